"""`reward.url` against a real HTTP verifier on 127.0.0.1 (tests/helpers/verifier.py): the JSON contract,
batching, the concurrency limit and retries with backoff counted on the server's side, a server that is down
or slow, and replies that are not to be trusted (not JSON, the wrong count, non-finite numbers, huge or deeply
nested bodies), each scored by reward.on_error: the fallback (counted) or a stop naming the URL and the sample."""

from __future__ import annotations

import json
import time

import pytest

from rlhf.config.schema import RewardConfig
from rlhf.driver.rl.reward_url import MAX_REPLY_BYTES
from rlhf.driver.rl.rewards import RewardError, RewardScorer
from tests.helpers.verifier import closed_port_url, scores_reply, verifier

SAMPLES = [(f"What is {i}+1?", f"answer {i}", str(i + 1)) for i in range(10)]


def scorer(url: str, **kw) -> RewardScorer:
    opts = {"timeout_s": 2.0, "retries": 2, "backoff_s": 0.01, "batch_size": 4, "max_concurrency": 2,
            "fallback_score": -5.0, **kw}
    return RewardScorer.for_url(RewardConfig(fn=None, url=url, **opts))


def score(s: RewardScorer) -> list[float]:
    prompts, responses, truths = map(list, zip(*SAMPLES))
    try:
        return s.score(prompts, responses, truths).tolist()
    finally:
        s.shutdown()


def test_scores_come_back_in_order_in_batches_with_the_contracts_fields():
    seen = []

    def verdict(sample):
        seen.append(sample)
        return float(sample["ground_truth"]) * 10 + len(sample["response"])

    with verifier(scores_reply(verdict)) as v:
        s = scorer(v.url)
        assert score(s) == [float(i + 1) * 10 + len(f"answer {i}") for i in range(10)]
    assert v.requests == 3 and sorted(v.batch_sizes) == [2, 4, 4]
    assert {"prompt": "What is 3+1?", "response": "answer 3", "ground_truth": "4"} in seen
    assert s.pop_metrics() == {"reward/errors": 0.0, "reward/timeouts": 0.0}


def test_the_concurrency_limit_is_honoured():
    def slow(body, n):
        return 200, json.dumps({"scores": [1.0] * len(body["samples"])}).encode(), 0.3

    with verifier(slow) as v:
        assert score(scorer(v.url, batch_size=1, max_concurrency=3)) == [1.0] * 10
    assert v.requests == 10 and v.max_in_flight == 3


def test_a_server_that_is_down_is_retried_then_scored_by_the_fallback_and_counted(capsys):
    s = scorer(closed_port_url(), backoff_s=0.05)
    t0 = time.monotonic()
    assert score(s) == [-5.0] * 10
    assert time.monotonic() - t0 >= 0.05 + 0.1  # two retries after 0.05 s and 0.1 s
    assert s.pop_metrics() == {"reward/errors": 10.0, "reward/timeouts": 0.0}
    err = capsys.readouterr().err
    assert "cannot be reached" in err and "(after 3 attempts)" in err and "on sample 0" in err


def test_a_server_that_is_down_stops_the_run_with_on_error_fail_naming_the_url_and_sample():
    url = closed_port_url()
    with pytest.raises(RewardError, match=rf"reward.url {url} cannot be reached .* on sample 0 \(prompt 'What is 0"):
        score(scorer(url, on_error="fail", retries=0))


def test_a_slow_reply_times_out_and_the_retry_succeeds():
    def slow_first(body, n):
        return 200, json.dumps({"scores": [7.0] * len(body["samples"])}).encode(), 1.5 if n == 1 else 0.0

    with verifier(slow_first) as v:
        s = scorer(v.url, timeout_s=0.5, batch_size=10, retries=1)
        assert score(s) == [7.0] * 10
    assert v.requests == 2
    assert s.pop_metrics()["reward/timeouts"] == 0.0


def test_a_server_that_stays_slow_exhausts_the_retries_and_counts_timeouts():
    def slow(body, n):
        return 200, b'{"scores": []}', 1.0

    with verifier(slow) as v:
        s = scorer(v.url, timeout_s=0.3, batch_size=10, retries=2)
        assert score(s) == [-5.0] * 10
    assert v.requests == 3  # the first attempt and two retries
    assert s.pop_metrics() == {"reward/errors": 0.0, "reward/timeouts": 10.0}


def test_http_errors_5xx_and_429_are_retried_4xx_are_not():
    def flaky(body, n):
        status = {1: 503, 2: 429}.get(n, 200)
        return status, json.dumps({"scores": [2.0] * len(body["samples"])}).encode(), 0.0

    with verifier(flaky) as v:
        assert score(scorer(v.url, batch_size=10)) == [2.0] * 10
    assert v.requests == 3
    with verifier(lambda body, n: (400, b"bad request", 0.0)) as v:
        assert score(scorer(v.url, batch_size=10)) == [-5.0] * 10
    assert v.requests == 1


GARBAGE = {
    "not json": b"<html>oops</html>",
    "json but no scores": b'{"score": 1}',
    "a list at the top": b"[1, 2, 3]",
    "the wrong count": json.dumps({"scores": [1.0] * 9}).encode(),
    "nested too deep": b'{"scores": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "huge": json.dumps({"scores": [1.0] * 10, "pad": "x" * (MAX_REPLY_BYTES + 1)}).encode(),
}


@pytest.mark.parametrize("kind", list(GARBAGE))
def test_a_reply_that_breaks_the_contract_fails_its_samples_without_a_retry(kind):
    with verifier(lambda body, n: (200, GARBAGE[kind], 0.0)) as v:
        s = scorer(v.url, batch_size=10)
        assert score(s) == [-5.0] * 10
    assert v.requests == 1
    assert s.pop_metrics()["reward/errors"] == 10.0


def test_a_bad_score_fails_that_sample_alone():
    """NaN and Infinity (JSON extensions Python would parse), 1e999 (inf as a float), strings, booleans and
    null: each of those samples is an error; the finite numbers of the same reply are kept."""
    body = b'{"scores": [1, NaN, Infinity, -Infinity, 1e999, "1", true, null, 2.5, [1]]}'
    with verifier(lambda b, n: (200, body, 0.0)) as v:
        s = scorer(v.url, batch_size=10)
        assert score(s) == [1.0] + [-5.0] * 7 + [2.5, -5.0]
    assert s.pop_metrics()["reward/errors"] == 8.0


def test_a_reply_that_trickles_in_past_the_timeout_is_a_timeout():
    """Each chunk comes within the timeout, the whole reply does not: reward.timeout_s bounds the request in all."""
    body = json.dumps({"scores": [1.0] * 10}).encode()
    with verifier(lambda b, n: (200, [body[i:i + 4] for i in range(0, len(body), 4)], 0.1)) as v:
        s = scorer(v.url, timeout_s=0.5, batch_size=10, retries=0)
        t0 = time.monotonic()
        assert score(s) == [-5.0] * 10
        assert time.monotonic() - t0 < 2.0
    assert s.pop_metrics()["reward/timeouts"] == 10.0


def test_redirects_are_not_followed_and_proxy_variables_are_not_used(monkeypatch):
    with verifier(lambda b, n: (307, b"", 0.0)) as v:
        assert score(scorer(v.url, batch_size=10)) == [-5.0] * 10
    assert v.requests == 1  # the redirect's target was never asked
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, closed_port_url().rsplit("/", 1)[0])
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with verifier(scores_reply(lambda sample: 3.0)) as v:
        assert score(scorer(v.url, batch_size=10)) == [3.0] * 10
    assert v.requests == 1
