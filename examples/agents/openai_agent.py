"""An agent written only against the `openai` client, trained by `rlhf train configs/grpo_tiny_openai_agent.yaml`.

It answers "What is a*b?" with a calculator tool in its own loop: it asks the model (with the tool's schema),
runs every tool call the model makes on its own calculator and sends the result back, until the model answers
without a call. It returns None, so the run's `reward.fn` (exact match) scores the last answer; an agent that
can judge its own result returns a number instead. Nothing here imports the training library: the same
function runs against any OpenAI-compatible server (`run(openai.OpenAI(base_url=..., api_key=...), task)`).
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

MAX_TURNS = 2  # the model's turns: a calculator call, then the answer (the run allows rollout.max_turns)

CALCULATOR = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses on numbers).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}

_OPS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                         ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
                         ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Arithmetic only: numbers, + - * / // % ** (exponents up to 64) and parentheses; an error text else."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("not arithmetic")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (ValueError, SyntaxError, ZeroDivisionError, TypeError, RecursionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else str(value)


def run(client: Any, task: dict[str, Any]) -> float | None:
    """One episode on `task` (a prompt record: `messages`, `ground_truth`); None: reward.fn scores it."""
    messages: list[dict[str, Any]] = list(task["messages"])
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = calculate(str(args["expression"])) if call.function.name == "calculator" else \
                    f"error: unknown tool {call.function.name!r}"
            except (ValueError, KeyError, TypeError) as e:
                result = f"error: bad arguments: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
