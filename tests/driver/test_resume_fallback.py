"""`--resume` never loses history. One real SFT run (tiny model, Ray, megatron-core; a checkpoint after each
of its 3 steps) is copied and damaged per test:
- `latest` unusable (garbage, empty, missing, naming a missing step): the newest intact step is used, said in
  one line;
- `latest` naming a path outside checkpoints/ (absolute, `..`, a link leaving it): refused in one line;
- the newest step damaged (a truncated shard, a truncated driver_state.json): the run resumes from the step
  before, keeps every metrics row and the damaged folder, and overwrites nothing it did not load from;
- no intact step: refused in one line (exit 2), with metrics and checkpoints untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from rlhf.cli import main as rlhf_main

REPO = Path(__file__).resolve().parents[2]
SFT = [str(REPO / "configs" / "sft_tiny.yaml"), "trainer.total_steps=3", "trainer.save_every=1",
       "trainer.val_every=0", "trainer.eval_iters=0", "trainer.export_hf=false", "trainer.progress_bar=false",
       "trainer.tensorboard=false", "trainer.global_batch_size=4", "policy.micro_batch_size=2",
       "data.seq_length=64", "policy.optim.warmup_steps=0", "policy.resources.num_cpus_per_worker=0.5"]


def digests(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def train(out: Path, *extra: str) -> int:
    return rlhf_main(["train", *SFT, f"trainer.output_dir={out}", *extra])


@pytest.fixture(scope="module")
def base_run(ray_session, tmp_path_factory):
    """The real 3-step run (checkpoints step-000001..3, latest -> step-000003), on the shared Ray."""
    out = tmp_path_factory.mktemp("resume") / "base"
    assert train(out) == 0
    return out


@pytest.fixture
def run(base_run, tmp_path) -> Path:
    """A copy of the base run to damage."""
    out = tmp_path / "run"
    shutil.copytree(base_run, out, symlinks=True)
    return out


def ckpts(run: Path) -> Path:
    return run / "checkpoints"


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def a_shard(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "policy").rglob("*") if p.is_file() and p.suffix == ".distcp"),
               key=lambda p: p.stat().st_size)


def one_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_base_run_has_three_checkpoints(base_run):
    names = sorted(p.name for p in ckpts(base_run).iterdir())
    assert names == ["latest", "step-000001", "step-000002", "step-000003"], names
    assert [json.loads(x)["step"] for x in (base_run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


@pytest.mark.parametrize("pointer", [b"\xff\xfe\x00garbage", b"", None, b"step-000009", b"not a step"])
def test_unusable_latest_falls_back_to_the_newest_intact_step(run, pointer):
    from rlhf.driver.infra.run_checkpoints import CheckpointManager

    if pointer is None:
        (ckpts(run) / "latest").unlink()
    else:
        (ckpts(run) / "latest").write_bytes(pointer)
    path, note = CheckpointManager(run).resume_point(trust=False)
    assert path == ckpts(run) / "step-000003"
    assert note is not None and "\n" not in note, note
    assert str(ckpts(run) / "latest") in note and "resuming from step-000003" in note, note
    why = {b"": "not a step folder", None: "is missing", b"step-000009": "step-000009, which does not exist",
           b"not a step": "not a step folder"}.get(pointer, "unreadable")
    assert why in note, note


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "nested_dotdot", "link"])
def test_latest_leaving_the_checkpoints_folder_is_refused(run, tmp_path, capsys, kind):
    outside = tmp_path / "elsewhere"
    shutil.copytree(ckpts(run) / "step-000003", outside / "step-000003")
    pointer = {"absolute": str(outside / "step-000003"), "dotdot": "../../elsewhere/step-000003",
               "nested_dotdot": "step-000003/../../../elsewhere/step-000003", "link": "step-000007"}[kind]
    if kind == "link":
        (ckpts(run) / "step-000007").symlink_to(outside / "step-000003")
    (ckpts(run) / "latest").write_text(pointer)
    metrics, before = (run / "metrics.jsonl").read_bytes(), {p.name: digests(p) for p in ckpts(run).glob("step-*")}
    assert train(run, "--resume") == 2
    err = one_line(capsys.readouterr().err)
    assert str(ckpts(run) / "latest") in err and "outside" in err, err
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert {p.name: digests(p) for p in ckpts(run).glob("step-*")} == before


def test_truncated_shard_is_damage_and_the_step_before_is_used(run, capsys):
    """A shard cut short in the newest step is reported as damage naming the file and the step used
    instead, not as a trust problem; with every step damaged, the refusal names the file (exit 2)."""
    from rlhf.driver.infra.run_checkpoints import CheckpointManager

    shard = a_shard(ckpts(run) / "step-000003")
    truncate(shard)
    path, note = CheckpointManager(run).resume_point(trust=False)
    assert path == ckpts(run) / "step-000002", note
    assert note is not None and "\n" not in note
    assert "damaged" in note and shard.name in note and "resuming from step-000002" in note, note
    assert "--trust-checkpoint" not in note, note
    for step in ("step-000001", "step-000002"):
        truncate(a_shard(ckpts(run) / step))
    metrics = (run / "metrics.jsonl").read_bytes()
    assert train(run, "--resume") == 2
    err = one_line(capsys.readouterr().err)
    assert "cannot resume" in err and "damaged" in err and shard.name in err and "--trust-checkpoint" not in err, err
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_no_step_with_a_readable_driver_state_is_refused_in_one_line(run, capsys):
    for step_dir in ckpts(run).glob("step-*"):
        truncate(step_dir / "driver_state.json")
    metrics, before = (run / "metrics.jsonl").read_bytes(), {p.name: digests(p) for p in ckpts(run).glob("step-*")}
    assert train(run, "--resume") == 2
    err = one_line(capsys.readouterr().err)
    assert "cannot resume" in err and "driver_state.json is damaged" in err and "step-000003" in err, err
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert {p.name: digests(p) for p in ckpts(run).glob("step-*")} == before


def test_resume_past_a_damaged_step_keeps_history(run, capsys):
    """latest -> step-000003 whose driver_state.json is cut short: the run says so in one line, resumes from
    step-000002, redoes step 3, keeps every earlier metrics row (after them a marker that `read_metrics`
    applies) and keeps the damaged folder aside; steps 1 and 2 are untouched."""
    from rlhf.driver.infra.metrics import read_metrics

    truncate(ckpts(run) / "step-000003" / "driver_state.json")
    damaged = digests(ckpts(run) / "step-000003")
    kept = {s: digests(ckpts(run) / s) for s in ("step-000001", "step-000002")}
    metrics = (run / "metrics.jsonl").read_bytes()
    assert train(run, "--resume") == 0
    out = capsys.readouterr().out
    notes = [x for x in out.splitlines() if x.startswith("resume:")]
    assert len(notes) == 1, out
    assert ("latest names step-000003" in notes[0] and "driver_state.json is damaged" in notes[0]
            and "resuming from step-000002" in notes[0]), notes[0]
    assert f"resumed from {ckpts(run) / 'step-000002'} at step 2" in out
    raw = (run / "metrics.jsonl").read_bytes()
    assert raw.startswith(metrics), "a row logged before the resume was changed or dropped"
    added = [json.loads(x) for x in raw[len(metrics):].decode().splitlines()]
    assert added[0]["resumed_at_step"] == 2 and added[0]["superseded_rows"] == 1, added
    assert [r["step"] for r in added[1:]] == [3]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1] == added[-1]
    assert {s: digests(ckpts(run) / s) for s in kept} == kept
    aside = [p for p in ckpts(run).iterdir() if p.name.startswith("step-000003.replaced-")]
    assert len(aside) == 1 and digests(aside[0]) == damaged, sorted(p.name for p in ckpts(run).iterdir())
    assert json.loads((ckpts(run) / "step-000003" / "driver_state.json").read_text())["step"] == 3
    assert (ckpts(run) / "latest").read_text() == "step-000003"


def test_a_save_keeps_a_newer_step_it_did_not_load_from(run):
    """latest rolled back to step-000001 while steps 2 and 3 are intact: the resumed run's save of step 2
    keeps the earlier step-000002, renamed, byte for byte."""
    from rlhf.driver.infra.run_checkpoints import CheckpointManager

    (ckpts(run) / "latest").write_text("step-000001")
    mgr = CheckpointManager(run)
    assert mgr.resume_point(trust=False) == (ckpts(run) / "step-000001", None)
    before = digests(ckpts(run) / "step-000002")
    mgr.save(2, {"rng": None}, lambda tmp: (tmp / "policy").mkdir())
    aside = [p for p in ckpts(run).iterdir() if p.name.startswith("step-000002.replaced-")]
    assert len(aside) == 1 and digests(aside[0]) == before
    assert sorted(os.listdir(ckpts(run) / "step-000002")) == ["driver_state.json", "policy"]
