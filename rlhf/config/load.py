"""Load a YAML preset, apply dotted overrides, check types against the schema, and validate."""

from __future__ import annotations

import difflib
import re
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from rlhf.config.schema import RunConfig
from rlhf.errors import ConfigError

_OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*=.+$", re.S)


def _known_keys(node: Any, prefix: str = "") -> list[str]:
    """All dotted keys of a schema dataclass, for "did you mean" hints."""
    keys = []
    hints = typing.get_type_hints(type(node))
    for f in fields(node):
        key = f"{prefix}{f.name}"
        keys.append(key)
        value = getattr(node, f.name)
        if value is None:  # an optional section (`policy.lora`): its keys are known too
            value = next((t() for t in typing.get_args(hints[f.name]) if isinstance(t, type) and is_dataclass(t)),
                         None)
        if is_dataclass(value):
            keys += _known_keys(value, key + ".")
    return keys


def _did_you_mean(key: str) -> str:
    known = _known_keys(RunConfig())
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:  # try the last component alone, within its section
        last = key.rsplit(".", 1)[-1]
        close = [k for k in known if difflib.get_close_matches(last, [k.rsplit(".", 1)[-1]], cutoff=0.75)]
    return f" (did you mean '{close[0]}'?)" if close else ""


def _read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file {p}{where} is not valid YAML: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _parse_overrides(overrides: list[str]) -> list[str]:
    for item in overrides:
        if not _OVERRIDE.match(item):
            raise ConfigError(
                f"invalid override {item!r}: expected KEY=VALUE with a dotted key and a non-empty value, "
                "e.g. trainer.total_steps=5"
            )
    return list(overrides)


# settings that were removed: key -> what replaces it (named in the error)
REMOVED = {
    "rollout.verify_first_sync": "rollout.verify_every (the log-prob canary after the first sync and every N-th "
                                 "after it; 0: never)",
    "rollout.verify_every_sync": "rollout.verify_every=1 (the log-prob canary after every sync)",
}


def _merge(base: Any, update: Any, source: str) -> Any:
    try:
        return OmegaConf.merge(base, update)
    except ConfigKeyError as e:
        key = e.full_key or str(e.key)
        if key in REMOVED:
            raise ConfigError(f"{source}: '{key}' was removed; use {REMOVED[key]}") from None
        raise ConfigError(f"{source}: unknown key '{key}'{_did_you_mean(key)}") from None
    except ValidationError as e:
        raise ConfigError(f"{source}: field '{e.full_key}': {str(e.msg).splitlines()[0]}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{source}: {str(e).splitlines()[0]}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, validate: bool = True,
                overlays: list[str | Path] | None = None) -> RunConfig:
    """Build a `RunConfig` from a YAML file, overlay YAML files merged over it in order (e.g. one written by
    `rlhf plan`) and `KEY=VALUE` overrides; raise ConfigError on anything bad."""
    cfg = OmegaConf.structured(RunConfig)
    if path is not None:
        cfg = _merge(cfg, _read_yaml(path), f"config file {path}")
    for overlay in overlays or []:
        cfg = _merge(cfg, _read_yaml(overlay), f"config file {overlay}")
    if overrides:
        dotlist = _parse_overrides(overrides)
        try:
            update = OmegaConf.from_dotlist(dotlist)
        except OmegaConfBaseException as e:
            raise ConfigError(f"overrides: {str(e).splitlines()[0]}") from None
        cfg = _merge(cfg, update, "override")
    run: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    if validate:
        from rlhf.config.validate import validate_config

        validate_config(run)
    return run


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (it loads back with `load_config`)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
