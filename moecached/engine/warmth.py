"""Warm starts: a cache's resident set kept in a small state file, and read back at drive speed.

The **state file** of a model names the model it was written for (:func:`model_identity`: the
index's fingerprint and each file's size, mtime, ctime, device and inode, which the reader pool
also compares to notice a changed model) and its resident experts, hottest first::

    {"format": "moecached-warm", "version": 1, "saved": <unix time>, "model": <path>,
     "identity": {"fingerprint": ..., "files": [{path, size, mtime_ns, ctime_ns, dev, ino}]},
     "experts": [[layer, expert], ...]}

It is written whole to a temporary file beside it, synced and renamed over the old one
(:func:`save_state`), so a crash leaves the old file or the new one, never half of one.
:func:`load_state` refuses anything else with one line (:class:`StateError`).

A **fill** (:class:`WarmFill`) loads a list of wanted experts into a running cache: the most
wanted that fit the free slots of their pool, then sorted by file offset, so the drive reads
the model front to back; they go through the cache's prefetch path (prefetch priority: every
demand read goes first, leases and slot generations as for any load), a window of loads in
flight, never evicting anything (an expert whose pool has no free slot left is skipped: the
budget is full). Once loaded they are put in the eviction order as they were wanted (at the
cold end, as prefetched experts enter: the least wanted is the next victim, below every expert
used since). While a fill runs, prefetch chunks may take every reader thread when no demand
read waits (``prefetch_chunks`` is raised to the threads; a demand job still cuts them to
``prefetch_with_demand`` at once). With ``run_bytes`` (the ``fill_run`` key) loads are queued
a run at a time, two runs in flight (past the prefetch cap), and the consecutive ones (the next
expert of a layer into the next slot, as a fresh arena hands its slots out) are read as one job
per run, each part one read over the run's slots (``ExpertCache.prefetch_many``): the drive sees
long front-to-back reads and a queue that never drains between runs. Their confidence is the cache's ``prefetch_min_confidence``, the lowest a
prefetch may have, so an engine's prefetch displaces a queued warm read at the prefetch cap.
Counters: :class:`WarmCounters` (``warm_loaded``, ``warm_bytes``, ``warm_seconds``,
``warm_wanted`` in ``stats``; declared in ``moecached.facts.stats``), kept on the cache as
``cache.warm``.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time

from moecached import MoecacheError

__all__ = ["StateError", "FORMAT", "VERSION", "model_identity", "identity_mismatch",
           "resident_experts", "save_state", "load_state", "WarmCounters", "WarmFill", "plan_fill",
           "counters_of"]

FORMAT = "moecached-warm"
VERSION = 1
#: a fill that sees no load finish or start for this long (the prefetch cap held full by
#: engines' prefetches) ends
STALL_S = 60.0
#: a buffered fill drops its experts' pages from the page cache at its end and this much later
#: again (read-ahead still in flight at the end lands after the first drop)
DROP_AGAIN_S = 0.5
#: ... joining the experts' tensors closer than this (the page cache's large folios straddle them)
DROP_GAP = 16 << 20
#: state files larger than this are refused unread (a model of 1M experts is ~12 MiB)
MAX_STATE_BYTES = 64 << 20


class StateError(MoecacheError):
    """A state file that cannot be used: unreadable, not JSON, truncated, wrong format; one line."""


# -- the model a state file belongs to -----------------------------------------------------------

def model_identity(index) -> dict:
    """What identifies the model files ``index`` was built from: the index's fingerprint (names,
    sizes, mtimes, tensor table) and per file its size, mtime, ctime, device and inode (what the
    reader pool compares to notice a changed model)."""
    return {"fingerprint": index.fingerprint(), "files": index.file_facts()}


def identity_mismatch(state: dict, index) -> str | None:
    """Why ``state`` (from :func:`load_state`) was written for another model than ``index``'s,
    or None when it is this one."""
    want, have = model_identity(index), state.get("identity") or {}
    if have.get("fingerprint") != want["fingerprint"]:
        return (f"it was written for model fingerprint {str(have.get('fingerprint'))[:32]}, "
                f"this model's is {want['fingerprint']}")
    hf = have.get("files") or []
    if len(hf) != len(want["files"]):
        return f"it names {len(hf)} model files, this model has {len(want['files'])}"
    for a, b in zip(hf, want["files"]):
        for k in ("size", "mtime_ns", "ctime_ns", "dev", "ino"):
            if a.get(k) != b[k]:
                return f"model file {b['path']} changed since it was written ({k} {a.get(k)} -> {b[k]})"
    return None


# -- the cache's resident set ---------------------------------------------------------------------
# The cache's pools (one LRU per size class, or per layer): read under its lock, changed never.

def _pool_experts(cache, pool) -> list:
    ne = cache.n_experts
    return [(int(pool.layers[k // ne]), k % ne) for k in pool.lru.keys() if pool.res[k] >= 0]


def resident_experts(cache) -> list:
    """The experts resident in ``cache`` now (``[(layer, expert), ...]``), hottest first: each
    pool's recency order, pools interleaved by rank (the n-th of a pool of N near n/N)."""
    with cache._lock:
        per_pool = [_pool_experts(cache, p) for p in cache._pools]
    ranked = [((i + 0.5) / len(xs), j, x) for j, xs in enumerate(per_pool) for i, x in enumerate(xs)]
    ranked.sort(key=lambda t: (t[0], t[1]))
    return [x for _, _, x in ranked]


def _valid(cache, layer, expert) -> bool:
    return (isinstance(layer, int) and isinstance(expert, int) and not isinstance(layer, bool)
            and not isinstance(expert, bool) and layer in cache._layers
            and 0 <= expert < cache.n_experts)


def whole_model_if_it_fits(cache) -> list | None:
    """Every expert of the model (``[(layer, expert)]``) when the free slots of each pool hold
    all of its missing experts now, else None: a cold daemon whose arena holds the whole model
    reads it all, in file order, instead of one demand miss per expert."""
    ne = cache.n_experts
    with cache._lock:
        for p in cache._pools:
            missing = sum(1 for k in range(len(p.layers) * ne) if p.alloc[k] < 0)
            if missing > len(p.free):
                return None
        return [(int(layer), e) for p in cache._pools for layer in p.layers for e in range(ne)]


def plan_fill(cache, wanted) -> list:
    """Which of ``wanted`` (``[(layer, expert)]``, most wanted first) a fill loads: those not
    resident or loading, at most as many per pool as it has free slots now (the most wanted
    first), in file order (file, offset of the first part). Ids outside the model are skipped."""
    seen, out = set(), []
    with cache._lock:
        room = {id(p): len(p.free) for p in cache._pools}
        for layer, expert in wanted:
            if (layer, expert) in seen or not _valid(cache, layer, expert):
                continue
            seen.add((layer, expert))
            L = cache._layers[layer]
            pool = L.pool
            if pool.alloc[L.base + expert] >= 0 or room[id(pool)] <= 0:
                continue
            room[id(pool)] -= 1
            out.append((L.fids[expert][0], L.offs[expert][0], layer, expert))
    out.sort()
    return [(layer, expert) for _, _, layer, expert in out]


# -- the state file ---------------------------------------------------------------------------

def save_state(path: str, cache, experts=None, model: str | None = None) -> int:
    """Write the state file of ``cache`` at ``path`` atomically (temporary file beside it,
    fsync, rename, fsync of the directory). ``experts``: the list to save (default: the resident
    set, :func:`resident_experts`). Returns the number of experts saved. OSError on failure (the
    old file, if any, stays)."""
    if experts is None:
        experts = resident_experts(cache)
    doc = {"format": FORMAT, "version": VERSION, "saved": round(time.time(), 3),
           "model": model or str(getattr(cache.index.files[0], "path", cache.index.files[0])),
           "identity": model_identity(cache.index),
           "experts": [[int(l), int(e)] for l, e in experts]}
    data = json.dumps(doc, separators=(",", ":")).encode()
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return len(doc["experts"])


def load_state(path: str) -> dict:
    """Read and check a state file: ``{"model", "identity", "experts": [(layer, expert)], "saved"}``.
    FileNotFoundError when there is none; :class:`StateError` (one line naming the file) when it
    cannot be used: unreadable, too large, not JSON (truncated), another format or version,
    fields of the wrong type."""
    def bad(why):
        return StateError(f"state file {path}: {why}")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise bad(f"cannot read it ({e.strerror or e})") from None
    if len(data) > MAX_STATE_BYTES:
        raise bad(f"larger than {MAX_STATE_BYTES} bytes")
    try:
        doc = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"not a complete JSON document (truncated or corrupt: {str(e)[:80]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad(f"not a {FORMAT} state file")
    if doc.get("version") != VERSION:
        raise bad(f"version {doc.get('version')!r}: expected {VERSION}")
    ident, experts = doc.get("identity"), doc.get("experts")
    if not isinstance(ident, dict) or not isinstance(ident.get("files"), list):
        raise bad("field 'identity' missing or not a map with 'files'")
    if not isinstance(experts, list) or not all(
            isinstance(x, list) and len(x) == 2 and all(type(v) is int and v >= 0 for v in x)
            for x in experts):
        raise bad("field 'experts' is not a list of [layer, expert] pairs of integers >= 0")
    return {"model": doc.get("model"), "identity": ident, "saved": doc.get("saved"),
            "experts": [(x[0], x[1]) for x in experts]}


# -- filling --------------------------------------------------------------------------------------

class WarmCounters:
    """What fills did to one cache (``cache.warm``): ``loaded`` experts and their ``bytes``,
    ``seconds`` spent filling (a running fill counts up to now), ``wanted`` (experts the last
    fill set out to load), ``running`` (the fill now, or None), ``pending`` (experts the running
    fill has yet to load)."""

    def __init__(self):
        self.loaded = 0
        self.bytes = 0
        self.wanted = 0
        self._seconds = 0.0
        self.running: WarmFill | None = None

    @property
    def seconds(self) -> float:
        r = self.running
        live = time.monotonic() - r.t0 if r is not None and r.t0 is not None else 0.0
        return round(self._seconds + live, 3)

    @property
    def pending(self) -> int:
        """Experts the running fill has yet to load (0: no fill runs)."""
        r = self.running
        return max(0, r.planned - r.done) if r is not None else 0


def counters_of(cache) -> WarmCounters:
    """The cache's :class:`WarmCounters` (made on first use)."""
    w = getattr(cache, "warm", None)
    if w is None:
        w = cache.warm = WarmCounters()
    return w


class WarmFill:
    """Load ``wanted`` (``[(layer, expert)]``, most wanted first) into ``cache`` in file order
    at prefetch priority, in a thread (:meth:`start`); see the module doc.

    ``window``: warm loads in flight (default: half of ``max_prefetch_loads``, at least 2; never
    more than leaves the cap for engines' prefetches). ``run_bytes`` (the ``fill_run`` key):
    loads are queued a run (at most this many bytes) at a time, the window two runs (past the
    prefetch cap: one run reads while the next waits behind it, so the drive's queue never
    drains between runs; engines' prefetches wait for the fill), and consecutive ones (the next
    expert of a layer into the next slot, as a fresh arena's free slots are taken) are read as
    one job, one read per part spanning their slots
    (``moecached.engine.cache.ExpertCache.prefetch_many``); 0: a read job per expert.
    ``run_io`` (the ``fill_io`` key): ``"direct"`` (O_DIRECT, as every read) or ``"buffered"``
    (runs read through the page cache's read-ahead, each chunk dropped from it once copied). ``progress(done, total, nbytes)``: called
    from the fill's thread as loads finish. ``on_done(fill)``: called once at the end.
    Attributes: ``planned`` (experts to load), ``done`` (loaded), ``nbytes``, ``elapsed``,
    ``stopped``, ``source`` (what the list came from, for messages).
    """

    def __init__(self, cache, wanted, *, source: str = "", window: int | None = None,
                 progress=None, on_done=None, log=None, passes: int = 3, run_bytes: int = 0,
                 run_io: str = "direct"):
        from moecached.engine.cache import PrefetchQuota
        self.cache = cache
        self.wanted = list(wanted)
        self.source = source
        self.log = log or logging.getLogger("moecached.engine.warmth")
        cap = int(cache.max_prefetch_loads)
        self.window = max(1, min(cap, int(window) if window else max(2, cap // 2)))
        #: ``fill_run``: consecutive experts (file order, consecutive slots) are read as runs of
        #: at most this many bytes, one read per part spanning their slots (0: one per expert)
        self.run_bytes = max(0, int(run_bytes)) if cap > 0 else 0
        #: ``fill_io``: "buffered" reads runs through the page cache's read-ahead (dropped behind)
        self.run_io = run_io
        #: with runs, the window is two runs (past the prefetch cap, unless ``window`` is given)
        self.quota = PrefetchQuota(None, past_cap=bool(self.run_bytes) and not window)
        self.progress, self.on_done = progress, on_done
        self.passes = passes
        #: why nothing is loaded although experts are wanted (None: nothing stops the fill)
        self.why_not = None
        if cap <= 0:
            self.plan = []
            self.why_not = "prefetch is off (max_prefetch_loads = 0), and a fill loads at prefetch priority"
        else:
            self.plan = plan_fill(cache, self.wanted)
        self.planned = len(self.plan)
        self.done = self.nbytes = 0
        self.populated = 0   # bytes of the arena mapped ahead of the readers (:meth:`_populate`)
        self.t0 = None
        self.elapsed = 0.0
        self.stopped = False
        self._stop = threading.Event()
        self._thread = None
        self._bytes_of = {L: sum(cache._cls[cache._layers[L].cid][0].part_bytes.values())
                          for L in {layer for layer, _ in self.plan}}
        #: experts queued together (one run each when they follow one another): a run's bytes,
        #: and the window two of them, so one run reads while the next waits in the queue
        big = max(self._bytes_of.values(), default=1)
        self.group = max(1, self.run_bytes // max(1, big)) if self.run_bytes else 1
        if self.quota.past_cap:
            self.window = max(self.window, 2 * self.group)
        self.group = min(self.group, max(1, self.window // 2))

    # ---- the fill's thread ------------------------------------------------------------------
    def start(self) -> "WarmFill":
        w = counters_of(self.cache)
        if w.running is not None and w.running is not self:
            w.running.stop()
        w.running, w.wanted = self, self.planned
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="moecached-warm", daemon=True)
        self._thread.start()
        return self

    def stop(self, wait: float = 10.0) -> None:
        """Queue no more loads (those in flight finish) and wait for the thread."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(wait)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the fill to end; True when it has."""
        t = self._thread
        if t is None:
            return True
        t.join(timeout)
        return not t.is_alive()

    def remaining(self) -> list:
        """Planned experts not resident (yet), in plan order."""
        cache = self.cache
        with cache._lock:
            return [(l, e) for l, e in self.plan
                    if cache._layers[l].pool.res[cache._layers[l].base + e] < 0]

    def _count(self, queued: list) -> list:
        """Count the queued experts whose loads ended resident; returns those still loading
        (one that is neither was not queued, or its load failed or was withdrawn)."""
        cache, left, new, nb = self.cache, [], 0, 0
        with cache._lock:
            for layer, expert in queued:
                L = cache._layers[layer]
                k = L.base + expert
                if L.pool.res[k] >= 0:
                    new += 1
                    nb += self._bytes_of[layer]
                elif k in L.pool.loading:
                    left.append((layer, expert))
        if new:
            self.done += new
            self.nbytes += nb
            w = counters_of(cache)
            w.loaded += new
            w.bytes += nb
            if self.progress is not None:
                try:
                    self.progress(self.done, self.planned, self.nbytes)
                except Exception:
                    self.log.exception("warm fill progress callback raised")
        return left

    def _run(self) -> None:
        cache, quota = self.cache, self.quota
        q = cache.readers.queue
        # While the fill runs, prefetch chunks may take every reader thread when no demand read
        # waits (a demand job still cuts them to prefetch_with_demand at once): the drive's
        # whole queue for the fill, as a demand burst would have it.
        with q._cond:
            pf_max, raised = q._pf_max, max(q._pf_max, q.threads)
            q._pf_max = raised
            q._cond.notify(raised - pf_max)
        try:
            todo = list(self.plan)
            for _ in range(self.passes):
                inflight: list = []
                i = 0
                moved = time.monotonic()
                while (i < len(todo) or inflight) and not self._stop.is_set():
                    if inflight:
                        n = len(inflight)
                        inflight = self._count(inflight)
                        if len(inflight) < n:
                            moved = time.monotonic()
                    room = self.window - quota.in_flight
                    if not quota.past_cap:
                        room = min(room, cache.max_prefetch_loads - cache._pf_loading)
                    if inflight and room < min(self.group, len(todo) - i):
                        room = 0   # wait for a whole run's room (a run reads as one job)
                    if self.group > 1:   # a run at a time: the next one queued behind it
                        room = min(room, self.group)
                    if i >= len(todo) or room <= 0:
                        if time.monotonic() - moved > STALL_S:   # engines' prefetches hold the cap
                            self.log.warning("warm fill from %s: no load finished or started for "
                                             "%.0f s (the prefetch cap stays full): ended with %d "
                                             "of %d experts", self.source or "a list", STALL_S,
                                             self.done, self.planned)
                            self._stop.set()
                            break
                        time.sleep(0.002)
                        continue
                    moved = time.monotonic()
                    batch, i = self._batch(todo[i:i + room]), i + room
                    if batch:
                        self._queue(batch)
                        inflight += batch
                if self._stop.is_set():
                    break
                todo = self._batch(self.remaining())   # failed, withdrawn or skipped: again
                if not todo:
                    break
            if not self._stop.is_set():
                self._reorder()
        except Exception as e:   # the cache closed under us, or a bug: end the fill, say why
            if not self._stop.is_set():
                self.log.warning("warm fill from %s ended early: %s", self.source or "a list", e)
        finally:
            with q._cond:
                if q._pf_max == raised:
                    q._pf_max = pf_max
            if self.run_io == "buffered":   # the read-ahead past each run's end: dropped too,
                self._drop_cached()         # and again once the read-ahead in flight landed
                t = threading.Timer(DROP_AGAIN_S, self._drop_cached)
                t.daemon = True
                t.start()
            self.stopped = self._stop.is_set()
            self.elapsed = time.monotonic() - self.t0
            w = counters_of(cache)
            if w.running is self:
                w._seconds += self.elapsed
                w.running = None
            if self.on_done is not None:
                try:
                    self.on_done(self)
                except Exception:
                    self.log.exception("warm fill done callback raised")

    def _drop_cached(self) -> None:
        """Drop the planned experts' parts from the page cache (buffered runs dropped each chunk
        once copied, but the read-ahead past a run's end may have brought more)."""
        idx = self.cache.index
        try:
            self.cache.readers.drop_cached(((s.file, s.offset, s.nbytes) for layer, expert in self.plan
                                            for s in idx.parts(layer, expert)), join_gap=DROP_GAP)
        except Exception as e:   # the cache closed under us: nothing left to drop
            self.log.debug("warm fill: page cache not dropped: %s", e)

    def _reorder(self) -> None:
        """Put the experts the fill loaded in the order they were wanted: loaded in file order,
        each entered at the cold end; now the most wanted of them is the least cold, the least
        wanted the next victim (still below every expert used since). Experts used or pinned
        meanwhile keep their place."""
        cache = self.cache
        with cache._lock:
            for layer, expert in self.wanted:   # most wanted first: each goes to the cold end
                L = cache._layers.get(layer)
                if L is None:
                    continue
                pool, k = L.pool, L.base + expert
                if pool.res[k] >= 0 and pool.unused[k] and not pool.lru.pin_count(k):
                    pool.lru.remove(k)
                    pool.lru.insert(k, True)

    def _batch(self, items: list) -> list:
        """Of ``items``, those still absent and with a free slot in their pool now (a fill never
        evicts: a pool without one is full)."""
        cache = self.cache
        out, room = [], {}
        with cache._lock:
            for layer, expert in items:
                L = cache._layers[layer]
                pool = L.pool
                r = room.setdefault(id(pool), len(pool.free))
                if pool.alloc[L.base + expert] >= 0 or r <= 0:
                    continue
                room[id(pool)] = r - 1
                out.append((layer, expert))
        return out

    def _queue(self, batch: list) -> int:
        reqs, conf = [], []
        c = float(self.cache.prefetch_min_confidence)
        for layer, expert in batch:
            if reqs and reqs[-1][0] == layer:
                reqs[-1][1].append(expert)
                conf[-1].append(c)
            else:
                reqs.append((layer, [expert]))
                conf.append([c])
        n = self.cache.prefetch_many(reqs, quota=self.quota, conf=conf,
                                     run=(self.run_bytes, self.run_io == "buffered"))
        if self.run_bytes:
            self._populate(batch)
        return n

    def _populate(self, batch: list) -> None:
        """Map the slots of ``batch``'s loads into the daemon now (an unlocked arena's pages are
        mapped on first use: by each O_DIRECT read, one page at a time, otherwise); the readers
        are still reading the run before, so this runs ahead of them."""
        cache, by_class = self.cache, {}
        with cache._lock:
            for layer, expert in batch:
                L = cache._layers[layer]
                slot = L.pool.alloc[L.base + expert]
                if slot >= 0:
                    by_class.setdefault(L.cid, []).append(int(slot))
        try:
            for cid, slots in by_class.items():
                self.populated += cache.arena.populate(cid, slots)
        except Exception as e:   # the cache closed under us
            self.log.debug("warm fill: slots not populated: %s", e)
