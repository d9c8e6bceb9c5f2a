"""Where the run's own processes listen: loopback on one node, this node's address when a Ray cluster spans
several nodes. The one home of that choice and of the sockets built on it.

Left to themselves, torch.distributed's TCPStore listens on every interface (`::`) whatever host it is given,
and gloo (also vLLM's gloo groups) on the address the machine's host name resolves to. Here the store serves
on a socket bound to the chosen address, and `bind_process(address)` points gloo (`GLOO_SOCKET_IFNAME`), NCCL's
bootstrap (`NCCL_SOCKET_IFNAME`) and vLLM (`VLLM_HOST_IP`) at it; a value the user set is kept.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
from typing import Any

log = logging.getLogger("workers")

LOOPBACK = "127.0.0.1"
_ENV_KEYS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def node_address() -> str:
    """The address this process's run listens on: this node's Ray address when the Ray cluster spans several
    nodes, else loopback (also without Ray)."""
    ray = sys.modules.get("ray")  # not imported: not initialised either
    try:
        if ray is not None and ray.is_initialized():
            ip = ray.util.get_node_ip_address()
            if ip and is_multi_node():  # (loopback addresses too: the nodes of a cluster simulated on one machine)
                return ip
    except Exception:  # noqa: BLE001 - not in a cluster after all: loopback
        pass
    return LOOPBACK


def is_multi_node() -> bool:
    """Whether the (initialised) Ray cluster has more than one live node."""
    import ray

    return len([n for n in ray.nodes() if n.get("Alive")]) > 1


def own_address(master_addr: str) -> str:
    """The address this rank listens on in a world that meets at `master_addr`: loopback when that is
    127.0.0.1 (one node), else this node's Ray address."""
    if master_addr in (LOOPBACK, "localhost", "::1"):
        return LOOPBACK
    import ray

    return ray.util.get_node_ip_address()


def interface_of(host: str) -> str | None:
    """The name of the network interface that holds `host` (an address or a resolvable name), or None."""
    import psutil

    ip = socket.gethostbyname(host) if ":" not in host else host
    loopback = ip.startswith("127.")  # Linux's loopback interface holds the whole 127.0.0.0/8
    for name, addrs in psutil.net_if_addrs().items():
        if loopback and any(a.address.startswith("127.") for a in addrs if a.family == socket.AF_INET):
            return name
        if any(a.address.split("%")[0] == ip for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)):
            return name
    return None


def bind_process(host: str) -> None:
    """Make the sockets this process's libraries open themselves listen on `host`: gloo's devices, NCCL's
    bootstrap and vLLM's advertised address. Call before the first process group or engine is built."""
    iface = interface_of(host)
    if iface is None:  # an address no interface holds (NAT): the libraries choose; say so in the log
        log.warning("no network interface holds %s: gloo and NCCL pick their own", host)
    else:
        for key in _ENV_KEYS:
            os.environ.setdefault(key, iface)
    os.environ.setdefault("VLLM_HOST_IP", host)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on `host` that was free a moment ago."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_store(host: str, port: int = 0, world_size: int | None = None,
                timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> Any:
    """A TCPStore server listening on `host` only (`port` 0: any free port, `store.port` says which)."""
    import torch

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(128)
        port = sock.getsockname()[1]
        fd = os.dup(sock.fileno())  # the store owns (and closes) the descriptor it is given
    finally:
        sock.close()
    try:
        return torch.distributed.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False,
                                          master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def rendezvous_store(host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """The store of a world whose rank 0 serves it on `host:port` (rank 0 serves, the others connect)."""
    import torch

    if rank == 0:
        return serve_store(host, port, world_size, timeout)
    return torch.distributed.TCPStore(host, port, world_size, False, timeout=timeout)


def init_world(backend: str, master_addr: str, master_port: int, rank: int, world_size: int,
               timeout: datetime.timedelta) -> None:
    """`torch.distributed.init_process_group` over a store that rank 0 serves on `master_addr:master_port`,
    with this process's gloo / NCCL sockets on `own_address(master_addr)`."""
    import torch

    bind_process(own_address(master_addr))
    store = rendezvous_store(master_addr, master_port, rank, world_size, timeout)
    torch.distributed.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                         timeout=timeout)


def gloo_group(store: Any, rank: int, size: int, timeout: datetime.timedelta, host: str | None = None) -> Any:
    """A ProcessGroupGloo over `store` whose device listens on `host` (default: `node_address()`)."""
    import torch

    pg = torch.distributed.ProcessGroupGloo
    opts = pg._Options()
    opts._timeout = timeout
    opts._devices = [pg.create_device(hostname=host or node_address())]
    return pg(store, rank, size, opts)
