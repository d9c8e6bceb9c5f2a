"""An LLM judge's prompt and verdict, as text: the template's placeholders, a sample's judge prompt, and the
number a verdict gives (`reward.judge`; the engines and the run's side are rlhf/driver/rl/reward_judge.py).

A verdict is untrusted model output: it becomes a finite float or None (malformed), never anything else."""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Mapping
from typing import Any

PLACEHOLDERS = ("prompt", "response", "ground_truth")
_FIRST_WORD = re.compile(r"\s*([^\W_]+)")


def template_fields(template: str) -> list[str]:
    """The placeholders `template` uses, in order. ValueError for a stray brace, or a field that is not a bare
    PLACEHOLDERS name (no attribute or index access, conversion or format spec)."""
    names = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if name not in PLACEHOLDERS or spec or conversion:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise ValueError(f"{shown} is not one of {', '.join('{' + p + '}' for p in PLACEHOLDERS)} "
                             "(write a literal brace as {{ or }})")
        names.append(name)
    return names


def as_text(x: Any) -> str:
    """A prompt, response or ground truth as the judge reads it: text as it is, chat messages as
    `role: content` lines, None as nothing, anything else as JSON."""
    if isinstance(x, str):
        return x
    if x is None:
        return ""
    if isinstance(x, list) and all(isinstance(m, dict) and "content" in m for m in x):
        return "\n".join(f"{m.get('role', 'user')}: {m['content']}" for m in x)
    return json.dumps(x, default=str)


def judge_prompt(template: str, prompt: Any, response: Any, ground_truth: Any) -> str:
    """`template` with the sample's fields in place (the template is checked by `template_fields`; the
    sample's text is never parsed as a template)."""
    return template.format(prompt=as_text(prompt), response=as_text(response), ground_truth=as_text(ground_truth))


def parse_verdict(text: str, pattern: re.Pattern[str], choices: Mapping[str, float]) -> float | None:
    """The score a verdict gives, or None when it is malformed. With `choices`: the score of the verdict's
    first word (letters and digits; case-insensitive); else the first match of `pattern`: its first capture
    group (the whole match without one) as a float. A non-finite number is malformed."""
    if choices:
        word = _FIRST_WORD.match(text)
        lowered = {k.lower(): float(v) for k, v in choices.items()}
        value = lowered.get(word.group(1).lower()) if word else None
    else:
        match = pattern.search(text)
        if match is None:
            return None
        try:
            value = float(match.group(1) if pattern.groups else match.group(0))
        except (TypeError, ValueError):  # TypeError: the group did not take part in the match
            return None
    return value if value is not None and math.isfinite(value) else None


def choice_key_error(key: str) -> str | None:
    """Why `key` cannot be a choice (a verdict's first word is letters and digits), or None."""
    return None if re.fullmatch(r"[^\W_]+", key) else f"{key!r} is not one word of letters and digits"
