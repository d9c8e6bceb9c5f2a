"""Per-token MoE routes between an RL batch's layout and its micro-batches' (routing replay, R3).

A batch's `routed_experts` [B, P+R, L, k] (int16, in the `input_ids` columns) hold, per token and layer,
the k experts the rollout engine routed it to; -1 where nothing was recorded (padding, a response's last
token, which the engine never ran, a dense layer). The micro-batch builders (`workers.roles.micro`) give
each micro-batch `_token_of` [its samples, P+R]: where each of its samples' real tokens sits in its
flattened [b * s] token block. With it, `attach_routes` lays a batch's routes out as the micro-batches'
`routes` [b, s, L, k] (a prompt shared by several samples takes the first one's, which equals the
others' as the engine computed the prompt once, from its prefix cache), and `batch_routes` puts what the
engine recorded per micro-batch back into the batch's layout.
"""

from __future__ import annotations

import torch

from workers.megatron.micro_batch import Micro

ROUTES_KEY = "routed_experts"  # the rollout engine's routes in a batch
POLICY_ROUTES_KEY = "policy_routed_experts"  # the experts the policy's forward used, same layout


def _member_rows(micros: list[Micro]) -> list[torch.Tensor]:
    """The batch rows of each micro-batch's samples (packed ones record them in `_index`)."""
    out, o = [], 0
    for m in micros:
        n = m.fields["_token_of"].shape[0]
        out.append(m.fields["_index"].cpu() if "_index" in m.fields else torch.arange(o, o + n))
        o += n
    return out


def attach_routes(micros: list[Micro], routes: torch.Tensor) -> None:
    """Set each micro-batch's `routes` from the batch's `routes` [B, P+R, L, k] (see module docstring)."""
    for m, rows in zip(micros, _member_rows(micros)):
        b, s = m.input_ids.shape[:2]
        tok = m.fields["_token_of"]
        valid = tok >= 0
        where, values = tok[valid], routes[rows][valid]  # row-major: the first sample of a shared prompt first
        slots, inverse = torch.unique(where, return_inverse=True)
        first = torch.full((len(slots),), len(where), dtype=torch.long)
        first.scatter_reduce_(0, inverse, torch.arange(len(where)), reduce="amin")
        out = torch.full((b * s, *routes.shape[2:]), -1, dtype=routes.dtype)
        out[slots] = values[first]
        m.routes = out.view(b, s, *routes.shape[2:]).to(m.input_ids.device)


def batch_routes(micros: list[Micro], recorded: list[torch.Tensor], batch_size: int, width: int) -> torch.Tensor:
    """The routes `recorded` per micro-batch ([b, s, L, k], `MegatronEngine.recorded_routes`) in the
    batch's layout [batch_size, width, L, k]; -1 where a token was not in any micro-batch."""
    shape = recorded[0].shape[2:]
    out = torch.full((batch_size, width, *shape), -1, dtype=torch.int16)
    for m, rows, rec in zip(micros, _member_rows(micros), recorded):
        tok = m.fields["_token_of"]
        flat = rec.reshape(-1, *shape)
        got = torch.where((tok >= 0)[..., None, None], flat[tok.clamp(min=0)], torch.full_like(flat[:1], -1))
        out[rows, : tok.shape[1]] = got
    return out
