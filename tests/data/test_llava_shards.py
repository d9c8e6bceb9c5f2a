"""`rlhf preprocess --format llava`: LLaVA records -> WebDataset shards, the streaming reader, bad records."""

from __future__ import annotations

import gc
import io
import json
import os
import tarfile
import warnings

import pytest
from PIL import Image

from rlhf.cli import main as rlhf_main
from rlhf.data.llava_shards import count_shards, iter_llava_shards, write_llava_shards
from rlhf.data.shapes import llava_records, make_items, messages
from rlhf.errors import UserError


def _image_file(path, fmt: str, colour=(200, 10, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 12), colour).save(buf, format=fmt)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def _turns(*pairs):
    return [{"from": who, "value": text} for who, text in pairs]


def _write_json(path, records):
    path.write_text(json.dumps(records))
    return path


@pytest.fixture
def shapes(tmp_path):
    items = make_items(12, seed=3)
    src = llava_records(items, tmp_path / "img", tmp_path / "data.json")
    return items, src, tmp_path / "img"


def test_round_trip_shapes(tmp_path, shapes):
    items, src, img = shapes
    stats = write_llava_shards(src, img, tmp_path / "out", shard_size=5)
    assert (stats.records, stats.samples, stats.images, sum(stats.skipped.values())) == (12, 12, 12, 0)
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"] and len(stats.shards) == 3
    with tarfile.open(tmp_path / "out" / "shard-000002.tar") as tar:  # 12 = 5 + 5 + 2
        assert tar.getnames() == ["00000010.0.png", "00000010.json", "00000011.0.png", "00000011.json"]
    samples = list(iter_llava_shards(tmp_path / "out"))
    assert [s["key"] for s in samples] == [f"{i:08d}" for i in range(12)]
    assert [s["id"] for s in samples] == [f"shape-{i}" for i in range(12)]
    for i, (sample, item) in enumerate(zip(samples, items)):
        assert sample["messages"] == messages(item)  # image part first, then the question; the answer
        assert sample["images"] == [(img / f"shape_{i:06d}.png").read_bytes()]
    pattern = str(tmp_path / "out" / "shard-{000000..000002}.tar")
    assert [s["id"] for s in iter_llava_shards(pattern)] == [s["id"] for s in samples]
    assert count_shards(pattern) == (12, stats.bytes, 3)
    assert "12 samples (12 images" in stats.summary() and "in 3 shards from 12 records; skipped 0" in stats.summary()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # webdataset leaks its handles
def test_shards_read_by_webdataset(tmp_path, shapes):
    import webdataset as wds

    _, src, img = shapes
    write_llava_shards(src, img, tmp_path / "out", shard_size=5)
    ds = wds.WebDataset(str(tmp_path / "out" / "shard-{000000..000002}.tar"), shardshuffle=False)
    got = [(s["__key__"], json.loads(s["json"])["id"], s["0.png"]) for s in ds]
    assert [(k, i) for k, i, _ in got] == [(f"{n:08d}", f"shape-{n}") for n in range(12)]
    assert got[4][2] == (img / "shape_000004.png").read_bytes()


def test_reader_closes_shard_on_early_stop(tmp_path, shapes):
    _, src, img = shapes
    write_llava_shards(src, img, tmp_path / "out", shard_size=5)

    def open_shards():
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return [f for f in fds if f.endswith(".tar")]

    with warnings.catch_warnings(record=True) as caught:  # a file closed by the GC warns
        warnings.simplefilter("always", ResourceWarning)
        gen = iter_llava_shards(tmp_path / "out")
        next(gen)
        assert len(open_shards()) == 1
        gen.close()
        assert open_shards() == []
        assert len(list(iter_llava_shards(tmp_path / "out"))) == 12
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_multi_image_text_only_and_system(tmp_path):
    img = tmp_path / "img"
    img.mkdir()
    jpg = _image_file(img / "a.jpg", "JPEG")
    png = _image_file(img / "b.png", "PNG", (0, 0, 255))
    _image_file(img / "c.bmp", "BMP", (0, 255, 0))
    records = [
        {"id": "x.y/1", "image": ["a.jpg", "b.png"], "conversations": _turns(
            ("system", "Be brief."), ("human", "Compare <image>\nand <image>\nplease"), ("gpt", "same"),
            ("human", "Sure?"), ("gpt", "yes"))},
        {"id": 7, "conversations": _turns(("human", "hi"), ("gpt", "hello"))},
        {"id": "bmp", "image": "c.bmp", "conversations": _turns(("human", "What colour?\n<image>"), ("gpt", "green"))},
    ]
    stats = write_llava_shards(_write_json(tmp_path / "d.json", records), img, tmp_path / "out")
    assert (stats.samples, stats.images, len(stats.shards)) == (3, 3, 1)
    with tarfile.open(tmp_path / "out" / "shard-000000.tar") as tar:
        assert tar.getnames() == ["00000000.0.jpg", "00000000.1.png", "00000000.json", "00000001.json",
                                  "00000002.0.png", "00000002.json"]
    multi, text, bmp = iter_llava_shards(tmp_path / "out")
    assert multi["id"] == "x.y/1" and multi["key"] == "00000000"
    assert multi["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                     {"type": "text", "text": "and "}, {"type": "image"},
                                     {"type": "text", "text": "please"}]},
        {"role": "assistant", "content": "same"},
        {"role": "user", "content": [{"type": "text", "text": "Sure?"}]},
        {"role": "assistant", "content": "yes"},
    ]
    assert multi["images"] == [jpg, png]
    assert text == {"key": "00000001", "id": 7, "images": [], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "hello"}]}
    assert bmp["messages"][0]["content"] == [{"type": "text", "text": "What colour?\n"}, {"type": "image"}]
    converted = Image.open(io.BytesIO(bmp["images"][0]))
    assert converted.format == "PNG" and converted.getpixel((3, 3)) == (0, 255, 0)


def _bad_set(tmp_path):
    img = tmp_path / "img"
    img.mkdir()
    _image_file(img / "ok.png", "PNG")
    (img / "garbage.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    qa = _turns(("human", "<image>\nQ"), ("gpt", "A"))
    records = [
        {"id": "good-0", "image": "ok.png", "conversations": qa},
        {"id": "miss", "image": "nope.png", "conversations": qa},
        {"id": "corrupt", "image": "garbage.png", "conversations": qa},
        {"id": "no-placeholder", "image": "ok.png", "conversations": _turns(("human", "Q"), ("gpt", "A"))},
        {"id": "two-placeholders", "image": "ok.png", "conversations": _turns(("human", "<image><image>Q"), ("gpt", "A"))},
        {"id": "robot", "conversations": _turns(("human", "Q"), ("robot", "A"))},
        {"id": "gpt-first", "conversations": _turns(("gpt", "A"), ("human", "Q"))},
        {"id": "two-humans", "conversations": _turns(("human", "Q"), ("human", "Q"), ("gpt", "A"))},
        {"id": "empty", "conversations": []},
        {"id": "no-conv"},
        "not an object",
        {"id": "good-11", "image": ["ok.png"], "conversations": qa},
    ]
    return _write_json(tmp_path / "data.json", records), img


def test_bad_records_skipped_and_counted(tmp_path, capsys):
    src, img = _bad_set(tmp_path)
    stats = write_llava_shards(src, img, tmp_path / "out")
    assert [s["id"] for s in iter_llava_shards(tmp_path / "out")] == ["good-0", "good-11"]
    assert [s["key"] for s in iter_llava_shards(tmp_path / "out")] == ["00000000", "00000011"]
    assert (stats.records, stats.samples) == (12, 2)
    assert dict(stats.skipped) == {"image_missing": 1, "image_corrupt": 1, "placeholder_mismatch": 2,
                                   "bad_role": 1, "bad_conversation": 4, "not_object": 1}
    assert "skipped 10 (4 bad_conversation, 1 bad_role, 1 image_corrupt" in stats.summary()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 10 and all(line.endswith("(skipped)") for line in err)
    assert err[0] == f"{src} record 1 (id 'miss'): image 'nope.png' not found in {img} (skipped)"
    assert err[1].startswith(f"{src} record 2 (id 'corrupt'): image 'garbage.png' is not a readable image")
    assert err[2] == f"{src} record 3 (id 'no-placeholder'): 0 <image> placeholders for 1 images (skipped)"
    assert "record 5 (id 'robot'): turn 1 has role 'robot'" in err[4]
    assert "record 6 (id 'gpt-first'): turn 0 is 'gpt'" in err[5]
    assert err[9] == f"{src} record 10: expected a JSON object, got str (skipped)"


def test_bad_records_strict(tmp_path):
    src, img = _bad_set(tmp_path)
    with pytest.raises(UserError, match=r"data\.json record 1 \(id 'miss'\): image 'nope\.png' not found in"):
        write_llava_shards(src, img, tmp_path / "out", strict=True)
    records = json.loads(src.read_text())
    _write_json(src, [records[0], records[6]])
    with pytest.raises(UserError, match=r"record 1 \(id 'gpt-first'\): turn 0 is 'gpt'"):
        write_llava_shards(src, img, tmp_path / "out", strict=True)
    _write_json(src, records[1:3])
    with pytest.raises(UserError, match="no samples to write"):
        write_llava_shards(src, img, tmp_path / "out")


def test_invalid_json_names_the_line(tmp_path, capsys):
    img = tmp_path / "img"
    img.mkdir()
    bad = tmp_path / "bad.json"
    bad.write_text('[\n {"id": "a", "conversations": []},\n {"id": "b",, }\n]\n')
    with pytest.raises(UserError, match=rf"{bad}:3: not valid JSON"):
        write_llava_shards(bad, img, tmp_path / "out")
    _write_json(bad, {"id": "a"})
    with pytest.raises(UserError, match="expected a JSON list of records, got dict"):
        write_llava_shards(bad, img, tmp_path / "out")
    good = {"id": "t", "conversations": _turns(("human", "hi"), ("gpt", "yo"))}
    lines = tmp_path / "d.jsonl"
    lines.write_text(json.dumps(good) + "\n{broken\n\n" + json.dumps({**good, "id": "u"}) + "\n")
    stats = write_llava_shards(lines, img, tmp_path / "out")
    assert dict(stats.skipped) == {"invalid_json": 1} and (stats.records, stats.samples) == (3, 2)
    assert capsys.readouterr().err.startswith(f"{lines}:2: not valid JSON")
    assert [(s["key"], s["id"]) for s in iter_llava_shards(tmp_path / "out")] == [("00000000", "t"), ("00000002", "u")]
    with pytest.raises(UserError, match=rf"{lines}:2: not valid JSON"):
        write_llava_shards(lines, img, tmp_path / "out", strict=True)


def test_cli_llava(tmp_path, shapes, capsys):
    _, src, img = shapes
    out = tmp_path / "shards"
    base = ["preprocess", "--format", "llava", "--input", str(src)]
    assert rlhf_main([*base, "--images", str(img), "--output-dir", str(out), "--shard-size", "5"]) == 0
    printed = capsys.readouterr().out.splitlines()
    size = count_shards(out)[1]
    assert printed[0].startswith("12 samples (12 images") and printed[1:] == [
        f"wrote 3 shards to {out}", f"read 12 samples, {size} bytes from 3 shards"]
    # a rerun with bigger shards replaces the earlier ones
    assert rlhf_main([*base, "--images", str(img), "--output-dir", str(out), "--strict"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [f"wrote 1 shards to {out}", f"read 12 samples, {size} bytes from 1 shards"]
    assert [p.name for p in out.iterdir()] == ["shard-000000.tar"]

    def error(argv):
        assert rlhf_main(argv) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1
        return lines[0]

    assert error([*base, "--output-dir", str(out)]) == "rlhf preprocess: error: --images is required with --format llava"
    assert error([*base, "--images", str(img)]) == "rlhf preprocess: error: --output-dir is required with --format llava"
    assert "--images " + str(tmp_path / "none") in error([*base, "--images", str(tmp_path / "none"), "--output-dir", str(out)])
    assert "--input " + str(tmp_path / "x.json") in error(
        ["preprocess", "--format", "llava", "--input", str(tmp_path / "x.json"), "--images", str(img), "--output-dir", str(out)])
    assert "--shard-size must be >= 1" in error([*base, "--images", str(img), "--output-dir", str(out), "--shard-size", "0"])
    assert error(["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "p")]) == (
        "rlhf preprocess: error: --tokenizer is required (with --format indexed)")


def test_shards_as_rl_prompts(tmp_path, shapes):
    """`data.train_file` naming shards: the conversation minus its answer is the prompt, the answer the ground
    truth, the image bytes ride along; a sample that does not end with the answer is refused by key and id."""
    from rlhf.data.prompts import read_prompt_file
    from rlhf.workflow import prompt_batch

    items, src, img = shapes
    write_llava_shards(src, img, tmp_path / "out", shard_size=5)
    recs = read_prompt_file(tmp_path / "out")
    assert [r["ground_truth"] for r in recs] == [it.answer for it in items]
    assert recs[0]["messages"] == messages(items[0], with_answer=False)
    assert recs[0]["images"] == [(img / "shape_000000.png").read_bytes()]
    batch = prompt_batch(recs[:3])
    assert batch.meta["images"] == [r["images"] for r in recs[:3]] and batch.meta["messages"][1] == recs[1]["messages"]
    question_only = _write_json(tmp_path / "q.json", [{"id": "q1", "image": "shape_000000.png",
                                                       "conversations": _turns(("human", "<image>\nWhat?"))}])
    write_llava_shards(question_only, img, tmp_path / "q")
    with pytest.raises(UserError, match=r"sample 00000000 \(id 'q1'\): the conversation must end with the assistant"):
        read_prompt_file(tmp_path / "q")
