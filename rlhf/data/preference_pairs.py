"""Preference pairs for DPO and the reward model: `PairDataset` (jsonl), `collate_pairs`, `scored_pairs`.

Accepted records (one per jsonl line):
- chat: `{"messages": [prompt turns], "chosen": answer, "rejected": answer}`; an answer is a string or a list
  of assistant messages (TRL's conversational form, `[{"role": "assistant", "content": str}]`);
- text: `{"prompt": str, "chosen": str, "rejected": str}`; the prompt becomes one user turn.
Each answer is appended to the prompt as an assistant turn and rendered with the chat template, with the SFT
stage's masking (`rlhf.data.chat`): the loss covers the answer's tokens and its end-of-turn token, never the
prompt (also not assistant turns inside a multi-turn prompt). A pair is truncated to seq_length + 1 ids per
side; one whose chosen or rejected answer has no token left is skipped (`num_skipped`).

Bad input is a UserError naming file:line: a missing or non-string field, an empty answer, chosen equal to
rejected.

Item: `{"chosen": sft item, "rejected": sft item}` (keys of `rlhf.data.sft.sample_tensors`). `collate_pairs`
gives one row per pair: `chosen_<k>` and `rejected_<k>` for k in tokens, labels, loss_mask, position_ids,
each [B, seq_length] (the layout of `workers.roles.dpo_step`). `scored_pairs` turns that batch into the
reward model's (`workers.roles.reward_model`): each answer's whole sequence, prompt through the answer's end of
turn (the last trained token; a chat template's text after it is not scored), as `<side>_input_ids` and
`<side>_attention_mask` [B, seq_length + 1], right-padded with the pad id.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf.data.chat import check_chat_template, normalize_conversation, tokenize_conversation
from rlhf.data.jsonl import check_input_file, read_jsonl
from rlhf.data.sft import collate_sft, sample_tensors
from rlhf.data.tokenizer import load_tokenizer, pad_id
from rlhf.errors import UserError

SIDES = ("chosen", "rejected")


def _answer(record: dict, side: str, where: str) -> str:
    """The text of one answer; UserError when missing, malformed or empty."""
    if side not in record:
        raise UserError(f"{where}: missing key {side!r} (a preference pair needs 'chosen' and 'rejected')")
    value = record[side]
    if isinstance(value, list):  # [{"role": "assistant", "content": ...}]
        if not value or not all(isinstance(m, dict) and m.get("role") == "assistant"
                                and isinstance(m.get("content"), str) for m in value):
            raise UserError(f"{where}: {side!r} must be a string or a list of assistant messages")
        value = "".join(m["content"] for m in value)
    if not isinstance(value, str):
        raise UserError(f"{where}: {side!r} is {type(value).__name__}, expected a string")
    if not value.strip():
        raise UserError(f"{where}: the {side} answer is empty")
    return value


def parse_pair(record: dict, where: str) -> tuple[list[dict[str, str]], str, str]:
    """(prompt messages, chosen text, rejected text) of one record; UserError naming `where` when bad."""
    if "messages" in record or "conversations" in record:
        prompt = normalize_conversation(record, where, need_assistant=False)
    elif "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            raise UserError(f"{where}: 'prompt' must be a non-empty string")
        prompt = [{"role": "user", "content": record["prompt"]}]
    else:
        raise UserError(f"{where}: expected 'messages' (chat prompt turns) or 'prompt' (text) with 'chosen' "
                        f"and 'rejected'")
    chosen, rejected = (_answer(record, s, where) for s in SIDES)
    if chosen == rejected:
        raise UserError(f"{where}: chosen and rejected are the same answer (nothing to prefer)")
    return prompt, chosen, rejected


def encode_answer(tokenizer: Any, prompt: list[dict[str, str]], answer: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of prompt + answer; the mask covers only the answer turn (content and end of turn)."""
    ids, mask = tokenize_conversation(tokenizer, [*prompt, {"role": "assistant", "content": answer}])
    start = len(tokenizer.apply_chat_template(prompt, tokenize=True, return_dict=True,
                                              add_generation_prompt=True)["input_ids"])
    mask = [m if t >= start else 0 for t, m in enumerate(mask)]
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


class PairDataset(torch.utils.data.Dataset):
    """Preference pairs from a jsonl file; items and layout in the module docstring."""

    def __init__(self, path: str | Path, tokenizer: Any, seq_length: int) -> None:
        self.path = str(check_input_file(path, "preference data file"))
        self.tokenizer = load_tokenizer(tokenizer)
        check_chat_template(self.tokenizer)
        self.seq_length = seq_length
        self.pad_id = pad_id(self.tokenizer)
        self.items: list[dict[str, dict[str, torch.Tensor]]] = []
        self.num_skipped = 0
        for lineno, rec in read_jsonl(self.path):
            prompt, chosen, rejected = parse_pair(rec, f"{self.path}:{lineno}")
            item = {}
            for side, text in zip(SIDES, (chosen, rejected), strict=True):
                ids, mask = encode_answer(self.tokenizer, prompt, text)
                ids, mask = ids[: seq_length + 1], mask[: seq_length + 1]
                if not mask[1:].any():
                    break
                item[side] = sample_tensors(ids, mask)
            if len(item) == 2:
                self.items.append(item)
            else:
                self.num_skipped += 1
        if not self.items:
            raise UserError(f"{self.path}: no preference pairs with answer tokens within seq_length {seq_length}")
        if self.num_skipped:
            warnings.warn(f"{self.path}: skipped {self.num_skipped} pairs with an answer past seq_length "
                          f"{seq_length}", stacklevel=2)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> dict[str, dict[str, torch.Tensor]]:
        return self.items[idx]

    def collate(self, items: Sequence[dict[str, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
        return collate_pairs(items, self.pad_id, self.seq_length)


def collate_pairs(items: Sequence[dict[str, dict[str, torch.Tensor]]], pad: int,
                  seq_length: int) -> dict[str, torch.Tensor]:
    """One row per pair: `chosen_<k>` / `rejected_<k>` [B, seq_length] (see the module docstring)."""
    out: dict[str, torch.Tensor] = {}
    for side in SIDES:
        for k, v in collate_sft([it[side] for it in items], pad, seq_length).items():
            out[f"{side}_{k}"] = v
    return out


def scored_pairs(batch: dict[str, torch.Tensor], pad: int) -> dict[str, torch.Tensor]:
    """The reward model's pair layout of a `collate_pairs` batch (module docstring), padded with `pad`."""
    out: dict[str, torch.Tensor] = {}
    for side in SIDES:
        tokens, labels, mask = batch[f"{side}_tokens"], batch[f"{side}_labels"], batch[f"{side}_loss_mask"]
        ids = torch.cat([tokens[:, :1], labels], dim=1)  # ids[t + 1] = labels[t]
        cols = torch.arange(ids.shape[1])
        last = (mask != 0).to(torch.long).mul(torch.arange(1, mask.shape[1] + 1)).argmax(1) + 1  # last trained id
        attn = (cols[None, :] <= last[:, None]).to(torch.long)
        out[f"{side}_input_ids"] = torch.where(attn.bool(), ids, pad)
        out[f"{side}_attention_mask"] = attn
    return out
