"""Fixtures of the worker-group tests (their helpers: tests/helpers/batches.py and tests/helpers/layouts.py)."""

from __future__ import annotations

import pytest

from tests.helpers.batches import make_rl_batch


@pytest.fixture(scope="session")
def rl_batch_factory():
    return make_rl_batch
