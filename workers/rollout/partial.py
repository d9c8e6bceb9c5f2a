"""Partial rollouts: samples generated a chunk of tokens at a time, across weight updates.

A `Sample` is one response in progress: its prompt's token ids, the tokens generated so far with their
sampled log-probs, and for each token the policy version (weight syncs so far) of the engine that produced
it. `continuation_batch` turns unfinished samples into a generate call's prompts (prompt + response so far,
as `prompt_ids`, one sample each; a fresh sample is its prompt alone), `extend` appends a round's tokens, and
`assemble` lays finished samples out as the Batch a generate call gives (`RolloutWorker.generate`), plus
`token_versions` [B, R].

MoE engines that record their routing (`routed_experts`, for routing replay) record it per round over the
whole sequence they ran: the prompt and the response so far (re-run as the round's prompt) and the new
tokens. A sample keeps, for each token, the route of the round that generated it, and for the prompt the
first round's; a position no round recorded yet (a round's last token, which its engine never ran) takes
the next round's. So the update replays, for every generated token, the experts its engine used when it
sampled it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from workers.batch import Batch, pad_sequences
from workers.roles.routes import ROUTES_KEY


@dataclass
class Sample:
    """One response in progress (or finished) of group `group` (a prompt's n samples share it)."""

    group: int
    prompt_ids: list[int]
    meta: dict[str, Any]  # its prompt record's fields (ground_truth, ...) and `prompt`, the templated text
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # None while in progress
    started: int = 0  # the policy version of its first token
    score: float | None = None  # its reward, scored in the buffer as soon as its whole group finished
    routes: torch.Tensor | None = None  # [prompt + tokens, layers, k] MoE routes (engines that record them)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def oldest(self) -> int:
        """The policy version of its oldest token (its start while it has none)."""
        return min(self.versions, default=self.started)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (a checkpoint's driver state): routes as nested lists."""
        return dict(self.__dict__) | {"routes": None if self.routes is None else self.routes.tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        routes = d.get("routes")
        return cls(**{**d, "routes": None if routes is None else torch.tensor(routes, dtype=torch.int16)})


def extend(sample: Sample, batch: Batch, i: int, version: int, max_tokens: int) -> None:
    """Append row i of a round's output (generated at `version`); finished on a stop (EOS, a stop token) or
    when the response reaches `max_tokens`."""
    mask = batch["response_mask"][i].bool()
    tokens, logprobs = batch["responses"][i][mask].tolist(), batch["rollout_logprobs"][i][mask].tolist()
    if ROUTES_KEY in batch:
        _extend_routes(sample, batch[ROUTES_KEY][i][batch["attention_mask"][i].bool()])
    sample.tokens += tokens
    sample.logprobs += logprobs
    sample.versions += [version] * len(tokens)
    sample.text += batch["response_text"][i]
    reason = batch["finish_reason"][i]
    if reason != "length" or len(sample.tokens) >= max_tokens:
        sample.finish_reason = reason


def _extend_routes(sample: Sample, ran: torch.Tensor) -> None:
    """Add a round's routes `ran` [the round's prompt + new tokens, layers, k] (before its tokens are added):
    the new tokens' routes are appended, and positions recorded -1 so far take this round's (module doc)."""
    known = len(sample.prompt_ids) + len(sample.tokens)
    if sample.routes is None:
        sample.routes = ran.clone()
        return
    old = torch.where(sample.routes < 0, ran[:known], sample.routes)
    sample.routes = torch.cat([old, ran[known:]])


def continuation_batch(samples: list[Sample]) -> Batch:
    """A generate call's prompts for unfinished samples: prompt + the response so far, one sample each."""
    return Batch(meta={"prompt_ids": [s.prompt_ids + s.tokens for s in samples],
                       "prompt": [s.meta.get("prompt", "") for s in samples]})


def assemble(samples: list[Sample]) -> Batch:
    """Finished samples (a group's rows contiguous) as a generate Batch: prompts left-padded to P, responses
    right-padded to R (padding 0), `rollout_logprobs`, `token_versions` (0 on padding), meta `group_id`
    (renumbered from 0), `response_text`, `finish_reason`, `policy_version` (the oldest token's version)
    and the samples' record fields (prompt, ground_truth, ...); `scores` when every sample has one."""
    prompts, p_mask = pad_sequences([s.prompt_ids for s in samples], left=True)
    responses, r_mask = pad_sequences([s.tokens for s in samples])
    logprobs, _ = pad_sequences([torch.tensor(s.logprobs, dtype=torch.float32) for s in samples], dtype=torch.float32)
    versions, _ = pad_sequences([s.versions for s in samples])
    order: dict[int, int] = {}
    groups = [order.setdefault(s.group, len(order)) for s in samples]
    meta: dict[str, list[Any]] = {k: [s.meta.get(k) for s in samples] for k in (samples[0].meta if samples else {})}
    meta |= {"response_text": [s.text for s in samples], "finish_reason": [s.finish_reason for s in samples],
             "group_id": groups, "policy_version": [s.oldest for s in samples]}
    batch = Batch(tensors={"input_ids": torch.cat([prompts, responses], 1), "attention_mask": torch.cat([p_mask, r_mask], 1),
                           "responses": responses, "response_mask": r_mask, "rollout_logprobs": logprobs,
                           "token_versions": versions}, meta=meta)
    if samples and all(s.routes is not None for s in samples):
        batch[ROUTES_KEY] = _laid_out_routes(samples, prompts.shape[1], responses.shape[1])
    if samples and all(s.score is not None for s in samples):
        batch["scores"] = torch.tensor([s.score for s in samples], dtype=torch.float32)
    return batch


def _laid_out_routes(samples: list[Sample], p: int, r: int) -> torch.Tensor:
    """The samples' routes in the `input_ids` columns [B, P + R, layers, k] (prompts left-padded to P,
    responses right-padded to R), -1 on padding, as `RolloutWorker.generate` gives them."""
    first = samples[0].routes
    assert first is not None
    out = torch.full((len(samples), p + r, *first.shape[1:]), -1, dtype=first.dtype)
    for row, s in enumerate(samples):
        assert s.routes is not None
        n = len(s.prompt_ids)
        out[row, p - n: p] = s.routes[:n]
        out[row, p: p + len(s.routes) - n] = s.routes[n:]
    return out
