"""One parallel layout of a trainer: how the world of GPUs is split and which memory levers are on."""

from __future__ import annotations

from dataclasses import dataclass, replace

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """world = tp * cp * dp * pp. Experts: `ep` groups of `etp`-way expert TP, over the tp*cp*dp ranks of a
    stage (expert data-parallel size edp = tp*cp*dp / (etp*ep)). `vpp` model chunks per pipeline rank."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    mbs: int = 1
    sp: bool = False  # sequence parallelism (with tp > 1)
    recompute: str = "none"  # none | selective (core attention) | full (every layer, uniform, 1 layer)
    offload: bool = False  # optimizer state and fp32 master weights on CPU
    dist_opt: bool = True  # distributed optimizer: optimizer state sharded over data-parallel ranks

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    def with_(self, **kw) -> Layout:
        return replace(self, **kw)

    def short(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        parts.append(f"dp{self.dp}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1 or self.etp != self.tp:
            parts.append(f"ep{self.ep}" + (f"/etp{self.etp}" if self.etp != self.tp else ""))
        parts.append(f"mbs{self.mbs}")
        if self.sp:
            parts.append("sp")
        if self.recompute != "none":
            parts.append(f"rc:{self.recompute}")
        if self.offload:
            parts.append("offload")
        return " ".join(parts)
