"""The daemon's memory floor: shrink the cache budget under memory pressure, grow it back after.

:class:`MemoryFloor` samples available memory (:class:`moecached.guard.MemoryProbe`: the smaller
of MemAvailable and the cgroup's headroom) and calls the cache's ``set_budget(bytes)``:

* **shrink** when ``available < floor``: the new budget is
  ``base - (floor - available) - margin``, where ``base`` is the current budget (or the bytes the
  cache actually holds, if ``used_bytes`` is given and smaller: shrinking an unfilled budget frees
  nothing) and ``margin`` is half the hysteresis band (at least 64 MiB), so one shrink lands inside
  the band instead of right at the floor. Never below ``min_budget``. Shrinks may follow each other
  every ``interval`` seconds (each one sees the previous one's effect: the cache punches holes in
  the arena, so Shmem and MemAvailable move at once).
* **grow** when ``available > floor + hysteresis`` has held for ``min_change_interval`` seconds and
  no change happened in the last ``min_change_interval`` seconds: the budget grows by the surplus
  above the band, ``available - (floor + hysteresis)``, capped at ``configured_budget``. Filling the
  new room uses at most the surplus, so the cache cannot grow itself back under the floor.

Together (a shrink lands in the band, a grow needs a sustained surplus above it and spends only
the surplus) memory hovering at the floor does not make the budget flap.

Shared memory is not reclaimable: the arena's pages are *not* part of MemAvailable, and evicting
a slot does not give its memory back unless the cache punches a hole in the arena file; that is
the cache's ``set_budget``'s job.

Use either ``tick(now)`` from the daemon's own loop, or ``start()`` / ``stop()`` for a thread that
ticks every ``interval`` seconds. ``stats()`` returns the state and recent events for the
daemon's ``stats`` reply.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from .guard import MemoryProbe
from .units import format_bytes

__all__ = ["MemoryFloor", "MIN_MARGIN"]

#: Smallest extra amount a shrink frees beyond the deficit, bytes.
MIN_MARGIN = 64 << 20


class MemoryFloor:
    """Keeps available memory above ``floor_bytes`` by resizing the cache budget.

    Arguments (sizes in bytes, times in seconds):

    * ``floor_bytes``: shrink when available memory falls under this.
    * ``hysteresis_bytes``: grow back only when available exceeds ``floor + hysteresis``.
    * ``configured_budget``: the budget to grow back to (never exceeded).
    * ``min_budget``: never shrink below this (e.g. the slots one token needs).
    * ``set_budget(bytes) -> dict``: the cache's resize (``ExpertCache.set_budget``); may raise,
      which is logged and recorded as an ``error`` event, and retried on a later tick.
    * ``probe``: anything with ``available() -> int`` (default :class:`MemoryProbe`), or a
      plain callable returning bytes.
    * ``interval``: thread tick period and the least time between two shrinks.
    * ``min_change_interval``: the surplus must hold this long, and the last change be this old,
      before a grow.
    * ``log``: a :class:`logging.Logger` (default ``moecached.floor``).
    * ``used_bytes``: optional callable, bytes the cache holds now; bases shrinks on it.
    * ``max_events``: how many events ``stats()`` keeps.
    """

    def __init__(self, floor_bytes: int, hysteresis_bytes: int, configured_budget: int, min_budget: int,
                 set_budget: Callable[[int], Any], probe=None, interval: float = 1.0,
                 min_change_interval: float = 5.0, log: Optional[logging.Logger] = None, *,
                 used_bytes: Optional[Callable[[], int]] = None, max_events: int = 100):
        if floor_bytes < 0 or hysteresis_bytes < 0:
            raise ValueError("floor_bytes and hysteresis_bytes must be >= 0")
        if min_budget < 0 or configured_budget < min_budget:
            raise ValueError(f"need 0 <= min_budget ({min_budget}) <= configured_budget ({configured_budget})")
        if interval <= 0 or min_change_interval < 0:
            raise ValueError("interval must be > 0 and min_change_interval >= 0")
        self.floor_bytes = int(floor_bytes)
        self.hysteresis_bytes = int(hysteresis_bytes)
        self.configured_budget = int(configured_budget)
        self.min_budget = int(min_budget)
        self.current_budget = int(configured_budget)
        self._set_budget = set_budget
        self.probe = MemoryProbe() if probe is None else probe
        self.interval = float(interval)
        self.min_change_interval = float(min_change_interval)
        self.log = log or logging.getLogger("moecached.floor")
        self.used_bytes = used_bytes
        self.events: deque = deque(maxlen=max_events)
        self.counts = {"shrink": 0, "grow": 0, "error": 0, "configure": 0}
        self.last_available: Optional[int] = None
        self.at_min = False
        self._held = False   # a pressure shrink holds the budget down until a grow restores it
        self._last_change: Optional[float] = None     # monotonic time of the last applied change
        self._last_shrink: Optional[float] = None
        self._above_since: Optional[float] = None     # when available went above floor + hysteresis
        self._lock = threading.RLock()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    # -- sampling ---------------------------------------------------------------------------
    def _available(self) -> int:
        p = self.probe
        if hasattr(p, "available"):
            return int(p.available())
        return int(p())

    @property
    def margin(self) -> int:
        """Extra bytes a shrink frees beyond the deficit: half the band, at least 64 MiB."""
        return max(self.hysteresis_bytes // 2, MIN_MARGIN)

    # -- the controller ---------------------------------------------------------------------
    def tick(self, now: Optional[float] = None, available: Optional[int] = None) -> Optional[dict]:
        """Sample (unless ``available`` is given) and shrink or grow if due.

        ``now`` is a monotonic time in seconds (default ``time.monotonic()``). Returns the event
        recorded (a dict: ``t`` wall time, ``mono``, ``kind`` "shrink"/"grow"/"error", ``from``,
        ``to``, ``available``, ``floor``, plus ``result`` or ``error``), or None if nothing changed.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            avail = self._available() if available is None else int(available)
            self.last_available = avail
            floor, band = self.floor_bytes, self.floor_bytes + self.hysteresis_bytes

            if avail < floor:
                self._above_since = None
                if self._last_shrink is not None and now - self._last_shrink < self.interval:
                    return None
                base = self.current_budget
                if self.used_bytes is not None:
                    try:
                        base = min(base, int(self.used_bytes()))
                    except Exception as e:  # noqa: BLE001 - a broken gauge must not stop the floor
                        self.log.warning("floor: cannot read cache usage: %s", e)
                target = max(self.min_budget, base - (floor - avail) - self.margin)
                if target >= self.current_budget:
                    if not self.at_min:
                        self.at_min = True
                        self.log.warning(
                            "floor: available %s is under the floor %s but the budget is already at "
                            "its minimum %s; cannot shrink further", format_bytes(avail),
                            format_bytes(floor), format_bytes(self.current_budget))
                    return None
                return self._change("shrink", target, avail, now)

            self.at_min = False
            if avail > band:
                if self._above_since is None:
                    self._above_since = now
                if self.current_budget >= self.configured_budget:
                    return None
                if now - self._above_since < self.min_change_interval:
                    return None
                if self._last_change is not None and now - self._last_change < self.min_change_interval:
                    return None
                target = min(self.configured_budget, self.current_budget + (avail - band))
                return self._change("grow", target, avail, now)

            # inside the band [floor, floor + hysteresis]: hold
            self._above_since = None
            return None

    def _change(self, kind: str, target: int, avail: int, now: float) -> dict:
        before = self.current_budget
        ev = {"t": time.time(), "mono": now, "kind": kind, "from": before, "to": target,
              "available": avail, "floor": self.floor_bytes}
        try:
            result = self._set_budget(target)
        except Exception as e:  # noqa: BLE001 - recorded and retried, never fatal
            ev["kind"] = "error"
            ev["attempted"] = kind
            ev["error"] = f"{type(e).__name__}: {e}"
            self.counts["error"] += 1
            self.events.append(ev)
            self.log.error("floor: %s of the budget %s -> %s failed: %s", kind, format_bytes(before),
                           format_bytes(target), ev["error"])
            if kind == "shrink":
                self._last_shrink = now   # retry after `interval`, not in a tight loop
            else:
                self._last_change = now
            return ev
        ev["result"] = result
        self.current_budget = target
        if kind == "shrink":
            self._held = True
        elif kind == "grow":
            self.at_min = False
            self._held = target < self.configured_budget
        self._last_change = now
        if kind == "shrink":
            self._last_shrink = now
        else:
            self._above_since = None
        self.counts[kind] += 1
        self.events.append(ev)
        freed = ""
        if isinstance(result, dict) and "bytes_released" in result:
            freed = f", released {format_bytes(result['bytes_released'])}"
        if kind == "configure":   # the operator's change (SIGHUP), not memory pressure
            self.log.info("floor: budget %s -> %s (configured budget %s, min_budget %s%s)",
                          format_bytes(before), format_bytes(target),
                          format_bytes(self.configured_budget), format_bytes(self.min_budget), freed)
            return ev
        level = logging.WARNING if kind == "shrink" else logging.INFO
        self.log.log(level, "floor: %s budget %s -> %s (available %s, floor %s%s)", kind,
                     format_bytes(before), format_bytes(target), format_bytes(avail),
                     format_bytes(self.floor_bytes), freed)
        return ev

    # -- reconfiguration (SIGHUP) -----------------------------------------------------------
    def reconfigure(self, *, floor_bytes: Optional[int] = None, hysteresis_bytes: Optional[int] = None,
                    configured_budget: Optional[int] = None, min_budget: Optional[int] = None) -> None:
        """Change settings in place (SIGHUP); the next tick acts on them.

        The budget follows at once through ``set_budget`` (event kind ``configure``, counted
        apart from shrinks and grows) where the new settings require it: a new
        ``configured_budget`` is taken as is while the floor has not shrunk the cache, and
        otherwise only cuts a budget above it (a shrink the floor made stays until memory
        allows a grow); a ``min_budget`` above the current budget raises it (at most to the
        configured budget). Raises ValueError for values out of range, changing nothing.
        """
        with self._lock:
            fb = self.floor_bytes if floor_bytes is None else int(floor_bytes)
            hb = self.hysteresis_bytes if hysteresis_bytes is None else int(hysteresis_bytes)
            cb = self.configured_budget if configured_budget is None else int(configured_budget)
            mb = self.min_budget if min_budget is None else int(min_budget)
            if fb < 0 or hb < 0 or mb < 0 or mb > cb:
                raise ValueError(f"floor {fb}, hysteresis {hb}: need >= 0; min_budget {mb}: "
                                 f"need 0 <= min_budget <= configured budget {cb}")
            shrunk = self._held or self.current_budget < self.configured_budget
            self.floor_bytes, self.hysteresis_bytes, self.min_budget = fb, hb, mb
            self.configured_budget = cb
            target = min(self.current_budget, cb) if shrunk else cb
            target = max(target, mb)
            if target != self.current_budget:
                self._change("configure", target,
                             self.last_available if self.last_available is not None else -1,
                             time.monotonic())
            self.at_min = self.current_budget <= self.min_budget
            self._above_since = None

    def resume(self, budget: int) -> None:
        """Take up again after being off while the cache ran at ``budget`` bytes (its
        configured budget): forget the old budget state, keep counts and events."""
        with self._lock:
            self.current_budget = self.configured_budget = int(budget)
            self.min_budget = min(self.min_budget, self.configured_budget)
            self.last_available = None
            self.at_min = self._held = False
            self._above_since = None

    # -- reporting --------------------------------------------------------------------------
    def stats(self) -> dict:
        """State for the daemon's ``stats``: budgets, floor, last available, counts, recent events."""
        with self._lock:
            return {
                "floor_bytes": self.floor_bytes,
                "hysteresis_bytes": self.hysteresis_bytes,
                "configured_budget": self.configured_budget,
                "current_budget": self.current_budget,
                "min_budget": self.min_budget,
                "available": self.last_available,
                "at_min": self.at_min,
                "shrinks": self.counts["shrink"],
                "grows": self.counts["grow"],
                "errors": self.counts["error"],
                "reconfigures": self.counts["configure"],
                "events": [dict(e) for e in self.events],
            }

    # -- thread -----------------------------------------------------------------------------
    def start(self) -> None:
        """Tick every ``interval`` seconds in a daemon thread until :meth:`stop`."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="moecached-floor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a failing probe must not kill the thread
                self.log.exception("floor: tick failed")
            self._stop.wait(self.interval)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (if started) and wait up to ``timeout`` seconds for it."""
        self._stop.set()
        t = self._thread
        if t is not None:
            t.join(timeout)
        self._thread = None
