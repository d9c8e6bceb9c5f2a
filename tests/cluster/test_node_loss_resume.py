"""`rlhf train` on a simulated three-node cluster (tests/helpers/local_cluster.py): the policy's two DP ranks on nodes
a and b. Node b is killed mid-run: the driver names the node and the ranks lost
within 30 s and exits; `--resume` on the two nodes left continues from the last checkpoint to the end."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.local_cluster import LocalCluster, NodeSpec

REPO = Path(__file__).resolve().parents[2]
RUN = ["configs/grpo_tiny.yaml", "model.warm_start_steps=5", "data.val_size=8", "data.prompts_per_step=4",
       "rollout.n=4", "rollout.num_threads=1", "policy.micro_batch_size=8", "policy.parallel.dp=2",
       "policy.resources.num_threads=1", "trainer.total_steps=6", "trainer.save_every=1", "trainer.val_every=0",
       "trainer.progress_bar=false", "trainer.export_hf=false"]


def _steps(run: Path) -> list[int]:
    """The steps of the run's history (a resume supersedes the rows it logs again: read_metrics)."""
    from rlhf.driver.infra.metrics import read_metrics

    return [r["step"] for r in read_metrics(run)]


def _checkpoints(run: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*") if p.name.split("-")[1].isdigit())


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_killed_node_is_named_and_resume_continues_on_the_nodes_left(tmp_path):
    root = Path(f"/tmp/rlhf-mnr-{os.getpid()}")
    nodes = [NodeSpec("head", "127.0.0.10", 1), NodeSpec("a", "127.0.0.2", 3), NodeSpec("b", "127.0.0.3", 3)]
    run = tmp_path / "run"
    with LocalCluster(nodes, root) as cluster:
        train = [sys.executable, "-m", "rlhf", "train", *RUN, f"trainer.output_dir={run}",
                 f"trainer.ray_address={cluster.address}"]
        # 1.5 CPUs a policy rank: spread puts one on a and one on b (the head has 1); the engine (1 CPU) goes
        # wherever Ray puts it (it starts beside the policy)
        placement = ["policy.resources.num_cpus_per_worker=1.5", "policy.resources.placement=spread"]
        first = subprocess.Popen([*train, *placement], cwd=REPO, env=cluster.env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 600
            while len(_checkpoints(run)) < 2:
                assert first.poll() is None, first.stdout.read()[-4000:] if first.stdout else ""
                assert time.monotonic() < deadline, "no second checkpoint within 600 s"
                time.sleep(1)
            logs = sorted(p.name for p in (run / "logs" / "policy").glob("*.log"))
            assert any(n.endswith("@127.0.0.3.log") for n in logs) and any(n.endswith("@127.0.0.2.log") for n in logs), logs
            lost = next(n.removesuffix(".log") for n in logs if n.endswith("@127.0.0.3.log"))
            cluster.kill_node("b")
            t0 = time.monotonic()
            out, _ = first.communicate(timeout=120)
            took = time.monotonic() - t0
        finally:
            if first.poll() is None:
                first.kill()
        assert first.returncode != 0, out[-3000:]
        assert took < 30, f"the driver took {took:.0f} s to stop after the node was killed"
        assert "node 127.0.0.3" in out and "left the cluster" in out and f"policy/{lost}" in out, out[-3000:]
        last = _checkpoints(run)[-1]
        assert last < 6

        # the same run on the two nodes left (4 CPUs): both policy ranks on a, the engine on the head or a
        again = subprocess.run([*train[:4], "--resume", *train[4:], *placement], cwd=REPO, env=cluster.env,
                               capture_output=True, text=True, timeout=900)
        assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
        assert "resum" in (again.stdout + again.stderr).lower()
        steps = _steps(run)
        assert steps == sorted(set(steps)) and steps[-1] == 6, steps  # each step once, up to the end
        assert _checkpoints(run)[-1] == 6
    shutil.rmtree(root, ignore_errors=True)
