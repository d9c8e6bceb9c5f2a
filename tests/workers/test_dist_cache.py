"""workers/dist_cache.py: the import-name -> distributions map kept on disk is importlib's own answer, a new
install is seen at once (a new cache file, not the old answer), and a damaged or unwritable cache is computed
around, never trusted."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from workers import dist_cache


def _install(site, name: str, top: str) -> None:
    """A distribution `name` whose import name is `top`, as pip lays it out (dist-info with top_level.txt)."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(f"{top}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A sys.path of one empty site folder while the test runs: importlib then reads only the distributions
    the test installs (the real site-packages' 48,000 RECORD paths take seconds per call)."""
    import json  # noqa: F401  # what dist_cache and importlib import lazily, imported before sys.path is cut
    import tempfile  # noqa: F401

    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.setattr(sys, "path", [str(folder)])
    return folder


def test_the_kept_map_is_importlibs_and_the_second_read_comes_from_the_file(site, tmp_path):
    _install(site, "probe-dist-a", "probe_a")
    cache = tmp_path / "cache"
    first = dist_cache.packages_distributions(cache)
    assert first == {k: list(v) for k, v in importlib.metadata.packages_distributions().items()}
    assert first["probe_a"] == ["probe-dist-a"]
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"
    calls = []
    again = dist_cache.packages_distributions(cache, compute=lambda: calls.append(1) or {})
    assert again == first and not calls  # answered from the file, importlib not asked


def test_an_install_is_a_new_key_and_is_seen(site, tmp_path):
    cache = tmp_path / "cache"
    _install(site, "probe-dist-a", "probe_a")
    before = dist_cache.cache_key(list(sys.path))
    assert "probe_b" not in dist_cache.packages_distributions(cache)
    _install(site, "probe-dist-b", "probe_b")
    assert dist_cache.cache_key(list(sys.path)) != before
    assert dist_cache.packages_distributions(cache)["probe_b"] == ["probe-dist-b"]
    assert len(list(cache.iterdir())) == 2


@pytest.mark.parametrize("content", ["not json", '{"probe_a": "not a list"}', '["a"]', '{"probe_a": [1]}'])
def test_a_damaged_cache_file_is_computed_again_and_replaced(site, tmp_path, content):
    _install(site, "probe-dist-a", "probe_a")
    cache = tmp_path / "cache"
    cache.mkdir()
    path = cache / f"packages-distributions-{dist_cache.cache_key(list(sys.path))}.json"
    path.write_text(content)
    got = dist_cache.packages_distributions(cache)
    assert got["probe_a"] == ["probe-dist-a"]
    assert dist_cache.packages_distributions(cache, compute=dict) == got  # the file was rewritten whole


def test_an_unwritable_cache_folder_still_answers(site, tmp_path):
    _install(site, "probe-dist-a", "probe_a")
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder would go")
    assert dist_cache.packages_distributions(blocked / "cache")["probe_a"] == ["probe-dist-a"]


def test_a_path_entry_without_distributions_changes_no_key_until_it_gains_one(site, tmp_path):
    """A Ray worker's sys.path has session folders of its own: they must not make a new cache file per
    session, yet a distribution installed there must be seen."""
    _install(site, "probe-dist-a", "probe_a")
    before = dist_cache.cache_key(list(sys.path))
    plain = tmp_path / "session"
    plain.mkdir()
    (plain / "module.py").write_text("")
    sys.path.insert(0, str(plain))  # the fixture's list: set back whole after the test
    assert dist_cache.cache_key(list(sys.path)) == before
    _install(plain, "probe-dist-c", "probe_c")
    assert dist_cache.cache_key(list(sys.path)) != before
    assert dist_cache.packages_distributions(tmp_path / "cache")["probe_c"] == ["probe-dist-c"]
