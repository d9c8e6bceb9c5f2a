"""Rule-based rewards: answer extraction, exact match, format regex, combinator, bad inputs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms import rewards as rewards_mod
from algorithms.rewards import (
    RewardResult,
    UnknownRewardError,
    combine_rewards,
    extract_answer,
    format_reward,
    get_reward_fn,
    list_rewards,
    parse_number,
    register_reward,
    score_with_reason,
)

em = get_reward_fn("math_exact_match")


@pytest.mark.parametrize(
    "response,gt,expected",
    [
        ("so the answer is \\boxed{42}.", "42", 1.0),
        ("first \\boxed{3} then \\boxed{7}", "7", 1.0),  # the last boxed answer counts
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{x = -3}", "-3", 1.0),
        ("\\boxed{{5}}", "5", 1.0),  # nested braces
        ("\\boxed{5.0}", "5", 1.0),
        ("\\boxed{1{,}000}", "1000", 1.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{\\$18}", "18", 1.0),
        ("\\boxed{12 \\text{ cm}}", "12", 1.0),
        ("I think 12 \\boxed{13}", "12", 0.0),  # boxed wins over other numbers
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72", 1.0),
        ("#### 1,234.50", "1234.5", 1.0),
        ("#### 7 apples, not 8", "7", 1.0),
        ("She has 3 apples and buys 4 more, so 7.", "7", 1.0),
        ("The answer is 1,000.", "1000", 1.0),
        ("Total: $1,234,567", "1234567", 1.0),
        ("items 1,2,3", "3", 1.0),  # a list is not a thousands-separated number
        ("from 3-5 we get", "5", 1.0),  # 3-5 is not -5
        ("it is -5", "-5", 1.0),
        ("the ratio is 3/4.", "0.75", 1.0),
        ("answer 0.1", 0.1, 1.0),
        ("answer 5", 5, 1.0),
        ("answer 6", 5, 0.0),
        ("answer 5", "Natalia sold 48/2 = 24 clips in May. #### 5", 1.0),  # gsm8k-style solution as gt
        ("answer 5", "\\boxed{5}", 1.0),
        ("answer 0.5", "\\frac{1}{2}", 1.0),
    ],
)
def test_math_exact_match(response, gt, expected):
    assert em(None, response, gt) == expected
    assert get_reward_fn("exact_match")("q", response, gt) == expected


def test_extract_answer_sources():
    assert extract_answer("\\boxed{12}") == ("12", "boxed")
    assert extract_answer("blah #### 34") == ("34", "####")
    assert extract_answer("x 1 y 2.5 z") == ("2.5", "last number")
    assert extract_answer("no digits here") == (None, "no answer found")
    assert extract_answer("unbalanced \\boxed{12") == ("12", "last number")


@pytest.mark.parametrize(
    "text,value",
    [
        ("5", 5),
        ("5.0", 5),
        ("-0.25", -0.25),
        ("1,000", 1000),
        ("$3", 3),
        ("7.", 7),
        ("3/4", 0.75),
        ("x=2", 2),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["abc", "", "1/0", "2x+1", "1,00", "--3"])
def test_parse_number_rejects(text):
    assert parse_number(text) is None


@settings(max_examples=50, deadline=None)
@given(n=st.integers(-(10**9), 10**9), style=st.sampled_from(["boxed", "hash", "last"]))
def test_exact_match_round_trips_integers(n, style):
    shown = f"{n:,}"
    response = {"boxed": f"\\boxed{{{shown}}}", "hash": f"work\n#### {shown}", "last": f"so it is {shown}."}[
        style
    ]
    assert em(None, response, str(n)) == 1.0
    assert em(None, response, f"{n}.0") == 1.0
    assert em(None, response, n + 1) == 0.0


@pytest.mark.parametrize(
    "response,gt,reason",
    [
        (None, "5", "empty response"),
        ("", "5", "empty response"),
        ("   ", "5", "empty response"),
        (42, "5", "empty response"),
        ("\\boxed{5}", None, "no ground truth"),
        ("\\boxed{5}", "", "no ground truth"),
        ("\\boxed{5}", "Paris", "ground truth is not numeric"),
        ("\\boxed{5}", float("nan"), "ground truth is not numeric"),
        ("\\boxed{5}", True, "ground truth is not numeric"),
        ("no number at all", "5", "no answer found"),
        ("\\boxed{Paris}", "5", "boxed answer is not numeric"),
        ("\\boxed{6}", "5", "wrong"),
    ],
)
def test_bad_inputs_score_zero_with_reason(response, gt, reason):
    res = score_with_reason("math_exact_match", "prompt", response, gt)
    assert isinstance(res, RewardResult)
    assert res.score == 0.0 and reason in res.reason
    assert em("prompt", response, gt) == 0.0


def test_format_reward():
    think = get_reward_fn("think_answer_format")
    assert think(None, "<think>a\nb</think> <answer>5</answer>", None) == 1.0
    assert think(None, "<answer>5</answer>", None) == 0.0
    assert get_reward_fn("boxed_format")(None, "so \\boxed{3}", None) == 1.0
    assert get_reward_fn("boxed_format")(None, "so 3", None) == 0.0
    fr = format_reward(r"^Answer: \d+$", mode="fullmatch", score=0.5)
    assert fr(None, "Answer: 12", None) == 0.5
    assert fr(None, "Answer: 12 because", None) == 0.0
    assert "mismatch" in fr.with_reason(None, "nope", None).reason
    assert fr(None, None, None) == 0.0
    assert format_reward(r"\d")(None, "abc 1", None) == 1.0  # default mode: search
    with pytest.raises(ValueError):
        format_reward("x", mode="contains")


def test_combine_rewards():
    combo = combine_rewards({"math_exact_match": 1.0, format_reward(r"\\boxed\{"): 0.1})
    assert combo(None, "\\boxed{5}", "5") == pytest.approx(1.1)
    assert combo(None, "5", "5") == pytest.approx(1.0)
    assert combo(None, "\\boxed{4}", "5") == pytest.approx(0.1)
    res = score_with_reason(combo, None, "\\boxed{4}", "5")
    assert "math_exact_match=0*1 (wrong" in res.reason and "format ok" in res.reason
    assert combo(None, None, None) == 0.0
    plain = combine_rewards({lambda p, r, g: 2.0: 0.5, "boxed_format": -1.0})
    assert plain(None, "\\boxed{1}", None) == pytest.approx(0.0)
    with pytest.raises(UnknownRewardError):
        combine_rewards({"no_such_reward": 1.0})
    with pytest.raises(ValueError):
        combine_rewards({})


def test_registry(monkeypatch):
    monkeypatch.setattr(rewards_mod, "_REGISTRY", dict(rewards_mod._REGISTRY))
    assert {"math_exact_match", "exact_match", "boxed_format"} <= set(list_rewards())
    with pytest.raises(KeyError) as info:
        get_reward_fn("nope")
    assert isinstance(info.value, ValueError) and "math_exact_match" in str(info.value)

    @register_reward("length_penalty")
    def length_penalty(prompt, response, ground_truth):
        return -0.01 * len(response)

    @register_reward("with_reason")
    def with_reason(prompt, response, ground_truth):
        return 0.5, "half"

    @register_reward("broken")
    def broken(prompt, response, ground_truth):
        raise RuntimeError("boom")

    assert get_reward_fn("length_penalty")(None, "abcd", None) == pytest.approx(-0.04)
    assert score_with_reason("with_reason", None, "x", None) == RewardResult(0.5, "half")
    assert get_reward_fn("with_reason")(None, "x", None) == 0.5
    res = score_with_reason("broken", None, "x", None)
    assert res.score == 0.0 and "RuntimeError: boom" in res.reason
    with pytest.raises(ValueError, match="already registered"):
        register_reward("length_penalty")(length_penalty)
    assert isinstance(get_reward_fn("length_penalty")(None, "abcd", None), float)


def test_builtin_and_factory_rewards_pickle():
    import pickle

    combo = combine_rewards({"math_exact_match": 1.0, "boxed_format": 0.1, format_reward(r"\d+"): 0.5})
    for fn in (combo, get_reward_fn("exact_match"), get_reward_fn("think_answer_format")):
        clone = pickle.loads(pickle.dumps(fn))
        assert clone(None, "\\boxed{5}", "5") == fn(None, "\\boxed{5}", "5")


def test_text_exact_match():
    from algorithms.rewards import get_reward_fn, score_with_reason

    fn = get_reward_fn("text_exact_match")
    assert fn("q", " Red.\n", "red") == 1.0 and fn("q", "2", "2") == 1.0
    assert fn("q", "reddish", "red") == 0.0 and fn("q", "", "red") == 0.0 and fn("q", "red", None) == 0.0
    assert score_with_reason("text_exact_match", "q", "blue", "red").reason == "wrong ('blue' != 'red')"
