"""The in-sandbox half of a code check, one file for both roles (standard library only: it runs as
`python -I -S main.py`; its first stdin line says the role).

- candidate: runs the model's code, then answers calls `{"id", "fn", "args", "kwargs"}` with the result as
  plain data (`{"id", "ok"}`), or `{"id", "error"}` / `{"id", "unserialisable"}`. It never sees a test.
- checker: for each check (a stdin line: setup, tests, stubs), runs the trusted setup and tests with each name the candidate defines replaced by a stub that sends
  the call out (the parent relays it to the candidate) and decodes the reply into plain builtins, so a test's
  `==`, `<` or `abs()` compares only trusted values. It reports `{"result": i, "passed"}` per test, then
  `{"done": true}`.

Protocol lines go on a copy of the original stdout; the code's own prints go to stderr, its stdin is empty.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import os
import sys
import traceback
import types
from typing import IO, Any

MAX_DEPTH = 100  # nesting of a plain value
MAX_MESSAGE = 300  # characters of an error message kept
MAX_INT_DIGITS = 100_000  # an int with more digits is not plain data (parsing one costs quadratic time)
# Exceptions a candidate's error may raise in the checker by name (a test may expect one); any other name
# raises CandidateError. Never StopIteration: `all(map(f, xs))` would read it as the end of the items.
RAISABLE: dict[str, type[Exception]] = {e.__name__: e for e in (
    ValueError, TypeError, IndexError, KeyError, LookupError, ZeroDivisionError, ArithmeticError, OverflowError,
    AttributeError, NameError, RuntimeError, RecursionError, NotImplementedError, AssertionError, UnicodeError)}


class Unplain(Exception):
    """A value that is not plain data (None, bool, int, float, str, bytes and lists, tuples, sets, dicts)."""


class CandidateError(Exception):
    """The candidate's call failed in a way a test cannot expect: no reply, a bad one, an unknown exception."""


def encode(v: Any, depth: int = 0) -> Any:
    """`v` as JSON data; exact builtin types only (a subclass, e.g. one overriding `__eq__`, is Unplain)."""
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return v
    if depth >= MAX_DEPTH:
        raise Unplain("nested too deep")
    if t is list:
        return [encode(x, depth + 1) for x in v]
    if t in (tuple, set, frozenset):
        return {t.__name__: [encode(x, depth + 1) for x in v]}
    if t is bytes:
        return {"bytes": v.hex()}
    if t is dict:
        return {"dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]}
    raise Unplain(t.__name__)


def decode(j: Any, depth: int = 0) -> Any:
    """The plain value `encode` wrote; ValueError for anything else."""
    t = type(j)
    if j is None or t in (bool, int, float, str):
        return j
    if depth >= MAX_DEPTH:
        raise ValueError("nested too deep")
    if t is list:
        return [decode(x, depth + 1) for x in j]
    if t is not dict or len(j) != 1:
        raise ValueError(f"not an encoded value: {t.__name__}")
    (tag, body), = j.items()
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError(f"bad {tag!r} body")
    items = [decode(x, depth + 1) for x in body]
    if tag == "tuple":
        return tuple(items)
    if tag == "set":
        return set(items)
    if tag == "frozenset":
        return frozenset(items)
    if tag == "dict" and all(type(p) is list and len(p) == 2 for p in items):
        return {k: v for k, v in items}
    raise ValueError(f"bad tag {tag!r}")


def _send(out: IO[str], msg: dict[str, Any]) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def _error(e: BaseException) -> dict[str, str]:
    try:
        message = str(e)[:MAX_MESSAGE]
    except BaseException:  # noqa: BLE001 - a hostile __str__ may raise anything
        message = "?"
    return {"error": type(e).__name__, "message": message}


# ---- candidate ----------------------------------------------------------------------------------------------

def _describe(ns: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """What each name is: "callable", {"module": name}, {"value": plain value} or "missing"."""
    out: dict[str, Any] = {}
    for name in names:
        v = ns.get(name, ns)
        if v is ns:
            out[name] = "missing"
        elif isinstance(v, types.ModuleType):
            out[name] = {"module": v.__name__}
        elif callable(v):
            out[name] = "callable"
        else:
            try:
                out[name] = {"value": encode(v)}
            except (Unplain, RecursionError):
                out[name] = "missing"
    return out


def _answer(ns: dict[str, Any], req: dict[str, Any], load_error: BaseException | None) -> dict[str, Any]:
    if "describe" in req:
        return {"ok": encode(_describe(ns, [str(n) for n in req["describe"]]))}
    if load_error is not None:
        return {"error": "CandidateError", "message": f"the code raised {type(load_error).__name__} when run"}
    fn = ns.get(req["fn"])
    if not callable(fn):
        return {"error": "NameError", "message": f"name {req['fn']!r} is not defined"}
    try:
        result = fn(*decode(req["args"]), **decode(req["kwargs"]))
    except BaseException as e:  # noqa: BLE001 - whatever the call raises is its answer
        return _error(e)
    try:
        return {"ok": encode(result)}
    except (Unplain, RecursionError):
        return {"unserialisable": type(result).__name__}


def serve(code: str, proto_in: IO[str], proto_out: IO[str]) -> None:
    """Run the model's code as `__main__`, then answer calls until stdin closes."""
    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    load_error = None
    try:
        exec(compile(code, "<candidate>", "exec"), ns)
    except BaseException as e:  # noqa: BLE001 - calls are answered with the error
        traceback.print_exc()
        load_error = e
    for line in proto_in:
        req: Any = None
        try:
            req = json.loads(line)
            reply = _answer(ns, req, load_error)
        except BaseException as e:  # noqa: BLE001 - every request gets a reply
            reply = _error(e)
        reply["id"] = req.get("id") if isinstance(req, dict) else None
        try:
            _send(proto_out, reply)
        except (Unplain, ValueError, RecursionError):
            _send(proto_out, {"id": reply["id"], "error": "CandidateError", "message": "unreadable reply"})


# ---- checker ------------------------------------------------------------------------------------------------

class _Link:
    """The checker's end of the calls to the candidate."""

    def __init__(self, proto_in: IO[str], proto_out: IO[str]) -> None:
        self.proto_in, self.proto_out, self.last_id = proto_in, proto_out, 0

    def ask(self, req: dict[str, Any]) -> Any:
        """Send one request; the decoded plain value of the reply, or the exception it stands for."""
        self.last_id += 1
        _send(self.proto_out, {"call": {**req, "id": self.last_id}})
        line = self.proto_in.readline()
        try:
            rep = json.loads(line)
        except (ValueError, RecursionError):
            raise CandidateError("unreadable reply") from None
        if type(rep) is not dict or rep.get("id") != self.last_id:
            raise CandidateError("a reply to another call")
        if "ok" in rep:
            try:
                return decode(rep["ok"])
            except (ValueError, TypeError, RecursionError) as e:
                raise CandidateError(f"a reply that is not plain data: {e}") from None
        if "unserialisable" in rep:
            raise CandidateError(f"returned a {str(rep['unserialisable'])[:80]}, not plain data")
        name, message = rep.get("error"), rep.get("message")
        message = message[:MAX_MESSAGE] if isinstance(message, str) else ""
        raise RAISABLE.get(name, CandidateError)(message) if isinstance(name, str) else CandidateError(message)

    def stub(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                req = {"fn": name, "args": encode(list(args)), "kwargs": encode(kwargs)}
            except Unplain as e:
                raise TypeError(f"{name}: an argument is not plain data ({e})") from None
            return self.ask(req)

        call.__name__ = call.__qualname__ = name
        return call


def _free_names(tests: list[str]) -> set[str]:
    """Names the tests read but never bind."""
    loaded: set[str] = set()
    bound: set[str] = set()
    for test in tests:
        try:
            tree = ast.parse(test)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    return loaded - bound


def _bind(g: dict[str, Any], link: _Link, kinds: Any, names: list[str]) -> None:
    """Give each free name what the candidate says it is: a stub, a module of the same name (imported here),
    or a plain value; anything else stays undefined (the test fails with NameError)."""
    if type(kinds) is not dict:
        return
    for name in names:
        kind = kinds.get(name)
        if kind == "callable":
            g[name] = link.stub(name)
        elif type(kind) is dict and kind.get("module") == name:
            try:
                g[name] = importlib.import_module(name)
            except ImportError:
                pass
        elif type(kind) is dict and "value" in kind:
            g[name] = kind["value"]


def check(material: dict[str, Any], link: _Link) -> None:
    """Run the setup, bind the stubs, then each test; report each test's result, then done."""
    g: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    tests = [str(t) for t in material["tests"]]
    try:
        exec(compile(material["setup"], "<setup>", "exec"), g)
    except BaseException as e:  # noqa: BLE001 - reported: every test fails
        traceback.print_exc()
        _send(link.proto_out, {"setup_error": _error(e)})
        _send(link.proto_out, {"done": True})
        return
    for name in material["stubs"]:
        g[name] = link.stub(name)
    free = sorted(_free_names(tests) - set(g) - set(dir(builtins)))
    if free:
        try:
            _bind(g, link, link.ask({"describe": free}), free)
        except Exception:  # noqa: BLE001 - unbound names fail their tests
            traceback.print_exc()
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {i}>", "exec"), g)
            _send(link.proto_out, {"result": i, "passed": True})
        except BaseException as e:  # noqa: BLE001 - any exception fails this test only
            _send(link.proto_out, {"result": i, "passed": False, **_error(e)})
    _send(link.proto_out, {"done": True})


def main() -> None:
    """Keep copies of stdin and stdout for the protocol; the code's stdin is empty and its stdout is stderr."""
    sys.set_int_max_str_digits(MAX_INT_DIGITS)
    proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8", errors="replace", newline="\n")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8", newline="\n")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    material = json.loads(proto_in.readline())
    if material["role"] == "candidate":
        serve(material["code"], proto_in, proto_out)
        return
    link = _Link(proto_in, proto_out)
    for line in proto_in:  # one check per line, each in fresh globals
        check(json.loads(line), link)


if __name__ == "__main__":
    main()
