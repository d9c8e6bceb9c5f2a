"""`AgentRollout`: the rollout of `rollout.openai_agent`, a user's agent written against the `openai` client.

For each prompt record, n sessions: each gets a bearer token of its own on the run's OpenAI-compatible
endpoint (workers/endpoint/, on 127.0.0.1 in this process: the agents run on this node), and the agent
`run(client, task)` runs in a process of a `RewardPool` in agent mode (never in the driver), within
`rollout.agent_timeout_s`. Once every session returned (or was ended), the sessions close and their recorded
completions become the training rows (workers/endpoint/trajectory.py: one row per conversation, the agent's
own context masked; a call that rewrites the history starts another row), each row tagged with its prompt's
`group_id`, so GRPO's groups are the n sessions of a prompt. A session's reward is what `run` returned; None:
`reward.fn` scores the session's last answer. A session whose agent raised, hung past its timeout or made no
completion gives no rows (counted: `agent/session_errors`, `agent/session_timeouts`, `agent/sessions_empty`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from rlhf.config.schema import RolloutConfig, RunConfig
from rlhf.driver.rl.reward_pool import RewardPool
from rlhf.errors import UserError
from workers.batch import Batch
from workers.config import build
from workers.endpoint.server import Endpoint
from workers.endpoint.trajectory import Trajectory, trajectories
from workers.rollout.prompts import Prompts, build_output
from workers.rollout.sampling import SamplingConfig

log = logging.getLogger(__name__)

FIELD = "rollout.openai_agent"


def agent_pool(r: RolloutConfig, workers: int | None = None) -> RewardPool:
    assert r.openai_agent
    return RewardPool(r.openai_agent, r.agent_workers if workers is None else workers, r.agent_timeout_s,
                      r.agent_memory_mb, mode="agent", field=FIELD)


def check_agent_fn(r: RolloutConfig) -> None:
    """Fail fast, with the reason, when `rollout.openai_agent` does not load (imported in an agent process)."""
    pool = agent_pool(r, 1)
    try:
        pool.start()
    finally:
        pool.shutdown()


def _task(record: dict[str, Any]) -> dict[str, Any]:
    """What the agent gets of a prompt record: its JSON fields (images stay behind)."""
    return {k: v for k, v in record.items() if k != "images"}


class AgentRollout:
    """The endpoint over `group`'s engines and the agent processes; `run` gives a generate-shaped Batch."""

    def __init__(self, cfg: RunConfig, group: Any) -> None:
        from transformers import AutoTokenizer

        r = cfg.rollout
        self.cfg, self.group = r, group
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        self.sampling = build(SamplingConfig, r).validate().with_(n=1)
        self.version = 0
        self.endpoint = Endpoint(self._sample, self.tokenizer, lambda: self.version, max_tokens=r.max_tokens,
                                 max_model_len=int(group.infos[0]["max_model_len"]),
                                 request_timeout_s=r.agent_timeout_s).start()
        self.pool = agent_pool(r)
        print(f"openai agent {r.openai_agent}: endpoint {self.endpoint.base_url} (one bearer token per session)",
              flush=True)

    def _sample(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.group.complete(requests, self.sampling)

    def run(self, prompts: list[dict[str, Any]], sampling: SamplingConfig, score: Callable[[Batch], Batch] | None,
            version: int) -> Batch:
        """n = `sampling.n` sessions per prompt record, sampled with `sampling` (its temperature: validation's
        greedy decoding too); `score` (the run's reward) scores the sessions whose agent returned None."""
        if isinstance(prompts, Batch):
            raise TypeError("rollout.openai_agent: the agent rollout takes prompt records, not a Batch")
        t0 = time.perf_counter()
        self.sampling, self.version = sampling.with_(n=1), version
        opened = []
        for i in range(len(prompts)):
            for j in range(sampling.n):
                session, token = self.endpoint.open_session(f"{i}-{j}", self.cfg.max_turns, self.cfg.max_total_tokens)
                opened.append((i, session, token))
        refused_before = sum(self.endpoint.refused.values())
        try:
            outcomes = self.pool.score([(self.endpoint.base_url, token, self.cfg.agent_timeout_s, _task(prompts[i]))
                                        for i, _, token in opened])
        finally:
            for _, _, token in opened:
                self.endpoint.close_session(token)
        rows: list[Trajectory] = []
        groups, sessions, rewards = [], [], []
        counts = {"error": 0, "timeout": 0, "empty": 0, "none": 0}
        first_failure = ""
        for k, ((i, session, _), out) in enumerate(zip(opened, outcomes)):
            if out.kind in ("error", "timeout"):
                counts[out.kind] += 1
                first_failure = first_failure or f"session {session.id}: {out.message}"
                continue
            trajs = trajectories(session.completions)
            if not trajs:
                counts["empty"] += 1
                continue
            counts["none"] += out.kind == "none"
            rows += trajs
            groups += [i] * len(trajs)
            sessions += [k] * len(trajs)
            rewards += [out.value] * len(trajs)
        if first_failure:
            log.warning("%s: %d agent session(s) failed, %d timed out; first: %s", FIELD, counts["error"],
                        counts["timeout"], first_failure)
        if not rows:
            raise UserError(f"{FIELD}: none of the {len(opened)} agent sessions gave a completion to train on"
                            + (f" (first failure: {first_failure})" if first_failure else ""))
        batch = self._batch(rows, prompts, groups)
        batch["scores"] = self._scores(batch, rewards, sessions, score)
        batch.info.update({
            "agent/sessions": float(len(opened)), "agent/session_errors": float(counts["error"]),
            "agent/session_timeouts": float(counts["timeout"]), "agent/sessions_empty": float(counts["empty"]),
            "agent/reward_by_fn": float(counts["none"]),
            "agent/calls_per_session": sum(len(s.completions) for _, s, _ in opened) / len(opened),
            "agent/rows_per_session": len(rows) / max(len(set(sessions)), 1),
            "agent/endpoint_refusals": float(sum(self.endpoint.refused.values()) - refused_before),
            "rollout/total_s": time.perf_counter() - t0,
            "rollout/response_tokens": int(batch["response_mask"].sum()),
        })
        return batch

    def _batch(self, rows: list[Trajectory], prompts: list[dict[str, Any]], groups: list[int]) -> Batch:
        """The rows as a generate Batch, from the recorded ids; `group_id` the prompt's, `policy_version` the
        oldest of the row's calls."""
        source = Batch(meta={"ground_truth": [prompts[g].get("ground_truth") for g in groups]})
        text = self.tokenizer.batch_decode([t.prompt_ids for t in rows])
        batch = build_output(Prompts([t.prompt_ids for t in rows], text, source), [[t] for t in rows], 1, self.pad_id)
        batch.meta["group_id"] = list(groups)
        batch.meta["policy_version"] = [min(t.versions) for t in rows]
        return batch

    @staticmethod
    def _scores(batch: Batch, rewards: list[float | None], sessions: list[int],
                score: Callable[[Batch], Batch] | None) -> torch.Tensor:
        """The agents' rewards; a session whose agent returned None gets `score`'s of its last row's answer."""
        last = {s: row for row, s in enumerate(sessions)}
        wanted = sorted(last[s] for s in set(sessions) if rewards[last[s]] is None)
        by_session: dict[int, float] = {}
        if wanted:
            if score is None:
                raise UserError(f"{FIELD}: an agent returned None and no reward is configured to score it")
            scored = score(batch.index(wanted))["scores"].tolist()
            by_session = {sessions[row]: float(x) for row, x in zip(wanted, scored)}
        return torch.tensor([by_session[s] if r is None else float(r) for r, s in zip(rewards, sessions)],
                            dtype=torch.float32)

    def shutdown(self) -> None:
        self.pool.shutdown()
        self.endpoint.close()
