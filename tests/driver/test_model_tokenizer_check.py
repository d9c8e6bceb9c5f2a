"""A model folder without tokenizer files is refused in one line (exit 2) naming the folder and the files
looked for, before Ray or any worker or engine starts: also when nothing before the engines needs the
tokenizer (an RL run whose model config names no context length, so no prompt is counted)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from rlhf.cli import main as rlhf_main

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


@pytest.fixture
def weights_only(tiny_model_factory, tmp_path) -> Path:
    """The tiny model's config and weights, its tokenizer files and its context length left out."""
    folder = tmp_path / "weights_only"
    shutil.copytree(tiny_model_factory("tiny-qwen2"), folder)
    for name in TOKENIZER_FILES:
        (folder / name).unlink(missing_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config.pop("max_position_embeddings", None)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("field", ["model.path", "model.tokenizer_path"])
@pytest.mark.timeout(300)
def test_model_without_tokenizer_files_is_one_line_before_any_worker(weights_only, tmp_path, capsys, field):
    out = tmp_path / "run"
    args = ["train", str(REPO / "configs" / "grpo_tiny.yaml"), "model.preset=null", f"model.path={weights_only}",
            f"trainer.output_dir={out}", "trainer.total_steps=1", "trainer.progress_bar=false"]
    tokenizer_dir = weights_only
    if field == "model.tokenizer_path":  # the weights' folder has none; the named tokenizer folder neither
        tokenizer_dir = tmp_path / "tokenizer"
        tokenizer_dir.mkdir()
        args.append(f"model.tokenizer_path={tokenizer_dir}")
    t0 = time.monotonic()
    assert rlhf_main(args) == 2
    took = time.monotonic() - t0
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(f"rlhf train: error: {field}: ") and str(tokenizer_dir) in err[0], err[0]
    assert "tokenizer.json" in err[0] and "tokenizer_config.json" in err[0], err[0]
    assert not (out / "ray").exists() and not (out / "logs").exists(), "Ray or a worker started"
    assert took < 60, f"refused after {took:.0f} s"
