"""`policy.lora` is checked before any worker starts, each problem in one line naming the field (and, for an
unknown target, the names that exist)."""

from __future__ import annotations

import pytest

from rlhf.config import load_config, save_config
from rlhf.errors import ConfigError

BASE = ["model.preset=tiny-qwen2"]


def err(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, BASE + overrides)
    return str(e.value)


def test_lora_is_off_by_default_and_on_with_any_key(tmp_path):
    assert load_config(None, BASE).policy.lora is None
    cfg = load_config(None, [*BASE, "policy.lora.rank=4", "policy.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"])
    lora = cfg.policy.lora
    assert lora is not None and lora.rank == 4 and lora.alpha == 16.0 and lora.scale == 4.0
    assert lora.targets() == ("linear_qkv", "linear_proj")
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
    example = load_config("configs/grpo_tiny_lora.yaml").policy.lora
    assert example is not None and example.targets() == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@pytest.mark.parametrize("overrides,words", [
    (["policy.lora.rank=0"], ["policy.lora.rank", "an integer >= 1", "got 0"]),
    (["policy.lora.alpha=0"], ["policy.lora.alpha", "> 0"]),
    (["policy.lora.dropout=1.5"], ["policy.lora.dropout", "[0, 1)"]),
    (["policy.lora.target_modules=[]"], ["policy.lora.target_modules", "at least one"]),
    (["policy.lora.target_modules=[q_proj,qkv]"],
     ["policy.lora.target_modules: 'qkv' names no module", "linear_qkv, linear_proj, linear_fc1, linear_fc2",
      "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"]),
    (["policy.lora.target_modules=[q_proj,v_proj]"], ["q_proj, v_proj without k_proj", "linear_qkv"]),
    (["policy.lora.target_modules=[gate_proj]"], ["gate_proj without up_proj", "linear_fc1"]),
    (["reference.lora.rank=4"], ["reference.lora", "policy only"]),
    (["policy.lora.rnak=4"], ["did you mean 'policy.lora.rank'"]),
])
def test_bad_lora_settings(overrides, words):
    msg = err(overrides)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg
