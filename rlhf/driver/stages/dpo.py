"""The DPO runner: `run_dpo(cfg)` for `algorithm.name: dpo` (losses sigmoid | ipo | simpo | orpo | kto,
`algorithm.dpo`).

KTO trains each pair as two unpaired examples (the chosen answer desirable, the rejected one undesirable,
`algorithms.preference_loss`); each batch also carries its pairs' mismatched prompt / answer rows
(`rlhf.data.kto_examples`), whose policy-minus-reference log-ratio gives the KL baseline z0, and the reference
log-probs of those rows come from the same source as the answers' (precomputed or the reference group).

The policy is the SFT stage's worker group fed preference pairs (`rlhf.driver.stages.pairs`: data, run loop,
metrics); each micro-batch of m pairs is one forward of 2m sequences.

Reference log-probs (the reference-free SimPO and ORPO need none: no pass, no group), `algorithm.dpo.reference`:
- `precompute`: before the first step the starting policy (after `trainer.load`) computes every train and
  validation pair's summed answer log-probs in a forward-only pass; they are saved in the run dir
  (`reference_logps.safetensors`, keyed by the data files, the model and seq_length) and read back on
  resume, so a resumed run uses the same reference.
- `group`: a frozen reference worker group (`ReferenceWorker`, the `reference` section's layout and micro
  batch) holding the starting weights (model.path, then `trainer.load` when set) computes each batch's
  reference log-probs as the step runs (one more forward per step, no cache; the verl / OpenRLHF way).
Both give the same numbers.

Metrics (train, and `val/` on the held-out pairs): loss, rewards/{chosen,rejected,margin,accuracy},
logps/{chosen,rejected}, nll/chosen and greedy_accuracy, the fraction of pairs whose chosen answer greedy
decoding would produce (`workers.roles.dpo_step`); ORPO adds orpo/or_loss, its odds-ratio term (its rewards
are the answers' log odds).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from algorithms import REFERENCE_FREE_LOSSES
from rlhf.config import RunConfig
from rlhf.data.kto_examples import kl_fields
from rlhf.driver.infra.run_loop import RunLoop
from rlhf.driver.stages.lm import global_batch_size, resolve_checkpoint, run_stage
from rlhf.driver.stages.pairs import PairData, PairRun, build_pair_data
from rlhf.errors import UserError
from workers.batch import Batch
from workers.config import build
from workers.roles.loss_config import PreferenceLossConfig

REF_FILE = "reference_logps.safetensors"
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen",
           "logps/rejected", "nll/chosen", "greedy_accuracy")
LOSS_METRICS = {"orpo": ("orpo/or_loss",), "kto": ("kto/kl_baseline",)}  # what a loss logs beyond METRICS


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
    key = {"train": _file_digest(d.train_file), "val": _file_digest(d.val_file), "val_size": d.val_size,
           "seed": d.seed, "seq_length": d.seq_length, "model": str(cfg.model.path), "load": t.load or ""}
    if cfg.algorithm.dpo.loss == "kto":  # also the mismatched rows of KTO's KL baseline
        key["kto"] = True
    return json.dumps(key, sort_keys=True)


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
            idx = list(range(lo, min(lo + chunk, len(ds))))
            batch = Batch(ds.collate([ds[i] for i in idx]))
            if data.kl:
                for k, v in kl_fields(ds, idx).items():
                    batch[k] = v
            parts.append(group.compute_pair_logps(batch))
        got = Batch.concat(parts)
        for side in ("chosen", "rejected", "kl") if data.kl else ("chosen", "rejected"):
            ref[f"{split}_{side}"] = got[f"{side}_logps"]
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.clone() for k, v in ref.items()}, str(tmp), metadata={"key": key})  # each its own storage
    tmp.rename(path)
    print(f"reference log-probs of {sum(len(ds) for ds in data.datasets().values())} pairs in "
          f"{time.perf_counter() - t0:.1f} s -> {path}", flush=True)
    return ref


def reference_group(cfg: RunConfig, out: Path) -> Any:
    """`algorithm.dpo.reference: group`: the frozen reference workers with the starting weights."""
    from rlhf.workflow import role_group
    from workers.roles import ReferenceWorker

    group = role_group("reference", cfg.reference, cfg, out, ReferenceWorker, model_path=cfg.model.path)
    if cfg.trainer.load:
        group.load_checkpoint(str(resolve_checkpoint(cfg.trainer.load)), load_optimizer=False, load_rng=False,
                              trust=cfg.trainer.trust_checkpoint)
    return group


class DPORun(PairRun):
    """`PairRun` with preference steps: the loss and reward metrics of `algorithms.preference_loss`."""

    METRICS = METRICS
    ref_group: Any = None

    def __init__(self, cfg: RunConfig, data: PairData, group: Any, frame: Any, loop: RunLoop) -> None:
        super().__init__(cfg, data, group, frame, loop)
        self.METRICS = METRICS + LOSS_METRICS.get(cfg.algorithm.dpo.loss, ())

    def _loss_config(self) -> PreferenceLossConfig:
        return build(PreferenceLossConfig, self.cfg.algorithm.dpo)

    def _with_reference(self, batch: Batch) -> Batch:
        if self.ref_group is not None:
            t0 = time.perf_counter()
            ref = self.ref_group.compute_pair_logps(batch)
            for key in ref.keys():  # noqa: SIM118 - a Batch: chosen_logps, rejected_logps (kto: kl_logps)
                batch[f"ref_{key}"] = ref[key]
            self.phase_times["time/reference"] = time.perf_counter() - t0
        return batch

    def train_pairs(self, batch: Batch) -> dict[str, float]:
        return self.group.train_preference_step(self._with_reference(batch), self._loss_config())

    def eval_pairs(self, batch: Batch) -> dict[str, float]:
        return self.group.eval_preference(self._with_reference(batch), self._loss_config())

    def start(self) -> None:
        o, out = self.cfg.algorithm.dpo, self.frame.out
        if o.loss in REFERENCE_FREE_LOSSES:  # no reference pass, no reference group
            self.restore()
        elif o.reference == "group":
            self.ref_group = self.frame.own(reference_group(self.cfg, out))
            self.restore()
        elif self.frame.resume_point() is None:
            self.restore()  # trainer.load: the loaded weights are the reference
            self.data.ref = reference_logps(self.cfg, self.data, self.group, out)
        else:  # the cache of the first start (or, lost, the starting weights before the checkpoint loads)
            self.data.ref = reference_logps(self.cfg, self.data, self.group, out)
            self.restore()


def run_dpo(cfg: RunConfig) -> dict[str, float]:
    """DPO as configured; returns the last step's metrics. The pairs are parsed and tokenised (UserError
    naming file:line) before Ray or any worker starts."""
    if cfg.algorithm.name != "dpo":
        raise UserError(f"algorithm.name: run_dpo runs dpo, got {cfg.algorithm.name!r}")
    Path(cfg.trainer.output_dir).mkdir(parents=True, exist_ok=True)
    data = build_pair_data(cfg)
    data.kl = cfg.algorithm.dpo.loss == "kto"  # KTO's mismatched rows ride along (rlhf.data.kto_examples)
    return run_stage(cfg, data, DPORun)
