"""`ReferenceWorker`: a frozen model (the policy's starting weights, or a distillation teacher): `compute_logprobs` (RL batches) and `compute_pair_logps`
(DPO's preference batches, `algorithm.dpo.reference: group`).

No optimizer or gradient buffers are built. With `init_kwargs["offload"]=True` (GPU) its parameters
stay on the CPU between calls, so it can share the policy's GPUs (colocate both on one ResourcePool).
"""

from __future__ import annotations

from workers.batch import Batch
from workers.dispatch import DP_COMPUTE, register
from workers.roles.base import MegatronWorker
from workers.roles.dpo_step import PairLogpsMixin
from workers.roles.policy import LogprobMixin


class ReferenceWorker(LogprobMixin, PairLogpsMixin, MegatronWorker):
    trainable = False

    @register(DP_COMPUTE)
    def compute_logprobs(self, batch: Batch, with_entropy: bool = False, key: str = "ref_logprobs",
                         micro_batch_size: int | None = None, temperature: float = 1.0,
                         top1_key: str | None = None) -> Batch:
        """Per-token log-probs [B, R] of the responses under `key` (default `ref_logprobs`), of the logits
        divided by `temperature`; with `top1_key`, the greedy token id at each response position (a
        distillation teacher's, `algorithms.top1_agreement`)."""
        return self._logprob_pass(batch, with_entropy, key, micro_batch_size, temperature, top1_key)
