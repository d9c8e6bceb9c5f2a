"""Other users cannot reach the embedded Ray's sockets and logs under the run: `<output_dir>/ray` is 0700,
also after Ray's worker processes started (each opens the folders of Ray's temp dir, `<output_dir>/ray/tmp`,
to all users again), and when run as root, a process of another uid cannot list or stat anything in it."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534

# In its own process (a test session may already hold a Ray instance): start the run's Ray and two tasks
# (Ray worker processes), then report the modes under <output_dir>/ray while Ray runs and, as root, what a
# process of another uid can reach there.
SCRIPT = """
import json, os, stat, sys, ray
from rlhf.config.schema import TrainerConfig
from rlhf.driver.infra.ray_env import init_ray

own = init_ray(TrainerConfig(output_dir=sys.argv[1], dashboard=False, ray_num_cpus=1))
@ray.remote(num_cpus=0)
def pid():
    return os.getpid()
ray.get([pid.remote(), pid.remote()], timeout=120)
run_ray = os.path.join(sys.argv[1], "ray")
sockets = [os.path.join(top, "sockets") for top, dirs, _ in os.walk(own.temp_dir) if "sockets" in dirs]
if os.geteuid() == 0:
    child = os.fork()
    if child == 0:
        os.setgid(NOBODY); os.setuid(NOBODY)
        got = []
        for p in [run_ray, *sockets]:
            try:
                os.listdir(p); got.append(p)
            except PermissionError:
                pass
        os.write(1, ("REACHED " + json.dumps(got) + "\\n").encode()); os._exit(0)
    os.waitpid(child, 0)
print("RESULT", json.dumps({"temp_dir": str(own.temp_dir), "sockets": sockets,
                            "run_ray_mode": stat.S_IMODE(os.stat(run_ray).st_mode)}), flush=True)
own.stop()
""".replace("NOBODY", str(NOBODY))


@pytest.mark.timeout(200)
def test_run_ray_folder_is_private_and_its_sockets_unreachable(tmp_path):
    short = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))  # short enough for Ray's socket paths under it
    try:
        short.chmod(0o755)  # the run dir's parents are open to all: only <output_dir>/ray may keep others out
        out = short / "run"
        (out / "ray").mkdir(parents=True)
        os.chmod(out / "ray", 0o777)  # left open by an earlier run (Ray's own temp dir then): closed again
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], env=env, capture_output=True, text=True,
                              timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        res = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
        assert res["temp_dir"] == str(out / "ray" / "tmp")
        assert res["sockets"] and all(s.startswith(str(out / "ray") + "/") for s in res["sockets"]), res
        assert res["run_ray_mode"] == 0o700, oct(res["run_ray_mode"])  # with Ray's workers running
        assert stat.S_IMODE((out / "ray").stat().st_mode) == 0o700  # after Ray stopped, too
        if os.geteuid() == 0:
            reached = json.loads(proc.stdout.split("REACHED ", 1)[1].splitlines()[0])
            assert reached == [], f"uid {NOBODY} can list {reached}"
    finally:
        shutil.rmtree(short, ignore_errors=True)
