"""The tool and code example tasks: held-out prompts never in a train file, the traces' calls are what the
agent loop parses and the calculator answers, the reference code passes its hidden tests in the sandbox."""

from __future__ import annotations

import json

from rlhf.data.code_tasks import write_code_data
from rlhf.data.tool_tasks import TOOL_SHARE, write_multiply_tool_data
from workers.agent.toolcalls import parse_tool_calls
from workers.agent.tools import calculator


def _read(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_multiply_tool_files(tmp_path):
    files = write_multiply_tool_data(tmp_path, seed=1, val_size=50, sft_size=30)
    train, val, sft = _read(files["rl_train"]), _read(files["rl_val"]), _read(files["sft_train"])
    assert len(val) == 50 and len(sft) == 30 and len(train) == 20_000
    assert not {r["prompt"] for r in val} & ({r["prompt"] for r in train} | {t["messages"][0]["content"] for t in sft})
    calls = [rec for rec in sft if len(rec["messages"]) == 4]
    assert len(calls) == round(len(sft) * TOOL_SHARE)  # the rest answer directly: what GRPO is to unlearn
    for rec in sft:
        user, answer = rec["messages"][0], rec["messages"][-1]
        a, b = map(int, user["content"].removeprefix("What is ").removesuffix("?").split("*"))
        assert answer["content"] == str(a * b) and min(a, b) >= 100 and max(a, b) <= 999
        assert [m["role"] for m in rec["messages"]] in (["user", "assistant"], ["user", "assistant", "tool", "assistant"])
    for rec in calls:
        _, call, tool, answer = rec["messages"]
        (parsed,) = parse_tool_calls(call["content"])
        assert parsed.name == "calculator" and calculator(**parsed.arguments) == tool["content"] == answer["content"]


def test_code_task_reference_passes_hidden_tests(tmp_path):
    from rlhf.eval.code import unit_test_pass_rate

    files = write_code_data(tmp_path, val_size=20, sft_size=10)
    val, sft = _read(files["rl_val"]), _read(files["sft_val"])
    assert not {r["prompt"] for r in val} & {r["prompt"] for r in _read(files["rl_train"])}
    rec, ref = val[0], sft[0]["messages"][1]["content"]
    assert sft[0]["messages"][0]["content"] == rec["prompt"]
    assert unit_test_pass_rate(rec["prompt"], f"```python\n{ref}\n```", rec["answer"]) == 1.0
    assert unit_test_pass_rate(rec["prompt"], "def f(x):\n    return x", rec["answer"]) < 1.0
