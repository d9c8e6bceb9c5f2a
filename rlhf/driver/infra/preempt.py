"""Graceful preemption: SIGTERM (Kubernetes, Slurm, `ray job stop`) and SIGINT stop a run at the next step
boundary, after a checkpoint, within `trainer.stop_grace_s`.

`ray.init` installs its own SIGTERM handler in the driver (it exits at once, wherever the driver is), so
`StopSignals.install` runs after Ray is up and takes precedence; `restore` puts the previous handlers back.
A second signal stops at once, without a checkpoint; if the step and its checkpoint outlast the grace period,
a watchdog ends the process (the last finished checkpoint stays valid: checkpoints are written atomically).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

from rlhf.errors import Stopped

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._watchdog: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)

    def install(self) -> None:
        """Handle SIGTERM and SIGINT from now on (only the main thread can install handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            self.signum = signum
            raise Stopped(f"stopped on a second {name}, without a checkpoint; resume with --resume "
                          "(from the last checkpoint)", self.exit_code)
        self.signum = signum
        print(f"received {name}: stopping after this step and its checkpoint (within trainer.stop_grace_s="
              f"{self.grace_s:g} s; {name} again stops at once)", file=sys.stderr, flush=True)
        self._watchdog = threading.Timer(self.grace_s, self._expired)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expired(self) -> None:
        """Exit now, without Ray's shutdown: the embedded Ray's reaper (rlhf/driver/infra/ray_reaper.py) ends its
        processes when this one is gone."""
        print(f"stopped: the step and its checkpoint took longer than trainer.stop_grace_s={self.grace_s:g} s; "
              "resume with --resume (from the last checkpoint)", file=sys.stderr, flush=True)
        os._exit(self.exit_code)
