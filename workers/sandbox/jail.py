"""The sandbox's launcher: isolates itself, then runs untrusted Python code. Standard library only, since it
runs as `python -I -S jail.py SPEC_JSON` (no site-packages, no environment).

Where the kernel allows it (namespaces; needs no root: an unprivileged user namespace suffices):
- a fresh network namespace (only a down loopback: no connection leaves it);
- a fresh PID namespace with the code as its init, so every process the code starts dies with it;
- a fresh mount namespace whose root is an empty tmpfs holding read-only binds of the interpreter and system
  libraries, a fresh /proc, a few /dev nodes and the working directory (the only writable place with /tmp);
  nothing else of the host's file system (home folders, tokens, the run's files) is visible;
- an unprivileged user (uid 65534-derived when started as root), no new privileges.
Always: resource limits (CPU seconds, address space, open files, processes, file size) and a scrubbed
environment. The parent enforces the wall clock and the output cap (workers/sandbox/sandbox.py).

Without namespaces (a container that forbids them) the code runs with the limits, the scrubbed environment and
its own directory only; `SandboxResult.isolation` says which level ran. It never runs as root: started as root
with an interpreter an unprivileged user cannot run, the launcher refuses (exit 125, one line saying why).

Lifetime: this process stays outside as the supervisor. It watches the process that started it (a pidfd) and
is the subreaper of everything below it; when the code's process exits, the caller dies, or it gets SIGTERM,
it kills what is left: the PID namespace (its init dies), every descendant, every process of the sandbox's
uid (started as root) and the memory cgroup. The code's process has a parent-death signal, so killing the
supervisor with SIGKILL takes the code with it.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as `python -I -S`: no path of its own

from workers.sandbox import cgroup, reaper  # standard library only

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 38, 36
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
EXIT_SETUP_FAILED = 125

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _enc(s: str | None) -> bytes | None:
    return s.encode() if s is not None else None


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(_enc(src), _enc(dst), _enc(fstype), ctypes.c_ulong(flags), _enc(data)), f"mount {dst}")


def _bind_ro(host: str, root: str) -> None:
    """Bind `host` read-only at the same path under `root` (a directory or a file)."""
    target = root + host
    if os.path.isdir(host):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(host, target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _system_dirs() -> list[str]:
    """Host paths the interpreter needs, read-only: the system libraries and the Python installation."""
    dirs = ["/usr", "/etc/ld.so.cache", "/etc/localtime", sys.base_prefix]
    return [d for d in dirs if os.path.exists(d)]


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _enter_namespaces(uid: int, gid: int) -> None:
    """New user (when not root), PID and network namespaces for this process's children (the mount namespace
    is the init's own: this supervisor keeps the host's files, /proc and cgroups in view)."""
    flags = CLONE_NEWPID | CLONE_NEWNET
    if os.geteuid() != 0:
        flags |= CLONE_NEWUSER
    _check(_libc.unshare(flags), "unshare")
    if flags & CLONE_NEWUSER:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")


def _build_root(root: str, work: str) -> None:
    """An empty tmpfs root with read-only system dirs, the working dir at /work, /tmp, /dev and /proc."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    os.makedirs(root, exist_ok=True)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=755")
    for d in _system_dirs():
        _bind_ro(d, root)
    for link in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink("/" + link):
            os.symlink(os.readlink("/" + link), f"{root}/{link}")
    os.makedirs(root + "/work")
    _mount(work, root + "/work", None, MS_BIND | MS_REC)
    os.makedirs(root + "/tmp")
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")
    os.makedirs(root + "/dev")
    for node in ("null", "zero", "random", "urandom"):
        open(f"{root}/dev/{node}", "a").close()
        _mount(f"/dev/{node}", f"{root}/dev/{node}", None, MS_BIND)
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/.old")
    _check(_libc.syscall(SYS_PIVOT_ROOT[platform.machine()], root.encode(), (root + "/.old").encode()),
           "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    os.rmdir("/.old")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _limit(spec: dict) -> None:
    def cap(which: int, value: int) -> None:
        resource.setrlimit(which, (value, value))

    cpu = max(1, int(spec["cpu_s"]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the limit, SIGKILL a second later
    cap(resource.RLIMIT_AS, int(spec["memory_mb"]) << 20)
    cap(resource.RLIMIT_NOFILE, int(spec["max_files"]))
    cap(resource.RLIMIT_FSIZE, int(spec["max_file_bytes"]))
    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_NPROC, int(spec["max_procs"]))


def _drop_privileges(uid: int, gid: int) -> None:
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _exec_code(spec: dict, cwd: str) -> None:
    os.chdir(cwd)
    env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "TMPDIR": "/tmp" if spec["isolated"] else cwd,
           "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    python = spec["python"]
    os.execve(python, [python, "-I", "-S", "-B", "main.py"], env)


def _wait_exit_code(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


class SetupFailed(Exception):
    """The sandbox cannot start as asked; the message is its one line."""


def _run_code(spec: dict, cwd: str, supervisor: int) -> None:
    """Limits, the unprivileged uid, default signal dispositions (an ignored SIGTERM of whoever started us
    must not be inherited), then the code; never as root."""
    _limit(spec)
    _drop_privileges(spec["uid"], spec["gid"])
    if 0 in os.getresuid() or 0 in os.getresgid():
        raise SetupFailed(
            f"refusing to run untrusted code as root: the kernel refused namespaces and the interpreter "
            f"{spec['python']} cannot be run by an unprivileged user (a folder on its path is not "
            "world-searchable); install Python where every user can run it or allow user namespaces")
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")  # set after the uid change
    if os.getppid() != supervisor:  # it died before the death signal was armed
        os._exit(EXIT_SETUP_FAILED)
    _exec_code(spec, cwd)


def _join_cgroup(spec: dict) -> None:
    """Move this process (and so all it starts) into the call's memory cgroup, where there is one."""
    if spec.get("cgroup"):
        _write(os.path.join(spec["cgroup"], "cgroup.procs"), "0")


def _child(spec: dict, supervisor: int) -> None:
    """Below the supervisor: the code directly (limits only), or the PID namespace's init (namespaces)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    if os.getppid() != (0 if spec["isolated"] else supervisor):  # it died before the signal was armed
        os._exit(EXIT_SETUP_FAILED)  # (the init's parent is outside its PID namespace: pid 0 in its view)
    _join_cgroup(spec)
    if not spec["isolated"]:
        _run_code(spec, spec["work"], supervisor)
    _check(_libc.unshare(CLONE_NEWNS), "unshare mount namespace")
    _build_root(spec["root"], spec["work"])
    code = os.fork()
    if code == 0:
        try:
            _run_code(spec, "/work", 1)
        except (OSError, SetupFailed) as e:
            sys.stderr.write(f"sandbox setup failed: {e}\n")
        os._exit(EXIT_SETUP_FAILED)
    os._exit(_wait_exit_code(code))


class _Stop(Exception):
    """SIGTERM to the supervisor: the caller's wall clock or output cap ended the run."""


def _stop(*_: object) -> None:
    raise _Stop


def _kill_uid(uid: int) -> None:
    """Started as root: SIGKILL every process of the sandbox's own uid (a forked helper does it as that uid,
    so kill(-1) reaches those processes only)."""
    if os.geteuid() != 0 or uid == 0:
        return
    helper = os.fork()
    if helper == 0:
        try:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(helper, 0)


def _end_the_rest(spec: dict) -> None:
    """Kill whatever the code left (daemons, setsid'd grandchildren) and record the cgroup's verdict in the
    run folder (outcome.json: OOM kills and peak memory) before removing the cgroup."""
    reaper.kill_descendants(os.getpid())
    if not spec["isolated"]:  # with namespaces the init's exit has killed them (and forks fail here now)
        _kill_uid(int(spec["uid"]))
    if not spec.get("cgroup"):
        return
    group = cgroup.MemoryCgroup(spec["cgroup"], int(spec["cgroup_version"]), int(spec["memory_mb"]))
    group.kill_all()
    try:
        _write(os.path.join(os.path.dirname(spec["work"]), "outcome.json"),
               json.dumps({"oom_kills": group.oom_kills(), "peak_mb": group.peak_mb()}))
    except OSError:
        pass
    group.remove()


def _setup_failed(message: str) -> int:
    sys.stderr.write(f"sandbox setup failed: {message}\n")
    return EXIT_SETUP_FAILED


def main() -> int:
    """This process (the supervisor) -> with namespaces, PID 1 of the new PID namespace (builds the root,
    then waits: when it exits the kernel kills everything left in the namespace) -> the code (a normal
    process, so the CPU limit's SIGXCPU reaches it). Limits only: this process -> the code."""
    spec = json.loads(sys.argv[1])
    caller = int(spec["caller"])
    try:
        caller_fd = reaper.watch(caller)
    except ProcessLookupError:
        return _setup_failed("the process that started the sandbox has exited")
    if os.getppid() != caller:
        return _setup_failed("the process that started the sandbox has exited")
    try:
        _write("/proc/self/oom_score_adj", "1000")  # the kernel's first OOM victim, before any worker
    except OSError:
        pass
    reaper.prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGTERM, _stop)
    me = os.getpid()
    try:
        if spec["isolated"]:
            _enter_namespaces(os.getuid(), os.getgid())
    except OSError as e:
        return _setup_failed(str(e))
    child = os.fork()
    if child == 0:
        try:
            _child(spec, me)
        except (OSError, SetupFailed) as e:
            sys.stderr.write(f"sandbox setup failed: {e}\n")
        os._exit(EXIT_SETUP_FAILED)
    try:
        status = reaper.wait_child(child, caller, caller_fd)
    except _Stop:
        status = None
    if status is None:  # the caller died or stopped the run: end the code now
        os.kill(child, signal.SIGKILL)
        _, status = os.waitpid(child, 0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _end_the_rest(spec)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main())
