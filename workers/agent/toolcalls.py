"""Tool calls as chat models write them (Qwen's and Hermes' templates): a JSON object
`{"name": ..., "arguments": {...}}` inside `<tool_call>...</tool_call>`. Model output is untrusted: anything
malformed becomes a `ToolCall` with an `error`, never an exception."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
MAX_CALL_CHARS = 16_384


@dataclass
class ToolCall:
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the call could not be parsed ("malformed", "no name", ...)


def parse_tool_calls(text: str, max_calls: int = 8) -> list[ToolCall]:
    """Every `<tool_call>` block in `text`, in order (at most `max_calls`); an unclosed block is malformed."""
    calls = [_parse_one(body) for body in _CALL.findall(text)[:max_calls]]
    tail = text[text.rfind(CLOSE) + len(CLOSE):] if CLOSE in text else text
    if OPEN in tail and len(calls) < max_calls:
        calls.append(ToolCall(error="malformed: <tool_call> without </tool_call>"))
    return calls


def _parse_one(body: str) -> ToolCall:
    if len(body) > MAX_CALL_CHARS:
        return ToolCall(error=f"malformed: call longer than {MAX_CALL_CHARS} characters")
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return ToolCall(error=f"malformed: not JSON ({e.msg})")
    if not isinstance(obj, dict):
        return ToolCall(error="malformed: expected a JSON object with name and arguments")
    name, args = obj.get("name"), obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return ToolCall(str(name or ""), error="bad arguments: not a JSON object")
    if not isinstance(name, str) or not name:
        return ToolCall(error="malformed: no tool name")
    if not isinstance(args, dict):
        return ToolCall(name, error="bad arguments: not a JSON object")
    return ToolCall(name, args)
