"""Where each RL step's samples come from: the rollout schedule, in one place.

The run loop asks the source for a step's prompts (`prompts(step)`); the step asks it for their scored
samples (`generate(ctx, score)`); the rollout handle tells it before every weight sync (`before_sync`), so
work started on the old weights finishes on them. Nothing else in the driver knows the mode:

- `RolloutSource` (`rollout.mode: sync`): each step draws its prompts and samples them on its own weights.
- `OneStepOffSource` (`one_step_off`): a step takes the samples started during the previous step and starts
  the next step's prompts on the weights before its update.
- `AsyncSource` (`async`): a bounded-staleness buffer (`async_buffer.AsyncRollout`) the engines keep filling
  while the policy trains, partial rollouts included; a step takes its oldest complete groups.

What is generated (single turn, tools and environments, image prompts) is the rollout handle's; the source
only decides when, on which weights, and which prompts. Its `state_dict` is what a checkpoint keeps of the
schedule: the loader as of the step, the engines' version and the async buffer's samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlhf.config.schema import RunConfig
from workers.batch import Batch

if TYPE_CHECKING:
    from rlhf.data.prompts import PromptLoader
    from rlhf.driver.rl.context import StepContext
    from rlhf.workflow import Roles, RolloutHandle

Score = Callable[[Batch], Batch]


class RolloutSource:
    """`rollout.mode: sync`: a step draws its prompts and generates them now, on the weights of this step."""

    def __init__(self, rollout: RolloutHandle, loader: PromptLoader, total_steps: int) -> None:
        self.rollout, self.loader, self.total_steps = rollout, loader, total_steps
        self._metrics: dict[str, float] = {}
        rollout.before_sync = self.before_sync

    def prompts(self, step: int) -> list[dict[str, Any]]:
        """The prompt records step `step` trains on."""
        return self.loader.next_batch()

    def generate(self, ctx: StepContext, score: Score | None = None) -> Batch:
        """The samples of `ctx.prompts`, scored with `score` as each engine returns."""
        return self.rollout.generate(ctx.prompts, score=score, seed=ctx.sample_seed())

    def before_sync(self) -> None:
        """Work in flight on the engines finishes on the weights it started with."""

    def pop_metrics(self) -> dict[str, float]:
        """The schedule's `rollout/*` metrics of the last step (async: the buffer's)."""
        out, self._metrics = self._metrics, {}
        return out

    def loader_state(self) -> dict[str, int]:
        """The prompt loader as a checkpoint of the step just done keeps it."""
        return self.loader.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the engines' side: the version (and the async buffer)."""
        return {"version": self.rollout.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` after the resumed run's first sync (the engines hold the checkpoint's weights,
        which were version `state["version"]`)."""
        self.rollout.version = int(state.get("version", self.rollout.version))


class OneStepOffSource(RolloutSource):
    """`rollout.mode: one_step_off`: the next step's prompts are drawn a step early and start generating on
    the weights before this step's update, so generation overlaps the update. A checkpoint keeps the loader
    as it was before that early draw, so a resumed run draws them again (their in-flight samples are not
    saved)."""

    def __init__(self, rollout: RolloutHandle, loader: PromptLoader, total_steps: int) -> None:
        super().__init__(rollout, loader, total_steps)
        self._next: list[dict[str, Any]] | None = None  # the next step's prompts, drawn early
        self._pending: tuple[list[dict[str, Any]], Any, int, Score | None] | None = None  # prefetched
        self._loader_state: dict[str, int] | None = None

    def prompts(self, step: int) -> list[dict[str, Any]]:
        if self._loader_state is None:  # the first step of this process draws its own prompts
            self._next = self.loader.next_batch()
        self._loader_state = self.loader.state_dict()
        prompts, self._next = self._next or [], self.loader.next_batch() if step < self.total_steps else None
        return prompts

    def generate(self, ctx: StepContext, score: Score | None = None) -> Batch:
        seed = ctx.sample_seed()
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is ctx.prompts:
            batch = self.rollout.tag(pending[1].result(score or pending[3]), pending[2])
        else:
            if pending is not None:
                pending[1].result()  # not wanted after all; the engines finish it first anyway
            batch = self.rollout.generate(ctx.prompts, score=score, seed=seed)
        if self._next is not None:  # the next step's samples, on the weights before this update
            self._pending = (self._next, self.rollout.start(self._next, {"seed": ctx.next_step_seed()}),
                             self.rollout.version, score)
        return batch

    def before_sync(self) -> None:
        if self._pending is not None:
            self._pending[1].result(self._pending[3])

    def loader_state(self) -> dict[str, int]:
        return self._loader_state or self.loader.state_dict()


class AsyncSource(RolloutSource):
    """`rollout.mode: async`: a step takes as many complete groups as its prompts from the buffer
    (`async_buffer.AsyncRollout`), which queues the prompts, draws more from the loader when it runs short,
    scores groups as they finish and keeps generating while the policy trains."""

    def __init__(self, rollout: RolloutHandle, loader: PromptLoader, total_steps: int, buffer: Any) -> None:
        super().__init__(rollout, loader, total_steps)
        self.buffer = buffer

    def generate(self, ctx: StepContext, score: Score | None = None) -> Batch:
        batch, self._metrics = self.buffer.take(ctx.prompts, ctx.next_prompts, self.rollout.version)
        return batch

    def before_sync(self) -> None:
        self.buffer.collect(self.rollout.version)

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"buffer": self.buffer.state_dict(self.rollout.version)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "buffer" in state:
            self.buffer.load_state_dict(state["buffer"])


def rollout_source(cfg: RunConfig, roles: Roles, loader: PromptLoader) -> RolloutSource:
    """The source of `cfg.rollout.mode` over the run's engines; async scores groups with the run's reward
    as they finish (in the buffer's thread: untimed, its time overlaps the update)."""
    total, rollout = cfg.trainer.total_steps, roles.rollout
    if cfg.rollout.mode == "one_step_off":
        return OneStepOffSource(rollout, loader, total)
    if cfg.rollout.mode == "async":
        from rlhf.driver.rl.async_buffer import AsyncRollout
        from rlhf.workflow import prompt_encoder

        r = cfg.rollout
        buffer = AsyncRollout(rollout.group.start_generate, prompt_encoder(cfg.model.tokenizer_path or cfg.model.path),
                              rollout.sampling, r.partial_tokens, r.max_staleness, score=roles.reward,
                              admission=r.admission)
        return AsyncSource(rollout, loader, total, buffer)
    return RolloutSource(rollout, loader, total)
