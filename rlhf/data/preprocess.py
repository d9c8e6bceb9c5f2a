"""`rlhf preprocess`: tokenise jsonl (or one-document-per-line .txt) into `PREFIX_<key>_document.bin/.idx`.

Same flags and output naming as Megatron's `preprocess_data.py` / PAI's `preprocess_data_megatron.py`.
The input is streamed; tokenising runs in N worker processes; a malformed line is reported by line number
and skipped (or, with strict, is a UserError naming file:line).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlhf.data.chunked_map import imap_chunks
from rlhf.data.indexed import IndexedWriter, token_dtype
from rlhf.data.jsonl import check_input_file, get_text, iter_lines, parse_line
from rlhf.data.tokenizer import eod_id, load_tokenizer
from rlhf.errors import UserError

MAX_REPORTED = 20  # malformed lines printed one by one; the rest only counted

_worker: dict[str, Any] = {}


@dataclass
class PreprocessStats:
    """Counts from one preprocess run."""

    lines: int = 0
    docs: int = 0
    tokens: int = 0
    empty: int = 0
    malformed: int = 0
    no_loss: int = 0  # SFT: conversations with no assistant token within seq_length
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        rate = self.docs / self.seconds if self.seconds > 0 else 0.0
        no_loss = f", {self.no_loss} without assistant tokens within seq_length" if self.no_loss else ""
        return (
            f"{self.docs} documents, {self.tokens} tokens from {self.lines} lines in {self.seconds:.1f}s "
            f"({rate:.0f} docs/s); skipped {self.malformed} malformed, {self.empty} empty{no_loss}"
        )


def output_prefix_for(output_prefix: str | Path, json_key: str) -> str:
    """Megatron's naming: `<output-prefix>_<key>_document`."""
    return f"{output_prefix}_{json_key}_document"


def _init_worker(tokenizer_spec: Any, json_key: str, is_jsonl: bool, append_eod: bool) -> None:
    tok = load_tokenizer(tokenizer_spec)
    _worker.update(tok=tok, key=json_key, jsonl=is_jsonl, eod=eod_id(tok) if append_eod else None)


@dataclass
class EncodedChunk:
    """A chunk's result: its documents' ids concatenated (cheap to send between processes) and lengths."""

    lines: int
    ids: np.ndarray
    lengths: np.ndarray
    errors: list[tuple[int, str]]  # (line number, reason)

    def documents(self) -> Iterator[np.ndarray]:
        start = 0
        for n in self.lengths.tolist():
            yield self.ids[start : start + n]
            start += n


def _encode_chunk(chunk: list[tuple[int, str]]) -> EncodedChunk:
    """Parse and tokenise the chunk's lines as one batch; empty documents get length 0."""
    texts: list[str] = []
    errors: list[tuple[int, str]] = []
    for lineno, line in chunk:
        text, err = line, None
        if _worker["jsonl"]:
            obj, err = parse_line(line)
            if err is None:
                text, err = get_text(obj, _worker["key"])
        if err is None:
            texts.append(text)
        else:
            errors.append((lineno, err))
    docs = _worker["tok"](texts)["input_ids"] if texts else []
    eod = _worker["eod"]
    if eod is not None:  # as Megatron: no eod on an empty document
        docs = [ids + [eod] if ids else ids for ids in docs]
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    ids = np.fromiter((t for d in docs for t in d), dtype=np.int64, count=int(lengths.sum()))
    return EncodedChunk(len(chunk), ids, lengths, errors)


def preprocess_pretrain(
    input_path: str | Path,
    output_prefix: str | Path,
    tokenizer: Any,
    json_key: str = "text",
    workers: int = 1,
    append_eod: bool = False,
    strict: bool = False,
    chunk_size: int = 256,
    progress: bool = True,
) -> tuple[str, PreprocessStats]:
    """Tokenise `input_path` into `<output_prefix>_<json_key>_document.{bin,idx}`; return (prefix, stats).

    `.txt` input: each non-blank line is a document. Otherwise jsonl with a string under `json_key`.
    """
    from tqdm import tqdm

    path = check_input_file(input_path)
    tok = load_tokenizer(tokenizer)  # validates the folder before any worker starts
    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    out_prefix = output_prefix_for(output_prefix, json_key)
    is_jsonl = path.suffix.lower() != ".txt"
    stats = PreprocessStats()
    start = time.time()
    with IndexedWriter(out_prefix, token_dtype(len(tok))) as writer:
        bar = tqdm(unit="docs", desc="tokenising", file=sys.stderr, disable=not progress, mininterval=0.5)
        initargs = (tok, json_key, is_jsonl, append_eod)
        lines = iter_lines(path, on_bad_utf8=bad_utf8_reporter(stats, path, strict))
        for results in imap_chunks(_encode_chunk, lines, workers, _init_worker, initargs, chunk_size):
            for lineno, err in results.errors:
                report_malformed(stats, f"{path}:{lineno}: {err}", strict)
            for ids in results.documents():
                if ids.size:
                    writer.add(ids)
                else:
                    stats.empty += 1
            stats.lines += results.lines
            bar.update(results.lines)
        bar.close()
        stats.docs, stats.tokens = writer.num_docs, writer.num_tokens
        if stats.tokens == 0:
            raise UserError(f"{path}: no tokens to write ({stats.summary()})")
    stats.seconds = time.time() - start
    return out_prefix, stats


def bad_utf8_reporter(stats: PreprocessStats, path: Path, strict: bool) -> Callable[[int, str], None]:
    """The `iter_lines` callback for a line that is not valid UTF-8: counted and reported as malformed,
    or (strict) a UserError naming file:line."""

    def report(lineno: int, reason: str) -> None:
        stats.lines += 1
        report_malformed(stats, f"{path}:{lineno}: {reason}", strict)

    return report


def report_malformed(stats: PreprocessStats, message: str, strict: bool) -> None:
    if strict:
        raise UserError(message)
    stats.malformed += 1
    if stats.malformed <= MAX_REPORTED:
        stats.errors.append(message)
        print(f"{message} (skipped)", file=sys.stderr)
    elif stats.malformed == MAX_REPORTED + 1:
        print(
            "... more malformed lines; only counting from here (--strict fails on the first)", file=sys.stderr
        )
