"""The user-facing workflow API in one import: what a custom RL step and its runner need.

    from rlhf.api import Roles, StepContext, compute_advantages, load_config, loss_config, prepare_inputs, run_rl

A step function takes the role handles and the step's context and returns its metrics; `run_rl` runs it
with data, validation, checkpoints, metrics and resume around it (see examples/custom_workflow.py).
"""

from __future__ import annotations

from algorithms import compute_advantages
from algorithms.rewards import extract_answer, parse_number
from rlhf.config import RunConfig, load_config
from rlhf.driver.rl.advantages import add_advantages, token_level_scores
from rlhf.driver.rl.context import StepContext, rollout_metrics
from rlhf.driver.rl.runner import run_rl
from rlhf.driver.warmstart.prepare import prepare_inputs
from rlhf.workflow import Roles, loss_config, value_loss_config
from workers.batch import Batch

__all__ = [
    "Batch", "Roles", "RunConfig", "StepContext", "add_advantages", "compute_advantages", "extract_answer",
    "load_config", "loss_config", "parse_number", "prepare_inputs", "rollout_metrics", "run_rl",
    "token_level_scores", "value_loss_config",
]
