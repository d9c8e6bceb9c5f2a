"""Conversations for SFT: ShareGPT / OpenAI records -> messages -> token ids + assistant mask.

Accepted records (one per jsonl line):
- OpenAI: `{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`
- ShareGPT: `{"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}` (also
  `user`/`assistant` as `from`), with an optional top-level `"system": str`.
The assistant mask marks the tokens of each assistant turn's content and its end-of-turn token: from the
template's `{% generation %}` markers when present, else by rendering each conversation prefix.
"""

from __future__ import annotations

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
}
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
        if role not in ROLE_MAP:
            raise UserError(f"{where}: turn {i} has role {role!r}; expected one of {', '.join(ROLE_MAP)}")
        if not isinstance(text, str):
            raise UserError(f"{where}: turn {i} ({role}) has no string {text_key!r}")
        messages.append({"role": ROLE_MAP[role], "content": text})
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: the conversation has no assistant turn (nothing to train on)")
    return messages


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


def tokenize_conversation(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(input ids, assistant mask) of the whole rendered conversation; mask is 1 on trained tokens."""
    if has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
    return _mask_by_prefixes(tokenizer, messages)


def _mask_by_prefixes(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Assistant mask for templates without generation markers: each assistant turn is the tokens between
    the render of the preceding turns plus the generation prompt and the render including that turn,
    cut after its last eos (so a trailing newline is not trained)."""
    ids = _render(tokenizer, messages)
    mask = [0] * len(ids)
    eos = tokenizer.eos_token_id
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], add_generation_prompt=True)) if i else 0
        upto = _render(tokenizer, messages[: i + 1])
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
    ids, mask = tokenize_conversation(tokenizer, messages)
    ids, mask = ids[: seq_length + 1], mask[: seq_length + 1]
    if not any(mask[1:]):
        return None
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)
