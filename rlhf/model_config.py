"""Reading an HF model's config.json before any model code runs: one reader for the config validation, the
data checks and the planner, so a missing file or broken JSON is reported the same way everywhere (one line
naming the setting, the file and the line)."""

from __future__ import annotations

import json
from pathlib import Path

from rlhf.errors import UserError
from workers.megatron.hf_fields import language_view


def read_config_json(path: str | Path, setting: str, error: type[UserError] = UserError) -> dict:
    """The JSON object in `path` (an HF model folder, or its config.json); `setting` (e.g. "model.path",
    "--model") starts each error message, raised as `error`."""
    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else p
    if not cfg_file.is_file():
        raise error(f"{setting}: {cfg_file} does not exist (expected an HF model folder with config.json)")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{setting}: {cfg_file} line {e.lineno} is not valid JSON: {e.msg}") from None
    if not isinstance(config, dict):
        raise error(f"{setting}: {cfg_file} must hold a JSON object")
    return language_view(config)  # a vision-language model: its text model's fields at the top
