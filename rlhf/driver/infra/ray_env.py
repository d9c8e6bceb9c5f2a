"""Start or join Ray: an embedded local instance bound to 127.0.0.1, or the cluster at RAY_ADDRESS/--address.

An embedded instance:
- listens on loopback only. Ray 2.60 turns `_node_ip_address="127.0.0.1"` into the machine's address
  (and then binds the GCS, raylet, workers and agents there) unless its "cluster mode" is off, which is
  what `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` does; it is set for the driver and the processes Ray starts,
  and the node address is checked after start (a non-loopback one stops the run);
- keeps its session folder (logs, sockets) under `<output_dir>/ray`, or, when that path is too long for a
  unix socket, in a short `/tmp/rlhf-eray-<pid>-*` folder removed at exit (and by the next start when the
  driver was killed). That folder is its owner's only (0700), and Ray's temp dir is its `tmp/` subfolder:
  Ray opens every folder it makes to all users (chmod 0777, again in each worker process that starts), so
  the closed folder above them is what keeps other users out of its sockets and logs;
- has its token file (`~/.ray/auth_token`, or RAY_AUTH_TOKEN_PATH) readable by its owner only;
- is ended with the driver: a reaper process (rlhf/driver/infra/ray_reaper.py) kills what Ray started and removes
  the driver's weight-sync files and scratch folder when the driver stops or dies, even by SIGKILL.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rlhf.config.schema import TrainerConfig
from rlhf.driver.infra.ray_reaper import processes_of, start_reaper, stop_reaper

CLUSTER_MODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps a loopback node address
SCRATCH_PREFIX = "rlhf-eray-"
# A unix socket path holds at most 107 bytes; Ray puts its sockets at
# <temp dir>/session_<date>_<time>_<usec>_<pid>/sockets/<name>, up to about 70 bytes after the temp dir.
SOCKET_PATH_MAX = 107
SESSION_SUFFIX_MAX = 72
RAY_SUBDIR = "tmp"  # Ray's temp dir inside the run's closed `ray/` folder


class EmbeddedRay:
    """The Ray instance this process started: `stop()` shuts it down and removes a scratch temp dir."""

    def __init__(self, temp_dir: Path, scratch: bool, saved_env: str | None) -> None:
        self.temp_dir, self.scratch, self._saved_env = temp_dir, scratch, saved_env
        self.reaper: subprocess.Popen[bytes] | None = None

    def watch(self) -> None:
        """Start the reaper over the processes Ray has started for this driver (call after `ray.init`): its
        GCS, raylet and monitors and what they started (the agents, idle workers)."""
        from ray._private import worker

        from workers.rollout.cpu.shm_file import PREFIX, SHM_DIR

        node = worker._global_node
        assert node is not None, "watch() runs after ray.init"
        processes = []
        for _kind, proc in node.live_processes():
            processes += processes_of(proc.pid, include_self=True)

        remove = [os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-*")]
        if self.scratch:
            remove.append(str(self.temp_dir.parent))
        self.reaper = start_reaper(processes, remove)

    def stop(self) -> None:
        import ray

        try:
            ray.shutdown()
        finally:
            _set_cluster_mode(self._saved_env)
            if self.reaper is not None:
                stop_reaper(self.reaper)
            if self.scratch:
                shutil.rmtree(self.temp_dir.parent, ignore_errors=True)


def ray_temp_dir(output_dir: str | Path) -> tuple[Path, bool]:
    """The embedded Ray's temp dir and whether it is a scratch one (removed at exit, with its parent): `tmp/`
    in `<output_dir>/ray` when Ray's socket paths under it fit in a unix socket address, else in a fresh
    short folder in /tmp. Its parent is made 0700 (see the module docstring)."""
    run_local = Path(output_dir).absolute() / "ray"
    if len(str(run_local / RAY_SUBDIR)) + SESSION_SUFFIX_MAX <= SOCKET_PATH_MAX:
        private = run_local
        private.mkdir(parents=True, exist_ok=True, mode=0o700)
        scratch = False
    else:
        private = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir="/tmp"))
        scratch = True
    private.chmod(0o700)  # also a folder an earlier run (or an older rlhf, whose Ray temp dir it was) left open
    (private / RAY_SUBDIR).mkdir(exist_ok=True, mode=0o700)
    return private / RAY_SUBDIR, scratch


def remove_stale_scratch_dirs(directory: str = "/tmp") -> list[str]:
    """Remove scratch Ray temp dirs whose driver process is gone (a driver killed before its cleanup ran)."""
    from workers.rollout.cpu.shm_file import pid_alive

    removed = []
    for path in glob.glob(os.path.join(directory, f"{SCRATCH_PREFIX}*")):
        try:
            pid = int(os.path.basename(path)[len(SCRATCH_PREFIX):].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def token_path() -> Path:
    """Where Ray reads its auth token: RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def ensure_private_token() -> Path:
    """Create Ray's token file 0600 if missing (Ray itself writes it with the umask, 0644), and make an
    existing one 0600. Returns its path."""
    path = token_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        path.chmod(0o600)
    return path


def _set_cluster_mode(value: str | None) -> None:
    """Set (or, with None, unset) Ray's cluster-mode switch for this process and the ones Ray starts."""
    from ray._private import ray_constants

    if value is None:
        os.environ.pop(CLUSTER_MODE_ENV, None)
    else:
        os.environ[CLUSTER_MODE_ENV] = value
    ray_constants.ENABLE_RAY_CLUSTER = value != "0"  # read when Ray resolves the node address


def dashboard_hint(url: str, temp_dir: Path, output_dir: str | Path) -> str:
    """The lines printed with the dashboard URL: how to get the token and where the metric charts are."""
    metrics = f"{temp_dir}/session_latest/metrics"
    return (f"Ray dashboard: http://{url}\n"
            f"  token: `ray get-auth-token` (or the file {token_path()})\n"
            f"  its Metrics charts need Prometheus and Grafana: `prometheus --config.file "
            f"{metrics}/prometheus/prometheus.yml`, Grafana with `--config {metrics}/grafana/grafana.ini`, and "
            f"RAY_PROMETHEUS_HOST / RAY_GRAFANA_HOST exported before `rlhf train`; the same curves are in "
            f"TensorBoard (`tensorboard --logdir {output_dir}`) and {output_dir}/report.png")


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ while the block runs (the embedded Ray's processes inherit them), then as before."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def init_ray(trainer: TrainerConfig, log_to_driver: bool = True) -> EmbeddedRay | None:
    """Initialise Ray if needed; return the embedded instance when this process started one. `log_to_driver`:
    the workers' output is echoed here too (it is in the run's logs/ either way)."""
    import ray

    if ray.is_initialized():
        return None
    address = trainer.ray_address or os.environ.get("RAY_ADDRESS")
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=log_to_driver)
        return None
    from workers.rollout.cpu.shm_file import remove_stale_files

    remove_stale_files()  # what drivers that were killed left: weight-sync files, scratch Ray temp dirs
    remove_stale_scratch_dirs()
    num_cpus = trainer.ray_num_cpus or max(4, os.cpu_count() or 1)
    temp_dir, scratch = ray_temp_dir(trainer.output_dir)
    ensure_private_token()
    saved_env = os.environ.get(CLUSTER_MODE_ENV)
    _set_cluster_mode("0")
    own = EmbeddedRay(temp_dir, scratch, saved_env)
    try:
        with _environ(env["env_vars"]):
            ctx = ray.init(num_cpus=num_cpus, include_dashboard=trainer.dashboard, dashboard_host="127.0.0.1",
                           _node_ip_address="127.0.0.1", _temp_dir=str(temp_dir), log_to_driver=log_to_driver,
                           configure_logging=False)
        node_ip = ray.util.get_node_ip_address()
        if not str(node_ip).startswith("127."):
            raise RuntimeError(f"the embedded Ray took the node address {node_ip}, not 127.0.0.1; refusing to "
                               f"run with Ray listening beyond loopback")
        own.watch()
    except BaseException:
        own.stop()
        raise
    if trainer.dashboard:
        print(dashboard_hint(ctx.dashboard_url or "", temp_dir, trainer.output_dir), flush=True)
    return own
