"""The placement strategies a run may ask for, by their config names (`<role>.resources.placement`,
`rollout.placement`), and Ray's placement-group strategy for each. No Ray import: configs check names here."""

from __future__ import annotations

# pack: as few nodes as possible; spread: over as many as possible; strict_pack: one node or fail;
# strict_spread: every bundle (a tensor-parallel group, an engine) on a node of its own or fail
PLACEMENTS = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK", "strict_spread": "STRICT_SPREAD"}


def ray_strategy(placement: str, who: str = "placement") -> str:
    """Ray's strategy for a config's `placement`; ValueError naming `who` for an unknown one."""
    if placement not in PLACEMENTS:
        raise ValueError(f"{who}={placement!r}: must be one of {', '.join(PLACEMENTS)}")
    return PLACEMENTS[placement]
