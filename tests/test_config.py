"""Config loading and validation: every error names the field and what was expected."""

from __future__ import annotations

import pytest
import torch

from rlhf.config import load_config, save_config
from rlhf.errors import ConfigError

BASE = ["model.preset=tiny-qwen2"]


def err(overrides: list[str], path=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, BASE + overrides if path is None else overrides)
    return str(e.value)


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(None, BASE + ["trainer.total_steps=5", "policy.parallel.tp=2", "rollout.stop=[a,b]"])
    assert cfg.trainer.total_steps == 5 and cfg.policy.parallel.tp == 2 and cfg.rollout.stop == ["a", "b"]
    save_config(cfg, tmp_path / "resolved.yaml")
    again = load_config(tmp_path / "resolved.yaml")
    assert again == cfg


def test_yaml_preset_with_overrides(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("model:\n  preset: tiny-llama\ntrainer:\n  total_steps: 3\n")
    cfg = load_config(f, ["trainer.total_steps=7"])
    assert cfg.model.preset == "tiny-llama" and cfg.trainer.total_steps == 7


def test_unknown_key_suggests():
    msg = err(["policy.paralel.tp=2"])
    assert "policy.paralel" in msg and "did you mean 'policy.parallel'" in msg
    assert "did you mean 'trainer.total_steps'" in err(["trainer.totl_steps=3"])


def test_unknown_key_in_yaml(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("model:\n  preset: tiny-qwen2\nrollout:\n  temprature: 0.5\n")
    msg = err([], path=f)
    assert str(f) in msg and "rollout.temprature" in msg and "rollout.temperature" in msg


def test_wrong_type():
    msg = err(["trainer.total_steps=abc"])
    assert "trainer.total_steps" in msg and "Integer" in msg


@pytest.mark.parametrize(
    "override, words",
    [
        ("rollout.top_p=0", ["rollout.top_p", "(0, 1]"]),
        ("policy.optim.lr=-1", ["policy.optim.lr", ">= 0"]),
        ("rollout.n=0", ["rollout.n", ">= 1"]),
        ("algorithm.kl_kind=k9", ["algorithm.kl_kind", "k3"]),
        ("algorithm.clip_c=0.5", ["algorithm.clip_c", "> 1"]),
        ("rollout.dtype=float64", ["rollout.dtype", "bfloat16", "auto"]),
        ("rollout.tp=0", ["rollout.tp", ">= 1"]),
        ("rollout.tp=3", ["rollout.tp=3", "4 attention heads"]),
        ("rollout.max_num_seqs=0", ["rollout.max_num_seqs", ">= 1"]),
        ("rollout.block_size=24", ["rollout.block_size", "multiple of 16"]),
        pytest.param("rollout.block_size=48", ["rollout.block_size", "multiple of 32", "CUDA"],
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only limit")),
        ("reward.on_error=ignore", ["reward.on_error", "fallback, fail"]),
        ("reward.timeout_s=0", ["reward.timeout_s", "> 0"]),
        ("reward.num_workers=0", ["reward.num_workers", ">= 1"]),
        ("reward.fallback_score=nan", ["reward.fallback_score", "finite"]),
        ("trainer.stop_grace_s=0", ["trainer.stop_grace_s", "> 0"]),
        ("policy.optim.max_consecutive_nonfinite=0", ["policy.optim.max_consecutive_nonfinite", ">= 1"]),
        ("policy.recompute=partial", ["policy.recompute", "none, selective, full"]),
        ("policy.recompute_num_layers=0", ["policy.recompute_num_layers", ">= 1"]),
        ("reference.sequence_parallel=true", ["reference.sequence_parallel=true", "reference.parallel.tp > 1 (tp=1)"]),
        ("policy.optim.overlap_param_gather=true", ["policy.optim.overlap_param_gather=true",
                                                    "policy.optim.use_distributed_optimizer=true"]),
        ("policy.optim.cpu_offload_fraction=1.5", ["policy.optim.cpu_offload_fraction", "(0, 1]"]),
        ("rollout.num_engines=0", ["rollout.num_engines", ">= 1"]),
        ("rollout.tp=2", ["rollout.tp=2", "rollout.num_engines"]),
        ("rollout.colocate_with=critic", ["rollout.colocate_with", "policy, null"]),
        ("rollout.mode=offline", ["rollout.mode", "sync, one_step_off, async"]),
        ("rollout.max_staleness=0", ["rollout.max_staleness", ">= 1"]),
        ("policy.resources.placement=scatter", ["policy.resources.placement", "pack, spread, strict_pack, strict_spread"]),
        ("rollout.placement=scatter", ["rollout.placement", "pack, spread, strict_pack, strict_spread"]),
        ("rollout.num_gpus=-1", ["rollout.num_gpus", ">= 0"]),
        ("rollout.partial_tokens=-1", ["rollout.partial_tokens", ">= 0"]),
        ("algorithm.off_policy_correction=clip", ["algorithm.off_policy_correction", "tis, mis_token"]),
        ("algorithm.is_cap=0.5", ["algorithm.is_cap", ">= 1"]),
        ("algorithm.oversample_factor=0.5", ["algorithm.oversample_factor", ">= 1"]),
        ("algorithm.is_high=0.9", ["algorithm.is_low / is_high", "0.5, 0.9"]),
    ],
)
def test_out_of_range(override, words):
    msg = err([override])
    for w in words:
        assert w in msg


def test_colocation_arithmetic_and_mode():
    msg = err(["rollout.colocate_with=policy", "rollout.num_engines=3", "policy.parallel.dp=2"])
    assert "rollout.num_engines=3" in msg and "tp x pp x dp = 1 x 1 x 2 = 2" in msg
    msg = err(["rollout.colocate_with=policy", "rollout.mode=one_step_off"])
    assert "rollout.mode=sync (got one_step_off)" in msg


def test_async_mode_fields():
    cfg = load_config(None, BASE + ["rollout.mode=async", "rollout.partial_tokens=4", "rollout.max_tokens=16"])
    assert (cfg.rollout.mode, cfg.rollout.partial_tokens, cfg.rollout.max_staleness) == ("async", 4, 1)
    assert "only rollout.mode=async does (got sync)" in err(["rollout.partial_tokens=4", "rollout.max_tokens=16"])
    msg = err(["rollout.mode=async", "rollout.partial_tokens=3", "rollout.max_tokens=16"])
    assert "rollout.partial_tokens=3 must divide rollout.max_tokens=16" in msg and "16 % 3 = 1" in msg
    assert "rollout.tools / rollout.env" in err(["rollout.mode=async", "rollout.tools=[calculator]"])
    msg = err(["rollout.mode=async", "rollout.partial_tokens=4", "rollout.max_tokens=16", "rollout.stop=[END]"])
    assert "stop string split across two rounds" in msg


def test_warm_start_target_needs_the_megatron_loop_and_held_out_prompts():
    assert "(0, 1]" in err(["model.warm_start_target_accuracy=1.5", "model.warm_start_backend=megatron"])
    assert "model.warm_start_backend=megatron" in err(["model.warm_start_target_accuracy=0.4"])
    msg = err(["model.warm_start_target_accuracy=0.4", "model.warm_start_backend=megatron", "data.val_size=0"])
    assert "data.val_size or data.val_file" in msg


def test_off_policy_correction_needs_the_recomputed_logprobs():
    msg = err(["algorithm.off_policy_correction=tis", "algorithm.old_logprobs=rollout"])
    assert "off_policy_correction=tis" in msg and "algorithm.old_logprobs=recompute or in_update (got rollout)" in msg


def test_old_logprobs_in_update_needs_one_optimizer_step():
    cfg = load_config(None, BASE + ["algorithm.old_logprobs=in_update", "algorithm.off_policy_correction=tis"])
    assert cfg.algorithm.old_logprobs == "in_update"
    msg = err(["algorithm.old_logprobs=in_update", "algorithm.ppo_epochs=2", "algorithm.mini_batches=2"])
    assert "algorithm.ppo_epochs x algorithm.mini_batches = 2 x 2 = 4 steps" in msg
    msg = err(["algorithm.old_logprobs=in_update", "algorithm.off_policy_correction=mis_token"])
    assert "off_policy_correction=mis_token" in msg and "off_policy_correction=tis" in msg
    msg = err(["algorithm.old_logprobs=in_update", "algorithm.kl_in_reward=true", "algorithm.kl_coef=0.1"])
    assert "algorithm.kl_in_reward" in msg


def test_parallel_divisibility():
    assert "4 attention heads" in err(["policy.parallel.tp=3"])
    assert "2 KV groups" in err(["policy.parallel.tp=4"])
    assert "2 layers" in err(["policy.parallel.pp=4"])
    assert "critic.parallel.pp" in err(["algorithm.name=ppo", "critic.enabled=true", "critic.parallel.pp=3"])


def test_context_parallel_fields():
    assert load_config(None, BASE + ["policy.parallel.cp=2"]).policy.parallel.cp == 2
    assert "policy.parallel.cp: expected an integer >= 1, got 0" in err(["policy.parallel.cp=0"])
    msg = err(["policy.parallel.cp=2", "policy.parallel.pp=2"])
    assert "policy.parallel.cp=2: context parallelism does not run with pipeline parallelism" in msg


def test_batch_arithmetic_explained():
    msg = err(["data.prompts_per_step=3", "rollout.n=3", "policy.micro_batch_size=2"])
    assert "micro batch x gradient accumulation x DP" in msg and "= 2" in msg
    msg = err(["data.prompts_per_step=3", "rollout.n=3", "algorithm.mini_batches=2"])
    assert "prompts x samples per prompt" in msg and "= 9" in msg
    msg = err(["algorithm.name=sft", "trainer.global_batch_size=10", "policy.micro_batch_size=4"])
    assert "trainer.global_batch_size=10" in msg and "micro batch x gradient accumulation x DP" in msg


def test_missing_and_garbled_yaml(tmp_path):
    assert "does not exist" in err([], path=tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  preset: [unclosed\n")
    msg = err([], path=bad)
    assert "not valid YAML" in msg and "line" in msg


def test_invalid_override_syntax():
    assert "invalid override 'a.b='" in err(["a.b="])
    assert "invalid override 'nokey'" in err(["nokey"])


def test_model_required_and_checked(tmp_path):
    with pytest.raises(ConfigError, match="model.path .* or model.preset"):
        load_config(None, [])
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config(None, ["model.preset=huge"])
    with pytest.raises(ConfigError, match="config.json"):
        load_config(None, [f"model.path={tmp_path}"])


def test_real_model_folder_divisibility(tiny_model_factory):
    path = tiny_model_factory("tiny-llama")
    with pytest.raises(ConfigError, match="tp=3 does not divide the 4 attention heads"):
        load_config(None, [f"model.path={path}", "policy.parallel.tp=3"])


# ---- choices come from the algorithms registries --------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("algorithm.kl_kind", "kl"),  # verl's name for k1
        ("algorithm.kl_kind", "low_var_kl+"),
        ("algorithm.kl_kind", "mse"),
        ("algorithm.kl_kind", "abs+"),
        ("algorithm.loss_agg_mode", "token-sum"),
        ("algorithm.adv_estimator", "rloo"),
        ("algorithm.kl_ctrl", "adaptive"),
        ("reward.fn", "math_exact_match"),
    ],
)
def test_registry_names_and_verl_aliases_accepted(field, value):
    cfg = load_config(None, BASE + [f"{field}={value}"])
    section, key = field.split(".")
    assert getattr(getattr(cfg, section), key) == value


@pytest.mark.parametrize(
    "field, listed",
    [
        ("algorithm.kl_kind", ["k1", "kl", "low_var_kl", "k3+", "mse+"]),
        ("algorithm.loss_agg_mode", ["token-mean", "token-sum", "seq-mean-token-sum-norm"]),
        ("algorithm.adv_estimator", ["gae", "grpo", "rloo", "reinforce_plus_plus_baseline"]),
        ("algorithm.kl_ctrl", ["fixed", "adaptive"]),
        ("reward.fn", ["exact_match", "math_exact_match", "module:function"]),
    ],
)
def test_unknown_choice_names_field_and_lists_registry(field, listed):
    msg = err([f"{field}=nope"])
    assert msg.startswith(f"{field}: expected one of ") and msg.endswith(", got 'nope'")
    choices = msg.removeprefix(f"{field}: expected one of ").removesuffix(", got 'nope'").split(", ")
    assert set(listed) <= set(choices)


def test_newly_registered_estimator_and_reward_need_no_config_edit(monkeypatch):
    from algorithms import advantages, rewards

    monkeypatch.setattr(advantages, "_REGISTRY", dict(advantages._REGISTRY))
    monkeypatch.setattr(rewards, "_REGISTRY", dict(rewards._REGISTRY))
    assert "my_baseline" not in err(["algorithm.adv_estimator=nope"])
    advantages.register_advantage_estimator("my_baseline")(advantages.rloo)
    rewards.register_reward("my_reward")(lambda prompt, response, ground_truth: 1.0)
    cfg = load_config(None, BASE + ["algorithm.adv_estimator=my_baseline", "reward.fn=my_reward"])
    assert cfg.algorithm.adv_estimator == "my_baseline" and cfg.reward.fn == "my_reward"


@pytest.mark.parametrize("key", ["trainer.log_every", "policy.resources.colocate_with"])
def test_removed_knobs_are_unknown_keys(key):
    msg = err([f"{key}=1"])
    assert f"unknown key '{key}'" in msg


def test_config_reference_documents_aliases_and_dual_clip():
    from algorithms import AGG_MODES, KL_ALIASES
    from rlhf.config.schema import AlgorithmConfig

    doc = AlgorithmConfig.__doc__ or ""
    for alias, ours in KL_ALIASES.items():
        assert f"{alias} = {ours}" in doc
    for mode in AGG_MODES:
        assert mode in doc
    assert "clip_c: null" in doc and "c = 3" in doc
    assert AlgorithmConfig().clip_c is None


def test_every_shipped_config_is_a_learning_example_and_validates(monkeypatch):
    """Each configs/*.yaml is in `make examples` (examples/learning.py EXAMPLES) with a promise, each example
    has its config, and every shipped config loads and passes validation as it is (no workers)."""
    import importlib.util
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("learning", repo / "examples" / "learning.py")
    learning = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "learning", learning)  # its dataclasses look their module up
    spec.loader.exec_module(learning)
    shipped = {p.stem: p for p in (repo / "configs").glob("*.yaml")}
    examples = {e.name: e for e in learning.EXAMPLES}
    assert sorted(shipped) == sorted(examples), "every configs/*.yaml is one examples/learning.py entry"
    for name, path in sorted(shipped.items()):
        assert examples[name].promise.strip() and examples[name].metric, name
        cfg = load_config(path)  # validates
        assert cfg.model.path or cfg.model.preset, name


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from rlhf.tiny_models import build_tokenizer

    return build_tokenizer(512)


@pytest.mark.parametrize("name", ["grpo_tiny_tools", "grpo_tiny_code"])
def test_agent_example_configs_load_and_fit_their_task(name, tiny_tokenizer):
    """The tool and code examples load and validate as shipped, and each turn's token budget holds what the
    warm start teaches the policy to write (the calculator call; the longest reference solution)."""
    from rlhf.data import code_tasks, tool_tasks

    cfg = load_config(f"configs/{name}.yaml")
    tok = tiny_tokenizer
    r = cfg.rollout
    if name == "grpo_tiny_tools":
        assert (cfg.data.task, r.tools, cfg.reward.fn) == ("multiply_tool", ["calculator"], "exact_match")
        call = len(tok(tool_tasks.call_text("999*999"), add_special_tokens=False)["input_ids"]) + 1
        answer = len(tok(str(999 * 999))["input_ids"]) + 1
        tool_turn = len(tok(f"<|im_end|>\n<|im_start|>tool\n{999 * 999}<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
        assert r.max_tokens >= call and r.max_total_tokens >= call + tool_turn + answer, (call, tool_turn, answer)
        assert r.max_turns >= 2
    else:
        assert (cfg.data.task, cfg.reward.fn, r.tools) == ("code_functions", "rlhf.eval.code:unit_test_pass_rate", [])
        longest = max(len(tok(code_tasks.solution(t))["input_ids"]) + 1 for t in code_tasks.all_tasks())
        assert r.max_tokens >= longest, longest


@pytest.mark.parametrize("override, words", [
    ("algorithm.dpo.nll_coef=-0.5", "algorithm.dpo.nll_coef: expected a number >= 0"),
    ("algorithm.dpo.beta=0", "algorithm.dpo.beta: expected a number > 0"),
    ("algorithm.dpo.label_smoothing=0.5", "algorithm.dpo.label_smoothing: expected a probability in [0, 0.5)"),
    ("algorithm.dpo.orpo_lambda=-1", "algorithm.dpo.orpo_lambda: expected a number >= 0"),
    ("algorithm.dpo.loss=orpo algorithm.dpo.label_smoothing=0.1", "algorithm.dpo.label_smoothing applies to the "
     "sigmoid and simpo losses, not orpo"),
    ("algorithm.dpo.loss=orpo algorithm.dpo.nll_coef=0.5", "algorithm.dpo.nll_coef: orpo already adds"),
])
def test_dpo_settings_checked(override, words):
    assert err(["algorithm.name=dpo", "data.task=arithmetic", *override.split()]).startswith(words)


def test_optimizer_cpu_offload_is_refused_without_cuda():
    msg = err(["policy.optim.cpu_offload=true", "policy.optim.use_distributed_optimizer=true"])
    assert "policy.optim.cpu_offload" in msg and "false on a CPU run" in msg and "host memory already" in msg
    assert "policy.optim.use_distributed_optimizer=true" in err(["policy.optim.cpu_offload=true"])
