"""`reward.url`: samples scored by a user's verifier over HTTP (httpx), the reply never trusted.

The contract (docs/recipes/reward-services.md): each request is `POST <url>` with a JSON body
`{"samples": [{"prompt": ..., "response": "...", "ground_truth": ...}, ...]}` of at most `reward.batch_size`
samples; the verifier answers HTTP 200 with `{"scores": [x0, x1, ...]}`, one finite number (or null: "could
not score this one") per sample, in order. At most `reward.max_concurrency` requests are in flight at once,
each bounded by `reward.timeout_s` in all (connect, send, wait and read). A request that fails as a whole
(it cannot connect, times out, or gets HTTP 429 or 5xx) is sent again up to `reward.retries` times, after
`reward.backoff_s`, then twice that, and so on. A reply that is not JSON, holds the wrong number of scores, a
non-finite or non-numeric one, or is larger than MAX_REPLY_BYTES makes its samples errors (not retried: the
verifier answered, wrongly). What becomes of a failed sample is `reward.on_error`'s (rlhf/driver/rl/rewards.py).

Proxy variables of the environment are not used: the samples go to the URL and nowhere else.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from rlhf.config.schema import RewardConfig
from rlhf.driver.rl.reward_pool import Outcome

MAX_REPLY_BYTES = 1 << 20  # a reply to a batch of 1,000 samples is about 20 kB
RETRIED_STATUS = frozenset({429, 500, 502, 503, 504})


class _Failed(Exception):
    """A request's failure: `kind` ("error" | "timeout"), whether sending it again may help (`retry`)."""

    def __init__(self, message: str, kind: str = "error", retry: bool = False) -> None:
        super().__init__(message)
        self.kind, self.retry = kind, retry


def parse_scores(data: bytes, count: int) -> list[Outcome]:
    """The outcomes of a reply body to a request of `count` samples; raises _Failed when the reply as a whole
    is not the contract's (not JSON, not an object with a list `scores` of `count` entries)."""
    try:
        reply = json.loads(data, parse_constant=float)  # NaN, Infinity: scored below as non-finite
    except (ValueError, RecursionError) as e:  # RecursionError: deeply nested arrays
        raise _Failed(f"replied with something that is not JSON ({type(e).__name__}: {str(e)[:80]})") from None
    scores = reply.get("scores") if isinstance(reply, dict) else None
    if not isinstance(scores, list):
        raise _Failed('replied without a list "scores"')
    if len(scores) != count:
        raise _Failed(f"replied {len(scores)} scores for {count} samples")
    out = []
    for x in scores:
        if x is None:
            out.append(Outcome(kind="error", message="replied null (could not score it)"))
        elif isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x):
            out.append(Outcome(value=float(x)))
        else:
            text = repr(x)
            out.append(Outcome(kind="error", message=f"replied {text[:40]}{'...' if len(text) > 40 else ''}, "
                                                     "not a finite number"))
    return out


class RemoteReward:
    """Scores samples at `reward.url`: `score` sends them in batches, several at once, and returns one Outcome
    per sample in order."""

    def __init__(self, rc: RewardConfig) -> None:
        assert rc.url
        self.url, self.timeout_s, self.retries, self.backoff_s = rc.url, rc.timeout_s, rc.retries, rc.backoff_s
        self.batch_size, self.concurrency = rc.batch_size, rc.max_concurrency
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        self.client = httpx.Client(timeout=httpx.Timeout(self.timeout_s), limits=limits, trust_env=False,
                                   follow_redirects=False)
        self.pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="reward-url")

    def score(self, samples: Sequence[tuple[Any, Any, Any]]) -> list[Outcome]:
        batches = [list(samples[i:i + self.batch_size]) for i in range(0, len(samples), self.batch_size)]
        return [o for part in self.pool.map(self._batch, batches) for o in part]

    def _batch(self, samples: list[tuple[Any, Any, Any]]) -> list[Outcome]:
        """One batch's outcomes, with its retries; a batch that fails as a whole fails each of its samples."""
        body = json.dumps({"samples": [{"prompt": p, "response": r, "ground_truth": g} for p, r, g in samples]},
                          default=str).encode()
        attempt = 0
        while True:
            try:
                return parse_scores(self._post(body), len(samples))
            except _Failed as e:
                if not e.retry or attempt >= self.retries:
                    tries = f" (after {attempt + 1} attempts)" if attempt else ""
                    return [Outcome(kind=e.kind, message=f"{e}{tries}")] * len(samples)
            time.sleep(self.backoff_s * 2 ** attempt)
            attempt += 1

    def _post(self, body: bytes) -> bytes:
        """The reply body of one POST, read within `timeout_s` in all and at most MAX_REPLY_BYTES long."""
        deadline = time.monotonic() + self.timeout_s
        late = _Failed(f"took longer than reward.timeout_s={self.timeout_s:g}", kind="timeout", retry=True)
        try:
            with self.client.stream("POST", self.url, content=body,
                                    headers={"Content-Type": "application/json"}) as reply:
                if reply.status_code != 200:
                    raise _Failed(f"replied HTTP {reply.status_code}", retry=reply.status_code in RETRIED_STATUS)
                data = b""
                for chunk in reply.iter_bytes():
                    data += chunk
                    if len(data) > MAX_REPLY_BYTES:
                        raise _Failed(f"replied more than {MAX_REPLY_BYTES} bytes")
                    if time.monotonic() > deadline:
                        raise late
                return data
        except httpx.TimeoutException:
            raise late from None
        except httpx.HTTPError as e:
            raise _Failed(f"cannot be reached ({type(e).__name__}: {str(e)[:80]})", retry=True) from None

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
