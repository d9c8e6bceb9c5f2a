"""The attention mask type follows the batch. Padded, packed and prefix-shared RL batches and packed LM
batches all carry an explicit mask that differs from plain causal attention, so the layer spec (the TE one
on GPU) must configure `arbitrary` attention, which reads the mask, and not `causal`, which TE would apply
instead of it; only a batch without a mask gets `causal`. CPU-only: the spec's configuration, no kernels."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from workers.batch import Batch, pad_sequences
from workers.megatron.masks import attn_mask_type_for, causal_mask
from workers.megatron.model_provider import layer_spec
from workers.roles.lm import lm_attention_mask
from workers.roles.micro import response_micros

CPU = torch.device("cpu")


def rl_batch() -> Batch:
    """Two prompts of different lengths, two responses of different lengths each (GRPO-style)."""
    prompts = [torch.arange(3, 9), torch.arange(3, 9), torch.arange(10, 13), torch.arange(10, 13)]
    responses = [torch.arange(20, 23), torch.arange(30, 35), torch.arange(40, 42), torch.arange(50, 54)]
    p_ids, p_mask = pad_sequences(prompts, left=True)
    r_ids, r_mask = pad_sequences(responses)
    return Batch({"input_ids": torch.cat([p_ids, r_ids], 1), "attention_mask": torch.cat([p_mask, r_mask], 1),
                  "responses": r_ids, "response_mask": r_mask})


def batch_mask(kind: str) -> torch.Tensor:
    if kind == "lm-packed":  # two SFT samples in one row, then padding
        return lm_attention_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    pack = {"padded": False, "packed": True, "prefix-shared": "prefix"}[kind]
    micros = response_micros(rl_batch(), 4, ["responses"], CPU, pack=pack)
    assert len(micros) == 1 and micros[0].explicit_positions == (kind == "prefix-shared")
    return micros[0].attention_mask


@pytest.mark.parametrize("kind", ["padded", "packed", "prefix-shared", "lm-packed"])
def test_each_batch_kind_configures_arbitrary_attention(kind):
    mask = batch_mask(kind)
    s = mask.shape[-1]
    assert not torch.equal(mask, causal_mask(s).expand_as(mask))  # plain causal attention would be wrong
    mask_type = attn_mask_type_for(mask)
    assert mask_type is AttnMaskType.arbitrary
    spec = layer_spec(use_te=False, mask_type=mask_type)
    assert spec.submodules.self_attention.params["attn_mask_type"] is AttnMaskType.arbitrary


def test_default_spec_reads_the_mask_and_no_mask_means_causal():
    assert layer_spec(use_te=False).submodules.self_attention.params["attn_mask_type"] is AttnMaskType.arbitrary
    assert attn_mask_type_for(None) is AttnMaskType.causal
    spec = layer_spec(use_te=False, mask_type=attn_mask_type_for(None))
    assert spec.submodules.self_attention.params["attn_mask_type"] is AttnMaskType.causal
