"""Families on strings and dictionaries. Reference functions must stay standalone."""

from __future__ import annotations

import string

from .family import Family, sentence, word, words


def reverse_words(s):
    return " ".join(s.split()[::-1])


def count_vowels(s):
    return sum(1 for c in s.lower() if c in "aeiou")


def is_palindrome(s):
    t = [c.lower() for c in s if c.isalnum()]
    return t == t[::-1]


def capitalize_words(s):
    return " ".join(w[:1].upper() + w[1:] for w in s.split(" "))


def run_length(s):
    out = []
    for c in s:
        if out and out[-1][0] == c:
            out[-1][1] += 1
        else:
            out.append([c, 1])
    return "".join(c + str(n) for c, n in out)


def caesar(s, k):
    out = ""
    for c in s:
        if c.islower():
            c = chr((ord(c) - 97 + k) % 26 + 97)
        out += c
    return out


def longest_word(s):
    best = ""
    for w in s.split():
        if len(w) > len(best):
            best = w
    return best


def word_counts(s):
    counts = {}
    for w in s.lower().split():
        counts[w] = counts.get(w, 0) + 1
    return counts


def invert(d):
    return {v: k for k, v in d.items()}


def merge_counts(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def group_by_first(ws):
    groups = {}
    for w in ws:
        groups.setdefault(w[0], []).append(w)
    return groups


def key_of_max(d):
    best = None
    for k in sorted(d):
        if best is None or d[k] > d[best]:
            best = k
    return best


def _palindromish(r, lv):
    w = word(r, lv, "abc")
    if r.random() < 0.5:
        w = w + w[::-1]
    if lv >= 3:
        w = " ".join([w[: len(w) // 2].upper(), w[len(w) // 2 :]]) + r.choice(["!", "", "?"])
    return [w]


def _counts(r, lv):
    return {k: r.randint(1, 9) for k in r.sample(string.ascii_lowercase[: 4 + lv], r.randint(1, 2 + lv))}


FAMILIES = [
    Family(
        "reverse_words",
        "strings",
        "train",
        reverse_words,
        "Return the words of s (separated by whitespace) in reverse order, joined by single spaces.",
        lambda r, lv: [sentence(r, lv) if lv < 3 else "  ".join(words(r, lv))],
        edge_cases=([""], ["one"]),
    ),
    Family(
        "count_vowels",
        "strings",
        "train",
        count_vowels,
        "Return how many characters of s are vowels (a, e, i, o, u, either case).",
        lambda r, lv: [sentence(r, lv)],
        edge_cases=([""], ["AEIOU xyz"]),
    ),
    Family(
        "is_palindrome",
        "strings",
        "train",
        is_palindrome,
        "Return True if s reads the same backwards, ignoring case and any character that is not a letter or digit.",
        _palindromish,
        edge_cases=([""], ["A man, a plan, a canal: Panama"]),
    ),
    Family(
        "capitalize_words",
        "strings",
        "train",
        capitalize_words,
        "Return s with the first letter of every space-separated word in upper case, the rest unchanged.",
        lambda r, lv: [sentence(r, lv).lower()],
        edge_cases=([""], ["a  b"]),
    ),
    Family(
        "run_length",
        "strings",
        "train",
        run_length,
        "Return the run-length encoding of s: each run of a repeated character becomes the character and the "
        'run length, e.g. "aaab" -> "a3b1".',
        lambda r, lv: ["".join(r.choice("ab" if lv == 1 else "abc") * r.randint(1, 3) for _ in range(2 + lv))],
        edge_cases=([""], ["z"]),
    ),
    Family(
        "caesar",
        "strings",
        "ood",
        caesar,
        "Return s with every lower-case letter shifted k places forward in the alphabet (wrapping from z to "
        "a); other characters stay as they are.",
        lambda r, lv: [sentence(r, lv), r.randint(0, 5 if lv == 1 else 30)],
        edge_cases=(["xyz", 3], ["Hi, there", 27]),
    ),
    Family(
        "longest_word",
        "strings",
        "train",
        longest_word,
        'Return the longest whitespace-separated word of s (the first one on ties; "" if there is none).',
        lambda r, lv: [sentence(r, lv)],
        edge_cases=([""], ["ab cd"]),
    ),
    Family(
        "word_counts",
        "dicts",
        "train",
        word_counts,
        "Return a dict mapping each lower-cased whitespace-separated word of s to how often it occurs.",
        lambda r, lv: [sentence(r, lv) + " " + sentence(r, lv)],
        edge_cases=([""],),
    ),
    Family(
        "invert",
        "dicts",
        "train",
        invert,
        "Return the inverse of the dict d: each value maps to its key (the values are distinct strings).",
        lambda r, lv: [{str(i): w for i, w in enumerate(dict.fromkeys(words(r, lv)))}],
        edge_cases=([{}],),
    ),
    Family(
        "merge_counts",
        "dicts",
        "ood",
        merge_counts,
        "Return a new dict with every key of the dicts a and b; a key in both maps to the sum of its counts.",
        lambda r, lv: [_counts(r, lv), _counts(r, lv)],
        edge_cases=([{}, {"a": 1}], [{}, {}]),
    ),
    Family(
        "group_by_first",
        "dicts",
        "train",
        group_by_first,
        "Return a dict mapping each first letter to the list of words of ws starting with it, in their order.",
        lambda r, lv: [words(r, lv)],
        edge_cases=([[]],),
    ),
    Family(
        "key_of_max",
        "dicts",
        "train",
        key_of_max,
        "Return the key of d with the largest value (the smallest such key on ties; None for an empty dict).",
        lambda r, lv: [_counts(r, lv)],
        edge_cases=([{}], [{"b": 2, "a": 2}]),
    ),
]
