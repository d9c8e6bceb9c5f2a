"""Tool calls, tools and the multi-turn agent loop on the real vLLM engine (a tiny random model, its first
turn forced to a tool call by vLLM's structured outputs)."""

from __future__ import annotations

import threading
import time

import pytest

from workers.agent.calls import CallRunner
from workers.agent.loop import Agent, run_agent
from workers.agent.options import AgentOptions
from workers.agent.toolcalls import CLOSE, ToolCall, parse_tool_calls
from workers.agent.tools import Tool, calculator, load_tools, run_call, tool_schemas

RELEASE = threading.Event()  # set at the end of the module: the hung tools and environments then return


def test_parser_well_formed_and_string_arguments():
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2*3"}, None), ("python", {"code": "print(1)"}, None)]


@pytest.mark.parametrize("body, error", [
    ("{not json", "malformed: not JSON"),
    ("[1, 2]", "malformed: expected a JSON object"),
    ('{"arguments": {}}', "malformed: no tool name"),
    ('{"name": "calculator", "arguments": [1]}', "bad arguments"),
    ('{"name": "x", "arguments": "{oops"}', "bad arguments"),
    ('{"name": "x", "arguments": {"a": "' + "y" * 20000 + '"}}', "malformed: call longer than"),
])
def test_parser_malformed_and_adversarial(body, error):
    calls = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert len(calls) == 1 and calls[0].error and calls[0].error.startswith(error), calls


def test_parser_unclosed_nested_and_many():
    assert parse_tool_calls("<tool_call>{\"name\": \"a\"}")[0].error.startswith("malformed: <tool_call> without")
    assert parse_tool_calls("no calls here") == []
    nested = parse_tool_calls('<tool_call><tool_call>{"name": "a"}</tool_call></tool_call>')
    assert nested[0].error.startswith("malformed")
    many = "".join('<tool_call>{"name": "a"}</tool_call>' for _ in range(100))
    assert len(parse_tool_calls(many, max_calls=8)) == 8


def test_calculator_is_arithmetic_only():
    assert calculator("(2 + 3) * 4 - 10 / 5") == "18"
    assert calculator("7 / 2") == "3.5"
    for bad in ("__import__('os').system('true')", "2 ** 10000", "a + 1", "[1][0]"):
        with pytest.raises(ValueError):
            calculator(bad)


def _slow(x: str) -> str:
    RELEASE.wait(5)
    return x


def _boom(x: str) -> str:
    raise RuntimeError("tool broke")


def _hang(x: str) -> str:
    """A tool that never returns (until the module's tests are done)."""
    RELEASE.wait(120)
    return x


@pytest.fixture(scope="module", autouse=True)
def _release_hung_threads():
    yield
    RELEASE.set()


def test_tool_failures_become_error_texts():
    tools = {**load_tools(["calculator", "python"]), "slow": Tool("slow", _slow), "boom": Tool("boom", _boom)}
    pool = CallRunner(2)
    cases = [
        (ToolCall("nope", {}), "unknown tool"), (ToolCall("calculator", {"expr": "1"}), "bad arguments"),
        (ToolCall("boom", {"x": "1"}), "exception"), (ToolCall("slow", {"x": "1"}), "timeout"),
        (ToolCall(error="malformed: not JSON (x)"), "malformed"),
        (ToolCall("calculator", {"expression": "import os"}), "exception"),
    ]
    for call, kind in cases:
        text, got = run_call(call, tools, pool, timeout_s=0.5)
        assert got == kind and text.startswith("error:"), (call, text, got)
    text, kind = run_call(ToolCall("python", {"code": "import os; print(os.getcwd())"}), tools, pool, 30)
    assert kind is None and text.strip() == "/work"  # model-written code runs in the sandbox
    with pytest.raises(ValueError, match="unknown tool"):
        load_tools(["shell"])


def test_hung_tools_time_out_and_free_their_slots():
    """A tool that never returns costs its call the timeout, not more; five of them (more than the runner's
    four slots) leave the slots free for the next calls, and nothing waits for their threads."""
    tools = {**load_tools(["calculator"]), "hang": Tool("hang", _hang)}
    runner = CallRunner(4)
    t0 = time.monotonic()
    text, kind = run_call(ToolCall("hang", {"x": "1"}), tools, runner, timeout_s=0.2)
    assert kind == "timeout" and "timed out after 0.2 s" in text and time.monotonic() - t0 < 1.5
    for _ in range(4):
        assert run_call(ToolCall("hang", {"x": "1"}), tools, runner, timeout_s=0.1)[1] == "timeout"
    t0 = time.monotonic()
    assert run_call(ToolCall("calculator", {"expression": "6*7"}), tools, runner, 5.0) == ("42", None)
    assert time.monotonic() - t0 < 1.0 and runner.abandoned == 5 and not runner.busy


def word_count(text: str, min_length: int = 1) -> int:
    """Count the words of a text."""
    return sum(len(w) >= min_length for w in text.split())


def scaled(values: list, factor: float | None = None, strict: bool = False, options: dict | None = None) -> str:
    """Scale numbers."""
    return str([v * (factor or 1) for v in values])


def declared(q: str) -> str:
    return q.upper()


declared.tool_schema = {"type": "function", "function": {  # type: ignore[attr-defined]
    "name": "declared", "description": "Shout the query.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": "the query"}},
                   "required": ["q"]}}}


def badly_declared(q: str) -> str:
    return q


badly_declared.tool_schema = {"name": "badly_declared"}  # type: ignore[attr-defined]


def test_module_function_tools_and_their_schemas():
    """`module:function` tools load, run and have schemas typed from their annotations (parameters with a
    default are optional), or the schema the function declares as `tool_schema`."""
    tools = load_tools([f"{__name__}:word_count", f"{__name__}:scaled", f"{__name__}:declared", "calculator"])
    assert list(tools) == ["word_count", "scaled", "declared", "calculator"]
    fn = tools["word_count"].schema()["function"]
    assert fn["description"] == "Count the words of a text."
    assert fn["parameters"] == {"type": "object", "properties": {"text": {"type": "string"},
                                                                  "min_length": {"type": "integer"}},
                                "required": ["text"]}
    props = tools["scaled"].schema()["function"]["parameters"]["properties"]
    assert props == {"values": {"type": "array"}, "factor": {"type": "number"}, "strict": {"type": "boolean"},
                     "options": {"type": "object"}}
    assert tools["declared"].schema() == declared.tool_schema
    runner = CallRunner(2)
    assert run_call(ToolCall("word_count", {"text": "a bb ccc", "min_length": 2}), tools, runner, 5) == ("2", None)
    assert run_call(ToolCall("declared", {"q": "hi"}), tools, runner, 5) == ("HI", None)
    assert run_call(ToolCall("word_count", {"txt": "a"}), tools, runner, 5)[1] == "bad arguments"
    with pytest.raises(ValueError, match="tool_schema needs 'parameters'"):
        load_tools([f"{__name__}:badly_declared"])


def test_rollout_and_sft_render_the_tool_schemas_identically(tiny_model_factory):
    """The prompt the rollout renders shows the tool signatures, and the SFT encoding of a tool-call trace
    (the record's `tools`, or the warm start's) starts with exactly those ids."""
    from transformers import AutoTokenizer

    from rlhf.data.chat import encode_sft_record
    from rlhf.data.tool_tasks import trace_record
    from rlhf.driver.warmstart.hf_sft import _encode_item
    from workers.batch import Batch
    from workers.rollout.prompts import normalise

    tok = AutoTokenizer.from_pretrained(tiny_model_factory("tiny-qwen2"))
    schemas = tool_schemas(load_tools(["calculator", f"{__name__}:word_count"]))
    record = trace_record(123, 456)
    prompt = record["messages"][:1]
    rendered = normalise(Batch(meta={"messages": [prompt]}), tok, schemas)
    assert "calculator(expression: string)" in rendered.text[0]
    assert "word_count(text: string, min_length: integer)" in rendered.text[0]
    assert rendered.text[0].index("calculator(") < rendered.text[0].index("What is 123*456?")
    ids, mask = encode_sft_record(tok, {**record, "tools": schemas}, "x", 512)
    n = len(rendered.ids[0])
    assert ids[:n].tolist() == rendered.ids[0] and not mask[:n].any() and mask[n:].any()
    warm_ids, warm_mask = _encode_item(tok, record["messages"], schemas)
    assert warm_ids == ids.tolist() and warm_mask == mask.tolist()
    # the task's own SFT file carries the calculator's schema, as the rollout of configs/grpo_tiny_tools renders it
    own = normalise(Batch(meta={"messages": [prompt]}), tok, tool_schemas(load_tools(["calculator"])))
    assert encode_sft_record(tok, record, "x", 512)[0][:len(own.ids[0])].tolist() == own.ids[0]


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    from transformers import AutoTokenizer

    from workers.rollout import EngineConfig, RolloutGroup

    model = tiny_model_factory("tiny-qwen2")
    group = RolloutGroup(EngineConfig(model_path=model, kv_cache_gb=0.25), in_process=True)
    yield group, AutoTokenizer.from_pretrained(model)
    group.shutdown()


def test_scripted_two_turn_trajectory_token_in_token_out(engine):
    """Turn 1 is forced to a calculator call; turn 2 is free. What the policy would train on (the Batch from
    build_output) is exactly the engine's sampled ids plus the tool turn's ids, with the mask 0 on the tool
    turn and the engine's log-probs on the model's tokens."""
    from vllm.sampling_params import StructuredOutputsParams

    from workers.batch import Batch
    from workers.rollout.prompts import build_output, normalise
    from workers.rollout.sampling import SamplingConfig

    group, tok = engine
    llm = group.engines[0].llm
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "17*3"}}</tool_call>'
    base = SamplingConfig(n=1, temperature=1.0, max_tokens=200, seed=0, stop=[CLOSE])

    def params(i: int, max_tokens: int):
        sp = base.with_(max_tokens=max_tokens if not turns[i] else min(8, max_tokens), seed=i).to_vllm()
        if not turns[i]:
            sp.structured_outputs = StructuredOutputsParams(choice=[call])
        turns[i] += 1
        return sp

    messages = [[{"role": "user", "content": "What is 17*3?"}]] * 2
    prompts = normalise(Batch(meta={"messages": messages}), tok)
    turns = [0, 0]
    trajs, metrics = run_agent(llm, tok, messages, prompts.ids, params, 200,
                               Agent(AgentOptions(max_turns=2, max_total_tokens=400), load_tools(["calculator"])))
    assert metrics["agent/tool_calls"] == 2 and metrics["agent/tool_errors"] == 0
    for t in trajs:
        assert len(t.sampled_logprobs) == len(t.token_ids) == len(t.mask), (len(t.sampled_logprobs), len(t.token_ids))
        assert t.turns == 2 and t.messages[1]["content"] == call and t.messages[2] == {"role": "tool",
                                                                                      "content": "51"}
        first = t.mask.index(0)
        glue_len = t.mask[first:].index(1) if 1 in t.mask[first:] else len(t.mask) - first
        assert tok.decode(t.token_ids[:first]) == call.replace(CLOSE, "") or \
            tok.decode(t.token_ids[:first]).startswith(call.replace(CLOSE, ""))
        glue = tok.decode(t.token_ids[first:first + glue_len])
        assert "51" in glue and glue.rstrip().endswith("assistant") and "tool" in glue
        # the ids continue the conversation exactly as the chat template renders it
        rendered = tok.apply_chat_template(t.messages[:3], tokenize=False, add_generation_prompt=True)
        assert tok.decode(prompts.ids[0] + t.token_ids[:first + glue_len]) == rendered
        # log-probs of the freely sampled turn are the engine's (recomputed here by prompt log-probs); the
        # forced turn carries what vLLM reports under structured outputs (not the model's), the tool turn 0
        ref = group.score_all([prompts.ids[0] + t.token_ids])[0][0][len(prompts.ids[0]) - 1:]
        for j, m in enumerate(t.mask):
            if m and j >= first + glue_len:
                assert t.sampled_logprobs[j] == pytest.approx(ref[j], abs=1e-4)
            elif not m:
                assert t.sampled_logprobs[j] == 0.0
    batch = build_output(prompts, [[t] for t in trajs], 1, group.engines[0].pad_id)
    for row, t in enumerate(trajs):
        n = len(t.token_ids)
        assert batch["responses"][row, :n].tolist() == t.token_ids
        assert batch["response_mask"][row, :n].tolist() == t.mask
        assert batch["rollout_logprobs"][row, :n].tolist() == pytest.approx(t.sampled_logprobs)


def test_generate_agent_on_the_engine(engine):
    group, _ = engine
    from workers.batch import Batch

    out = group.engines[0].generate_agent(Batch(meta={"messages": [[{"role": "user", "content": "hi"}]] * 2}),
                                          {"n": 2, "max_tokens": 8, "temperature": 1.0},
                                          {"tools": ["calculator"], "max_turns": 2, "max_total_tokens": 32})
    assert out["responses"].shape[0] == 4 and out["response_mask"].sum() > 0
    assert {"agent/turns_mean", "agent/tool_calls", "agent/truncated"} <= set(out.info)


class _Flaky:
    """An environment that answers once, then fails."""

    def reset(self, messages, ground_truth):
        self.calls = 0

    def step(self, action):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("environment broke")
        return "try again", 0.5, False


def test_environment_turns_are_masked_and_rewarded(engine):
    from workers.agent.env import GuessNumber
    from workers.batch import Batch
    from workers.rollout.prompts import normalise
    from workers.rollout.sampling import SamplingConfig

    group, tok = engine
    llm = group.engines[0].llm
    messages = [[{"role": "user", "content": "Guess my number."}]] * 3
    prompts = normalise(Batch(meta={"messages": messages}), tok)
    base = SamplingConfig(n=1, temperature=1.0, max_tokens=6, seed=0, stop=[CLOSE])

    def params(i, max_tokens):
        return base.with_(max_tokens=max_tokens, seed=i).to_vllm()

    cfg = Agent(AgentOptions(max_turns=3, max_total_tokens=200), {}, env=GuessNumber)
    trajs, metrics = run_agent(llm, tok, messages, prompts.ids, params, 6, cfg, ["1234567"] * 3)
    for t in trajs:  # the random model never guesses 1234567: three turns, two observations in between
        assert t.turns == 3 and t.rewards == [0.0, 0.0, 0.0] and t.done
        observations = [m for m in t.messages if m["role"] == "user"][1:]
        assert len(observations) == 2 and all(m["content"] in ("higher", "lower", "Answer with a number.")
                                              for m in observations)
        assert t.mask.count(0) > 0 and tok.decode([x for x, m in zip(t.token_ids, t.mask) if not m]).count("user") == 2
    assert metrics["agent/env_reward_mean"] == 0.0 and metrics["agent/env_errors"] == 0
    trajs, metrics = run_agent(llm, tok, messages, prompts.ids, params, 6,
                               Agent(AgentOptions(max_turns=3, max_total_tokens=200, env_reward="last"), {}, env=_Flaky))
    assert metrics["agent/env_errors"] == 3 and all(t.rewards == [0.5] and t.turns == 2 for t in trajs)


def _forced(tok, plan: dict[int, list[str]], max_tokens: int = 8):
    """A `params` function for run_agent: trajectory i's turn k is forced to the text plan[i][k] (structured
    outputs: the model then samples its end-of-turn token), later turns are free; records when each turn was
    queued on the engine."""
    from vllm.sampling_params import StructuredOutputsParams

    from workers.rollout.sampling import SamplingConfig

    base = SamplingConfig(n=1, temperature=1.0, max_tokens=200, seed=0, stop=[CLOSE])
    queued: dict[tuple[int, int], float] = {}

    def params(i: int, left: int):
        turn = sum(1 for key in queued if key[0] == i)
        queued[(i, turn)] = time.monotonic()
        forced = plan.get(i, [])
        sp = base.with_(max_tokens=left if turn < len(forced) else min(max_tokens, left), seed=i).to_vllm()
        if turn < len(forced):
            sp.structured_outputs = StructuredOutputsParams(choice=[forced[turn]])
        return sp

    return params, queued


PROGRESSED = threading.Event()  # set when trajectory 2 of the no-stall test queues its third turn


def _slow_tool(x: str) -> str:
    """Returns once another trajectory has made two turns of progress: only if the engine kept stepping it."""
    return "slow " + x if PROGRESSED.wait(60) else "stalled"


def _call(name: str, **args) -> str:
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


def test_a_slow_tool_does_not_stall_the_other_trajectories(engine):
    """Trajectory 0's tool returns only after trajectory 1 has generated two more turns (two calculator calls,
    then a third turn): it can only return its result if the engine keeps stepping 1 while 0's tool runs."""
    from workers.batch import Batch
    from workers.rollout.prompts import normalise

    group, tok = engine
    tools = {**load_tools(["calculator"]), "slow": Tool("slow", _slow_tool)}
    plan = {0: [_call("slow", x="b")],
            1: [_call("calculator", expression="2*3"), _call("calculator", expression="4*5")]}
    params, queued = _forced(tok, plan)

    def watched(i: int, left: int):
        sp = params(i, left)
        if (1, 2) in queued:
            PROGRESSED.set()
        return sp

    messages = [[{"role": "user", "content": "Go."}]] * 2
    prompts = normalise(Batch(meta={"messages": messages}), tok, tool_schemas(tools))
    PROGRESSED.clear()
    trajs, metrics = run_agent(group.engines[0].llm, tok, messages, prompts.ids, watched, 200,
                               Agent(AgentOptions(max_turns=3, max_total_tokens=400, tool_timeout_s=90), tools))
    assert trajs[0].messages[2] == {"role": "tool", "content": "slow b"}
    assert [m["content"] for m in trajs[1].messages if m["role"] == "tool"] == ["6", "20"]
    assert metrics["agent/tool_calls"] == 3 and metrics["agent/tool_errors"] == 0


class _Hangs:
    """Its reset or its step never returns when the ground truth says so; otherwise one step, reward 1."""

    def reset(self, messages, ground_truth):
        self.mode = ground_truth
        if ground_truth == "reset":
            RELEASE.wait(120)

    def step(self, action):
        if self.mode == "step":
            RELEASE.wait(120)
        return None, 1.0, True


def test_a_hung_tool_or_environment_ends_in_a_timeout_not_a_hung_rollout(engine):
    """Trajectory 0's environment never finishes its reset, 1's never finishes a step, 3 calls a tool that
    never returns: each costs its trajectory one tool_timeout_s (0 and 1 end, 3 reads a timeout error and
    goes on), 2 is unaffected, and the rollout returns without waiting for the hung threads."""
    from workers.batch import Batch
    from workers.rollout.prompts import normalise

    group, tok = engine
    params, _ = _forced(tok, {3: [_call("hang", x="a")]})
    messages = [[{"role": "user", "content": "Play."}]] * 4
    tools = {"hang": Tool("hang", _hang)}
    prompts = normalise(Batch(meta={"messages": messages}), tok, tool_schemas(tools))
    t0 = time.monotonic()
    cfg = Agent(AgentOptions(max_turns=3, max_total_tokens=200, tool_timeout_s=0.5), tools, env=_Hangs)
    trajs, metrics = run_agent(group.engines[0].llm, tok, messages, prompts.ids, params, 200, cfg,
                               ["reset", "step", "ok", "tool"])
    assert time.monotonic() - t0 < 3 * 0.5 + 60  # generous for a loaded machine; a hang would be 120 s
    assert [t.turns for t in trajs] == [0, 1, 1, 2] and all(t.done for t in trajs)
    assert [t.rewards for t in trajs] == [[], [], [1.0], [1.0]] and trajs[0].token_ids == []
    assert trajs[3].messages[2] == {"role": "tool", "content": "error: hang timed out after 0.5 s"}
    assert metrics["agent/env_timeouts"] == 2 and metrics["agent/env_errors"] == 2
    assert metrics["agent/tool_errors/timeout"] == 1 and metrics["agent/abandoned_calls"] == 3


def test_a_turn_ending_on_eos_keeps_one_end_of_turn(engine):
    """A turn without a tool call ends on the end-of-turn token the model samples (vLLM keeps it in the turn's
    ids); the environment's observation follows it without a second one, so the ids are the conversation as
    the chat template renders it."""
    from workers.agent.env import GuessNumber
    from workers.batch import Batch
    from workers.rollout.prompts import normalise

    group, tok = engine
    params, _ = _forced(tok, {0: ["5", "7"]})
    messages = [[{"role": "user", "content": "Guess my number."}]]
    prompts = normalise(Batch(meta={"messages": messages}), tok)
    cfg = Agent(AgentOptions(max_turns=3, max_total_tokens=64), {}, env=GuessNumber)
    trajs, metrics = run_agent(group.engines[0].llm, tok, messages, prompts.ids, params, 8, cfg, ["7"])
    t = trajs[0]
    assert [m["content"] for m in t.messages[1:]] == ["5", "higher", "7"] and t.rewards == [0.0, 1.0]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert t.token_ids.count(eos) == 3 and t.token_ids[-1] == eos  # each model turn's own, the observation's
    assert tok.decode(prompts.ids[0] + t.token_ids) == tok.apply_chat_template(t.messages, tokenize=False).rstrip("\n")
    assert [x for x, m in zip(t.token_ids, t.mask) if m].count(eos) == 2  # the model's end-of-turn tokens train


def test_agent_metrics_merge_across_engines():
    """Counts add up; per-trajectory means are weighted by each engine's trajectories (3 and 1 here), so
    the merged mean is the mean over all 4; a kind one engine never saw counts 0 there."""
    from workers.rollout.group import _merge_info

    a = {"agent/turns_mean": 2.0, "agent/tool_calls": 6.0, "agent/tool_calls_per_trajectory": 2.0,
         "agent/tool_errors": 1.0, "agent/tool_errors/timeout": 1.0, "agent/tool_time_s": 0.5,
         "agent/truncated": 1 / 3, "rollout/response_tokens": 30, "rollout/generate_s": 1.0}
    b = {"agent/turns_mean": 1.0, "agent/tool_calls": 0.0, "agent/tool_calls_per_trajectory": 0.0,
         "agent/tool_errors": 2.0, "agent/tool_errors/malformed": 2.0, "agent/tool_time_s": 0.25,
         "agent/truncated": 0.0, "rollout/response_tokens": 10, "rollout/generate_s": 2.0}
    m = _merge_info([a, b], [3, 1])
    assert m["agent/turns_mean"] == pytest.approx((2.0 * 3 + 1.0) / 4)
    assert m["agent/tool_calls_per_trajectory"] == pytest.approx(6.0 / 4) == pytest.approx(m["agent/tool_calls"] / 4)
    assert m["agent/truncated"] == pytest.approx(1 / 4)
    assert (m["agent/tool_calls"], m["agent/tool_errors"], m["agent/tool_time_s"]) == (6.0, 3.0, 0.75)
    assert (m["agent/tool_errors/timeout"], m["agent/tool_errors/malformed"]) == (1.0, 2.0)
    assert (m["rollout/response_tokens"], m["rollout/generate_s"]) == (40, 2.0)
    assert not any(k.startswith("agent/") for k in _merge_info([{"rollout/generate_s": 1.0}] * 2, [2, 2]))


def test_the_sandbox_isolation_level_is_reported_at_startup(monkeypatch, caplog, capsys):
    """A run that executes untrusted code prints the sandbox's isolation level (the probe logs it too), and a
    warning when the kernel leaves it resource limits only; a run without such code probes nothing."""
    import logging

    import workers.sandbox
    from rlhf.config import load_config
    from rlhf.driver.rl.runner import report_sandbox
    from workers.sandbox import namespaces_available

    base = ["model.preset=tiny-qwen2"]
    assert report_sandbox(load_config(None, base)) is None
    namespaces_available.cache_clear()
    with caplog.at_level(logging.INFO, logger="workers.sandbox.sandbox"):
        line = report_sandbox(load_config(None, [*base, "rollout.tools=[python]"]))
    assert line and line.startswith("sandbox: namespaces") and line in capsys.readouterr().out
    assert "sandbox isolation: namespaces" in caplog.text
    monkeypatch.setattr(workers.sandbox, "namespaces_available", lambda: False)
    line = report_sandbox(load_config(None, [*base, "reward.fn=rlhf.eval.code:unit_test_pass_rate"]))
    assert line and line.startswith("WARNING sandbox: resource limits only") and "WITHOUT network" in line
