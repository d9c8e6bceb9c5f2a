"""Loading HF tokenizers from local folders, and the small adapter megatron-core's GPT datasets need."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf.errors import UserError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(tokenizer_dir_or_obj: Any):
    """Return an HF tokenizer: `tokenizer_dir_or_obj` is a local folder or an already loaded tokenizer.

    Never touches a hub: a path that is not an existing folder with tokenizer files is a UserError.
    """
    if not isinstance(tokenizer_dir_or_obj, str | Path):
        return tokenizer_dir_or_obj
    path = Path(tokenizer_dir_or_obj)
    if not path.exists():
        raise UserError(f"tokenizer folder {path} does not exist")
    if not path.is_dir():
        raise UserError(f"tokenizer path {path} is not a folder (expected an HF model or tokenizer folder)")
    if not any((path / name).exists() for name in _TOKENIZER_FILES):
        raise UserError(f"tokenizer folder {path} has none of {', '.join(_TOKENIZER_FILES)}")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types; the user needs the folder and the reason
        raise UserError(f"cannot load the tokenizer from {path}: {e}") from e


def eod_id(tokenizer) -> int:
    """The end-of-document id appended by `--append-eod`: the tokenizer's eos (as Megatron's HF tokenizer)."""
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    raise UserError("the tokenizer has neither an eos nor a pad token; cannot mark end of document")


def pad_id(tokenizer) -> int:
    """The padding id: the tokenizer's pad token, else its eos."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return eod_id(tokenizer)


class MegatronTokenizerAdapter:
    """What megatron-core's GPTDataset reads from `GPTDatasetConfig.tokenizer`: eod, pad, vocab_size and
    a JSON-serialisable `unique_identifiers` dict (part of the dataset cache key)."""

    def __init__(self, tokenizer, name: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.eod = eod_id(tokenizer)
        self.eos = self.eod
        self.pad = pad_id(tokenizer)
        self.vocab_size = len(tokenizer)
        self.unique_identifiers = {
            "class": type(self).__name__,
            "tokenizer": name or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "pad": self.pad,
        }

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)
