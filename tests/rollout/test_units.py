"""Rollout pieces that need no engine: sampling validation, buckets, prompts, transport choice."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from workers.batch import Batch
from workers.config import build
from workers.rollout.buckets import BucketPacker, group_key, unpack
from workers.rollout.config import EngineConfig
from workers.rollout.registry import TRANSPORTS, choose_transport
from workers.rollout.sampling import SamplingConfig


@pytest.mark.parametrize(
    "field,value",
    [("n", 0), ("n", -2), ("max_tokens", 0), ("max_tokens", -1), ("top_p", 0.0), ("top_p", 1.5),
     ("top_p", -0.1), ("temperature", -1.0), ("top_k", -5), ("seed", -1), ("min_tokens", 99)],
)
def test_bad_sampling_is_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingConfig\.{field}="):
        SamplingConfig(**{field: value}).validate()


def test_sampling_from_the_run_config_and_with():
    from rlhf.config import load_config

    r = load_config("configs/grpo_tiny.yaml", ["rollout.n=4", "rollout.temperature=0.6", "rollout.stop=[x]"],
                    validate=False)
    sp = build(SamplingConfig, r.rollout).validate()
    assert (sp.n, sp.temperature, sp.stop, sp.seed) == (4, 0.6, ["x"], r.rollout.seed)
    assert sp.with_(n=2).n == 2
    with pytest.raises(ValueError, match="top_p"):
        sp.with_(top_p=2.0)


def test_engine_config_validation():
    with pytest.raises(ValueError, match="kv_cache_gb"):
        EngineConfig(model_path="x", kv_cache_gb=0).validate()
    with pytest.raises(TypeError):
        EngineConfig("x")  # by keyword: a path is never taken for another field
    with pytest.raises(ValueError, match=r"unknown EngineConfig keys \['n'\]"):
        build(EngineConfig, {"model_path": "path", "n": 3})
    cfg = build(EngineConfig, {"dtype": "bfloat16", "tp": 1, "max_num_seqs": 8, "model_path": "path"})
    assert (cfg.dtype, cfg.max_num_seqs, cfg.model_path) == ("bfloat16", 8, "path")


def test_transport_is_chosen_in_one_place():
    def name(**kw) -> str:
        return choose_transport(**kw).name

    assert name(on_gpu=False, colocated=True) == "gloo"
    assert name(on_gpu=True, colocated=True) == "cuda_ipc"
    assert name(on_gpu=True, colocated=False) == "nccl"
    with pytest.raises(ValueError, match="needs CUDA"):
        choose_transport(on_gpu=False, colocated=False, override="nccl")
    with pytest.raises(ValueError, match="unknown weight-sync transport 'tcp'"):
        choose_transport(on_gpu=False, colocated=False, override="tcp")
    assert name(on_gpu=False, colocated=False, same_host=True) == "shm"
    assert name(on_gpu=False, colocated=False, override="gloo", same_host=True) == "gloo"
    assert name(on_gpu=True, colocated=True, same_host=True) == "cuda_ipc"
    assert name(on_gpu=True, colocated=False, nodes=3) == "nccl"
    with pytest.raises(ValueError, match="rollout.colocate_with=policy on GPUs needs the policy and its engines on one node, not 2"):
        choose_transport(on_gpu=True, colocated=True, nodes=2)
    assert name(on_gpu=False, colocated=True, nodes=2) == "gloo"
    with pytest.raises(ValueError, match="one host"):
        choose_transport(on_gpu=False, colocated=False, override="shm", same_host=False)
    asked = []  # a same-host check runs only when shm is a candidate, strict when shm was named

    def check(strict: bool) -> bool:
        asked.append(strict)
        return True

    assert name(on_gpu=True, colocated=False, same_host=check) == "nccl"
    assert name(on_gpu=False, colocated=False, override="gloo", same_host=check) == "gloo"
    assert name(on_gpu=False, colocated=False, same_host=check) == "shm"
    assert name(on_gpu=False, colocated=False, override="shm", same_host=check) == "shm"
    assert asked == [False, True]
    assert {n: t.name for n, t in TRANSPORTS.items()} == {n: n for n in ("shm", "gloo", "nccl", "cuda_ipc")}


def test_transport_owns_its_control_keys():
    """A receiver deletes the control keys of its previous sync at the start of the next one; keys another
    transport object remembered (another process) stay."""
    from workers.rollout.control import SyncEndpoint
    from workers.rollout.transport import SyncSession
    from workers.rollout.weight_sync import GlooTransport

    endpoint = SyncEndpoint.open("127.0.0.1")
    session = SyncSession(1, GlooTransport, endpoint.host, endpoint.port, num_receivers=1, source_ranks=[0],
                          timeout_s=5.0)
    mine, other = GlooTransport(), GlooTransport()
    for key in ("a", "b", "c"):
        endpoint.store.set(key, b"1")
    mine.remember(session, 1, "a", "b")
    other.remember(session, 1, "c")
    mine.forget_old_keys(session, 1)
    assert [endpoint.store.check([k]) for k in ("a", "b", "c")] == [False, False, True]
    mine.forget_old_keys(session, 1)  # nothing left to delete
    mine.drop(session)
    assert GlooTransport.local() is GlooTransport.local() is not mine


def test_sync_config_from_the_run_config():
    from rlhf.config import load_config
    from workers.rollout.config import SyncConfig

    cfg = load_config("configs/grpo_tiny.yaml", ["rollout.zero_copy_weights=true", "rollout.sync_bucket_mb=8",
                                                 "rollout.sync_transport=gloo"])
    sc = build(SyncConfig, cfg.rollout, timeout_s=30.0)
    assert (sc.zero_copy_weights, sc.sync_bucket_mb, sc.sync_transport, sc.timeout_s) == (True, 8.0, "gloo", 30.0)
    assert build(SyncConfig, load_config("configs/grpo_tiny.yaml", []).rollout).zero_copy_weights is False


def test_shm_layout_keeps_fused_weights_back_to_back():
    """q/k/v (weights and biases) and gate/up follow each other without padding, so the engine's fused
    tensors are views of the file (zero copy needs that); every other tensor starts aligned."""
    from workers.rollout.cpu.shm_file import ALIGN, ShmLayout

    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (33, 8), p + "self_attn.q_proj.weight": (8, 8),
              p + "self_attn.k_proj.weight": (3, 8), p + "self_attn.v_proj.weight": (3, 8),
              p + "mlp.gate_proj.weight": (5, 8), p + "mlp.up_proj.weight": (5, 8),
              p + "self_attn.q_proj.bias": (8,), p + "self_attn.k_proj.bias": (3,), p + "self_attn.v_proj.bias": (3,),
              "model.norm.weight": (8,)}
    lay = ShmLayout.from_shapes(shapes, "float32")
    off = dict(zip(lay.names, lay.offsets))
    for a, b in [("q_proj", "k_proj"), ("k_proj", "v_proj")]:
        for kind, size in [("weight", 8 * 4), ("bias", 4)]:
            n = shapes[p + f"self_attn.{a}.{kind}"][0]
            assert off[p + f"self_attn.{b}.{kind}"] == off[p + f"self_attn.{a}.{kind}"] + n * size
    assert off[p + "mlp.up_proj.weight"] == off[p + "mlp.gate_proj.weight"] + 5 * 8 * 4
    for name in ("model.embed_tokens.weight", p + "self_attn.q_proj.weight", p + "mlp.gate_proj.weight",
                 p + "self_attn.q_proj.bias", "model.norm.weight"):
        assert off[name] % ALIGN == 0
    assert lay.nbytes % ALIGN == 0 and lay.nbytes >= off["model.norm.weight"] + 8 * 4


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_tp_shard_written_in_place_rebuilds_the_hf_tensors(tp):
    """shard_into_hf is the inverse of to_mcore_shard: every rank writing its shard = the gathered to_hf."""
    from workers.megatron.hf_map import (
        COLUMN,
        FC1,
        QKV,
        REPLICATED,
        ROW,
        VOCAB,
        Dims,
        shard_into_hf,
        to_hf,
        to_mcore_shard,
    )

    d = Dims(hidden=8, heads=8, groups=4, head_dim=4, ffn=12, vocab=10, layers=1, tied=False, qkv_bias=True)
    g = torch.Generator().manual_seed(0)
    q, kv = d.heads * d.head_dim, d.groups * d.head_dim
    cases = {
        REPLICATED: [(8,)], COLUMN: [(12, 8)], ROW: [(8, 12)], VOCAB: [(10, 8)],
        QKV: [(q, 8), (kv, 8), (kv, 8)], FC1: [(12, 8), (12, 8)],
    }
    padded = 16  # vocab rounded up to a multiple of tp (x a Megatron divisor)
    for kind, shapes in cases.items():
        full = [torch.randn(*s, generator=g) for s in shapes]
        shards = [to_mcore_shard(kind, full, d, r, tp, padded) for r in range(tp)]
        out = [torch.full(s, float("nan"), dtype=torch.bfloat16) for s in shapes]
        written = 0
        for r in range(tp if kind != REPLICATED else 1):
            written += shard_into_hf(kind, shards[r], out, d, r, tp)
        assert written == sum(t.numel() for t in full), kind
        for got, want in zip(out, full):
            assert torch.equal(got, want.to(torch.bfloat16)), kind
        if kind != VOCAB:  # the gather path gives the same tensors
            for got, want in zip(to_hf(kind, shards, d), full):
                assert torch.equal(got, want), kind
    # QKV bias (1-D) too
    full = [torch.randn(n, generator=g) for n in (q, kv, kv)]
    out = [torch.empty_like(t) for t in full]
    for r in range(tp):
        shard_into_hf(QKV, to_mcore_shard(QKV, full, d, r, tp, padded), out, d, r, tp)
    assert all(torch.equal(a, b) for a, b in zip(out, full))


def test_shm_layout_views_and_stale_files(tmp_path):
    import os
    import pickle

    from workers.rollout.cpu import shm_file as shm

    shapes = {"a.weight": (3, 5), "b.bias": (7,), "c.weight": (2, 2)}
    layout = shm.ShmLayout.from_shapes(shapes, "bfloat16")
    assert layout.offsets == [0, 256, 512] and layout.nbytes == 768
    path = str(tmp_path / "w.bin")
    m = shm.open_mapping(path, layout.nbytes, create=True)
    assert shm.open_mapping(path, layout.nbytes, create=True) is m  # cached: pages stay warm
    layout.view(m, "b.bias").copy_(torch.arange(7.0))
    other = shm.ShmLayout.from_shapes(shapes, "bfloat16")
    fresh = torch.from_file(path, shared=True, size=layout.nbytes, dtype=torch.uint8)  # another mapping
    got = dict(pickle.loads(pickle.dumps(other)).items(fresh))
    assert list(got) == list(shapes) and got["a.weight"].shape == (3, 5)
    assert torch.equal(got["b.bias"], torch.arange(7.0, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="needs"):
        shm._MAPS.pop(path)
        shm.open_mapping(path, 4096, create=False)
    shm.remove_file(path)
    assert not os.path.exists(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        shm.open_mapping(path, 16, create=False)
    dead = tmp_path / f"{shm.PREFIX}999999999-x.bin"  # no such pid
    mine = tmp_path / f"{shm.PREFIX}{os.getpid()}-y.bin"
    dead.write_bytes(b"x")
    mine.write_bytes(b"x")
    assert shm.remove_stale_files(str(tmp_path)) == [str(dead)]
    assert mine.exists()


def _fake_weights(layers: int = 3) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = [("model.embed_tokens.weight", torch.randn(50, 8, generator=g))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", torch.randn(8, generator=g))]
        out += [(p + f"self_attn.{x}_proj.weight", torch.randn(8, 8, generator=g)) for x in "qkvo"]
        out += [(p + f"mlp.{x}_proj.weight", torch.randn(16, 8, generator=g)) for x in ("gate", "up")]
        out += [(p + "mlp.down_proj.weight", torch.randn(8, 16, generator=g))]
    out += [("model.norm.weight", torch.randn(8, generator=g)), ("lm_head.weight", torch.randn(50, 8, generator=g))]
    return out


def test_group_key_keeps_fused_modules_together():
    assert group_key("model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn"
    assert group_key("model.layers.3.self_attn.v_proj.bias") == "model.layers.3.self_attn"
    assert group_key("model.layers.3.mlp.gate_proj.weight") == "model.layers.3.mlp"
    assert group_key("model.embed_tokens.weight") == "model.embed_tokens"
    assert group_key("lm_head.weight") == "lm_head"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_buckets_round_trip_bounded_and_whole_groups(dtype):
    weights = _fake_weights()
    bucket_bytes = 1200 * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    packer = BucketPacker(bucket_bytes, dtype)
    got, groups_per_bucket = {}, []
    for buf, meta in packer.buckets(iter(weights)):
        assert meta.numel <= 1200 or len({group_key(n) for n in meta.names}) == 1  # oversize only alone
        groups_per_bucket.append({group_key(n) for n in meta.names})
        got.update({k: v.clone() for k, v in unpack(buf.clone(), meta)})
    assert list(got) == [n for n, _ in weights]
    for name, t in weights:
        assert torch.equal(got[name], t.to(getattr(torch, dtype))), name
    seen: set[str] = set()
    for groups in groups_per_bucket:  # no group straddles two buckets
        assert not (groups & seen)
        seen |= groups
    assert packer.num_buckets == len(groups_per_bucket) > 1
    assert packer.max_bucket_bytes <= max(bucket_bytes, 2 * 16 * 8 * 4 + 8 * 16 * 4)


def test_prompts_normalise_chat_text_and_ids(tiny_model_factory):
    from transformers import AutoTokenizer

    from workers.batch import Batch
    from workers.rollout.prompts import normalise

    tok = AutoTokenizer.from_pretrained(tiny_model_factory("tiny-qwen2"))
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    chat = normalise(Batch(meta={"prompt": [msgs, "plain text"], "ground_truth": ["5", "x"]}), tok)
    expect = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    expect = expect["input_ids"] if isinstance(expect, dict) or hasattr(expect, "keys") else expect
    assert chat.ids[0] == list(expect)
    assert chat.text[0].endswith("<|im_start|>assistant\n")
    assert chat.ids[1] == tok("plain text")["input_ids"]
    ids = normalise([[5, 6, 7]], tok)
    assert ids.ids == [[5, 6, 7]] and isinstance(ids.text[0], str)
    with pytest.raises(ValueError, match="meta fields"):
        normalise(Batch(meta={"question": ["x"]}), tok)


def test_receive_buffers_are_reused_only_when_no_view_lives():
    from workers.rollout.buckets import BucketMeta, BufferPool

    pool = BufferPool()
    meta = BucketMeta(0, "float32", ["a", "b"], [(2, 2), (3,)], [0, 4], 7)
    first = pool.get(7, torch.float32, "cpu")
    held = dict(pool.views(first, meta))  # vLLM still holds these views
    second = pool.get(7, torch.float32, "cpu")
    assert second.data_ptr() != first.data_ptr()
    del held
    list(pool.views(second, meta))  # views consumed and dropped at once
    third = pool.get(5, torch.float32, "cpu")
    assert third.data_ptr() in (first.data_ptr(), second.data_ptr()) and third.numel() == 5


def test_engines_share_the_model_info_cache_and_nothing_else(tmp_path, monkeypatch):
    """Each engine gets a fresh cache folder whose `modelinfos` is the user's persistent one, so vLLM's model-class
    inspection (a fresh interpreter, ~20 s on 2 cores) runs once, not at every engine start."""
    from workers.rollout import config as rc

    shared = tmp_path / "home" / "vllm-modelinfos"
    monkeypatch.setattr(rc, "MODELINFO_CACHE", shared)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # prepare_env sets process-wide variables: undo them
    roots = []
    for name in ("a", "b"):
        os.environ.pop("VLLM_CACHE_ROOT", None)
        work = rc.prepare_env(rc.EngineConfig(model_path="unused", work_dir=str(tmp_path / name)))
        roots.append(Path(os.environ["VLLM_CACHE_ROOT"]))
        assert roots[-1] == Path(work) / "vllm_cache"
    (shared / "x.json").write_text("{}")
    assert roots[0] != roots[1] and all((r / "modelinfos" / "x.json").is_file() for r in roots)
    os.environ["VLLM_CACHE_ROOT"] = str(tmp_path / "mine")  # the user's own choice is kept as it is
    rc.prepare_env(rc.EngineConfig(model_path="unused", work_dir=str(tmp_path / "c")))
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "mine") and not (tmp_path / "mine").exists()


def rollout_part(prompts: list[list[int]], responses: list[list[int]]) -> Batch:
    """A generate Batch laid out as the engine's: prompts left-padded, responses right-padded."""
    p, r = max(map(len, prompts)), max(map(len, responses))
    ids = torch.full((len(prompts), p + r), 9)
    attn = torch.zeros_like(ids)
    for i, (q, a) in enumerate(zip(prompts, responses)):
        ids[i, p - len(q):p], ids[i, p:p + len(a)] = torch.tensor(q), torch.tensor(a)
        attn[i, p - len(q):p + len(a)] = 1
    routes = torch.where(attn.bool()[..., None, None], ids[..., None, None], -1).expand(-1, -1, 2, 1)
    return Batch({"input_ids": ids, "attention_mask": attn, "responses": ids[:, p:].clone(),
                  "response_mask": attn[:, p:].clone(), "rollout_logprobs": -attn[:, p:].float(),
                  "routed_experts": routes.clone(), "scores": torch.ones(len(prompts))},
                 meta={"group_id": list(range(len(prompts)))})


def test_concat_rollouts_keeps_every_response_where_the_trainer_looks_for_it():
    from workers.rollout.prompts import concat_rollouts

    a = rollout_part([[1, 2], [3]], [[10, 11, 12], [13]])            # P = 2, R = 3
    b = rollout_part([[4, 5, 6, 7]], [[20]])                         # P = 4, R = 1
    out = concat_rollouts([a, b])
    p = out["input_ids"].shape[1] - out["responses"].shape[1]
    assert (p, out["responses"].shape[1]) == (4, 3)
    for row, (prompt, response) in enumerate([([1, 2], [10, 11, 12]), ([3], [13]), ([4, 5, 6, 7], [20])]):
        ids, attn = out["input_ids"][row], out["attention_mask"][row]
        assert ids[attn.bool()].tolist() == prompt + response
        assert ids[p - len(prompt):p].tolist() == prompt and ids[p:p + len(response)].tolist() == response
        assert out["responses"][row, :len(response)].tolist() == response
        assert int(out["response_mask"][row].sum()) == len(response)
        assert out["routed_experts"][row, :, 0, 0].tolist() == torch.where(attn.bool(), ids, -1).tolist()
    assert out["rollout_logprobs"][0].tolist() == [-1, -1, -1] and out["rollout_logprobs"][2].tolist() == [-1, 0, 0]
    assert out["scores"].tolist() == [1, 1, 1] and out["group_id"] == [0, 1, 0]
    assert concat_rollouts([a]) is a and len(concat_rollouts([a, b.index(slice(0, 0))])) == 2


def test_prompts_spread_by_tokens_in_flight():
    from workers.rollout.group import prompt_cost, split_by_load

    assert split_by_load([1.0] * 4, [0.0, 0.0]) == [0, 2, 4]  # idle engines: the even split
    assert split_by_load([1.0] * 3, [1.0, 0.0]) == [0, 1, 3]  # engine 0 busy: engine 1 takes more
    assert split_by_load([1.0] * 2, [10.0, 0.0]) == [0, 0, 2]  # far busier: nothing for it
    assert split_by_load([5.0, 1.0], [0.0, 0.0]) == [0, 1, 2]  # one long prompt: still one each
    assert split_by_load([1.0] * 6, [0.0, 0.0, 0.0]) == [0, 2, 4, 6]
    sp = SamplingConfig(n=4, max_tokens=8)
    b = Batch(meta={"prompt_ids": [[1, 2, 3], [4]]})
    assert [prompt_cost(b, i, sp) for i in range(2)] == [3 + 32, 1 + 32]
    chat = Batch(meta={"messages": [[{"role": "user", "content": "x" * 40}]]})
    assert prompt_cost(chat, 0, sp) == 40 // 4 + 1 + 32
