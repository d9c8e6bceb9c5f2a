"""KTO's mismatched prompt / answer pairs, for its KL baseline z0 (`algorithms.kto`).

KTO (`algorithm.dpo.loss=kto`) trains each preference pair as two unpaired examples (`algorithms.preference_loss`).
Its reference point z0 estimates KL(policy || reference) from answers the policy and the reference score
under prompts they do not answer: here pair i's prompt with pair (i + 1) mod N's chosen answer, N the
dataset's pair count (TRL pairs each prompt with the next example's completion too). The partner is fixed by
the dataset, so the reference's log-probs of these rows can be precomputed like the answers' own.

`kl_fields(ds, idx)`: `kl_<k>` [B, seq_length] for k in tokens, labels, loss_mask, position_ids (the layout of
`collate_pairs`, loss_mask over the borrowed answer's tokens and its end of turn).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhf.data.sft import collate_sft, sample_tensors

KL_SIDE = "kl"


def _full(item: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of an SFT item: the n + 1 ids and their answer mask (mask[0] is 0, the first id is a prompt's)."""
    ids = torch.cat([item["tokens"], item["labels"][-1:]])
    mask = torch.cat([torch.zeros(1, dtype=item["loss_mask"].dtype), item["loss_mask"]])
    return ids, mask


def mismatched_item(prompt_item: dict[str, torch.Tensor], answer_item: dict[str, torch.Tensor],
                    seq_length: int) -> dict[str, torch.Tensor]:
    """The SFT item of `prompt_item`'s prompt (through the assistant header) followed by `answer_item`'s
    answer (its masked tokens and everything after them), cut to seq_length + 1 ids."""
    p_ids, p_mask = _full(prompt_item)
    a_ids, a_mask = _full(answer_item)
    p_start, a_start = (int(m.nonzero()[0]) if m.any() else len(m) for m in (p_mask, a_mask))
    ids = torch.cat([p_ids[:p_start], a_ids[a_start:]])[: seq_length + 1]
    mask = torch.cat([torch.zeros(p_start, dtype=a_mask.dtype), a_mask[a_start:]])[: seq_length + 1]
    return sample_tensors(ids.numpy(), mask.numpy())


def kl_fields(ds: Any, idx: Sequence[int]) -> dict[str, torch.Tensor]:
    """`kl_<k>` of the pairs `idx` of `ds` (a `PairDataset`): each one's prompt with the next pair's chosen
    answer (module docstring)."""
    n = len(ds)
    items = [mismatched_item(ds[i]["chosen"], ds[(i + 1) % n]["chosen"], ds.seq_length) for i in idx]
    return {f"{KL_SIDE}_{k}": v for k, v in collate_sft(items, ds.pad_id, ds.seq_length).items()}
