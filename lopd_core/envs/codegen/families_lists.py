"""Families on lists and small algorithms. Reference functions must stay standalone."""

from __future__ import annotations

from .family import Family, int_list, size, words


def sum_evens(xs):
    return sum(x for x in xs if x % 2 == 0)


def running_sum(xs):
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def second_largest(xs):
    values = sorted(set(xs))
    return values[-2] if len(values) >= 2 else None


def rotate(xs, k):
    if not xs:
        return []
    k %= len(xs)
    return xs[-k:] + xs[:-k] if k else list(xs)


def dedupe(xs):
    seen, out = set(), []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def chunks(xs, n):
    return [xs[i : i + n] for i in range(0, len(xs), n)]


def flatten(xss):
    return [x for xs in xss for x in xs]


def binary_search(xs, target):
    lo, hi = 0, len(xs) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if xs[mid] == target:
            return mid
        if xs[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1


def max_subarray(xs):
    best = cur = xs[0]
    for x in xs[1:]:
        cur = max(x, cur + x)
        best = max(best, cur)
    return best


def balanced(s):
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for c in s:
        if c in "([{":
            stack.append(c)
        elif c in pairs and (not stack or stack.pop() != pairs[c]):
            return False
    return not stack


def merge_sorted(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]


def common_prefix(ws):
    if not ws:
        return ""
    prefix = ws[0]
    for w in ws[1:]:
        while not w.startswith(prefix):
            prefix = prefix[:-1]
    return prefix


def transpose(m):
    return [list(row) for row in zip(*m)]


def _distinct_sorted(r, lv):
    return sorted(r.sample(range(-50 if lv > 1 else 0, 60), size(r, lv)))


def _search_args(r, lv):
    xs = _distinct_sorted(r, lv)
    return [xs, r.choice(xs) if r.random() < 0.6 else r.randint(-60, 70)]


def _brackets(r, lv):
    s = ""
    for _ in range(2 + 2 * lv):
        o, c = r.choice(["()", "[]", "{}"][:lv])
        s = r.choice([o + s + c, s + o + c, s + c, o + s])
    return [s]


def _matrix(r, lv):
    cols = r.randint(1, 2 + lv)
    return [[[r.randint(0, 9) for _ in range(cols)] for _ in range(r.randint(1, 2 + lv))]]


def _prefixed(r, lv):
    stem = r.choice(["inter", "pre", "con", "tr", ""])
    return [[stem + w for w in words(r, lv)]]


FAMILIES = [
    Family(
        "sum_evens",
        "lists",
        "train",
        sum_evens,
        "Return the sum of the even numbers in the list of integers xs.",
        lambda r, lv: [int_list(r, lv)],
        edge_cases=([[]], [[-3, -2, 7]]),
    ),
    Family(
        "running_sum",
        "lists",
        "train",
        running_sum,
        "Return the list of running totals of xs: element i is xs[0] + ... + xs[i].",
        lambda r, lv: [int_list(r, lv)],
        edge_cases=([[]],),
    ),
    Family(
        "second_largest",
        "lists",
        "train",
        second_largest,
        "Return the second largest distinct value in xs, or None if xs has fewer than two distinct values.",
        lambda r, lv: [int_list(r, lv, hi=5 if lv > 1 else 20)],
        edge_cases=([[4, 4]], [[]], [[1, 9, 9]]),
    ),
    Family(
        "rotate",
        "lists",
        "train",
        rotate,
        "Return xs rotated k places to the right (k >= 0; the last k elements move to the front).",
        lambda r, lv: [int_list(r, lv), r.randint(0, 3 * lv)],
        edge_cases=([[], 3], [[1, 2], 0]),
    ),
    Family(
        "dedupe",
        "lists",
        "train",
        dedupe,
        "Return xs without repeated elements, keeping the first occurrence of each, in order.",
        lambda r, lv: [int_list(r, lv, lo=0, hi=4 + lv)],
        edge_cases=([[]],),
    ),
    Family(
        "chunks",
        "lists",
        "train",
        chunks,
        "Split xs into consecutive pieces of length n (n >= 1; the last may be shorter); return them as a "
        "list of lists.",
        lambda r, lv: [int_list(r, lv), r.randint(1, 2 + lv)],
        edge_cases=([[], 2], [[1, 2, 3], 5]),
    ),
    Family(
        "flatten",
        "lists",
        "train",
        flatten,
        "Return the concatenation of the lists in xss (one level of nesting).",
        lambda r, lv: [[int_list(r, lv) for _ in range(r.randint(1, 1 + lv))]],
        edge_cases=([[]], [[[], [1]]]),
    ),
    Family(
        "binary_search",
        "algorithms",
        "train",
        binary_search,
        "xs is sorted ascending with distinct values: return the index of target in xs, or -1 if absent.",
        _search_args,
        edge_cases=([[], 3], [[5], 5]),
    ),
    Family(
        "max_subarray",
        "algorithms",
        "ood",
        max_subarray,
        "Return the largest sum of a non-empty contiguous sub-list of the non-empty list xs.",
        lambda r, lv: [int_list(r, max(lv, 2))],
        edge_cases=([[-4, -2, -7]], [[3]]),
    ),
    Family(
        "balanced",
        "algorithms",
        "ood",
        balanced,
        "Return True if the brackets (), [] and {} in s are balanced and properly nested, else False.",
        lambda r, lv: [_brackets(r, lv)],
        edge_cases=([""], ["(]"], ["([)]"]),
    ),
    Family(
        "merge_sorted",
        "algorithms",
        "train",
        merge_sorted,
        "Merge the ascending lists a and b into one ascending list (keep duplicates).",
        lambda r, lv: [sorted(int_list(r, lv)), sorted(int_list(r, lv))],
        edge_cases=([[], [1]], [[2, 2], [2]]),
    ),
    Family(
        "common_prefix",
        "algorithms",
        "train",
        common_prefix,
        'Return the longest common prefix of the strings in ws ("" for an empty list).',
        _prefixed,
        edge_cases=([[]], [["same", "same"]]),
    ),
    Family(
        "transpose",
        "algorithms",
        "ood",
        transpose,
        "Return the transpose of the rectangular matrix m (a list of equal-length rows).",
        _matrix,
        edge_cases=([[[1, 2, 3]]],),
    ),
]
