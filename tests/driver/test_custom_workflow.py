"""The custom-workflow example (RLOO + a custom reward) runs through the same machinery. (A `module:function`
reward from the config: tests/driver/test_reward_guard_e2e.py.)"""

from __future__ import annotations

import pytest

from tests.helpers.cli import FAST, python
from tests.helpers.runs import metrics


# `slow` (58 s in make test): a user step function through rlhf.api's run_rl stays covered by
# test_objectives_e2e.py's rotating step
@pytest.mark.slow
def test_custom_rloo_workflow(tmp_path):
    run = tmp_path / "rloo"
    r = python("examples/custom_workflow.py", *FAST, "trainer.total_steps=2", "trainer.val_every=0",
               "trainer.export_hf=false", f"trainer.output_dir={run}")
    assert r.returncode == 0, r.stderr[-4000:]
    rows = metrics(run)
    assert [row["step"] for row in rows if row["step"] > 0] == [1, 2]
    assert "time/generate" in rows[-1] and "pg_loss" in rows[-1]
