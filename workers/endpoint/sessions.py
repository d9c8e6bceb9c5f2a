"""Agent sessions of the OpenAI-compatible endpoint: one random bearer token per session, which is both the
session's credential and its identity, and the record of everything the engines sampled in it.

Tokens are stored only as SHA-256 digests, looked up by the digest of what a request presents: a request
reaches a session only with that session's token, and a closed session's token opens nothing.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from dataclasses import dataclass, field


@dataclass
class Completion:
    """One sample, exactly as the engine produced it: the prompt ids it was given, the ids it sampled (the
    end-of-turn token included), their log-probs and the policy version of the weights that sampled them."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: str
    text: str


@dataclass
class Session:
    """An agent's session: its completions in order, and the raw text behind each tool-call id it returned
    (so an assistant message sent back with those tool calls renders as the model wrote it)."""

    id: str
    max_calls: int
    max_tokens: int  # sampled tokens over the whole session
    completions: list[Completion] = field(default_factory=list)
    raw_text: dict[str, str] = field(default_factory=dict)
    open: bool = True
    pending: int = 0  # completions in flight

    @property
    def tokens_left(self) -> int:
        return self.max_tokens - sum(len(c.token_ids) for c in self.completions)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class Sessions:
    """The open sessions, by token digest; thread-safe (the server's loop and the driver both use it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_digest: dict[bytes, Session] = {}

    def open(self, session_id: str, max_calls: int, max_tokens: int) -> tuple[Session, str]:
        """A new session and its token (32 random bytes, URL-safe)."""
        token = secrets.token_urlsafe(32)
        session = Session(session_id, max_calls, max_tokens)
        with self._lock:
            self._by_digest[_digest(token)] = session
        return session, token

    def find(self, token: str) -> Session | None:
        """The open session of `token`, or None."""
        with self._lock:
            session = self._by_digest.get(_digest(token))
        return session if session is not None and session.open else None

    def close(self, token: str) -> Session | None:
        """Close the session: its token is refused from now on. Returns it (None if unknown)."""
        with self._lock:
            session = self._by_digest.pop(_digest(token), None)
            if session is not None:
                session.open = False
        return session

    def record(self, session: Session, completion: Completion, tool_call_ids: list[str]) -> bool:
        """Add a finished completion to its session; False (nothing kept) once the session closed: what the
        driver read at closing is the whole trajectory."""
        with self._lock:
            if not session.open:
                return False
            session.completions.append(completion)
            session.raw_text.update(dict.fromkeys(tool_call_ids, completion.text))
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_digest)
