"""What an evaluation task is: its items (prompt, gold answer, options) and how one answer is scored."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.sandbox.verdict import CodeCheck


@dataclass
class Item:
    prompt: str | list[dict[str, str]]  # raw text, or chat messages (the chat template is applied)
    gold: Any
    choices: list[str] = field(default_factory=list)  # multiple choice: the continuations scored
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Task:
    name: str  # as given to --tasks (the key in results.json)
    kind: str  # "choice" (option log-likelihoods) | "generate" (scored answer) | "code" (run tests) | "harness"
    items: list[Item]
    score: Callable[[Item, str], float] | None = None  # generate: 1.0 / 0.0 per response
    stop: list[str] = field(default_factory=list)
    program: Callable[[Item, str], CodeCheck] | None = None  # code: the candidate and the tests it must pass
    short: str = ""  # the name in metric keys (eval/<short>/<metric>): the file's stem, not its path
    config: dict[str, Any] = field(default_factory=dict)  # recorded in results.json (num_fewshot, limit, files)
    harness: Any = None  # kind "harness": the lm-eval task object

    def __post_init__(self) -> None:
        self.short = self.short or self.name
