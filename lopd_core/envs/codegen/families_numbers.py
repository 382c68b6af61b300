"""Families on numbers: arithmetic, conditionals and loops. Reference functions must stay standalone."""

from __future__ import annotations

from .family import Family


def clamp(x, lo, hi):
    return max(lo, min(x, hi))


def digit_sum(n):
    return sum(int(d) for d in str(abs(n)))


def gcd(a, b):
    while b:
        a, b = b, a % b
    return a


def is_prime(n):
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def fizzbuzz(n):
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    return str(n)


def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result


def count_multiples(lo, hi, k):
    return sum(1 for x in range(lo, hi + 1) if x % k == 0)


def grade(score):
    if score >= 90:
        return "A"
    if score >= 80:
        return "B"
    if score >= 70:
        return "C"
    if score >= 60:
        return "D"
    return "F"


def leap_year(y):
    return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)


def sign_label(x):
    if x > 0:
        return "positive"
    if x < 0:
        return "negative"
    return "zero"


def triangle_type(a, b, c):
    x, y, z = sorted([a, b, c])
    if x <= 0 or x + y <= z:
        return "invalid"
    if x == z:
        return "equilateral"
    if x == y or y == z:
        return "isosceles"
    return "scalene"


def collatz_steps(n):
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def sum_of_squares(n):
    return sum(i * i for i in range(1, n + 1))


def is_power_of_two(n):
    return n > 0 and n & (n - 1) == 0


def _scale(level: int) -> int:
    return (10, 100, 10_000)[level - 1]


def _clamp_args(r, lv):
    lo = r.randint(-_scale(lv), _scale(lv))
    return [r.randint(-2 * _scale(lv), 2 * _scale(lv)), lo, lo + r.randint(0, _scale(lv))]


def _gcd_args(r, lv):
    g = r.randint(1, 12)
    return [g * r.randint(1, _scale(lv)), g * r.randint(1, _scale(lv))]


def _range_args(r, lv):
    lo = r.randint(-_scale(lv) if lv > 1 else 0, _scale(lv))
    return [lo, lo + r.randint(0, _scale(lv)), r.randint(1, 9)]


def _triangle_args(r, lv):
    a, b = r.randint(2, 9), r.randint(1, 9)
    return r.choice([[a] * 3, [r.randint(1, 9) for _ in range(3)], [a, a, b]])


FAMILIES = [
    Family(
        "clamp",
        "arithmetic",
        "train",
        clamp,
        "Return x limited to the range [lo, hi] (lo <= hi).",
        _clamp_args,
        edge_cases=([5, 5, 5], [-3, 0, 0]),
    ),
    Family(
        "digit_sum",
        "arithmetic",
        "train",
        digit_sum,
        "Return the sum of the decimal digits of the integer n (ignore its sign).",
        lambda r, lv: [r.randint(-_scale(lv) * 10 if lv > 1 else 0, _scale(lv) * 10)],
        edge_cases=([0], [-909]),
    ),
    Family(
        "gcd",
        "arithmetic",
        "train",
        gcd,
        "Return the greatest common divisor of the non-negative integers a and b (gcd(0, 0) is 0).",
        _gcd_args,
        edge_cases=([0, 7], [0, 0]),
    ),
    Family(
        "is_prime",
        "arithmetic",
        "train",
        is_prime,
        "Return True if the integer n is a prime number, else False.",
        lambda r, lv: [r.randint(-5 if lv > 1 else 2, _scale(lv) * 3)],
        edge_cases=([1], [0], [97]),
    ),
    Family(
        "fizzbuzz",
        "arithmetic",
        "train",
        fizzbuzz,
        'Return "Fizz" if n is divisible by 3, "Buzz" if by 5, "FizzBuzz" if by both, else str(n).',
        lambda r, lv: [r.randint(1, _scale(lv))],
        edge_cases=([15], [0]),
    ),
    Family(
        "factorial",
        "loops",
        "train",
        factorial,
        "Return n! for a non-negative integer n (0! is 1).",
        lambda r, lv: [r.randint(1, 5 * lv)],
        edge_cases=([0], [1]),
    ),
    Family(
        "count_multiples",
        "loops",
        "ood",
        count_multiples,
        "Return how many integers x with lo <= x <= hi are divisible by k (k > 0).",
        _range_args,
        edge_cases=([5, 4, 3], [0, 0, 7]),
    ),
    Family(
        "grade",
        "conditionals",
        "train",
        grade,
        'Return the letter grade for a score: "A" for 90 or more, "B" for 80-89, "C" for 70-79, '
        '"D" for 60-69, else "F".',
        lambda r, lv: [r.randint(0, 100)],
        edge_cases=([90], [59], [80]),
    ),
    Family(
        "leap_year",
        "conditionals",
        "train",
        leap_year,
        "Return True if year y is a leap year in the Gregorian calendar (divisible by 4, except centuries "
        "not divisible by 400).",
        lambda r, lv: [r.choice([r.randint(1, 2100), 4 * r.randint(1, 500), 100 * r.randint(1, 30)])],
        edge_cases=([1900], [2000]),
    ),
    Family(
        "sign_label",
        "conditionals",
        "train",
        sign_label,
        'Return "positive", "negative" or "zero" according to the sign of the number x.',
        lambda r, lv: [r.randint(-_scale(lv), _scale(lv)) if lv < 3 else r.uniform(-5, 5)],
        edge_cases=([0],),
    ),
    Family(
        "triangle_type",
        "conditionals",
        "ood",
        triangle_type,
        'Return "invalid" if sides a, b, c cannot form a triangle (a side <= 0, or the two shorter sum to no '
        'more than the longest), else "equilateral", "isosceles" or "scalene".',
        _triangle_args,
        edge_cases=([1, 2, 3], [0, 4, 4], [5, 3, 5]),
    ),
    Family(
        "collatz_steps",
        "loops",
        "train",
        collatz_steps,
        "Return how many Collatz steps (n -> n/2 if even, else 3n+1) it takes to reach 1 from n >= 1.",
        lambda r, lv: [r.randint(1, _scale(lv))],
        edge_cases=([1], [27]),
    ),
    Family(
        "sum_of_squares",
        "loops",
        "train",
        sum_of_squares,
        "Return 1*1 + 2*2 + ... + n*n for an integer n (0 when n < 1).",
        lambda r, lv: [r.randint(1, _scale(lv))],
        edge_cases=([0], [-4]),
    ),
    Family(
        "is_power_of_two",
        "loops",
        "train",
        is_power_of_two,
        "Return True if the integer n is a power of two (1, 2, 4, ...), else False.",
        lambda r, lv: [r.choice([2 ** r.randint(0, 4 * lv), r.randint(-_scale(lv), _scale(lv))])],
        edge_cases=([0], [1], [-8]),
    ),
]
