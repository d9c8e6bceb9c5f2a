"""The reward services' settings (reward.url and its request settings, reward.judge) are checked when the config
loads, before anything starts: one line naming the field."""

from __future__ import annotations

import pytest

from rlhf.config import load_config
from rlhf.errors import ConfigError


def load(*overrides: str):
    return load_config("configs/grpo_tiny.yaml", ["trainer.output_dir=/tmp/unused", *overrides])


def test_a_service_with_the_rule_for_validation_loads():
    cfg = load("reward.url=https://verifier.internal:8443/score", "reward.batch_size=1", "reward.retries=0",
               "reward.backoff_s=0")
    assert cfg.reward.url == "https://verifier.internal:8443/score" and cfg.reward.fn == "exact_match"
    cfg = load("reward.fn=null", "reward.judge.model_path=/models/judge", 'reward.judge.choices={"Yes": 1, "no": 0}',
               "reward.judge.prompt_template=Judge {{x}} {response} {prompt} {ground_truth}")
    assert cfg.reward.judge.choices == {"Yes": 1.0, "no": 0.0}


@pytest.mark.parametrize("overrides, message", [
    (["reward.fn=null"], "reward: expected reward.fn"),
    (["reward.url=ftp://host/x"], "reward.url: expected an http:// or https:// URL with a host, got 'ftp://host/x'"),
    (["reward.url=http:///path"], "reward.url: expected an http"),
    (["reward.url=http://h/s", "reward.model_path=/m"], "reward.model_path: one reward source scores the rollouts, "
                                                       "but reward.url is set too"),
    (["reward.url=http://h/s", "reward.judge.model_path=/j"], "reward.judge.model_path: one reward source"),
    (["reward.batch_size=0"], "reward.batch_size: expected an integer >= 1"),
    (["reward.max_concurrency=0"], "reward.max_concurrency: expected an integer >= 1"),
    (["reward.retries=-1"], "reward.retries: expected an integer >= 0"),
    (["reward.backoff_s=-0.5"], "reward.backoff_s: expected seconds >= 0"),
    (["reward.backoff_s=inf"], "reward.backoff_s: expected seconds >= 0"),
    (["reward.judge.num_engines=0"], "reward.judge.num_engines: expected an integer >= 1"),
    (["reward.judge.max_tokens=0"], "reward.judge.max_tokens: expected an integer >= 1"),
    (["reward.judge.prompt_template=Judge {prompt}"], "reward.judge.prompt_template: expected a template with "
                                                      "{response}"),
    (["reward.judge.prompt_template=Judge {response} {answer}"], "reward.judge.prompt_template: {answer} is not one"),
    (["reward.judge.prompt_template=Judge {response.__class__}"], "reward.judge.prompt_template: "
                                                                  "{response.__class__} is not one"),
    (["reward.judge.prompt_template=Judge {response!r}"], "reward.judge.prompt_template: {response!r} is not one"),
    (["reward.judge.prompt_template=Judge {0} {response}"], "reward.judge.prompt_template: {0} is not one"),
    (["reward.judge.prompt_template=Judge {response"], "reward.judge.prompt_template: "),
    (["reward.judge.pattern=Score=(\\d"], "reward.judge.pattern: 'Score=(\\\\d' is not a regular expression"),
    (["reward.judge.pattern=(a)(b)"], "reward.judge.pattern: expected a regular expression with at most one"),
    (['reward.judge.choices={"good answer": 1}'], "reward.judge.choices: expected words of letters and digits"),
    (['reward.judge.choices={"yes": nan}'], "reward.judge.choices.yes: expected a finite score"),
    (["reward.judge.dtype=int4"], "reward.judge.dtype='int4' must be one of"),
    (["reward.judge.kv_cache_gb=0"], "reward.judge.kv_cache_gb=0"),
])
def test_bad_reward_service_settings(overrides, message):
    with pytest.raises(ConfigError) as e:
        load(*overrides)
    text = str(e.value)
    assert text.startswith(message) and "\n" not in text, text
