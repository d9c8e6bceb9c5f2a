"""A torch.distributed world built by workers/net.py listens on the address it is given and nowhere else:
the store (TCPStore alone listens on `::`), the gloo groups of the world and megatron-style `new_group`s
(gloo alone binds what the host name resolves to) and the weight sync's own gloo group. Checked on loopback
(one node) and on this machine's network address (what a rank of a multi-node run is given)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket

import psutil
import pytest


def _addresses() -> list[str]:
    nic = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
           if a.family == socket.AF_INET and not a.address.startswith("127.")]
    return ["127.0.0.1", *nic[:1]]


def _rank(rank: int, host: str, port: int, out) -> None:
    try:
        for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "VLLM_HOST_IP"):
            os.environ.pop(key, None)
        import torch

        from workers import net

        timeout = datetime.timedelta(seconds=60)
        net.bind_process(host)
        store = net.rendezvous_store(host, port, rank, 2, timeout)
        torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
        group = torch.distributed.new_group([0, 1], backend="gloo")
        x = torch.full((4,), float(rank + 1))
        torch.distributed.all_reduce(x, group=group)
        sync = net.gloo_group(torch.distributed.PrefixStore("sync", store), rank, 2, timeout, host=host)
        y = torch.full((2,), float(rank))
        sync.broadcast([y]).wait()
        listening = sorted({c.laddr.ip for c in psutil.Process().net_connections("inet")
                            if c.status == psutil.CONN_LISTEN})
        torch.distributed.barrier()
        out.put((rank, x.tolist(), y.tolist(), listening, os.environ["VLLM_HOST_IP"]))
        torch.distributed.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, repr(e), None, None, None))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("host", _addresses())
def test_world_listens_only_on_its_address(host):
    from workers.net import free_port, serve_store

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port(host)
    procs = [ctx.Process(target=_rank, args=(r, host, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=100) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, x, y, listening, vllm_ip in results:
        assert x == [3.0] * 4 and y == [0.0, 0.0], (rank, x)
        assert listening == [host], f"rank {rank} listens on {listening}, not only on {host}"
        assert vllm_ip == host

    store = serve_store(host)  # the weight-sync control store
    mine = {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN}
    assert (host, store.port) in mine and ("::", store.port) not in mine and ("0.0.0.0", store.port) not in mine
