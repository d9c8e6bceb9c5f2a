"""Agents for the `rollout.openai_agent` tests, chosen per task by the answer's last digit: the example agent
(examples/agents/openai_agent.py), a two-call agent (its second call continues the first's conversation), one
that returns its own reward, one that crashes and one that hangs past the session timeout."""

from __future__ import annotations

import time
from typing import Any

from examples.agents.openai_agent import CALCULATOR
from examples.agents.openai_agent import run as example_run


def two_calls(client: Any, task: dict[str, Any]) -> None:
    messages = list(task["messages"])
    first = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], max_tokens=12)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "So the answer is?"}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=6)


def mixed(client: Any, task: dict[str, Any]) -> float | None:
    digit = int(str(task["ground_truth"])[-1])
    if digit in (3, 4):
        raise RuntimeError("an agent that crashes")
    if digit in (5, 7):
        time.sleep(3600)  # past rollout.agent_timeout_s: its process is killed
    if digit in (0, 1, 2):
        return example_run(client, task)
    two_calls(client, task)
    return 0.25 if digit == 9 else None  # its own reward, or reward.fn's
