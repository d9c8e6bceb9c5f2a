"""Tools the policy can call: built in (`calculator`, `python` in the sandbox) or a user's `module:function`.

A tool's JSON schema (what the chat template shows the model, `Tool.schema`) is built from the function's
signature: each parameter typed from its annotation (str, int, float, bool, list, dict; unannotated: string),
required unless it has a default, the description the docstring's first line. A function may declare its
schema instead, as an attribute `tool_schema` (OpenAI's `{"name", "description", "parameters"}`, or that
object under `{"type": "function", "function": ...}`).

`check_call` and `finish_call` turn every failure (unknown tool, bad arguments, an exception, a timeout) into
an error text for the model and an error kind for the metrics; they never raise.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import operator
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.agent.calls import Call, CallRunner
from workers.agent.toolcalls import ToolCall
from workers.sandbox import SandboxLimits, run_code

MAX_RESULT_CHARS = 2_000


JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
                              dict: "object"}


@dataclass
class Tool:
    name: str
    fn: Callable[..., Any]
    description: str = ""
    declared: dict[str, Any] | None = field(default=None, repr=False)  # the function's own `tool_schema`

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema that chat templates render (`apply_chat_template(tools=...)`)."""
        if self.declared is not None:
            return {"type": "function", "function": {**self.declared, "name": self.name}}
        props: dict[str, Any] = {}
        required = []
        hints = _hints(self.fn)
        for p in inspect.signature(self.fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            props[p.name] = {"type": _json_type(hints.get(p.name, str))}
            if p.default is p.empty:
                required.append(p.name)
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": {"type": "object", "properties": props,
                                                                "required": required}}}


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - an unresolvable annotation is typed as a string
        return {}


def _json_type(hint: Any) -> str:
    """The JSON schema type of an annotation (`int`, `list[str]`, `float | None`, ...); unknown: string."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        return _json_type(kinds[0]) if len(kinds) == 1 else "string"
    return JSON_TYPES.get(origin or hint, "string")


def _declared_schema(spec: str, fn: Callable[..., Any]) -> dict[str, Any] | None:
    """The function's `tool_schema` attribute as an OpenAI function object, checked; None if it has none."""
    declared = getattr(fn, "tool_schema", None)
    if declared is None:
        return None
    if isinstance(declared, dict) and declared.get("type") == "function" and "function" in declared:
        declared = declared["function"]
    params = declared.get("parameters") if isinstance(declared, dict) else None
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ValueError(f"tool {spec!r}: tool_schema needs 'parameters' with type 'object', got {declared!r:.120}")
    return dict(declared)


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses on numbers)."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            if isinstance(node.op, ast.Pow) and abs(ev(node.right)) > 64:
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element: {type(node).__name__}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    value = ev(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else repr(value)


def python(code: str) -> str:
    """Run Python code in the sandbox; returns its stdout (and stderr on failure)."""
    r = run_code(code, SandboxLimits(wall_s=10, cpu_s=5, max_output_bytes=MAX_RESULT_CHARS * 4))
    if r.status == "ok":
        return r.stdout
    return f"{r.stdout}\n[{r.status}] {r.stderr[-500:]}".strip()


BUILTIN: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python}


def load_tools(specs: list[str]) -> dict[str, Tool]:
    """Tools by spec: a built-in name or `module:function` (named after the function)."""
    tools = {}
    for spec in specs:
        if spec in BUILTIN:
            fn = BUILTIN[spec]
        elif ":" in spec:
            module, _, attr = spec.partition(":")
            fn = getattr(importlib.import_module(module), attr)
        else:
            raise ValueError(f"unknown tool {spec!r}: a built-in ({', '.join(BUILTIN)}) or module:function")
        if not callable(fn):
            raise ValueError(f"tool {spec!r} is not a function")
        name = spec if spec in BUILTIN else spec.partition(":")[2]
        tools[name] = Tool(name, fn, (inspect.getdoc(fn) or "").split("\n")[0], _declared_schema(spec, fn))
    return tools


def tool_schemas(tools: dict[str, Tool]) -> list[dict[str, Any]] | None:
    """The schemas to render into the prompt (`apply_chat_template(tools=...)`); None without tools."""
    return [t.schema() for t in tools.values()] or None


def check_call(call: ToolCall, tools: dict[str, Tool]) -> tuple[str, str] | None:
    """(error text, error kind) when the call cannot run (malformed, unknown tool, bad arguments), else None."""
    if call.error:
        return f"error: {call.error}", call.error.split(":")[0]
    tool = tools.get(call.name)
    if tool is None:
        return f"error: unknown tool {call.name!r}; tools: {', '.join(tools)}", "unknown tool"
    try:
        inspect.signature(tool.fn).bind(**call.arguments)
    except TypeError as e:
        return f"error: bad arguments for {call.name}: {e}", "bad arguments"
    return None


def _invoke(fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    return fn(**arguments)


def start_call(call: ToolCall, tools: dict[str, Tool], runner: CallRunner,
               timeout_s: float) -> Call | tuple[str, str | None]:
    """The checked call started on `runner` (its outcome read later by `finish_call`), or its error now."""
    bad = check_call(call, tools)
    if bad is not None:
        return bad
    return runner.submit(_invoke, tools[call.name].fn, call.arguments, timeout_s=timeout_s, name=f"tool {call.name}")


def finish_call(call: ToolCall, running: Call | tuple[str, str | None]) -> tuple[str, str | None]:
    """(result text for the model, error kind or None) of a call `start_call` returned, once resolved."""
    if isinstance(running, tuple):
        return running
    try:
        out = running.result()
    except TimeoutError:
        return f"error: {call.name} timed out after {running.timeout_s:g} s", "timeout"
    except Exception as e:  # noqa: BLE001 - a tool's failure is the model's feedback, not the run's
        return f"error: {call.name} raised {type(e).__name__}: {e}"[:MAX_RESULT_CHARS], "exception"
    return str(out)[:MAX_RESULT_CHARS], None


def run_call(call: ToolCall, tools: dict[str, Tool], runner: CallRunner, timeout_s: float) -> tuple[str, str | None]:
    """One call, start to finish: returns by `timeout_s` even when the tool never does."""
    running = start_call(call, tools, runner, timeout_s)
    while isinstance(running, Call) and not running.resolved:
        runner.wait(timeout_s)
    return finish_call(call, running)
