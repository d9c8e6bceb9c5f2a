"""Checkpoints load only when they match the signed manifest written at save (or are trusted explicitly):
a planted pickle is refused by the commands before any worker starts, and by the loader itself, without
ever being unpickled (the marker file it would create does not appear). Forged manifests, foreign keys and
damage: test_checkpoint_signing.py."""

from __future__ import annotations

import json
import shutil

import pytest

from rlhf.cli import main as cli
from rlhf.config import load_config
from rlhf.errors import UserError
from tests.helpers.lm import lm_overrides
from tests.helpers.planted import fake_run, plant
from workers.megatron.ckpt_key import load_key
from workers.megatron.ckpt_manifest import (
    MANIFEST_FILE,
    UntrustedCheckpointError,
    verify_manifest,
    write_manifest,
)


def test_manifest_detects_changed_extra_and_missing_files(tmp_path):
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    (d / "a.bin").write_bytes(b"a" * 100)
    (d / "sub" / "b.bin").write_bytes(b"b")
    with pytest.raises(UntrustedCheckpointError, match=f"has no {MANIFEST_FILE}.*--trust-checkpoint"):
        verify_manifest(d)
    write_manifest(d, load_key())
    verify_manifest(d)
    assert json.loads((d / MANIFEST_FILE).read_text())["format"] == "rlhf-checkpoint-manifest-v2"
    (d / "a.bin").write_bytes(b"a" * 99 + b"x")
    with pytest.raises(UntrustedCheckpointError, match=r"a.bin changed since it was saved"):
        verify_manifest(d)
    write_manifest(d, load_key())
    (d / "sub" / "c.pt").write_bytes(b"c")
    with pytest.raises(UntrustedCheckpointError, match=r"sub/c.pt is not in its manifest"):
        verify_manifest(d)
    (d / "sub" / "c.pt").unlink()
    (d / "sub" / "b.bin").unlink()
    with pytest.raises(UntrustedCheckpointError, match=r"is damaged: sub/b.bin is missing"):
        verify_manifest(d)
    (d / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(UntrustedCheckpointError, match="malformed"):
        verify_manifest(d)


@pytest.mark.timeout(900)
def test_converted_checkpoint_trust(tiny_model_factory, tmp_path, capsys):
    from rlhf.conversion.rank_fns import mcore_to_hf_rank
    from workers.megatron.launch import run_distributed

    marker = tmp_path / "PWNED"
    ckpt = tmp_path / "mcore"
    assert cli(["convert", "hf-to-mcore", "--hf", tiny_model_factory("tiny-qwen2"), "--out", str(ckpt)]) == 0
    model = ckpt / "model"
    assert (model / MANIFEST_FILE).is_file()
    assert cli(["convert", "mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp_path / "hf1")]) == 0  # ours loads
    good_index = (model / ".metadata").read_bytes()

    plant(model, marker)  # a hostile index in a checkpoint that has our manifest
    capsys.readouterr()
    assert cli(["convert", "mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert ".metadata is truncated or changed" in err and "Traceback" not in err, err
    assert cli(["generate", "--model", str(ckpt), "--prompt", "hi"]) == 2  # same check, before any engine
    assert ".metadata is truncated or changed" in capsys.readouterr().err
    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    assert cli(["eval", "--model", str(ckpt), "--tasks", f"prompts:{tmp_path / 'q.jsonl'}", "--output",
                str(tmp_path / "results.json")]) == 2
    assert ".metadata is truncated or changed" in capsys.readouterr().err and not (tmp_path / "results.json").exists()
    with pytest.raises(Exception, match=r"\.metadata is truncated or changed"):  # the loader refuses on its own too
        run_distributed(mcore_to_hf_rank, 1, args=(str(ckpt), str(tmp_path / "hf3"), False), timeout_s=300)
    (model / MANIFEST_FILE).unlink()  # a foreign checkpoint: no manifest at all
    assert cli(["convert", "mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp_path / "hf4")]) == 2
    assert f"has no {MANIFEST_FILE}" in capsys.readouterr().err
    assert not marker.exists(), "the planted pickle was unpickled"

    (model / ".metadata").write_bytes(good_index)  # a genuine checkpoint without manifest, trusted by the user
    assert cli(["convert", "mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp_path / "hf5"),
                "--trust-checkpoint"]) == 0
    assert (tmp_path / "hf5" / "model.safetensors").read_bytes() == (tmp_path / "hf1" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("how", ["load", "resume", "rl-resume"])
def test_training_refuses_untrusted_checkpoint_before_workers(no_ray, lm_inputs, tmp_path, how):
    """SFT with trainer.load / --resume and GRPO with --resume (a run dir whose checkpoint was planted)."""
    import ray

    from rlhf.driver.rl.runner import run_rl
    from rlhf.driver.stages.lm import run_lm

    marker = tmp_path / "PWNED"
    run_dir = tmp_path / "run"
    if how == "load":
        role = fake_run(tmp_path / "other", marker, with_manifest=False)
        extra, match = (f"trainer.load={role.parent.parent.parent}",), f"{role} has no {MANIFEST_FILE}"
    else:
        role = fake_run(run_dir, marker, with_manifest=True)
        extra, match = ("trainer.resume=auto",), r"policy: \.metadata is not in its manifest"
    if how == "rl-resume":
        prompts = tmp_path / "p.jsonl"
        prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)})
                                   + "\n" for i in range(16)))
        cfg = load_config("configs/grpo_tiny.yaml", [
            f"model.path={lm_inputs['model']}", "model.preset=null", "model.warm_start_steps=0", "data.task=null",
            f"data.train_file={prompts}", "data.val_size=0", f"trainer.output_dir={run_dir}", *extra])
        with pytest.raises(UserError, match=match):
            run_rl(cfg)
    else:
        cfg = load_config(None, lm_overrides(lm_inputs, "sft", run_dir, *extra))
        with pytest.raises(UserError, match=match):
            run_lm(cfg)
    assert not ray.is_initialized(), "the refusal must come before Ray starts"
    assert not marker.exists()
    shutil.rmtree(tmp_path / "other", ignore_errors=True)


def test_warm_start_reads_hf_weights_as_safetensors_only(tiny_model_factory, tmp_path):
    """The RL examples' warm start (and its accuracy check) load an HF folder from safetensors only: a folder
    whose weights are a pickle (`pytorch_model.bin`) is refused, not unpickled."""
    import torch
    from safetensors.torch import load_file

    from rlhf.driver.warmstart.hf_sft import greedy_accuracy, sft_warm_start

    model = tmp_path / "model"
    shutil.copytree(tiny_model_factory("tiny-qwen2"), model)
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    with pytest.raises(OSError, match="safetensors"):
        sft_warm_start(model, [("1+1=", "2")], tmp_path / "out", steps=1, batch_size=1)
    with pytest.raises(OSError, match="safetensors"):
        greedy_accuracy(model, [("1+1=", "2")])
