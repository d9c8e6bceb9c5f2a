"""Fixtures for the data tests: the tiny-qwen2 tokenizer folder and small jsonl writers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tok_dir(tiny_model_factory) -> str:
    """An HF model folder (tiny-qwen2) with a ChatML tokenizer."""
    return tiny_model_factory("tiny-qwen2")


@pytest.fixture(scope="session")
def tokenizer(tok_dir):
    from rlhf.data.tokenizer import load_tokenizer

    return load_tokenizer(tok_dir)


def write_lines(path: Path, lines: list) -> Path:
    """Write dicts as JSON lines and strings verbatim."""
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path
