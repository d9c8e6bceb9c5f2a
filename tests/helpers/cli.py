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


def rlhf_in_process(*args: str, path: Path | str | None = None) -> subprocess.CompletedProcess:
    """`rlhf ARGS` through the CLI's own main in this process, on the shared Ray (the test asks for
    `ray_session`): no interpreter, import or Ray start-up. For runs whose subject is what the run does, not the
    CLI process itself (its signals, its exit on a crash: those run `rlhf`). Its exit code and output come back
    as `rlhf` gives them; `path` is first on sys.path while it runs (a module:function reward of the test's own;
    the reward processes get the driver's sys.path), and what was imported from there is forgotten after."""
    import contextlib
    import importlib
    import io

    from rlhf.cli import main

    out, err = io.StringIO(), io.StringIO()
    extra = str(Path(path).resolve()) if path is not None else None
    if extra:
        sys.path.insert(0, extra)
        importlib.invalidate_caches()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        if extra:
            sys.path.remove(extra)
            for name, module in list(sys.modules.items()):
                if str(getattr(module, "__file__", None) or "").startswith(extra + os.sep):
                    del sys.modules[name]
    return subprocess.CompletedProcess(["rlhf", *args], code, out.getvalue(), err.getvalue())
