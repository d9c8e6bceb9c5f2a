"""The multi-turn agent loop on a vLLM engine, token in, token out.

A trajectory generates until a tool call (`</tool_call>`), the end of its turn or its token budget; the
calls run (concurrently across trajectories, each with a timeout) and their results are appended as `tool`
messages, tokenised once as the chat template's glue between turns; then generation continues from the
exact token ids so far, never re-tokenised from text. The response mask is 1 on the model's own tokens only,
and the sampled-token log-probs are kept for those.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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


def run_agent(llm: Any, tokenizer: Any, messages: list[list[dict[str, str]]], prompt_ids: list[list[int]],
              params: ParamsFn, max_tokens_per_turn: int, cfg: AgentConfig) -> tuple[list[Trajectory], dict[str, float]]:
    """Run one trajectory per (messages, prompt_ids). Returns the trajectories and `agent/*` metrics."""
    trajs = [Trajectory([dict(m) for m in msgs], list(ids)) for msgs, ids in zip(messages, prompt_ids)]
    errors: Counter[str] = Counter()
    calls = 0
    tool_s = 0.0
    with ThreadPoolExecutor(cfg.tool_workers, thread_name_prefix="tool") as pool, \
            ThreadPoolExecutor(cfg.tool_workers, thread_name_prefix="tool-call") as outer:
        for _ in range(cfg.max_turns):
            active = [i for i, t in enumerate(trajs) if not t.done]
            if not active:
                break
            reqs, sps = [], []
            for i in active:
                t = trajs[i]
                left = cfg.max_total_tokens - len(t.token_ids)
                reqs.append({"prompt_token_ids": t.prompt_ids + t.token_ids})
                sps.append(params(i, max(1, min(max_tokens_per_turn, left))))
            outs = llm.generate(reqs, sps, use_tqdm=False)
            pending: list[tuple[int, list]] = []
            for i, out in zip(active, outs):
                t, c = trajs[i], out.outputs[0]
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
                if not found or len(t.token_ids) >= cfg.max_total_tokens:
                    t.done = True
                    continue
                pending.append((i, found))
            t0 = time.perf_counter()
            results = list(outer.map(lambda job: [run_call(call, cfg.tools, pool, cfg.tool_timeout_s)
                                                  for call in job[1]], pending))
            tool_s += time.perf_counter() - t0
            for (i, found), res in zip(pending, results):
                t = trajs[i]
                calls += len(found)
                errors.update(kind for _, kind in res if kind)
                glue = _tool_turn_ids(tokenizer, t.messages, [text for text, _ in res])
                room = cfg.max_total_tokens - len(t.token_ids)
                if len(glue) >= room:  # no room left for the model to answer: stop before the tool output
                    t.done, t.finish_reason = True, "length"
                    continue
                t.token_ids += glue
                t.mask += [0] * len(glue)
                t.sampled_logprobs += [0.0] * len(glue)
                t.messages += [{"role": "tool", "content": text} for text, _ in res]
        for t in trajs:
            if not t.done:  # out of turns
                t.finish_reason = "length"
    n = max(len(trajs), 1)
    metrics = {"agent/turns_mean": sum(t.turns for t in trajs) / n, "agent/tool_calls": float(calls),
               "agent/tool_calls_per_trajectory": calls / n, "agent/tool_errors": float(sum(errors.values())),
               "agent/tool_time_s": tool_s,
               "agent/truncated": sum(t.finish_reason == "length" for t in trajs) / n}
    metrics.update({f"agent/tool_errors/{k.replace(' ', '_')}": float(v) for k, v in errors.items()})
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
