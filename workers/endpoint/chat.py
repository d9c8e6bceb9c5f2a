"""OpenAI chat messages to prompt token ids (the model's chat template), and a sampled completion back to an
OpenAI message with `tool_calls` when the model wrote tool calls (workers/agent/toolcalls.py).

An assistant message that comes back with tool calls this session returned renders as the text the model
sampled (looked up by tool-call id), so the next prompt continues the conversation as the model wrote it.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from workers.agent.toolcalls import CLOSE, OPEN, parse_tool_calls
from workers.endpoint.protocol import Message
from workers.endpoint.sessions import Session

_BLOCK = re.compile(re.escape(OPEN) + r".*?" + re.escape(CLOSE), re.DOTALL)


class BadRequest(ValueError):
    """A request the endpoint refuses with a 400 (the message goes back to the agent)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def _text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}: only text content parts are supported", param="messages")
        parts.append(part["text"])
    return "".join(parts)


def template_messages(messages: list[Message], session: Session) -> list[dict[str, str]]:
    """The messages as the chat template takes them: text content; an assistant turn with tool calls as the
    text the model sampled (or, for calls it did not write here, as `<tool_call>` blocks)."""
    out = []
    for i, m in enumerate(messages):
        text = _text(m.content, f"messages[{i}]")
        if m.role == "assistant" and m.tool_calls:
            raw = next((session.raw_text[c.id] for c in m.tool_calls if c.id in session.raw_text), None)
            if raw is not None:
                text = raw
            else:
                for c in m.tool_calls:
                    args = c.function.arguments
                    if isinstance(args, str):
                        try:
                            args = json.loads(args)
                        except ValueError:
                            raise BadRequest(f"messages[{i}]: tool call arguments are not JSON",
                                             param="messages") from None
                    text += OPEN + json.dumps({"name": c.function.name, "arguments": args}) + CLOSE
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def render(tokenizer: Any, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None) -> list[int]:
    """Prompt ids: the chat template with the generation prompt, tokenised as the rollout does
    (workers/rollout/prompts.normalise)."""
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template that refuses these messages: the agent's error
        raise BadRequest(f"the chat template refused the messages: {type(e).__name__}: {e}",
                         param="messages") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def assistant_message(text: str) -> tuple[dict[str, Any], list[str]]:
    """The OpenAI message for sampled `text`, and the ids of its tool calls (empty: none parsed). Calls that
    do not parse stay in the content as text, for the agent to handle."""
    calls = [c for c in parse_tool_calls(text) if c.error is None]
    if not calls:
        return {"role": "assistant", "content": text}, []
    ids = [f"call_{uuid.uuid4().hex[:24]}" for _ in calls]
    content = _BLOCK.sub("", text).strip()
    return {"role": "assistant", "content": content or None,
            "tool_calls": [{"id": i, "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                           for i, c in zip(ids, calls)]}, ids
