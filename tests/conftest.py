"""Shared fixtures: offline HF, a GPU marker that skips with the reason, tiny models built once, and the one
embedded Ray of the test process (tests/helpers/ray_cluster.py)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session", autouse=True)
def checkpoint_key(tmp_path_factory):
    """A checkpoint key of the test session (workers/megatron/ckpt_key.py), never the user's own: set in the
    environment, so the CLI's subprocesses and ranks sign and verify with it too."""
    from workers.megatron.ckpt_key import KEY_ENV

    old = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = str(tmp_path_factory.mktemp("checkpoint-key") / "checkpoint.key")
    yield os.environ[KEY_ENV]
    if old is None:
        os.environ.pop(KEY_ENV, None)
    else:
        os.environ[KEY_ENV] = old


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: no GPU on this machine (GPU-only test)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """`factory(preset)` -> path of an HF model folder, created once per session and preset."""
    from rlhf.tiny_models import create_tiny_model

    cache: dict[str, str] = {}

    def factory(preset: str = "tiny-qwen2") -> str:
        if preset not in cache:
            cache[preset] = str(create_tiny_model(preset, tmp_path_factory.mktemp(preset)))
        return cache[preset]

    return factory


@pytest.fixture(scope="module")
def ray_session(request):
    """The test process's shared embedded Ray (4 CPUs), started if not up; when the module is done, every CPU
    must be free again (tests/helpers/ray_cluster.py)."""
    from tests.helpers.ray_cluster import assert_cluster_free, shared_ray

    shared_ray()
    yield
    assert_cluster_free(request.module.__name__)


@pytest.fixture
def no_ray():
    """No Ray in this process while the test runs: for tests that prove a refusal came before any Ray started,
    or that start a Ray of their own."""
    from tests.helpers.ray_cluster import stop_shared_ray

    stop_shared_ray()
    yield
    stop_shared_ray()


@pytest.fixture(scope="session", autouse=True)
def _stop_ray_at_the_end():
    yield
    from tests.helpers.ray_cluster import stop_shared_ray

    stop_shared_ray()
