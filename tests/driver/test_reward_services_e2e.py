"""Two-step GRPO runs (configs/grpo_tiny.yaml, the e2e tests' fast settings) whose rewards come from a service:
a verifier over HTTP (`reward.url`, a real server in this process) and an LLM judge on engines of its own
(`reward.judge`, a tiny judge whose verdicts are known: tests/helpers/judge_model.py). Each checks that the
scores the run logged are the service's, and that reward.fn still gives validation's accuracy."""

from __future__ import annotations

import json
import threading

import pytest

from tests.helpers.cli import FAST
from tests.helpers.cli import rlhf_in_process as rlhf
from tests.helpers.judge_model import planted_judge
from tests.helpers.runs import metrics
from tests.helpers.verifier import length_score, verifier

pytestmark = pytest.mark.usefixtures("ray_session")

# no warm start (what the policy answers does not matter here), validation at step 0 and after the last step
RUN = [*FAST, "model.warm_start_steps=0", "trainer.val_every=0", "trainer.total_steps=2", "trainer.export_hf=false",
       "trainer.save_every=0"]
BATCH = 16  # FAST: 4 prompts x 4 samples a step, 16 validation prompts


def test_grpo_scores_with_a_remote_verifier(tmp_path):
    replied: list[float] = []
    lock = threading.Lock()

    def reply(body, n):
        scores = [length_score(s) for s in body["samples"]]
        with lock:
            replied.extend(scores)
        return 200, json.dumps({"scores": scores}).encode(), 0.0

    run = tmp_path / "run"
    with verifier(reply) as v:
        r = rlhf("train", "configs/grpo_tiny.yaml", *RUN, f"reward.url={v.url}", "reward.batch_size=6",
                 "reward.max_concurrency=2", f"trainer.output_dir={run}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rows = metrics(run)
    steps = [row for row in rows if row["step"] > 0]
    vals = [row for row in rows if "val/reward_mean" in row]
    assert [row["step"] for row in steps] == [1, 2] and vals
    for row in steps:  # 1000 + the response's length: the verifier's score, no rule's
        assert row["reward_mean"] >= 1000 and row["reward/errors"] == row["reward/timeouts"] == 0, row
    for row in vals:
        assert row["val/reward_mean"] >= 1000 and 0 <= row["val/accuracy"] <= 1, row  # accuracy: reward.fn's rule
    # every sample the run scored went to the verifier, in requests of at most 6, and its scores are the run's
    assert sum(v.batch_sizes) == BATCH * (len(steps) + len(vals)) and max(v.batch_sizes) <= 6
    logged = sum(row["reward_mean"] for row in steps) + sum(row["val/reward_mean"] for row in vals)
    assert abs(logged * BATCH - sum(replied)) < 1e-2 * len(replied)


# `slow` (41 s in make test): the judge's prompt, parsing and scores stay covered by test_reward_judge.py
@pytest.mark.slow
def test_grpo_scores_with_an_llm_judge(tmp_path, tiny_model_factory):
    """The judge answers "Score: 9" to a response whose last token has an even id (or is 0-4) and nothing
    (malformed: the fallback -1, counted) to any other, so 16 samples with m malformed verdicts have the mean reward (9 (16 - m) - m) / 16:
    each mean the run logged (the step's, and validation's after the last step) gives a whole m, and the
    malformed verdicts counted are their sum."""
    judge = planted_judge(tmp_path / "judge", base=tiny_model_factory("tiny-llama"), even_ids=True)
    run = tmp_path / "run"
    r = rlhf("train", "configs/grpo_tiny.yaml", *RUN, f"reward.judge.model_path={judge}", "reward.judge.chat=false",
             "reward.judge.prompt_template=Judge {response}", "reward.judge.max_tokens=8",
             "reward.judge.num_cpus=0.5", "reward.judge.kv_cache_gb=0.05", "reward.fallback_score=-1",
             f"trainer.output_dir={run}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rows = metrics(run)
    steps = [row for row in rows if row["step"] > 0]
    assert [row["step"] for row in steps] == [1, 2]

    def malformed(mean: float) -> int:
        m = (9 * BATCH - BATCH * mean) / 10
        assert abs(m - round(m)) < 1e-4 and 0 <= round(m) <= BATCH, mean  # only the judge's 9 and -1 give this
        return round(m)

    parsed = 0
    for row in rows:
        means = [row[k] for k in ("reward_mean", "val/reward_mean") if k in row]
        assert row["reward/judge_malformed"] == sum(malformed(x) for x in means), row
        parsed += BATCH * len(means) - row["reward/judge_malformed"]
    assert parsed > 0  # some verdicts were read
    for row in steps:
        assert row["time/judge"] > 0 and row["time/reward"] > 0, row
    assert (run / "logs" / "judge" / "0.log").is_file()
