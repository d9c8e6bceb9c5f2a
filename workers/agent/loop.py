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

from workers.agent.toolcalls import CLOSE, parse_tool_calls
from workers.agent.tools import Tool, run_call
from workers.rollout.prompts import sampled_logprobs


@dataclass
class AgentConfig:
    tools: dict[str, Tool]
    max_turns: int = 4  # model turns per trajectory
    max_total_tokens: int = 256  # response tokens per trajectory, model and tool tokens together
    tool_timeout_s: float = 10.0
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


ParamsFn = Callable[[int, int], Any]  # (trajectory index, max new tokens) -> vLLM SamplingParams stopping at CLOSE


class _Run:
    """The state of one `run_agent` call: trajectories, their tool futures and the counters."""

    def __init__(self, llm: Any, tokenizer: Any, params: ParamsFn, max_tokens_per_turn: int, cfg: AgentConfig,
                 trajs: list[Trajectory]) -> None:
        self.engine, self.tokenizer, self.params, self.per_turn, self.cfg = (
            llm.llm_engine, tokenizer, params, max_tokens_per_turn, cfg)
        self.trajs = trajs
        self.tag = uuid.uuid4().hex[:8]
        self.errors: Counter[str] = Counter()
        self.calls, self.tool_s = 0, 0.0

    def submit(self, i: int) -> None:
        """Queue trajectory i's next model turn on the engine."""
        from vllm.sampling_params import RequestOutputKind

        t = self.trajs[i]
        left = self.cfg.max_total_tokens - len(t.token_ids)
        sp = self.params(i, max(1, min(self.per_turn, left)))
        sp.output_kind = RequestOutputKind.FINAL_ONLY
        self.engine.add_request(f"agent-{self.tag}-{i}-{t.turns}", {"prompt_token_ids": t.prompt_ids + t.token_ids},
                                sp)

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
        if not found or len(t.token_ids) >= self.cfg.max_total_tokens or t.turns >= self.cfg.max_turns:
            if found:  # out of turns or tokens with a call pending
                t.finish_reason = "length"
            t.done = True
            return []
        return found

    def tool_results(self, i: int, found: list, res: list[tuple[str, str | None]]) -> bool:
        """Append the tool turn; False when no room is left for the model to answer."""
        t = self.trajs[i]
        self.calls += len(found)
        self.errors.update(kind for _, kind in res if kind)
        glue = _tool_turn_ids(self.tokenizer, t.messages, [text for text, _ in res])
        if len(glue) >= self.cfg.max_total_tokens - len(t.token_ids):
            t.done, t.finish_reason = True, "length"
            return False
        t.token_ids += glue
        t.mask += [0] * len(glue)
        t.sampled_logprobs += [0.0] * len(glue)
        t.messages += [{"role": "tool", "content": text} for text, _ in res]
        return True


def run_agent(llm: Any, tokenizer: Any, messages: list[list[dict[str, str]]], prompt_ids: list[list[int]],
              params: ParamsFn, max_tokens_per_turn: int, cfg: AgentConfig) -> tuple[list[Trajectory], dict[str, float]]:
    """Run one trajectory per (messages, prompt_ids), each at its own pace: the engine steps while tools run
    in threads, and a trajectory's next turn joins the engine's batch as soon as its tool results are in.
    Returns the trajectories and `agent/*` metrics."""
    trajs = [Trajectory([dict(m) for m in msgs], list(ids)) for msgs, ids in zip(messages, prompt_ids)]
    run = _Run(llm, tokenizer, params, max_tokens_per_turn, cfg, trajs)
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
                    if found:
                        job = outer.submit(lambda f=found: [run_call(c, cfg.tools, pool, cfg.tool_timeout_s) for c in f])
                        tools[job] = (i, found, time.perf_counter())
            else:
                wait(list(tools), return_when=FIRST_COMPLETED)
            for job in [f for f in tools if f.done()]:
                i, found, t0 = tools.pop(job)
                run.tool_s += time.perf_counter() - t0
                if run.tool_results(i, found, job.result()):
                    run.submit(i)
    n = max(len(trajs), 1)
    metrics = {"agent/turns_mean": sum(t.turns for t in trajs) / n, "agent/tool_calls": float(run.calls),
               "agent/tool_calls_per_trajectory": run.calls / n,
               "agent/tool_errors": float(sum(run.errors.values())), "agent/tool_time_s": run.tool_s,
               "agent/truncated": sum(t.finish_reason == "length" for t in trajs) / n}
    metrics.update({f"agent/tool_errors/{k.replace(' ', '_')}": float(v) for k, v in run.errors.items()})
    return trajs, metrics


def _tool_turn_ids(tokenizer: Any, messages: list[dict[str, str]], results: list[str]) -> list[int]:
    """Token ids between the model's last token (its `</tool_call>`) and its next turn: the end of the
    assistant turn, the tool messages and the generation prompt, as the chat template renders them."""
    before = tokenizer.apply_chat_template(messages, tokenize=False)
    after = tokenizer.apply_chat_template(messages + [{"role": "tool", "content": r} for r in results],
                                          tokenize=False, add_generation_prompt=True)
    content = messages[-1]["content"]
    end = before.rfind(content)
    if end < 0 or not after.startswith(before):
        raise ValueError("the chat template does not render a tool turn as an extension of the conversation")
    glue = before[end + len(content):] + after[len(before):]
    return tokenizer.encode(glue, add_special_tokens=False)
