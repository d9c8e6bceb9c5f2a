"""Invalid UTF-8 in input files is reported by file:line (never replaced with U+FFFD), refused under --strict
and in prompt files."""

from __future__ import annotations

import json

import pytest

from rlhf.cli import main as rlhf_main
from rlhf.data.indexed import open_indexed
from rlhf.data.prompts import read_prompt_file
from rlhf.errors import UserError

BAD = b"\xff\xfebroken \xc3("  # not UTF-8: a stray 0xff, then a truncated 2-byte sequence


def _jsonl_with_bad_line(path, key: str = "text"):
    """Lines 1, 2 and 4 are valid jsonl; line 3 holds invalid UTF-8 inside a JSON string."""
    rows = [json.dumps({key: f"document number {i}", "answer": str(i)}).encode() for i in range(3)]
    bad = b'{"' + key.encode() + b'": "' + BAD + b'", "answer": "9"}'
    path.write_bytes(b"\n".join([rows[0], rows[1], bad, rows[2]]) + b"\n")
    return path


def test_clean_drops_and_reports_invalid_lines(tmp_path, capsys):
    src = tmp_path / "raw.txt"
    src.write_bytes(b"first document\n" + BAD + b"\nsecond document\n")
    out = tmp_path / "clean.txt"
    assert rlhf_main(["clean", "--input", str(src), "--output", str(out)]) == 0
    cap = capsys.readouterr()
    assert f"{src}:2: invalid UTF-8 (byte 0xff at character 1) (dropped)" in cap.err
    assert "read 3, kept 2, dropped 1 (1 invalid_utf8)" in cap.out
    text = out.read_text(encoding="utf-8")
    assert text == "first document\nsecond document\n"
    assert "\ufffd" not in text


@pytest.mark.parametrize("sft", [False, True])
def test_preprocess_reports_invalid_lines_and_strict_refuses(tmp_path, tok_dir, capsys, sft):
    if sft:
        rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
                for i in range(3)]
        good = [json.dumps(r).encode() for r in rows]
        src = tmp_path / "conv.jsonl"
        src.write_bytes(b"\n".join([good[0], good[1], b'{"messages": "' + BAD + b'"}', good[2]]) + b"\n")
        extra = ["--sft", "--seq-length", "32"]
    else:
        src = _jsonl_with_bad_line(tmp_path / "corpus.jsonl")
        extra = []
    prefix = tmp_path / "out"
    base = ["preprocess", "--input", str(src), "--output-prefix", str(prefix), "--tokenizer", tok_dir,
            "--no-progress", *extra]
    assert rlhf_main(base) == 0
    cap = capsys.readouterr()
    assert f"{src}:3: invalid UTF-8 (byte 0xff at character " in cap.err
    assert "3 documents" in cap.out and "skipped 1 malformed" in cap.out
    if not sft:
        ds = open_indexed(f"{prefix}_text_document")
        assert len(ds) == 3
        del ds
    for f in tmp_path.glob("out_*"):
        f.unlink()
    assert rlhf_main([*base, "--strict"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlhf preprocess: error: {src}:3: invalid UTF-8 (byte 0xff")
    assert len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("out_*")), "strict failure left output files"


def test_prompt_file_with_invalid_utf8_names_file_and_line(tmp_path):
    src = _jsonl_with_bad_line(tmp_path / "prompts.jsonl", key="prompt")
    with pytest.raises(UserError, match=rf"^{src}:3: invalid UTF-8 \(byte 0xff at character \d+\)$"):
        read_prompt_file(src)


def test_generate_input_with_invalid_utf8_is_one_line(tmp_path, tok_dir, capsys):
    src = _jsonl_with_bad_line(tmp_path / "prompts.jsonl", key="prompt")
    assert rlhf_main(["generate", "--model", tok_dir, "--input", str(src)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"rlhf generate: error: {src}:3: invalid UTF-8 (byte 0xff at character 13)"
