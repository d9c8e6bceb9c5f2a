"""Cut a `Batch` shard into model-ready micro-batches (`Micro`) and put per-token results back.

RL layout: `input_ids` [B, P+R] (prompt left-padded to P, response right-padded to R) with
`attention_mask`; the logits for response token j sit at column P-1+j. Each micro-batch is trimmed to
the columns some row actually uses (all-padding columns on the left and right are dropped), which
changes nothing for the real tokens: RoPE depends only on relative positions and padding keys are
masked. (The LM layout of `train_lm_step` is cut by `workers.roles.lm.lm_micros`.)

Packing (`pack=True`): the real tokens of the batch's sequences are laid end
to end, first-fit-decreasing into as few rows as possible (none longer than the longest sequence), with
a block-diagonal causal mask, and `micro_batch_size` rows make a micro-batch. Little compute is spent on
padding (the RL batch is padded to the longest prompt and response of the whole batch); the losses are
split-invariant (global normaliser), so regrouping the samples does not change the gradients. Each sequence sees only itself, and RoPE
depends only on relative positions, so the results equal the padded ones up to float rounding. The
model output is gathered back to [b, R, ...] by `response_slice`. Prefix sharing (`pack="prefix"`, the
roles' default where the model's RoPE takes explicit positions): the samples of one prompt share one copy
of it in a packed row (`prefix_shared_micros`).

Image batches (a vision-language policy: `pixel_values` / `image_grid_thw` in the batch, workers/vision/
inputs.py) run unpacked, each micro-batch taking its rows' image inputs as `Micro.model_inputs`.

MoE routing (`token_map=True`): each micro-batch also carries `_token_of` [its samples, P+R], where each
real token of a sample sits in the micro-batch's flattened [b * s] token block (-1: padding), so per-token
routes move between the batch's layout and the micro-batch's (`workers.roles.routes`); a batch's
`routed_experts` (when among `keys`) become the micro-batch's `routes`, the experts to replay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.batch import Batch
from workers.megatron.engine import Micro
from workers.megatron.masks import causal_mask
from workers.roles.base import MegatronWorker
from workers.roles.routes import POLICY_ROUTES_KEY, ROUTES_KEY, attach_routes, batch_routes
from workers.vision.inputs import IMAGE_KEYS


def attention_mask_4d(attn: torch.Tensor) -> torch.Tensor:
    """[b, s] 1 on real tokens -> [b, 1, s, s] bool, True where attention is masked (future or padding)."""
    s = attn.shape[1]
    causal = causal_mask(s, device=attn.device)
    return (causal[None] | (attn == 0)[:, None, :]).unsqueeze(1)


def position_ids(attn: torch.Tensor) -> torch.Tensor:
    return (attn.long().cumsum(-1) - 1).clamp_min(0)


def make_micro(ids: torch.Tensor, attn: torch.Tensor, fields: dict[str, torch.Tensor],
               device: torch.device, min_cols: int = 0) -> Micro:
    """A Micro of the columns [lo, hi) that hold real tokens (hi >= min_cols so the caller's slices exist)."""
    used = attn.bool().any(0).nonzero().flatten()
    lo = int(used.min()) if used.numel() else 0
    hi = int(used.max()) + 1 if used.numel() else 1
    lo, hi = min(lo, max(min_cols - 1, 0)), max(hi, min(min_cols, ids.shape[1]))
    ids, attn = ids[:, lo:hi].to(device), attn[:, lo:hi].to(device)
    return Micro(ids, position_ids(attn), attention_mask_4d(attn).to(device),
                 {k: v.to(device) for k, v in fields.items()}, offset=lo)


def response_micros(batch: Batch, micro_batch_size: int, keys: list[str], device: torch.device,
                    pack: bool | str = False, token_map: bool = False) -> list[Micro]:
    """Micro-batches of an RL batch; `fields` carry `keys` (e.g. responses, advantages). Fields whose
    name starts with '_' are bookkeeping for `response_slice` / `restore_order`.

    Unpacked: `micro_batch_size` consecutive rows per micro-batch. Packed: the batch's sequences are
    packed first-fit-decreasing into rows no longer than the longest sequence, and
    `micro_batch_size` such rows form a micro-batch (so a micro-batch holds at least as many
    sequences, with far less padding); the samples' order changes, `_index` records it. `pack="prefix"`:
    the samples that share a prompt (GRPO's n samples) share ONE copy of it (`prefix_shared_micros`).
    `token_map`: see the module docstring (routing replay and recording)."""
    r = batch["responses"].shape[1]
    p = batch["input_ids"].shape[1] - r
    plain = [k for k in keys if k != ROUTES_KEY]
    images = [k for k in IMAGE_KEYS if k in batch]
    if images:
        pack = False  # image rows run as they are: their patches and grids are per row (workers/vision/inputs.py)
    if pack == "prefix":
        out = prefix_shared_micros(batch, p, max(1, micro_batch_size), plain, device)
    elif pack:
        out = packed_micros(batch, p, max(1, micro_batch_size), plain, device)
    else:
        out = []
        for chunk in batch.chunks(max(1, micro_batch_size)):
            fields = {k: chunk[k] for k in plain if k in chunk}
            micro = make_micro(chunk["input_ids"], chunk["attention_mask"], fields, device, min_cols=p)
            micro.fields["_resp_col"] = torch.tensor(p - 1 - micro.offset)
            s = micro.input_ids.shape[1]
            cols = torch.arange(batch["input_ids"].shape[1]) - micro.offset
            rows = torch.arange(len(chunk))[:, None] * s
            inside = (cols >= 0) & (cols < s) & chunk["attention_mask"].bool()
            micro.fields["_token_of"] = torch.where(inside, rows + cols, -1)
            micro.model_inputs = {k: chunk[k].to(device) for k in images}
            out.append(micro)
    if ROUTES_KEY in keys and ROUTES_KEY in batch:
        attach_routes(out, batch[ROUTES_KEY])
    if not token_map and ROUTES_KEY not in keys:
        for m in out:
            m.fields.pop("_token_of", None)
    return out


def first_fit_decreasing(lens: list[int], cap: int) -> list[list[int]]:
    """Indices of `lens` packed into bins of total length <= cap (longest first; deterministic)."""
    bins: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lens)), key=lambda k: (-lens[k], k)):
        row = next((r for r, f in enumerate(fill) if f + lens[i] <= cap), None)
        if row is None:
            bins.append([])
            fill.append(0)
            row = len(bins) - 1
        bins[row].append(i)
        fill[row] += lens[i]
    return bins


def real_spans(batch: Batch, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the columns [lo, hi) from the first real token (at most p-1: the logit of response token 0)
    to one past the last real token (at least p), for the RL layout with prompts left-padded to p."""
    attn = batch["attention_mask"].bool()
    cols = torch.arange(attn.shape[1])
    lo = torch.where(attn, cols, torch.full_like(cols, attn.shape[1])).min(1).values.clamp(max=p - 1)
    hi = torch.where(attn, cols + 1, torch.zeros_like(cols)).max(1).values.clamp(min=p)
    return lo, hi


def packed_micros(batch: Batch, p: int, rows_per_micro: int, keys: list[str], device: torch.device) -> list[Micro]:
    """Pack every row's real span [first real token, last real token] (see `response_micros`)."""
    ids = batch["input_ids"]
    lo, hi = real_spans(batch, p)
    lens = (hi - lo).tolist()
    bins = first_fit_decreasing(lens, max(lens, default=1))
    micros = []
    for k in range(0, len(bins), rows_per_micro):
        rows = bins[k:k + rows_per_micro]
        members = [i for row in rows for i in row]
        w = max(sum(lens[i] for i in row) for row in rows)
        tokens = torch.zeros(len(rows), w, dtype=ids.dtype)
        seg = torch.full((len(rows), w), -1, dtype=torch.long)
        pos = torch.zeros(len(rows), w, dtype=torch.long)
        start = {}
        token_of = torch.full((len(members), ids.shape[1]), -1, dtype=torch.long)
        k_of = {i: k for k, i in enumerate(members)}
        for r, row in enumerate(rows):
            o = 0
            for i in row:
                n = lens[i]
                tokens[r, o:o + n] = ids[i, lo[i]:hi[i]]
                seg[r, o:o + n] = i
                pos[r, o:o + n] = torch.arange(n)
                start[i] = r * w + o
                token_of[k_of[i], lo[i]:hi[i]] = torch.arange(r * w + o, r * w + o + n)
                o += n
        causal = causal_mask(w)
        mask = (causal[None] | (seg[:, :, None] != seg[:, None, :])).unsqueeze(1)  # [rows, 1, w, w]
        m_idx = torch.tensor(members, dtype=torch.long)
        m_lo, m_hi = lo[m_idx], hi[m_idx]
        m_start = torch.tensor([start[i] for i in members], dtype=torch.long)
        r_eff = int((m_hi - p).max())
        j = torch.arange(r_eff)
        gather = m_start[:, None] + (p - 1 - m_lo)[:, None] + j[None, :]  # [b, R_eff] into the flat output
        gather = torch.where(j[None, :] < (m_hi - p)[:, None], gather, m_start[:, None])  # padding: a real slot
        fields = {k: batch[k][m_idx].to(device) for k in keys if k in batch}
        token_of = torch.where(batch["attention_mask"][m_idx].bool(), token_of, -1)
        fields |= {"_gather": gather.to(device), "_index": m_idx, "_token_of": token_of}
        micros.append(Micro(tokens.to(device), pos.to(device), mask.to(device), fields))
    return micros


def prefix_shared_micros(batch: Batch, p: int, rows_per_micro: int, keys: list[str], device: torch.device
                         ) -> list[Micro]:
    """Packing where the samples that share a prompt share one copy of it.

    A group = one prompt (m tokens) followed by the responses of some samples with that prompt: all of them,
    or fewer where long responses would make the shared row's quadratic attention cost more than the
    repeated prompt saves (`split_group`); groups are packed first-fit-decreasing into rows no longer
    than the longest group. A batch where nothing is shared (n=1, or every group split to single samples)
    is packed by `packed_micros`. A response token attends to its group's prompt and, causally, to its own response,
    never to the other responses; positions continue from the prompt (m, m+1, ...; RoPE at explicit
    positions, workers/megatron/rope_positions.py), so every sample sees exactly the sequence it had alone
    and the logits equal the unshared ones up to float rounding. The shared prompt positions get the sum
    of the samples' gradients, as separate copies would. GRPO (n samples, prompts longer than responses)
    computes ~n times fewer prompt tokens."""
    ids = batch["input_ids"]
    lo, hi = real_spans(batch, p)
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i in range(len(batch)):
        by_prompt.setdefault(tuple(ids[i, int(lo[i]):p].tolist()), []).append(i)
    rlen = (hi - p).tolist()
    groups = []
    for g in by_prompt.values():
        groups += split_group(g, p - int(lo[g[0]]), [rlen[i] for i in g])
    if all(len(g) == 1 for g in groups):  # nothing shared: plain packing (RoPE without explicit positions)
        return packed_micros(batch, p, rows_per_micro, keys, device)
    plen = [p - int(lo[g[0]]) for g in groups]
    glen = [plen[k] + sum(rlen[i] for i in g) for k, g in enumerate(groups)]
    bins = first_fit_decreasing(glen, max(glen, default=1))
    micros = []
    for b0 in range(0, len(bins), rows_per_micro):
        rows = bins[b0:b0 + rows_per_micro]
        w = max(sum(glen[k] for k in row) for row in rows)
        tokens = torch.zeros(len(rows), w, dtype=ids.dtype)
        grp = torch.full((len(rows), w), -1, dtype=torch.long)  # group of the token, -1: padding
        own = torch.full((len(rows), w), -1, dtype=torch.long)  # sample of a response token, -1: prompt/pad
        pos = torch.zeros(len(rows), w, dtype=torch.long)
        members, first, start, token_rows = [], [], [], []
        for r, row in enumerate(rows):
            o = 0
            for k in row:
                m = plen[k]
                tokens[r, o:o + m] = ids[groups[k][0], p - m:p]
                grp[r, o:o + m] = k
                pos[r, o:o + m] = torch.arange(m)
                prompt_end = o + m
                prompt_tokens = torch.arange(r * w + o, r * w + prompt_end)
                o += m
                for i in groups[k]:
                    n = rlen[i]
                    tokens[r, o:o + n] = ids[i, p:p + n]
                    grp[r, o:o + n] = k
                    own[r, o:o + n] = i
                    pos[r, o:o + n] = torch.arange(m, m + n)
                    members.append(i)
                    first.append(r * w + prompt_end - 1)  # the logit that predicts response token 0
                    start.append(r * w + o)
                    t = torch.full((ids.shape[1],), -1, dtype=torch.long)
                    t[p - m:p] = prompt_tokens  # the shared copy of the prompt
                    t[p:p + n] = torch.arange(r * w + o, r * w + o + n)
                    token_rows.append(t)
                    o += n
            pos[r, o:] = torch.arange(w - o)
        same_group = grp[:, :, None] == grp[:, None, :]  # padding pairs count as one group (no empty rows)
        visible = (own[:, None, :] == -1) | (own[:, :, None] == own[:, None, :])
        causal = causal_mask(w)
        mask = (causal[None] | ~(same_group & visible)).unsqueeze(1)  # [rows, 1, w, w], True = masked
        m_idx = torch.tensor(members, dtype=torch.long)
        n_resp = torch.tensor([rlen[i] for i in members], dtype=torch.long)
        r_eff = max(1, int(n_resp.max()))
        j = torch.arange(r_eff)
        first_t, start_t = torch.tensor(first), torch.tensor(start)
        gather = torch.where(j[None, :] == 0, first_t[:, None], start_t[:, None] + j[None, :] - 1)
        gather = torch.where(j[None, :] < n_resp[:, None], gather, first_t[:, None])  # padding: a real slot
        fields = {key: batch[key][m_idx].to(device) for key in keys if key in batch}
        token_of = torch.where(batch["attention_mask"][m_idx].bool(), torch.stack(token_rows), -1)
        fields |= {"_gather": gather.to(device), "_index": m_idx, "_token_of": token_of}
        micros.append(Micro(tokens.to(device), pos.to(device), mask.to(device), fields, explicit_positions=True))
    return micros


# Cost model of a packed row of w tokens: w (per-token work: the linear layers) + w^2 / ATTN_CROSSOVER
# (the dense [w, w] attention scores and mask: matmuls plus element-wise passes over heads x w x w).
ATTN_CROSSOVER = 1024


def split_group(samples: list[int], m: int, rlens: list[int], crossover: int = ATTN_CROSSOVER) -> list[list[int]]:
    """The samples of one prompt (m tokens; responses of rlens tokens) in k consecutive parts, each to share
    its own copy of the prompt, with k chosen by the row cost model: one part when the prompt is long
    against the responses (GRPO on short answers), one sample per part when long responses would make one
    shared row quadratically expensive (its attention grows with the square of the row)."""
    n = len(samples)

    def bounds(k: int) -> list[int]:
        return [round(j * n / k) for j in range(k + 1)]

    def cost(k: int) -> float:
        b = bounds(k)
        return sum(w + w * w / crossover for w in (m + sum(rlens[lo:hi]) for lo, hi in zip(b, b[1:])))

    b = bounds(min(range(1, n + 1), key=cost))
    return [samples[lo:hi] for lo, hi in zip(b, b[1:])]


def restore_order(parts: list[torch.Tensor], indices: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-micro-batch results [b_i, ...] and put row k back at position indices[k]."""
    values, index = torch.cat(parts), torch.cat(indices)
    out = torch.empty_like(values)
    out[index] = values
    return out


def join_outputs(outs: list[dict[str, torch.Tensor]], key: str) -> torch.Tensor:
    """Concatenate `key` of per-micro-batch results in the batch's row order (packed micro-batches carry
    `_index`, the rows they hold)."""
    if "_index" in outs[0]:
        return restore_order([o[key] for o in outs], [o["_index"] for o in outs])
    return torch.cat([o[key] for o in outs])


def response_slice(micro: Micro, output: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The model output [b, s, ...] at the positions that predict response tokens: [b, R_eff, ...], R_eff
    (packed micro-batches: output [1, S, ...] gathered per row)."""
    if "_gather" in micro.fields:
        idx = micro.fields["_gather"]
        return output.reshape(-1, *output.shape[2:])[idx], idx.shape[1]
    start = int(micro.fields["_resp_col"])
    r_eff = max(0, min(micro.fields["responses"].shape[1], output.shape[1] - start - 1))
    return output[:, start:start + r_eff], r_eff


def pad_right(x: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    """Right-pad dim 1 of [b, w] to `width`."""
    if x.shape[1] >= width:
        return x[:, :width]
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def forward_responses(worker: MegatronWorker, batch: Batch, micro_batch_size: int | None,
                      outputs: Callable[[torch.Tensor, Micro], dict[str, torch.Tensor]]) -> Batch:
    """A forward pass over the batch's responses: `outputs(out, micro)` maps the model's output at a
    micro-batch's response positions ([b, r, ...]) to per-token tensors [b, r]; returns them [B, R] in
    the batch's order, 0 at padding. MoE models, when the batch has the rollout's `routed_experts`: they
    are replayed when the role's `moe.routing_replay` is on, and the experts every token used come back as
    `policy_routed_experts` (same layout, `workers.roles.routes`)."""
    eng = worker.engine
    r = batch["responses"].shape[1]
    routed = eng.routing is not None and ROUTES_KEY in batch
    keys = ["responses", ROUTES_KEY] if routed and eng.moe.routing_replay else ["responses"]
    micros = response_micros(batch, micro_batch_size or worker.micro_batch_size, keys, eng.device,
                             pack=worker.pack_sequences, token_map=routed)

    def loss_fn(mb: Micro, out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        sl, _ = response_slice(mb, out)
        data = {k: pad_right(v.float().cpu(), r) for k, v in outputs(sl, mb).items()}
        if "_index" in mb.fields:
            data["_index"] = mb.fields["_index"]
        return torch.zeros((), device=out.device), data

    with worker.onloaded():
        outs = eng.forward_backward(micros, loss_fn, forward_only=True, record_routes=routed)
    if not outs:
        return Batch()
    tensors = {k: join_outputs(outs, k) for k in outs[0] if k != "_index"}
    if "response_mask" in batch:
        mask = batch["response_mask"].to(torch.float32)
        tensors = {k: v * mask for k, v in tensors.items()}
    if routed:
        tensors[POLICY_ROUTES_KEY] = batch_routes(micros, eng.recorded_routes, len(batch), batch["input_ids"].shape[1])
    return Batch(tensors)
