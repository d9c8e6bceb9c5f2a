"""Tools the policy can call: built in (`calculator`, `python` in the sandbox) or a user's `module:function`.

`run_call` turns every failure (unknown tool, bad arguments, an exception, a timeout) into an error text for
the model and an error kind for the metrics; it never raises.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import operator
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from workers.agent.toolcalls import ToolCall
from workers.sandbox import SandboxLimits, run_code

MAX_RESULT_CHARS = 2_000


@dataclass
class Tool:
    name: str
    fn: Callable[..., Any]
    description: str = ""

    def schema(self) -> dict[str, Any]:
        """The JSON schema chat templates render into the system prompt."""
        params = {p: {"type": "string"} for p in inspect.signature(self.fn).parameters}
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": {"type": "object", "properties": params,
                                                                "required": list(params)}}}


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
        name = spec if spec in BUILTIN else spec.partition(":")[2]
        tools[name] = Tool(name, fn, (inspect.getdoc(fn) or "").split("\n")[0])
    return tools


def run_call(call: ToolCall, tools: dict[str, Tool], pool: ThreadPoolExecutor, timeout_s: float) -> tuple[str, str | None]:
    """(result text for the model, error kind or None)."""
    if call.error:
        return f"error: {call.error}", call.error.split(":")[0]
    tool = tools.get(call.name)
    if tool is None:
        return f"error: unknown tool {call.name!r}; tools: {', '.join(tools)}", "unknown tool"
    try:
        inspect.signature(tool.fn).bind(**call.arguments)
    except TypeError as e:
        return f"error: bad arguments for {call.name}: {e}", "bad arguments"
    future = pool.submit(tool.fn, **call.arguments)
    try:
        out = future.result(timeout=timeout_s)
    except FutureTimeout:
        return f"error: {call.name} timed out after {timeout_s:g} s", "timeout"
    except Exception as e:  # noqa: BLE001 - a tool's failure is the model's feedback, not the run's
        return f"error: {call.name} raised {type(e).__name__}: {e}"[:MAX_RESULT_CHARS], "exception"
    return str(out)[:MAX_RESULT_CHARS], None
