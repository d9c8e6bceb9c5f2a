"""MoE routes across partial-rollout rounds (workers/rollout/partial.py): each generated token keeps the route
of the round that sampled it, the prompt the first round's, and a position a round could not record (its
last token) takes the next round's; `assemble` lays them out in the `input_ids` columns, and a checkpoint's
JSON round trip keeps them."""

from __future__ import annotations

import json

import torch

from workers.batch import Batch, pad_sequences
from workers.roles.routes import ROUTES_KEY
from workers.rollout.partial import Sample, assemble, extend

LAYERS, K = 2, 2


def _round(rows: list[tuple[list[int], list[int], list[int]]], finish: list[str]) -> Batch:
    """A generate call's output: per row (prompt ids, new tokens, route id per token of prompt + new tokens),
    the route of token t at every layer and slot being its route id; -1 on the last new token (never run)."""
    prompts, p_mask = pad_sequences([p for p, _, _ in rows], left=True)
    responses, r_mask = pad_sequences([t for _, t, _ in rows])
    width = prompts.shape[1] + responses.shape[1]
    routes = torch.full((len(rows), width, LAYERS, K), -1, dtype=torch.int16)
    for i, (p, t, ids) in enumerate(rows):
        cols = list(range(prompts.shape[1] - len(p), prompts.shape[1])) + list(
            range(prompts.shape[1], prompts.shape[1] + len(t)))
        for c, rid in zip(cols, ids[:-1]):  # the last token was sampled, never run
            routes[i, c] = rid
    return Batch(tensors={"responses": responses, "response_mask": r_mask,
                          "attention_mask": torch.cat([p_mask, r_mask], 1),
                          "rollout_logprobs": torch.zeros(responses.shape, dtype=torch.float32),
                          ROUTES_KEY: routes},
                 meta={"response_text": ["x"] * len(rows), "finish_reason": finish})


def test_routes_follow_the_round_that_sampled_each_token_and_survive_a_checkpoint():
    a = Sample(group=0, prompt_ids=[5, 6, 7], meta={"prompt": "a"})
    b = Sample(group=0, prompt_ids=[8], meta={"prompt": "b"})
    # round 1 (version 0): a samples 2 tokens, b 3; routes 100+ for a, 200+ for b
    first = _round([(a.prompt_ids, [1, 2], [100, 101, 102, 103, 104]),
                    (b.prompt_ids, [3, 4, 9], [200, 201, 202, 203])], ["length", "length"])
    extend(a, first, 0, 0, 10)
    extend(b, first, 1, 0, 10)
    assert b.routes is not None and b.routes[:, 0, 0].tolist() == [200, 201, 202, -1]
    assert a.routes is not None and a.routes[:, 0, 0].tolist() == [100, 101, 102, 103, -1]
    # round 2 (version 1): a re-runs prompt + its 2 tokens (new routes 300+) and samples 1 more, then stops
    extend(a, _round([(a.prompt_ids + a.tokens, [11], [300, 301, 302, 303, 304, 305])], ["stop"]), 0, 1, 10)
    assert a.done and a.tokens == [1, 2, 11] and a.versions == [0, 0, 1]
    # the first round's routes stay; the position round 1 could not record (its last token) takes round 2's;
    # the new token's route is round 2's; its own last position is unrecorded
    assert a.routes[:, 0, 0].tolist() == [100, 101, 102, 103, 304, -1]
    b.finish_reason = "stop"
    restored = [Sample.from_dict(json.loads(json.dumps(s.to_dict()))) for s in (a, b)]
    assert all(torch.equal(x.routes, y.routes) for x, y in zip(restored, (a, b)))
    batch = assemble(restored)
    routes = batch[ROUTES_KEY]
    assert routes.shape == (2, batch["input_ids"].shape[1], LAYERS, K)
    # row 0: prompt of 3 (no left padding), then 3 response tokens; row 1: prompt of 1 left-padded by 2
    assert routes[0, :, 0, 0].tolist() == [100, 101, 102, 103, 304, -1]
    assert routes[1, :, 0, 0].tolist() == [-1, -1, 200, 201, 202, -1]
