"""GPU: with the Transformer Engine layer spec, packed and padded batches give each sample the logits it has
alone, because the attention mask type follows the batch; forced to `causal`, TE ignores the masks."""

from __future__ import annotations

import pytest
from mcore_train_fns import masked_vs_alone_logits

from workers.megatron.launch import run_distributed

pytestmark = pytest.mark.gpu
pytest.importorskip("transformer_engine", reason="the Transformer Engine layer spec needs transformer-engine")


def test_te_logits_follow_packing_and_padding_masks(tiny_model_factory):
    out = run_distributed(masked_vs_alone_logits, 1, args=(tiny_model_factory("tiny-qwen2"),))[0]
    assert out["te"], "the TE layer spec is not in use (transformer_engine missing?)"
    assert out["packed"] < 1e-3 and out["padded"] < 1e-3, out
    assert out["packed_causal_type"] > 1e-2, out  # the old plain-causal spec: sample b sees sample a
