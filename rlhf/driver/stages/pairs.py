"""What the preference stages share (`algorithm.name: dpo | rm`): their pairs and their run loop.

Pairs come from `data.train_file` (jsonl, `rlhf.data.preference_pairs`), validation from `data.val_file` or
`data.val_size` pairs held out of it; a bad record fails with one line naming file:line before any model
work (`check_pair_files`). A step takes `trainer.global_batch_size` pairs (micro batch x gradient
accumulation x DP, counted in pairs). `PairRun` is the LM stage's run (`LMRun`: layouts, optimizer, schedule,
checkpoints, resume, metrics) with a pair batch per step; a stage says how a batch trains and evaluates
(`train_pairs`, `eval_pairs`) and which of the results are its metrics (`METRICS`, also logged as `val/...`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.config import RunConfig
from rlhf.data.kto_examples import kl_fields
from rlhf.driver.infra.run_loop import RunLoop
from rlhf.driver.stages.lm import LMRun
from rlhf.driver.stages.lm_data import SampleOrder, _field, tokenizer_path
from rlhf.errors import UserError
from workers.batch import Batch


@dataclass
class PairData:
    """The train / validation pairs of a run, their sample order and (DPO, once computed) reference log-probs."""

    train: Any  # PairDataset
    order: SampleOrder
    val: Any = None
    val_rows: list[int] | None = None
    # {train,val}_{chosen,rejected}: [len(dataset)]; pairs held out of the train file (data.val_size) use train_*
    # (and {train,val}_kl with `kl`)
    ref: dict[str, torch.Tensor] | None = None
    kl: bool = False  # KTO: each batch carries its pairs' mismatched rows, `kl_<k>` (rlhf.data.kto_examples)

    def next_batch(self, n: int) -> Batch:
        return self._batch(self.train, "train", self.order.take(n))

    def val_batch(self, n: int) -> Batch | None:
        if self.val is None or not self.val_rows:
            return None
        return self._batch(self.val, self._split(self.val), [self.val_rows[i % len(self.val_rows)] for i in range(n)])

    def _split(self, ds: Any) -> str:
        return "train" if ds is self.train else "val"

    def _batch(self, ds: Any, split: str, idx: list[int]) -> Batch:
        out = Batch(ds.collate([ds[i] for i in idx]))
        if self.kl:
            for k, v in kl_fields(ds, idx).items():
                out[k] = v
        if self.ref is not None:
            t = torch.as_tensor(idx, dtype=torch.long)
            for side in ("chosen", "rejected", "kl") if self.kl else ("chosen", "rejected"):
                out[f"ref_{side}_logps"] = self.ref[f"{split}_{side}"][t]
        return out

    def datasets(self) -> dict[str, Any]:
        """The datasets of the run, by split name (a held-out part of the train file is in `train`)."""
        return {"train": self.train} | ({"val": self.val} if self.val is not None and self.val is not self.train
                                         else {})


def check_pair_files(cfg: RunConfig) -> None:
    """Parse every record of the pair files (no tokenizer): a bad line fails before any model work."""
    from rlhf.data.jsonl import check_input_file, read_jsonl
    from rlhf.data.preference_pairs import parse_pair

    d = cfg.data
    if not d.train_file:
        raise UserError(f"data.train_file: {cfg.algorithm.name} needs a jsonl of preference pairs (messages or "
                        f"prompt, with chosen and rejected)")
    for name in ("train_file", "val_file"):
        path = getattr(d, name)
        if path:
            _field(f"data.{name}", lambda path=path: check_input_file(path, "preference data file"))
            for lineno, rec in read_jsonl(path):
                parse_pair(rec, f"{path}:{lineno}")


def build_pair_data(cfg: RunConfig) -> PairData:
    """The run's pairs, tokenised (UserError naming file:line on a bad record)."""
    from rlhf.data.checks import check_seq_length
    from rlhf.data.preference_pairs import PairDataset
    from rlhf.data.tokenizer import load_tokenizer

    d = cfg.data
    tok = tokenizer_path(cfg)
    _field("model.tokenizer_path" if cfg.model.tokenizer_path else "model.path", lambda: load_tokenizer(tok))
    _field("data.seq_length", lambda: check_seq_length(d.seq_length, cfg.model.path))
    check_pair_files(cfg)
    train = _field("data.train_file", lambda: PairDataset(d.train_file, tok, d.seq_length))
    rows = list(range(len(train)))
    val, val_rows = None, None
    if d.val_file:
        val = _field("data.val_file", lambda: PairDataset(d.val_file, tok, d.seq_length))
        val_rows = list(range(len(val)))
    elif d.val_size > 0:
        if d.val_size >= len(rows):
            raise UserError(f"data.val_size={d.val_size} leaves no training pairs ({len(rows)} in {d.train_file})")
        perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(d.seed)).tolist()
        val, val_rows, rows = train, perm[: d.val_size], sorted(perm[d.val_size:])
    return PairData(train, SampleOrder(rows, d.seed, shuffle=True), val, val_rows)


class PairRun(LMRun):
    """`LMRun` over preference pairs (module docstring); subclasses define `METRICS`, `train_pairs` and
    `eval_pairs` (and may add timings of their own to `self.phase_times` while preparing a batch)."""

    data: PairData  # type: ignore[assignment]
    METRICS: tuple[str, ...] = ()

    def __init__(self, cfg: RunConfig, data: PairData, group: Any, frame: Any, loop: RunLoop) -> None:
        super().__init__(cfg, data, group, frame, loop)
        self.phase_times: dict[str, float] = {}

    def train_pairs(self, batch: Batch) -> dict[str, float]:
        raise NotImplementedError

    def eval_pairs(self, batch: Batch) -> dict[str, float]:
        raise NotImplementedError

    def validate(self) -> dict[str, float]:
        if self.cfg.trainer.eval_iters == 0:
            return {}
        batch = self.data.val_batch(self.gbs * self.cfg.trainer.eval_iters)
        if batch is None:
            return {}
        t0 = time.perf_counter()
        out = self.eval_pairs(batch)
        self.phase_times.clear()
        return {**{f"val/{k}": out[k] for k in self.METRICS}, "time/val": time.perf_counter() - t0}

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = self.data.next_batch(self.gbs)
        t1 = time.perf_counter()
        out = self.train_pairs(batch)
        dt = time.perf_counter() - t0
        skipped = bool(out.get("skipped", 0.0))
        self.skipped_total += int(skipped)
        tokens = sum(int(batch[f"{s}_loss_mask"].sum()) for s in ("chosen", "rejected"))
        times, self.phase_times = self.phase_times, {}
        return {
            **{k: out[k] for k in self.METRICS}, "lr": out["lr"], "grad_norm": out["grad_norm"],
            "skipped": float(skipped), "skipped_steps": float(self.skipped_total), "pairs": out["pairs"],
            "loss_tokens": float(tokens), "pairs_per_s": len(batch) / dt, "step_time_s": dt,
            "consumed_samples": float(self.data.order.consumed), "time/data": t1 - t0,
            "time/train": time.perf_counter() - t1 - sum(times.values()), **times,
        }
