"""The optional Weights & Biases sink: a real wandb in offline mode (no account, no network)."""

from __future__ import annotations

import importlib.util
import json
import struct

import pytest

from rlhf.config import load_config
from rlhf.driver.infra.metrics import MetricsLogger, read_metrics, wandb_args
from rlhf.errors import ConfigError

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2 as pb  # noqa: E402

BASE = ["model.preset=tiny-qwen2"]


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def wandb_records(path) -> list[pb.Record]:
    """The records of a `.wandb` file: a 7-byte header, then a leveldb log (32 KiB blocks of
    crc32 / length / type chunks; 1 full, 2 first, 3 middle, 4 last)."""
    data, pos, records, parts = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer too short for a chunk header: padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            records.append(rec)
            parts = b""
    return records


def test_offline_run_holds_the_logged_metrics(tmp_path):
    out = tmp_path / "my_run"
    cfg = load_config(None, BASE + [f"trainer.output_dir={out}", "trainer.wandb=true"])
    args = wandb_args(cfg)
    assert args["name"] == "my_run" and args["mode"] == "offline" and args["config"]["trainer"]["wandb"]
    logger = MetricsLogger(out, 2, tensorboard=False, progress_bar=False, wandb=args)
    logger.log(1, {"loss": 2.5, "val/accuracy": 0.25, "note": "text", "bad": float("nan")})
    logger.log(2, {"loss": 1.5, "val/accuracy": 0.75})
    logger.close()
    assert [r["loss"] for r in read_metrics(out)] == [2.5, 1.5]

    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "run" in kinds and "exit" in kinds, f"{run_file} ({run_file.stat().st_size} bytes) is incomplete: {kinds}"
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == "my_run" and run.project == "rlhf"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}  # the resolved config
    assert config["trainer"]["output_dir"] == str(out) and config["model"]["preset"] == "tiny-qwen2"
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    assert [(r["_step"], r["loss"], r["val/accuracy"]) for r in rows] == [(1, 2.5, 0.25), (2, 1.5, 0.75)]
    assert not any("note" in r or "bad" in r for r in rows)  # numbers only


def test_wandb_failure_warns_and_training_goes_on(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no service")

    monkeypatch.setattr(wandb, "init", broken)
    with pytest.warns(UserWarning, match="wandb init failed"):
        logger = MetricsLogger(tmp_path, 1, tensorboard=False, progress_bar=False, wandb={"mode": "offline"})
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 1.0}]


def test_config_checks():
    with pytest.raises(ConfigError, match=r"trainer\.wandb_mode: expected one of offline, online, disabled"):
        load_config(None, BASE + ["trainer.wandb_mode=cloud"])
    assert load_config(None, BASE).trainer.wandb is False


def test_missing_wandb_fails_before_any_worker(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"trainer\.wandb=true.*pip install wandb"):
        load_config(None, BASE + ["trainer.wandb=true"])
    cfg = load_config(None, BASE + ["trainer.wandb=true"], validate=False)
    with pytest.raises(ConfigError, match="pip install wandb"):
        wandb_args(cfg)
