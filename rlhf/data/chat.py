"""Conversations for SFT: ShareGPT / OpenAI records -> messages -> token ids + assistant mask.

Accepted records (one per jsonl line):
- OpenAI: `{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}`
- ShareGPT: `{"conversations": [{"from": "system"|"human"|"gpt"|"tool", "value": str}, ...]}` (also
  `user`/`assistant` as `from`), with an optional top-level `"system": str`.
Tool use (agent traces): an assistant turn may carry OpenAI `tool_calls`
(`[{"function": {"name", "arguments"}}]`, arguments an object or a JSON string); they are written into its
content as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format the agent loop
(workers/agent/toolcalls.py) parses, so SFT teaches exactly the text the rollout reads. `tool` turns (tool
results) are context, like user turns. A record's top-level `tools` (OpenAI function schemas, as in OpenAI's
fine-tuning format) go to the chat template as `apply_chat_template(tools=...)`, exactly as the rollout
renders its prompts (workers/rollout/prompts.py), so a trace is trained on the prompt the policy later sees.
The assistant mask marks the tokens of each assistant turn's content and its end-of-turn token: from the
template's `{% generation %}` markers when present, else by rendering each conversation prefix. Tool results,
user turns and the template's glue are never trained on.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from rlhf.errors import UserError

ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
OPEN_CALL, CLOSE_CALL = "<tool_call>", "</tool_call>"  # as workers/agent/toolcalls.py parses them
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def normalize_conversation(record: dict, where: str, need_assistant: bool = True) -> list[dict[str, str]]:
    """The record's turns as `[{"role", "content"}]`; a UserError naming `where` (file:line) if malformed
    (or, with `need_assistant`, without an assistant turn; a preference pair's prompt has none)."""
    if "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    else:
        raise UserError(f"{where}: expected a 'messages' (OpenAI) or 'conversations' (ShareGPT) list")
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: the conversation must be a non-empty list of turns")
    messages: list[dict[str, str]] = []
    system = record.get("system")
    if isinstance(system, str) and system:
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise UserError(f"{where}: turn {i} is {type(turn).__name__}, expected an object")
        role = turn.get(role_key, turn.get("role"))
        text = turn.get(text_key, turn.get("content"))
        if role in ROLE_MAP and ROLE_MAP[role] == "assistant" and turn.get("tool_calls"):
            text = (text or "") + _tool_call_text(turn["tool_calls"], f"{where}: turn {i}")
        if role not in ROLE_MAP:
            raise UserError(f"{where}: turn {i} has role {role!r}; expected one of {', '.join(ROLE_MAP)}")
        if not isinstance(text, str):
            raise UserError(f"{where}: turn {i} ({role}) has no string {text_key!r}")
        messages.append({"role": ROLE_MAP[role], "content": text})
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: the conversation has no assistant turn (nothing to train on)")
    return messages


def _tool_call_text(calls: Any, where: str) -> str:
    """OpenAI `tool_calls` as the `<tool_call>{json}</tool_call>` blocks the agent loop parses."""
    if not isinstance(calls, list):
        raise UserError(f"{where}: tool_calls must be a list")
    out = []
    for call in calls:
        fn = call.get("function", call) if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        args = fn.get("arguments", {}) if isinstance(fn, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            raise UserError(f"{where}: a tool call needs a string name and object arguments, got {call!r:.80}")
        out.append(OPEN_CALL + json.dumps({"name": name, "arguments": args}) + CLOSE_CALL)
    return "".join(out)


def conversation_tools(record: dict, where: str) -> list[dict] | None:
    """The record's `tools` (a list of function schemas), or None; a UserError naming `where` if malformed."""
    tools = record.get("tools")
    if tools is None:
        return None
    ok = isinstance(tools, list) and all(
        isinstance(t, dict) and isinstance(t.get("function", t), dict) and t.get("function", t).get("name")
        for t in tools)
    if not ok:
        raise UserError(f"{where}: 'tools' must be a list of function schemas ({{\"type\": \"function\", "
                        f"\"function\": {{\"name\", \"parameters\"}}}}), got {tools!r:.80}")
    return tools or None


def has_generation_markers(tokenizer) -> bool:
    """Whether the tokenizer's chat template marks assistant content with {% generation %}."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def check_chat_template(tokenizer) -> None:
    """UserError when the tokenizer cannot render conversations."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the tokenizer has no chat_template; SFT data needs one to render conversations")


def _render(tokenizer, messages: list[dict], **kwargs: Any) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    )


def tokenize_conversation(tokenizer, messages: list[dict[str, str]],
                          tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """(input ids, assistant mask) of the whole rendered conversation (with the `tools` schemas shown to the
    model); mask is 1 on trained tokens."""
    if has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
    return _mask_by_prefixes(tokenizer, messages, tools)


def _mask_by_prefixes(tokenizer, messages: list[dict[str, str]],
                      tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """Assistant mask for templates without generation markers: each assistant turn is the tokens between
    the render of the preceding turns plus the generation prompt and the render including that turn,
    cut after its last eos (so a trailing newline is not trained)."""
    ids = _render(tokenizer, messages, tools=tools)
    mask = [0] * len(ids)
    eos = tokenizer.eos_token_id
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], tools=tools, add_generation_prompt=True)) if i else 0
        upto = _render(tokenizer, messages[: i + 1], tools=tools)
        if upto != ids[: len(upto)] or start > len(upto):
            raise UserError(
                "the chat template does not render conversations prefix-consistently; add {% generation %} "
                "markers around assistant content to the template to compute the loss mask"
            )
        end = len(upto)
        turn = upto[start:end]
        if eos is not None and eos in turn:
            end = start + len(turn) - turn[::-1].index(eos)
        for t in range(start, end):
            mask[t] = 1
    return ids, mask


def encode_sft_record(
    tokenizer, record: dict, where: str, seq_length: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids int32, assistant mask uint8) truncated to seq_length + 1, or None when no assistant token is
    left to predict after truncation. A malformed record is a UserError naming `where`."""
    messages = normalize_conversation(record, where)
    ids, mask = tokenize_conversation(tokenizer, messages, conversation_tools(record, where))
    ids, mask = ids[: seq_length + 1], mask[: seq_length + 1]
    if not any(mask[1:]):
        return None
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)
