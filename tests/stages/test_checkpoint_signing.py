"""Checkpoint manifests are signed with this user's key (workers/megatron/ckpt_key.py, ckpt_manifest.py).

A hostile folder whose manifest was recomputed the way an attacker would (the sha256 list in plain Python,
with the old MAC, no MAC, or a MAC made with a guessed key) is refused in one line by `convert`, `generate`,
`eval` and `trainer.load`, without its planted pickle ever running. A folder signed with another key is
refused until `rlhf checkpoint trust` imports it; a truncated shard is reported as damage, not as a trust
problem; an edited `hf/config.json` and a corrupt `.metadata` under --trust-checkpoint end in one line naming
the file. The session's key is a temp file (tests/conftest.py), never the user's own.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.cli import main as cli
from rlhf.errors import UserError
from tests.helpers.lm import lm_overrides
from tests.helpers.planted import Plant, fake_run
from workers.megatron.ckpt_key import KEY_ENV, CheckpointKeyError, key_path, load_key
from workers.megatron.ckpt_manifest import (
    MANIFEST_FILE,
    DamagedCheckpointError,
    UntrustedCheckpointError,
    verify_manifest,
    write_manifest,
)

REPO = Path(__file__).resolve().parents[2]


def _forge(folder: Path, mac: str) -> None:
    """What an attacker does after planting a file: recompute the manifest's digests in plain Python, keeping
    its layout, then `mac`: "keep" (the old MAC), "drop" (none), or "empty" / "guess" (an HMAC made the way the
    source code does, with an empty or a guessed key)."""
    m = json.loads((folder / MANIFEST_FILE).read_text())
    nested = m.get("nested", [])
    files = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel != MANIFEST_FILE and rel.split("/")[0] not in nested:
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
            old = next(iter(m["files"].values()))
            files[rel] = digest if isinstance(old, str) else {"size": p.stat().st_size, "sha256": digest}
    m["files"] = files
    if mac == "drop":
        m.pop("mac", None)
    elif mac in ("empty", "guess"):
        key = b"" if mac == "empty" else bytes(32)
        canon = json.dumps({k: m.get(k, []) for k in ("format", "files", "nested")}, sort_keys=True,
                           separators=(",", ":"))
        m["mac"] = hmac.new(key, canon.encode(), hashlib.sha256).hexdigest()
    (folder / MANIFEST_FILE).write_text(json.dumps(m))


def _run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """`rlhf ARGS` in a subprocess (the session's key path in its environment), warnings off."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "rlhf", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, input=stdin, timeout=600)


def _one_line(r: subprocess.CompletedProcess, command: str) -> str:
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, err[-3000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert err.startswith(f"rlhf {command}: error: "), err
    return err


def _commands(ckpt: Path, tmp: Path, *extra: str) -> dict[str, list[str]]:
    """convert, generate and eval of the checkpoint `ckpt` (in subprocesses, like a user)."""
    (tmp / "q.jsonl").write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    return {"convert": ["convert", "mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp / "hf-out"), *extra],
            "generate": ["generate", "--model", str(ckpt), "--prompt", "hi", *extra],
            "eval": ["eval", "--model", str(ckpt), "--tasks", f"prompts:{tmp / 'q.jsonl'}", "--output",
                     str(tmp / "results.json"), *extra]}


def _all_one_line(ckpt: Path, tmp: Path, *extra: str) -> dict[str, str]:
    """Run convert, generate and eval side by side; each ends with exit 2 and one line (returned)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = {c: subprocess.Popen([sys.executable, "-m", "rlhf", *a], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env, cwd=REPO) for c, a in _commands(ckpt, tmp, *extra).items()}
    out = {}
    for c, p in procs.items():
        stdout, stderr = p.communicate(timeout=600)
        out[c] = _one_line(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr), c)
    assert not (tmp / "hf-out").exists() and not (tmp / "results.json").exists()
    return out


@pytest.fixture(scope="module")
def converted(tiny_model_factory, tmp_path_factory) -> Path:
    """A converted checkpoint (`rlhf convert hf-to-mcore` of tiny-qwen2), signed with the session's key."""
    out = tmp_path_factory.mktemp("signing") / "mcore"
    assert cli(["convert", "hf-to-mcore", "--hf", tiny_model_factory("tiny-qwen2"), "--out", str(out)]) == 0
    return out


def _copy(converted: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "mcore"
    shutil.copytree(converted, ckpt)
    return ckpt


def test_key_is_private_and_an_exposed_key_is_refused(tmp_path, monkeypatch):
    """Created 0600 in a 0700 folder on first use, the same key afterwards; a key others can read, a link or
    a malformed file is refused in one line naming it. The default place is under $XDG_CONFIG_HOME."""
    monkeypatch.delenv(KEY_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    assert key_path() == tmp_path / "cfg" / "rlhf" / "checkpoint.key"
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "private" / "checkpoint.key"))
    path = key_path()
    key = load_key()
    assert len(key) == 32 and load_key() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.chmod(0o644)
    with pytest.raises(CheckpointKeyError, match=r"mode 0644: others can read it.*chmod 600") as e:
        load_key()
    assert str(e.value).startswith(f"{path}: ") and len(str(e.value).splitlines()) == 1
    path.chmod(0o640)
    with pytest.raises(CheckpointKeyError, match="mode 0640"):
        load_key()
    path.chmod(0o600)
    link = tmp_path / "private" / "link.key"
    link.symlink_to(path)
    monkeypatch.setenv(KEY_ENV, str(link))
    with pytest.raises(CheckpointKeyError, match="symbolic link"):
        load_key()
    (tmp_path / "bad.key").write_text("not hex")
    (tmp_path / "bad.key").chmod(0o600)
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "bad.key"))
    with pytest.raises(CheckpointKeyError, match="malformed"):
        load_key()


def test_signed_manifest_refuses_forgeries_and_reports_damage(tmp_path):
    """The manifest's MAC is checked before its digests: recomputed digests with the old MAC, no MAC, or a
    MAC under an empty or guessed key are untrusted; another key is "another user or machine"; with our MAC,
    a truncated, changed or missing file is damage (named, with sizes, no --trust-checkpoint advice)."""
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    (d / "a.bin").write_bytes(b"a" * 100)
    (d / "sub" / "b.bin").write_bytes(b"b")
    write_manifest(d, load_key())
    verify_manifest(d)
    for mac in ("keep", "drop", "empty", "guess"):
        (d / "a.bin").write_bytes(pickle.dumps(Plant(tmp_path / "PWNED")))
        _forge(d, mac)
        with pytest.raises(UntrustedCheckpointError, match="--trust-checkpoint") as e:
            verify_manifest(d)
        assert not isinstance(e.value, DamagedCheckpointError), (mac, e.value)
        assert ("not signed with your checkpoint key" if mac != "drop" else "is not signed") in str(e.value)
    write_manifest(d, b"k" * 32)  # another user's or machine's key
    with pytest.raises(UntrustedCheckpointError, match="saved by another user or machine.*rlhf checkpoint trust"):
        verify_manifest(d)
    m = json.loads((d / MANIFEST_FILE).read_text())
    (d / MANIFEST_FILE).write_text(json.dumps({"format": "rlhf-checkpoint-manifest-v1", "files": {
        k: v["sha256"] for k, v in m["files"].items()}}))
    with pytest.raises(UntrustedCheckpointError, match="unsigned manifest"):
        verify_manifest(d)

    write_manifest(d, load_key())
    size = (d / "a.bin").stat().st_size
    os.truncate(d / "a.bin", 10)
    with pytest.raises(DamagedCheckpointError, match=rf"is damaged: a.bin is truncated or changed: size 10 of "
                                                     rf"{size} bytes") as e:
        verify_manifest(d)
    assert "--trust-checkpoint" not in str(e.value)
    (d / "a.bin").write_bytes(b"x" * size)
    with pytest.raises(DamagedCheckpointError, match="a.bin changed since it was saved"):
        verify_manifest(d)
    (d / "sub" / "b.bin").unlink()
    (d / "a.bin").unlink()
    with pytest.raises(DamagedCheckpointError, match="is damaged: a.bin is missing"):
        verify_manifest(d)
    write_manifest(d, load_key())
    (d / "sub" / "c.pt").write_bytes(b"c")
    with pytest.raises(UntrustedCheckpointError, match=r"sub/c.pt is not in its manifest.*--trust-checkpoint") as e:
        verify_manifest(d)
    assert not isinstance(e.value, DamagedCheckpointError)


@pytest.mark.timeout(900)
def test_forged_converted_checkpoint_is_refused_by_every_command(converted, tmp_path):
    """A planted `.metadata` with the manifest recomputed (digests plus a MAC under a guessed key): convert,
    generate and eval refuse it in one line, exit 2, and the pickle never runs; so do the other forgeries
    for convert. The conversion's own ranks refuse a recomputed manifest's stale digests too."""
    ckpt = _copy(converted, tmp_path)
    marker = tmp_path / "PWNED"
    (ckpt / "model" / ".metadata").write_bytes(pickle.dumps(Plant(marker)))
    _forge(ckpt / "model", "guess")
    for command, line in _all_one_line(ckpt, tmp_path).items():
        assert "model: rlhf_manifest.json is not signed with your checkpoint key" in line, (command, line)
        assert "rlhf checkpoint trust" in line and "--trust-checkpoint" in line
    for mac in ("keep", "drop", "empty"):
        _forge(ckpt / "model", mac)
        assert cli(["convert", "mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp_path / "hf")]) == 2, mac
    assert not marker.exists(), "the planted pickle was unpickled"


def test_trainer_load_refuses_a_forged_manifest(no_ray, lm_inputs, tmp_path):
    """trainer.load of a checkpoint whose manifest was recomputed: refused before Ray, nothing unpickled."""
    import ray

    from rlhf.config import load_config
    from rlhf.driver.stages.lm import run_lm

    marker = tmp_path / "PWNED"
    role = fake_run(tmp_path / "other", marker, forge=lambda r: _forge(r, "guess"))
    cfg = load_config(None, lm_overrides(lm_inputs, "sft", tmp_path / "run", f"trainer.load={role}"))
    with pytest.raises(UserError, match=r"policy: rlhf_manifest.json is not signed with your checkpoint key"):
        run_lm(cfg)
    assert not ray.is_initialized() and not marker.exists()


@pytest.mark.timeout(900)
def test_foreign_key_is_refused_until_imported(converted, tiny_model_factory, tmp_path):
    """A checkpoint signed with another key (another user or machine) is refused with the way out; `rlhf
    checkpoint trust` asks first (declining signs nothing), then signs every folder and says which; then it
    converts back to the model's exact weights."""
    from safetensors.torch import load_file

    ckpt = _copy(converted, tmp_path)
    other = b"o" * 32
    write_manifest(ckpt / "model", other)
    write_manifest(ckpt, other, nested=["model"])
    line = _one_line(_run(*_commands(ckpt, tmp_path)["convert"]), "convert")
    assert "saved by another user or machine" in line and f"rlhf checkpoint trust {ckpt}" in line, line
    r = _run("checkpoint", "trust", str(ckpt), stdin="n\n")
    assert r.returncode == 1 and "nothing signed" in r.stderr, r.stderr
    with pytest.raises(UntrustedCheckpointError):
        verify_manifest(ckpt)
    r = _run("checkpoint", "trust", str(ckpt), stdin="y\n")
    assert r.returncode == 0, r.stderr
    assert f"signed {ckpt / 'model' / MANIFEST_FILE}" in r.stdout and f"signed {ckpt / MANIFEST_FILE}" in r.stdout
    assert str(key_path()) in r.stdout
    verify_manifest(ckpt)
    assert cli(["convert", "mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    got = load_file(tmp_path / "hf" / "model.safetensors")
    want = load_file(Path(tiny_model_factory("tiny-qwen2")) / "model.safetensors")
    assert sorted(got) == sorted(want) and all(got[k].equal(want[k]) for k in want)


def test_truncated_shard_is_damage_not_trust(converted, tmp_path, capsys):
    """A truncated shard of our own checkpoint: "damaged", the file and its sizes, no --trust-checkpoint."""
    ckpt = _copy(converted, tmp_path)
    shard = sorted((ckpt / "model").glob("*.distcp"))[-1]
    size = shard.stat().st_size
    os.truncate(shard, size // 3)
    capsys.readouterr()
    assert cli(["convert", "mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rlhf convert: error: checkpoint {ckpt / 'model'} is damaged: {shard.name} is truncated or "
                   f"changed: size {size // 3} of {size} bytes; restore the folder from a good copy, or use an "
                   "earlier checkpoint"), err


@pytest.mark.timeout(900)
def test_edited_hf_config_is_one_line(converted, tmp_path, capsys):
    """An edited `hf/config.json` of a converted checkpoint: named as changed by the signed manifest; under
    --trust-checkpoint, named as not matching the weights (the load fails inside the ranks), one line each."""
    ckpt = _copy(converted, tmp_path)
    config = ckpt / "hf" / "config.json"
    cfg = json.loads(config.read_text())
    cfg["hidden_size"] = cfg["hidden_size"] // 2
    config.write_text(json.dumps(cfg, indent=2))
    capsys.readouterr()
    assert cli(["convert", "mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"checkpoint {ckpt} is damaged: hf/config.json " in err, err
    line = _one_line(_run(*_commands(ckpt, tmp_path, "--trust-checkpoint")["convert"]), "convert")
    assert line.startswith(f"rlhf convert: error: {config}: the model it describes does not match the checkpoint "
                           f"{ckpt / 'model'} ("), line
    assert not (tmp_path / "hf-out").exists()


def test_corrupt_index_under_trust_is_one_line(no_ray, converted, lm_inputs, tmp_path):
    """A corrupt `.metadata` with --trust-checkpoint: convert, generate and eval name the folder and the file
    that could not be read (exit 2, one line), and so does trainer.load, before Ray starts."""
    import ray

    from rlhf.config import load_config
    from rlhf.driver.stages.lm import run_lm

    ckpt = _copy(converted, tmp_path)
    index = ckpt / "model" / ".metadata"
    index.write_bytes(index.read_bytes()[:50])
    for command, line in _all_one_line(ckpt, tmp_path, "--trust-checkpoint").items():
        assert f"checkpoint {ckpt / 'model'}: .metadata could not be read (UnpicklingError" in line, (command, line)
    run = tmp_path / "run" / "checkpoints" / "step-000001"
    shutil.copytree(ckpt / "model", run / "policy")
    (run / "driver_state.json").write_text(json.dumps({"step": 1}))
    cfg = load_config(None, lm_overrides(lm_inputs, "sft", tmp_path / "out", f"trainer.load={run / 'policy'}",
                                         "trainer.trust_checkpoint=true", "trainer.no_load_optim=true"))
    with pytest.raises(UserError, match=rf"checkpoint {run / 'policy'}: \.metadata could not be read"):
        run_lm(cfg)
    assert not ray.is_initialized()


def test_trust_command_signs_every_role_of_a_run(tmp_path, capsys):
    """`rlhf checkpoint trust RUN --yes` signs each role folder of each step (other users' or old manifests);
    a folder with no checkpoint, or one holding a link, is refused in one line."""
    steps = [tmp_path / "run" / "checkpoints" / f"step-00000{i}" for i in (1, 2)]
    roles = [s / r for s in steps for r in ("policy", "critic")]
    for role in roles:
        role.mkdir(parents=True)
        (role / "metadata.json").write_text("{}")
        (role / "common.pt").write_bytes(b"x")
        write_manifest(role, b"o" * 32)
    capsys.readouterr()
    assert cli(["checkpoint", "trust", str(tmp_path / "run"), "--yes"]) == 0
    out = capsys.readouterr().out
    for role in roles:
        verify_manifest(role)
        assert f"signed {role / MANIFEST_FILE}" in out
    assert cli(["checkpoint", "trust", str(tmp_path / "run" / "checkpoints" / "none")]) == 2
    assert capsys.readouterr().err.strip().endswith("is not a folder")
    (roles[0] / "link.pt").symlink_to(tmp_path / "elsewhere")
    assert cli(["checkpoint", "trust", str(steps[0]), "--yes"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{roles[0] / 'link.pt'} is a link" in err, err


def test_train_with_an_exposed_key_stops_before_ray(no_ray, lm_inputs, tmp_path, monkeypatch, capsys):
    """A key file others can read fails `rlhf train` in one line before Ray starts, not at the first save."""
    import ray

    key = Path(os.environ[KEY_ENV])
    load_key()
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "exposed.key"))
    shutil.copy(key, tmp_path / "exposed.key")
    (tmp_path / "exposed.key").chmod(0o644)
    capsys.readouterr()
    assert cli(["train", str(REPO / "configs" / "sft_tiny.yaml"), *lm_overrides(lm_inputs, "sft", tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rlhf train: error: {tmp_path / 'exposed.key'}: the checkpoint key has mode 0644: others can "
                   f"read it and sign checkpoints as you; run `chmod 600 {tmp_path / 'exposed.key'}` (or delete it "
                   "for a new key, which un-trusts your existing checkpoints)"), err
    assert not ray.is_initialized()
