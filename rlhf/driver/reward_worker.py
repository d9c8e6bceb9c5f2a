"""A reward process: `python -m rlhf.driver.reward_worker SPEC SYS_PATH_JSON` scores samples with the user's
`module:function` outside the driver. One JSON object per line each way (no pickle): requests
`{"i": k, "args": [prompt, response, ground_truth]}` on stdin; replies `{"i": k, "value": x}`,
`{"i": k, "bad": "returned str 'abc'"}` or `{"i": k, "error": "ValueError: ..."}` on the original stdout. The
user's prints go to stderr, so they cannot garble the replies. Only the standard library is imported here,
so a process starts in a fraction of a second.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import math
import numbers
import os
import signal
import sys
from typing import IO, Any


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the driver dies, even if the user's function never returns."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def encode(value: Any) -> dict[str, Any]:
    """A reply for what the function returned: a finite number, or why it is not one."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        x = float(value)
        return {"value": x} if math.isfinite(x) else {"bad": f"returned {x}"}
    text = repr(value)
    return {"bad": f"returned {type(value).__name__} {text[:60] + ('...' if len(text) > 60 else '')}"}


def _send(out: IO[str], obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def main() -> int:
    _die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # stop signals are the driver's: it ends this process
        signal.signal(sig, signal.SIG_IGN)
    spec, path = sys.argv[1], json.loads(sys.argv[2])
    sys.path[:0] = [p for p in path if p not in sys.path]
    out = os.fdopen(os.dup(1), "w")  # the reply channel
    os.dup2(2, 1)  # the user's prints go to stderr
    module_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
        if not callable(fn):
            raise TypeError(f"{fn_name} is a {type(fn).__name__}, not a function")
    except Exception as e:  # noqa: BLE001 - reported to the driver as one line
        _send(out, {"error": f"cannot load {spec}: {type(e).__name__}: {e}"})
        return 1
    _send(out, {"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = encode(fn(*req["args"]))
        except Exception as e:  # noqa: BLE001 - the driver scores it by reward.on_error
            reply = {"error": f"{type(e).__name__}: {e}"}
        _send(out, {"i": req["i"], **reply})
    return 0


if __name__ == "__main__":
    sys.exit(main())
