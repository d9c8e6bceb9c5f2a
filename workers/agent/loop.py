"""The multi-turn agent loop on a vLLM engine, token in, token out.

A trajectory generates until a tool call (`</tool_call>`), the end of its turn or its token budget; the
calls run in threads (each with a timeout) while the engine keeps stepping the other trajectories, and their
results are appended as `tool` messages, tokenised once as the chat template's glue between turns; then generation continues from the
exact token ids so far, never re-tokenised from text. The response mask is 1 on the model's own tokens only,
and the sampled-token log-probs are kept for those.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from workers.agent.env import AGGREGATIONS, Environment
from workers.agent.options import AgentOptions
from workers.agent.toolcalls import CLOSE, parse_tool_calls
from workers.agent.tools import Tool, run_call
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

    def step_env(self, i: int) -> tuple[str | None, float, bool]:
        """The environment's answer to trajectory i's last turn (run in a thread, under the tool timeout)."""
        t = self.trajs[i]
        return t.env.step(t.text)

    def env_results(self, i: int, job: Future) -> bool:
        """Record the environment's step; append its observation as a user turn. False: the trajectory ends."""
        t = self.trajs[i]
        try:
            obs, reward, done = job.result(timeout=0)
            t.rewards.append(float(reward))
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
        glue = _turn_ids(self.tokenizer, t.messages, new)
        if len(glue) >= self.cfg.options.max_total_tokens - len(t.token_ids):
            t.done, t.finish_reason = True, "length"
            return False
        t.token_ids += glue
        t.mask += [0] * len(glue)
        t.sampled_logprobs += [0.0] * len(glue)
        t.messages += new
        return True


def run_agent(llm: Any, tokenizer: Any, messages: list[list[dict[str, str]]], prompt_ids: list[list[int]],
              params: ParamsFn, max_tokens_per_turn: int, cfg: Agent,
              ground_truths: list[Any] | None = None, lora_request: Any = None
              ) -> tuple[list[Trajectory], dict[str, float]]:
    """Run one trajectory per (messages, prompt_ids), each at its own pace: the engine steps while tools run
    in threads, and a trajectory's next turn joins the engine's batch as soon as its tool results are in.
    Returns the trajectories and `agent/*` metrics. `lora_request`: the vLLM LoRA adapter every turn runs with."""
    trajs = [Trajectory([dict(m) for m in msgs], list(ids)) for msgs, ids in zip(messages, prompt_ids)]
    run = _Run(llm, tokenizer, params, max_tokens_per_turn, cfg, trajs, lora_request)
    if cfg.env is not None:
        for t, gt in zip(trajs, ground_truths or [None] * len(trajs)):
            t.env = cfg.env()
            t.env.reset([dict(m) for m in t.messages], gt)
    tools: dict[Future, tuple[int, list, float]] = {}
    with ThreadPoolExecutor(cfg.tool_workers, thread_name_prefix="tool") as pool, \
            ThreadPoolExecutor(cfg.tool_workers, thread_name_prefix="tool-call") as outer:
        for i in range(len(trajs)):
            run.submit(i)
        while run.engine.has_unfinished_requests() or tools:
            if run.engine.has_unfinished_requests():
                for out in run.engine.step():
                    if not out.finished:
                        continue
                    i = int(out.request_id.split("-")[2])
                    found = run.finished_turn(i, out.outputs[0])
                    if found and not trajs[i].done:
                        job = outer.submit(lambda f=found: [run_call(c, cfg.tools, pool, cfg.options.tool_timeout_s) for c in f])
                        tools[job] = (i, found, time.perf_counter())
                    elif not trajs[i].done:  # no tool call: the environment answers
                        tools[outer.submit(run.step_env, i)] = (i, [], time.perf_counter())
            else:
                done, _ = wait(list(tools), timeout=cfg.options.tool_timeout_s * 4 + 10, return_when=FIRST_COMPLETED)
                if not done:  # an environment step hangs: end those trajectories
                    for job, (i, _, _) in list(tools.items()):
                        run.errors["env_timeout"] += 1
                        trajs[i].done = True
                        tools.pop(job)
            for job in [f for f in tools if f.done()]:
                i, found, t0 = tools.pop(job)
                run.tool_s += time.perf_counter() - t0
                more = run.tool_results(i, found, job.result()) if found else run.env_results(i, job)
                if more:
                    run.submit(i)
    n = max(len(trajs), 1)
    metrics = {"agent/turns_mean": sum(t.turns for t in trajs) / n, "agent/tool_calls": float(run.calls),
               "agent/tool_calls_per_trajectory": run.calls / n,
               "agent/tool_errors": float(sum(run.errors.values())), "agent/tool_time_s": run.tool_s,
               "agent/truncated": sum(t.finish_reason == "length" for t in trajs) / n}
    metrics.update({f"agent/tool_errors/{k.replace(' ', '_')}": float(v) for k, v in run.errors.items()
                    if not k.startswith("env_")})
    if cfg.env is not None:
        metrics["agent/env_errors"] = float(run.errors["env_error"] + run.errors["env_timeout"])
        metrics["agent/env_reward_mean"] = sum(AGGREGATIONS[cfg.options.env_reward](t.rewards) for t in trajs) / n
    return trajs, metrics


def _turn_ids(tokenizer: Any, messages: list[dict[str, str]], new: list[dict[str, str]]) -> list[int]:
    """Token ids between the model's last token and its next turn: the end of the assistant turn, the new
    (tool or user) messages and the generation prompt, as the chat template renders them."""
    before = tokenizer.apply_chat_template(messages, tokenize=False)
    after = tokenizer.apply_chat_template(messages + new, tokenize=False, add_generation_prompt=True)
    content = messages[-1]["content"]
    end = before.rfind(content)
    if end < 0 or not after.startswith(before):
        raise ValueError("the chat template does not render a new turn as an extension of the conversation")
    glue = before[end + len(content):] + after[len(before):]
    return tokenizer.encode(glue, add_special_tokens=False)
