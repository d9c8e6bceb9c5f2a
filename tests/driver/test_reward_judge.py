"""`reward.judge` on a real engine: a tiny judge whose verdicts are known (tests/helpers/judge_model.py: after a
prompt ending in 0-4 it says "Score: 9", after any other it says nothing) run by vLLM in this process. Its
verdicts become scores; malformed ones are counted and scored by reward.on_error (the fallback, or a stop naming
the judge, the verdict and the sample); a prompt too long for the judge is an error, never sent; the chat
template wraps the prompt when asked; the judge's time is counted."""

from __future__ import annotations

import pytest

from rlhf.config.schema import JudgeConfig, RewardConfig
from rlhf.driver.rl.reward_judge import Judge
from rlhf.driver.rl.rewards import RewardError, RewardScorer
from tests.helpers.judge_model import planted_judge


@pytest.fixture(scope="module")
def judge_engine(tmp_path_factory, tiny_model_factory):
    from workers.rollout import EngineConfig, RolloutGroup

    path = planted_judge(tmp_path_factory.mktemp("judge"), base=tiny_model_factory("tiny-llama"))
    group = RolloutGroup(EngineConfig(model_path=str(path), kv_cache_gb=0.05, max_num_seqs=16), in_process=True)
    yield str(path), group
    group.shutdown()


def scorer(judge_engine, **kw) -> RewardScorer:
    path, group = judge_engine
    judge = {"model_path": path, "chat": False, "prompt_template": "Q {prompt} A {response}", **kw.pop("judge", {})}
    rc = RewardConfig(fn=None, judge=JudgeConfig(**judge), fallback_score=-1.0, **kw)
    return RewardScorer.for_judge(rc, Judge(rc.judge, group))


RESPONSES = ["12", "17", "nothing", "4", "answer 3", "9"]  # judged by their last character: 0-4 -> "Score: 9"


def test_verdicts_become_scores_and_malformed_ones_are_counted_and_fall_back(judge_engine, capsys):
    s = scorer(judge_engine)
    scores = s.score(["p"] * 6, RESPONSES, [None] * 6).tolist()
    assert scores == [9.0, -1.0, -1.0, 9.0, 9.0, -1.0]
    metrics = s.pop_metrics()
    assert metrics["reward/judge_malformed"] == 3.0 and metrics["reward/errors"] == 0.0
    assert metrics["time/judge"] > 0
    assert s.pop_metrics()["time/judge"] == 0.0
    err = capsys.readouterr().err
    assert "3 malformed verdicts" in err and f"reward.judge {judge_engine[0]} gave the malformed verdict ''" in err


def test_malformed_verdicts_stop_the_run_with_on_error_fail(judge_engine):
    s = scorer(judge_engine, on_error="fail")
    with pytest.raises(RewardError, match=r"reward.judge .* gave the malformed verdict '' on sample 1 "
                                          r"\(prompt 'p', response '17'\); reward.on_error=fail"):
        s.score(["p"] * 6, RESPONSES, [None] * 6)


def test_choices_and_a_pattern_without_a_group(judge_engine):
    by_word = scorer(judge_engine, judge={"choices": {"score": 0.5}})
    assert by_word.score(["p"] * 2, ["1", "7"], [None] * 2).tolist() == [0.5, -1.0]
    whole_match = scorer(judge_engine, judge={"pattern": r"\d"})
    assert whole_match.score(["p"], ["1"], [None]).tolist() == [9.0]


def test_the_template_takes_the_samples_fields_and_a_sample_cannot_inject_placeholders(judge_engine):
    path, group = judge_engine
    jc = JudgeConfig(model_path=path, chat=False, prompt_template="{prompt}|{response}|{ground_truth}")
    ids, texts = Judge(jc, group).prompts([("a {response}", "b", {"x": 1}), ([{"role": "user", "content": "hi"}],
                                                                            "c", None)])
    assert texts == ['a {response}|b|{"x": 1}', "user: hi|c|"]
    chat = Judge(JudgeConfig(model_path=path, prompt_template="{response}"), group)
    assert chat.prompts([("p", "r", None)])[1] == ["<|im_start|>user\nr<|im_end|>\n<|im_start|>assistant\n"]


def test_a_judge_prompt_too_long_for_the_judge_is_an_error_and_not_sent(judge_engine):
    s = scorer(judge_engine)
    too_long = " ".join(["word"] * 600)  # the tiny judge's context is 512 tokens
    assert s.score(["p", "p"], [too_long + " 1", "1"], [None, None]).tolist() == [-1.0, 9.0]
    metrics = s.pop_metrics()
    assert metrics["reward/errors"] == 1.0 and metrics["reward/judge_malformed"] == 0.0
