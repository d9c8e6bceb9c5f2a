"""The custom-workflow example (RLOO + a custom reward) runs through the same machinery. (A `module:function`
reward from the config: tests/driver/test_reward_guard_e2e.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_rl_e2e import FAST


def test_custom_rloo_workflow(tmp_path):
    run = tmp_path / "rloo"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "examples/custom_workflow.py", *FAST, "trainer.total_steps=2",
                        "trainer.val_every=0", "trainer.export_hf=false", f"trainer.output_dir={run}"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if row["step"] > 0] == [1, 2]
    assert "time/generate" in rows[-1] and "pg_loss" in rows[-1]
