"""The arithmetic example task files and the script that writes them."""

from __future__ import annotations

import json
from pathlib import Path

from examples.make_arithmetic_data import main as make_data
from rlhf.data.arithmetic import WRONG_OFFSETS, split_pairs, write_arithmetic_data, write_preference_data
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


def _pairs(path) -> list[tuple[int, int, int]]:
    """(a + b, chosen, rejected) per line."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    sums = [sum(int(x) for x in r["messages"][0]["content"].removeprefix("What is ").removesuffix("?").split("+"))
            for r in rows]
    return [(s, int(r["chosen"]), int(r["rejected"])) for s, r in zip(sums, rows, strict=True)]


def test_preference_pairs_near_misses_for_dpo_half_random_for_the_reward_model(tmp_path):
    dpo = write_preference_data(tmp_path, seed=0, val_size=200)
    rm = write_preference_data(tmp_path, seed=0, val_size=200, name="rm", random_share=0.5)
    assert set(dpo) == {"dpo_train", "dpo_val"} and set(rm) == {"rm_train", "rm_val"}
    _, val = split_pairs(seed=0, val_size=200)
    for paths in (dpo, rm):
        rows = _pairs(paths["dpo_val" if "dpo_val" in paths else "rm_val"])
        assert [s for s, _, _ in rows] == [a + b for a, b in val]  # the held-out split of the other files
        assert all(c == s and r != s and 0 <= r <= 198 for s, c, r in rows)
    assert all(r - s in WRONG_OFFSETS for s, _, r in _pairs(dpo["dpo_train"]))
    far = [r - s not in WRONG_OFFSETS for s, _, r in _pairs(rm["rm_train"])]
    assert 0.45 < sum(far) / len(far) < 0.55  # half random wrong sums (a random one is a near miss ~3% of the time)
    wrong = [r for s, _, r in _pairs(rm["rm_train"]) if abs(r - s) > 10]
    assert min(wrong) < 10 and max(wrong) > 188  # drawn from the whole range of sums


def test_pair_stages_on_the_task_train_on_their_own_pair_files(tmp_path):
    from rlhf.config import load_config
    from rlhf.driver.warmstart.prepare import prepare_inputs

    for algo in ("dpo", "rm"):
        cfg = load_config(None, [f"algorithm.name={algo}", "model.preset=tiny-qwen2", "model.warm_start_steps=0",
                                 "data.task=arithmetic", f"trainer.output_dir={tmp_path / algo}"])
        prepare_inputs(cfg)
        assert cfg.data.train_file == str(tmp_path / algo / "data" / f"{algo}_train.jsonl")
        assert cfg.data.val_file == str(tmp_path / algo / "data" / f"{algo}_val.jsonl") and cfg.data.val_size == 0
    rm = _pairs(tmp_path / "rm" / "data" / "rm_train.jsonl")
    assert sum(r - s not in WRONG_OFFSETS for s, _, r in rm) > len(rm) / 3  # the reward model's mix
    assert all(r - s in WRONG_OFFSETS for s, _, r in _pairs(tmp_path / "dpo" / "data" / "dpo_train.jsonl"))
