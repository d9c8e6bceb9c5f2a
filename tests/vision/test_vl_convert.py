"""Qwen2-VL HF <-> megatron-core: logits on image + text batches against transformers at TP2 and PP2, the
weight export bit-exact, the CLI round trip HF -> mcore (TP2) -> HF bit-exact, M-RoPE positions against
transformers' `get_rope_index`."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from vl_fns import vl_batch, vl_parity

from rlhf.cli import main as cli
from workers.megatron.launch import run_distributed
from workers.vision.mrope import mrope_positions


def test_logits_and_export_at_tp2(tiny_model_factory):
    path = tiny_model_factory("tiny-qwen2-vl")
    ranks = run_distributed(vl_parity, 2, args=(path,), tp=2)
    for r in ranks:
        assert r["filled"] == r["n_params"]
        assert r["max_abs_diff"] < 1e-4, r["max_abs_diff"]
        assert r["blind_diff"] > 1e-2  # the pixels reach the language model
        assert r["mismatched"] == [] and r["exported"] == r["source"]


def test_logits_and_export_at_pp2(tiny_model_factory):
    """Stage 0 holds the vision tower and layer 0, stage 1 layer 1 and the head: together every tensor."""
    path = tiny_model_factory("tiny-qwen2-vl")
    first, last = run_distributed(vl_parity, 2, args=(path,), pp=2)
    assert any(n.startswith("visual.") for n in first["exported"])
    assert not any(n.startswith("visual.") for n in last["exported"])
    assert sorted(first["exported"] + last["exported"]) == first["source"]
    assert first["mismatched"] == last["mismatched"] == []
    assert last["max_abs_diff"] < 1e-4 and last["blind_diff"] > 1e-2


def test_cli_round_trip_is_bit_exact(tiny_model_factory, tmp_path):
    path = tiny_model_factory("tiny-qwen2-vl")
    assert cli(["convert", "hf-to-mcore", "--hf", path, "--out", str(tmp_path / "mc"), "--tp", "2"]) == 0
    assert cli(["convert", "mcore-to-hf", "--mcore", str(tmp_path / "mc"), "--out", str(tmp_path / "hf")]) == 0
    a, b = load_file(f"{path}/model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(a) == sorted(b) and any(k.startswith("visual.") for k in a)
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert (tmp_path / "hf" / "preprocessor_config.json").is_file()  # the processor travels with the weights


def _hf_rope_index(path: str, enc) -> torch.Tensor:
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return model.model.get_rope_index(enc["input_ids"], enc["mm_token_type_ids"], enc["image_grid_thw"],
                                      attention_mask=enc["attention_mask"])[0]


def test_mrope_positions_match_transformers(tiny_model_factory):
    """Right- and left-padded batches (positions counted over each row's tokens, as the engine does)."""
    from transformers import AutoConfig

    path = tiny_model_factory("tiny-qwen2-vl")
    image_token = AutoConfig.from_pretrained(path).image_token_id
    enc, inputs = vl_batch(path)
    mask = enc["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ours = mrope_positions(enc["input_ids"], positions, inputs["image_grid_thw"], image_token, merge=2)
    want = _hf_rope_index(path, enc)
    assert torch.equal(ours[:, mask.bool()], want[:, mask.bool()])
    assert int(ours.max()) < int(positions.max())  # each image shortened its row's positions
    # Left padding: same rows shifted right.
    flip = torch.stack([torch.roll(r, int((m == 0).sum())) for r, m in zip(enc["input_ids"], mask)])
    lmask = torch.stack([torch.roll(m, int((m == 0).sum())) for m in mask])
    lpos = (lmask.cumsum(-1) - 1).clamp(min=0)
    left = mrope_positions(flip, lpos, inputs["image_grid_thw"], image_token, merge=2)
    assert torch.equal(left[:, lmask.bool()], want[:, mask.bool()])


def test_packed_rows_reset_the_image_shift(tiny_model_factory):
    """Two sequences packed in one row: the second starts again from position 0 without the first's shift."""
    from transformers import AutoConfig

    path = tiny_model_factory("tiny-qwen2-vl")
    image_token = AutoConfig.from_pretrained(path).image_token_id
    enc, inputs = vl_batch(path, n=2)
    n0 = int(enc["attention_mask"][0].sum())
    row = torch.cat([enc["input_ids"][0, :n0], enc["input_ids"][0, :n0]])[None]
    pos = torch.cat([torch.arange(n0), torch.arange(n0)])[None]
    grid = torch.stack([inputs["image_grid_thw"][0, 0]] * 2)[None]
    out = mrope_positions(row, pos, grid, image_token, merge=2)
    assert torch.equal(out[:, 0, :n0], out[:, 0, n0:])
