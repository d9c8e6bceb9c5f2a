"""Resolve the configured reward (a rule name or a `module:function`) and score batches, failures included."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from algorithms.rewards import get_reward_fn, list_rewards
from rlhf.config.schema import RewardConfig
from rlhf.driver.rl.reward_pool import Outcome, RewardPool
from rlhf.driver.rl.reward_worker import encode
from rlhf.errors import ConfigError, UserError

RewardCallable = Callable[[Any, str, Any], float]


def check_reward_fn(rc: RewardConfig) -> None:
    """Fail fast, with the reason, on a `reward.fn` that is no built-in name and no `module:function` that
    loads. The user's module is imported in a reward process (never in the driver: its top-level code is as
    untrusted as the function), bounded in time like every start of one."""
    if ":" not in rc.fn:
        builtin_reward_fn(rc.fn)
        return
    pool = RewardPool(rc.fn, 1, rc.timeout_s, rc.memory_mb)
    try:
        pool.start()
    finally:
        pool.shutdown()


def builtin_reward_fn(spec: str) -> RewardCallable:
    """A rule function of algorithms.rewards by name (`exact_match`, ...); ConfigError naming the choices."""
    try:
        return get_reward_fn(spec)
    except (KeyError, ValueError):
        raise ConfigError(
            f"reward.fn: unknown reward function {spec!r}; expected one of {', '.join(list_rewards())} "
            "or module:function"
        ) from None


class RewardError(UserError):
    """A reward call failed (raised, returned no finite number, or timed out) with reward.on_error=fail."""


def _short(x: Any, n: int = 60) -> str:
    text = repr(x)
    return text[:n] + "..." if len(text) > n else text


class _InProcess:
    """A built-in rule (trusted, fast) scored in this process."""

    def __init__(self, fn: RewardCallable) -> None:
        self.fn = fn

    def score(self, samples: list[tuple[Any, Any, Any]]) -> list[Outcome]:
        return [self._one(x) for x in samples]

    def _one(self, sample: tuple[Any, Any, Any]) -> Outcome:
        try:
            reply = encode(self.fn(*sample))
        except Exception as e:  # noqa: BLE001 - scored by reward.on_error like a user's function
            return Outcome(kind="error", message=f"raised {type(e).__name__}: {e}")
        return Outcome(value=reply["value"]) if "value" in reply else Outcome(kind="error", message=reply["bad"])

    def shutdown(self) -> None:
        pass


class RewardScorer:
    """Scores samples with one reward source: `reward.fn` (a built-in in this process; a `module:function` in
    a `RewardPool` of processes with a per-call timeout), or a service (`for_url`: reward.url; `for_judge`:
    reward.judge). A sample whose call raises, returns anything but a finite number, times out or (a judge)
    gives a malformed verdict is scored `reward.fallback_score` and counted (`reward/errors`,
    `reward/timeouts`, `reward/judge_malformed`; one warning line per batch), or with `reward.on_error=fail`
    stops the run with one line naming the source and the sample."""

    def __init__(self, rc: RewardConfig, backend: Any = None, source: str | None = None) -> None:
        self.on_error, self.fallback = rc.on_error, rc.fallback_score
        if backend is None:
            assert rc.fn
            user = ":" in rc.fn
            backend = RewardPool(rc.fn, rc.num_workers, rc.timeout_s, rc.memory_mb) if user else \
                _InProcess(builtin_reward_fn(rc.fn))
            source = f"reward.fn {rc.fn}"
        self.backend, self.source = backend, source or type(backend).__name__
        self.counts = {"reward/errors": 0.0, "reward/timeouts": 0.0}

    @property
    def pool(self) -> RewardPool | None:
        """The reward processes of a `module:function` reward (None for the other sources)."""
        return self.backend if isinstance(self.backend, RewardPool) else None

    @classmethod
    def for_url(cls, rc: RewardConfig) -> RewardScorer:
        """Scores by the verifier at `reward.url` (reward_url.py)."""
        from rlhf.driver.rl.reward_url import RemoteReward

        assert rc.url
        return cls(rc, RemoteReward(rc), f"reward.url {rc.url}")

    @classmethod
    def for_judge(cls, rc: RewardConfig, judge: Any) -> RewardScorer:
        """Scores by `judge` (a reward_judge.Judge of `reward.judge`); counts `reward/judge_malformed` too."""
        scorer = cls(rc, judge, f"reward.judge {rc.judge.model_path}")
        scorer.counts["reward/judge_malformed"] = 0.0
        return scorer

    def score(self, prompts: list, responses: list[str], ground_truths: list) -> torch.Tensor:
        """One float score per sample."""
        samples = list(zip(prompts, responses, ground_truths))
        outcomes = self.backend.score(samples)
        failed = [(i, o) for i, o in enumerate(outcomes) if o.value is None]
        if failed:
            i, first = failed[0]
            what = (f"{self.source} {first.message.replace(chr(10), ' ')} on sample {i} (prompt "
                    f"{_short(samples[i][0])}, response {_short(samples[i][1])})")
            if self.on_error == "fail":
                raise RewardError(f"{what}; reward.on_error=fail (reward.on_error=fallback scores such samples "
                                  "reward.fallback_score)")
            kinds = {k: sum(o.kind == k for _, o in failed) for k in ("timeout", "malformed")}
            errors = len(failed) - kinds["timeout"] - kinds["malformed"]
            self.counts["reward/errors"] += errors
            self.counts["reward/timeouts"] += kinds["timeout"]
            if kinds["malformed"]:
                self.counts["reward/judge_malformed"] = self.counts.get("reward/judge_malformed", 0.0) + \
                    kinds["malformed"]
            malformed = f", {kinds['malformed']} malformed verdicts" if kinds["malformed"] else ""
            print(f"warning: {len(failed)} of {len(samples)} rewards scored reward.fallback_score={self.fallback:g} "
                  f"({errors} errors, {kinds['timeout']} timeouts{malformed}); first: {what}", file=sys.stderr,
                  flush=True)
        return torch.tensor([self.fallback if o.value is None else o.value for o in outcomes], dtype=torch.float32)

    def pop_metrics(self) -> dict[str, float]:
        """The failures counted since the last call (`reward/errors`, `reward/timeouts`; a judge's
        `reward/judge_malformed` and `time/judge`)."""
        out, self.counts = self.counts, dict.fromkeys(self.counts, 0.0)
        pop = getattr(self.backend, "pop_metrics", None)
        return {**out, **(pop() if pop is not None else {})}

    def shutdown(self) -> None:
        self.backend.shutdown()
