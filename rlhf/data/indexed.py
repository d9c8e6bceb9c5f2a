"""Writing and reading Megatron's indexed dataset (`PREFIX.bin` + `PREFIX.idx`) through megatron-core."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rlhf.data.checks import check_data_prefix, data_prefix_paths
from rlhf.errors import UserError
from workers.file_problems import file_errors, partial_name


def megatron_indexed():
    """megatron-core's indexed_dataset module, imported without its CPU-only "no TE / Apex" warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def token_dtype(vocab_size: int) -> type[np.number]:
    """The smallest dtype Megatron uses for token ids of this vocabulary (uint16 below 65500, else int32)."""
    return megatron_indexed().DType.optimal_dtype(vocab_size)


class IndexedWriter:
    """Context manager around `IndexedDatasetBuilder`: one document per `add`. The files are written under
    temporary names and renamed on success (`.bin` first, then the `.idx` that marks the set complete);
    on error they are removed. A full disk or read-only folder is a FileProblem naming the file."""

    def __init__(self, prefix: str | Path, dtype: type[np.number]) -> None:
        self.prefix = str(prefix)
        self.dtype = dtype
        self.num_docs = 0
        self.num_tokens = 0
        self._builder = None

    def __enter__(self) -> IndexedWriter:
        bin_path, _ = data_prefix_paths(self.prefix)
        if not bin_path.parent.is_dir():
            raise UserError(f"output folder {bin_path.parent} does not exist")
        with file_errors(bin_path, "write"):
            self._builder = megatron_indexed().IndexedDatasetBuilder(str(partial_name(bin_path)), dtype=self.dtype)
        return self

    def add(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one document (a non-empty sequence of ids) as a single sequence."""
        arr = np.asarray(ids, dtype=self.dtype)
        with file_errors(data_prefix_paths(self.prefix)[0], "write"):
            self._builder.add_document(arr, [int(arr.size)])
        self.num_docs += 1
        self.num_tokens += int(arr.size)

    def __exit__(self, exc_type, exc, tb) -> None:
        bin_path, idx_path = data_prefix_paths(self.prefix)
        tmp_bin, tmp_idx = partial_name(bin_path), partial_name(idx_path)
        if exc_type is not None:
            self._remove(tmp_bin, tmp_idx)
            return
        try:
            with file_errors(bin_path, "write"):
                self._builder.data_file.close()  # flushes: a full disk shows here
            with file_errors(idx_path, "write"):
                self._builder.finalize(str(tmp_idx))
            os.replace(tmp_bin, bin_path)
            os.replace(tmp_idx, idx_path)
        except BaseException:
            self._remove(tmp_bin, tmp_idx)
            raise

    def _remove(self, *paths: Path) -> None:
        self._builder.data_file.close()
        for p in paths:
            p.unlink(missing_ok=True)


def open_indexed(prefix: str | Path):
    """Open an existing indexed dataset (mmap), checking the files first.

    Keep the returned object alive while using arrays read from it: megatron-core unmaps the file in
    its __del__, and a view outliving it segfaults (`open_indexed(p)[0].tolist()` does).
    """
    check_data_prefix(prefix)
    bin_path, _ = data_prefix_paths(prefix)
    if bin_path.stat().st_size == 0:  # numpy cannot mmap an empty file
        raise UserError(f"data prefix {prefix} has zero tokens ({bin_path} is empty)")
    return megatron_indexed().IndexedDataset(str(prefix), mmap=True)

