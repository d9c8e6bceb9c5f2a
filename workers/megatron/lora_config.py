"""The LoRA settings of the trained policy (the schema's `policy.lora` section) and the module names it targets.

Targets are megatron-core's linear layers, each named by its megatron name or by the HF projections it fuses:

| megatron      | HF names                     | parallel | adapter split over TP                  |
|---------------|------------------------------|----------|----------------------------------------|
| `linear_qkv`  | `q_proj`, `k_proj`, `v_proj` | column   | A [r, in] replicated, B [out/tp, r]    |
| `linear_proj` | `o_proj`                     | row      | A [r, in/tp], B [out, r] replicated    |
| `linear_fc1`  | `gate_proj`, `up_proj`       | column   | as linear_qkv                          |
| `linear_fc2`  | `down_proj`                  | row      | as linear_proj                         |

A fused layer has ONE adapter pair (A shared by the fused projections, B over all their output rows), so
its HF names come together: `q_proj` alone would mean adapting k and v too, which is refused; name all three
(or `linear_qkv`). Exported to PEFT, such an adapter becomes one pair per projection with the same A and
B's rows split (`q_proj.lora_B` = the q rows), which computes exactly the same update.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MCORE_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# HF projection -> the megatron layer that holds it; the names of one layer must all be given together
HF_ALIASES = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
              "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}


def available_targets() -> str:
    """The names `target_modules` accepts, for error messages."""
    return f"{', '.join(MCORE_TARGETS)} (megatron) or {', '.join(HF_ALIASES)} (HF)"


@dataclass
class LoRAConfig:
    """Low-rank adapters on the policy's linear layers: W x + (alpha / rank) B A dropout(x).

    - `rank`: the adapters' inner size r (>= 1); `alpha`: their scale is alpha / rank (PEFT's `lora_alpha`).
    - `dropout`: on the adapters' input while training (PEFT's `lora_dropout`).
    - `target_modules`: megatron or HF names of the linear layers to adapt (table in the module docstring).
    Every other parameter (embeddings, norms, output layer, the base weights) is frozen.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(MCORE_TARGETS))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def targets(self) -> tuple[str, ...]:
        """The megatron layer names adapted, in MCORE_TARGETS order (call `fit_error` first)."""
        chosen = {HF_ALIASES.get(t, t) for t in self.target_modules}
        return tuple(t for t in MCORE_TARGETS if t in chosen)

    def fit_error(self) -> str | None:
        """Why these settings cannot run, or None; the field named is relative to the section (the caller
        prefixes `policy.lora.`)."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            return f"rank: expected an integer >= 1 (the adapters' inner size), got {self.rank!r}"
        if not self.alpha > 0:
            return f"alpha: expected a number > 0 (the adapters' scale is alpha / rank), got {self.alpha!r}"
        if not 0 <= self.dropout < 1:
            return f"dropout: expected a probability in [0, 1), got {self.dropout!r}"
        if not self.target_modules:
            return f"target_modules: expected at least one of {available_targets()}, got []"
        for name in self.target_modules:
            if name not in MCORE_TARGETS and name not in HF_ALIASES:
                return f"target_modules: {name!r} names no module of the model; available: {available_targets()}"
        given = set(self.target_modules)
        for layer in MCORE_TARGETS:
            parts = [h for h, m in HF_ALIASES.items() if m == layer]
            named = [h for h in parts if h in given]
            if len(parts) > 1 and named and len(named) < len(parts) and layer not in given:
                return (f"target_modules: {', '.join(named)} without {', '.join(h for h in parts if h not in named)}: "
                        f"{', '.join(parts)} are one fused megatron layer ({layer}) with one adapter; name all "
                        f"of them or {layer}")
        return None
