"""Trying again: one back-off and one retry loop for every gRPC call that may
meet a peer that is restarting or briefly unreachable."""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

import grpc

T = TypeVar("T")

# The peer may answer next time: it is restarting, busy, or not there yet.
UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class Backoff:
    """Delays between tries: ``first``, doubling, at most ``cap`` seconds."""

    def __init__(self, first: float = 0.1, cap: float = 1.0):
        self.first, self.cap = first, cap
        self.delay = first

    def next(self) -> float:
        """The delay to wait now; the one after it doubles."""
        d = self.delay
        self.delay = min(self.delay * 2, self.cap)
        return d

    def reset(self) -> None:
        self.delay = self.first

    def wait(self, stop: threading.Event | None = None) -> None:
        d = self.next()
        if stop is not None:
            stop.wait(d)
        else:
            time.sleep(d)


def retry(call: Callable[[], T], deadline_s: float, codes=UNAVAILABLE, stop: threading.Event | None = None,
          backoff: Backoff | None = None) -> T:
    """``call()`` until it returns, retrying a grpc.RpcError whose code is in
    ``codes`` until ``deadline_s`` has passed (or ``stop`` is set); any other
    error, or the last one, is raised."""
    backoff = backoff or Backoff()
    t_end = time.monotonic() + deadline_s
    while True:
        try:
            return call()
        except grpc.RpcError as e:
            if e.code() not in codes or time.monotonic() >= t_end or (stop is not None and stop.is_set()):
                raise
            backoff.wait(stop)
