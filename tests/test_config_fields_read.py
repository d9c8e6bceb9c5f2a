"""Every config field is read by some code: a knob that nothing reads silently does nothing.

A read is an attribute access `x.name` (or `getattr(x, "name")`) whose receiver `x` is known to hold the
section that declares the field, so `trainer.seed` is not read by `cfg.data.seed`. The receiver's class comes
from a light reading of the code (no imports of it): `cfg.trainer` (a section's field name), a local set from
one (`t = cfg.trainer`, `a, r = cfg.algorithm, cfg.rollout`), a parameter or variable annotated with the class
(`sp: SamplingConfig`), a constructor or `build(Cls, ...)`, a call whose return annotation names the class,
`self` in the class or a subclass of it (`EngineConfig` reading a field of `EngineOptions`), and `self.attr`
assigned one of these. `vars(section)` (or `asdict`) hands every field of the section on, as in `f(**vars(section))`
or a mapping of settings an objective takes its own from: it reads them all. The config package itself (declaring and validating a field) is not a reader.
"""

from __future__ import annotations

import ast
import re
from dataclasses import fields, is_dataclass
from functools import cache
from pathlib import Path
from typing import Any

from rlhf.config.schema import RunConfig

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("rlhf", "workers", "algorithms")
CONFIG_DIR = ROOT / "rlhf" / "config"  # declaring or validating a field is not reading it


def _sections(cls: type, out: dict[str, set[type]] | None = None) -> dict[str, set[type]]:
    """Field name -> the section classes a field of that name holds, over the whole schema."""
    out = {} if out is None else out
    for f in fields(cls):
        value = getattr(cls(), f.name)
        if is_dataclass(value):
            sub = type(value)
            out.setdefault(f.name, set()).add(sub)
            _sections(sub, out)
    return out


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, type, str]]:
    """(dotted key, section class, field name) of every non-section field."""
    out = []
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            out += _leaves(value, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", type(node), f.name))
    return out


def declarer(section: type, name: str) -> str:
    """The class of `section`'s hierarchy whose own body declares field `name` (the most derived one)."""
    return next(c.__name__ for c in section.__mro__ if name in c.__dict__.get("__annotations__", {}))


class Code:
    """The classes, return annotations and attribute accesses of a set of source texts."""

    def __init__(self, sources: dict[str, str], sections: dict[str, set[type]]) -> None:
        self.trees = {p: ast.parse(s) for p, s in sources.items()}
        self.section_attrs = {k: {c.__name__ for c in v} for k, v in sections.items()}
        runtime = {c for v in sections.values() for s in v for c in s.__mro__ if c is not object}
        self.bases: dict[str, set[str]] = {c.__name__: {b.__name__ for b in c.__bases__} for c in runtime}
        self.field_names = {c.__name__: {f.name for f in fields(c)} for c in runtime}
        self.field_types: dict[str, dict[str, set[str]]] = {}
        for c in runtime:
            self.field_types[c.__name__] = {f.name: {type(getattr(c(), f.name)).__name__} for f in fields(c)
                                            if is_dataclass(getattr(c(), f.name))} if _constructible(c) else {}
        self.scopes: list[tuple[ast.AST, int, str | None, list[ast.AST], list[ast.AST]]] = []
        self.defs: list[ast.AST] = []  # every class and function definition
        for tree in self.trees.values():
            self._scopes(tree, -1, None)
        classes = [d for d in self.defs if isinstance(d, ast.ClassDef)]
        for c in classes:
            self.bases.setdefault(c.name, set()).update(ast.unparse(b).split(".")[-1] for b in c.bases)
        self.returns: dict[str, set[str]] = {}  # function name -> the classes its return annotation names
        for d in self.defs:
            if isinstance(d, ast.FunctionDef | ast.AsyncFunctionDef) and d.returns is not None:
                self.returns.setdefault(d.name, set()).update(self.names_in(d.returns))
        self.attrs: dict[str, dict[str, set[str]]] = {}  # class -> attribute (self.x = ..., x: T in its body)
        for c in classes:
            for item in c.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and self.names_in(item.annotation):
                    self.attrs.setdefault(c.name, {}).setdefault(item.target.id, set()).update(
                        self.names_in(item.annotation))
        self.reads: set[tuple[str, str]] = set()  # (receiver class, attribute)
        for record in (False, True):  # the first pass types self.attr for the methods that read it
            self._pass(record)

    @cache  # noqa: B019 - one Code per test session
    def ancestors(self, name: str) -> frozenset[str]:
        out, todo = {name}, [name]
        while todo:
            for b in self.bases.get(todo.pop(), ()):
                if b not in out:
                    out.add(b)
                    todo.append(b)
        return frozenset(out)

    def names_in(self, annotation: ast.AST) -> set[str]:
        """The known classes an annotation names (`SamplingConfig | dict | None`, a string annotation)."""
        return {n for n in re.findall(r"[A-Za-z_]\w*", ast.unparse(annotation)) if n in self.bases}

    # ---- types of expressions -----------------------------------------------------------------------
    def types(self, e: ast.AST, env: dict[str, set[str]]) -> set[str]:
        if isinstance(e, ast.Name):
            return env.get(e.id, set())
        if isinstance(e, ast.Attribute):
            out = set()
            for t in self.types(e.value, env):
                for c in self.ancestors(t):
                    out |= self.field_types.get(c, {}).get(e.attr, set()) | self.attrs.get(c, {}).get(e.attr, set())
            return out or set(self.section_attrs.get(e.attr, set()))
        if isinstance(e, ast.Call):
            f = e.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name == "build" and e.args:
                return self.names_in(e.args[0])
            if name == "replace" and e.args:
                return self.types(e.args[0], env)
            if name in self.bases:
                return {name}
            return set(self.returns.get(name, set()))
        if isinstance(e, ast.IfExp):
            return self.types(e.body, env) | self.types(e.orelse, env)
        if isinstance(e, ast.BoolOp):
            return set().union(*(self.types(v, env) for v in e.values))
        return set()

    # ---- scopes ---------------------------------------------------------------------------------------
    def _bind(self, target: ast.AST, value: ast.AST | None, env: dict[str, set[str]], cls: str | None,
              extra: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        if isinstance(target, ast.Tuple | ast.List) and isinstance(value, ast.Tuple | ast.List) \
                and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self._bind(t, v, env, cls)
            return
        got = (self.types(value, env) if value is not None else set()) | extra
        if not got:
            return
        if isinstance(target, ast.Name):
            env.setdefault(target.id, set()).update(got)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self" \
                and cls is not None:
            self.attrs.setdefault(cls, {}).setdefault(target.attr, set()).update(got)

    def _scopes(self, scope: ast.AST, parent: int, cls: str | None) -> None:
        """Add `scope` (a module or function) and the scopes nested in it to `self.scopes`, each with the nodes
        that bind a name (assignments, for loops over a literal, with) and those that may read a field."""
        index = len(self.scopes)
        binds: list[ast.AST] = []
        reads: list[ast.AST] = []
        self.scopes.append((scope, parent, cls, binds, reads))
        todo: list[ast.AST] = list(scope.body)  # type: ignore[attr-defined]
        while todo:
            node = todo.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.defs.append(node)
                self._scopes(node, index, cls)
                continue
            if isinstance(node, ast.ClassDef):
                self.defs.append(node)
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        self.defs.append(item)
                        self._scopes(item, index, node.name)
                continue
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.withitem) or (
                    isinstance(node, ast.For | ast.comprehension) and isinstance(node.iter, ast.Tuple | ast.List)):
                binds.append(node)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)) or (
                    isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                reads.append(node)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("vars", "asdict") \
                    and len(node.args) == 1:
                reads.append(node)  # vars(section): every field of the section is handed on
            todo.extend(ast.iter_child_nodes(node))

    def _pass(self, record: bool) -> None:
        """Type every scope's names (its parent's first); with `record`, collect the typed attribute reads."""
        envs: list[dict[str, set[str]]] = []
        for scope, parent, cls, binds, reads in self.scopes:
            env = {k: set(v) for k, v in envs[parent].items()} if parent >= 0 else {}
            if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
                args = scope.args
                for i, a in enumerate([*args.posonlyargs, *args.args, *args.kwonlyargs]):
                    if i == 0 and cls is not None and a.arg in ("self", "cls"):
                        env[a.arg] = {cls}
                    elif a.annotation is not None:
                        env[a.arg] = self.names_in(a.annotation)
            envs.append(env)
            for _ in range(2):  # a later assignment may type an earlier one's value
                for node in binds:
                    if isinstance(node, ast.Assign):
                        for t in node.targets:
                            self._bind(t, node.value, env, cls)
                    elif isinstance(node, ast.AnnAssign):
                        self._bind(node.target, node.value, env, cls, self.names_in(node.annotation))
                    elif isinstance(node, ast.withitem):
                        if node.optional_vars is not None:
                            self._bind(node.optional_vars, node.context_expr, env, cls)
                    else:
                        for v in node.iter.elts:  # type: ignore[attr-defined]
                            self._bind(node.target, v, env, cls)  # type: ignore[attr-defined]
            if record:
                for node in reads:
                    if isinstance(node, ast.Attribute):
                        self.reads |= {(t, node.attr) for t in self.types(node.value, env)}
                    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id != "getattr":
                        self.reads |= {(t, f) for t in self.types(node.args[0], env) for f in self.field_names.get(t, ())}
                    else:
                        call: Any = node
                        self.reads |= {(t, str(call.args[1].value)) for t in self.types(call.args[0], env)}

    def is_read(self, declared_in: str, name: str) -> bool:
        """Some access of `.name` on an instance of `declared_in` or of a subclass of it."""
        return any(attr == name and declared_in in self.ancestors(t) for t, attr in self.reads)


def _constructible(c: type) -> bool:
    try:
        c()
    except TypeError:
        return False
    return True


def _sources() -> dict[str, str]:
    return {str(p): p.read_text() for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py"))
            if CONFIG_DIR not in p.parents}


def test_every_config_field_is_read_outside_the_config_package():
    code = Code(_sources(), _sections(RunConfig))
    unread = sorted(key for key, section, name in _leaves(RunConfig()) if not code.is_read(declarer(section, name), name))
    assert not unread, f"config fields that no code in {', '.join(CODE_DIRS)} reads: {unread}"


def test_the_check_tells_sections_apart():
    sections = _sections(RunConfig)
    code = Code({"a.py": "def f(cfg):\n    t = cfg.trainer\n    return t.seed, cfg.data.prompts_per_step\n",
                 "b.py": "class X:\n    def g(self, sp: SamplingConfig):\n        self.sp = build(SamplingConfig, sp)\n"
                         "    def h(self):\n        return self.sp.top_k, getattr(self.other, 'top_p')\n",
                 "c.py": "def g(rc):\n    return Group(**vars(rc.resources))\n",
                 "d.py": "def h(cfg):\n    options = vars(cfg.reward)\n    return use(options)\n"}, sections)
    assert code.is_read("TrainerConfig", "seed") and code.is_read("DataConfig", "prompts_per_step")
    assert not code.is_read("DataConfig", "seed")  # data.seed: another section's field of the same name
    assert code.is_read("SamplingConfig", "top_k") and not code.is_read("SamplingConfig", "top_p")
    assert code.is_read("ResourceConfig", "num_threads")  # every field of a splatted section
    assert code.is_read("RewardConfig", "memory_mb")  # and of a section handed on whole
    assert not code.is_read("TrainerConfig", "log_every")
