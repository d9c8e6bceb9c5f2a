"""The custom-workflow example (RLOO + a custom reward) runs through the same machinery, and a
`module:function` reward from the config is imported and used."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_rl_e2e import FAST


def test_custom_rloo_workflow_and_module_reward(tmp_path):
    run = tmp_path / "rloo"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "examples/custom_workflow.py", *FAST, "trainer.total_steps=2",
                        "trainer.val_every=0", "trainer.export_hf=false", f"trainer.output_dir={run}"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if row["step"] > 0] == [1, 2]
    assert "time/generate" in rows[-1] and "pg_loss" in rows[-1]

    # a reward function given as module:function (a module of the user's, found on PYTHONPATH)
    (tmp_path / "my_reward.py").write_text("def always_one(prompt, response, ground_truth):\n    return 1.0\n")
    run2 = tmp_path / "modreward"
    r = subprocess.run([sys.executable, "-m", "rlhf", "train", "configs/grpo_tiny.yaml", *FAST,
                        "reward.fn=my_reward:always_one", "trainer.total_steps=1", "trainer.val_every=0",
                        "trainer.export_hf=false", f"trainer.output_dir={run2}"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(x) for x in (run2 / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["reward_mean"] == 1.0
