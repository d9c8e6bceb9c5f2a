"""RL prompt loading (jsonl, parquet, field mapping, split, errors) and the resumable PromptLoader."""

from __future__ import annotations

import pytest

from rlhf.data.prompts import PromptLoader, load_prompt_dataset
from rlhf.errors import UserError
from tests.helpers.files import write_lines


def _records(n: int) -> list[dict]:
    return [
        {"question": f"q{i}", "chat": [{"role": "user", "content": f"q{i}"}], "answer": i} for i in range(n)
    ]


def test_jsonl_mapping_split_and_seed(tmp_path):
    f = write_lines(tmp_path / "p.jsonl", _records(50))
    train, val = load_prompt_dataset(f, val_size=10, prompt_key="question", seed=3)
    assert len(train) == 40 and len(val) == 10
    assert {r["ground_truth"] for r in train + val} == {str(i) for i in range(50)}
    assert all(r["prompt"] == f"q{r['ground_truth']}" and r["messages"] is None for r in train)
    again, _ = load_prompt_dataset(f, val_size=10, prompt_key="question", seed=3)
    other, _ = load_prompt_dataset(f, val_size=10, prompt_key="question", seed=4)
    assert again == train and other != train
    chat, none = load_prompt_dataset(f, messages_key="chat")
    assert none == [] and chat[0]["prompt"] is None and chat[0]["messages"][0]["role"] == "user"
    _, frac = load_prompt_dataset(f, val_size=0.2, prompt_key="question")
    assert len(frac) == 10
    v = write_lines(tmp_path / "v.jsonl", _records(5))
    train, val = load_prompt_dataset(f, val_file=v, prompt_key="question")
    assert len(train) == 50 and len(val) == 5


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": ["1", "2", "3"]}), path)
    train, val = load_prompt_dataset(path, val_size=1)
    assert len(train) == 2 and len(val) == 1 and {r["prompt"] for r in train + val} == {"a", "b", "c"}
    pq.write_table(pa.table({"prompt": ["a", None], "answer": ["1", "2"]}), path)
    with pytest.raises(UserError, match=r"key 'prompt' missing in 1 row\(s\), first at row 2"):
        load_prompt_dataset(path)


def test_bad_prompt_files(tmp_path):
    with pytest.raises(UserError, match="prompt file .* does not exist"):
        load_prompt_dataset(tmp_path / "none.jsonl")
    f = write_lines(tmp_path / "bad.jsonl", [{"prompt": "a", "answer": "1"}, "{oops"])
    with pytest.raises(UserError, match=rf"{f}:2: not valid JSON"):
        load_prompt_dataset(f)
    f = write_lines(
        tmp_path / "miss.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}, {"prompt": "c"}]
    )
    with pytest.raises(UserError, match=r"key 'answer' missing in 2 line\(s\), first at line 2"):
        load_prompt_dataset(f)
    f = write_lines(tmp_path / "ok.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    with pytest.raises(UserError, match="key 'messages' missing"):
        load_prompt_dataset(f, messages_key="messages")
    with pytest.raises(UserError, match="leaves no train prompts"):
        load_prompt_dataset(f, val_size=2)
    with pytest.raises(UserError, match="either val_file or val_size"):
        load_prompt_dataset(f, val_file=f, val_size=1)
    with pytest.raises(UserError, match="unsupported prompt file type"):
        load_prompt_dataset(write_lines(tmp_path / "p.csv", ["a,b"]))


def test_prompt_loader_epochs_and_resume():
    prompts = [{"prompt": str(i), "messages": None, "ground_truth": str(i)} for i in range(10)]
    loader = PromptLoader(prompts, batch_size=3, seed=7)
    epoch0 = [loader.next_batch() for _ in range(3)]
    assert all(len(b) == 3 for b in epoch0) and len({p["prompt"] for b in epoch0 for p in b}) == 9
    assert loader.epoch == 0 and loader.batches_per_epoch == 3
    nxt = loader.next_batch()
    assert loader.epoch == 1 and nxt != epoch0[0]
    state = loader.state_dict()
    expected = [loader.next_batch() for _ in range(5)]
    resumed = PromptLoader(prompts, batch_size=3, seed=7)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(5)] == expected
    with pytest.raises(UserError, match="saved for 10 prompts"):
        PromptLoader(prompts[:5], batch_size=3, seed=7).load_state_dict(state)
    with pytest.raises(UserError, match="larger than"):
        PromptLoader(prompts, batch_size=11)
