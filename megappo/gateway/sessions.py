"""A gateway session's state (SessionState: its key, its megappo.agent.capture.Session, its reward, the request in
flight) and one request's hold on it (Turn): a session's requests go one at a time, and a close from another thread
copies it between two of them, never during one."""

from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Optional

from megappo.agent.capture import Session
from megappo.gateway.requests import GatewayError


@dataclass
class SessionState:
    id: str
    key: str
    session: Session
    row: Optional[dict] = None
    reward: Optional[float] = None
    latencies: list = field(default_factory=list)
    # a training session (gateway/agents.py): sampling the client cannot change (temperature, top_p, a seed
    # per request: seed + t * seed_stride) and the response budget (tokens after the first prompt)
    forced: dict = field(default_factory=dict)
    budget: Optional[int] = None
    busy: bool = False  # a request in flight (Turn)
    tasks: set = field(default_factory=set)  # its engine requests' tasks in flight (close_session cancels them)
    closed: bool = False
    # the session as it was before the request in flight (Turn): what a close meanwhile hands out; the lock
    # keeps a close (from another thread) from copying the session while a request changes it
    pending: Optional[tuple] = None
    lock: threading.RLock = field(default_factory=threading.RLock)

    def record(self) -> dict:
        """A copy of its finished requests (a request still in flight is not in it: Turn), which nothing
        recorded later changes."""
        with self.lock:
            return {"session_id": self.id, "row": self.row, "reward": self.reward, "latencies": list(self.latencies),
                    **self.session.as_of(self.pending)}


class Turn:
    """One request's hold on its session (state None: megappo serve's open key, a throwaway session, nothing kept).

    A session's requests go one at a time: each continues (or restarts) the conversation the previous one left, so
    a second request while one is in flight is refused (409), never recorded against the wrong segment. The
    request changes the session only under `lock` (the prompt it builds, then `record`, its answer), so a close
    from another thread copies the session between those, never during. Until it is recorded the request is not
    in the session's record: a close meanwhile hands out the session as it was before it (SessionState.pending),
    and a request that is refused or fails puts the session back so."""

    def __init__(self, state: Optional[SessionState], session: Session):
        self.state, self.session = state, session
        self.lock = state.lock if state is not None else nullcontext()

    def __enter__(self) -> "Turn":
        if self.state is not None and self.state.busy:
            raise GatewayError(409, "this session has a request in flight: a session is one conversation, one "
                                    "request at a time; open one session per parallel branch", "conflict_error",
                               {"x-should-retry": "false"})  # the OpenAI SDK retries a 409 unless told not to
        with self.lock:
            self.saved = self.session.snapshot()
            if self.state is not None:
                self.state.pending, self.state.busy = self.saved, True
        return self

    def record(self, latency: float, *args, **kwargs) -> None:
        """Session.record and the request's latency, unless the session closed meanwhile (its record was handed
        out without this request)."""
        with self.lock:
            if self.state is None or not self.state.closed:
                self.session.record(*args, **kwargs)
                if self.state is not None:
                    self.state.latencies.append(latency)
            self._done()

    def __exit__(self, kind, value, tb) -> None:
        with self.lock:
            if kind is not None:  # refused or failed: the session as it was
                self.session.restore(self.saved)
            self._done()
        if self.state is not None:
            self.state.busy = False

    def _done(self) -> None:
        if self.state is not None:
            self.state.pending = None
