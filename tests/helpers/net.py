"""Listening sockets of a process tree, and the ones beyond loopback."""

from __future__ import annotations


def loopback(ip: str) -> bool:
    ip = ip.removeprefix("::ffff:")
    return ip.startswith("127.") or ip == "::1"


def listening_sockets(pid: int) -> list[tuple[int, str, str, int]]:
    """(pid, name, address, port) of every listening TCP socket of process `pid` and all its descendants."""
    import psutil

    root = psutil.Process(pid)
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            out += [(p.pid, " ".join(p.cmdline())[:80], c.laddr.ip, c.laddr.port) for c in p.net_connections("inet")
                    if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
    return out


def exposed(sockets: list[tuple[int, str, str, int]]) -> list[tuple[int, str, str, int]]:
    """The sockets of `sockets` that listen beyond loopback."""
    return [s for s in sockets if not loopback(s[2])]
