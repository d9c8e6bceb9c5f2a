"""DPO end to end on the real stack (Ray actors, megatron-core over gloo, CPU), and its bad-input errors.

Run A: sigmoid DPO at TP1, 3 steps on the same 8 arithmetic pairs (correct vs wrong sum), validation on 16
held-out pairs, reference log-probs precomputed; run B: the same at TP2 for 2 steps. The reference log-probs
must equal transformers' on the HF model, the first step's loss is exactly log 2 (policy = reference), the
loss falls and the update does not depend on the layout. (Learning on the arithmetic task is the
`dpo_tiny` example's job, in `make examples`.)
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from rlhf.config import load_config
from rlhf.driver.metrics import read_metrics
from rlhf.errors import UserError


@pytest.fixture(scope="module")
def pair_files(tiny_model_factory, tmp_path_factory) -> dict[str, str]:
    from rlhf.data.arithmetic import preference_record, split_pairs

    d = tmp_path_factory.mktemp("dpo_data")
    train, val = split_pairs(seed=0, val_size=16)
    rng = random.Random(0)
    for name, pairs in (("train", train[:8]), ("val", val)):  # one global batch: each step sees the same pairs
        recs = [preference_record(a, b, rng) for a, b in pairs]
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return {"model": tiny_model_factory("tiny-qwen2"), "train": str(d / "train.jsonl"), "val": str(d / "val.jsonl")}


def overrides(files: dict[str, str], out: Path, *extra: str) -> list[str]:
    return [f"model.path={files['model']}", "algorithm.name=dpo", "algorithm.dpo.beta=0.5",
            f"data.train_file={files['train']}", f"data.val_file={files['val']}", "data.seq_length=32",
            "trainer.total_steps=3", "trainer.global_batch_size=8", "policy.micro_batch_size=4",
            "policy.optim.lr=1e-3", "policy.optim.warmup_steps=0", "policy.optim.lr_decay_style=constant",
            "trainer.eval_iters=1", "trainer.progress_bar=false", "trainer.tensorboard=false",
            "trainer.export_hf=false", "policy.resources.num_cpus_per_worker=0.5", f"trainer.output_dir={out}",
            *extra]


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from rlhf.config.schema import TrainerConfig
    from rlhf.driver.ray_env import init_ray

    init_ray(TrainerConfig(ray_num_cpus=4))
    yield
    ray.shutdown()


def run(files: dict, out: Path, *extra: str) -> list[dict]:
    from rlhf.driver.dpo import run_dpo

    run_dpo(load_config(None, overrides(files, out, *extra)))
    return read_metrics(out)


@pytest.fixture(scope="module")
def run_a(ray_session, pair_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo_a")
    return out, run(pair_files, out)


def hf_answer_logps(model_dir: str, batch: dict, side: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch[f"{side}_tokens"]).logits.float()
    logp = torch.log_softmax(logits, -1).gather(-1, batch[f"{side}_labels"][..., None])[..., 0]
    return (logp * batch[f"{side}_loss_mask"]).sum(-1)


def test_dpo_learns_with_reference_and_validation(run_a, pair_files):
    from safetensors.torch import load_file

    from rlhf.data.preference import PairDataset

    out, rows = run_a
    by = {r["step"]: r for r in rows}
    assert sorted(s for s in by if s > 0) == [1, 2, 3]
    assert by[1]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # step 1: the policy is the reference
    assert by[1]["rewards/margin"] == pytest.approx(0.0, abs=1e-5)
    losses = [by[s]["loss"] for s in (1, 2, 3)]
    assert losses[2] < losses[1] < losses[0] - 0.01, losses  # the same 8 pairs every step
    assert by[3]["rewards/margin"] > 0 and by[3]["rewards/accuracy"] > 0.5
    assert by[3]["logps/chosen"] < 0 and by[3]["logps/rejected"] < 0
    assert by[0]["val/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert by[3]["val/loss"] != by[0]["val/loss"] and 0 <= by[3]["val/rewards/accuracy"] <= 1
    ref = load_file(str(out / "reference_logps.safetensors"))
    ds = PairDataset(pair_files["train"], pair_files["model"], 32)
    batch = ds.collate([ds[i] for i in range(8)])
    for side in ("chosen", "rejected"):
        want = hf_answer_logps(pair_files["model"], batch, side)
        assert torch.allclose(ref[f"train_{side}"][:8], want, atol=1e-4), (ref[f"train_{side}"][:8], want)


def test_tp2_matches_tp1(run_a, pair_files, tmp_path):
    rows = run(pair_files, tmp_path / "tp2", "policy.parallel.tp=2", "trainer.total_steps=2", "trainer.eval_iters=0")
    a = {r["step"]: r for r in run_a[1]}
    b = {r["step"]: r for r in rows}
    for step in (1, 2):
        for key in ("loss", "rewards/margin", "logps/chosen"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-5), (step, key)
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-3)


@pytest.mark.parametrize("record,message", [
    ({"prompt": "What is 1+1?", "chosen": "2", "rejected": "2"}, "chosen and rejected are the same answer"),
    ({"prompt": "What is 1+1?", "chosen": " ", "rejected": "3"}, "the chosen answer is empty"),
    ({"messages": [{"role": "user", "content": "hi"}], "chosen": "a", "rejected": ""}, "the rejected answer is empty"),
    ({"prompt": "What is 1+1?", "chosen": "2"}, "missing key 'rejected'"),
])
def test_bad_pairs_name_the_line_before_any_model_work(tmp_path, record, message):
    from rlhf.driver.prepare import prepare_inputs

    good = {"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    cfg = load_config(None, ["algorithm.name=dpo", "model.preset=tiny-qwen2", f"data.train_file={path}",
                             f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(UserError) as e:
        prepare_inputs(cfg)
    assert str(e.value).startswith(f"{path}:2: ") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run" / "model").exists()  # failed before the model was created


def test_pair_encoding_masks_only_the_answer(tiny_model_factory):
    from rlhf.data.preference import encode_answer, parse_pair
    from rlhf.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_factory("tiny-qwen2"))
    rec = {"messages": [{"role": "user", "content": "What is 3+4?"}, {"role": "assistant", "content": "hmm"},
                        {"role": "user", "content": "sure?"}], "chosen": "7", "rejected": [
                            {"role": "assistant", "content": "8"}]}
    prompt, chosen, rejected = parse_pair(rec, "f:1")
    assert (chosen, rejected) == ("7", "8")
    ids, mask = encode_answer(tok, prompt, chosen)
    trained = tok.decode(ids[mask.astype(bool)])
    assert trained.startswith("7") and "hmm" not in trained, trained


def test_held_out_pairs_read_their_reference_from_the_train_split(pair_files, tmp_path):
    from rlhf.driver.dpo import build_pair_data

    cfg = load_config(None, overrides(pair_files, tmp_path / "run", "data.val_file=null", "data.val_size=3"))
    data = build_pair_data(cfg)
    assert len(data.order.rows) == 5 and not set(data.order.rows) & set(data.val_rows or [])
    n = len(data.train)
    data.ref = {"train_chosen": torch.arange(n, dtype=torch.float32), "train_rejected": -torch.arange(n).float()}
    val = data.val_batch(3)
    assert val["ref_chosen_logps"].tolist() == [float(i) for i in data.val_rows]
    for row, i in zip(val["chosen_tokens"], data.val_rows, strict=True):
        tokens = data.train[i]["chosen"]["tokens"]
        assert torch.equal(row[: tokens.numel()], tokens)
