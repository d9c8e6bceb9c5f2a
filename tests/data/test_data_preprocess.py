"""`rlhf preprocess` (pretraining text) and `rlhf clean`: output, malformed lines, workers, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from rlhf.cli import main as rlhf_main
from rlhf.data.clean import clean_file, normalize_text
from rlhf.data.indexed import open_indexed
from rlhf.data.preprocess import preprocess_pretrain
from rlhf.errors import UserError
from tests.helpers.files import write_lines

TEXTS = [f"What is {a}+{a + 1}? The answer is {2 * a + 1}." for a in range(40)]


def _corpus(tmp_path):
    lines: list = [{"text": t, "id": i} for i, t in enumerate(TEXTS)]
    lines.insert(3, "{not json")  # line 4
    lines.insert(10, {"body": "no text key"})  # line 11
    lines.insert(20, {"text": 17})  # line 21
    lines.insert(25, "")  # blank: ignored silently
    return write_lines(tmp_path / "corpus.jsonl", lines)


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_writes_documents_and_skips_malformed(tmp_path, tok_dir, tokenizer, capsys, workers):
    src = _corpus(tmp_path)
    prefix, stats = preprocess_pretrain(
        src, tmp_path / "out", tok_dir, workers=workers, append_eod=True, chunk_size=7
    )
    assert prefix == f"{tmp_path / 'out'}_text_document"
    assert (stats.docs, stats.malformed, stats.lines) == (len(TEXTS), 3, len(TEXTS) + 3)
    err = capsys.readouterr().err
    for where in (
        f"{src}:4: not valid JSON",
        f"{src}:11: missing key 'text'",
        f"{src}:21: key 'text' is int",
    ):
        assert where in err
    ds = open_indexed(prefix)
    assert len(ds) == len(TEXTS)
    for i, text in enumerate(TEXTS):
        expected = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        assert ds[i].tolist() == expected
    assert ds[0].dtype == np.uint16  # Megatron's optimal dtype for a small vocabulary
    assert stats.tokens == sum(len(ds[i]) for i in range(len(ds)))


def test_preprocess_strict_fails_naming_the_line_and_leaves_no_files(tmp_path, tok_dir):
    src = _corpus(tmp_path)
    with pytest.raises(UserError, match=rf"{src}:4: not valid JSON"):
        preprocess_pretrain(src, tmp_path / "out", tok_dir, strict=True, progress=False)
    assert not list(tmp_path.glob("out_text_document*"))


def test_preprocess_bad_input(tmp_path, tok_dir):
    src = _corpus(tmp_path)
    with pytest.raises(UserError, match="tokenizer folder .*nope does not exist"):
        preprocess_pretrain(src, tmp_path / "out", tmp_path / "nope")
    with pytest.raises(UserError, match="input file .*missing.jsonl does not exist"):
        preprocess_pretrain(tmp_path / "missing.jsonl", tmp_path / "out", tok_dir)
    bad = write_lines(tmp_path / "bad.jsonl", ["nope", {"x": 1}])
    with pytest.raises(UserError, match="no tokens to write"):
        preprocess_pretrain(bad, tmp_path / "bad", tok_dir, progress=False)
    assert not list(tmp_path.glob("bad_text_document*"))


def test_preprocess_txt_and_custom_key(tmp_path, tok_dir, tokenizer):
    txt = tmp_path / "docs.txt"
    txt.write_text("first doc\n\nsecond doc\n")
    prefix, stats = preprocess_pretrain(txt, tmp_path / "t", tok_dir, progress=False)
    ds = open_indexed(prefix)  # keep `ds` alive while using its arrays: its __del__ unmaps them
    assert stats.docs == 2 and ds[1].tolist() == tokenizer("second doc")["input_ids"]
    src = write_lines(tmp_path / "c.jsonl", [{"content": "hello world"}])
    prefix, _ = preprocess_pretrain(src, tmp_path / "c", tok_dir, json_key="content", progress=False)
    assert prefix.endswith("c_content_document")


def test_cli_preprocess_clean_and_errors(tmp_path, tok_dir, capsys):
    raw = tmp_path / "raw.txt"
    raw.write_text("a  b\tc  doc one\n\nshort\n a b c doc one \nthe second   document\n")
    assert (
        rlhf_main(
            [
                "clean",
                "--input",
                str(raw),
                "--output",
                str(tmp_path / "c.txt"),
                "--dedup-lines",
                "--min-length",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "read 4, kept 2, dropped 2 (1 duplicate, 1 too_short)" in out
    assert (tmp_path / "c.txt").read_text() == "a b c doc one\nthe second document\n"
    prefix = tmp_path / "sub" / "p"
    assert (
        rlhf_main(
            [
                "preprocess",
                "--input",
                str(tmp_path / "c.txt"),
                "--output-prefix",
                str(prefix),
                "--tokenizer",
                tok_dir,
                "--workers",
                "2",
                "--append-eod",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "2 documents" in capsys.readouterr().out
    assert (tmp_path / "sub" / "p_text_document.idx").is_file()
    assert (
        rlhf_main(
            [
                "preprocess",
                "--input",
                str(raw),
                "--output-prefix",
                str(prefix),
                "--tokenizer",
                str(tmp_path / "none"),
            ]
        )
        == 2
    )
    assert "rlhf preprocess: error: tokenizer folder" in capsys.readouterr().err


def test_normalize_and_clean_jsonl(tmp_path):
    assert normalize_text("  a\t\tb  \r\n\r\n\r\n\n c   d ") == "a b\n\nc d"
    src = write_lines(
        tmp_path / "in.jsonl",
        [
            {"text": "Hello   world, this is long", "meta": 1},
            {"text": "hello world"},
            {"text": "Hello world, this is long "},
            {"text": "   "},
            "broken",
        ],
    )
    stats = clean_file(src, tmp_path / "out.jsonl", min_length=12, dedup=True)
    assert stats.read == 5 and stats.kept == 1
    assert dict(stats.dropped) == {"too_short": 1, "duplicate": 1, "empty": 1, "malformed": 1}
    assert f"{src}:5" in stats.first_malformed
    assert (tmp_path / "out.jsonl").read_text() == '{"text": "Hello world, this is long", "meta": 1}\n'
    with pytest.raises(UserError, match="is the input file"):
        clean_file(src, src)
