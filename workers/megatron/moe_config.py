"""The training choices of a Mixture-of-Experts model (the schema's `<role>.moe` section).

The model itself (experts, top-k, sizes, shared expert, router normalisation) comes from its config.json
(`model_provider.moe_config_from_hf`); these settings only choose how it is trained and run, and become
megatron TransformerConfig overrides (`transformer_overrides`). Dense models ignore them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
TOKEN_DISPATCHERS = ("auto", "allgather", "alltoall")
# megatron's aux-loss tracker names of the load-balancing types
TRACKER_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


@dataclass
class MoEConfig:
    """Router losses and token dispatch of an MoE model.

    - `aux_loss_coeff`: the load-balancing loss (Switch Transformer; megatron `moe_aux_loss_coeff`), 0 = off.
      `load_balancing_type` says over what it balances: `aux_loss` each micro-batch's tokens, `seq_aux_loss`
      each sequence's.
    - `z_loss_coeff`: the router z-loss (ST-MoE: the squared log-sum-exp of the router logits), 0 = off.
    - `expert_bias_update_rate`: aux-loss-free balancing of routers with an expert bias (DeepSeek-V3): after
      each training pass every bias moves by this much towards balance (up for experts that got fewer tokens
      than the mean over the global batch, down for more; megatron `moe_router_bias_update_rate`). The biases
      are part of the model and its checkpoints; routers without a bias ignore it.
    - `token_dispatcher`: how tokens reach the experts of other expert-parallel ranks. `auto`: `alltoall` with
      CUDA or pipeline parallelism, `allgather` otherwise (megatron-core 0.16.1's all-to-all dispatcher
      creates CUDA streams, so it cannot be built on CPU; with PP the engine runs micro-batches of varying
      shapes (variable_seq_lengths), which megatron allows only with all-to-all).
    """

    aux_loss_coeff: float = 0.0
    load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | none
    z_loss_coeff: float = 0.0
    expert_bias_update_rate: float = 1e-3
    token_dispatcher: str = "auto"  # auto | allgather | alltoall
    routing_replay: bool = False  # the policy: replay the rollout engine's experts in its forwards (R3)

    def dispatcher(self, pp: int) -> str:
        """The dispatcher megatron builds at pipeline size `pp` (`auto` resolved for this machine)."""
        if self.token_dispatcher != "auto":
            return self.token_dispatcher
        from workers.megatron.cpu_compat import cuda_absent  # torch: imported only when a model is built

        return "alltoall" if pp > 1 or not cuda_absent() else "allgather"

    @property
    def balancing(self) -> str:
        """The load-balancing type in effect ("none" when its coefficient is 0)."""
        return self.load_balancing_type if self.aux_loss_coeff > 0 else "none"

    def tracked_losses(self) -> dict[str, str]:
        """Metric name -> megatron aux-loss tracker name of the router losses that are on."""
        out = {}
        if self.balancing != "none":
            out["moe/aux_loss"] = TRACKER_NAMES[self.balancing]
        if self.z_loss_coeff > 0:
            out["moe/z_loss"] = "z_loss"
        return out

    def transformer_overrides(self, pp: int) -> dict[str, Any]:
        """megatron TransformerConfig fields for these choices at pipeline size `pp`."""
        return {
            "moe_router_load_balancing_type": self.balancing,
            "moe_aux_loss_coeff": self.aux_loss_coeff if self.balancing != "none" else 0.0,
            "moe_z_loss_coeff": self.z_loss_coeff if self.z_loss_coeff > 0 else None,
            "moe_token_dispatcher_type": self.dispatcher(pp),
            "moe_router_bias_update_rate": self.expert_bias_update_rate,
        }

    def fit_error(self, pp: int, cuda: bool) -> str | None:
        """Why these choices cannot run at pipeline size `pp` on this machine (`cuda`), or None; the
        field named is relative to the section (the caller prefixes `<role>.moe.`)."""
        if self.load_balancing_type not in LOAD_BALANCING_TYPES:
            return f"load_balancing_type: expected one of {', '.join(LOAD_BALANCING_TYPES)}, got {self.load_balancing_type!r}"
        if self.token_dispatcher not in TOKEN_DISPATCHERS:
            return f"token_dispatcher: expected one of {', '.join(TOKEN_DISPATCHERS)}, got {self.token_dispatcher!r}"
        for name in ("aux_loss_coeff", "z_loss_coeff", "expert_bias_update_rate"):
            value = getattr(self, name)
            if not value >= 0:
                return f"{name}: expected a coefficient >= 0, got {value!r}"
        dispatcher = self.dispatcher(pp)
        if pp > 1 and dispatcher != "alltoall":
            return (f"token_dispatcher={self.token_dispatcher} with pipeline parallelism (pp={pp}): the pipeline "
                    "schedules run micro-batches of varying shapes (variable_seq_lengths), which megatron allows "
                    "only with the alltoall dispatcher")
        if dispatcher == "alltoall" and not cuda:
            why = f"pipeline parallelism (pp={pp}) needs it" if pp > 1 else "it was chosen"
            return (f"token_dispatcher: the alltoall dispatcher cannot run without CUDA ({why}): megatron-core "
                    "0.16.1 builds it with torch.cuda.Stream; on CPU use pp=1 and the allgather dispatcher")
        return None
