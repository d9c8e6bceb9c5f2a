"""DPO end to end on the real stack (Ray actors, megatron-core over gloo, CPU), and its bad-input errors.

Run A: sigmoid DPO at TP1, 4 steps on the same 8 arithmetic pairs (correct vs wrong sum), validation on 16
held-out pairs, reference log-probs precomputed, a checkpoint at step 2. The reference log-probs must equal
transformers' on the HF model, the first step's loss is exactly log 2 (policy = reference) and the loss
falls. Then, 2 steps each: TP2, DP2 and PP2 (the PP2 run with `reference: group`, a frozen reference worker
group) give A's update; A resumed from its step-2 checkpoint gives A's steps 3 and 4; IPO, SimPO and ORPO
(reference-free: no reference pass or group) run end to end. (Learning on the arithmetic task is the
`dpo_tiny` example's job, in `make examples`.)
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from rlhf.config import load_config
from rlhf.driver.infra.metrics import read_metrics
from rlhf.errors import UserError


def overrides(files: dict[str, str], out: Path, *extra: str) -> list[str]:
    return [f"model.path={files['model']}", "algorithm.name=dpo", "algorithm.dpo.beta=0.5",
            f"data.train_file={files['train']}", f"data.val_file={files['val']}", "data.seq_length=32",
            "trainer.total_steps=4", "trainer.global_batch_size=8", "policy.micro_batch_size=4",
            "policy.optim.lr=1e-3", "policy.optim.warmup_steps=0", "policy.optim.lr_decay_style=constant",
            "trainer.eval_iters=1", "trainer.progress_bar=false", "trainer.tensorboard=false",
            "trainer.export_hf=false", "policy.resources.num_cpus_per_worker=0.5",
            "reference.resources.num_cpus_per_worker=0.5", f"trainer.output_dir={out}", *extra]


def run(files: dict, out: Path, *extra: str) -> list[dict]:
    from rlhf.driver.stages.dpo import run_dpo

    run_dpo(load_config(None, overrides(files, out, *extra)))
    return read_metrics(out)


@pytest.fixture(scope="module")
def run_a(ray_session, pair_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo_a")
    return out, run(pair_files, out, "trainer.save_every=2")


def hf_answer_logps(model_dir: str, batch: dict, side: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch[f"{side}_tokens"]).logits.float()
    logp = torch.log_softmax(logits, -1).gather(-1, batch[f"{side}_labels"][..., None])[..., 0]
    return (logp * batch[f"{side}_loss_mask"]).sum(-1)


def test_dpo_learns_with_reference_and_validation(run_a, pair_files):
    from safetensors.torch import load_file

    from rlhf.data.preference_pairs import PairDataset

    out, rows = run_a
    by = {r["step"]: r for r in rows}
    assert sorted(s for s in by if s > 0) == [1, 2, 3, 4]
    assert by[1]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # step 1: the policy is the reference
    assert by[1]["rewards/margin"] == pytest.approx(0.0, abs=1e-5)
    losses = [by[s]["loss"] for s in (1, 2, 3)]
    assert losses[2] < losses[1] < losses[0] - 0.01, losses  # the same 8 pairs every step
    assert by[3]["rewards/margin"] > 0 and by[3]["rewards/accuracy"] > 0.5
    assert by[3]["logps/chosen"] < 0 and by[3]["logps/rejected"] < 0
    assert by[0]["val/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert by[4]["val/loss"] != by[0]["val/loss"] and 0 <= by[4]["val/rewards/accuracy"] <= 1
    ref = load_file(str(out / "reference_logps.safetensors"))
    ds = PairDataset(pair_files["train"], pair_files["model"], 32)
    batch = ds.collate([ds[i] for i in range(8)])
    for side in ("chosen", "rejected"):
        want = hf_answer_logps(pair_files["model"], batch, side)
        assert torch.allclose(ref[f"train_{side}"][:8], want, atol=1e-4), (ref[f"train_{side}"][:8], want)


@pytest.mark.parametrize("layout", [
    pytest.param(("policy.parallel.tp=2",), marks=pytest.mark.slow),
    pytest.param(("policy.parallel.dp=2",), marks=pytest.mark.slow),
    ("policy.parallel.pp=2", "algorithm.dpo.reference=group"),  # and the reference from a frozen group
], ids=["tp2", "dp2", "pp2-reference-group"])
def test_layouts_give_the_tp1_update(run_a, pair_files, tmp_path, layout):
    out = tmp_path / "run"
    rows = run(pair_files, out, *layout, "trainer.total_steps=2", "trainer.eval_iters=0")
    a = {r["step"]: r for r in run_a[1]}
    b = {r["step"]: r for r in rows}
    for step in (1, 2):
        for key in ("loss", "rewards/margin", "logps/chosen"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-5), (step, key)
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-3)
    group = "algorithm.dpo.reference=group" in layout
    assert (out / "reference_logps.safetensors").exists() != group  # a group computes them as the steps run
    assert ("time/reference" in b[1]) == group


def test_resume_two_plus_two_equals_four(run_a, pair_files, tmp_path):
    """Run A resumed in new workers from its step-2 checkpoint, with the run dir's reference cache."""
    out_a, rows_a = run_a
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(out_a / "checkpoints" / "step-000002", out / "checkpoints" / "step-000002")
    (out / "checkpoints" / "latest").write_text("step-000002")
    shutil.copy2(out_a / "reference_logps.safetensors", out / "reference_logps.safetensors")
    rows = run(pair_files, out, "trainer.save_every=2", "trainer.resume=auto")
    assert [r["step"] for r in rows] == [3, 4]
    want, got = {r["step"]: r for r in rows_a}, {r["step"]: r for r in rows}
    for key in ("loss", "grad_norm", "lr", "rewards/margin", "consumed_samples", "val/loss"):
        for step in (3, 4):
            if key in want[step]:
                assert got[step][key] == pytest.approx(want[step][key], rel=1e-6, abs=1e-7), (key, step)


@pytest.mark.parametrize("loss", ["ipo", "simpo"])
def test_ipo_and_simpo_train_end_to_end(ray_session, pair_files, tmp_path, loss):
    out = tmp_path / loss
    rows = run(pair_files, out, f"algorithm.dpo.loss={loss}", "trainer.total_steps=2", "trainer.eval_iters=0",
               *(["algorithm.dpo.beta=2.0", "algorithm.dpo.simpo_gamma=0.5"] if loss == "simpo" else []))
    by = {r["step"]: r for r in rows}
    if loss == "ipo":  # policy = reference at step 1: every log-ratio is 0, the loss (0 - 1 / (2 beta))^2
        assert by[1]["loss"] == pytest.approx(1.0, abs=1e-5) and by[1]["rewards/margin"] == pytest.approx(0, abs=1e-6)
    else:  # reference-free: no reference pass; the margin is beta x the length-normalised log-prob gap
        assert not (out / "reference_logps.safetensors").exists()
        assert by[1]["rewards/margin"] != 0 and by[1]["rewards/chosen"] < 0
    assert by[2]["loss"] < by[1]["loss"] and math.isfinite(by[2]["grad_norm"]), (by[1], by[2])


def test_orpo_trains_without_a_reference(ray_session, pair_files, tmp_path, monkeypatch):
    """ORPO is reference-free: even with `reference: group` neither the reference pass nor the group starts
    (both replaced here by functions that fail); the loss (chosen NLL + lambda x odds-ratio term) falls on the
    same 8 pairs and the log-odds margin grows."""
    import rlhf.driver.stages.dpo as dpo

    def no_reference(*_: object, **__: object) -> None:
        raise AssertionError("orpo started a reference")

    monkeypatch.setattr(dpo, "reference_group", no_reference)
    monkeypatch.setattr(dpo, "reference_logps", no_reference)
    out = tmp_path / "orpo"
    rows = run(pair_files, out, "algorithm.dpo.loss=orpo", "algorithm.dpo.orpo_lambda=1.0",
               "algorithm.dpo.reference=group", "trainer.total_steps=3", "trainer.eval_iters=0")
    by = {r["step"]: r for r in rows}
    assert not (out / "reference_logps.safetensors").exists() and "time/reference" not in by[1]
    first, last = by[1], by[3]
    assert first["rewards/chosen"] < 0 and first["orpo/or_loss"] > 0  # log odds of p < 1/2; -log sigmoid > 0
    assert first["loss"] == pytest.approx(first["nll/chosen"] + first["orpo/or_loss"], rel=1e-5)
    assert last["loss"] < by[2]["loss"] < first["loss"], (first, by[2], last)
    assert last["rewards/margin"] > first["rewards/margin"] and last["orpo/or_loss"] < first["orpo/or_loss"]
    assert math.isfinite(last["grad_norm"]), last


@pytest.mark.parametrize("record,message", [
    ({"prompt": "What is 1+1?", "chosen": "2", "rejected": "2"}, "chosen and rejected are the same answer"),
    ({"prompt": "What is 1+1?", "chosen": " ", "rejected": "3"}, "the chosen answer is empty"),
    ({"messages": [{"role": "user", "content": "hi"}], "chosen": "a", "rejected": ""}, "the rejected answer is empty"),
    ({"prompt": "What is 1+1?", "chosen": "2"}, "missing key 'rejected'"),
])
@pytest.mark.parametrize("algo", ["dpo", "rm"])
def test_bad_pairs_name_the_line_before_any_model_work(tmp_path, record, message, algo):
    from rlhf.driver.warmstart.prepare import prepare_inputs

    good = {"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    cfg = load_config(None, [f"algorithm.name={algo}", "model.preset=tiny-qwen2", f"data.train_file={path}",
                             f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(UserError) as e:
        prepare_inputs(cfg)
    assert str(e.value).startswith(f"{path}:2: ") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run" / "model").exists()  # failed before the model was created


def test_pair_encoding_masks_only_the_answer(tiny_model_factory):
    from rlhf.data.preference_pairs import encode_answer, parse_pair
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
    from rlhf.driver.stages.pairs import build_pair_data

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
