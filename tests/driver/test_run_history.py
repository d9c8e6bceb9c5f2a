"""No lost history: `rlhf train` refuses a folder holding a run unless --resume or --force (which moves it
aside), `rlhf clean` refuses an existing output without --force, and a resumed run logs each step once."""

from __future__ import annotations

import json

from rlhf.cli import main as rlhf_main
from rlhf.driver.run_dir import drop_rows_after

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


def test_resume_drops_rows_after_the_checkpoint(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(6)) + '{"step": 6, "lo')  # torn last line
    assert drop_rows_after(f, 3) == 3
    assert [json.loads(x)["step"] for x in f.read_text().splitlines()] == [0, 1, 2, 3]
    assert drop_rows_after(f, 0) == 4 and f.read_text() == ""  # no checkpoint: the run starts over


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
