"""HF folders compared bit for bit, and the conversion tests' checks of each source rank's weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def assert_same_hf(a: Path, b: Path) -> None:
    from transformers import AutoModelForCausalLM

    sa = AutoModelForCausalLM.from_pretrained(a).state_dict()
    sb = AutoModelForCausalLM.from_pretrained(b).state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def source_ranks(ranks: list[dict], hf_dir: str) -> list[dict]:
    """The parity world's results for `hf_dir`, one a rank (mcore_convert_fns.parity_and_reshard), after checking
    that each rank filled all its parameters from the folder and yielded them back unchanged, and that the
    ranks together yield every HF tensor once."""
    from workers.megatron.hf_map import expected_hf_shapes

    per_rank = [r["models"][hf_dir] for r in ranks]
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    for r in per_rank:
        assert r["filled"] == r["n_params"]
        assert r["mismatched"] == [], f"iter_hf_weights differs from the source for {r['mismatched']}"
    yielded = [n for r in per_rank for n in r["yielded"]]
    assert sorted(yielded) == sorted(expected_hf_shapes(cfg)), "source ranks must cover every tensor once"
    return per_rank
