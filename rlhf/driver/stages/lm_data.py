"""Data for the pretraining and SFT stages: input checks, datasets, and a resumable sample order.

- pretrain: `data.data_prefix` (Megatron indexed .bin/.idx) through `build_pretrain_datasets`; the
  train / valid splits come from `data.split`. GPTDataset already shuffles (seeded), so samples are
  read in order.
- sft: `data.train_file` (jsonl conversations, or an indexed SFT prefix) through `SFTDataset` (packed
  rows with `data.pack`); validation from `data.val_file`, else `data.val_size` rows held out of the
  train set. Rows are reshuffled every epoch with a seed derived from `data.seed` and the epoch.
The position in the sample order is the number of samples consumed: a checkpoint stores it, so a
resumed run sees exactly the batches the uninterrupted run would have seen.
Validation always uses the same first `trainer.eval_iters` global batches of the validation set
(wrapping around a small set), so val/loss values are comparable across steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.config.schema import RunConfig
from rlhf.errors import UserError
from workers.batch import LM_KEYS, Batch


class SampleOrder:
    """Indices into `rows`, epoch after epoch (reshuffled per epoch when `shuffle`); resumable."""

    def __init__(self, rows: Sequence[int], seed: int, shuffle: bool) -> None:
        if not rows:
            raise UserError("the training set is empty")
        self.rows, self.seed, self.shuffle = list(rows), seed, shuffle
        self.consumed = 0
        self._perm: tuple[int, list[int]] | None = None

    def _epoch_perm(self, epoch: int) -> list[int]:
        if self._perm is None or self._perm[0] != epoch:
            n = len(self.rows)
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                perm = torch.randperm(n, generator=g).tolist()
            else:
                perm = list(range(n))
            self._perm = (epoch, perm)
        return self._perm[1]

    def take(self, n: int) -> list[int]:
        out = []
        for p in range(self.consumed, self.consumed + n):
            epoch, i = divmod(p, len(self.rows))
            out.append(self.rows[self._epoch_perm(epoch)[i]])
        self.consumed += n
        return out

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = int(state["consumed"])


@dataclass
class LMData:
    """The datasets of one run and how their items become a `Batch`."""

    kind: str  # pretrain | sft
    train: Any
    order: SampleOrder
    collate: Callable[[list[dict[str, torch.Tensor]]], dict[str, Any]]
    seq_length: int
    val: Any = None
    val_rows: list[int] | None = None

    def next_batch(self, n: int) -> Batch:
        return self._batch(self.train, self.order.take(n))

    def val_batch(self, n: int) -> Batch | None:
        """The fixed validation set: `n` rows (wrapping around a smaller set); None without one."""
        if self.val is None or not self.val_rows:
            return None
        return self._batch(self.val, [self.val_rows[i % len(self.val_rows)] for i in range(n)])

    def _batch(self, ds: Any, idx: list[int]) -> Batch:
        out = self.collate([ds[i] for i in idx])
        return Batch({k: out[k] for k in LM_KEYS})


def stack_items(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pretraining items (equal lengths) -> [B, S] tensors."""
    return {k: torch.stack([it[k] for it in items]) for k in LM_KEYS}


def tokenizer_path(cfg: RunConfig) -> str:
    return cfg.model.tokenizer_path or cfg.model.path or ""


def _field(name: str, fn: Callable[[], Any]) -> Any:
    """Run a data check; prefix its UserError with the config field it is about."""
    try:
        return fn()
    except UserError as e:
        raise UserError(f"{name}: {e}") from None


def check_lm_inputs(cfg: RunConfig) -> None:
    """Checks of the files an SFT / pretraining run reads, before any worker starts (UserError)."""
    from rlhf.data.checks import check_data_prefix, check_seq_length, parse_split
    from rlhf.data.tokenizer import load_tokenizer

    tok = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    _field(tok, lambda: load_tokenizer(tokenizer_path(cfg)))
    _field("data.seq_length", lambda: check_seq_length(cfg.data.seq_length, cfg.model.path))
    d = cfg.data
    if cfg.algorithm.name == "pretrain":
        from rlhf.data.pretrain import check_prefixes_have_tokens, parse_blend

        prefixes, _ = _field("data.data_prefix", lambda: parse_blend(d.data_prefix))
        _field("data.split", lambda: parse_split(d.split))
        for p in prefixes:
            _field("data.data_prefix", lambda p=p: check_data_prefix(p))
        _field("data.data_prefix", lambda: check_prefixes_have_tokens(prefixes, d.split))
    else:
        from rlhf.data.jsonl import check_input_file
        from rlhf.data.sft_indexed import is_sft_prefix

        if not d.train_file:
            raise UserError("data.train_file: SFT needs a jsonl of conversations (messages / conversations)")
        for name in ("train_file", "val_file"):
            path = getattr(d, name)
            if path and not is_sft_prefix(path):
                _field(f"data.{name}", lambda path=path: check_input_file(path, "SFT data file"))


def build_lm_data(cfg: RunConfig, global_batch_size: int, out_dir: str) -> LMData:
    """The datasets of an SFT or pretraining run (after `check_lm_inputs`)."""
    return _pretrain_data(cfg, global_batch_size, out_dir) if cfg.algorithm.name == "pretrain" \
        else _sft_data(cfg)


def _pretrain_data(cfg: RunConfig, gbs: int, out_dir: str) -> LMData:
    from rlhf.data.checks import parse_split
    from rlhf.data.pretrain import build_pretrain_datasets

    d, t = cfg.data, cfg.trainer
    weights = parse_split(d.split)
    n_val = gbs * t.eval_iters if weights[1] > 0 and t.eval_iters > 0 else 0
    sizes = (t.total_steps * gbs, n_val or None, None)
    train, val, _ = _field("data.data_prefix", lambda: build_pretrain_datasets(
        d.data_prefix, d.split, d.seq_length, d.seed, tokenizer_path(cfg), sizes,
        eod_mask_loss=d.eod_mask_loss, path_to_cache=f"{out_dir}/data_cache"))
    val_rows = list(range(min(len(val), n_val))) if val is not None and n_val else None
    return LMData("pretrain", train, SampleOrder(range(len(train)), d.seed, shuffle=False), stack_items,
                  d.seq_length, val if val_rows else None, val_rows)


def _sft_data(cfg: RunConfig) -> LMData:
    from rlhf.data.sft import SFTDataset

    d = cfg.data
    tok = tokenizer_path(cfg)
    train = _field("data.train_file", lambda: SFTDataset(d.train_file, tok, d.seq_length, pack=d.pack))
    rows = list(range(len(train)))
    val, val_rows = None, None
    if d.val_file:
        val = _field("data.val_file", lambda: SFTDataset(d.val_file, tok, d.seq_length, pack=d.pack))
        val_rows = list(range(len(val)))
    elif d.val_size > 0:
        if d.val_size >= len(rows):
            raise UserError(f"data.val_size={d.val_size} leaves no training rows ({len(rows)} in "
                            f"{d.train_file}{' after packing' if d.pack else ''})")
        g = torch.Generator().manual_seed(d.seed)
        perm = torch.randperm(len(rows), generator=g).tolist()
        val, val_rows, rows = train, perm[: d.val_size], sorted(perm[d.val_size:])
    return LMData("sft", train, SampleOrder(rows, d.seed, shuffle=True), train.collate, d.seq_length, val,
                  val_rows)
