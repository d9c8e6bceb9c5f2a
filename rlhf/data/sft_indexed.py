"""Pre-built SFT sets in Megatron's indexed format (`rlhf preprocess --sft --output-prefix P`).

Two indexed datasets with one sequence per conversation, in the same order:
- `P_sft_input_ids.{bin,idx}`: the rendered conversation's token ids, truncated to seq_length + 1;
- `P_sft_assistant_mask.{bin,idx}` (uint8): 1 on the ids that carry the loss (assistant turns).
`SFTDataset(P, tokenizer, seq_length)` reads them (it may truncate further, not extend).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from rlhf.data.chat import check_chat_template, encode_sft_record
from rlhf.data.chunked_map import imap_chunks
from rlhf.data.indexed import IndexedWriter, open_indexed, token_dtype
from rlhf.data.jsonl import check_input_file, iter_lines, parse_line
from rlhf.data.preprocess import PreprocessStats, bad_utf8_reporter, report_malformed
from rlhf.data.tokenizer import load_tokenizer
from rlhf.errors import UserError

IDS_SUFFIX = "_sft_input_ids"
MASK_SUFFIX = "_sft_assistant_mask"

_worker: dict[str, Any] = {}


def sft_prefixes(prefix: str | Path) -> tuple[str, str]:
    """The (input ids, assistant mask) indexed prefixes of SFT set `prefix`."""
    return f"{prefix}{IDS_SUFFIX}", f"{prefix}{MASK_SUFFIX}"


def is_sft_prefix(prefix: str | Path) -> bool:
    """Whether `prefix` names a pre-built SFT set (its input-ids index exists)."""
    return Path(sft_prefixes(prefix)[0] + ".idx").is_file()


class SFTIndexedStore:
    """Random access to (ids, assistant mask) of a pre-built SFT set; holds the mmaps open."""

    def __init__(self, prefix: str | Path) -> None:
        ids_prefix, mask_prefix = sft_prefixes(prefix)
        self._ids = open_indexed(ids_prefix)
        self._masks = open_indexed(mask_prefix)
        self._lengths = np.array(self._ids.sequence_lengths, dtype=np.int64)
        mask_lengths = np.array(self._masks.sequence_lengths, dtype=np.int64)
        if not np.array_equal(self._lengths, mask_lengths):
            raise UserError(f"SFT set {prefix}: {ids_prefix} and {mask_prefix} do not match; rebuild it")

    def __len__(self) -> int:
        return int(self._lengths.size)

    def length(self, i: int) -> int:
        return int(self._lengths[i])

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return np.array(self._ids[i], dtype=np.int32), np.array(self._masks[i], dtype=np.uint8)


def _init_worker(tokenizer: Any, seq_length: int) -> None:
    _worker.update(tok=tokenizer, seq_length=seq_length)


def _encode_chunk(chunk: list[tuple[int, str]]) -> list[tuple[int, Any, str | None]]:
    """(line number, (ids, mask) | None, error | None) per line; None without error means no loss tokens."""
    out = []
    for lineno, line in chunk:
        obj, err = parse_line(line)
        pair = None
        if err is None:
            try:
                pair = encode_sft_record(_worker["tok"], obj, "", _worker["seq_length"])
            except UserError as e:
                err = str(e).removeprefix(": ")
        out.append((lineno, pair, err))
    return out


def preprocess_sft(
    input_path: str | Path,
    output_prefix: str | Path,
    tokenizer: Any,
    seq_length: int,
    workers: int = 1,
    strict: bool = False,
    chunk_size: int = 32,
    progress: bool = True,
) -> tuple[str, PreprocessStats]:
    """Tokenise a conversations jsonl into the two indexed datasets above; return (prefix, stats)."""
    from tqdm import tqdm

    path = check_input_file(input_path)
    tok = load_tokenizer(tokenizer)
    check_chat_template(tok)
    if not isinstance(seq_length, int) or seq_length < 1:
        raise UserError(f"--seq-length must be a positive integer, got {seq_length!r}")
    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    ids_prefix, mask_prefix = sft_prefixes(output_prefix)
    stats = PreprocessStats()
    start = time.time()
    with (
        IndexedWriter(ids_prefix, token_dtype(len(tok))) as ids_out,
        IndexedWriter(mask_prefix, np.uint8) as mask_out,
    ):
        bar = tqdm(unit="docs", desc="tokenising", file=sys.stderr, disable=not progress, mininterval=0.5)
        lines = iter_lines(path, on_bad_utf8=bad_utf8_reporter(stats, path, strict))
        chunks = imap_chunks(_encode_chunk, lines, workers, _init_worker, (tok, seq_length), chunk_size)
        for results in chunks:
            for lineno, pair, err in results:
                stats.lines += 1
                if err is not None:
                    report_malformed(stats, f"{path}:{lineno}: {err}", strict)
                elif pair is None:
                    stats.no_loss += 1
                else:
                    ids_out.add(pair[0])
                    mask_out.add(pair[1])
            bar.update(len(results))
        bar.close()
        stats.docs, stats.tokens = ids_out.num_docs, ids_out.num_tokens
        if stats.docs == 0:
            raise UserError(f"{path}: no SFT samples to write ({stats.summary()})")
    stats.seconds = time.time() - start
    return str(output_prefix), stats
