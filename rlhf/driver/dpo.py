"""The DPO runner: `run_dpo(cfg)` for `algorithm.name: dpo` (losses sigmoid | ipo | simpo, `algorithm.dpo`).

The policy is the SFT stage's worker group (same layouts, optimizer, schedule, checkpoints, resume and
metrics: `LMRun`), fed preference pairs instead of token rows: `data.train_file` (jsonl, see
`rlhf.data.preference`), validation from `data.val_file` or `data.val_size` pairs held out of it. A step
takes `trainer.global_batch_size` pairs (micro batch x gradient accumulation x DP, counted in pairs); each
micro-batch of m pairs is one forward of 2m sequences.

Reference log-probs (`algorithm.dpo.reference: precompute`; SimPO needs none): before the first step the
starting policy (after `trainer.load`) computes every train and validation pair's summed answer log-probs in
a forward-only pass; they are saved in the run dir (`reference_logps.safetensors`, keyed by the data files,
the model and seq_length) and read back on resume, so a resumed run uses the same reference.

Metrics (train, and `val/` on the held-out pairs): loss, rewards/{chosen,rejected,margin,accuracy},
logps/{chosen,rejected} and greedy_accuracy, the fraction of pairs whose chosen answer greedy decoding
would produce (`workers.roles.preference`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf.config import RunConfig
from rlhf.driver.checkpoints import CheckpointManager, export_hf
from rlhf.driver.lm import LMRun, global_batch_size, make_group, resolve_checkpoint
from rlhf.driver.lm_data import SampleOrder, _field, tokenizer_path
from rlhf.driver.scaffold import RunScaffold
from rlhf.errors import UserError
from workers.batch import Batch
from workers.config import build
from workers.roles.loss_config import PreferenceLossConfig

REF_FILE = "reference_logps.safetensors"
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen",
           "logps/rejected", "greedy_accuracy")


@dataclass
class PairData:
    """The train / validation pairs of a run, their sample order and (once computed) reference log-probs."""

    train: Any  # PairDataset
    order: SampleOrder
    val: Any = None
    val_rows: list[int] | None = None
    # {train,val}_{chosen,rejected}: [len(dataset)]; pairs held out of the train file (data.val_size) use train_*
    ref: dict[str, torch.Tensor] | None = None

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
        if self.ref is not None:
            t = torch.as_tensor(idx, dtype=torch.long)
            out["ref_chosen_logps"] = self.ref[f"{split}_chosen"][t]
            out["ref_rejected_logps"] = self.ref[f"{split}_rejected"][t]
        return out

    def datasets(self) -> dict[str, Any]:
        """The datasets that need reference log-probs, by split name."""
        return {"train": self.train} | ({"val": self.val} if self.val is not None and self.val is not self.train
                                         else {})


def check_pair_files(cfg: RunConfig) -> None:
    """Parse every record of the pair files (no tokenizer): a bad line fails before any model work."""
    from rlhf.data.jsonl import check_input_file, read_jsonl
    from rlhf.data.preference import parse_pair

    d = cfg.data
    if not d.train_file:
        raise UserError("data.train_file: DPO needs a jsonl of preference pairs (messages or prompt, with chosen "
                        "and rejected)")
    for name in ("train_file", "val_file"):
        path = getattr(d, name)
        if path:
            _field(f"data.{name}", lambda path=path: check_input_file(path, "preference data file"))
            for lineno, rec in read_jsonl(path):
                parse_pair(rec, f"{path}:{lineno}")


def build_pair_data(cfg: RunConfig) -> PairData:
    """The run's pairs, tokenised (UserError naming file:line on a bad record)."""
    from rlhf.data.checks import check_seq_length
    from rlhf.data.preference import PairDataset
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


def _file_digest(path: str | None) -> str:
    if not path:
        return ""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def reference_key(cfg: RunConfig) -> str:
    """What the cached reference log-probs depend on: the pair files, the starting model and seq_length."""
    d, t = cfg.data, cfg.trainer
    return json.dumps({"train": _file_digest(d.train_file), "val": _file_digest(d.val_file),
                       "val_size": d.val_size, "seed": d.seed, "seq_length": d.seq_length,
                       "model": str(cfg.model.path), "load": t.load or ""}, sort_keys=True)


def reference_logps(cfg: RunConfig, data: PairData, group: Any, out: Path) -> dict[str, torch.Tensor]:
    """The reference log-probs of every pair (`algorithm.dpo.reference: precompute`): read from the run dir,
    else computed by `group` (the starting policy) and saved there."""
    if cfg.algorithm.dpo.reference != "precompute":  # the only source today (validate.DPO_REFERENCES)
        raise UserError(f"algorithm.dpo.reference={cfg.algorithm.dpo.reference!r}: only precompute is implemented")
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = out / REF_FILE
    key = reference_key(cfg)
    if path.is_file():
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("key") == key:
                return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        raise UserError(f"{path} holds reference log-probs of other data or another model (changed since the "
                        f"run started); start a new run (--force) or restore the inputs")
    t0 = time.perf_counter()
    chunk = max(global_batch_size(cfg), cfg.policy.micro_batch_size * cfg.policy.parallel.dp) * 4
    ref: dict[str, torch.Tensor] = {}
    for split, ds in data.datasets().items():
        parts = []
        for lo in range(0, len(ds), chunk):
            batch = Batch(ds.collate([ds[i] for i in range(lo, min(lo + chunk, len(ds)))]))
            parts.append(group.compute_pair_logps(batch))
        got = Batch.concat(parts)
        ref[f"{split}_chosen"], ref[f"{split}_rejected"] = got["chosen_logps"], got["rejected_logps"]
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.clone() for k, v in ref.items()}, str(tmp), metadata={"key": key})  # each its own storage
    tmp.rename(path)
    print(f"reference log-probs of {sum(len(ds) for ds in data.datasets().values())} pairs in "
          f"{time.perf_counter() - t0:.1f} s -> {path}", flush=True)
    return ref


class DPORun(LMRun):
    """`LMRun` with preference steps: the loss and reward metrics of `algorithms.preference_loss`."""

    data: PairData  # type: ignore[assignment]

    def _loss_config(self) -> PreferenceLossConfig:
        return build(PreferenceLossConfig, self.cfg.algorithm.dpo)

    def validate(self) -> dict[str, float]:
        if self.cfg.trainer.eval_iters == 0:
            return {}
        batch = self.data.val_batch(self.gbs * self.cfg.trainer.eval_iters)
        if batch is None:
            return {}
        t0 = time.perf_counter()
        out = self.group.eval_preference(batch, self._loss_config())
        return {**{f"val/{k}": out[k] for k in METRICS}, "time/val": time.perf_counter() - t0}

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = self.data.next_batch(self.gbs)
        t1 = time.perf_counter()
        out = self.group.train_preference_step(batch, self._loss_config())
        dt = time.perf_counter() - t0
        skipped = bool(out.get("skipped", 0.0))
        self.consecutive_nonfinite = self.consecutive_nonfinite + 1 if skipped else 0
        self.skipped_total += int(skipped)
        tokens = sum(int(batch[f"{s}_loss_mask"].sum()) for s in ("chosen", "rejected"))
        return {
            **{k: out[k] for k in METRICS}, "lr": out["lr"], "grad_norm": out["grad_norm"], "skipped": float(skipped),
            "skipped_steps": float(self.skipped_total), "pairs": out["pairs"], "loss_tokens": float(tokens),
            "pairs_per_s": len(batch) / dt, "step_time_s": dt, "consumed_samples": float(self.data.order.consumed),
            "time/data": t1 - t0, "time/train": time.perf_counter() - t1,
        }


def run_dpo(cfg: RunConfig) -> dict[str, float]:
    """DPO as configured; returns the last step's metrics. The pairs are parsed and tokenised (UserError
    naming file:line) before Ray or any worker starts."""
    if cfg.algorithm.name != "dpo":
        raise UserError(f"algorithm.name: run_dpo runs dpo, got {cfg.algorithm.name!r}")
    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = build_pair_data(cfg)
    if cfg.trainer.load:
        CheckpointManager.check_trusted(resolve_checkpoint(cfg.trainer.load), cfg.trainer.trust_checkpoint)
    with RunScaffold(cfg) as frame:
        group = frame.own(make_group(cfg, out))
        run = DPORun(cfg, data, group, frame)
        if cfg.algorithm.dpo.loss == "simpo":  # reference-free
            run.restore()
        elif frame.resume_point() is None:
            run.restore()  # trainer.load: the loaded weights are the reference
            data.ref = reference_logps(cfg, data, group, out)
        else:  # the cache of the first start (or, lost, the starting weights before the checkpoint loads)
            data.ref = reference_logps(cfg, data, group, out)
            run.restore()
        last = run.run(frame.metrics_logger(run.step))
        if cfg.trainer.export_hf:
            export_hf(out / "hf", lambda d: group.save_hf_weights(d, tokenizer_path(cfg)))
    return last
