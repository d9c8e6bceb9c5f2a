"""An agent session's completions as training trajectories, from the recorded token ids (never re-tokenised).

A session's calls usually extend one conversation: the prompt of call k+1 starts with the prompt and the
sampled ids of call k, followed by what the agent added (tool results, a user turn, the template's glue).
Such calls form ONE trajectory: the first prompt, then every call's sampled ids (trained: mask 1, with their
log-probs) and between them the added ids (context: mask 0, log-prob 0). A call whose prompt does not
extend the trajectory so far (the agent rewrote the history, or the chat template re-renders a past turn
differently from the sampled ids) starts a new trajectory with its own prompt. Either way every trained id
is an id the engine sampled, in the context it was sampled in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.endpoint.sessions import Completion


@dataclass
class Trajectory:
    """One training row, in the shape `workers.rollout.prompts.build_output` takes (token_ids,
    sampled_logprobs, mask, text, finish_reason) plus the versions of its calls."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    sampled_logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    versions: list[int] = field(default_factory=list)
    calls: int = 0

    def add(self, c: Completion, context: list[int]) -> None:
        """Append `context` (masked) and then the completion's sampled ids."""
        self.token_ids += context + c.token_ids
        self.mask += [0] * len(context) + [1] * len(c.token_ids)
        self.sampled_logprobs += [0.0] * len(context) + list(c.logprobs)
        self.text, self.finish_reason = c.text, c.finish_reason
        self.versions.append(c.version)
        self.calls += 1


def trajectories(completions: list[Completion]) -> list[Trajectory]:
    """The session's completions, in order, as trajectories (see the module docstring)."""
    out: list[Trajectory] = []
    for c in completions:
        cur = out[-1] if out else None
        so_far = cur.prompt_ids + cur.token_ids if cur is not None else None
        if cur is not None and so_far is not None and c.prompt_ids[:len(so_far)] == so_far:
            cur.add(c, c.prompt_ids[len(so_far):])
        else:
            t = Trajectory(list(c.prompt_ids))
            t.add(c, [])
            out.append(t)
    return out
