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


class RewardScorer:
    """Scores samples with the configured `reward.fn`. A built-in (trusted, fast) runs in this process; a
    `module:function` runs in a `RewardPool` of processes with a per-call timeout. A call that raises, returns
    anything but a finite number, or times out is scored `reward.fallback_score` and counted
    (`reward/errors`, `reward/timeouts`, one warning line per batch), or with `reward.on_error=fail` stops the
    run with one line naming the function and the sample."""

    def __init__(self, rc: RewardConfig) -> None:
        assert rc.fn
        self.spec, self.on_error, self.fallback = rc.fn, rc.on_error, rc.fallback_score
        user = ":" in rc.fn
        self.fn = None if user else builtin_reward_fn(rc.fn)
        self.pool = RewardPool(rc.fn, rc.num_workers, rc.timeout_s, rc.memory_mb) if user else None
        self.counts = {"reward/errors": 0.0, "reward/timeouts": 0.0}

    def _in_process(self, sample: tuple[Any, Any, Any]) -> Outcome:
        assert self.fn is not None
        try:
            reply = encode(self.fn(*sample))
        except Exception as e:  # noqa: BLE001 - scored by reward.on_error like a user's function
            return Outcome(kind="error", message=f"raised {type(e).__name__}: {e}")
        return Outcome(value=reply["value"]) if "value" in reply else Outcome(kind="error", message=reply["bad"])

    def score(self, prompts: list, responses: list[str], ground_truths: list) -> torch.Tensor:
        """One float score per sample."""
        samples = list(zip(prompts, responses, ground_truths))
        outcomes = self.pool.score(samples) if self.pool else [self._in_process(x) for x in samples]
        failed = [(i, o) for i, o in enumerate(outcomes) if o.value is None]
        if failed:
            i, first = failed[0]
            what = (f"reward.fn {self.spec} {first.message.replace(chr(10), ' ')} on sample {i} (prompt "
                    f"{_short(samples[i][0])}, response {_short(samples[i][1])})")
            if self.on_error == "fail":
                raise RewardError(f"{what}; reward.on_error=fail (reward.on_error=fallback scores such samples "
                                  "reward.fallback_score)")
            timeouts = sum(o.kind == "timeout" for _, o in failed)
            self.counts["reward/errors"] += len(failed) - timeouts
            self.counts["reward/timeouts"] += timeouts
            print(f"warning: {len(failed)} of {len(samples)} rewards scored reward.fallback_score={self.fallback:g} "
                  f"({len(failed) - timeouts} errors, {timeouts} timeouts); first: {what}", file=sys.stderr,
                  flush=True)
        return torch.tensor([self.fallback if o.value is None else o.value for o in outcomes], dtype=torch.float32)

    def pop_metrics(self) -> dict[str, float]:
        """The failures counted since the last call (`reward/errors`, `reward/timeouts`)."""
        out, self.counts = self.counts, dict.fromkeys(self.counts, 0.0)
        return out

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
