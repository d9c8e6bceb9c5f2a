"""A reward process: `python -m rlhf.driver.rl.reward_worker SPEC SYS_PATH_JSON [OPTIONS_JSON]` scores samples with
the user's `module:function` outside the driver. One JSON object per line each way (no pickle): requests
`{"i": k, "args": [prompt, response, ground_truth]}` on stdin; replies `{"i": k, "value": x}`,
`{"i": k, "bad": "returned str 'abc'"}` or `{"i": k, "error": "ValueError: ..."}` on the original stdout. With
OPTIONS_JSON `"mode": "agent"` the function is an agent, `fn(client, task) -> reward | None`: requests carry
`[base_url, api_key, timeout_s, task]`, the process builds the `openai.OpenAI` client, and None replies
`{"i": k, "none": true}`. The
user's prints go to stderr, so they cannot garble the replies. Only the standard library is imported here,
so a process starts in a fraction of a second.

Two processes: a supervisor (this one) and, below it, the scorer that runs the function. The scorer is the
init of its own PID namespace where the kernel allows one, so everything the function starts (a
`subprocess`, a fork, a daemon with setsid) dies with it; elsewhere the supervisor, their subreaper, kills
them. The supervisor watches the driver (a pidfd) and ends the scorer and all below it when the driver dies.
OPTIONS_JSON: `caller` (the driver's pid), `cgroup` (a memory cgroup to join, or null) and `memory_mb`
(without a cgroup, the scorer's address-space limit). Both are the kernel's first OOM victims
(oom_score_adj 1000), before the training workers.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import math
import numbers
import os
import resource
import signal
import site
import sys
from typing import IO, Any

from workers.sandbox import reaper

CLONE_NEWUSER, CLONE_NEWPID = 0x10000000, 0x20000000


def _new_pid_namespace() -> bool:
    """Make this process's next child the init of a new PID namespace (with a user namespace when not root);
    False where the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWPID | (CLONE_NEWUSER if os.geteuid() != 0 else 0)
    if libc.unshare(flags) != 0:
        return False
    if flags & CLONE_NEWUSER:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    return True


def _bound_memory(opts: dict[str, Any]) -> None:
    """Join the memory cgroup, or cap the address space at `memory_mb` where there is none."""
    if opts.get("cgroup"):
        with open(os.path.join(opts["cgroup"], "cgroup.procs"), "w") as f:
            f.write("0")
    elif opts.get("memory_mb"):
        limit = int(opts["memory_mb"]) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _supervise(opts: dict[str, Any]) -> int | None:
    """Fork the scorer and, in this process, watch it and the driver until either exits; then kill whatever
    is left below. Returns the exit code for this process, or None in the scorer (which goes on to score)."""
    caller = int(opts.get("caller") or os.getppid())
    try:
        caller_fd = reaper.watch(caller)
    except ProcessLookupError:
        return 1
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    reaper.prctl(reaper.PR_SET_CHILD_SUBREAPER, 1)
    isolated = _new_pid_namespace()
    me = os.getpid()
    scorer = os.fork()
    if scorer == 0:
        reaper.prctl(reaper.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != (0 if isolated else me):  # the supervisor died before the signal was armed
            os._exit(1)
        return None
    devnull = os.open(os.devnull, os.O_RDWR)  # the scorer alone holds the pipes: the driver sees its exit
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    status = reaper.wait_child(scorer, caller, caller_fd)
    if status is None:  # the driver died
        reaper.kill_tree(scorer)
        _, status = os.waitpid(scorer, 0)
    reaper.kill_descendants(me)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def encode(value: Any) -> dict[str, Any]:
    """A reply for what the function returned: a finite number, or why it is not one."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        x = float(value)
        return {"value": x} if math.isfinite(x) else {"bad": f"returned {x}"}
    text = repr(value)
    return {"bad": f"returned {type(value).__name__} {text[:60] + ('...' if len(text) > 60 else '')}"}


def _call_agent(fn: Any, base_url: str, api_key: str, timeout_s: float, task: Any) -> dict[str, Any]:
    """Run an agent on one task with a client of the endpoint; its reward, or None (scored by reward.fn)."""
    import openai  # imported before the process reported ready: not in the session's time

    with openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0) as client:
        value = fn(client, task)
    return {"none": True} if value is None else encode(value)


def _send(out: IO[str], obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def _ignore(*_: object) -> None:
    """Stop signals are the driver's: it ends this process. A handler, not SIG_IGN: a program the function
    runs starts with the default dispositions (SIG_IGN would be inherited across exec)."""


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # until the scorer installs its handler
    opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    code = _supervise(opts)
    if code is not None:
        return code
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore)
    try:
        _bound_memory(opts)
    except OSError as e:
        sys.stdout.write(json.dumps({"error": f"cannot bound the reward process's memory: {e}"}) + "\n")
        return 1
    spec, path = sys.argv[1], json.loads(sys.argv[2])
    agent = opts.get("mode") == "agent"
    # the driver's own entries first (a module:function of the user's); not those inside this environment's
    # site-packages, such as the vendor folder pkg_resources appends, which would shadow the real packages
    own = tuple(site.getsitepackages())
    sys.path[:0] = [p for p in path if p not in sys.path and not p.startswith(own)]
    out = os.fdopen(os.dup(1), "w")  # the reply channel
    os.dup2(2, 1)  # the user's prints go to stderr
    module_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
        if not callable(fn):
            raise TypeError(f"{fn_name} is a {type(fn).__name__}, not a function")
        if agent:
            importlib.import_module("openai")
    except Exception as e:  # noqa: BLE001 - reported to the driver as one line
        _send(out, {"error": f"cannot load {spec}: {type(e).__name__}: {e}"})
        return 1
    _send(out, {"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = _call_agent(fn, *req["args"]) if agent else encode(fn(*req["args"]))
        except Exception as e:  # noqa: BLE001 - the driver scores it by reward.on_error
            reply = {"error": f"{type(e).__name__}: {e}"}
        _send(out, {"i": req["i"], **reply})
    return 0


if __name__ == "__main__":
    sys.exit(main())
