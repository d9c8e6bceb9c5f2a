"""Policy groups at TP=2, PP=2 and DP=2 against TP=1 on the same weights (real Ray, real megatron-core).

One Ray session and one group per layout for the whole module; the tests run in file order and share
the groups (the train step changes their weights, so the logprob check comes first).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.helpers.batches import hf_logprobs, hf_response_logits, make_rl_batch
from tests.helpers.layouts import ray_groups
from workers.group import WorkerDiedError, WorkerGroup
from workers.roles import PolicyWorker, fetch_state_dict
from workers.roles.lm import lm_batch_from_rl

LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "dp2": (1, 1, 2)}
OPTIM = {"lr": 1e-4, "clip_grad": 1.0, "weight_decay": 0.0}  # Adam amplifies tiny grad noise by lr/eps
DIST_OPT = {"tp1", "dp2"}  # these two use megatron's distributed optimizer, tp2 / pp2 the plain one


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_factory):
    path = tiny_model_factory("tiny-qwen2")
    log_dir = tmp_path_factory.mktemp("logs")
    with ray_groups() as groups:
        for name, (tp, pp, dp) in LAYOUTS.items():
            groups[name] = WorkerGroup(
                "policy", PolicyWorker, tp=tp, pp=pp, dp=dp, name=f"policy-{name}", num_cpus_per_worker=0.5,
                timeout_s=120, log_dir=log_dir,
                init_kwargs={"model_path": path, "micro_batch_size": 4,
                             "optim": {**OPTIM, "use_distributed_optimizer": name in DIST_OPT}},
            )
        yield {"path": path, "groups": groups, "tmp": tmp_path_factory.mktemp("ckpt")}


def test_logprobs_match_across_layouts(env):
    batch = make_rl_batch(n=10, seed=1)
    ref = hf_logprobs(env["path"], batch)
    base = env["groups"]["tp1"].compute_logprobs(batch, with_entropy=True)
    assert base["logprobs"].shape == batch["responses"].shape
    assert (base["logprobs"] - ref).abs().max() < 1e-4  # megatron vs transformers
    assert (base["entropy"] > 0).sum() == batch["response_mask"].sum()
    for name in ("tp2", "pp2", "dp2"):
        out = env["groups"][name].compute_logprobs(batch, with_entropy=True, micro_batch_size=3)
        assert (out["logprobs"] - base["logprobs"]).abs().max() <= 1e-5, name
        assert (out["entropy"] - base["entropy"]).abs().max() <= 1e-5, name


def test_logprobs_at_the_sampling_temperature(env):
    batch = make_rl_batch(n=6, seed=3)
    ref = hf_logprobs(env["path"], batch, temperature=0.7)
    assert (ref - hf_logprobs(env["path"], batch)).abs().max() > 1e-2  # the temperature changes them
    for name in ("tp1", "tp2"):
        out = env["groups"][name].compute_logprobs(batch, temperature=0.7)
        assert (out["logprobs"] - ref).abs().max() < 1e-4, name


def test_greedy_token_ids_match_transformers_across_layouts(env):
    """`top1_key` (a distillation teacher's greedy picks): each response position's argmax over the whole
    vocabulary, the same at TP=2 (each rank holds half the vocab) and PP=2 as in transformers."""
    batch = make_rl_batch(n=6, seed=4)
    mask = batch["response_mask"].bool()
    ref = hf_response_logits(env["path"], batch).argmax(-1)
    assert ref[mask].unique().numel() > 1  # positions pick different tokens: an id mix-up would show
    for name in ("tp1", "tp2", "pp2"):
        out = env["groups"][name].compute_logprobs(batch, temperature=0.7, top1_key="top1")
        assert torch.equal(out["top1"].long()[mask], ref[mask]), name


def test_async_call(env):
    batch = make_rl_batch(n=4, seed=2)
    futures = [env["groups"][n].compute_logprobs.remote(batch) for n in ("tp1", "tp2")]
    a, b = (f.get() for f in futures)
    assert (a["logprobs"] - b["logprobs"]).abs().max() <= 1e-5


def test_train_step_same_update_across_layouts(env):
    batch = make_rl_batch(n=8, seed=3)
    batch["old_logprobs"] = env["groups"]["tp1"].compute_logprobs(batch)["logprobs"]
    loss_cfg = {"clip_low": 0.2, "clip_high": 0.28, "mini_batches": 2, "entropy_coef": 0.01}
    micro = {"tp1": 4, "tp2": 1, "pp2": 2, "dp2": 3}  # different micro-batch counts per layout
    metrics, weights = {}, {}
    initial = fetch_state_dict(env["groups"]["tp1"].state_dict_for_rollout())
    for name, g in env["groups"].items():
        metrics[name] = g.train_step(batch, loss_cfg, micro_batch_size=micro[name])
        weights[name] = fetch_state_dict(g.state_dict_for_rollout(bucket_mb=1.0))
    base = weights["tp1"]
    assert metrics["tp1"]["num_steps"] == 2 and metrics["tp1"]["skipped_steps"] == 0
    assert max((base[k] - initial[k]).abs().max().item() for k in base) > 5e-5  # the steps did move the weights
    for name in ("tp2", "pp2", "dp2"):
        assert weights[name].keys() == base.keys(), name
        diff = max((weights[name][k] - base[k]).abs().max().item() for k in base)
        print(f"{name}: max |param - tp1 param| = {diff:.2e}")
        assert diff <= 1e-5, (name, diff)
        for key in ("loss", "grad_norm", "clipfrac"):
            assert metrics[name][key] == pytest.approx(metrics["tp1"][key], rel=1e-5, abs=1e-6), (name, key)


def test_old_logprobs_in_update_match_a_recompute_pass(env, tmp_path):
    """`old_logprobs=in_update` (the update's own forward, detached) makes the update a recomputing pass and
    the driver's truncated-IS correction make, and logs the same `mismatch/*` and `off_policy/*`."""
    from algorithms import logprob_mismatch, rollout_correction

    g = env["groups"]["tp2"]
    batch = make_rl_batch(n=8, seed=11)
    mask = batch["response_mask"]
    g.save_checkpoint(str(tmp_path / "ckpt"))
    old = g.compute_logprobs(batch)["logprobs"]
    shift = 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0))
    batch["rollout_logprobs"] = (old + shift) * mask  # samples of an older policy
    weights, _, om = rollout_correction(old, batch["rollout_logprobs"], mask, "tis", cap=1.5)
    loss = {"clip_low": 0.2, "clip_high": 0.28, "off_policy_correction": "tis", "is_cap": 1.5}
    driver = batch.select(["input_ids", "attention_mask", "responses", "response_mask"])
    driver["old_logprobs"], driver["advantages"] = old, batch["advantages"] * weights
    ref = g.train_step(driver, {**loss, "old_logprobs": "recompute"})
    w_ref = fetch_state_dict(g.state_dict_for_rollout())
    g.load_checkpoint(str(tmp_path / "ckpt"))
    got = g.train_step(batch, {**loss, "old_logprobs": "in_update"})
    w_got = fetch_state_dict(g.state_dict_for_rollout())
    assert max((w_got[k] - w_ref[k]).abs().max().item() for k in w_ref) <= 1e-5
    for key in ("loss", "pg_loss", "grad_norm"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    assert 0 < om["capped_fraction"] < 1  # the cap did bite
    for key in ("is_ratio_mean", "is_ratio_max", "capped_fraction"):
        assert got[f"off_policy/{key}"] == pytest.approx(om[key], rel=1e-4), key
    mis = logprob_mismatch(batch["rollout_logprobs"], old, mask)
    for key in ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl"):
        assert got[f"mismatch/{key}"] == pytest.approx(mis[key], rel=1e-4), key


def test_recompute_with_the_engines_logprobs_corrects_in_the_update_as_the_driver_did(env, tmp_path):
    """`old_logprobs=recompute` with the engine's log-probs in the batch: the update applies MIS (mask and
    normaliser narrowed) and logs `mismatch/*` and `off_policy/*` itself; the same weights, bit for bit, as a
    batch the driver corrected (advantages weighted, mask narrowed) without the engine's log-probs."""
    from algorithms import logprob_mismatch, rollout_correction

    g = env["groups"]["dp2"]
    batch = make_rl_batch(n=8, seed=12)
    mask = batch["response_mask"]
    g.save_checkpoint(str(tmp_path / "ckpt"))
    batch["old_logprobs"] = old = g.compute_logprobs(batch)["logprobs"]
    shift = 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    batch["rollout_logprobs"] = (old + shift) * mask
    weights, keep, om = rollout_correction(old, batch["rollout_logprobs"], mask, "mis_token", low=0.6, high=1.6)
    loss = {"clip_low": 0.2, "clip_high": 0.28, "off_policy_correction": "mis_token", "is_low": 0.6, "is_high": 1.6,
            "old_logprobs": "recompute"}
    driver = batch.select(["input_ids", "attention_mask", "responses", "old_logprobs"])
    driver["advantages"], driver["response_mask"] = batch["advantages"] * weights, keep
    ref = g.train_step(driver, loss, micro_batch_size=3)
    w_ref = fetch_state_dict(g.state_dict_for_rollout())
    g.load_checkpoint(str(tmp_path / "ckpt"))
    got = g.train_step(batch, loss, micro_batch_size=3)
    w_got = fetch_state_dict(g.state_dict_for_rollout())
    assert all(torch.equal(w_got[k], w_ref[k]) for k in w_ref)
    assert 0 < om["masked_fraction"] < 1  # the band did drop tokens
    for key in ("loss", "pg_loss", "grad_norm", "tokens", "clipfrac"):
        assert got[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-9), key
    for key, value in om.items():
        assert got[f"off_policy/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for key, value in logprob_mismatch(batch["rollout_logprobs"], old, mask).items():
        assert got[f"mismatch/{key}"] == pytest.approx(value, rel=1e-5), key


def test_checkpoint_round_trip_and_reshard(env, tmp_path):
    tp1, tp2 = env["groups"]["tp1"], env["groups"]["pp2"]
    batch = make_rl_batch(n=8, seed=4)
    batch["old_logprobs"] = tp1.compute_logprobs(batch)["logprobs"]
    ckpt = str(tmp_path / "ckpt")
    tp1.save_checkpoint(ckpt)
    saved = tp1.compute_logprobs(batch)["logprobs"]
    after_one = tp1.train_step(batch, {})
    w1 = fetch_state_dict(tp1.state_dict_for_rollout())
    meta = tp1.load_checkpoint(ckpt)
    assert meta["layout"] == {"tp": 1, "pp": 1, "dp": 1, "ep": 1, "cp": 1}
    assert (tp1.compute_logprobs(batch)["logprobs"] - saved).abs().max() == 0
    again = tp1.train_step(batch, {})  # optimizer + scheduler state restored: the same step again
    w2 = fetch_state_dict(tp1.state_dict_for_rollout())
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 1e-6
    assert again["grad_norm"] == pytest.approx(after_one["grad_norm"], rel=1e-5)
    tp2.load_checkpoint(ckpt, load_optimizer=False)  # a TP1 checkpoint into a PP2 layout
    assert (tp2.compute_logprobs(batch)["logprobs"] - saved).abs().max() <= 1e-5


def test_distributed_optimizer_checkpoint_loads_at_another_dp(env, tmp_path):
    dp2, tp1 = env["groups"]["dp2"], env["groups"]["tp1"]
    batch = make_rl_batch(n=8, seed=8)
    batch["old_logprobs"] = dp2.compute_logprobs(batch)["logprobs"]
    dp2.save_checkpoint(str(tmp_path / "dp2"))
    meta = tp1.load_checkpoint(str(tmp_path / "dp2"))  # model + distributed optimizer state, DP 2 -> 1
    assert meta["layout"]["dp"] == 2
    for g in (dp2, tp1):
        g.train_step(batch, {"mini_batches": 2})
    a, b = (fetch_state_dict(g.state_dict_for_rollout()) for g in (dp2, tp1))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5


def test_hf_export_from_pp2_reloads_in_transformers(env, tmp_path):
    g = env["groups"]["pp2"]
    batch = make_rl_batch(n=6, seed=9)
    out = g.save_hf_weights(str(tmp_path / "hf"))
    ours = g.compute_logprobs(batch)["logprobs"]
    assert (hf_logprobs(out, batch) - ours).abs().max() <= 1e-4


def test_nonfinite_step_is_skipped(env):
    g = env["groups"]["dp2"]
    batch = make_rl_batch(n=4, seed=5)
    batch["old_logprobs"] = g.compute_logprobs(batch)["logprobs"]
    before = fetch_state_dict(g.state_dict_for_rollout())
    bad = batch.index(list(range(4)))
    bad["advantages"] = torch.full_like(batch["advantages"], float("nan"))
    m = g.train_step(bad, {})
    assert m["skipped_steps"] == 1 and m["grad_norm"] != m["grad_norm"]  # NaN norm reported
    after = fetch_state_dict(g.state_dict_for_rollout())
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_train_lm_step_lowers_loss(env):
    g = env["groups"]["tp2"]
    batch = make_rl_batch(n=8, seed=6)
    lm = lm_batch_from_rl(batch.select(["input_ids", "attention_mask"]))
    losses = [g.train_lm_step(lm)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]


def test_dead_rank_fails_fast_with_identity(env):
    g = env["groups"]["dp2"]
    victim = g.infos[1]
    os.kill(victim["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as err:
        g.compute_logprobs(make_rl_batch(n=4, seed=7))
    assert time.monotonic() - t0 < 60  # noticed, not timed out (the group's timeout is 120 s)
    msg = str(err.value)
    assert "role 'policy'" in msg and "rank 1" in msg and victim["name"] in msg and victim["node_ip"] in msg
    # The message carries the tail of the dead rank's own log (earlier tests in this module may have pushed
    # its 'started' line out of the 20-line tail, so compare against the file's last line instead).
    log_lines = g.log_path(1).read_text().splitlines()
    assert "started: pid" in log_lines[0] and "last log lines" in msg and log_lines[-1] in msg
