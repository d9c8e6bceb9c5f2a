"""Fixtures for the data tests: the tiny-qwen2 tokenizer folder and its tokenizer (jsonl writers:
tests/helpers/files.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tok_dir(tiny_model_factory) -> str:
    """An HF model folder (tiny-qwen2) with a ChatML tokenizer."""
    return tiny_model_factory("tiny-qwen2")


@pytest.fixture(scope="session")
def tokenizer(tok_dir):
    from rlhf.data.tokenizer import load_tokenizer

    return load_tokenizer(tok_dir)
