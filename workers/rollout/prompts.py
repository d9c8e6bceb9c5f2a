"""Prompt normalisation (chat messages, raw text or token ids -> token ids) and the output Batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workers.batch import Batch

PROMPT_KEYS = ("prompt_ids", "messages", "prompt")


@dataclass
class Prompts:
    """Normalised prompts: token ids and text per prompt, plus the input batch (its other fields ride along)."""

    ids: list[list[int]]
    text: list[str]
    source: Batch


def _is_messages(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, dict) for m in x)


def _is_ids(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) for t in x)


def as_batch(prompts: Batch | Sequence[Any]) -> Batch:
    """A Batch from a Batch or a plain list of prompts (strings, message lists or token-id lists)."""
    if isinstance(prompts, Batch):
        return prompts
    items = list(prompts)
    if items and all(_is_ids(x) for x in items):
        return Batch(meta={"prompt_ids": items})
    if items and all(isinstance(x, torch.Tensor) for x in items):
        return Batch(meta={"prompt_ids": [x.tolist() for x in items]})
    return Batch(meta={"prompt": items})


def normalise(prompts: Batch | Sequence[Any], tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> Prompts:
    """Token ids and text of each prompt.

    Fields, first found wins: meta `prompt_ids` (token-id lists, used as is; text decoded), `messages`
    (chat messages; the chat template is applied with the generation prompt and `tools`, the schemas of the
    tools the model may call, as SFT renders them: rlhf/data/chat.py), `prompt` (each entry a string, used as
    raw text, or a list of message dicts, chat-templated).
    """
    batch = as_batch(prompts)
    if len(batch) == 0:
        raise ValueError("generate got no prompts")
    key = next((k for k in PROMPT_KEYS if k in batch.meta), None)
    if key is None:
        raise ValueError(f"the prompt batch needs one of the meta fields {PROMPT_KEYS}; it has {batch.keys()}")
    values = batch.meta[key]
    if key == "prompt_ids":
        ids = [[int(t) for t in x] for x in values]
        if any(not x for x in ids):
            raise ValueError("an empty token-id prompt was passed")
        text = list(batch.meta["prompt"]) if "prompt" in batch.meta else tokenizer.batch_decode(ids)
        return Prompts(ids, [str(t) for t in text], batch)
    text, templated = [], []
    for i, x in enumerate(values):
        if _is_messages(x):
            text.append(tokenizer.apply_chat_template(list(x), tools=tools, add_generation_prompt=True,
                                                      tokenize=False))
            templated.append(True)
        elif isinstance(x, str):
            text.append(x)
            templated.append(False)
        else:
            raise ValueError(f"prompt {i} is neither text nor chat messages: {type(x).__name__}")
    ids = [None] * len(text)
    for flag in (True, False):
        rows = [i for i, t in enumerate(templated) if t is flag]
        if rows:
            enc = tokenizer([text[i] for i in rows], add_special_tokens=not flag)["input_ids"]
            for i, e in zip(rows, enc):
                ids[i] = list(e)
    if any(not x for x in ids):
        raise ValueError("a prompt tokenised to zero tokens")
    return Prompts(ids, text, batch)  # type: ignore[arg-type]


def build_output(prompts: Prompts, outputs: Sequence[Sequence[Any]], n: int, pad_id: int,
                 tokenizer: Any = None) -> Batch:
    """The generate Batch (see RolloutWorker.generate) from vLLM's per-prompt completion lists, or from
    agent trajectories (which carry `sampled_logprobs` and a `mask`: 1 on the model's own tokens).

    Responses that vLLM did not detokenise (no stop strings) are decoded here in one batched call."""
    rows = len(prompts.ids) * n
    resp_ids: list[list[int]] = []
    resp_lp: list[list[float]] = []
    masks: list[list[int] | None] = []
    texts, reasons = [], []
    for comps in outputs:
        for c in comps:
            toks = list(c.token_ids)
            resp_ids.append(toks)
            lp = getattr(c, "sampled_logprobs", None)
            resp_lp.append(lp if lp is not None else sampled_logprobs(c.logprobs, toks))
            masks.append(getattr(c, "mask", None))
            texts.append(c.text)
            reasons.append(c.finish_reason or "length")
    if len(resp_ids) != rows:
        raise RuntimeError(f"the engine returned {len(resp_ids)} samples, expected {rows}")
    if tokenizer is not None:
        texts = tokenizer.batch_decode(resp_ids, skip_special_tokens=True)
    width_p = max(len(p) for p in prompts.ids)
    width_r = max(1, max(len(r) for r in resp_ids))
    input_ids = torch.full((rows, width_p + width_r), pad_id, dtype=torch.long)
    attn = torch.zeros((rows, width_p + width_r), dtype=torch.long)
    logprobs = torch.zeros((rows, width_r), dtype=torch.float32)
    for row in range(rows):
        p, r = prompts.ids[row // n], resp_ids[row]
        input_ids[row, width_p - len(p):width_p] = torch.tensor(p)
        attn[row, width_p - len(p):width_p] = 1
        if r:
            input_ids[row, width_p:width_p + len(r)] = torch.tensor(r)
            attn[row, width_p:width_p + len(r)] = 1
            logprobs[row, :len(r)] = torch.tensor(resp_lp[row], dtype=torch.float32)
    routes = _routes(prompts, outputs, n, width_p + width_r)
    response_mask = attn[:, width_p:].clone()
    for row, mask in enumerate(masks):
        if mask is not None:
            response_mask[row, :len(mask)] = torch.tensor(mask, dtype=torch.long)
    repeat = [i // n for i in range(rows)]
    base = prompts.source.index(repeat)
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attn,
        "responses": input_ids[:, width_p:].clone(),
        "response_mask": response_mask,
        "rollout_logprobs": logprobs,
    }
    if routes is not None:
        tensors["routed_experts"] = routes
    out = Batch(
        tensors=tensors,
        meta={
            "prompt": [prompts.text[i] for i in repeat],
            "response_text": texts,
            "finish_reason": reasons,
            "group_id": repeat,
        },
    )
    return base.union(out)


def _routes(prompts: Prompts, outputs: Sequence[Sequence[Any]], n: int, width: int) -> torch.Tensor | None:
    """The experts the engine routed each token to, [rows, width, layers, top-k] int16 in the `input_ids`
    columns (-1 where it routed nothing: padding, the last response token), when it recorded them (MoE
    models with `return_routed_experts`: [tokens it ran, layers, top-k] per sample from the first prompt
    token on, `workers.rollout.route_capture`); None if a sample has none."""
    comps = [c for cs in outputs for c in cs]
    found = [getattr(c, "routed_experts", None) for c in comps]
    if not comps or any(r is None for r in found):
        return None
    width_p = max(len(p) for p in prompts.ids)
    first = found[0]
    out = torch.full((len(comps), width, *first.shape[1:]), -1, dtype=torch.int16)
    for row, (c, r) in enumerate(zip(comps, found)):
        start = width_p - len(prompts.ids[row // n])
        t = min(len(r), width - start, len(prompts.ids[row // n]) + len(c.token_ids))
        out[row, start:start + t] = torch.as_tensor(r[:t].astype("int16"))
    return out


def sampled_logprobs(logprobs: Any, toks: list[int]) -> list[float]:
    """The sampled token's logprob at each step (vLLM returns a dict or a flat container per step)."""
    if logprobs is None:
        return [0.0] * len(toks)
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: the sampled token comes first at each position
        flat = logprobs.logprobs
        return [float(flat[i]) for i in logprobs.start_indices]
    return [float(step[t].logprob) for step, t in zip(logprobs, toks)]


def concat_rollouts(parts: Sequence[Batch]) -> Batch:
    """Generate Batches of several calls or engines as one. Each is laid out [prompt left-padded to P |
    response right-padded to R], and the trainer finds the responses at column P = width - R, so the prompt
    columns are left-padded and the response columns right-padded to the widest P and R (a plain
    `Batch.concat` would right-pad the whole row and shift the responses of the shorter-prompt batches).
    Per-sequence tensors (width P + R: ids, masks, routed experts) are split at P; per-response ones (width R)
    are right-padded; padding is 0, and -1 for routed experts (nothing routed)."""
    given = [p for p in parts if p is not None]
    parts = [p for p in given if len(p)]
    if len(parts) <= 1:
        return parts[0] if parts else (given[0] if given else Batch())
    shapes = [(b["input_ids"].shape[1] - b["responses"].shape[1], b["responses"].shape[1]) for b in parts]
    width_p, width_r = max(p for p, _ in shapes), max(r for _, r in shapes)
    aligned = []
    for b, (p, r) in zip(parts, shapes):
        tensors = {}
        for k, v in b.tensors.items():
            fill = -1 if k == "routed_experts" else 0
            tail = (0, 0) * (v.dim() - 2)
            if v.dim() >= 2 and v.shape[1] == p + r and p > 0:
                v = torch.cat([torch.nn.functional.pad(v[:, :p], tail + (width_p - p, 0), value=fill),
                               torch.nn.functional.pad(v[:, p:], tail + (0, width_r - r), value=fill)], dim=1)
            elif v.dim() >= 2 and v.shape[1] == r:
                v = torch.nn.functional.pad(v, tail + (0, width_r - r), value=fill)
            tensors[k] = v
        aligned.append(Batch(tensors, b.meta, b.info))
    return Batch.concat(aligned)
