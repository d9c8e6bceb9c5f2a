"""The documentation site: the generated reference pages match the code, the site builds strictly (a broken link
or anchor, or a page left out of the nav, fails it), each recipe names its example config and its measurement,
and the README front page links only to files that exist."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from rlhf import api_reference
from rlhf.config import reference
from rlhf.config.schema import RunConfig
from rlhf.config.validate import ROLLOUT_MODES

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
# recipe page -> the example config it is built around (each with a measured result in bench/RESULTS.md)
RECIPE_CONFIGS = {
    "pretrain": "configs/pretrain_tiny.yaml", "sft": "configs/sft_tiny.yaml", "dpo": "configs/dpo_tiny.yaml",
    "reward-model": "configs/rm_tiny.yaml", "ppo": "configs/ppo_tiny.yaml", "grpo": "configs/grpo_tiny.yaml",
    "moe": "configs/grpo_tiny_moe.yaml", "deepseek": "configs/grpo_tiny_deepseek.yaml",
    "lora": "configs/grpo_tiny_lora.yaml", "agents": "configs/grpo_tiny_tools.yaml",
    "vision-language": "configs/grpo_shapes_vl.yaml",
}
# recipes measured by a bench script rather than an example config
RECIPE_MEASURED = ("evaluation", "planning", "multi-node")


def _keys(prefix: str, cls: type) -> list[str]:
    """Every dotted key of a schema section, nested sections (also optional ones: `lora`) included."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        sub = next((t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)), None)
        out += _keys(key, sub) if isinstance(sub, type) else [key]
    return out


def test_config_reference_is_current():
    page = reference.PAGE.read_text()
    assert page == reference.render(), "docs/reference/config.md is stale: run `python -m rlhf.config.reference`"


def test_config_reference_has_every_field_and_the_validators_choices():
    page = reference.PAGE.read_text()
    keys = []
    for top in dataclasses.fields(RunConfig):
        if top.name in ("reference", "critic", "reward_model", "teacher"):
            continue  # the roles share one section, written <role>
        keys += _keys("<role>" if top.name == "policy" else top.name, typing.get_type_hints(RunConfig)[top.name])
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert not missing and len(keys) > 150, f"keys without a row in docs/reference/config.md: {missing}"
    mode_row = next(line for line in page.splitlines() if line.startswith("| `rollout.mode` |"))
    assert all(f"`{m}`" in mode_row for m in ROLLOUT_MODES), mode_row
    critic_enabled = next(line for line in page.splitlines() if line.startswith("| `<role>.enabled` |"))
    assert "critic: `false`" in critic_enabled and "policy: `true`" in critic_enabled, critic_enabled


def test_reference_checks_fail_on_a_stale_page(tmp_path):
    for module, page in ((reference, reference.PAGE), (api_reference, api_reference.PAGE)):
        stale = tmp_path / page.name
        stale.write_text(page.read_text().replace("\n| `", "\n| `x", 1).replace("\n## `", "\n## `x", 1))
        assert module.main(["--check", "--out", str(stale)]) == 1


def test_api_reference_is_current_and_complete():
    import rlhf.api

    page = api_reference.PAGE.read_text()
    assert page == api_reference.render(), "docs/reference/api.md is stale: run `python -m rlhf.api_reference`"
    missing = [name for name in rlhf.api.__all__ if f"## `{name}`" not in page]
    assert not missing, f"names of rlhf.api without a section: {missing}"
    for method in ("RolloutHandle.generate", "RolloutHandle.sync_weights", "PolicyHandle.train"):
        assert f"`{method}`" in page, method


def _build(config: Path, site: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=cwd, env=ENV, capture_output=True, text=True, timeout=120)


def test_site_builds_strictly(tmp_path):
    out = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stdout + out.stderr
    for page in ("reference/config/index.html", "recipes/grpo/index.html", "bench/RESULTS/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_strict_build_fails_on_a_broken_link_or_anchor(tmp_path):
    """The real config's validation settings, on a one-page site with a link to a missing page and one to a
    missing anchor: the build fails and names both."""
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n## Here\n\nSee [there](missing.md) and [here](#no-such-anchor).\n")
    cfg.update(docs_dir=str(docs), nav=[{"Home": "index.md"}])
    config = tmp_path / "mkdocs.yml"
    config.write_text(yaml.safe_dump(cfg))
    out = _build(config, tmp_path / "site", cwd=tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode != 0 and "missing.md" in log and "no-such-anchor" in log, log


@pytest.mark.parametrize("recipe", sorted(RECIPE_CONFIGS))
def test_recipe_names_its_example_and_measurement(recipe):
    page = (DOCS / "recipes" / f"{recipe}.md").read_text()
    config = RECIPE_CONFIGS[recipe]
    assert (ROOT / config).is_file(), config
    assert config in page, f"docs/recipes/{recipe}.md does not name {config}"
    assert "](../bench/RESULTS.md#" in page, f"docs/recipes/{recipe}.md links to no measurement"


def test_measured_recipes_link_their_measurement():
    for recipe in RECIPE_MEASURED:
        assert "](../bench/RESULTS.md#" in (DOCS / "recipes" / f"{recipe}.md").read_text(), recipe


def test_readme_is_a_front_page_whose_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 220
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links to no page"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    results = text[text.index("## Results"):].split("\n## ", 1)[0]
    rows = [line for line in results.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    unlinked = [row for row in rows if "bench/RESULTS.md" not in row]
    assert rows and not unlinked, f"README results rows without a link to their measurement: {unlinked}"


def test_code_map_names_every_driver_module():
    """docs/concepts/architecture.md follows the tree: each module of rlhf/driver's subpackages is named in the
    row of its subpackage, and every path the map names exists."""
    page = (DOCS / "concepts" / "architecture.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in page.splitlines() if line.startswith("| `rlhf/driver/")}
    missing = []
    for module in sorted((ROOT / "rlhf" / "driver").glob("*/*.py")):
        row = rows.get(f"rlhf/driver/{module.parent.name}/", "")
        if module.name != "__init__.py" and f"`{module.name}`" not in row:
            missing.append(str(module.relative_to(ROOT)))
    assert not missing, f"docs/concepts/architecture.md does not name these modules in their folder's row: {missing}"
    named = re.findall(r"`((?:rlhf|workers|algorithms|examples|tests|bench|deploy|configs)/[^`]*)`", page)
    gone = [path for path in named if not (ROOT / path).exists()]
    assert not gone, f"docs/concepts/architecture.md names paths that do not exist: {gone}"
