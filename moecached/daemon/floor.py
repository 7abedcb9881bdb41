"""The daemon's memory floor: shrink the cache budget under memory pressure, grow it back after.

:class:`MemoryFloor` samples available memory (:class:`MemoryProbe`, below: the smaller
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
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from moecached import MoecacheError
from moecached.facts.units import format_bytes

__all__ = ["MemoryFloor", "MIN_MARGIN", "MemoryProbe", "MemorySample", "MemoryLimitError",
           "read_memory_limit", "fit_arena"]

#: Limits at or above this are "no limit" (cgroup v1 writes 2**63 - page size for unlimited).
_UNLIMITED = 1 << 62


@dataclass
class MemorySample:
    """One reading of available memory, in bytes.

    ``available`` is the effective figure, ``min(mem_available, cgroup_headroom)``;
    ``source`` says which one it came from ("MemAvailable" or "cgroup <path>").
    ``cgroup_headroom`` is None outside a memory-limited cgroup. For the tightest limited
    cgroup: ``cgroup`` its directory, ``cgroup_path`` its name as ``/proc/self/cgroup`` writes
    it (``/system.slice/moecached.service``), ``cgroup_limit`` the limit in bytes and
    ``limit_file`` the file it came from (``memory.max``, ``memory.limit_in_bytes``).
    """
    available: int
    mem_available: int
    cgroup_headroom: Optional[int] = None
    cgroup: Optional[str] = None
    cgroup_limit: Optional[int] = None
    source: str = "MemAvailable"
    details: dict = field(default_factory=dict)
    cgroup_path: Optional[str] = None
    limit_file: Optional[str] = None


class MemoryProbe:
    """Reads how much memory can still be used before the kernel (or a cgroup) runs out.

    * ``MemAvailable`` from ``psutil.virtual_memory().available`` (or ``mem_available``, a
      callable returning bytes, for tests).
    * The cgroup headroom of this process's cgroup and of every ancestor that has a limit:
      cgroup v2: ``memory.max - (memory.current - inactive_file)`` (``memory.stat``);
      cgroup v1: ``limit - (memory.usage_in_bytes - total_inactive_file)``, limit being
      ``hierarchical_memory_limit`` from ``memory.stat`` (or ``memory.limit_in_bytes``).
      Inactive file pages are subtracted from usage because the kernel reclaims them before
      it OOM-kills inside the cgroup; shmem is charged and is not reclaimable.

    ``proc_cgroup`` and ``cgroup_root`` are paths (``/proc/self/cgroup``, ``/sys/fs/cgroup``)
    so tests can point them at a fake tree. The cgroup directories are found once, at
    construction (``refresh()`` finds them again).
    """

    def __init__(self, *, proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup",
                 mem_available: Optional[Callable[[], int]] = None):
        self.proc_cgroup = proc_cgroup
        self.cgroup_root = cgroup_root
        self._mem_available = mem_available
        self.refresh()

    # -- discovery -----------------------------------------------------------------------
    def refresh(self) -> None:
        """(Re)locate the cgroup directories whose limits apply to this process."""
        self._v2_dirs: list[str] = []
        self._v2_base = self.cgroup_root
        self._v1_dir: Optional[str] = None
        try:
            with open(self.proc_cgroup) as f:
                lines = f.read().splitlines()
        except OSError:
            return
        for line in lines:
            parts = line.split(":", 2)
            if len(parts) != 3:
                continue
            hier, controllers, path = parts
            if hier == "0" and controllers == "":
                # v2 (unified) — mounted at the root, or at ./unified in hybrid setups
                for base in (self.cgroup_root, os.path.join(self.cgroup_root, "unified")):
                    if os.path.exists(os.path.join(base, "cgroup.controllers")):
                        self._v2_dirs = self._ancestors(base, path, "memory.max")
                        self._v2_base = base
                        break
            elif "memory" in controllers.split(","):
                d = os.path.join(self.cgroup_root, "memory", path.lstrip("/"))
                if os.path.exists(os.path.join(d, "memory.usage_in_bytes")):
                    self._v1_dir = d

    @staticmethod
    def _ancestors(base: str, path: str, marker: str) -> list[str]:
        """Cgroup dirs from ``base/path`` up to (not including) ``base`` that hold ``marker``."""
        out = []
        rel = path.strip("/")
        while rel:
            d = os.path.join(base, rel)
            if os.path.exists(os.path.join(d, marker)):
                out.append(d)
            rel = os.path.dirname(rel)
        return out

    # -- reading -------------------------------------------------------------------------
    @staticmethod
    def _read_int(path: str) -> Optional[int]:
        try:
            with open(path) as f:
                s = f.read().strip()
        except OSError:
            return None
        if s == "max":
            return None
        try:
            return int(s)
        except ValueError:
            return None

    @staticmethod
    def _read_stat(path: str) -> dict:
        out = {}
        try:
            with open(path) as f:
                for line in f:
                    k, _, v = line.partition(" ")
                    try:
                        out[k] = int(v)
                    except ValueError:
                        pass
        except OSError:
            pass
        return out

    def _cgroup_headroom(self):
        """Smallest headroom over the limited cgroups: (bytes, dir, limit, name, limit file) or
        (None, None, None, None, None)."""
        best = (None, None, None, None, None)
        for d in self._v2_dirs:
            limit = self._read_int(os.path.join(d, "memory.max"))
            if limit is None or limit >= _UNLIMITED:
                continue
            current = self._read_int(os.path.join(d, "memory.current"))
            if current is None:
                continue
            inactive = self._read_stat(os.path.join(d, "memory.stat")).get("inactive_file", 0)
            head = max(0, limit - max(0, current - inactive))
            if best[0] is None or head < best[0]:
                best = (head, d, limit, self._name(d, self._v2_base), "memory.max")
        if self._v1_dir:
            d = self._v1_dir
            stat = self._read_stat(os.path.join(d, "memory.stat"))
            limit = stat.get("hierarchical_memory_limit")
            if limit is None:
                limit = self._read_int(os.path.join(d, "memory.limit_in_bytes"))
            usage = self._read_int(os.path.join(d, "memory.usage_in_bytes"))
            if limit is not None and limit < _UNLIMITED and usage is not None:
                inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
                head = max(0, limit - max(0, usage - inactive))
                if best[0] is None or head < best[0]:
                    best = (head, d, limit, self._name(d, os.path.join(self.cgroup_root, "memory")),
                            "memory.limit_in_bytes")
        return best

    @staticmethod
    def _name(d: str, base: str) -> str:
        rel = os.path.relpath(d, base)
        return "/" if rel == "." else "/" + rel

    def mem_available(self) -> int:
        """The kernel's MemAvailable, bytes."""
        if self._mem_available is not None:
            return int(self._mem_available())
        import psutil
        return int(psutil.virtual_memory().available)

    def sample(self) -> MemorySample:
        """Read both sources now; see :class:`MemorySample`."""
        ma = self.mem_available()
        head, d, limit, name, limit_file = self._cgroup_headroom()
        if head is not None and head < ma:
            rel = os.path.relpath(d, self.cgroup_root)
            return MemorySample(head, ma, head, d, limit, f"cgroup /{rel}", cgroup_path=name,
                                limit_file=limit_file)
        return MemorySample(ma, ma, head, d, limit, "MemAvailable", cgroup_path=name,
                            limit_file=limit_file)

    def available(self) -> int:
        """Effective available bytes: ``min(MemAvailable, cgroup headroom)``."""
        return self.sample().available


#: Smallest extra amount a shrink frees beyond the deficit, bytes.
MIN_MARGIN = 64 << 20


class MemoryLimitError(MoecacheError):
    """The arena does not fit in the memory this process may use; the message names the limit,
    the budget and the fix."""


def read_memory_limit(cgroup_root: str = "/sys/fs/cgroup", *, proc_cgroup: str = "/proc/self/cgroup",
                      mem_available: Optional[Callable[[], int]] = None) -> MemorySample:
    """What this process may still use: MemAvailable and the memory cgroup limit (cgroup v2
    ``memory.max`` of its cgroup and every ancestor, v1 ``memory.limit_in_bytes``) with the
    headroom under it, read now under ``cgroup_root`` (a path, so tests can fake the tree)."""
    return MemoryProbe(proc_cgroup=proc_cgroup, cgroup_root=cgroup_root,
                       mem_available=mem_available).sample()


def fit_arena(size: int, sample: MemorySample, *, floor: Optional[int] = None, swap_free: int = 0,
              smallest: int = 0, what: str = "budget") -> int:
    """The arena bytes to reserve for a planned arena of ``size`` bytes, checked against
    ``sample`` (:func:`read_memory_limit`) before anything is reserved.

    The arena must fit in the cgroup's headroom and in MemAvailable (plus ``swap_free`` when it
    is not locked), less :data:`MIN_MARGIN` for the daemon's own memory; an arena past a cgroup
    limit gets the daemon OOM-killed while it reserves, with nothing in the log. Without a
    ``floor`` an arena that does not fit raises :class:`MemoryLimitError` (one line: the limit,
    the budget, the fix). With a ``floor`` the arena is sized down to what fits above the floor
    (the returned value is then smaller than ``size``); it is refused when that is under
    ``smallest`` bytes."""
    margin = MIN_MARGIN
    fmt = lambda n: format_bytes(n, precision=2)  # noqa: E731
    head = sample.cgroup_headroom
    mem_room = sample.mem_available + max(0, int(swap_free)) - margin
    cg_room = None if head is None else head - margin
    if floor is not None:
        avail = sample.mem_available if head is None else min(head, sample.mem_available)
        room = avail - margin - int(floor)
        if size <= room:
            return int(size)
        if room >= max(1, smallest):
            return int(room)
        src = (f"the memory cgroup {sample.cgroup_path} ({sample.limit_file}) has {fmt(avail)} left"
               if head is not None and head <= sample.mem_available else
               f"MemAvailable is {fmt(avail)}")
        raise MemoryLimitError(
            f"{what} {fmt(size)} does not fit above the floor {fmt(floor)}: {src}, less the floor and "
            f"{fmt(margin)} the daemon needs besides the arena leaves {fmt(max(room, 0))}, under the "
            f"smallest arena {fmt(smallest)}; lower --floor, free memory, or raise the memory limit")
    if cg_room is not None and size > cg_room and cg_room <= mem_room:
        limit = int(sample.cgroup_limit)
        fix = ("MemoryMax= (systemctl edit moecached)" if sample.limit_file == "memory.max" else
               "the cgroup's memory.limit_in_bytes (MemoryLimit= under systemd)")
        raise MemoryLimitError(
            f"{what} {fmt(size)} exceeds the memory cgroup limit {fmt(limit)} of {sample.cgroup_path} "
            f"({sample.limit_file}) minus {fmt(max(0, limit - head))} in use and {fmt(margin)} the daemon "
            f"needs besides the arena; lower --budget or raise {fix}, or set --floor to start with "
            f"what fits")
    if size > mem_room:
        swap = f" + free swap {fmt(swap_free)}" if swap_free else ""
        raise MemoryLimitError(
            f"{what} {fmt(size)} exceeds available memory {fmt(sample.mem_available)} (MemAvailable{swap}) "
            f"less {fmt(margin)} the daemon needs besides the arena; lower --budget, free memory, or "
            f"set --floor to start with what fits")
    return int(size)


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
    * ``log``: a :class:`logging.Logger` (default ``moecached.daemon.floor``).
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
        self.log = log or logging.getLogger("moecached.daemon.floor")
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
