"""The multi-turn agent loop on a vLLM engine, token in, token out.

A trajectory generates until a tool call (`</tool_call>`), the end of its turn or its token budget; the
calls run on threads (each with a timeout, never waited for past it: workers/agent/calls.py) while the engine
keeps stepping the other trajectories, and their results are appended as `tool` messages, tokenised once as the chat template's glue between turns; then generation continues from the
exact token ids so far, never re-tokenised from text. The response mask is 1 on the model's own tokens only,
and the sampled-token log-probs are kept for those.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.agent.calls import Call, CallRunner
from workers.agent.env import AGGREGATIONS, Environment
from workers.agent.options import AgentOptions
from workers.agent.toolcalls import CLOSE, ToolCall, parse_tool_calls
from workers.agent.tools import Tool, finish_call, start_call, tool_schemas
from workers.rollout.prompts import sampled_logprobs


@dataclass
class Agent:
    """What the loop runs with: the settings, the loaded tools and the environment class (made once per
    trajectory)."""

    options: AgentOptions
    tools: dict[str, Tool]
    env: Callable[[], Environment] | None = None
    tool_workers: int = 4


@dataclass
class Trajectory:
    """One sample: what `build_output` needs (token_ids, sampled_logprobs, mask, text, finish_reason)."""

    messages: list[dict[str, str]]
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    sampled_logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    turns: int = 0
    done: bool = False
    env: Any = None
    rewards: list[float] = field(default_factory=list)  # the environment's, one per step


ParamsFn = Callable[[int, int], Any]  # (trajectory index, max new tokens) -> vLLM SamplingParams stopping at CLOSE


class _Run:
    """The state of one `run_agent` call: trajectories, their tool futures and the counters."""

    def __init__(self, llm: Any, tokenizer: Any, params: ParamsFn, max_tokens_per_turn: int, cfg: Agent,
                 trajs: list[Trajectory], lora_request: Any = None) -> None:
        self.engine, self.tokenizer, self.params, self.per_turn, self.cfg = (
            llm.llm_engine, tokenizer, params, max_tokens_per_turn, cfg)
        self.lora_request = lora_request
        self.trajs = trajs
        self.tag = uuid.uuid4().hex[:8]
        self.errors: Counter[str] = Counter()
        self.calls, self.tool_s = 0, 0.0
        self.schemas = tool_schemas(cfg.tools)  # rendered into the prompt, so into every re-render too

    def submit(self, i: int) -> None:
        """Queue trajectory i's next model turn on the engine."""
        from vllm.sampling_params import RequestOutputKind

        t = self.trajs[i]
        left = self.cfg.options.max_total_tokens - len(t.token_ids)
        sp = self.params(i, max(1, min(self.per_turn, left)))
        sp.output_kind = RequestOutputKind.FINAL_ONLY
        self.engine.add_request(f"agent-{self.tag}-{i}-{t.turns}", {"prompt_token_ids": t.prompt_ids + t.token_ids},
                                sp, lora_request=self.lora_request)

    def finished_turn(self, i: int, c: Any) -> list:
        """Record a finished model turn; return its tool calls (empty: the trajectory is done)."""
        t = self.trajs[i]
        t.turns += 1
        toks = list(c.token_ids)
        t.token_ids += toks
        t.mask += [1] * len(toks)
        t.sampled_logprobs += sampled_logprobs(c.logprobs, toks)
        # vLLM cuts the stop string from the text (not from the tokens): put the tag back
        text = c.text + CLOSE if c.stop_reason == CLOSE and not c.text.endswith(CLOSE) else c.text
        t.text = text  # the reward scores the last model turn
        t.messages.append({"role": "assistant", "content": text})
        t.finish_reason = c.finish_reason or "length"
        found = parse_tool_calls(text) if c.stop_reason == CLOSE else []
        out_of_room = len(t.token_ids) >= self.cfg.options.max_total_tokens or t.turns >= self.cfg.options.max_turns
        if found and out_of_room:  # a call pending with no turn left to read its result
            t.done, t.finish_reason = True, "length"
        elif not found and t.env is None:
            t.done = True
        return found

    def reset_env(self, i: int, ground_truth: Any) -> None:
        """Make and reset trajectory i's environment (on a thread, under the tool timeout)."""
        assert self.cfg.env is not None
        env = self.cfg.env()
        env.reset([dict(m) for m in self.trajs[i].messages], ground_truth)
        self.trajs[i].env = env

    def env_started(self, i: int, call: Call) -> bool:
        """After the reset: True to generate the first turn; a failed or hung reset ends the trajectory empty."""
        try:
            call.result()
        except TimeoutError:
            self.errors["env_timeout"] += 1
        except Exception:  # noqa: BLE001 - a failing environment ends its trajectory, not the run
            self.errors["env_error"] += 1
        else:
            return True
        self.trajs[i].done = True
        return False

    def step_env(self, i: int) -> tuple[str | None, float, bool]:
        """The environment's answer to trajectory i's last turn (run on a thread, under the tool timeout)."""
        t = self.trajs[i]
        return t.env.step(t.text)

    def env_results(self, i: int, call: Call) -> bool:
        """Record the environment's step; append its observation as a user turn. False: the trajectory ends."""
        t = self.trajs[i]
        try:
            obs, reward, done = call.result()
            t.rewards.append(float(reward))
        except TimeoutError:  # a hung step: the trajectory ends with the rewards so far
            self.errors["env_timeout"] += 1
            t.done = True
            return False
        except Exception:  # noqa: BLE001 - a failing environment ends its trajectory, not the run
            self.errors["env_error"] += 1
            t.done = True
            return False
        if done or obs is None or t.turns >= self.cfg.options.max_turns:
            t.done = True
            return False
        return self.append_turn(i, [{"role": "user", "content": str(obs)}])

    def tool_results(self, i: int, found: list, res: list[tuple[str, str | None]]) -> bool:
        """Append the tool turn; False when no room is left for the model to answer."""
        self.calls += len(found)
        self.errors.update(kind for _, kind in res if kind)
        return self.append_turn(i, [{"role": "tool", "content": text} for text, _ in res])

    def append_turn(self, i: int, new: list[dict[str, str]]) -> bool:
        """Append messages that are context, not the model's (masked); False when no room is left for the
        model to answer after them."""
        t = self.trajs[i]
        glue = _turn_ids(self.tokenizer, t.messages, new, self.schemas, t.token_ids[-1] if t.token_ids else None)
        if len(glue) >= self.cfg.options.max_total_tokens - len(t.token_ids):
            t.done, t.finish_reason = True, "length"
            return False
        t.token_ids += glue
        t.mask += [0] * len(glue)
        t.sampled_logprobs += [0.0] * len(glue)
        t.messages += new
        return True


@dataclass
class _Job:
    """What trajectory i waits for: its tool calls (each started, or an error found before running), or its
    environment's reset or step."""

    kind: str  # "tools" | "reset" | "step"
    running: list[Call | tuple[str, str | None]]
    found: list[ToolCall] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    @property
    def resolved(self) -> bool:
        return all(not isinstance(r, Call) or r.resolved for r in self.running)


def run_agent(llm: Any, tokenizer: Any, messages: list[list[dict[str, str]]], prompt_ids: list[list[int]],
              params: ParamsFn, max_tokens_per_turn: int, cfg: Agent,
              ground_truths: list[Any] | None = None, lora_request: Any = None
              ) -> tuple[list[Trajectory], dict[str, float]]:
    """Run one trajectory per (messages, prompt_ids), each at its own pace: the engine steps while tools and
    environment steps run on threads (`CallRunner`), and a trajectory's next turn joins the engine's batch
    as soon as its results are in. A call past `tool_timeout_s` is answered as timed out and never waited
    for again, so this returns even when a tool or an environment hangs. Returns the trajectories and
    `agent/*` metrics. `lora_request`: the vLLM LoRA adapter every turn runs with."""
    trajs = [Trajectory([dict(m) for m in msgs], list(ids)) for msgs, ids in zip(messages, prompt_ids)]
    run = _Run(llm, tokenizer, params, max_tokens_per_turn, cfg, trajs, lora_request)
    runner = CallRunner(cfg.tool_workers)
    timeout = cfg.options.tool_timeout_s
    jobs: dict[int, _Job] = {}
    if cfg.env is not None:
        for i, gt in enumerate(ground_truths or [None] * len(trajs)):
            jobs[i] = _Job("reset", [runner.submit(run.reset_env, i, gt, timeout_s=timeout, name="environment reset")])
    else:
        for i in range(len(trajs)):
            run.submit(i)
    while run.engine.has_unfinished_requests() or jobs:
        if run.engine.has_unfinished_requests():
            for out in run.engine.step():
                if not out.finished:
                    continue
                i = int(out.request_id.split("-")[2])
                found = run.finished_turn(i, out.outputs[0])
                if found and not trajs[i].done:
                    jobs[i] = _Job("tools", [start_call(c, cfg.tools, runner, timeout) for c in found], found)
                elif not trajs[i].done:  # no tool call: the environment answers
                    jobs[i] = _Job("step", [runner.submit(run.step_env, i, timeout_s=timeout, name="environment step")])
            runner.poll()
        elif not any(job.resolved for job in jobs.values()):
            runner.wait(timeout)
        for i in [i for i, job in jobs.items() if job.resolved]:
            job = jobs.pop(i)
            run.tool_s += time.perf_counter() - job.t0
            first = job.running[0]
            if job.kind == "tools":
                more = run.tool_results(i, job.found, [finish_call(c, r) for c, r in zip(job.found, job.running)])
            else:
                assert isinstance(first, Call)
                more = run.env_started(i, first) if job.kind == "reset" else run.env_results(i, first)
            if more:
                run.submit(i)
    n = max(len(trajs), 1)
    metrics = {"agent/turns_mean": sum(t.turns for t in trajs) / n, "agent/tool_calls": float(run.calls),
               "agent/tool_calls_per_trajectory": run.calls / n,
               "agent/tool_errors": float(sum(v for k, v in run.errors.items() if not k.startswith("env_"))),
               "agent/tool_time_s": run.tool_s,
               "agent/truncated": sum(t.finish_reason == "length" for t in trajs) / n}
    metrics.update({f"agent/tool_errors/{k.replace(' ', '_')}": float(v) for k, v in run.errors.items()
                    if not k.startswith("env_")})
    if runner.abandoned:
        metrics["agent/abandoned_calls"] = float(runner.abandoned)
    if cfg.env is not None:
        metrics["agent/env_errors"] = float(run.errors["env_error"] + run.errors["env_timeout"])
        metrics["agent/env_timeouts"] = float(run.errors["env_timeout"])
        metrics["agent/env_reward_mean"] = sum(AGGREGATIONS[cfg.options.env_reward](t.rewards) for t in trajs) / n
    return trajs, metrics


def _turn_ids(tokenizer: Any, messages: list[dict[str, str]], new: list[dict[str, str]],
              tools: list[dict[str, Any]] | None = None, last_id: int | None = None) -> list[int]:
    """Token ids between the model's last token (`last_id`) and its next turn: the end of the assistant turn,
    the new (tool or user) messages and the generation prompt, as the chat template renders them (with the
    same `tools` as the prompt). A turn that ended on an end-of-turn token the model sampled (vLLM keeps it in
    the turn's ids) already holds the template's end of turn: it is not added twice."""
    before = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    after = tokenizer.apply_chat_template(messages + new, tools=tools, tokenize=False, add_generation_prompt=True)
    content = messages[-1]["content"]
    end = before.rfind(content)
    if end < 0 or not after.startswith(before):
        raise ValueError("the chat template does not render a new turn as an extension of the conversation")
    glue = before[end + len(content):] + after[len(before):]
    if last_id is not None and last_id in tokenizer.all_special_ids:
        sampled = tokenizer.convert_ids_to_tokens(last_id)
        if glue.startswith(sampled):
            glue = glue[len(sampled):]
    return tokenizer.encode(glue, add_special_tokens=False)
