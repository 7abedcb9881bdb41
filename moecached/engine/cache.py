"""The expert cache: ties the GGUF index, the slot arena, the reader pool and the eviction policy.

Model::

    index (where each expert's bytes are)  --->  ReaderPool (O_DIRECT reads)  --->  Arena slots
                                                                                    ^
    acquire / acquire_many / acquire_async / prefetch / release  ---- ExpertCache --+-- LRU per pool

* A *pool* is a set of slots of one size class with one LRU (policy ``"global"``: one per size
  class; ``"per-layer"``: one per layer, an equal share of its class's slots).
* An expert ``(layer, expert)`` is, in its pool, *absent*, *loading* (slot allocated, read in
  flight, pinned by the load) or *resident* (slot published). A slot is published only when its
  read succeeded; a failed read frees the slot and fails every acquire waiting on it with
  :class:`LoadError` (other loads go on).
* ``acquire`` is all-or-nothing: granted when every expert is resident or can get a slot right
  now, then it pins them, starts one read per absent expert and completes when the last lands;
  else it waits in a FIFO queue holding no pins. Every lease pins its experts until
  ``release``; every load pins its slot until it ends; pinned keys are never evicted, never
  given back by :meth:`ExpertCache.set_budget`.
* A failed load gives its slot back as it found it (to the expert it evicted when no byte was
  read into it). Once the model file changes (``model_changed``), acquires that need a read
  fail at once with :class:`ModelChangedError`, prefetches queue nothing; resident hits go on.
* Prefetches never wait and never jump the queue; confidence, caps and demand-hot experts:
  ``moecached.engine.prefetch``.

The cache is a facade over parts that each own their state, never calling back into it (they
return work -- reads to submit, loads to promote, callbacks to run -- which the cache does after
dropping its lock):

=========================================  ===================================================
``moecached.engine.slots`` (Layout, Tally)  pools, layers, slot generations, resident map, per-layer counters
``moecached.engine.pins`` (ShmPins, Lease)  shared-memory pins and pin files; what an acquire returns
``moecached.engine._hits`` (HitPath)        the lease table and the resident-hit path (Cython)
``moecached.engine.pools`` (Pools)          eviction, slots given back, budget shrink/grow, ghosts
``moecached.engine.loads`` (Loads)          the life of a load: queued, in flight, landed, withdrawn
``moecached.engine.prefetch`` (PrefetchGate) the prefetch gate: quotas, caps, confidence
``moecached.engine.requests`` (Requests)    acquires, their queue and waiters; admission
``moecached.engine.substitute``             substitution, decided when an acquire arrives
=========================================  ===================================================

Lock discipline: one ``threading.Lock`` (``_lock``) around all bookkeeping of every part;
reads are submitted, promoted, memory released/restored and user callbacks invoked only after
it is dropped. ``_budget_lock`` serialises :meth:`ExpertCache.set_budget` calls (the arena's
memory moves outside ``_lock``, under it). The parts' methods run under ``_lock`` taken here,
except where their docstrings say otherwise (the hit path takes it itself).

Counting (per requested expert, disjoint, ``hits + prefetch_hits + misses + substituted ==
len(experts)``): ``moecached.engine.requests``.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading

from moecached.engine._hits import HitPath
from moecached.engine.errors import (AcquireTimeout, CacheClosed, CacheError, CapacityError,
                                     LeaseError, LoadError, ModelChangedError, RequestError)
from moecached.engine.loads import Loads
from moecached.engine.pins import Lease, ShmPins
from moecached.engine.policy import EVICTIONS, SCAN_ADMITS
from moecached.engine.pools import Pools
from moecached.engine.prefetch import PrefetchGate, PrefetchQuota
from moecached.engine import runs
from moecached.engine.requests import Requests
from moecached.engine.slots import Layout, Tally
from moecached.facts.stats import CACHE_STATS, CLASS_STATS, FAST_PATH_STATS, LAYER_STATS

__all__ = ["CacheError", "RequestError", "CapacityError", "LeaseError", "LoadError",
           "ModelChangedError", "AcquireTimeout", "CacheClosed", "Lease", "PrefetchQuota",
           "ExpertCache"]


class _Via:
    """An attribute of the cache kept by one of its parts: the names the counters' table
    (``moecached.facts.stats``), the daemon and the tests read (and a few set)."""
    __slots__ = ("part", "name")

    def __init__(self, part: str, name: str):
        self.part, self.name = part, name

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        return getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj, value):
        setattr(getattr(obj, self.part), self.name, value)


class ExpertCache:
    """Expert cache over one model (see module doc for semantics).

    Args:
        index: an ``ExpertIndex`` (``moecached.engine.index.open_index``).
        budget_bytes / slots: arena size, exactly one (``moecached.engine.arena.plan_slots`` semantics:
            each size class gets the same share of its layers' experts). Neither: all experts.
        policy: ``"global"`` (one LRU per size class over all its layers) or ``"per-layer"``.
        readers: reader threads; chunk_bytes: read chunk size (bytes); direct_io: O_DIRECT.
        read_queue: a ``ReadQueue`` shared with other caches (several models of one daemon): its
            threads read this cache's experts and ``readers`` / ``chunk_bytes`` are its; closing
            the cache leaves it running. None: a queue of the cache's own.
        arena_dir, arena_name, hugetlb, lock_memory: passed to ``Arena`` (``lock=lock_memory``).
        shrunk_policy: what an acquire that fits the class's configured size but not its current
            (``set_budget``-shrunk) size does: ``"wait"`` (queue until the budget grows) or
            ``"error"`` (RequestError at once).
        max_prefetch_loads: prefetch loads allowed in flight (queued or reading, not yet
            demanded); further prefetches are dropped and counted in ``prefetches_dropped``,
            since prefetch pays only when the drive has slack. Default: 2 x top-k x size
            classes, at least 16.
        prefetch_min_confidence: prefetched experts of lower confidence are dropped (config key
            of that name; an attribute a reload sets).
        admit_cold, scan_admit, eviction: the config keys of those names
            (``moecached.engine.requests``, ``moecached.engine.policy``).
        log: a ``logging.Logger`` (default ``logging.getLogger("moecached.engine.cache")``).
        arena_progress: ``progress(done, total)`` while the arena is reserved and locked.

    Attributes: ``arena`` (``Arena``), ``index``, ``readers`` (``ReaderPool``), ``hit_path``
    (the resident-hit path the server's hot path calls: ``moecached.engine._hits.HitPath``).

    Raises:
        CacheError: bad policy, or ``"per-layer"`` with fewer slots than layers in a class.
        ArenaError: from the arena (budget, /dev/shm, RLIMIT_MEMLOCK).
    """

    def __init__(self, index, *, budget_bytes=None, slots=None, policy="global", readers=16,
                 chunk_bytes=256 * 1024, arena_dir="/dev/shm", arena_name=None, hugetlb=False,
                 lock_memory=True, direct_io=True, shrunk_policy="wait", max_prefetch_loads=None,
                 log=None, arena_progress=None, admit_cold="off", eviction="lru", scan_admit="cold",
                 prefetch_min_confidence=0.0, read_queue=None):
        from moecached.engine.arena import Arena, plan_slots
        from moecached.engine.readers import ReaderPool

        if policy not in ("global", "per-layer"):
            raise CacheError(f"policy: found {policy!r}, expected 'global' or 'per-layer'")
        if eviction not in EVICTIONS:
            raise CacheError(f"eviction: found {eviction!r}, expected one of {', '.join(EVICTIONS)}")
        self.eviction = eviction
        if shrunk_policy not in ("wait", "error"):
            raise CacheError(f"shrunk_policy: found {shrunk_policy!r}, expected 'wait' or 'error'")
        self.log = log or logging.getLogger("moecached.engine.cache")
        self.index = index
        self.policy = policy
        if scan_admit not in SCAN_ADMITS:
            raise CacheError(f"scan_admit: found {scan_admit!r}, expected one of {', '.join(SCAN_ADMITS)}")
        self._plan_slots = plan_slots
        self._lock = threading.Lock()
        self._budget_lock = threading.Lock()
        ne = self.n_experts = int(index.n_experts)
        if budget_bytes is None and slots is None:
            slots = sum(len(sc.layers) for sc in index.size_classes) * ne
        self.arena = Arena(index, budget_bytes=budget_bytes, slots=slots, dir=arena_dir,
                           name=arena_name, hugetlb=hugetlb, lock=lock_memory, progress=arena_progress)
        try:
            self._layout = layout = Layout(index, self.arena, policy, eviction)
            files = [str(getattr(f, "path", f)) for f in index.files]
            self._file_names = files
            sizes = getattr(index, "file_sizes", None)
            mtimes = getattr(index, "file_mtimes_ns", None)
            ident = getattr(index, "file_identity", None) or None
            if not sizes or not mtimes:  # duck-typed index: what the files are now
                sts = [os.stat(f) for f in files]
                sizes, mtimes = [st.st_size for st in sts], [st.st_mtime_ns for st in sts]
            own = {} if read_queue is not None else dict(threads=readers, chunk_bytes=chunk_bytes)
            self.readers = ReaderPool(files, direct=direct_io, file_sizes=sizes,
                                      file_mtimes_ns=mtimes, file_identity=ident, log=self.log,
                                      queue=read_queue, **own)
        except BaseException:
            self.arena.close(unlink=True)
            raise
        self._tally = tally = Tally(max(layout.layers) + 1)
        self._shmpins = ShmPins(layout, tally)
        self._slots = Pools(layout, self._shmpins)
        self._loads = Loads(layout, self._slots, tally, self.log, files)
        self._gate = PrefetchGate(layout, self._slots, self._loads, index, max_prefetch_loads,
                                  prefetch_min_confidence)
        waitq: list = []
        base = secrets.randbits(62) | (1 << 62)  # random 63-bit base, far from 2**63
        self._hits = HitPath(self._lock, layout, tally, waitq, Lease, base)
        self._requests = Requests(layout, self._slots, self._loads, self._hits, tally, waitq,
                                  shrunk_policy=shrunk_policy, admit_cold=admit_cold,
                                  scan_admit=scan_admit)

    # ---- the parts' state, by the names it has always had -------------------------------------
    _layers = _Via("_layout", "layers")
    _pools = _Via("_layout", "pools")
    _cls = _Via("_layout", "cls")
    _gens = _gens_mv = _Via("_layout", "gens")
    _shm = _Via("_layout", "shm")
    _moe_layers = _Via("_layout", "moe_layers")
    _max_bytes = _Via("_layout", "max_bytes")
    _l_hits = _Via("_tally", "hits")
    _l_pf = _Via("_tally", "pf")
    _l_miss = _Via("_tally", "miss")
    _l_reads = _Via("_tally", "reads")
    _l_subst = _Via("_tally", "subst")
    _held = _Via("_shmpins", "held")
    fast_log = _Via("_shmpins", "fast_log")
    _leases = _Via("_hits", "table")
    _id_base = _Via("_hits", "id_base")
    _closed = _Via("_hits", "closed")
    c_leases = _Via("_hits", "granted")
    _reqs = _Via("_requests", "reqs")
    _waitq = _Via("_requests", "waitq")
    c_waits, shrunk_policy, admit_cold, scan_admit = (
        _Via("_requests", n) for n in ("c_waits", "shrunk_policy", "admit_cold", "scan_admit"))
    _pf_loading = _Via("_loads", "pf_loading")
    c_inflight, c_reads, c_bytes, c_read_errors, c_reads_discarded, c_run_reads, c_run_loads = (
        _Via("_loads", n) for n in ("c_inflight", "c_reads", "c_bytes", "c_read_errors",
                                     "c_reads_discarded", "c_run_reads", "c_run_loads"))
    c_evictions, c_wasted, c_ghost_hits, c_shrinks, c_grows, c_repunched = (
        _Via("_slots", n) for n in ("c_evictions", "c_wasted", "c_ghost_hits", "c_shrinks",
                                     "c_grows", "c_repunched"))
    (max_prefetch_loads, prefetch_min_confidence, c_prefetches, c_pf_dropped, c_pf_low_conf,
     c_pf_displaced, c_pf_hot) = (
        _Via("_gate", n) for n in ("max_prefetch_loads", "prefetch_min_confidence", "c_prefetches",
                                    "c_pf_dropped", "c_pf_low_conf", "c_pf_displaced", "c_pf_hot"))

    @property
    def hit_path(self) -> HitPath:
        """The resident-hit path (``moecached.engine._hits.HitPath``): what the server's hot
        path calls for acquires of resident experts, releases and no-op prefetches."""
        return self._hits

    # ---- outside the lock ----------------------------------------------------------------------
    def _after(self, submits, promotes, done) -> None:
        """Submit reads, promote, run callbacks: always called with the lock released."""
        readers = self.readers
        for run in runs.cut(submits):
            if len(run) > 1:   # consecutive loads of a fill: one job
                runs.submit(self, run)
                continue
            (load, reads), = run
            try:
                jid = readers.submit(reads, priority=load.priority,
                                     callback=lambda j, err, n, sec, _l=load:
                                     self._on_read(_l, err, n, sec))
            except Exception as e:  # pool closed or refused: fail the load like a read error
                e.dest_written = False  # refused before reading: the slot is as it was
                self._on_read(load, e, 0, 0.0)
                continue
            load.job_id = jid
            if load.priority and load.demanded:
                readers.promote(jid)
        for load in promotes:
            jid = load.job_id
            if jid is not None:
                readers.promote(jid)
        for cb, res in done:
            try:
                cb(res)
            except Exception:
                self.log.exception("moecached cache: acquire callback raised")

    def _on_read(self, load, error, nbytes: int, seconds: float) -> None:
        """Reader-thread callback of one load: publish or free its slot, complete/fail waiters."""
        submits, promotes, done = [], [], []
        err = None
        with self._lock:
            if self._closed:
                return
            try:
                err = self._requests.on_read(load, error, nbytes, self.readers, submits, promotes,
                                             done)
            except Exception as e:  # a bookkeeping bug must not leave requesters hanging
                self.log.exception("moecached cache: internal error completing a load")
                self._requests.abandon(load, CacheError(
                    f"internal error completing load of layer {load.layer} expert "
                    f"{load.expert}: {e!r}"), done)
        if err is not None:
            self.log.warning("moecached cache: %s", err)
        if submits or promotes or done:
            self._after(submits, promotes, done)

    def _kick(self, submits, promotes, done) -> None:
        """Grant queued requests that now fit (under the lock)."""
        if self._requests.waitq:
            self._requests.kick(self.readers, submits, promotes, done)

    # ---- acquire / release ---------------------------------------------------------------------
    def acquire(self, layer: int, experts, timeout: float | None = None) -> Lease:
        """Block until every expert of ``layer`` in ``experts`` is resident; pin them; return a Lease.

        Args:
            layer: GGUF block number with routed experts (one of ``index.expert_layers``).
            experts: expert ids (ints ``0 .. n_experts-1``, no duplicates).
            timeout: seconds, or None to wait for ever.
        Returns: :class:`Lease`, items in the order of ``experts``.
        Raises: RequestError / CapacityError (at once), LoadError, AcquireTimeout, CacheClosed.
        """
        if type(experts) is not list:
            experts = list(experts)
        lease = self._hits.acquire(layer, experts)
        if lease is not None:
            return lease
        return self.acquire_many([(layer, experts)], timeout=timeout)

    def acquire_resident(self, layer: int, experts: list) -> Lease | None:
        """The hit path: pin ``experts`` of ``layer`` when every one of them is resident.

        Args:
            layer: GGUF block number; experts: a list of Python ints (at most 256).
        Returns: a :class:`Lease` (stall 0.0, misses 0), counted exactly as
            :meth:`acquire_async` would count it; or ``None`` when the request needs the
            general path: any expert absent or still loading, an unknown layer, a bad,
            repeated or out-of-range id, an empty list, or the cache closed. ``None`` changes
            nothing; the general path then waits for reads or raises the precise error.
        One call into Cython (``HitPath.acquire``: the cache lock, ``LRU.grant_resident``).
        """
        return self._hits.acquire(layer, experts)

    def acquire_many(self, requests, timeout: float | None = None) -> Lease:
        """Like :meth:`acquire` for several layers at once: one all-or-nothing lease.

        Args:
            requests: ``[(layer, [expert, ...]), ...]``; each (layer, expert) at most once
                (a repeat is a RequestError). Several layers of one size class share its slots:
                their experts together must fit the class.
            timeout: seconds or None.
        Returns: one :class:`Lease`, items layer by layer in request order.
        Raises: as :meth:`acquire`.
        """
        ev = threading.Event()
        box = []

        def cb(res):
            box.append(res)
            ev.set()

        ticket = self.acquire_async(requests, cb)
        if not ev.wait(timeout):
            if self.cancel(ticket):
                raise AcquireTimeout(f"acquire of {sum(len(e) for _, e in requests)} experts "
                                     f"timed out after {timeout} s")
            ev.wait()
        res = box[0]
        if isinstance(res, BaseException):
            raise res
        return res

    def acquire_async(self, requests, callback, *, tag=None, subst=None) -> int:
        """Start an acquire of ``[(layer, [experts]), ...]``; returns its ticket (= the lease id).

        Every layer's reads are queued at once. ``callback(result)`` gets a :class:`Lease` or a
        :class:`CacheError` (LoadError, CacheClosed) exactly once, unless :meth:`cancel`
        returned True for the ticket (then never): inline before this returns when everything is
        resident, otherwise from a reader thread (or the thread whose release/set_budget freed
        the slots it waited for). Bad requests raise RequestError here, no callback.
        ``tag`` is kept on the request (for the caller's bookkeeping; shown nowhere else).
        ``subst``: ``(r, cap, {layer: (scores, candidates)})`` -- substitution, decided here on
        arrival (``moecached.engine.substitute``; docs/policies.md, "Substitution"):
        ``scores`` are the router's scores of the layer's requested experts (same order),
        ``candidates`` ``[(expert, score), ...]`` further experts ranked by the router (none of
        them requested); ``cap`` (< 0: none) bounds the swaps per layer. The lease's ``swaps``
        say which experts were replaced, and its items name the substitutes.
        """
        submits, promotes, done = [], [], []
        with self._lock:
            if self._closed:
                raise CacheClosed()
            rid = self._requests.submit(requests, callback, tag, subst, self.readers, submits,
                                        promotes, done)
        self._after(submits, promotes, done)
        return rid

    def cancel(self, ticket: int) -> bool:
        """Drop a waiting acquire (client vanished): unpin what it pinned; its reads go on as
        prefetches (their experts enter unused). Returns False when the ticket is unknown or
        already completed/failed (then its callback has been or is being called)."""
        submits, promotes, done = [], [], []
        with self._lock:
            if not self._requests.cancel(ticket, self.readers, submits, promotes, done):
                return False
        self._after(submits, promotes, done)
        return True

    def release(self, lease_or_id) -> None:
        """Unpin a lease (a :class:`Lease` or its id). LeaseError when unknown or released twice."""
        if self._hits.release(lease_or_id):
            return
        lid = lease_or_id.id if isinstance(lease_or_id, Lease) else lease_or_id
        submits = None
        with self._lock:
            pins = self._hits.table.pop(lid, None)
            if pins is not None:
                for pool, keys in pins:
                    pool.lru.unpin_keys(keys)
                if self._requests.waitq:
                    submits, promotes, done = [], [], []
                    self._kick(submits, promotes, done)
        if pins is None:
            if isinstance(lid, int) and not self.own_lease_id(lid):
                raise LeaseError(f"lease {lid}: not from this cache instance (stale: daemon restarted?)")
            raise LeaseError(f"lease {lid}: unknown or already released")
        if submits is not None:
            self._after(submits, promotes, done)

    def own_lease_id(self, lid: int) -> bool:
        """True when ``lid`` lies in this cache instance's id range (issued here, or one it
        could issue); False marks a lease id from another instance, e.g. before a restart."""
        return self._hits.own(lid)

    def lease_generations(self, items) -> list[int]:
        """Generation of each item's slot (``(layer, expert, class_id, slot)`` items of a lease
        still pinned): what a holder compares against the arena's control block to know its
        lease is still valid (docs/protocol.md, "Lease validity")."""
        return self._hits.generations(items)

    # ---- prefetch --------------------------------------------------------------------------------
    def prefetch(self, layer: int, experts, conf=None) -> int:
        """Queue prefetch reads (low priority) for the absent ones of ``experts`` of ``layer``.

        Resident or in-flight experts are skipped; an expert that cannot get a slot now (pool all
        pinned, or acquires queued for slots in that pool) is skipped too: prefetch never waits
        and never jumps the queue. ``conf``: confidence per expert (see :meth:`prefetch_many`).
        Returns the number of reads queued. RequestError on a bad layer/expert/confidence.
        """
        return self.prefetch_many([(layer, experts)], conf=None if conf is None else [conf])

    def prefetch_many(self, requests, quota: PrefetchQuota | None = None, conf=None, run=None) -> int:
        """:meth:`prefetch` for ``[(layer, [experts]), ...]``; returns reads queued in total.

        ``quota``: the sender's :class:`PrefetchQuota`: its loads count there, and a read that
        would take it past ``quota.limit`` is dropped (counted in ``quota.dropped`` and in
        ``prefetches_dropped``), so one sender cannot take every prefetch load.
        ``conf``: ``[[confidence per expert], ...]`` parallel to ``requests`` (floats in [0, 1];
        None: all 1). Experts below ``prefetch_min_confidence`` are dropped; the rest are taken
        highest confidence first (request order among equals); at a cap, a queued read not yet
        started of lower confidence (the sender's own when its own cap is the one reached) is
        withdrawn in favour of the new one; a read whose slot would cost a demand-hot expert
        is dropped (``moecached.engine.prefetch``). Everything is validated before anything is
        queued. ``run`` (a fill's ``(fill_run, fill_io == "buffered")``): the loads this call
        queues that follow one another are read as runs of that many bytes (``engine.runs``)."""
        submits, promotes, done = [], [], []
        if conf is not None and len(conf) != len(requests):
            raise RequestError(f"conf: {len(conf)} lists for {len(requests)} layers, expected one per layer")
        with self._lock:
            if self._closed:
                raise CacheClosed()
            todo = self._gate.plan(requests, conf)
            if self.readers.model_changed is not None:
                return 0   # nothing is read from a changed model
            queued, displaced = self._gate.queue(todo, quota, conf is not None,
                                                 self._requests.waiting_pools(), self.readers,
                                                 submits)
            for load, _reads in submits if run and run[0] > 0 else ():
                load.run = (int(run[0]), bool(run[1]))
            if displaced:
                self._kick(submits, promotes, done)   # a withdrawn read may have freed a slot
        if submits or done:
            self._after(submits, promotes, done)
        return queued

    def prefetch_noop(self, layer: int, experts: list) -> bool:
        """True when a prefetch of ``experts`` of ``layer`` has nothing to do: every one is a
        valid, distinct id already resident or loading (a list of Python ints, at most 256).
        False when it may have work or the request is bad: the caller then runs
        :meth:`prefetch_many`, which also raises the precise error. Changes and counts nothing
        (a prefetch that finds everything present queues no read either way); the check runs in
        Cython (``HitPath.prefetch_noop``), so a flood of such prefetches costs little."""
        return self._hits.prefetch_noop(layer, experts)

    # ---- shared-memory pins ----------------------------------------------------------------------
    def drain_pins(self) -> None:
        """Apply the shared-memory hits waiting in the pin files' rings (cheap when none wait);
        the server calls it before serving any request."""
        shm = self._layout.shm
        if not shm.files or not shm.pending():
            return
        with self._lock:
            if not self._closed:
                self._shmpins.drain()

    def take_fast_log(self) -> list:
        """Shared-memory hits applied since the last call, ``(pin file, t, layer, expert)`` in
        order (one pin call shares ``t``), while a trace is recorded; [] otherwise."""
        with self._lock:
            return self._shmpins.take_fast_log()

    def pins_held(self) -> int:
        """Slots clients pin through shared memory now (honoured or not), over all pin files:
        leases the server never saw (a removal of the model waits for them)."""
        with self._lock:
            return 0 if self._closed else self._layout.shm.pinned_now()

    def sweep_pins(self) -> None:
        """Drain the rings, forget released fast-path pins, let waiting acquires use their slots
        (the server calls it while pin files are open: such a release sends no message)."""
        submits, promotes, done = [], [], []
        with self._lock:
            if self._closed:
                return
            self._shmpins.drain()
            if self._shmpins.sweep():
                self._kick(submits, promotes, done)
        self._after(submits, promotes, done)

    @property
    def pins_awaited(self) -> bool:
        """True while an eviction waits on a slot a fast-path pin holds (read without the lock)."""
        return bool(self._shmpins.held)

    def check_resident_map(self) -> int:
        """Check the resident map against the cache's own state, repair what another process
        changed (every tick); returns the entries repaired now (counted in ``map_repairs``)."""
        with self._lock:
            return 0 if self._closed else self._layout.check_map()

    @property
    def pin_files(self) -> int:
        """Pin files open now (and found truncated, not yet taken by :meth:`take_broken_pin_files`)."""
        return self._shmpins.n_files

    def take_broken_pin_files(self) -> list:
        """Pin files found truncated since the last call (already unmapped, their pins no longer
        honoured): their clients are to be dropped, then :meth:`close_pin_file` each."""
        with self._lock:
            return self._shmpins.take_broken()

    def default_pin_quota(self) -> int:
        """Slots whose fast-path pins are honoured per client when the configuration gives no
        quota: four tokens' worth of top-k over every MoE layer, at most half the slots."""
        return self._shmpins.default_quota(self.index, self.arena)

    def open_pin_file(self, name: str, epoch: int, quota: int, uid: int | None = None):
        """Create the pin file ``name`` beside the arena for one fast-path client (0600, owned by
        ``uid`` when given, ``flock``ed while it lives) and honour its pins; its ``PinFile``.
        OSError when it cannot be made (nothing is left behind)."""
        path = os.path.join(os.path.dirname(self.arena.path), name)
        f = self._shmpins.create_file(path, epoch, quota, uid)
        with self._lock:
            self._shmpins.add(f, uid)
        return f

    def close_pin_file(self, f) -> None:
        """Stop honouring ``f``'s pins, unlink and unmap it (its client left). Idempotent."""
        submits, promotes, done = [], [], []
        with self._lock:
            self._shmpins.remove(f)
            if not self._closed and self._shmpins.sweep():
                self._kick(submits, promotes, done)
        self._shmpins.unlink_file(f)
        self._after(submits, promotes, done)

    # ---- budget ---------------------------------------------------------------------------------
    def set_budget(self, budget_bytes: int) -> dict:
        """Resize the cache to ``budget_bytes`` (clamped to the configured size).

        Shrink: per pool, give back free slots first, then evict unpinned keys from the cold end,
        and release those slots' memory (``arena.release_memory``); pinned (leased or loading)
        slots are never touched, so a shrink may stop short (reported; :meth:`settle_memory`
        finishes it once they are released). Grow: restore given-back
        slots (``arena.restore_memory``) up to the target and let waiting acquires in.
        Targets per class follow ``arena.plan_slots``; per-layer pools get ``target // layers``.
        Returns ``{"slots_before", "slots_after", "slots_target", "bytes_released",
        "bytes_restored"}`` (slots summed over all pools). Raises CacheError (with the arena's
        reason) when the budget gives some class no slot.
        """
        from moecached.engine.arena import ArenaError
        try:
            counts = self._plan_slots(self.index, budget_bytes=int(budget_bytes),
                                      page_size=self.arena.page_size)
        except ArenaError as e:
            raise CacheError(f"set_budget({budget_bytes}): {e}") from None
        with self._budget_lock:
            with self._lock:
                if self._closed:
                    raise CacheClosed()
                shrink, grow, before, after, target = self._slots.resize(counts)
            released, restored, grown, lost, failed = self._slots.move_memory(
                self.arena, shrink, grow, self._lock)
            after -= lost
            if shrink or grow:
                self._slots.punch_again(self.arena, self._lock, fresh=True)
            submits, promotes, done = [], [], []
            with self._lock:
                self._slots.add_free(grown)
                self._kick(submits, promotes, done)
            self._after(submits, promotes, done)
            if failed is not None:
                raise CacheError(f"set_budget({budget_bytes}): grow stopped at {after} slots: {failed}")
            return {"slots_before": before, "slots_after": after, "slots_target": target,
                    "bytes_released": released, "bytes_restored": restored}

    def settle_memory(self) -> dict:
        """The budget's periodic work (``Pools.settle``): a shrink that pins stopped short goes on
        once they are released; pages readers faulted back into given-back slots (reading a hole
        of a tmpfs file allocates one) are punched again. ``{"bytes_released", "bytes_repunched"}``."""
        with self._budget_lock:
            return self._slots.settle(self.arena, self._lock, lambda: self._closed)

    def set_ghost(self, per_class: dict) -> None:
        """Keep ``per_class[cid]`` ghost entries per size class (``moecached.daemon.split``: the keys
        evicted last, as many as one more step of budget would add; a demanded load of one
        counts in ``ghost_hits``). 0 or absent: none. Per-layer pools share their class's
        count evenly."""
        with self._lock:
            self._slots.set_ghost(per_class)

    # ---- introspection / lifetime ---------------------------------------------------------------
    @property
    def model_changed(self) -> str | None:
        """Why the model file is no longer the one indexed (one line), or None while it is."""
        return self.readers.model_changed

    def pinned_count(self) -> int:
        """Distinct pinned keys over all pools (leased or loading)."""
        with self._lock:
            return self._slots.pinned()

    def descriptor(self) -> dict:
        """Arena descriptor (``Arena.descriptor()``) plus ``fingerprint`` (index), ``policy``,
        ``n_experts``, ``expert_layers`` and ``size_classes`` (id, layers, parts, part_bytes,
        slot_bytes, n_slots) — everything a client needs to find a leased slot's bytes."""
        d = dict(self.arena.descriptor())
        d["fingerprint"] = self.index.fingerprint()
        d["policy"] = self.policy
        d["n_experts"] = self.n_experts
        d["expert_layers"] = [int(x) for x in self.index.expert_layers]
        d["size_classes"] = [{"id": c.id, "layers": list(c.layers), "parts": list(c.parts),
                              "part_bytes": dict(c.part_bytes), "slot_bytes": c.slot_bytes,
                              "n_slots": c.n_slots} for c in self.arena.classes]
        return d

    def stats(self) -> dict:
        """Counters (ints unless noted; bytes in bytes, times in microseconds); the top-level
        counters and gauges are declared in ``moecached.facts.stats.CACHE_STATS``:

        ``hits``, ``demand_misses``, ``prefetch_hits`` (per requested expert, see module doc),
        ``prefetches`` (prefetch reads queued), ``wasted_prefetches`` (evicted unused),
        ``evictions``, ``bytes_read``, ``reads`` (completed), ``read_errors``,
        ``reads_in_flight``, ``read_latency`` (LatencyHistogram.to_dict: count, mean_us, max_us,
        p50_us, p99_us, buckets_us), ``leases`` (granted), ``leases_open``, ``waiting``
        (requests queued for slots), ``acquires_queued`` (total that had to queue),
        ``pinned``, ``classes`` (per size class: id, slot_bytes, slots_max, slots, used
        (resident+loading), pinned, loading, free, hits, demand_misses, prefetch_hits, reads),
        ``layers`` ({layer: {hits, demand_misses, prefetch_hits, reads}}),
        ``budget`` ({configured_bytes, current_bytes}), ``shrink_events``, ``grow_events``,
        ``readers`` (ReaderPool.stats()), ``model_changed`` (why the model file is no longer
        the one indexed, or None).
        """
        with self._lock:
            classes = [{"id": cid, **{s.key: (sum(getattr(self, s.value)[l] for l in c.layers)
                                              if isinstance(s.value, str) else s.value(c, pools))
                                      for s in CLASS_STATS}}
                       for cid, (c, pools) in self._layout.cls.items()]
            layers = {str(l): {s.key: getattr(self, s.value)[l] for s in LAYER_STATS}
                      for l in sorted(self._layout.layers)}
            cur = self._slots.current_bytes(self.index, self.arena)
            out = {s.key: (getattr(self, s.value) if isinstance(s.value, str) else s.value(self))
                   for s in CACHE_STATS if s.value is not None}
            out.update({
                "classes": classes, "layers": layers,
                "budget": {"configured_bytes": self._layout.max_bytes, "current_bytes": cur},
                "policy": self.policy,
                "model_changed": self.readers.model_changed,
                "fast_path": self._fast_path_stats(),
            })
        try:
            out["readers"] = self.readers.stats()
        except Exception:
            out["readers"] = {}
        out["read_latency"] = self.readers.latency()   # measured by the reader pool
        return out

    def _fast_path_stats(self) -> dict:
        """Counters of the shared-memory hit path (under the lock); see docs/operations.md."""
        return {s.key: s.value(self) for s in FAST_PATH_STATS}

    def close(self) -> None:
        """Fail every waiting acquire with CacheClosed("cache closed"), stop the readers, unlink
        the arena. Idempotent. Open leases die with the arena."""
        done = []
        with self._lock:
            if self._closed:
                return
            self._hits.closed = True
            self._requests.close(CacheClosed(), done)
        for cb, res in done:
            try:
                cb(res)
            except Exception:
                self.log.exception("moecached cache: acquire callback raised")
        for f in list(self._layout.shm.files):
            self.close_pin_file(f)
        with self._lock:
            self._layout.shm.close()
            self._layout.release_views()   # views of the mapping: let it be unmapped
            self._hits.release_views()
        try:
            self.readers.close()
        finally:
            self.arena.close(unlink=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
