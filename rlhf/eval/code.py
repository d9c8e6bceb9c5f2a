"""Running model-written code against tests, in the sandbox: the pass check for HumanEval-style tasks and a
unit-test reward (`reward.fn=rlhf.eval.code:unit_test_pass_rate`).

The code and the tests run in two sandboxed processes (workers/sandbox/verdict.py): the tests call the code's
functions across a pipe and compare only plain values decoded on their side, and the verdict comes from the
tests' process. Code that hunts for a success marker, exits early, forges output lines or returns an object
that equals anything cannot pass a test it fails."""

from __future__ import annotations

import json
import re
from typing import Any

from workers.sandbox import SandboxLimits
from workers.sandbox.verdict import CodeCheck, run_check

_FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)
REWARD_LIMITS = SandboxLimits(wall_s=10.0, cpu_s=5.0, memory_mb=512)


def extract_code(response: str) -> str:
    """The last fenced Python block of a response, or the whole response when it has none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _tests(ground_truth: Any) -> list[str]:
    if isinstance(ground_truth, str):
        try:
            ground_truth = json.loads(ground_truth)
        except ValueError:
            return [line for line in ground_truth.splitlines() if line.strip()]
    if isinstance(ground_truth, dict):
        ground_truth = ground_truth.get("tests", [])
    if not isinstance(ground_truth, list) or not all(isinstance(t, str) for t in ground_truth):
        raise ValueError("unit_test_pass_rate: ground truth must be a list of test statements (or a JSON one)")
    return ground_truth


def unit_test_pass_rate(prompt: Any, response: str, ground_truth: Any) -> float:
    """Fraction of the hidden tests (ground truth: a list of statements such as `assert f(2) == 4`) that pass
    against the code in the response; each test has its own verdict (one that fails, raises or hangs does not
    hide the others)."""
    tests = _tests(ground_truth)
    if not tests:
        return 0.0
    result = run_check(CodeCheck(extract_code(response), tuple(tests)), REWARD_LIMITS)
    return sum(result.passed) / len(tests)
