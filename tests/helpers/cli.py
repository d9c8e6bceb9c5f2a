"""`rlhf` (or any Python script) in a subprocess, as a user runs it, and the fast RL settings of the e2e tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FAST = [
    "model.warm_start_steps=5", "data.val_size=16", "data.prompts_per_step=4", "rollout.n=4",
    "policy.micro_batch_size=8", "trainer.val_every=1", "trainer.progress_bar=false",
]


def cli_env(path: Path | str | None = None) -> dict[str, str]:
    """The environment of a CLI subprocess: this one's, HF offline, output unbuffered; `path` first on its
    PYTHONPATH (for a module:function reward or step of the test's own)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if path is not None:
        env["PYTHONPATH"] = f"{path}:{env.get('PYTHONPATH', '')}"
    return env


def python(*args: str, timeout: int = 600, path: Path | str | None = None, **kwargs) -> subprocess.CompletedProcess:
    """`python ARGS` (a script, or `-m rlhf ...`) in a subprocess with `cli_env(path)`, output captured as text;
    `kwargs` go to subprocess.run (cwd, input)."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=cli_env(path),
                          timeout=timeout, **kwargs)


def rlhf(*args: str, timeout: int = 600, path: Path | str | None = None) -> subprocess.CompletedProcess:
    """`rlhf ARGS` in a subprocess; `path` goes on its PYTHONPATH (for a module:function reward)."""
    return python("-m", "rlhf", *args, timeout=timeout, path=path)
