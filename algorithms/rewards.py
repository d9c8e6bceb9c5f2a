"""Rule-based reward functions ``fn(prompt, response, ground_truth) -> float``, registered by name.

Every reward also has a detailed form returning ``RewardResult(score, reason)``: use
``score_with_reason(name_or_fn, prompt, response, ground_truth)``. Reward functions never raise on
bad inputs (``None``, empty strings, a non-numeric ground truth, ...): they score 0 and say why. An
exception escaping a user-registered function is caught the same way (score 0, reason ``error: ...``)
and logged, so one odd sample cannot stop a training run.

Built-ins: ``math_exact_match`` (alias ``exact_match``), ``text_exact_match``, ``boxed_format``,
``think_answer_format``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = [
    "RewardResult",
    "RewardFn",
    "UnknownRewardError",
    "register_reward",
    "get_reward_fn",
    "list_rewards",
    "score_with_reason",
    "extract_answer",
    "parse_number",
    "math_exact_match",
    "text_exact_match",
    "format_reward",
    "combine_rewards",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardResult:
    score: float
    reason: str


class UnknownRewardError(KeyError, ValueError):
    """Unknown reward name (both a ``KeyError`` and a ``ValueError``)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class RewardFn:
    """A reward callable: ``fn(prompt, response, ground_truth) -> float``, plus ``.with_reason(...)``.

    Wraps ``impl`` returning a ``RewardResult``, a ``(score, reason)`` pair or a number.
    """

    def __init__(self, impl: Callable[[Any, Any, Any], Any], name: str | None = None) -> None:
        self.impl = impl
        self.name: str = name or str(getattr(impl, "__name__", "reward"))
        self.__doc__ = getattr(impl, "__doc__", None)

    def with_reason(self, prompt: Any, response: Any, ground_truth: Any) -> RewardResult:
        try:
            out = self.impl(prompt, response, ground_truth)
        except Exception as exc:  # noqa: BLE001 - a reward must not crash training; see module doc
            logger.warning("reward %s raised %s: %s", self.name, type(exc).__name__, exc)
            return RewardResult(0.0, f"error: {type(exc).__name__}: {exc}")
        return _to_result(out)

    def __call__(self, prompt: Any, response: Any, ground_truth: Any) -> float:
        return self.with_reason(prompt, response, ground_truth).score

    def __repr__(self) -> str:
        return f"RewardFn({self.name!r})"


def _to_result(out: Any) -> RewardResult:
    if isinstance(out, RewardResult):
        return out
    if isinstance(out, tuple) and len(out) == 2:
        return RewardResult(float(out[0]), str(out[1]))
    return RewardResult(float(out), "ok")


_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[Callable[..., Any]], RewardFn]:
    """Decorator: register ``fn(prompt, response, ground_truth)`` (returning a float, a
    ``RewardResult`` or ``(score, reason)``) under ``name``; returns the ``RewardFn``.
    Re-registering a name raises ``ValueError``."""

    def deco(fn: Callable[..., Any]) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is already registered")
        rf = fn if isinstance(fn, RewardFn) else RewardFn(fn, name)
        _REGISTRY[name] = rf
        return rf

    return deco


def list_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward_fn(name: str) -> RewardFn:
    """The reward registered as ``name`` (callable returning a float); ``UnknownRewardError``
    (a ``KeyError`` and ``ValueError``) listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownRewardError(f"unknown reward {name!r}; known: {', '.join(list_rewards())}") from None


def _resolve(name_or_fn: str | Callable[..., Any]) -> RewardFn:
    if isinstance(name_or_fn, str):
        return get_reward_fn(name_or_fn)
    if isinstance(name_or_fn, RewardFn):
        return name_or_fn
    return RewardFn(name_or_fn)


def score_with_reason(
    name_or_fn: str | Callable[..., Any], prompt: Any, response: Any, ground_truth: Any
) -> RewardResult:
    """Score one sample with a registered name or any reward callable; returns ``RewardResult``."""
    return _resolve(name_or_fn).with_reason(prompt, response, ground_truth)


# ------------------------------------------------------------------------------------ answer extraction

# a number: optional minus (not part of a word or an expression like "3-5"), thousands groups or plain
# digits, optional decimals; or a bare decimal like ".5"; optionally a simple fraction "3/4"
_NUMBER = r"(?<![\w.])-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:/\d+(?!\.\d))?"
_NUMBER_RE = re.compile(_NUMBER)
_FRAC_RE = re.compile(r"^(-?)\\d?frac\{([^{}]+)\}\{([^{}]+)\}$")
_TEXT_RE = re.compile(r"\\(?:text|mbox|mathrm)\{([^{}]*)\}")
_ASSIGN_RE = re.compile(r"^[A-Za-z]\w*\s*=\s*(.+)$")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), with nested braces; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced


def extract_answer(text: str) -> tuple[str | None, str]:
    """The final answer string of ``text`` and where it came from (``boxed``, ``####`` or ``last number``).

    Priority: the last ``\\boxed{}``; else the text after the last ``####`` (its first number if it
    has one); else the last number in the text. ``(None, why)`` when nothing is found.
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip(), "boxed"
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        m = _NUMBER_RE.search(tail)
        return (m.group(0) if m else tail), "####"
    found = _NUMBER_RE.findall(text)
    if found:
        return found[-1], "last number"
    return None, "no answer found"


def parse_number(s: str) -> Fraction | None:
    """Exact value of a numeric answer string, or None.

    Accepts integers, decimals, thousands commas (``1,000``), a leading ``$``, a trailing ``%`` or
    ``.``, simple fractions (``3/4``, ``\\frac{3}{4}``), LaTeX spacing, redundant braces, unit text
    (``5 \\text{cm}``) and an assignment ``x = 5``.
    """
    t = s.strip().strip("$").strip()
    t = t.replace("\\!", "").replace("\\,", "").replace("{,}", ",").replace("\\%", "%").replace("\\$", "")
    t = _TEXT_RE.sub(lambda m: m.group(1) if re.search(r"\d", m.group(1)) else "", t)  # units
    t = t.strip().rstrip(".").rstrip("%").strip()
    while t.startswith("{") and t.endswith("}"):
        t = t[1:-1].strip()
    m = _ASSIGN_RE.match(t)
    if m:
        t = m.group(1).strip()
    m = _FRAC_RE.match(t.replace(" ", ""))
    if m:
        num, den = parse_number(m.group(2)), parse_number(m.group(3))
        if num is None or den is None or den == 0:
            return None
        value = num / den
        return -value if m.group(1) else value
    if not re.fullmatch(_NUMBER, t):
        return None
    t = t.replace(",", "")
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def _fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):g}"


def _math_exact_match(prompt: Any, response: Any, ground_truth: Any) -> RewardResult:
    """1.0 iff the response's final answer equals the ground truth numerically.

    The answer is extracted by ``extract_answer`` (last ``\\boxed{}``, else after ``####``, else the last
    number) and compared exactly as a fraction, so ``"5.0" == "5"`` and ``"1,000" == "1000"``. The ground
    truth may be a number, a bare answer, or a full solution ending in ``#### 42`` / ``\\boxed{42}``.
    """
    if not isinstance(response, str) or not response.strip():
        return RewardResult(0.0, "empty response")
    if ground_truth is None or (isinstance(ground_truth, str) and not ground_truth.strip()):
        return RewardResult(0.0, "no ground truth")
    if isinstance(ground_truth, bool):
        return RewardResult(0.0, f"ground truth is not numeric: {ground_truth!r}")
    if isinstance(ground_truth, int | float):
        try:  # str() keeps the decimal a user wrote: Fraction("0.1") == 1/10, Fraction(0.1) != 1/10
            gt_value: Fraction | None = Fraction(str(ground_truth))
        except (ValueError, OverflowError):
            gt_value = None
    else:
        gt_value = parse_number(str(ground_truth))
        if gt_value is None:
            gt_text, _ = extract_answer(str(ground_truth))
            gt_value = parse_number(gt_text) if gt_text is not None else None
    if gt_value is None:
        return RewardResult(0.0, f"ground truth is not numeric: {str(ground_truth)[:50]!r}")
    answer, source = extract_answer(response)
    if answer is None:
        return RewardResult(0.0, "no answer found in response")
    value = parse_number(answer)
    if value is None:
        return RewardResult(0.0, f"{source} answer is not numeric: {answer[:50]!r}")
    if value == gt_value:
        return RewardResult(1.0, f"correct ({source}: {_fmt(value)})")
    return RewardResult(0.0, f"wrong ({source}: {_fmt(value)} != {_fmt(gt_value)})")


math_exact_match = register_reward("math_exact_match")(_math_exact_match)
_REGISTRY["exact_match"] = math_exact_match


def _text_exact_match(prompt: Any, response: Any, ground_truth: Any) -> RewardResult:
    """1.0 iff the response, stripped of surrounding whitespace and a final full stop, equals the ground
    truth ignoring case: one-word answers ("red", "2") of tasks whose answers are not all numbers."""
    if not isinstance(response, str) or not response.strip():
        return RewardResult(0.0, "empty response")
    if ground_truth is None or not str(ground_truth).strip():
        return RewardResult(0.0, "no ground truth")
    got, want = response.strip().rstrip(".").strip().lower(), str(ground_truth).strip().lower()
    if got == want:
        return RewardResult(1.0, "correct")
    return RewardResult(0.0, f"wrong ({got[:30]!r} != {want[:30]!r})")


text_exact_match = register_reward("text_exact_match")(_text_exact_match)


# ---------------------------------------------------------------------------------------- format rewards


def format_reward(
    pattern: str | re.Pattern[str], flags: int = re.DOTALL, mode: str = "search", score: float = 1.0
) -> RewardFn:
    """Reward factory: ``score`` if the response matches ``pattern``, else 0.

    ``mode`` is ``search`` (anywhere; anchor with ``^``/``$`` yourself), ``match`` (at the start) or
    ``fullmatch`` (the whole response). ``flags`` default to ``re.DOTALL`` so ``.`` spans lines.
    """
    if mode not in ("search", "match", "fullmatch"):
        raise ValueError(f"unknown format mode {mode!r}; known: search, match, fullmatch")
    rx = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern, flags)
    return RewardFn(_FormatMatch(rx, mode, float(score)), f"format_reward({rx.pattern!r})")


@dataclass(frozen=True)
class _FormatMatch:  # a class rather than a closure, so the reward pickles (multiprocessing pools)
    rx: re.Pattern[str]
    mode: str
    score: float

    def __call__(self, prompt: Any, response: Any, ground_truth: Any) -> RewardResult:
        if not isinstance(response, str) or not response:
            return RewardResult(0.0, "empty response")
        if getattr(self.rx, self.mode)(response):
            return RewardResult(self.score, "format ok")
        return RewardResult(0.0, f"format mismatch ({self.rx.pattern[:60]!r})")


register_reward("boxed_format")(format_reward(r"\\boxed\{.*\}"))
register_reward("think_answer_format")(
    format_reward(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", mode="fullmatch")
)


# -------------------------------------------------------------------------------------------- combinator


def combine_rewards(weights: Mapping[str | Callable[..., Any], float]) -> RewardFn:
    """Weighted sum ``sum_i w_i * reward_i(prompt, response, ground_truth)``.

    Keys are registered names or reward callables; the reason lists each part. Unknown names raise
    ``UnknownRewardError`` here, at construction time.
    """
    if not weights:
        raise ValueError("combine_rewards needs at least one reward")
    parts = tuple((_resolve(k), float(w)) for k, w in weights.items())
    return RewardFn(_WeightedSum(parts), "combine(" + ", ".join(fn.name for fn, _ in parts) + ")")


@dataclass(frozen=True)
class _WeightedSum:
    parts: tuple[tuple[RewardFn, float], ...]

    def __call__(self, prompt: Any, response: Any, ground_truth: Any) -> RewardResult:
        total = 0.0
        reasons = []
        for fn, w in self.parts:
            res = fn.with_reason(prompt, response, ground_truth)
            total += w * res.score
            reasons.append(f"{fn.name}={res.score:g}*{w:g} ({res.reason})")
        return RewardResult(total, "; ".join(reasons))
