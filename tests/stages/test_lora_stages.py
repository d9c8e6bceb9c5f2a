"""SFT and DPO with `policy.lora` on the real stack (Ray actors, megatron-core over gloo, CPU): the loss falls
with only the adapters trained, the frozen weights come out of the export unchanged, and the export carries
the PEFT adapter. (GRPO with LoRA: tests/driver/test_rl_e2e.py; the engine-level guarantees: tests/megatron/
test_lora.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlhf.config import load_config
from rlhf.driver.infra.metrics import read_metrics
from tests.helpers.lm import lm_overrides

LORA = ["policy.lora.rank=4", "policy.lora.alpha=8", "policy.optim.lr=1e-2", "trainer.export_hf=true"]


def weights(folder: str | Path) -> dict:
    return {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def check_export(out: Path, base: str) -> None:
    """Frozen tensors equal the base model's; adapted linears moved; the PEFT adapter is there."""
    before, after = weights(base), weights(out / "hf")
    assert before.keys() == after.keys()
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert (after[name] == before[name]).all(), name
    assert (after["model.layers.0.self_attn.q_proj.weight"] - before["model.layers.0.self_attn.q_proj.weight"]
            ).abs().max() > 1e-4
    assert (out / "hf" / "adapter" / "adapter_config.json").is_file()


def test_sft_with_lora(ray_session, lm_inputs, tmp_path):
    from rlhf.driver.stages.lm import run_lm

    out = tmp_path / "sft"
    run_lm(load_config(None, lm_overrides(lm_inputs, "sft", out, "trainer.total_steps=3", *LORA)))
    loss = {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
    assert loss[3] < loss[1] - 0.05, loss
    check_export(out, lm_inputs["model"])


def test_dpo_with_lora(ray_session, lm_inputs, tmp_path):
    import json
    import random

    from rlhf.data.arithmetic import preference_record, split_pairs
    from rlhf.driver.stages.dpo import run_dpo

    train, _ = split_pairs(seed=0, val_size=16)
    rng = random.Random(0)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(preference_record(a, b, rng)) + "\n" for a, b in train[:8]))
    out = tmp_path / "dpo"
    cfg = load_config(None, [
        f"model.path={lm_inputs['model']}", "algorithm.name=dpo", "algorithm.dpo.beta=0.5", f"data.train_file={pairs}",
        "data.seq_length=32", "trainer.total_steps=3", "trainer.global_batch_size=8", "policy.micro_batch_size=4",
        "trainer.eval_iters=0", "trainer.progress_bar=false", "trainer.tensorboard=false",
        "policy.resources.num_cpus_per_worker=0.5", f"trainer.output_dir={out}", *LORA])
    run_dpo(cfg)
    loss = {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
    assert loss[1] == pytest.approx(math.log(2), abs=1e-5)  # B = 0 at the start: the policy is the reference
    assert loss[3] < loss[1] - 0.01, loss
    check_export(out, lm_inputs["model"])
