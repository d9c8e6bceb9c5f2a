"""Running model-written code against tests, in the sandbox: the pass check for HumanEval-style tasks and a
unit-test reward (`reward.fn=rlhf.eval.code:unit_test_pass_rate`).

A script passes when it exits 0 and prints, as its last line, a random token appended after the tests: code
that exits early (`os._exit(0)` before the tests run) or swallows the tests' failures cannot print a token
it never saw."""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from workers.sandbox import SandboxLimits, SandboxResult, run_many

_FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)
REWARD_LIMITS = SandboxLimits(wall_s=10.0, cpu_s=5.0, memory_mb=512)


def with_token(script: str) -> tuple[str, str]:
    """`script` followed by a print of a fresh random token; returns (script, token)."""
    token = secrets.token_hex(16)
    return f"{script}\n\nprint({token!r})\n", token


def passed(result: SandboxResult, token: str) -> bool:
    lines = result.stdout.strip().splitlines()
    return result.status == "ok" and bool(lines) and lines[-1] == token


def run_scripts(scripts: list[str], limits: SandboxLimits, workers: int = 2) -> list[bool]:
    """Whether each script passes (exit 0 and the token printed last), run in the sandbox in parallel."""
    guarded = [with_token(s) for s in scripts]
    results = run_many([g[0] for g in guarded], limits, workers=workers)
    return [passed(r, token) for r, (_, token) in zip(results, guarded)]


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
    against the code in the response, each test in its own sandboxed run."""
    tests = _tests(ground_truth)
    if not tests:
        return 0.0
    code = extract_code(response)
    return sum(run_scripts([f"{code}\n\n{test}" for test in tests], REWARD_LIMITS)) / len(tests)
