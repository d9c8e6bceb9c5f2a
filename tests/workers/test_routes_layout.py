"""Per-token routes between a batch's layout and its micro-batches' (workers/roles/routes.py), for padded,
packed and prefix-shared micro-batches: every real token's routes land on that token, and what the engine
records per micro-batch comes back in the batch's layout. No model: plain tensors."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.batches import grouped_batch
from workers.roles.micro import response_micros
from workers.roles.routes import ROUTES_KEY, batch_routes

LAYERS, TOPK = 3, 2
CPU = torch.device("cpu")


def routes_of(batch) -> torch.Tensor:
    """Routes that name their token: [..., layer, 0] = the token id, [..., layer, 1] = layer; -1 on padding."""
    ids = batch["input_ids"]
    r = torch.stack([ids[..., None].expand(*ids.shape, LAYERS),
                     torch.arange(LAYERS).expand(*ids.shape, LAYERS)], -1).to(torch.int16)
    return torch.where(batch["attention_mask"].bool()[..., None, None], r, torch.full_like(r, -1))


@pytest.mark.parametrize("pack", [False, True, "prefix"])
def test_routes_follow_their_tokens_and_come_back(pack):
    batch = grouped_batch(prompts=3, n=4, seed=1)
    batch[ROUTES_KEY] = routes = routes_of(batch)
    micros = response_micros(batch, 2, ["responses", ROUTES_KEY], CPU, pack=pack)
    assert all(ROUTES_KEY not in m.fields for m in micros)  # not a per-sample loss field
    for m in micros:
        assert m.routes.shape == (*m.input_ids.shape, LAYERS, TOPK)
        real = m.routes[..., 0, 0] >= 0
        assert torch.equal(m.routes[..., 0, 0][real].long(), m.input_ids[real])
        assert torch.equal(m.routes[..., :, 1][real], torch.arange(LAYERS, dtype=torch.int16).expand(int(real.sum()), -1))
    tokens = int(batch["attention_mask"].sum())
    if pack == "prefix":  # the 3 prompts are laid out once each, not once per sample
        assert sum(int((m.routes[..., 0, 0] >= 0).sum()) for m in micros) < tokens
    back = batch_routes(micros, [m.routes for m in micros], len(batch), batch["input_ids"].shape[1])
    assert torch.equal(back, routes)


def test_unrecorded_positions_stay_free():
    batch = grouped_batch(prompts=2, n=2, seed=2)
    routes = routes_of(batch)
    routes[:, -1] = -1  # e.g. the response's last token, which the engine never ran
    batch[ROUTES_KEY] = routes
    micros = response_micros(batch, 4, ["responses", ROUTES_KEY], CPU, pack=True)
    free = sum(int((m.routes[..., 0, 0] < 0).sum()) for m in micros)
    assert free == sum(m.input_ids.numel() for m in micros) - int((routes[..., 0, 0] >= 0).sum())
