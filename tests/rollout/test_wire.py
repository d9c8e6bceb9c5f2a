"""Weight-sync control messages: signed JSON on a loopback-only store; a pickle (or anything not signed
with the run's secret) written into the store is refused without being unpickled."""

from __future__ import annotations

import json
import pickle

import psutil
import pytest
import torch

from tests.helpers.planted import Plant
from workers.rollout import wire
from workers.rollout.buckets import BucketMeta
from workers.rollout.control import Channel, SyncEndpoint
from workers.rollout.cpu.shm_file import ShmLayout

SECRET = "s3cret" * 8


@pytest.fixture(scope="module")
def endpoint():
    return SyncEndpoint.open("127.0.0.1")


def _channel(endpoint, secret: str = SECRET) -> Channel:
    return Channel(endpoint.host, endpoint.port, "t", 0, 1, 2, 5.0, secret=secret)


def test_store_listens_on_loopback_only(endpoint):
    mine = [c.laddr for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == endpoint.port]
    assert mine and all(a.ip == "127.0.0.1" for a in mine), mine


def test_messages_round_trip(endpoint):
    src, dst = _channel(endpoint), _channel(endpoint)
    meta = BucketMeta(3, "bfloat16", ["a.weight", "b.bias"], [(4, 2), (7,)], [0, 8], 15)
    layout = ShmLayout.from_shapes({"x.weight": (3, 5), "x.bias": (5,)}, "float32")
    for key, obj in (("k/meta", meta), ("k/layout", layout), ("k/end", wire.END)):
        src.publish(key, obj)
    assert dst.fetch("k/meta") == meta and isinstance(dst.fetch("k/meta").shapes[0], tuple)
    got = dst.fetch("k/layout")
    assert (got.names, got.shapes, got.offsets, got.nbytes) == (layout.names, layout.shapes, layout.offsets,
                                                                layout.nbytes)
    assert dst.fetch("k/end") == wire.END
    src.set_flag("k/done")
    dst.wait_flags(["k/done"])


def test_pickle_and_unsigned_values_are_refused(endpoint, tmp_path):
    marker = tmp_path / "PWNED"
    ch = _channel(endpoint)
    endpoint.store.set("evil/pickle", pickle.dumps(Plant(marker)))  # what a hostile client could write
    with pytest.raises(wire.ForgedMessageError, match="not signed with this run's secret"):
        ch.fetch("evil/pickle")
    body = json.dumps({"t": "end"}).encode()
    endpoint.store.set("evil/json", b"0" * 64 + body)
    with pytest.raises(wire.ForgedMessageError):
        ch.fetch("evil/json")
    _channel(endpoint, secret="another run").publish("evil/other", wire.END)
    with pytest.raises(wire.ForgedMessageError):
        ch.fetch("evil/other")
    endpoint.store.set("evil/flag", b"1")  # a done flag set by someone else
    with pytest.raises(wire.ForgedMessageError):
        ch.wait_flags(["evil/flag"])
    ch.publish("moved", wire.END)  # a signed value copied under another key
    endpoint.store.set("evil/moved", endpoint.store.get("moved"))
    with pytest.raises(wire.ForgedMessageError):
        ch.fetch("evil/moved")
    assert not marker.exists()
    with pytest.raises(ValueError, match="no session secret"):
        _channel(endpoint, secret="").publish("x", wire.END)


def test_cuda_ipc_handle_encoding():
    """The arguments of torch's CUDA rebuild function travel field by field; no other function may."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    meta = BucketMeta(0, "float32", ["w"], [(2, 3)], [0], 6)
    args = (torch.Tensor, torch.Size([2, 3]), (3, 1), 0, torch.UntypedStorage, torch.float32, 0, b"\x00handle\xff",
            24, 0, False, b"ref", 8, b"event", True)
    data = wire.encode("k", (meta, (rebuild_cuda_tensor, args)), SECRET)
    got_meta, (fn, got) = wire.decode("k", data, SECRET)
    assert got_meta == meta and fn is rebuild_cuda_tensor and got == tuple(args)
    import os

    with pytest.raises(TypeError, match="rebuild function"):
        wire.encode("k", (meta, (os.system, ("true",))), SECRET)
    raw = json.loads(data[64:])
    raw["rebuild"] = "system"
    body = json.dumps(raw).encode()
    with pytest.raises(ValueError, match="unknown CUDA IPC rebuild function"):
        wire.decode("k", wire._mac(SECRET, "k", body) + body, SECRET)
