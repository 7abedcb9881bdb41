"""One request waiting for its reply (the leader/followers reply pump's unit)."""
from __future__ import annotations

import threading


class _Call:
    """One request waiting for its reply: a lighter ``concurrent.futures.Future``.

    The reader sets the outcome (value, then state, then wakes an Event if a follower thread
    made one); a waiting thread that does not hold the socket creates the Event lazily, so a
    single-threaded caller never pays for one. Cancelling is not done here: whoever pops the
    call's entry from ``Client._pending`` first (the reader handing over a reply, or a caller
    giving up) decides its fate, atomically under the GIL.
    """
    __slots__ = ("rid", "op", "state", "value", "event")

    def __init__(self, rid: int, op: str):
        self.rid = rid
        self.op = op
        self.state = 0          # 0 waiting, 1 value is the reply, 2 value is the exception
        self.value = None
        self.event = None

    def done(self) -> bool:
        return self.state != 0

    def set_result(self, value) -> None:
        self.value = value
        self.state = 1
        ev = self.event
        if ev is not None:
            ev.set()

    def set_exception(self, exc: BaseException) -> None:
        self.value = exc
        self.state = 2
        ev = self.event
        if ev is not None:
            ev.set()

    def result(self):
        if self.state == 2:
            raise self.value
        return self.value

    def wait(self, timeout: float) -> None:
        """Sleep until done or ``timeout`` seconds (a follower thread's wait)."""
        ev = self.event
        if ev is None:
            ev = self.event = threading.Event()
        if self.state == 0:   # checked after the Event exists: a set_result now will set it
            ev.wait(timeout)
