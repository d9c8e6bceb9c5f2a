"""The sandbox contains what untrusted code tries (the real launcher, real namespaces and limits on this
kernel); each attempt is reported as a status, and the sandbox keeps working afterwards."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.procs import world_readable_python
from workers.sandbox import SandboxLimits, namespaces_available, run_code, run_many, sandbox
from workers.sandbox.sandbox import JAIL_UID_BASE, _run

FAST = SandboxLimits(wall_s=8.0, cpu_s=2.0, memory_mb=256)


def _jailed_processes() -> list[int]:
    """Host pids of processes running sandboxed code (`python -I -S -B main.py`)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[-2:-1] == [b"main.py"]:
                pids.append(int(pid))
        except OSError:
            continue
    return pids


def test_namespaces_are_used_on_this_kernel():
    assert namespaces_available(), "this machine allows user/mount/pid/net namespaces; the probe must see them"
    r = run_code("import os; print(os.getcwd()); print(sorted(os.listdir('/')))")
    assert r.status == "ok" and r.isolation == "namespaces", r
    cwd, listing = r.stdout.splitlines()
    assert cwd == "/work" and "home" not in listing and "work" in listing


def test_infinite_loop_hits_the_cpu_limit():
    r = run_code("while True:\n    pass\n", SandboxLimits(wall_s=30, cpu_s=1))
    assert r.status == "cpu_limit", r


def test_sleeping_code_hits_the_wall_clock():
    r = run_code("import time\ntime.sleep(60)\n", SandboxLimits(wall_s=1.5))
    assert r.status == "timeout", r


def test_fork_bomb_is_contained_and_leaves_nothing_behind():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_code(code, SandboxLimits(wall_s=3, cpu_s=2, max_procs=16))
    assert r.status in ("timeout", "cpu_limit"), r
    for _ in range(50):  # the kernel tears the PID namespace down asynchronously
        if not _jailed_processes():
            break
        time.sleep(0.1)
    assert _jailed_processes() == []


def test_allocating_10_gb_fails_inside():
    r = run_code("x = bytearray(10 * 1024**3)\nprint('allocated')\n", FAST)
    assert r.status == "memory" and "allocated" not in r.stdout, r


def test_writes_outside_the_working_directory_fail(tmp_path):
    target = tmp_path / "escaped.txt"
    code = f"""
for path in {[str(target), "/etc/escaped", "/usr/escaped", "/root/escaped", "/escaped"]!r}:
    try:
        open(path, "w").write("x")
        print("WROTE", path)
    except OSError as e:
        print("refused", path, type(e).__name__)
open("inside.txt", "w").write("ok")
print("inside ok", open("inside.txt").read())
"""
    r = run_code(code, FAST)
    assert r.status == "ok", r
    assert "WROTE" not in r.stdout and "inside ok ok" in r.stdout, r.stdout
    assert not target.exists()


def test_parent_environment_and_files_are_out_of_reach(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_SANDBOX_SECRET", "s3cret-token")
    secret_file = tmp_path / "token"
    secret_file.write_text("s3cret-file")
    code = f"""
import os
print(dict(os.environ))
for pid in os.listdir('/proc'):
    if pid.isdigit():
        try:
            print(open(f'/proc/{{pid}}/environ', 'rb').read())
        except OSError as e:
            print('no environ', pid, type(e).__name__)
try:
    print(open({str(secret_file)!r}).read())
except OSError as e:
    print('no file', type(e).__name__)
"""
    r = run_code(code, FAST)
    assert r.status == "ok", r
    assert "s3cret" not in r.stdout and "no file" in r.stdout, r.stdout


def test_no_network_even_to_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("CONNECTED")
except OSError as e:
    print("blocked", type(e).__name__)
"""
    try:
        r = run_code(code, FAST)
    finally:
        server.close()
    assert r.status == "ok" and "blocked" in r.stdout and "CONNECTED" not in r.stdout, r


def test_printing_100_mb_is_cut_at_the_cap():
    limits = SandboxLimits(wall_s=30, max_output_bytes=1 << 16)
    r = run_code("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)\n", limits)
    assert r.status == "output_limit", r.status
    assert len(r.stdout) <= limits.max_output_bytes


def test_errors_and_stdin_and_many_runs():
    r = run_code("import sys\nprint(sys.stdin.read().upper())\nraise SystemExit(3)\n", FAST, stdin="abc")
    assert r.status == "error" and r.returncode == 3 and r.stdout.strip() == "ABC", r
    done: list[str] = []  # on_done sees each result as it finishes (what a progress bar counts)
    results = run_many([f"print({i} * {i})" for i in range(6)], FAST, workers=3, on_done=lambda r: done.append(r.stdout))
    assert [x.stdout.strip() for x in results] == [str(i * i) for i in range(6)]
    assert sorted(done) == sorted(x.stdout for x in results)
    assert all(x.status == "ok" for x in results)


def _limits_only_python(monkeypatch) -> None:
    """The limits-only path started as root runs the code as another uid, which needs an interpreter that
    uid can run: use one (skip where the machine has none)."""
    if os.getuid() == 0 and not sandbox._world_readable_python():
        python = world_readable_python() or pytest.skip("no interpreter an unprivileged user can run")
        monkeypatch.setattr(sandbox, "_python", lambda: python)


def test_without_namespaces_the_limits_still_hold(monkeypatch):
    """The fallback for kernels that refuse namespaces (forced here): limits and a scrubbed environment."""
    _limits_only_python(monkeypatch)
    monkeypatch.setenv("RLHF_SANDBOX_SECRET", "s3cret-token")
    r = _run("import os\nprint(dict(os.environ))\nwhile True:\n    pass\n", SandboxLimits(wall_s=30, cpu_s=1),
             "", isolated=False)
    assert r.isolation == "limits" and r.status == "cpu_limit" and "s3cret" not in r.stdout, r


def test_limits_only_never_runs_code_as_root(tmp_path, monkeypatch):
    """Started as root without namespaces and with an interpreter no other uid can run, the sandbox refuses
    with one line saying why: the code never runs (it ran as root before)."""
    monkeypatch.setattr(sandbox, "_world_readable_python", lambda: False)
    proof = tmp_path / "ran"
    r = _run(f"import os\nopen({str(proof)!r}, 'w').write(str(os.getuid()))\nprint('uid', os.getuid())\n",
             FAST, "", isolated=False)
    if os.getuid() != 0:  # not root: it runs as this user, as always
        assert r.status == "ok" and r.stdout.split() == ["uid", str(os.getuid())], r
        return
    assert r.status == "setup_failed" and not proof.exists() and "uid" not in r.stdout, r
    assert r.stderr.count("\n") == 1 and "refusing to run untrusted code as root" in r.stderr, r.stderr


def test_limits_only_as_root_runs_as_another_uid_without_roots_files(monkeypatch):
    """The limits-only path started as root runs the code as its own unprivileged uid: it cannot write /etc,
    read /root or signal root's processes."""
    if os.getuid() != 0:
        pytest.skip("the uid drop happens when started as root")
    _limits_only_python(monkeypatch)
    victim = subprocess.Popen(["sleep", "60"])
    target = f"/etc/rlhf-sandbox-escape-{os.getpid()}"
    code = f"""
import os
print("uid", os.getuid(), os.geteuid())
for what, attempt in [("wrote /etc", lambda: open({target!r}, "w").write("x")),
                      ("listed /root", lambda: os.listdir("/root")),
                      ("killed", lambda: os.kill({victim.pid}, 9))]:
    try:
        attempt()
        print("ESCAPED", what)
    except OSError as e:
        print("refused", what, type(e).__name__)
"""
    try:
        r = _run(code, FAST, "", isolated=False)
        assert victim.poll() is None, "the sandboxed code killed a root process"
    finally:
        victim.kill()
        victim.wait()
        if os.path.exists(target):
            os.unlink(target)
            raise AssertionError(f"the sandboxed code wrote {target}")
    assert r.status == "ok" and r.isolation == "limits", r
    uid = r.stdout.split()[1:3]
    assert uid[0] == uid[1] and int(uid[0]) >= JAIL_UID_BASE, r.stdout
    assert "ESCAPED" not in r.stdout and r.stdout.count("refused") == 3, r.stdout


def test_unprivileged_user_gets_the_same_isolation(tmp_path):
    """Started by a non-root user the sandbox uses an unprivileged user namespace instead of setuid. The check
    runs as uid 1000 inside a user namespace (`unshare --map-user`), which takes that code path here."""
    import shutil
    import subprocess
    import sys

    if os.getuid() != 0:  # the suite itself runs unprivileged: that is the path already
        test_namespaces_are_used_on_this_kernel()
        return
    assert shutil.which("unshare"), "util-linux unshare is needed to start the check as another user"
    script = ("import os\n"
              "from workers.sandbox import run_code, SandboxLimits\n"
              "r = run_code('import os; print(os.getuid(), os.getcwd())', SandboxLimits(wall_s=20))\n"
              "print(os.getuid(), r.status, r.isolation, r.stdout.strip())\n")
    repo = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(["unshare", "--user", "--map-user=1000", "--map-group=1000",
                          os.path.realpath(sys._base_executable), "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=str(tmp_path), env={"PYTHONPATH": repo, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1000", "ok", "namespaces", "1000", "/work"], out.stdout
