"""The arithmetic example task files and the script that writes them."""

from __future__ import annotations

import json

from examples.make_arithmetic_data import main as make_data
from rlhf.data.arithmetic import split_pairs, write_arithmetic_data
from rlhf.data.prompts import load_prompt_dataset
from rlhf.data.sft import SFTDataset


def test_split_is_seeded_and_disjoint():
    train, val = split_pairs(seed=0, val_size=200)
    assert len(train) == 9800 and len(val) == 200 and not set(train) & set(val)
    assert split_pairs(seed=0)[1] == val and split_pairs(seed=1)[1] != val


def test_files_load_as_prompts_sft_and_text(tmp_path, tok_dir):
    paths = write_arithmetic_data(tmp_path, seed=0, val_size=200)
    train, val = load_prompt_dataset(paths["rl_train"], val_file=paths["rl_val"])
    assert len(train) == 9800 and len(val) == 200
    for r in val[:20]:
        a, b = (int(x) for x in r["prompt"].removeprefix("What is ").removesuffix("?").split("+"))
        assert r["ground_truth"] == str(a + b)
    chat, _ = load_prompt_dataset(paths["rl_val"], messages_key="messages")
    assert chat[0]["messages"][0]["role"] == "user"
    val_questions = {r["prompt"] for r in val}
    with open(paths["pretrain"]) as f:
        texts = [json.loads(line)["text"] for line in f]
    assert len(texts) == 9800 and not any(t.rsplit(" ", 1)[0] in val_questions for t in texts)
    sft = SFTDataset(paths["sft_val"], tok_dir, seq_length=32)
    assert len(sft) == 200 and sft[0]["loss_mask"].sum() >= 2  # the digits and <|im_end|>


def test_script(tmp_path, capsys):
    assert make_data(["--out", str(tmp_path / "d"), "--val-size", "100"]) == 0
    assert "rl_val: " in capsys.readouterr().out
    assert len((tmp_path / "d" / "rl_val.jsonl").read_text().splitlines()) == 100
    assert make_data(["--out", str(tmp_path / "e"), "--val-size", "10000"]) == 2
