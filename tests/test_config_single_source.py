"""Each setting is declared once: a worker-side config class shares its fields with the run's schema (the
schema's sections are built on the worker classes) instead of keeping a copy that can drift."""

from __future__ import annotations

import ast
from dataclasses import dataclass, fields
from pathlib import Path

from rlhf.config.schema import AlgorithmConfig, DPOConfig, RoleConfig, RolloutConfig
from workers.agent.options import AgentOptions
from workers.megatron.lora_config import LoRAConfig
from workers.megatron.moe_config import MoEConfig
from workers.megatron.optim_config import OptimConfig, OptimSettings
from workers.roles.loss_config import PPOLossConfig, PreferenceLossConfig, UpdateConfig, ValueLossConfig
from workers.roles.options import MegatronOptions, RoleOptions
from workers.rollout.config import EngineConfig, EngineOptions, SyncConfig, SyncOptions
from workers.rollout.sampling import SamplingConfig

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = ("Config", "Options", "Settings")

# worker config class -> (the schema section its values come from, its fields the run does not set)
WORKER_CONFIGS: dict[type, tuple[type, set[str]]] = {
    OptimConfig: (OptimConfig, set()),
    MoEConfig: (MoEConfig, set()),
    LoRAConfig: (LoRAConfig, set()),
    OptimSettings: (OptimConfig, {"total_steps"}),  # derived by the driver from the run's length
    UpdateConfig: (AlgorithmConfig, set()),
    PPOLossConfig: (AlgorithmConfig, set()),
    ValueLossConfig: (AlgorithmConfig, set()),
    PreferenceLossConfig: (DPOConfig, set()),
    SamplingConfig: (RolloutConfig, set()),
    EngineOptions: (RolloutConfig, set()),
    EngineConfig: (RolloutConfig, {"model_path", "tokenizer_path", "max_model_len", "enable_chunked_prefill",
                                   "enable_prefix_caching", "logprobs_mode", "gpu_memory_utilization",
                                   "enable_sleep_mode", "enforce_eager", "work_dir", "max_lora_rank", "extra",
                                   "return_routed_experts"}),  # derived: an MoE policy that replays or logs mismatch
    SyncOptions: (RolloutConfig, set()),
    AgentOptions: (RolloutConfig, set()),
    RoleOptions: (RoleConfig, set()),
    MegatronOptions: (RoleConfig, {"ep", "load_weights", "pack_sequences"}),  # ep: parallel.ep
    SyncConfig: (RolloutConfig, {"direct_load", "colocated", "timeout_s", "verify_tolerance_16bit", "policy_dtype",
                                 "verify_num_seqs", "verify_seq_len"}),
}
# (worker class, field): a worker field that takes a schema value of the same name without being its declaration
DERIVED = {(EngineConfig, "seed"): "the engines are seeded with rollout.seed (SamplingConfig.seed)",
           (MegatronOptions, "model_path"): "the role's model_path, else model.path (rlhf.workflow.role_group)",
           (MegatronOptions, "optim"): "the role's optim with the schedule's length (OptimSettings)"}


def copies(worker: type, section: type, worker_only: set[str]) -> list[str]:
    """The fields of `worker` that are neither the section's own declaration nor listed as worker-only."""
    theirs = section.__dataclass_fields__  # type: ignore[attr-defined]
    problems = []
    for f in fields(worker):
        if (worker, f.name) in DERIVED:
            continue
        if f.name in worker_only:
            if f.name in theirs:
                problems.append(f"{worker.__name__}.{f.name} is listed as worker-only but the schema has it")
        elif theirs.get(f.name) is not f:
            where = "redeclares" if f.name in theirs else "is not in"
            problems.append(f"{worker.__name__}.{f.name} {where} the schema's {section.__name__}.{f.name}")
    return problems


def _worker_config_classes() -> set[str]:
    """Names of the dataclasses under workers/ that hold settings (*Config, *Options, *Settings)."""
    names = set()
    for path in (ROOT / "workers").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(SUFFIXES) and any(
                    "dataclass" in ast.unparse(d) for d in node.decorator_list):
                names.add(node.name)
    return names


def test_every_worker_config_class_is_checked():
    assert _worker_config_classes() == {c.__name__ for c in WORKER_CONFIGS}, (
        "a settings dataclass under workers/ must be listed in WORKER_CONFIGS with the schema section it "
        "is built from (its fields then shared with the schema, not copied)")


def test_worker_configs_share_the_schema_declarations():
    problems = [p for w, (section, only) in WORKER_CONFIGS.items() for p in copies(w, section, only)]
    problems += [f"{w.__name__} has no field {n} (listed as worker-only)" for w, (_, only) in WORKER_CONFIGS.items()
                 for n in sorted(only - {f.name for f in fields(w)})]
    assert not problems, problems


def test_the_check_finds_a_copy_and_a_rename():
    @dataclass
    class Copied:
        clip_low: float = 0.2  # declared again: may drift from AlgorithmConfig's

    @dataclass
    class Renamed:
        agg_mode: str = "token-mean"

    assert copies(Copied, AlgorithmConfig, set()) == ["Copied.clip_low redeclares the schema's AlgorithmConfig.clip_low"]
    assert copies(Renamed, AlgorithmConfig, set()) == ["Renamed.agg_mode is not in the schema's AlgorithmConfig.agg_mode"]
    assert copies(PPOLossConfig, AlgorithmConfig, set()) == []
