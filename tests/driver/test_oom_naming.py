"""A dead worker's error says OOM when the kernel's OOM killer struck on this node, and names the killed
process: a real OOM kill (a process over a 64 MB memory cgroup), read back from /proc/vmstat and the kernel
log."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workers.group.errors import oom_kill_count, oom_note
from workers.sandbox import cgroup

HOG = """
import sys
open(sys.argv[1], "w").write("0")  # into the 64 MB group
block = b"x" * (300 << 20)
"""


def test_an_oom_kill_on_this_node_is_named():
    group = cgroup.create("oomtest", 64)
    if group is None:
        pytest.skip("no memory cgroup can be made here (needs root and a memory controller)")
    before = oom_kill_count()
    assert oom_note(before) == ""  # nothing killed since: no note
    try:
        hog = subprocess.Popen([sys.executable, "-c", HOG, group.procs_file])
        assert hog.wait(timeout=60) == -9
    finally:
        group.remove()
    note = oom_note(before)
    assert note.startswith("\n(out of memory: the kernel's OOM killer killed"), note
    readable = subprocess.run(["dmesg"], capture_output=True, timeout=5).returncode == 0
    if readable:
        assert f"killed: pid {hog.pid} (python" in note or f", pid {hog.pid} (python" in note, note
    assert "largest process now is pid" in note and "\n" not in note[1:], note
