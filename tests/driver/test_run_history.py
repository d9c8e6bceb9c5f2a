"""No lost history: `rlhf train` refuses a folder holding a run unless --resume or --force (which moves it
aside), `rlhf clean` refuses an existing output without --force, and a resumed run keeps every metrics row
while `read_metrics` reads each step once."""

from __future__ import annotations

import json

from rlhf.cli import main as rlhf_main
from rlhf.driver.infra.metrics import mark_resume, read_metrics

BAD_DATA = ["data.task=null", "data.train_file=/nonexistent/prompts.jsonl"]  # fails right after the folder check


def _old_run(run):
    (run / "checkpoints" / "step-000004").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-000004")
    (run / "config.yaml").write_text("trainer: {}\n")
    rows = "".join(json.dumps({"step": s, "loss": 1.0 / (s + 1)}) + "\n" for s in range(5))
    (run / "metrics.jsonl").write_text(rows)
    return rows


def test_train_refuses_a_folder_holding_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    rows = _old_run(run)
    assert rlhf_main(["train", "configs/grpo_tiny.yaml", *BAD_DATA, f"trainer.output_dir={run}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(run) in err and "--resume" in err and "--force" in err, err
    assert (run / "metrics.jsonl").read_text() == rows and (run / "checkpoints" / "latest").is_file()
    assert rlhf_main(["train", "configs/grpo_tiny.yaml", *BAD_DATA, f"trainer.output_dir={run}", "--resume",
                      "--force"]) == 2
    assert "give one" in capsys.readouterr().err


def test_force_moves_the_old_run_aside(tmp_path, capsys):
    run = tmp_path / "run"
    rows = _old_run(run)
    rlhf_main(["train", "configs/grpo_tiny.yaml", *BAD_DATA, f"trainer.output_dir={run}", "--force"])
    out = capsys.readouterr().out
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and str(aside[0]) in out, (out, list(tmp_path.iterdir()))
    assert (aside[0] / "metrics.jsonl").read_text() == rows
    assert (aside[0] / "checkpoints" / "latest").read_text() == "step-000004"
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


def test_inputs_alone_are_not_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)  # generated inputs (data/, model/) are reused, not a run
    assert rlhf_main(["train", "configs/grpo_tiny.yaml", *BAD_DATA, f"trainer.output_dir={run}"]) == 2
    assert "/nonexistent/prompts.jsonl" in capsys.readouterr().err


def test_resume_keeps_every_row_and_reads_each_step_once(tmp_path):
    """A resume from step 3 of a run that logged up to step 6 (its last line torn by a kill) deletes no row: it
    ends the torn line and appends a marker; `read_metrics` then reads steps 0-3 and the resumed run's rows.
    A second resume, from step 0 (no checkpoint), supersedes them all."""
    f = tmp_path / "metrics.jsonl"
    old = "".join(json.dumps({"step": s}) + "\n" for s in range(6)) + '{"step": 6, "lo'  # torn last line
    f.write_text(old)
    assert mark_resume(f, 3, tmp_path / "step-000003") == 2
    assert f.read_text().startswith(old + "\n")
    with f.open("a") as out:
        out.write(json.dumps({"step": 4, "again": True}) + "\n")
    assert [(r["step"], "again" in r) for r in read_metrics(tmp_path)] == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 1)]
    assert mark_resume(f, 4, None) == 0  # nothing after step 4: no marker
    assert mark_resume(f, 0, None) == 5 and read_metrics(tmp_path) == []
    assert f.read_text().startswith(old + "\n") and len(f.read_text().splitlines()) == 10


def test_clean_refuses_an_existing_output(tmp_path, capsys):
    raw, out = tmp_path / "raw.txt", tmp_path / "out.txt"
    raw.write_text("first document here\nsecond document here\n")
    out.write_text("precious\n")
    assert rlhf_main(["clean", "--input", str(raw), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--force" in err and str(out) in err, err
    assert out.read_text() == "precious\n"
    assert rlhf_main(["clean", "--input", str(raw), "--output", str(out), "--force"]) == 0
    assert out.read_text() == "first document here\nsecond document here\n"
