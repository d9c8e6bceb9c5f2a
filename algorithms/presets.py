"""Named algorithm presets: documented combinations of settings, checked by the config's validator.

- ``dr_grpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training"): GRPO without its two length and
  difficulty biases: the group advantage is not divided by the group's std (``norm_by_std: false``) and each
  sequence's token sum is divided by a constant instead of its own length
  (``loss_agg_mode: seq-mean-token-sum-norm``, the constant being the padded response length).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ALGORITHM_PRESETS", "preset_mismatches"]

# preset name -> the algorithm settings it stands for
ALGORITHM_PRESETS: dict[str, dict[str, Any]] = {
    "dr_grpo": {"adv_estimator": "grpo", "norm_by_std": False, "loss_agg_mode": "seq-mean-token-sum-norm"},
}


def preset_mismatches(name: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of preset ``name`` that ``settings`` holds with another value: ``{key: wanted}``.
    ``ValueError`` for an unknown preset, listing the known ones."""
    if name not in ALGORITHM_PRESETS:
        raise ValueError(f"unknown algorithm preset {name!r}; known: {', '.join(sorted(ALGORITHM_PRESETS))}")
    return {k: v for k, v in ALGORITHM_PRESETS[name].items() if settings.get(k) != v}
