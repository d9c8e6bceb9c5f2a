"""A vision-language model's config refuses, before any worker starts, what image batches do not run on yet."""

from __future__ import annotations

import pytest

from rlhf.config.load import load_config
from rlhf.errors import ConfigError

CONFIG = "configs/grpo_shapes_vl.yaml"


@pytest.mark.parametrize("override,message", [
    ("rollout.mode=async", r"rollout.mode=async: the async buffer does not carry image prompts yet \(preset "
                           r"tiny-qwen2-vl is a vision-language model\)"),
    ("policy.parallel.cp=2", r"policy.parallel.cp=2: preset tiny-qwen2-vl is a vision-language model"),
    ("model.warm_start_backend=megatron", r"the Megatron warm start does not take images yet"),
])
def test_unsupported_settings_fail_fast(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIG, [override])


def test_the_shipped_config_validates():
    cfg = load_config(CONFIG)
    assert cfg.data.task == "shapes" and cfg.reward.fn == "text_exact_match" and not cfg.policy.freeze_vision
