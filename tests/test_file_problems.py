"""Truncated files, a full disk and a read-only output folder end every command with one line naming the file
and the cause, exit code 2, and no half-written output (outputs are renamed into place only when complete).

The commands are the real ones (`rlhf.cli.main`, in process so the disk faults below can be injected; the
converter's ranks are real spawned processes). A full disk cannot be made without root (no small tmpfs
here), so it is simulated in this process at the write call: `open` hands out files whose `write` raises
OSError(ENOSPC) after a few bytes, as a full file system does. Read-only: a folder chmod-ed to 0o555 when
the tests run as a normal user; as root, where the mode does not stop writes, opening or creating anything
under that folder raises OSError(EROFS) in this process, as a read-only mount does.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from rlhf.cli import main as cli

ROOT = os.geteuid() == 0
READ_ONLY = ("read-only file system", "permission denied (read-only folder?)")


def _one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"rlhf {command}: error: "), err
    return err


def _nothing_left(folder: Path, *keep: str) -> None:
    left = sorted(p.name for p in folder.iterdir() if p.name not in keep)
    assert left == [], f"half-written output left behind: {left}"


class _FullDiskFile:
    """A real file whose writes fail with ENOSPC once `room` bytes are used."""

    def __init__(self, f, room: int) -> None:
        self._f, self._room = f, room

    def write(self, data):
        self._room -= len(data)
        if self._room < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.fixture
def full_disk(tmp_path, monkeypatch):
    """Files opened for writing under `tmp_path/full` run out of space after 64 bytes (see module doc)."""
    folder = tmp_path / "full"
    folder.mkdir()
    real_open = builtins.open

    def fake_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if isinstance(file, str | os.PathLike) and str(file).startswith(str(folder)) and set(mode) & set("wax"):
            return _FullDiskFile(f, 64)
        return f

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(shutil, "_USE_CP_SENDFILE", False)  # copies go through open() too
    return folder


@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """A folder nothing can be written into (see module doc)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if not ROOT:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return

    def refuse(path) -> None:
        p = os.fspath(path) if isinstance(path, str | os.PathLike) else ""
        if isinstance(p, str) and os.path.abspath(p).startswith(str(folder) + os.sep):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), p)

    real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

    def fake_open(file, mode="r", *args, **kwargs):
        if set(mode) & set("wax+"):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        refuse(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    yield folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(20)))
    return src


PLAN = ["--model", "tiny-qwen2", "--nodes", "1", "--gpus-per-node", "1", "--gpu-mem", "24GiB", "--seq-len", "256",
        "--global-batch", "8"]


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)}) + "\n" for i in range(2)))
    return path


def test_read_only_output_folder_every_command(read_only, corpus, prompts, tiny_model_factory, capsys):
    """Each command names the read-only output before its work (eval: before it loads the model, here one that
    is missing)."""
    model = tiny_model_factory("tiny-qwen2")
    capsys.readouterr()
    commands = {
        "eval": ["--model", str(read_only.parent / "missing"), "--tasks", f"prompts:{prompts}", "--output",
                 str(read_only / "results.json")],
        "plan": [*PLAN, "--out", str(read_only / "overlay.yaml")],
        "clean": ["--input", str(corpus), "--output", str(read_only / "c.jsonl")],
        "preprocess": ["--input", str(corpus), "--output-prefix", str(read_only / "p"), "--tokenizer", model,
                       "--no-progress"],
        "convert": ["hf-to-mcore", "--hf", model, "--out", str(read_only / "mc")],
        "generate": ["--model", model, "--prompt", "hi", "--output", str(read_only / "g.jsonl")],
        "init-model": ["--preset", "tiny-qwen2", "--out", str(read_only / "m")],
        "train": ["configs/grpo_tiny.yaml", f"trainer.output_dir={read_only / 'run'}"],
    }
    for command, args in commands.items():
        assert cli([command, *args]) == 2, command
        err = _one_line(capsys, command)
        assert f"{read_only}/" in err and err.endswith(READ_ONLY), err
    _nothing_left(read_only)


def test_full_disk_every_small_output(full_disk, corpus, prompts, tiny_model_factory, capsys):
    """clean, preprocess, init-model, plan --out and eval --compare's chart on a full disk: one line naming the
    output, nothing half-written left."""
    model = tiny_model_factory("tiny-qwen2")
    capsys.readouterr()
    assert cli(["init-model", "--preset", "tiny-qwen2", "--out", str(full_disk / "m")]) == 2
    assert _one_line(capsys, "init-model").endswith(f"{full_disk / 'm'}: cannot write: no space left on device")
    assert cli(["plan", *PLAN, "--out", str(full_disk / "overlay.yaml")]) == 2
    err = _one_line(capsys, "plan")
    assert err.endswith(f"{full_disk / 'overlay.yaml'}: cannot write: no space left on device"), err
    results = prompts.parent / "results.json"
    results.write_text(json.dumps({"tasks": {"t": {"metric": "acc", "value": 0.5, "stderr": 0.1}}}))
    assert cli(["eval", "--compare", str(results), "--output", str(full_disk / "cmp.json")]) == 2
    err = _one_line(capsys, "eval")
    assert err.endswith(f"{full_disk / 'eval_compare.png'}: cannot write: no space left on device"), err
    assert cli(["clean", "--input", str(corpus), "--output", str(full_disk / "c.jsonl")]) == 2
    assert _one_line(capsys, "clean").endswith(f"{full_disk / 'c.jsonl'}: cannot write: no space left on device")
    assert cli(["preprocess", "--input", str(corpus), "--output-prefix", str(full_disk / "p"),
                "--tokenizer", model, "--no-progress"]) == 2
    err = _one_line(capsys, "preprocess")
    assert err.endswith(f"{full_disk / 'p_text_document.bin'}: cannot write: no space left on device"), err
    _nothing_left(full_disk)


def test_truncated_safetensors(tmp_path, tiny_model_factory, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_factory("tiny-qwen2"), model)
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    (tmp_path / "p.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "1+1="}], "answer": "2"}) + "\n")
    capsys.readouterr()
    commands = {
        "convert": ["hf-to-mcore", "--hf", str(model), "--out", str(tmp_path / "out" / "mc")],
        "generate": ["--model", str(model), "--prompt", "hi"],
        "train": ["configs/grpo_tiny.yaml", f"model.path={model}", "model.preset=null", "model.warm_start_steps=0",
                  "data.task=null", f"data.train_file={tmp_path / 'p.jsonl'}", "data.val_size=0", f"trainer.output_dir={tmp_path / 'run'}"],
    }
    for command, args in commands.items():
        assert cli([command, *args]) == 2, command
        err = _one_line(capsys, command)
        assert f"{weights}: truncated or corrupt safetensors file (" in err, err
    assert not (tmp_path / "out").exists()


def test_convert_full_disk_and_truncated_shard_leave_no_output(tmp_path, full_disk, read_only, tiny_model_factory,
                                                               capsys):
    """hf-to-mcore onto a full disk (the ranks' writes are real, the parent's last files fail), then a real
    conversion: mcore-to-hf into a read-only folder names it before any rank starts; with a truncated shard it
    names the checkpoint, leaves no output folder, and with --force keeps the old output intact."""
    model = tiny_model_factory("tiny-qwen2")
    capsys.readouterr()
    assert cli(["convert", "hf-to-mcore", "--hf", model, "--out", str(full_disk / "mc")]) == 2
    err = _one_line(capsys, "convert")
    assert f"{full_disk / 'mc'}" in err and err.endswith("cannot write: no space left on device"), err
    _nothing_left(full_disk)

    mc = tmp_path / "mc"
    assert cli(["convert", "hf-to-mcore", "--hf", model, "--out", str(mc)]) == 0
    capsys.readouterr()
    assert cli(["convert", "mcore-to-hf", "--mcore", str(mc), "--out", str(read_only / "hf")]) == 2
    err = _one_line(capsys, "convert")
    assert f"{read_only}/" in err and err.endswith(READ_ONLY), err
    _nothing_left(read_only)
    shard = sorted((mc / "model").glob("*.distcp"))[-1]
    os.truncate(shard, shard.stat().st_size // 3)
    out = tmp_path / "hf"
    assert cli(["convert", "mcore-to-hf", "--mcore", str(mc), "--out", str(out)]) == 2
    err = _one_line(capsys, "convert")  # the signed manifest no longer matches the shard: damage, not trust
    assert f"{shard.name} is truncated" in err and "--trust-checkpoint" not in err, err
    assert cli(["convert", "mcore-to-hf", "--mcore", str(mc), "--out", str(out), "--trust-checkpoint"]) == 2
    assert _one_line(capsys, "convert").endswith(f"{mc / 'model'}: truncated or corrupt checkpoint shard (EOFError)")
    _nothing_left(tmp_path, "mc", "full", "ro")
    out.mkdir()
    (out / "old.txt").write_text("kept")
    assert cli(["convert", "mcore-to-hf", "--mcore", str(mc), "--out", str(out), "--force",
                "--trust-checkpoint"]) == 2
    _one_line(capsys, "convert")
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    _nothing_left(tmp_path, "mc", "full", "ro", "hf")


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # a thread's traceback
def test_full_disk_under_the_run_side_files(full_disk, monkeypatch):
    """metrics.jsonl, TensorBoard's events (at the start and later, from its writer thread, without that
    thread's traceback) and report.png on a full disk: a FileProblem naming the file (the CLI's one line), and
    no half-drawn report. TensorBoard opens its file again for every record (each fits in the fixture's 64
    bytes), so its folder gets a disk whose room counts over all of them."""
    from rlhf.driver.infra.metrics import MetricsLogger
    from rlhf.driver.infra.report import write_report
    from workers.file_problems import FileProblem

    logger = MetricsLogger(full_disk, total_steps=9, tensorboard=False, progress_bar=False)
    with pytest.raises(FileProblem) as info:
        for step in range(1, 10):
            logger.log(step, {"loss": 1.0 / step})
    assert str(info.value) == f"{full_disk / 'metrics.jsonl'}: cannot write: no space left on device"
    logger.close()

    run = full_disk.parent / "tb"  # metrics.jsonl has room; TensorBoard's folder `room` bytes in all
    room = {"left": 0}
    full_open = io.open

    def tb_disk(file, mode="r", *args, **kwargs):
        f = full_open(file, mode, *args, **kwargs)
        name = os.fsdecode(file) if isinstance(file, str | bytes | os.PathLike) else ""  # TensorBoard's are bytes
        if not (name.startswith(str(run / "tensorboard")) and set(mode) & set("wa")):
            return f
        disk = _FullDiskFile(f, room["left"])
        real_write = disk.write

        def write(data):
            room["left"] -= len(data)
            return real_write(data)

        disk.write = write
        return disk

    monkeypatch.setattr(io, "open", tb_disk)
    with pytest.raises(FileProblem) as info:
        MetricsLogger(run, total_steps=1, tensorboard=True, progress_bar=False)  # writes its first event
    assert str(info.value) == f"{run / 'tensorboard'}: cannot write: no space left on device"
    room["left"] = 200  # the first events fit; the writer thread fails on a later one, the logger names it
    logger = MetricsLogger(run, total_steps=50, tensorboard=True, progress_bar=False)
    with pytest.raises(FileProblem) as info:
        for step in range(1, 51):
            logger.log(step, {"x": 1.0})
            time.sleep(0.05)  # the writer thread writes in the background
    assert str(info.value) == f"{run / 'tensorboard'}: cannot write: no space left on device"
    logger.close()

    report = full_disk / "report"
    report.mkdir()
    with pytest.raises(FileProblem) as info:
        write_report(report)
    assert str(info.value) == f"{report / 'report.png'}: cannot write: no space left on device"
    _nothing_left(report)


def test_eval_results_on_a_full_disk(full_disk, prompts, tiny_model_factory, capsys):
    """A real (one item, one token) evaluation whose results file does not fit: one line naming it, and no
    half-written results file (it is renamed into place only when complete)."""
    model = tiny_model_factory("tiny-qwen2")
    capsys.readouterr()
    assert cli(["eval", "--model", model, "--tasks", f"prompts:{prompts}", "--limit", "1", "--max-tokens", "1",
                "--output", str(full_disk / "results.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"rlhf eval: error: {full_disk / 'results.json'}: cannot write: no space left on device", err
    _nothing_left(full_disk)
