"""A real HTTP verifier for the `reward.url` tests: a ThreadingHTTPServer on 127.0.0.1 (a free port) in a
thread, answering each POST with what the test's `reply` function makes of the request body. It counts the
requests, the samples and the most requests it had in flight at once, so a test can check the client's
retries, batch size and concurrency limit on the server's side."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# reply(body, n) -> (HTTP status, reply bytes, seconds to wait before answering); `n` counts requests from 1.
# A list of byte chunks instead is sent as one body, chunk after chunk, with the wait before each.
Reply = Callable[[dict[str, Any], int], tuple[int, bytes | list[bytes], float]]


@dataclass
class Verifier:
    url: str
    requests: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def scores_reply(fn: Callable[[dict[str, Any]], float]) -> Reply:
    """A well-behaved verifier: `{"scores": [fn(sample), ...]}` at once."""
    def reply(body: dict[str, Any], n: int) -> tuple[int, bytes, float]:
        return 200, json.dumps({"scores": [fn(s) for s in body["samples"]]}).encode(), 0.0
    return reply


def length_score(sample: dict[str, Any]) -> float:
    """The verifier's score of the end-to-end run: the response's length in characters, plus 1000 (no rule or
    function of the run gives such a score)."""
    return 1000.0 + len(sample["response"])


@contextmanager
def verifier(reply: Reply, path: str = "/score") -> Iterator[Verifier]:
    """A running verifier at `http://127.0.0.1:<port><path>`; stopped (its connections closed) on exit."""
    state = Verifier(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                state.requests += 1
                n = state.requests
                state.batch_sizes.append(len(body.get("samples", [])))
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                status, data, delay = reply(body, n)
                chunks = data if isinstance(data, list) else [data]
                if not isinstance(data, list):
                    time.sleep(delay)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(sum(len(c) for c in chunks)))
                if status in (301, 302, 307, 308):
                    self.send_header("Location", "/elsewhere")
                self.end_headers()
                for chunk in chunks:
                    if isinstance(data, list):
                        time.sleep(delay)
                    self.wfile.write(chunk)
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                pass
            finally:
                with state.lock:
                    state.in_flight -= 1

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}{path}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (a port bound and released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/score"
