"""The settings of multi-turn rollouts; the run config's rollout section is built on this class."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AgentOptions:
    # Multi-turn tool use: built-in tools (calculator, python: runs in the sandbox) or module:function.
    # Empty (and no env): one response per prompt. With either, rollout.max_tokens caps each model turn.
    tools: list[str] = field(default_factory=list)
    max_turns: int = 4
    max_total_tokens: int = 256  # a trajectory's response tokens, model and tool turns together
    tool_timeout_s: float = 10.0  # a tool call, an environment reset or step; past it: an error, never waited for
    # An environment (module:Class with reset(messages, ground_truth) and step(text) -> observation, reward,
    # done) answers each model turn without a tool call; its rewards (env_reward: sum | last | mean) are the
    # trajectory's score instead of reward.fn. e.g. workers.agent.env:GuessNumber
    env: str | None = None
    env_reward: str = "sum"
