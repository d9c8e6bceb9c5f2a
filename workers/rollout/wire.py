"""Weight-sync control messages on the wire: JSON of known types, authenticated with the sync's secret.

The control store (control.py, a TCPStore) carries small messages: bucket metas, the shm layout, CUDA IPC
handles, the end marker and done / ack flags. Whoever can reach the store could write into it, so a value
is never unpickled: it is `<hmac-sha256 hex><json>`, where the HMAC covers the key and the JSON under the
per-syncer secret (`SyncSession.secret`, handed to the run's own processes through Ray), and is checked
before the JSON is parsed; the JSON is turned back only into the types below.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any

import torch

from workers.rollout.buckets import BucketMeta
from workers.rollout.cpu.shm_file import ShmLayout

END = "end"
_MAC_LEN = 64  # hex digits of a sha256


class ForgedMessageError(ValueError):
    """A control value whose HMAC does not match: written by someone without the run's secret."""


def _mac(secret: str, key: str, body: bytes) -> bytes:
    return hmac.new(secret.encode(), key.encode() + b"\0" + body, hashlib.sha256).hexdigest().encode()


def encode(key: str, obj: Any, secret: str) -> bytes:
    """The signed value stored under `key` for `obj` (BucketMeta, ShmLayout, END, True, or a CUDA IPC
    bucket `(BucketMeta, reduce_tensor(t))`)."""
    if not secret:
        raise ValueError("weight sync: no session secret (SyncSession.secret) to sign control messages with")
    body = json.dumps(_to_json(obj), separators=(",", ":")).encode()
    return _mac(secret, key, body) + body


def decode(key: str, data: bytes, secret: str) -> Any:
    """Check the HMAC of `data` (ForgedMessageError otherwise), then rebuild the object it encodes."""
    mac, body = bytes(data[:_MAC_LEN]), bytes(data[_MAC_LEN:])
    if not secret or not hmac.compare_digest(mac, _mac(secret, key, body)):
        raise ForgedMessageError(f"weight sync: the control value under {key!r} is not signed with this run's "
                                 f"secret (another process wrote into the store); refusing it")
    return _from_json(json.loads(body))


# ---- objects <-> JSON ----------------------------------------------------------------------------
def _shapes(shapes: list[Any]) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in s) for s in shapes]


def _to_json(obj: Any) -> Any:
    if obj is True:
        return {"t": "flag"}
    if isinstance(obj, str) and obj == END:
        return {"t": "end"}
    if isinstance(obj, BucketMeta):
        return {"t": "bucket", "index": obj.index, "dtype": obj.dtype, "names": obj.names,
                "shapes": [list(s) for s in obj.shapes], "offsets": obj.offsets, "numel": obj.numel}
    if isinstance(obj, ShmLayout):
        return {"t": "shm_layout", "dtype": obj.dtype, "names": obj.names, "shapes": [list(s) for s in obj.shapes],
                "offsets": obj.offsets, "nbytes": obj.nbytes}
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], BucketMeta):
        rebuild, args = obj[1]
        return {"t": "ipc", "meta": _to_json(obj[0]), "rebuild": _ipc_rebuild_name(rebuild),
                "args": [_arg_to_json(a) for a in args]}
    raise TypeError(f"weight sync: no wire encoding for {type(obj).__name__}")


def _from_json(raw: Any) -> Any:
    kind = raw.get("t") if isinstance(raw, dict) else None
    if kind == "flag":
        return True
    if kind == "end":
        return END
    if kind == "bucket":
        return BucketMeta(index=int(raw["index"]), dtype=str(raw["dtype"]), names=[str(n) for n in raw["names"]],
                          shapes=_shapes(raw["shapes"]), offsets=[int(o) for o in raw["offsets"]],
                          numel=int(raw["numel"]))
    if kind == "shm_layout":
        return ShmLayout(dtype=str(raw["dtype"]), names=[str(n) for n in raw["names"]], shapes=_shapes(raw["shapes"]),
                         offsets=[int(o) for o in raw["offsets"]], nbytes=int(raw["nbytes"]))
    if kind == "ipc":
        rebuild = _IPC_REBUILDS().get(raw["rebuild"])
        if rebuild is None:
            raise ValueError(f"weight sync: unknown CUDA IPC rebuild function {raw['rebuild']!r}")
        return _from_json(raw["meta"]), (rebuild, tuple(_arg_from_json(a) for a in raw["args"]))
    raise ValueError(f"weight sync: unknown control message {str(raw)[:80]!r}")


# ---- CUDA IPC handles: the arguments of torch's rebuild function, field by field ------------------
def _IPC_REBUILDS() -> dict[str, Any]:  # noqa: N802 - a constant, built lazily (torch.multiprocessing import)
    from torch.multiprocessing import reductions

    return {"rebuild_cuda_tensor": reductions.rebuild_cuda_tensor}


def _ipc_rebuild_name(fn: Any) -> str:
    for name, known in _IPC_REBUILDS().items():
        if fn is known:
            return name
    raise TypeError(f"weight sync: unexpected CUDA IPC rebuild function {fn!r}")


def _types() -> dict[str, Any]:
    return {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter, "UntypedStorage": torch.UntypedStorage,
            "TypedStorage": torch.TypedStorage}


def _arg_to_json(a: Any) -> Any:
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, bytes):
        return {"bytes": base64.b64encode(a).decode()}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, (tuple, list)):  # torch.Size included
        return {"tuple": [_arg_to_json(x) for x in a]}
    if isinstance(a, type):
        for name, t in _types().items():
            if a is t:
                return {"type": name}
    raise TypeError(f"weight sync: no wire encoding for the CUDA IPC argument {a!r}")


def _arg_from_json(a: Any) -> Any:
    if not isinstance(a, dict):
        return a
    if "bytes" in a:
        return base64.b64decode(a["bytes"])
    if "dtype" in a:
        dtype = getattr(torch, a["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"weight sync: unknown dtype {a['dtype']!r}")
        return dtype
    if "device" in a:
        return torch.device(a["device"])
    if "tuple" in a:
        return tuple(_arg_from_json(x) for x in a["tuple"])
    if "type" in a and a["type"] in _types():
        return _types()[a["type"]]
    raise ValueError(f"weight sync: unknown CUDA IPC argument {str(a)[:80]!r}")
