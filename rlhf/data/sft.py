"""SFT data: `SFTDataset` (jsonl or a pre-built indexed set) and `collate_sft`.

Source: a jsonl of conversations (see `rlhf.data.chat`: OpenAI `messages` or ShareGPT `conversations`),
or the prefix P of a set written by `rlhf preprocess --sft --output-prefix P`. Each conversation is
rendered with the tokenizer's chat template; the loss covers only assistant turns (content plus its
end-of-turn token). A conversation is truncated to seq_length + 1 ids (seq_length inputs after the shift);
one with no assistant token left is skipped (`dataset.num_skipped`).

Dataset item (one sample, or with pack=True several samples packed into one row), L <= seq_length:
- `tokens` [L] int64: input ids.
- `labels` [L] int64: next-token targets (labels[t] = id at t+1 within the same sample).
- `loss_mask` [L] float32: 1 where labels[t] is an assistant token, else 0.
- `position_ids` [L] int64: 0.. per sample (restarting at each packed sample).
- `segment_lengths` [n] int64: lengths of the n samples in the row (sum = L).
Packing never splits a sample and never lets labels cross sample boundaries, so every sample's loss is the
same packed or not.

`collate_sft(items, pad_id, seq_length=None)` pads to S = seq_length (or the longest row) and returns
`tokens`, `labels` [B, S] int64 (pad_id after the row), `loss_mask` [B, S] float32 (0 on padding) and
`position_ids` [B, S] int64 (the padding tail counts from 0 as its own segment). The worker rebuilds the
attention mask from the positions (`workers.roles.lm.lm_attention_mask`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf.data.chat import check_chat_template, encode_sft_record
from rlhf.data.jsonl import check_input_file, read_jsonl
from rlhf.data.packing import pack_lengths, row_segments
from rlhf.data.sft_indexed import SFTIndexedStore, is_sft_prefix
from rlhf.data.tokenizer import load_tokenizer, pad_id
from rlhf.errors import UserError


def sample_tensors(ids: np.ndarray, mask: np.ndarray) -> dict[str, torch.Tensor]:
    """The item of one sample from its ids and assistant mask (both length n >= 2): L = n - 1."""
    ids_t = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    n = ids_t.numel() - 1
    return {
        "tokens": ids_t[:-1].clone(),
        "labels": ids_t[1:].clone(),
        "loss_mask": torch.as_tensor(np.asarray(mask[1:], dtype=np.float32)),
        "position_ids": torch.arange(n, dtype=torch.long),
        "segment_lengths": torch.tensor([n], dtype=torch.long),
    }


def concat_samples(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pack sample items into one row (keys as in the module doc)."""
    return {key: torch.cat([it[key] for it in items]) for key in items[0]}


class _ListStore:
    """Encoded conversations held in memory (from jsonl)."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self.ids)

    def length(self, i: int) -> int:
        return int(self.ids[i].size)

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.ids[i], self.masks[i]


class SFTDataset(torch.utils.data.Dataset):
    """SFT samples from a conversations jsonl or an indexed SFT prefix; items as in the module docstring."""

    def __init__(self, path: str | Path, tokenizer: Any, seq_length: int, pack: bool = False) -> None:
        if not isinstance(seq_length, int) or isinstance(seq_length, bool) or seq_length < 1:
            raise UserError(f"seq_length must be a positive integer, got {seq_length!r}")
        self.path = str(path)
        self.tokenizer = load_tokenizer(tokenizer)
        self.seq_length = seq_length
        self.pack = pack
        self.pad_id = pad_id(self.tokenizer)
        self.num_skipped = 0
        self._store, self._keep = self._load(Path(self.path))
        if not self._keep:
            raise UserError(f"{path}: no SFT samples with assistant tokens within seq_length {seq_length}")
        if self.num_skipped:
            warnings.warn(
                f"{path}: skipped {self.num_skipped} conversations with no assistant token within "
                f"seq_length {seq_length}",
                stacklevel=2,
            )
        self.lengths = [min(self._store.length(i), seq_length + 1) - 1 for i in self._keep]
        self.rows = pack_lengths(self.lengths, seq_length) if pack else [[i] for i in range(len(self._keep))]

    def _load(self, path: Path) -> tuple[Any, list[int]]:
        """(store, indices of the stored conversations to use)."""
        if is_sft_prefix(path):
            store = SFTIndexedStore(path)
            keep = []
            for i in range(len(store)):
                # Samples that fit were checked when the set was built; re-check those we truncate further.
                if store.length(i) <= self.seq_length + 1 or store.get(i)[1][1 : self.seq_length + 1].any():
                    keep.append(i)
            self.num_skipped = len(store) - len(keep)
            return store, keep
        check_input_file(path, "SFT data file")
        check_chat_template(self.tokenizer)
        store = _ListStore()
        for lineno, rec in read_jsonl(path):
            pair = encode_sft_record(self.tokenizer, rec, f"{path}:{lineno}", self.seq_length)
            if pair is None:
                self.num_skipped += 1
            else:
                store.ids.append(pair[0])
                store.masks.append(pair[1])
        return store, list(range(len(store)))

    @property
    def num_samples(self) -> int:
        """Conversations kept (before packing)."""
        return len(self._keep)

    def __len__(self) -> int:
        return len(self.rows)

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        """The unpacked item of kept conversation `i` (0 <= i < num_samples)."""
        ids, mask = self._store.get(self._keep[i])
        return sample_tensors(ids[: self.seq_length + 1], mask[: self.seq_length + 1])

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        row = self.rows[idx]
        if len(row) == 1:
            return self.sample(row[0])
        return concat_samples([self.sample(i) for i in row])

    def collate(self, items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """`collate_sft` padded to this dataset's seq_length (fixed shapes, as pipeline parallelism needs)."""
        return collate_sft(items, self.pad_id, self.seq_length)


def collate_sft(
    items: Sequence[dict[str, torch.Tensor]], pad_id: int, seq_length: int | None = None
) -> dict[str, torch.Tensor]:
    """Pad dataset items into a batch; keys and shapes in the module docstring."""
    if not items:
        raise ValueError("collate_sft needs at least one item")
    width = seq_length or max(int(it["tokens"].numel()) for it in items)
    rows = len(items)
    tokens = torch.full((rows, width), pad_id, dtype=torch.long)
    labels = torch.full((rows, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(rows, width, dtype=torch.float32)
    position_ids = torch.empty(rows, width, dtype=torch.long)
    for b, it in enumerate(items):
        n = int(it["tokens"].numel())
        if n > width:
            raise ValueError(f"item {b} has {n} tokens > seq_length {width}")
        tokens[b, :n] = it["tokens"]
        labels[b, :n] = it["labels"]
        loss_mask[b, :n] = it["loss_mask"]
        segs = row_segments([int(s) for s in it["segment_lengths"]], width)
        position_ids[b] = torch.cat([torch.arange(s) for s in segs])
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
