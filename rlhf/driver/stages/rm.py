"""The reward-model runner: `run_rm(cfg)` for `algorithm.name: rm`.

Bradley-Terry training of a scalar head on preference pairs (`algorithms.bradley_terry_loss`): the model of
`model.path` (a causal LM, whose LM head is replaced by a value head, or a reward model) in a
`RewardModelWorker` group with the `policy` section's layout, optimizer and micro batch (counted in pairs),
on the pairs of the DPO stage (`rlhf.driver.stages.pairs`: the same files, masking, validation, checkpoints and
resume). Each answer is scored at its last token, the end of turn (`rlhf.data.preference_pairs.scored_pairs`),
where a PPO / GRPO run serving it as `reward.model_path` reads a response's score.

Metrics (train, and `val/` on the held-out pairs): loss, accuracy (the share of pairs whose chosen answer
scores higher), margin (mean chosen minus rejected score), scores/chosen, scores/rejected. With
`trainer.export_hf` the model is written to `<output_dir>/hf` as an HF `*ForSequenceClassification` with one
label (`workers.roles.hf_export`), loadable by transformers and by `reward.model_path`.
"""

from __future__ import annotations

from pathlib import Path

from rlhf.config import RunConfig
from rlhf.driver.stages.lm import run_stage
from rlhf.driver.stages.pairs import PairRun, build_pair_data
from rlhf.errors import UserError
from workers.batch import Batch

METRICS = ("loss", "accuracy", "margin", "scores/chosen", "scores/rejected")


class RMRun(PairRun):
    """`PairRun` with Bradley-Terry steps on a reward-model group."""

    METRICS = METRICS
    role = "reward_model"

    @classmethod
    def worker_class(cls) -> type:
        from workers.roles import RewardModelWorker

        return RewardModelWorker

    def _scored(self, batch: Batch) -> Batch:
        from rlhf.data.preference_pairs import scored_pairs

        return Batch(scored_pairs(batch, self.data.train.pad_id))

    def train_pairs(self, batch: Batch) -> dict[str, float]:
        return self.group.train_step(self._scored(batch))

    def eval_pairs(self, batch: Batch) -> dict[str, float]:
        return self.group.eval_step(self._scored(batch))


def run_rm(cfg: RunConfig) -> dict[str, float]:
    """Train a reward model as configured; returns the last step's metrics. The pairs are parsed and tokenised
    (UserError naming file:line) before Ray or any worker starts."""
    if cfg.algorithm.name != "rm":
        raise UserError(f"algorithm.name: run_rm runs rm, got {cfg.algorithm.name!r}")
    Path(cfg.trainer.output_dir).mkdir(parents=True, exist_ok=True)
    return run_stage(cfg, build_pair_data(cfg), RMRun)
