"""Deadlines for the tests' polling loops: a condition that never comes true fails the test in one line
naming what it waited for, instead of hanging the suite (pytest.ini's per-test timeout is the backstop)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

DEFAULT_S = 60.0


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = DEFAULT_S, every_s: float = 0.01) -> None:
    """Poll `cond` until it holds; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(every_s)


async def until(cond: Callable[[], bool], what: str, timeout_s: float = DEFAULT_S, every_s: float = 0.001) -> None:
    """`wait_for` for a coroutine: yields to the event loop between polls."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
        await asyncio.sleep(every_s)
