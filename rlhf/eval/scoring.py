"""Metrics of the evaluation: unbiased pass@k, answer extraction and equivalence, standard errors."""

from __future__ import annotations

import math
import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / sqrt(n); 0 for n < 2)."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def last_number(text: str) -> str | None:
    """The last number in `text` (GSM8K-style answers: `#### 42` or a final number), commas removed."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def numbers_equal(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    try:
        return math.isclose(float(a), float(b), rel_tol=0, abs_tol=1e-6)
    except ValueError:
        return a.strip() == b.strip()


def math_equal(response: str, gold: str) -> bool:
    """Whether the response's final answer equals `gold` mathematically (math-verify: LaTeX, fractions,
    sets, \\boxed{...})."""
    from math_verify import parse, verify

    return bool(verify(parse(gold), parse(response)))
