"""`rlhf eval`: metrics against their definitions, HumanEval in the sandbox, option log-likelihoods against
transformers, reasoning-gym's own scorer, the command end to end and its input errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from rlhf.errors import UserError
from rlhf.eval.run import EvalOptions, _code, option_logprobs
from rlhf.eval.scoring import last_number, pass_at_k
from rlhf.eval.tasks import Item, load_task


@pytest.mark.parametrize("n,c,k", [(10, 0, 1), (10, 3, 1), (10, 3, 5), (20, 19, 2), (5, 5, 5), (7, 2, 7)])
def test_pass_at_k_equals_the_closed_form(n, c, k):
    closed = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)


def test_answer_extraction():
    assert last_number("so 3 + 4 = 7.\n#### 1,234") == "1234"
    assert last_number("no digits") is None


def test_humaneval_canonical_solutions_pass_in_the_sandbox_and_wrong_ones_fail():
    task = load_task("humaneval")
    assert len(task.items) == 164
    canonical = [[it.meta["canonical_solution"]] for it in task.items]
    metrics, samples = _code(task, canonical, EvalOptions(sandbox_workers=2))
    failed = [s["task_id"] for s in samples if not all(s["passed"])]
    assert failed == [] and metrics["pass@1"]["value"] == 1.0, failed
    wrong = [["    return None\n"] for _ in task.items[:8]]
    task.items = task.items[:8]
    metrics, samples = _code(task, wrong, EvalOptions(sandbox_workers=2))
    assert metrics["pass@1"]["value"] == 0.0


def test_reasoning_gym_scores_are_its_own():
    import reasoning_gym

    task = load_task("rg:basic_arithmetic", limit=5, seed=3)
    data = reasoning_gym.create_dataset("basic_arithmetic", size=5, seed=3)
    for item, entry in zip(task.items, data):
        assert item.gold == entry["answer"]
        for response in (f"<answer>{entry['answer']}</answer>", entry["answer"], "<answer>0.5</answer>", "x"):
            expect = data.score_answer(answer=reasoning_gym.utils.extract_answer(response) or response.strip(),
                                       entry=entry)
            assert task.score(item, response) == expect
        assert task.score(item, f"<answer>{entry['answer']}</answer>") == 1.0


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    from workers.rollout import EngineConfig, RolloutGroup

    model = tiny_model_factory("tiny-qwen2")
    group = RolloutGroup(EngineConfig(model_path=model, kv_cache_gb=0.25), in_process=True)
    yield model, group
    group.shutdown()


def test_option_loglikelihoods_equal_transformers(engine, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, group = engine
    (tmp_path / "algebra_test.csv").write_text("What is 2+2?,3,4,5,22,B\nPick the vowel,b,c,e,d,C\n")
    task = load_task(f"mc:{tmp_path / 'algebra_test.csv'}")
    tok = AutoTokenizer.from_pretrained(model_dir)
    # letters (single tokens: the next-token path) and whole answers (several tokens: the prompt log-probs)
    # letters (short: token by token from the prefix cache) and long answers (whole, by prompt log-probs)
    task.items.append(Item("Q: the capital of France?\nA:", 0, choices=[" Paris, of course it is", " Lyon or so"]))
    assert len(tok.encode(task.items[-1].choices[0], add_special_tokens=False)) > 4
    ours = option_logprobs(group, tok, task.items)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for item, lps in zip(task.items, ours):
        ctx = tok.encode(item.prompt)
        for choice, lp in zip(item.choices, lps):
            cont = tok.encode(choice, add_special_tokens=False)
            with torch.no_grad():
                logits = hf(torch.tensor([ctx + cont])).logits[0].log_softmax(-1)
            ref = sum(float(logits[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))
            assert lp == pytest.approx(ref, abs=1e-4)


def test_eval_command_end_to_end_and_compare(tiny_model_factory, tmp_path):
    model = tiny_model_factory("tiny-qwen2")
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)}) + "\n"
                                              for i in range(4)))
    (tmp_path / "b_test.csv").write_text("q1,a,b,c,d,A\nq2,a,b,c,d,D\n")
    out = tmp_path / "run1" / "results.json"
    cmd = [sys.executable, "-m", "rlhf", "eval", "--model", model, "--limit", "3", "--max-tokens", "8", "--n", "2",
           "--temperature", "1.0", "--tasks", f"humaneval,prompts:{tmp_path / 'q.jsonl'},mc:{tmp_path / 'b_test.csv'}",
           "--output", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["tasks"]
    assert set(res) == {"humaneval", f"prompts:{tmp_path / 'q.jsonl'}", f"mc:{tmp_path / 'b_test.csv'}"}
    for v in res.values():
        assert {"metric", "value", "stderr", "n", "config"} <= set(v) and 0.0 <= v["value"] <= 1.0
    assert res["humaneval"]["n"] == 3 and len(res["humaneval"]["samples"][0]["responses"]) == 2
    assert "| humaneval | pass@1 |" in r.stdout
    r = subprocess.run([sys.executable, "-m", "rlhf", "eval", "--compare", str(out.parent), str(out),
                        "--output", str(tmp_path / "cmp.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and (tmp_path / "eval_compare.png").is_file(), r.stderr[-2000:]
    assert r.stdout.count("| humaneval |") == 1


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(UserError, match="unknown task 'nope'; known: humaneval"):
        load_task("nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answer": "A"}) + "\n" +
                   json.dumps({"question": "q", "answer": "A"}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl:2: missing field 'choices'"):
        load_task(f"mc:{bad}")
    with pytest.raises(UserError, match="not found"):
        load_task(f"gsm8k:{tmp_path / 'missing.jsonl'}")
    r = subprocess.run([sys.executable, "-m", "rlhf", "eval", "--model", str(tmp_path), "--tasks", "humaneval"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "not a converted megatron checkpoint" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]


def test_item_kinds_from_files(tmp_path):
    (tmp_path / "g.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    task = load_task(f"gsm8k:{tmp_path / 'g.jsonl'}")
    assert task.score(task.items[0], "The answer is 2.") == 1.0 and task.score(task.items[0], "3") == 0.0
    (tmp_path / "m.jsonl").write_text(json.dumps({"problem": "half?", "solution": "$\\boxed{\\frac{1}{2}}$"}) + "\n")
    task = load_task(f"math:{tmp_path / 'm.jsonl'}")
    assert task.score(task.items[0], "so it is $\\boxed{0.5}$") == 1.0
    assert task.score(task.items[0], "$\\boxed{3}$") == 0.0
    assert isinstance(Item("p", 1).choices, list)


def test_unit_test_reward_runs_hidden_tests_in_the_sandbox():
    from rlhf.eval.code import unit_test_pass_rate

    tests = ["assert square(2) == 4", "assert square(-3) == 9", "assert square(0) == 0"]
    good = "Here:\n```python\ndef square(x):\n    return x * x\n```"
    half = "```python\ndef square(x):\n    return abs(x) * 2 if x else 0\n```"
    cheat = "```python\nimport os\nos._exit(0)\n```"
    escape = "```python\nimport sys\nsys.stdout.write('ok\\n')\ndef square(x):\n    while True: pass\n```"
    assert unit_test_pass_rate(None, good, tests) == 1.0
    assert unit_test_pass_rate(None, half, json.dumps(tests)) == pytest.approx(2 / 3)
    assert unit_test_pass_rate(None, cheat, tests) == 0.0  # exiting before the tests is not passing them
    assert unit_test_pass_rate(None, escape, {"tests": tests[:1]}) == 0.0
