"""The run directory of a multi-node run must be storage every node shares (checkpoints are written by ranks
on several nodes, the driver reads them back): checked once at start, before any worker starts.

The driver writes a token file in `<output_dir>/.node-check/`; one task per live node, pinned there, reads
it back and writes its own file beside it; the driver then reads every node's file. A node that cannot read
the token, cannot write, or whose file the driver does not see fails the run with one line naming the node.
"""

from __future__ import annotations

import logging
import secrets
import shutil
from pathlib import Path
from typing import Any

from rlhf.errors import UserError

CHECK_DIR = ".node-check"
log = logging.getLogger(__name__)


def _probe(folder: str, token: str, name: str) -> str:
    """On one node: read the driver's token and write this node's file; "" or what went wrong."""
    here = Path(folder)
    try:
        seen = (here / "driver").read_text()
    except OSError as e:
        return f"cannot read the driver's file {here / 'driver'} ({e.strerror or e})"
    if seen != token:
        return f"reads a different {here / 'driver'} than the driver wrote (another file system at that path)"
    try:
        (here / name).write_text(token)
    except OSError as e:
        return f"cannot write {here / name} ({e.strerror or e})"
    return ""


def check_shared_run_dir(out: Path, timeout_s: float = 60.0) -> None:
    """Raise UserError unless every live node of the Ray cluster reads and writes `out` as the driver does.
    One node: nothing to check."""
    import ray
    from ray.exceptions import NodeDiedError, TaskUnschedulableError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return
    folder = Path(out).absolute() / CHECK_DIR
    folder.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    (folder / "driver").write_text(token)
    probe = ray.remote(num_cpus=0, max_retries=0)(_probe)
    try:
        refs: dict[Any, dict[str, Any]] = {}
        for n in nodes:
            strategy = NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            refs[probe.options(scheduling_strategy=strategy).remote(str(folder), token, f"node-{n['NodeID']}")] = n
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref, n in refs.items():
            try:
                problem = ray.get(ref) if ref in ready else f"did not answer within {timeout_s:g}s"
            except (TaskUnschedulableError, NodeDiedError):  # a node that left since ray.nodes(): nothing to check
                log.warning("node %s left the cluster during the run-dir check", n.get("NodeManagerAddress", "?"))
                continue
            mine = folder / f"node-{n['NodeID']}"
            if not problem and (not mine.is_file() or mine.read_text() != token):
                problem = f"wrote {mine}, which the driver does not see (another file system at that path)"
            if problem:
                raise UserError(
                    f"trainer.output_dir: {out} is not on storage every node shares: node "
                    f"{n.get('NodeManagerAddress', '?')} ({n['NodeID'][:8]}) {problem}; put the run directory on "
                    f"shared storage (NFS, a ReadWriteMany volume) mounted at the same path on every node")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
