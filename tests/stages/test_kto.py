"""KTO as a stage (`algorithm.dpo.loss=kto`) end to end on the real stack, 2 steps on the 8 arithmetic pairs
(tests/stages/conftest.py): each pair is a desirable and an undesirable example; the KL baseline z0 comes from
each prompt with the next pair's chosen answer, under the policy and the reference.

Step 1 (policy = reference, so every log-ratio and z0 are 0) has the loss 1 - sigmoid(0) = 0.5 exactly; the loss
falls at step 2. The reference's log-probs of the mismatched rows equal transformers' on the HF model; the
reference group computes the same numbers as the precomputed cache (the same losses, step by step)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rlhf.config import load_config
from rlhf.errors import ConfigError


def kto_overrides(files: dict[str, str], out: Path, *extra: str) -> list[str]:
    return [f"model.path={files['model']}", "algorithm.name=dpo", "algorithm.dpo.loss=kto", "algorithm.dpo.beta=0.5",
            f"data.train_file={files['train']}", f"data.val_file={files['val']}", "data.seq_length=32",
            "trainer.total_steps=2", "trainer.global_batch_size=8", "policy.micro_batch_size=4",
            "policy.optim.lr=1e-3", "policy.optim.warmup_steps=0", "policy.optim.lr_decay_style=constant",
            "trainer.eval_iters=1", "trainer.progress_bar=false", "trainer.tensorboard=false",
            "trainer.export_hf=false", "policy.resources.num_cpus_per_worker=0.5",
            "reference.resources.num_cpus_per_worker=0.5", f"trainer.output_dir={out}", *extra]


def kto_run(files: dict[str, str], out: Path, *extra: str) -> dict[int, dict]:
    from rlhf.driver.infra.metrics import read_metrics
    from rlhf.driver.stages.dpo import run_dpo

    run_dpo(load_config(None, kto_overrides(files, out, *extra)))
    return {r["step"]: r for r in read_metrics(out)}


@pytest.fixture(scope="module")
def precomputed(ray_session, pair_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("kto")
    return out, kto_run(pair_files, out)


def test_kto_trains_from_half_and_logs_its_baseline(precomputed):
    _, by = precomputed
    assert sorted(s for s in by if s > 0) == [1, 2]
    assert by[1]["loss"] == pytest.approx(0.5, abs=1e-6)  # policy = reference: 1 - sigmoid(0) per example
    assert by[1]["kto/kl_baseline"] == pytest.approx(0.0, abs=1e-6) and by[1]["rewards/margin"] == pytest.approx(0.0, abs=1e-5)
    assert by[0]["val/loss"] == pytest.approx(0.5, abs=1e-6) and "val/kto/kl_baseline" in by[0]
    assert by[2]["loss"] < by[1]["loss"] - 1e-3, (by[1], by[2])  # the same 8 pairs every step
    assert by[2]["rewards/margin"] > 0 and by[2]["kto/kl_baseline"] >= 0 and math.isfinite(by[2]["grad_norm"])


def test_the_baseline_rows_are_each_prompt_with_the_next_pairs_answer(precomputed, pair_files):
    """The cached reference log-probs of the mismatched rows equal transformers' on the HF model, and the rows
    are pair i's question with pair i + 1's chosen answer."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.data.kto_examples import kl_fields
    from rlhf.data.preference_pairs import PairDataset

    out, _ = precomputed
    ref = load_file(str(out / "reference_logps.safetensors"))
    ds = PairDataset(pair_files["train"], pair_files["model"], 32)
    rows = kl_fields(ds, range(len(ds)))
    model = AutoModelForCausalLM.from_pretrained(pair_files["model"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=rows["kl_tokens"]).logits.float()
    logp = torch.log_softmax(logits, -1).gather(-1, rows["kl_labels"][..., None])[..., 0]
    want = (logp * rows["kl_loss_mask"]).sum(-1)
    assert (ref["train_kl"] - want).abs().max() < 1e-4 and "val_kl" in ref
    tok = AutoTokenizer.from_pretrained(pair_files["model"])
    records = [json.loads(line) for line in Path(pair_files["train"]).read_text().splitlines()]
    for i in range(len(ds)):
        ids, mask = rows["kl_tokens"][i], rows["kl_loss_mask"][i]
        answer = tok.decode(rows["kl_labels"][i][mask.bool()])
        prompt = tok.decode(ids[: int(mask.nonzero()[0]) + 1])
        question = records[i]["prompt"] if "prompt" in records[i] else records[i]["messages"][-1]["content"]
        assert question in prompt and records[(i + 1) % len(ds)]["chosen"] in answer, (prompt, answer)


def test_the_reference_group_gives_the_cached_numbers(ray_session, precomputed, pair_files, tmp_path):
    _, want = precomputed
    got = kto_run(pair_files, tmp_path / "group", "algorithm.dpo.reference=group", "trainer.eval_iters=0")
    assert not (tmp_path / "group" / "reference_logps.safetensors").exists() and "time/reference" in got[1]
    for step in (1, 2):
        for key in ("loss", "kto/kl_baseline", "rewards/margin"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-6), (step, key)


@pytest.mark.parametrize("extra,message", [
    ("algorithm.dpo.kto_desirable_weight=0", "algorithm.dpo.kto_desirable_weight"),
    ("algorithm.dpo.kto_undesirable_weight=nan", "algorithm.dpo.kto_undesirable_weight"),
    ("algorithm.dpo.label_smoothing=0.1", "algorithm.dpo.label_smoothing applies to the sigmoid and simpo"),
])
def test_bad_kto_settings_fail_naming_the_field(extra, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.preset=tiny-qwen2", "algorithm.name=dpo", "algorithm.dpo.loss=kto",
                           f"data.train_file={tmp_path / 'pairs.jsonl'}", extra])
