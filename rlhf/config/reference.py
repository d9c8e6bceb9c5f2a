"""The config reference page, generated from the schema: every field of `RunConfig` with its type, default,
allowed values and documentation, grouped by section.

The documentation of a field is the comment above it or beside it in its dataclass (the schema's sections are
built on worker config classes, so each field's comment is read from the class that declares it); its allowed
values are those the validator checks (`_choice` and `_require` calls in `rlhf/config/validate.py`), so the
page says what a run accepts, not what someone wrote down.

    python -m rlhf.config.reference            # writes docs/reference/config.md
    python -m rlhf.config.reference --check    # exit 1 when that page differs from the schema
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

from rlhf.config import validate
from rlhf.config.schema import RunConfig
from rlhf.generated_page import page_main

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "config.md"
ROLES = ("policy", "reference", "critic", "reward_model", "teacher")
ROLE = "<role>"


@dataclasses.dataclass
class Row:
    """One field of the reference: its dotted key and what the page says about it."""

    key: str
    type: str
    default: str
    allowed: str
    doc: str


def _type_name(tp: Any) -> str:
    """A readable name of an annotation: `int`, `str | None`, `list[str]`, `tuple[float, float]`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # "or", not "|": a pipe in a table cell splits it on GitHub
        return " or ".join("None" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is Any:
        return "Any"
    return getattr(tp, "__name__", str(tp))


def _yaml(value: Any) -> str:
    """A default as it would be written in a YAML config."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment in `cls`'s own source: the comment lines right above it, then the one beside it."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, str] = {}
    cls_node = ast.parse(source).body[0]
    assert isinstance(cls_node, ast.ClassDef)
    for node in cls_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments.get(line, ""))
            line -= 1
        beside = comments.get(node.lineno) if node.end_lineno == node.lineno else comments.get(node.end_lineno or 0)
        out[node.target.id] = " ".join([*above, *([beside] if beside else [])]).strip()
    return out


def _declaring_class(cls: type, name: str) -> type:
    """The class in `cls`'s MRO whose own body declares field `name`."""
    for klass in cls.__mro__:
        if name in klass.__dict__.get("__annotations__", {}):
            return klass
    return cls


def _field_patterns(node: ast.expr, loops: dict[str, list[str]]) -> list[str]:
    """The dotted keys a validator call names: a string, or an f-string whose placeholders are the role's
    `name` (written `<role>.`) or the variable of an enclosing loop over string constants (one key per value).
    Empty for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if not isinstance(node, ast.JoinedStr):
        return []
    keys = [""]
    for v in node.values:
        if isinstance(v, ast.Constant):
            keys = [k + str(v.value) for k in keys]
        elif isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name) and v.value.id == "name":
            keys = [k + ROLE for k in keys]
        elif isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name) and v.value.id in loops:
            keys = [k + value for k in keys for value in loops[v.value.id]]
        else:
            return []
    return keys


def _validator_calls(node: ast.AST, loops: dict[str, list[str]]) -> list[tuple[ast.Call, dict[str, list[str]]]]:
    """Every call under `node`, with the values of the enclosing `for x in ("a", "b")` loops' variables."""
    if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Tuple | ast.List):
        values = [e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        if len(values) == len(node.iter.elts):
            loops = {**loops, node.target.id: values}
    out = [(node, loops)] if isinstance(node, ast.Call) else []
    for child in ast.iter_child_nodes(node):
        out += _validator_calls(child, loops)
    return out


def _text(node: ast.expr) -> str | None:
    """The text of a validator's `expected` argument; an f-string's placeholders are shown as `...`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else "..." for v in node.values)
    return None


def _namespace(tree: ast.Module) -> dict[str, Any]:
    """validate.py's globals plus the names its functions import locally (for evaluating choice lists)."""
    ns = dict(vars(validate))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.col_offset > 0:
            module = __import__(node.module, fromlist=[a.name for a in node.names])
            for alias in node.names:
                ns[alias.asname or alias.name] = getattr(module, alias.name)
    return ns


def validator_rules() -> dict[str, str]:
    """Dotted key (roles as `<role>.`) -> the values or range the validator accepts, read from its calls."""
    tree = ast.parse(Path(validate.__file__).read_text())
    ns = _namespace(tree)
    rules: dict[str, str] = {}
    for node, loops in _validator_calls(tree, {}):
        if not (isinstance(node.func, ast.Name) and len(node.args) >= 3):
            continue
        keys = _field_patterns(node.args[1], loops)
        if node.func.id == "_choice" and keys:
            try:
                choices = eval(compile(ast.Expression(node.args[2]), "<validate>", "eval"), ns)  # our own source
            except Exception:  # noqa: BLE001 - a choice list built from a local value: leave the field undescribed
                continue
            for key in keys:
                rules.setdefault(key, "one of " + ", ".join(f"`{c}`" for c in choices))
        elif node.func.id == "_require" and (text := _text(node.args[2])):
            for key in keys:
                rules.setdefault(key, text)
    return rules


def _escape(text: str) -> str:
    """Markdown-safe table cell text: pipes, angle brackets and stars escaped outside `code spans`."""
    parts = text.replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = (parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                    .replace("*", r"\*").replace("_", r"\_"))
    return "`".join(parts).replace("|", r"\|")


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass an annotation holds (also through `X | None`), else None."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg) and isinstance(arg, type):
            return arg
    return None


def _sections(prefix: str, cls: type, value: Any, rules: dict[str, str],
              out: list[tuple[str, type, list[Row]]]) -> None:
    """Append (section key, class, rows) for `cls` and, after it, for each nested dataclass field."""
    hints = typing.get_type_hints(cls)
    rows: list[Row] = []
    nested: list[tuple[str, type, Any]] = []
    comment_cache: dict[type, dict[str, str]] = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        sub = _dataclass_of(hints[f.name])
        current = getattr(value, f.name) if value is not None else None
        if sub is not None and (current is not None or f.default is None):
            nested.append((key, sub, current))
            if current is not None:
                continue
        owner = _declaring_class(cls, f.name)
        doc = comment_cache.setdefault(owner, _field_comments(owner)).get(f.name, "")
        if sub is not None:  # an optional section, off by default
            doc = (doc + f" Its fields are in `{key}` below.").strip()
        if value is None and f.default is not dataclasses.MISSING:
            current = f.default
        elif value is None and f.default_factory is not dataclasses.MISSING:
            current = f.default_factory()
        rows.append(Row(key, _type_name(hints[f.name]), _yaml(current), rules.get(key, ""), doc))
    out.append((prefix, cls, rows))
    for key, sub, current in nested:
        _sections(key, sub, current, rules, out)


def _role_defaults(cfg: RunConfig) -> dict[str, str]:
    """`<role>.` key -> how the roles' defaults differ, for the keys where they do."""
    per_role: dict[str, dict[str, str]] = {}
    for role in ROLES:
        found: list[tuple[str, type, list[Row]]] = []
        _sections(ROLE, type(getattr(cfg, role)), getattr(cfg, role), {}, found)
        for _, _, rows in found:
            for row in rows:
                per_role.setdefault(row.key, {})[role] = row.default
    return {key: "; ".join(f"{role}: `{d}`" for role, d in got.items())
            for key, got in per_role.items() if len(set(got.values())) > 1}


def _doc_of(cls: type) -> str:
    """The class docstring as markdown, or "" for a class that has none of its own."""
    doc = cls.__dict__.get("__doc__")
    if not doc or doc.startswith(f"{cls.__name__}("):  # none, or the signature dataclass() writes in its place
        return ""
    return inspect.cleandoc(doc)


def render() -> str:
    """The whole reference page."""
    cfg = RunConfig()
    rules = validator_rules()
    lines = [
        "# Config reference",
        "",
        "<!-- Generated by `python -m rlhf.config.reference` from rlhf/config/schema.py: do not edit by hand. -->",
        "",
        "Every key of a run config, by section: its type, its default, what the validator accepts (before any",
        "worker starts; blank where any value of the type is accepted) and what it does. Set a key in the YAML",
        "file or on the command line: `rlhf train configs/grpo_tiny.yaml trainer.total_steps=5 policy.parallel.tp=2`.",
        "The four Megatron roles (`policy`, `reference`, `critic`, `reward_model`) share one section layout,",
        "written `<role>` below.",
        "",
    ]
    role_diff = _role_defaults(cfg)
    for top in dataclasses.fields(RunConfig):
        if top.name in ROLES[1:]:
            continue
        prefix = ROLE if top.name == "policy" else top.name
        found: list[tuple[str, type, list[Row]]] = []
        _sections(prefix, type(getattr(cfg, top.name)), getattr(cfg, top.name), rules, found)
        for key, cls, rows in found:
            depth = "##" if "." not in key else "###"
            title = "Roles: `policy`, `reference`, `critic`, `reward_model`" if key == ROLE else f"`{key}`"
            lines += [f"{depth} {title}", ""]
            if doc := _doc_of(cls):
                lines += [doc, ""]
            if not rows:
                continue
            lines += ["| key | type | default | accepted | description |", "|---|---|---|---|---|"]
            for row in rows:
                default = f"`{row.default}`"
                if row.key in role_diff:
                    default = role_diff[row.key]
                lines.append(f"| `{row.key}` | {_escape('`' + row.type + '`')} | {_escape(default)} | {_escape(row.allowed)} "
                             f"| {_escape(row.doc)} |")
            lines.append("")
    return "\n".join(re.sub(r"[ \t]+$", "", line) for line in lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the page, or with --check say whether the checked-in page matches rlhf/config/schema.py."""
    return page_main(render, PAGE, "rlhf.config.reference", "rlhf/config/schema.py", argv)


if __name__ == "__main__":
    sys.exit(main())
