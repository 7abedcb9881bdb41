"""The expert cache: ties the GGUF index, the slot arena, the reader pool and the eviction policy.

Model::

    index (where each expert's bytes are)  --->  ReaderPool (O_DIRECT reads)  --->  Arena slots
                                                                                    ^
    acquire / acquire_many / acquire_async / prefetch / release  ---- ExpertCache --+-- LRU per pool

* A *pool* is a set of slots of one size class with one LRU: policy ``"global"`` has one pool per
  size class (all its layers share the class's slots); ``"per-layer"`` gives every layer of a class
  an equal share of the class's slots (``n_slots // len(layers)``) with its own LRU.
* An expert ``(layer, expert)`` is, in its pool, *absent*, *loading* (slot allocated, read in
  flight, pinned by the load) or *resident* (slot published). A slot is published only when its
  read succeeded; a failed read frees the slot and fails every acquire waiting on it with
  :class:`LoadError` (other loads go on).
* ``acquire`` is all-or-nothing: a request is granted only when every expert in it is resident or
  can get a slot right now (free, or by evicting an unpinned key from the cold end); then it pins
  all of its experts, starts one read per absent expert (demand priority; a queued prefetch of a
  wanted expert is promoted; an in-flight read is shared, never repeated) and completes when the
  last of its reads lands. A request that cannot get its slots yet waits in a FIFO queue holding
  no pins (so waiters can never deadlock each other); a request whose experts are all resident or
  already loading never waits in that queue (it needs no new slot).
* Pins: every lease pins its experts until ``release``; every load pins its slot until it ends.
  Pinned keys are never evicted, never given back by :meth:`ExpertCache.set_budget`.
* A failed load gives its slot back as it found it: a free slot goes back to the free list; a
  slot taken by evicting a resident expert gets that expert back (resident again, at the cold
  end, counters restored) when the load failed before any byte was read into the slot (refused
  at submit, or the model changed before its first chunk). Only a read that failed after
  writing part of the slot frees it (the evicted expert's bytes are gone).
* Once the model file changes (``model_changed``), acquires that need a read fail at once with
  :class:`ModelChangedError` (no slot taken), prefetches queue nothing; resident hits go on.
* Prefetched experts enter the LRU at the cold end and are marked *unused*; the first demand use
  counts a prefetch hit and moves them hot; evicting an unused one counts a wasted prefetch.
* Prefetch confidence (docs/policies.md, "Prefetch confidence"): each prefetched expert carries a
  confidence in [0, 1] (1 without one). Below ``prefetch_min_confidence`` it is dropped; the
  experts of one prefetch are taken highest confidence first; at a prefetch cap a queued read
  not yet started of lower confidence is withdrawn for it (its slot given back as it was found);
  a prefetch never evicts a *demand-hot* expert: one demanded since it came in and not among
  the colder half of its pool's recency order.

Lock discipline: one ``threading.Lock`` around all bookkeeping; reads are submitted, promoted,
memory released/restored and user callbacks invoked only after the lock is dropped.

Counting (per requested expert, disjoint, ``hits + prefetch_hits + misses + substituted ==
len(experts)``): ``hits`` = resident and already demanded before; ``prefetch_hits`` = first demand
of an expert a prefetch brought in (resident, or still in flight: the read is promoted);
``substituted`` = not resident, and a resident substitute candidate was granted in its place
(``acquire_async(..., subst=)``; docs/policies.md "Substitution"); ``misses`` = everything else
(a new demand read, or waiting on another request's in-flight demand read).
"""
from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field

from moecached import MoecacheError
from moecached.engine.arena import arena_bytes
from moecached.engine.policy import EVICTIONS, SCAN_ADMITS, make_eviction
from moecached.engine.readers import ModelChanged
from moecached.facts.stats import CACHE_STATS, CLASS_STATS, FAST_PATH_STATS, LAYER_STATS
from moecached.engine._shm import PinFile, ShmArena

__all__ = ["CacheError", "RequestError", "CapacityError", "LeaseError", "LoadError",
           "ModelChangedError", "AcquireTimeout", "CacheClosed", "Lease", "PrefetchQuota",
           "ExpertCache"]


class CacheError(MoecacheError):
    """Base of every cache error; ``str(e)`` is one line."""


class RequestError(CacheError):
    """Bad request, raised at once: unknown layer, expert out of range, duplicate expert, empty
    request, or more experts of one pool than it can ever hold (or holds now, with
    ``shrunk_policy="error"``)."""


class CapacityError(RequestError):
    """The request fits its pool's configured size but not its current (``set_budget``-shrunk)
    size, and ``shrunk_policy="error"``. Retry later."""


class CacheClosed(CacheError):
    """The cache is closed (or closing): ``str(e) == "cache closed"``."""

    def __init__(self, msg: str = "cache closed"):
        super().__init__(msg)


class LeaseError(CacheError):
    """Release of a lease id that is unknown, already released, or from another cache instance."""


class LoadError(CacheError):
    """A read needed by this acquire failed (short read, EIO, file changed); names layer, expert
    and file. The expert stays absent; a later acquire retries the read."""


class ModelChangedError(LoadError):
    """The model file is no longer the one indexed (see ``ExpertCache.model_changed``): an
    acquire that needs a read is refused at once, before any slot is taken (nothing evicted);
    resident experts are still served (their slots hold bytes read before the change)."""


class AcquireTimeout(CacheError):
    """A blocking acquire did not complete within ``timeout``; it was cancelled (no pins held)."""


@dataclass(slots=True)
class Lease:
    """What an acquire returns; pins its experts until :meth:`ExpertCache.release`.

    Attributes:
        id: lease id; unique and increasing from a random 63-bit base per cache instance (ids from
            another instance, e.g. before a restart, are recognisably stale). For
            ``acquire_async`` it equals the ticket id.
        items: ``(layer, expert, class_id, slot)`` per requested expert, in request order (for
            ``acquire_many``: layers in request order, experts in order within each layer).
            Part ``p`` of an item is at ``arena.part_offset(class_id, slot, p)``.
        hits, prefetch_hits, misses, substituted: how the experts were found (see module doc;
            they sum to ``len(items)``).
        stall_s: seconds from the call to the lease being ready (0.0 when all were resident).
        swaps: ``(layer, missing, substitute)`` per substitution, in request order; the item of
            ``missing`` names ``substitute`` instead.
    """
    id: int
    items: list
    hits: int
    prefetch_hits: int
    misses: int
    stall_s: float
    swaps: list = field(default_factory=list)

    @property
    def substituted(self) -> int:
        return len(self.swaps)

    @property
    def slots(self) -> list[int]:
        """Slot of each item, in request order (meaningful per size class; for one-layer leases)."""
        return [it[3] for it in self.items]


class PrefetchQuota:
    """One sender's share of the prefetch loads (the server keeps one per client).

    Attributes:
        limit: most prefetch loads of this sender in flight (queued or reading, not yet
            demanded); beyond it the sender's new prefetches are dropped. None: no own limit
            (the cache's ``max_prefetch_loads`` still applies).
        in_flight: its prefetch loads in flight now (kept by the cache, under its lock; a load
            stops counting when it lands, fails or a demand takes it over).
        dropped: its prefetch reads not queued because a limit (its own or the cache's) was
            reached.
    """
    __slots__ = ("limit", "in_flight", "dropped")

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.in_flight = 0
        self.dropped = 0


class _Pool:
    """Slots of one size class under one LRU (a whole class, or one layer's share)."""
    __slots__ = ("cid", "lru", "res", "alloc", "loading", "unused", "free", "disabled",
                 "max_cap", "n_keys", "layers", "gbase", "ghost", "ghost_n")

    def __init__(self, cid: int, layers: list[int], n_experts: int, slots: list[int],
                 eviction: str = "lru"):
        self.cid = cid
        self.layers = layers
        self.n_keys = len(layers) * n_experts
        self.lru = make_eviction(eviction, self.n_keys)   # LRU's interface (config eviction)
        self.res = [-1] * self.n_keys      # key -> slot when resident (published), else -1
        self.alloc = [-1] * self.n_keys    # key -> slot when resident or loading, else -1
        self.loading: dict[int, _Load] = {}
        self.unused = bytearray(self.n_keys)  # 1: brought in by prefetch, not demanded yet
        self.free = list(reversed(slots))  # pop() hands out the lowest slot first
        self.disabled: list[int] = []      # slots given back by set_budget
        self.max_cap = len(slots)
        self.gbase: list[int] = []         # layer position -> resident-map key of its expert 0
        self.ghost: dict = {}              # keys evicted last, oldest first (moecached.daemon.split)
        self.ghost_n = 0                   # ghost entries kept (ExpertCache.set_ghost)

    @property
    def cap(self) -> int:
        return self.max_cap - len(self.disabled)


class _Layer:
    __slots__ = ("layer", "pool", "base", "cid", "offs", "fids", "ne")

    def __init__(self, layer, pool, base, cid, offs, fids, ne):
        self.layer, self.pool, self.base, self.cid = layer, pool, base, cid
        self.offs, self.fids, self.ne = offs, fids, ne


class _Load:
    __slots__ = ("pool", "key", "slot", "layer", "expert", "demanded", "prefetched", "waiters",
                 "job_id", "priority", "fids", "victim", "quota", "conf", "gen")

    def __init__(self, pool, key, slot, layer, expert, demanded, fids, victim=None):
        self.pool, self.key, self.slot, self.layer, self.expert = pool, key, slot, layer, expert
        self.demanded = demanded
        self.prefetched = not demanded
        self.waiters: list[_Req] = []
        self.job_id = None
        self.priority = 0 if demanded else 1
        self.fids = fids
        self.victim = victim    # (key, was_unused) evicted to free the slot, or None
        self.quota = None   # PrefetchQuota of the prefetch's sender while it counts there
        self.conf = 1.0     # the prefetch's confidence (lower ones are withdrawn first at a cap)
        self.gen = -1       # the slot's generation when the load took it (checked at publish)


class _Req:
    __slots__ = ("id", "groups", "by_pool", "cb", "t0", "state", "pending", "pins", "items",
                 "hits", "pf", "misses", "tag", "stalled", "swaps", "subst")
    QUEUED, LOADING, DONE = 0, 1, 2

    def __init__(self, rid, groups, by_pool, cb, tag):
        self.id = rid
        self.groups = groups        # [(_Layer, [expert, ...]), ...] in request order
        self.by_pool = by_pool      # {pool: [key, ...]}
        self.cb = cb
        self.t0 = time.perf_counter()
        self.state = _Req.QUEUED
        self.pending = 0
        self.pins: list = []        # [(pool, [key, ...])]
        self.items = None
        self.hits = self.pf = self.misses = 0
        self.tag = tag
        self.stalled = False        # waited in the queue or for a read
        self.swaps: list = []       # [(layer, missing, substitute)] chosen on arrival
        self.subst = frozenset()    # {(layer, substitute)}: granted as substitutes, not hits


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
        log: a ``logging.Logger`` (default ``logging.getLogger("moecached.engine.cache")``).
        arena_progress: ``progress(done, total)`` while the arena is reserved and locked.

    Attributes: ``arena`` (``Arena``), ``index``, ``readers`` (``ReaderPool``).

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
        self.shrunk_policy = shrunk_policy
        self.admit_cold = admit_cold   # "off" | "prompt" | int N (config key admit_cold)
        if scan_admit not in SCAN_ADMITS:
            raise CacheError(f"scan_admit: found {scan_admit!r}, expected one of {', '.join(SCAN_ADMITS)}")
        self.scan_admit = scan_admit   # where admit_cold puts a miss: "cold" | "probation"
        self._plan_slots = plan_slots
        self._closed = False
        self._lock = threading.Lock()
        self._budget_lock = threading.Lock()
        ne = self.n_experts = int(index.n_experts)
        if budget_bytes is None and slots is None:
            slots = sum(len(sc.layers) for sc in index.size_classes) * ne
        self.arena = Arena(index, budget_bytes=budget_bytes, slots=slots, dir=arena_dir,
                           name=arena_name, hugetlb=hugetlb, lock=lock_memory, progress=arena_progress)
        try:
            self._build(index, ne)
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

        base = secrets.randbits(62) | (1 << 62)  # random 63-bit base, far from 2**63
        self._id_base = base
        self._ids = itertools.count(base)
        self._leases: dict[int, list] = {}     # lease id -> [(pool, [keys])]
        self._reqs: dict[int, _Req] = {}       # ticket -> request not yet completed
        self._waitq: list[_Req] = []           # FIFO of requests waiting for slots
        # counters
        nl = max(self._layers) + 1
        self._l_hits = [0] * nl
        self._l_pf = [0] * nl
        self._l_miss = [0] * nl
        self._l_reads = [0] * nl
        self._l_subst = [0] * nl
        self.c_prefetches = 0
        self.c_pf_dropped = 0
        self._pf_loading = 0   # prefetch loads queued or reading that no request waits for
        # Prefetch pays only when the drive has slack: beyond this many prefetch loads in flight
        # new prefetches are dropped (counted), so a noisy predictor cannot bury demand reads.
        # Default: two layers' worth of top-k per size class, at least 16.
        self.max_prefetch_loads = int(max_prefetch_loads) if max_prefetch_loads is not None else \
            max(16, 2 * max(1, int(getattr(index, "top_k", 0) or 8)) * max(1, len(index.size_classes)))
        self.prefetch_min_confidence = float(prefetch_min_confidence)  # config key of that name
        self.c_pf_low_conf = 0    # prefetched experts dropped below prefetch_min_confidence
        self.c_pf_displaced = 0   # queued prefetch reads withdrawn for higher-confidence ones
        self.c_pf_hot = 0         # prefetches dropped: the only victim was demand-hot
        self.c_wasted = 0
        self.c_bytes = 0
        self.c_reads = 0
        self.c_read_errors = 0
        self.c_reads_discarded = 0   # completed reads whose slot's generation had moved (never published)
        self.c_inflight = 0
        self.c_evictions = 0
        self.c_leases = 0
        self.c_waits = 0
        self.c_shrinks = 0
        self.c_grows = 0
        self.c_ghost_hits = 0

    # ------------------------------------------------------------------ construction
    def _build(self, index, ne):
        arena = self.arena
        self._base_addr = arena.base_address
        # slot generations in the arena's control block (written here only, under the lock)
        self._gens = self._gens_mv = {c.id: memoryview(arena.generations(c.id)).cast("B").cast("Q")
                                      for c in arena.classes}
        self._cls = {}           # cid -> (layout, [pools])
        self._layers: dict[int, _Layer] = {}
        self._max_bytes = arena.size   # budgets count the whole arena file (control block too)
        for c in arena.classes:
            pools = []
            if self.policy == "global":
                pools.append((_Pool(c.id, list(c.layers), ne, list(range(c.n_slots)),
                                    self.eviction), c.layers))
            else:
                share = c.n_slots // len(c.layers)
                if share < 1:
                    raise CacheError(
                        f"policy 'per-layer': size class {c.id} has {c.n_slots} slots for "
                        f"{len(c.layers)} layers, expected >= 1 per layer; raise the budget")
                for i, layer in enumerate(c.layers):
                    pools.append((_Pool(c.id, [layer], ne,
                                        list(range(i * share, (i + 1) * share)), self.eviction),
                                  [layer]))
            self._cls[c.id] = (c, [p for p, _ in pools])
            pbytes = [c.part_bytes[p] for p in c.parts]
            for pool, layers in pools:
                for li, layer in enumerate(layers):
                    offs, fids = index.part_table(layer)
                    if offs.shape != (ne, len(c.parts)):
                        raise CacheError(f"index part_table({layer}): shape {offs.shape}, "
                                         f"expected {(ne, len(c.parts))}")
                    spans = index.parts(layer, 0)
                    for p, sp in enumerate(spans):
                        if (int(sp.offset) != int(offs[0, p]) or int(sp.nbytes) != pbytes[p]
                                or int(fids[0, p]) != int(sp.file)):
                            raise CacheError(
                                f"index layer {layer} part {p}: parts() and part_table() disagree "
                                f"or part bytes {sp.nbytes} != class {c.id} part bytes {pbytes[p]}")
                    self._layers[int(layer)] = _Layer(int(layer), pool, li * ne, c.id,
                                                      offs.tolist(), fids.tolist(), ne)
        self._pools = [p for _, ps in self._cls.values() for p in ps]
        # the resident map and the fast-path pin files (rules: clients/c/include/moecache_shm.h)
        moe = {int(l): i for i, l in enumerate(index.expert_layers)}
        for pool in self._pools:
            pool.gbase = [moe[int(l)] * ne for l in pool.layers]
        self._moe_layers = [int(l) for l in index.expert_layers]
        self._shm = ShmArena(arena.base_address, ne, arena.n_keys,
                             [(c.gen_off, c.n_slots) for c in arena.classes], arena.resmap_off)
        self._held: set = set()   # (pool, key) pinned in the LRU because a fast-path pin holds it
        self.fast_log = None      # list while shared-memory hits are to be recorded (take_fast_log)

    # ------------------------------------------------------------------ helpers (under lock)
    def _reads_for(self, L: _Layer, expert: int, slot: int) -> list:
        c = self._cls[L.cid][0]
        offs, fids = L.offs[expert], L.fids[expert]
        out = []
        for p, name in enumerate(c.parts):
            pb = c.part_bytes[name]
            out.append((fids[p], offs[p], pb, self._base_addr + c.part_off[name] + slot * pb))
        return out

    def _evict_one(self, pool: _Pool) -> int:
        """Evict the coldest unpinned key of ``pool``; returns its slot or -1."""
        return self._evict(pool)[0]

    def _evict(self, pool: _Pool, prefetch: bool = False) -> tuple:
        """Evict the coldest unpinned key of ``pool`` that no fast-path pin holds: ``(slot,
        (key, was_unused))``, or ``(-1, None)``. Hits taken through shared memory are applied
        first, so the victim is the one the socket path would pick; a victim a fast-path pin
        holds is pinned in the LRU (released by :meth:`_sweep_held`) and the next one tried.
        ``prefetch``: ``(-2, None)``, evicting nothing, when the victim is demand-hot (demanded
        since it came in, and not among the colder half of the pool's recency order)."""
        if self._shm.files:
            self._drain_locked()
        lru = pool.lru
        while True:
            k = lru.victim()
            if k < 0:
                return -1, None
            if prefetch and not pool.unused[k]:
                half = len(lru) // 2
                if lru.cold_rank(k, half) >= half:
                    return -2, None
            s = pool.alloc[k]
            ne = self.n_experts
            # clears the resident map and moves the generation (old leases on it go invalid),
            # unless a pin file holds the slot
            if not self._shm.try_evict(pool.gbase[k // ne] + k % ne, pool.cid, s):
                lru.pin(k)
                self._held.add((pool, k))
                continue
            was_unused = pool.unused[k]
            lru.remove(k)
            if pool.ghost_n:
                g = pool.ghost
                g[k] = None
                if len(g) > pool.ghost_n:
                    del g[next(iter(g))]
            pool.alloc[k] = -1
            pool.res[k] = -1
            if was_unused:
                pool.unused[k] = 0
                self.c_wasted += 1
            self.c_evictions += 1
            return s, (k, was_unused)

    def _take_slot(self, pool: _Pool, prefetch: bool = False) -> tuple:
        """A slot for a load: ``(slot, victim)``; victim ``(key, was_unused)`` when a resident
        expert was evicted for it (given back if the load fails untouched), slot -1 if none
        (-2: for a prefetch, the victim would have been demand-hot; see :meth:`_evict`)."""
        if pool.free:
            return pool.free.pop(), None
        return self._evict(pool, prefetch)

    def _publish(self, pool: _Pool, k: int, slot: int) -> None:
        """The resident map says ``k`` is in ``slot`` (its bytes are complete)."""
        ne = self.n_experts
        self._shm.publish(pool.gbase[k // ne] + k % ne, slot)

    # ------------------------------------------------------------------ shared-memory hits
    def _drain_locked(self) -> int:
        """Apply the hits clients took through shared memory (their rings, merged by time) to
        the LRU and the hit counters, as a socket hit counts; entries naming an expert that is
        not resident are dropped (counted per client). Under the lock. Returns entries applied."""
        got = self._shm.drain()
        if not got:
            return 0
        ne = self.n_experts
        layers, lmap = self._moe_layers, self._layers
        n = 0
        log = self.fast_log
        for key, f, t in got:
            layer = layers[key // ne]
            L = lmap[layer]
            pool = L.pool
            k = L.base + key % ne
            if pool.res[k] < 0:
                f.drops += 1
                continue
            if log is not None:
                log.append((f, t, layer, key % ne))
            pool.lru.touch(k)
            if pool.unused[k]:
                pool.unused[k] = 0
                self._l_pf[layer] += 1
                f.prefetch_hits += 1
            else:
                self._l_hits[layer] += 1
                f.hits += 1
            n += 1
        return n

    def take_fast_log(self) -> list:
        """The shared-memory hits applied since the last call, as ``(pin file, t, layer,
        expert)`` in the order applied (entries of one pin call share ``t``), while
        ``fast_log`` is a list (the server sets it while a trace is recorded); [] otherwise."""
        with self._lock:
            log = self.fast_log
            if not log:
                return []
            self.fast_log = []
        return log

    def _sweep_held(self) -> bool:
        """Unpin, in the LRU, keys no honoured fast-path pin holds any more. Under the lock.
        True when some key became evictable."""
        held = self._shm.sweep()
        freed = False
        if self._held:
            gs = self._shm.global_slot
            for pool, k in list(self._held):
                if gs(pool.cid, pool.alloc[k]) not in held:
                    self._held.discard((pool, k))
                    pool.lru.unpin(k)
                    freed = True
        return freed

    def drain_pins(self) -> None:
        """Apply the shared-memory hits waiting in the pin files' rings (cheap when none wait);
        the server calls it before serving any request."""
        shm = self._shm
        if not shm.files or not shm.pending():
            return
        with self._lock:
            if not self._closed:
                self._drain_locked()

    def pins_held(self) -> int:
        """Slots clients pin through shared memory now (honoured or not), over all pin files:
        leases the server never saw (a removal of the model waits for them)."""
        with self._lock:
            return 0 if self._closed else self._shm.pinned_now()

    def sweep_pins(self) -> None:
        """Drain the rings, forget fast-path pins that were released, and let waiting acquires
        use the slots they held (the server calls it every few milliseconds while pin files
        are open: a release through shared memory sends no message)."""
        submits, promotes, done = [], [], []
        with self._lock:
            if self._closed:
                return
            self._drain_locked()
            if self._sweep_held() and self._waitq:
                self._kick(submits, promotes, done)
        self._after(submits, promotes, done)

    @property
    def pin_files(self) -> int:
        """Pin files open now (and found truncated, not yet taken by :meth:`take_broken_pin_files`)."""
        return len(self._shm.files) + len(self._shm.broken)

    def take_broken_pin_files(self) -> list:
        """Pin files found truncated since the last call (already unmapped, their pins no longer
        honoured): their clients are to be dropped, then :meth:`close_pin_file` each."""
        with self._lock:
            out, self._shm.broken = self._shm.broken, []
        return out

    def default_pin_quota(self) -> int:
        """Slots whose fast-path pins are honoured per client when the configuration gives no
        quota: four tokens' worth of top-k over every MoE layer, at most half the slots."""
        top_k = max(1, int(getattr(self.index, "top_k", 0) or 8))
        total = sum(c.n_slots for c in self.arena.classes)
        return max(1, min(4 * top_k * len(self._moe_layers), total // 2))

    def open_pin_file(self, name: str, epoch: int, quota: int, uid: int | None = None) -> PinFile:
        """Create the pin file ``name`` beside the arena for one fast-path client (mode 0600,
        owned by ``uid`` when given, an exclusive ``flock`` held while it lives, so stale
        cleanup leaves it alone) and honour its pins from now on. OSError when it cannot be
        made (nothing is left behind)."""
        import fcntl
        shm = self._shm
        path = os.path.join(os.path.dirname(self.arena.path), name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, shm.file_size)
            os.pwrite(fd, shm.header(epoch, quota), 0)   # magic last seen by cleanup: locked
            if uid is not None:
                os.fchown(fd, uid, -1)
            f = PinFile(path, fd, shm.file_size, quota)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        with self._lock:
            shm.add(f)
        return f

    def close_pin_file(self, f: PinFile) -> None:
        """Stop honouring ``f``'s pins, unlink and unmap it (its client left). Idempotent."""
        submits, promotes, done = [], [], []
        with self._lock:
            self._shm.remove(f)
            if not self._closed and self._sweep_held() and self._waitq:
                self._kick(submits, promotes, done)
        fd, f.fd = f.fd, None
        if fd is not None:
            try:
                st, cur = os.fstat(fd), os.stat(f.path)
                if (st.st_dev, st.st_ino) == (cur.st_dev, cur.st_ino):
                    os.unlink(f.path)
            except OSError:
                pass
            os.close(fd)
        self._after(submits, promotes, done)

    def _cold(self, tag, width: int) -> bool:
        """Whether a demanded miss enters the LRU at the cold end (config key admit_cold: the
        acquire is tagged prompt, or names more than N experts of the layer)."""
        a = self.admit_cold
        return (tag == "prompt") if a == "prompt" else (a != "off" and width > a)

    def _start_load(self, L: _Layer, expert: int, slot: int, demanded: bool, submits: list,
                    victim=None, cold: bool = False):
        pool = L.pool
        k = L.base + expert
        if pool.ghost and pool.ghost.pop(k, 0) is None and demanded:
            self.c_ghost_hits += 1   # a hit one more step of budget would have had
        # the LRU first: it refuses a key already present, before anything else has changed
        if cold and demanded and self.scan_admit == "probation":
            pool.lru.insert_probation(k)     # scan-resistant admission at the probation point
        else:
            pool.lru.insert(k, cold or not demanded)
        load = _Load(pool, k, slot, L.layer, expert, demanded, L.fids[expert], victim)
        load.gen = self._gens[pool.cid][slot]
        pool.alloc[k] = slot
        pool.loading[k] = load
        pool.lru.pin(k)                  # the load's own pin, dropped when it ends
        self.c_inflight += 1
        self._l_reads[L.layer] += 1
        submits.append((load, self._reads_for(L, expert, slot)))
        return load

    def _validate(self, requests) -> tuple[list, dict]:
        """-> (groups [(_Layer, experts)], by_pool {pool: [keys]}); RequestError when bad."""
        if self._closed:
            raise CacheClosed()
        groups = []
        by_pool: dict[_Pool, list] = {}
        for layer, experts in requests:
            L = self._layers.get(layer)
            if L is None:
                raise RequestError(f"layer {layer!r}: not a layer with routed experts "
                                   f"(expected one of {sorted(self._layers)})")
            ex = [int(e) for e in experts]
            for e in ex:
                if not 0 <= e < L.ne:
                    raise RequestError(f"layer {layer} expert {e}: out of range 0..{L.ne - 1}")
            keys = by_pool.setdefault(L.pool, [])
            keys.extend(L.base + e for e in ex)
            groups.append((L, ex))
        if not groups or not any(ex for _, ex in groups):
            raise RequestError("empty request: no experts listed")
        for pool, keys in by_pool.items():
            if len(set(keys)) != len(keys):
                seen = set()
                for k in keys:
                    if k in seen:
                        break
                    seen.add(k)
                raise RequestError(f"duplicate in request: layer {pool.layers[k // self.n_experts]} "
                                   f"expert {k % self.n_experts} listed twice")
            n = len(keys)
            where = (f"size class {pool.cid}" if self.policy == "global"
                     else f"layer {pool.layers[0]} (size class {pool.cid})")
            if n > pool.max_cap:
                raise RequestError(f"request needs {n} slots of {where}, which holds at most "
                                   f"{pool.max_cap}; raise the budget or split the request")
            if n > pool.cap and self.shrunk_policy == "error":
                raise CapacityError(f"request needs {n} slots of {where}, which holds {pool.cap} "
                                   f"now (budget shrunk from {pool.max_cap})")
        return groups, by_pool

    def _can_grant(self, req: _Req) -> bool:
        for pool, keys in req.by_pool.items():
            alloc, res, lru = pool.alloc, pool.res, pool.lru
            need = own = 0
            for k in keys:
                if alloc[k] < 0:
                    need += 1
                elif res[k] >= 0 and lru.pin_count(k) == 0:
                    own += 1
            if need and need > len(pool.free) + len(lru) - lru.pinned - own:
                return False
        return True

    def _needs_slots(self, req: _Req) -> bool:
        for pool, keys in req.by_pool.items():
            alloc = pool.alloc
            for k in keys:
                if alloc[k] < 0:
                    return True
        return False

    def _grant(self, req: _Req, submits: list, promotes: list) -> None:
        """Pin everything of ``req``, start its missing loads (caller checked _can_grant).
        Returns False, granting nothing, when a fast-path pin held a victim the count relied on
        (the slots already freed stay free)."""
        taken = self._take_slots(req)
        if taken is None:
            return False
        items = []
        misses = []
        hits = pf = miss = 0
        pins = []
        subst = req.subst
        for L, ex in req.groups:
            pool, base, cid, layer = L.pool, L.base, L.cid, L.layer
            alloc, res, lru, unused = pool.alloc, pool.res, pool.lru, pool.unused
            keys = []
            lh = lp = lm = ls = 0
            for e in ex:
                k = base + e
                keys.append(k)
                s = alloc[k]
                if s < 0:
                    items.append(None)
                    misses.append((len(items) - 1, L, e, self._cold(req.tag, len(ex))))
                    lm += 1
                    continue
                lru.pin(k)
                lru.touch(k)
                items.append((layer, e, cid, s))
                if res[k] >= 0:
                    if subst and (layer, e) in subst:   # a substitute, in a missing one's place
                        unused[k] = 0
                        ls += 1
                    elif unused[k]:
                        unused[k] = 0
                        lp += 1
                    else:
                        lh += 1
                else:
                    load = pool.loading[k]
                    load.waiters.append(req)
                    req.pending += 1
                    if not load.demanded:
                        load.demanded = True
                        self._pf_loading -= 1
                        if load.quota is not None:
                            load.quota.in_flight -= 1
                            load.quota = None
                        lp += 1
                        if load.priority:
                            promotes.append(load)
                    else:
                        lm += 1
            pins.append((pool, keys))
            self._l_hits[layer] += lh
            self._l_pf[layer] += lp
            self._l_miss[layer] += lm
            if ls:
                self._l_subst[layer] += ls
            hits += lh
            pf += lp
            miss += lm
        for (i, L, e, cold), (s, victim) in zip(misses, taken):   # slots taken before anything changed
            load = self._start_load(L, e, s, True, submits, victim, cold)
            L.pool.lru.pin(load.key)
            load.waiters.append(req)
            req.pending += 1
            items[i] = (L.layer, e, L.cid, s)
        req.items = items
        req.pins = pins
        if req.pending:
            req.stalled = True
        req.hits, req.pf, req.misses = hits, pf, miss
        req.state = _Req.LOADING
        return True

    def _take_slots(self, req: _Req) -> list | None:
        """Slots for every absent expert of ``req``, in request order (own resident keys pinned
        meanwhile, so none of them is a victim); None, with the slots given back free, when
        there are too few (a victim held by a fast-path pin)."""
        need, own = [], []
        for L, ex in req.groups:
            pool, base = L.pool, L.base
            for e in ex:
                (own if pool.alloc[base + e] >= 0 else need).append((pool, base + e))
        if not need:
            return []
        for pool, k in own:
            pool.lru.pin(k)
        taken = []
        try:
            for pool, _ in need:
                s, victim = self._take_slot(pool)
                if s < 0:
                    break
                taken.append((s, victim))
        finally:
            for pool, k in own:
                pool.lru.unpin(k)
        if len(taken) < len(need):
            for (pool, _), (s, _v) in reversed(list(zip(need, taken))):
                pool.free.append(s)
            return None
        return taken

    def _refuse_reads(self, req: _Req, done: list) -> bool:
        """The model changed and ``req`` needs a read: fail it now (no slot taken). Under lock."""
        why = self.readers.model_changed
        if why is None or not self._needs_slots(req):
            return False
        self._fail(req, ModelChangedError(f"{why}: acquire needs a read of the changed model; "
                                          f"only resident experts are served until it is re-indexed"),
                   done)
        return True

    def _finish(self, req: _Req, done: list) -> None:
        req.state = _Req.DONE
        self._reqs.pop(req.id, None)
        self._leases[req.id] = req.pins
        self.c_leases += 1
        stall = time.perf_counter() - req.t0 if req.stalled else 0.0
        done.append((req.cb, Lease(req.id, req.items, req.hits, req.pf, req.misses, stall,
                                   req.swaps)))

    def _unpin(self, pins) -> None:
        for pool, keys in pins:
            unpin = pool.lru.unpin
            for k in keys:
                unpin(k)

    def _fail(self, req: _Req, err: CacheError, done: list) -> None:
        if req.state == _Req.LOADING:
            self._unpin(req.pins)
        elif req.state == _Req.QUEUED:
            try:
                self._waitq.remove(req)
            except ValueError:
                pass
        req.state = _Req.DONE
        req.pins = []
        self._reqs.pop(req.id, None)
        done.append((req.cb, err))

    def _kick(self, submits, promotes, done) -> None:
        """Grant queued requests that fit now, FIFO per pool (a blocked pool blocks later ones)."""
        blocked = set()
        for req in list(self._waitq):
            if req.state != _Req.QUEUED:
                continue
            if blocked and any(p in blocked for p in req.by_pool):
                blocked.update(req.by_pool)
                continue
            if self._refuse_reads(req, done):
                continue
            if self._can_grant(req) and self._grant(req, submits, promotes):
                self._waitq.remove(req)
                if req.pending == 0:
                    self._finish(req, done)
            else:
                blocked.update(req.by_pool)

    # ------------------------------------------------------------------ outside the lock
    def _after(self, submits, promotes, done) -> None:
        """Submit reads, promote, run callbacks: always called with the lock released."""
        readers = self.readers
        for load, reads in submits:
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

    def _on_read(self, load: _Load, error, nbytes: int, seconds: float) -> None:
        """Reader-thread callback of one load: publish or free its slot, complete/fail waiters."""
        submits, promotes, done = [], [], []
        err = None
        with self._lock:
            if self._closed:
                return
            try:
                err = self._complete_load(load, error, nbytes, seconds, submits, promotes, done)
            except Exception as e:  # a bookkeeping bug must not leave requesters hanging
                self.log.exception("moecached cache: internal error completing a load")
                bad = CacheError(f"internal error completing load of layer {load.layer} expert "
                                 f"{load.expert}: {e!r}")
                for req in load.waiters:
                    if req.state != _Req.DONE:
                        req.state = _Req.DONE
                        self._reqs.pop(req.id, None)
                        done.append((req.cb, bad))
                load.waiters = []
        if err is not None:
            self.log.warning("moecached cache: %s", err)
        if submits or promotes or done:
            self._after(submits, promotes, done)

    def _complete_load(self, load, error, nbytes, seconds, submits, promotes, done):
        """Under the lock. Returns the LoadError when the read failed, else None."""
        pool, k = load.pool, load.key
        err = None
        if not load.demanded:
            self._pf_loading -= 1
            if load.quota is not None:
                load.quota.in_flight -= 1
                load.quota = None
        self.c_inflight -= 1
        self.c_reads += 1
        del pool.loading[k]
        if error is None and self._gens[pool.cid][load.slot] != load.gen:
            self._discard_load(load, done)
        elif error is None:
            self.c_bytes += nbytes
            pool.res[k] = load.slot
            self._publish(pool, k, load.slot)
            pool.lru.unpin(k)
            if not load.demanded:
                pool.unused[k] = 1
            for req in load.waiters:
                if req.state == _Req.LOADING:
                    req.pending -= 1
                    if req.pending == 0:
                        self._finish(req, done)
        else:
            msg = str(error).splitlines()[0] if str(error) else type(error).__name__
            names = self._file_names
            fname = ", ".join(dict.fromkeys(names[f] if 0 <= f < len(names) else "?"
                                            for f in load.fids))
            if isinstance(error, ModelChanged):
                # not an I/O error, and said once by the reader pool: neither counted nor logged
                fail = ModelChangedError(f"load of layer {load.layer} expert {load.expert} from "
                                         f"{fname} refused: {msg}")
            else:
                self.c_read_errors += 1
                err = fail = LoadError(f"load of layer {load.layer} expert {load.expert} from "
                                       f"{fname} failed: {msg}")
            for req in load.waiters:
                if req.state == _Req.LOADING:
                    self._fail(req, fail, done)
            self._give_back_slot(load, not getattr(error, "dest_written", True))
        load.waiters = []
        if self._waitq:
            self._kick(submits, promotes, done)
        return err

    def _discard_load(self, load: _Load, done: list) -> None:
        """A read landed in a slot whose generation moved after the load took it: the slot is
        no longer this load's, so nothing is published, the slot is left to whoever holds it
        now and every waiter fails. The life of a load (docs/operations.md) never gets here;
        this is the check that makes a lease unable to lie if it ever did. Under the lock."""
        pool, k = load.pool, load.key
        self.c_reads_discarded += 1
        if pool.alloc[k] == load.slot:
            pool.alloc[k] = -1
        pool.unused[k] = 0
        pool.lru.unpin(k)
        err = LoadError(f"load of layer {load.layer} expert {load.expert} discarded: size class "
                        f"{pool.cid} slot {load.slot} changed hands while its read was in flight "
                        f"(generation {load.gen} -> {self._gens[pool.cid][load.slot]}); internal "
                        f"error, counted in reads_discarded: please report it")
        self.log.error("moecached cache: %s", err)
        for req in load.waiters:
            if req.state == _Req.LOADING:
                self._fail(req, err, done)
        if pool.alloc[k] < 0 and pool.lru.pin_count(k) == 0:
            pool.lru.remove(k)

    def _give_back_slot(self, load: _Load, untouched: bool) -> None:
        """A load that published nothing gives its slot back (under the lock): to the expert it
        evicted when ``untouched`` (no byte read into the slot), else to the free list."""
        pool, k = load.pool, load.key
        pool.alloc[k] = -1
        pool.res[k] = -1
        pool.unused[k] = 0
        pool.lru.unpin(k)
        pool.lru.remove(k)
        self._gens[pool.cid][load.slot] += 1
        v = load.victim
        if v is not None and untouched and pool.alloc[v[0]] < 0:
            # the slot still holds the evicted expert's bytes: it gets its place back
            vk, was_unused = v
            pool.alloc[vk] = pool.res[vk] = load.slot
            self._publish(pool, vk, load.slot)
            pool.unused[vk] = was_unused
            pool.lru.insert(vk, True)
            self.c_evictions -= 1
            if was_unused:
                self.c_wasted -= 1
        else:
            pool.free.append(load.slot)

    def _displace(self, conf: float, quota) -> bool:
        """Withdraw the queued, not yet started prefetch read of lowest confidence below
        ``conf`` (of ``quota``'s sender when given) and give its slot back. Under the lock.
        True when one was withdrawn."""
        cands = [ld for p in self._pools for ld in p.loading.values()
                 if not ld.demanded and ld.job_id is not None and ld.conf < conf
                 and (quota is None or ld.quota is quota)]
        cands.sort(key=lambda ld: ld.conf)
        for load in cands:
            if not self.readers.withdraw(load.job_id):
                continue   # started already: it goes on
            self._pf_loading -= 1
            if load.quota is not None:
                load.quota.in_flight -= 1
                load.quota = None
            self.c_inflight -= 1
            self._l_reads[load.layer] -= 1
            del load.pool.loading[load.key]
            self._give_back_slot(load, True)
            self.c_pf_displaced += 1
            return True
        return False

    # ------------------------------------------------------------------ public API
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
        lease = self.acquire_resident(layer, experts)
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
        The per-expert bookkeeping (validate, pin, touch, prefetch-hit check) runs in Cython
        (``LRU.grant_resident``) under the cache lock.
        """
        L = self._layers.get(layer)
        if L is None:
            return None
        pool = L.pool
        with self._lock:
            if self._closed:
                return None
            got = pool.lru.grant_resident(experts, L.base, L.ne, pool.res, pool.unused, layer, L.cid)
            if got is None:
                return None
            keys, items, pf = got
            lid = next(self._ids)
            self._leases[lid] = [(pool, keys)]
            self.c_leases += 1
            n = len(keys)
            self._l_hits[layer] += n - pf
            if pf:
                self._l_pf[layer] += pf
        return Lease(lid, items, n - pf, pf, 0, 0.0)

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
        arrival by :meth:`_substitute` (the rule of docs/policies.md, "Substitution"):
        ``scores`` are the router's scores of the layer's requested experts (same order),
        ``candidates`` ``[(expert, score), ...]`` further experts ranked by the router (none of
        them requested); ``cap`` (< 0: none) bounds the swaps per layer. The lease's ``swaps``
        say which experts were replaced, and its items name the substitutes.
        """
        submits, promotes, done = [], [], []
        with self._lock:
            groups, by_pool = self._validate(requests)
            swaps = []
            if subst is not None:
                requests, swaps = self._substitute(groups, subst)
                if swaps:
                    groups, by_pool = self._validate(requests)
            rid = next(self._ids)
            req = _Req(rid, groups, by_pool, callback, tag)
            if swaps:
                req.swaps = swaps
                req.subst = frozenset((l, c) for l, _, c in swaps)
            self._reqs[rid] = req
            blocked = self._waitq and self._needs_slots(req) and any(
                p in q.by_pool for q in self._waitq for p in by_pool)
            if self._refuse_reads(req, done):
                pass
            elif not blocked and self._can_grant(req) and self._grant(req, submits, promotes):
                if req.pending == 0:
                    self._finish(req, done)
            else:
                self.c_waits += 1
                req.stalled = True
                self._waitq.append(req)
        self._after(submits, promotes, done)
        return rid

    def _substitute(self, groups, subst) -> tuple[list, list]:
        """Choose substitutes for a request on arrival (under the lock). For each layer with
        candidates whose requested experts are not all resident (a fast-path hit never gets
        here): for each requested expert ``m`` not resident, in request order, while fewer
        than ``cap`` swaps were made in the layer, the resident candidate not yet given with
        the highest score >= ``r * score(m)`` (ties: first) takes ``m``'s place; then every
        candidate not given is credited to the eviction order (``lfu-subst`` counts it). The
        simulator runs the same rule (``moecached.engine.policy.replay_subst``).
        Returns (requests with the substitutes in place, [(layer, missing, substitute)])."""
        r, cap, per = subst
        out, swaps = [], []
        for L, ex in groups:
            got = per.get(L.layer)
            pool, base = L.pool, L.base
            res = pool.res
            if got is None or all(res[base + e] >= 0 for e in ex):
                out.append((L.layer, ex))
                continue
            scores, cands = got
            given = set()
            new = list(ex)
            n = 0
            for i, e in enumerate(ex):
                if res[base + e] >= 0 or (0 <= cap <= n):
                    continue
                need = r * scores[i]
                best = None
                for c, sc in cands:
                    if res[base + c] >= 0 and c not in given and sc >= need and \
                            (best is None or sc > best[1]):
                        best = (c, sc)
                if best is not None:
                    given.add(best[0])
                    new[i] = best[0]
                    swaps.append((L.layer, e, best[0]))
                    n += 1
            credit = pool.lru.credit
            for c, _ in cands:
                if c not in given:
                    credit(base + c)
            out.append((L.layer, new))
        return out, swaps

    def cancel(self, ticket: int) -> bool:
        """Drop a waiting acquire (client vanished): unpin what it pinned; its reads go on as
        prefetches (their experts enter unused). Returns False when the ticket is unknown or
        already completed/failed (then its callback has been or is being called)."""
        with self._lock:
            req = self._reqs.pop(ticket, None)
            if req is None or req.state == _Req.DONE:
                return False
            if req.state == _Req.QUEUED:
                self._waitq.remove(req)
            else:
                self._unpin(req.pins)
                for pool, keys in req.pins:
                    for k in keys:
                        load = pool.loading.get(k)
                        if load is not None and req in load.waiters:
                            load.waiters.remove(req)
                            if not any(w.state == _Req.LOADING for w in load.waiters):
                                load.demanded = False
                                self._pf_loading += 1
            req.state = _Req.DONE
            req.pins = []
            submits, promotes, done = [], [], []
            if self._waitq:
                self._kick(submits, promotes, done)
        self._after(submits, promotes, done)
        return True

    def prefetch(self, layer: int, experts, conf=None) -> int:
        """Queue prefetch reads (low priority) for the absent ones of ``experts`` of ``layer``.

        Resident or in-flight experts are skipped; an expert that cannot get a slot now (pool all
        pinned, or acquires queued for slots in that pool) is skipped too: prefetch never waits
        and never jumps the queue. ``conf``: confidence per expert (see :meth:`prefetch_many`).
        Returns the number of reads queued. RequestError on a bad layer/expert/confidence.
        """
        return self.prefetch_many([(layer, experts)], conf=None if conf is None else [conf])

    def prefetch_many(self, requests, quota: PrefetchQuota | None = None, conf=None) -> int:
        """:meth:`prefetch` for ``[(layer, [experts]), ...]``; returns reads queued in total.

        ``quota``: the sender's :class:`PrefetchQuota`: its loads count there, and a read that
        would take it past ``quota.limit`` is dropped (counted in ``quota.dropped`` and in
        ``prefetches_dropped``), so one sender cannot take every prefetch load.
        ``conf``: ``[[confidence per expert], ...]`` parallel to ``requests`` (floats in [0, 1];
        None: all 1). Experts below ``prefetch_min_confidence`` are dropped; the rest are taken
        highest confidence first (request order among equals); at a cap, a queued read not yet
        started of lower confidence (the sender's own when its own cap is the one reached) is
        withdrawn in favour of the new one; a read whose slot would cost a demand-hot expert
        is dropped (module doc). Everything is validated before anything is queued."""
        submits, promotes, done = [], [], []
        own = quota.limit if quota is not None and quota.limit is not None else None
        if conf is not None and len(conf) != len(requests):
            raise RequestError(f"conf: {len(conf)} lists for {len(requests)} layers, expected one per layer")
        with self._lock:
            if self._closed:
                raise CacheClosed()
            todo = []
            for i, (layer, experts) in enumerate(requests):
                L = self._layers.get(layer)
                if L is None:
                    raise RequestError(f"layer {layer!r}: not a layer with routed experts")
                cs = conf[i] if conf is not None else None
                if cs is not None and len(cs) != len(experts):
                    raise RequestError(f"conf of layer {layer}: {len(cs)} values for {len(experts)} "
                                       f"experts, expected one per expert")
                for j, e in enumerate(experts):
                    e = int(e)
                    if not 0 <= e < L.ne:
                        raise RequestError(f"layer {layer} expert {e}: out of range 0..{L.ne - 1}")
                    c = 1.0 if cs is None else float(cs[j])
                    if not 0.0 <= c <= 1.0:
                        raise RequestError(f"conf of layer {layer} expert {e}: {c!r}, expected 0..1")
                    todo.append((c, L, e))
            if self.readers.model_changed is not None:
                return 0   # nothing is read from a changed model
            if conf is not None:
                todo.sort(key=lambda t: -t[0])   # stable: request order among equals
            waiting = {p for q in self._waitq for p in q.by_pool} if self._waitq else ()
            full, hot = set(), set()   # pools with no slot for a prefetch now / only hot victims
            displaced = False
            queued = 0
            floor = self.prefetch_min_confidence
            for c, L, e in todo:
                pool = L.pool
                if pool in waiting or pool in full:
                    continue
                if pool.alloc[L.base + e] >= 0:
                    continue
                if c < floor:
                    self.c_pf_low_conf += 1
                    continue
                if pool in hot:
                    self.c_pf_hot += 1
                    continue
                mine = own is not None and quota.in_flight >= own
                over = mine or self._pf_loading >= self.max_prefetch_loads
                if over and self._displace(c, quota if mine else None):
                    displaced = True
                    if pool.alloc[L.base + e] >= 0:
                        continue   # the withdrawn read had evicted this very expert: it is back
                    over = self._pf_loading >= self.max_prefetch_loads or (
                        own is not None and quota.in_flight >= own)
                if over:
                    self.c_pf_dropped += 1
                    if quota is not None:
                        quota.dropped += 1
                    continue
                s, victim = self._take_slot(pool, True)
                if s < 0:
                    if s == -2:
                        self.c_pf_hot += 1
                        hot.add(pool)
                    else:
                        full.add(pool)
                    continue
                load = self._start_load(L, e, s, False, submits, victim)
                load.conf = c
                queued += 1
                self._pf_loading += 1
                self.c_prefetches += 1
                if quota is not None:
                    load.quota = quota
                    quota.in_flight += 1
            if displaced and self._waitq:
                self._kick(submits, promotes, done)   # a withdrawn read may have freed a slot
        if submits or done:
            self._after(submits, promotes, done)
        return queued

    def lease_generations(self, items) -> list[int]:
        """Generation of each item's slot (``(layer, expert, class_id, slot)`` items of a lease
        still pinned): what a holder compares against the arena's control block to know its
        lease is still valid (docs/protocol.md, "Lease validity")."""
        g = self._gens_mv
        return [g[it[2]][it[3]] for it in items]

    def prefetch_noop(self, layer: int, experts: list) -> bool:
        """True when a prefetch of ``experts`` of ``layer`` has nothing to do: every one is a
        valid, distinct id already resident or loading (a list of Python ints, at most 256).
        False when it may have work or the request is bad: the caller then runs
        :meth:`prefetch_many`, which also raises the precise error. Changes and counts nothing
        (a prefetch that finds everything present queues no read either way); the check runs in
        Cython (``LRU.all_present``), so a flood of such prefetches costs little."""
        L = self._layers.get(layer)
        if L is None:
            return False
        with self._lock:
            if self._closed:
                return False
            return L.pool.lru.all_present(experts, L.base, L.ne)

    def own_lease_id(self, lid: int) -> bool:
        """True when ``lid`` lies in this cache instance's id range (issued here, or one it
        could issue); False marks a lease id from another instance, e.g. before a restart."""
        return self._id_base <= lid < self._id_base + (1 << 40)

    def release(self, lease_or_id) -> None:
        """Unpin a lease (a :class:`Lease` or its id). LeaseError when unknown or released twice."""
        lid = lease_or_id.id if isinstance(lease_or_id, Lease) else lease_or_id
        submits = None
        with self._lock:
            pins = self._leases.pop(lid, None)
            if pins is not None:
                for pool, keys in pins:
                    pool.lru.unpin_keys(keys)
                if self._waitq:
                    submits, promotes, done = [], [], []
                    self._kick(submits, promotes, done)
        if pins is None:
            if isinstance(lid, int) and not self.own_lease_id(lid):
                raise LeaseError(f"lease {lid}: not from this cache instance (stale: daemon restarted?)")
            raise LeaseError(f"lease {lid}: unknown or already released")
        if submits is not None:
            self._after(submits, promotes, done)

    def set_budget(self, budget_bytes: int) -> dict:
        """Resize the cache to ``budget_bytes`` (clamped to the configured size).

        Shrink: per pool, give back free slots first, then evict unpinned keys from the cold end,
        and release those slots' memory (``arena.release_memory``); pinned (leased or loading)
        slots are never touched, so a shrink may stop short (reported). Grow: restore given-back
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
            shrink, grow = [], []       # (pool, [slots])
            before = after = target_total = 0
            with self._lock:
                if self._closed:
                    raise CacheClosed()
                for cid, (c, pools) in self._cls.items():
                    t = min(counts.get(cid, c.n_slots), c.n_slots)
                    if self.policy == "per-layer":
                        t = t // len(c.layers)
                    for pool in pools:
                        tgt = min(t, pool.max_cap)
                        target_total += tgt
                        cur = pool.cap
                        before += cur
                        if tgt < cur:
                            take = []
                            while len(take) < cur - tgt and pool.free:
                                take.append(pool.free.pop())
                            while len(take) < cur - tgt:
                                s = self._evict_one(pool)
                                if s < 0:
                                    break
                                take.append(s)
                            pool.disabled.extend(take)
                            if take:
                                shrink.append((pool, take))
                        elif tgt > cur:
                            take = pool.disabled[:tgt - cur]
                            del pool.disabled[:tgt - cur]
                            grow.append((pool, take))
                        after += pool.cap
                if shrink:
                    self.c_shrinks += 1
                if grow:
                    self.c_grows += 1
            released = 0
            for pool, take in shrink:
                released += self.arena.release_memory(pool.cid, take)
            restored = 0
            failed = None
            grown = []
            for pool, take in grow:
                try:
                    self.arena.restore_memory(pool.cid, take)
                    restored += len(take) * self._cls[pool.cid][0].slot_bytes
                    grown.append((pool, take))
                except Exception as e:  # keep them given back, report
                    failed = e
                    with self._lock:
                        pool.disabled.extend(take)
                        after -= len(take)
            submits, promotes, done = [], [], []
            with self._lock:
                for pool, take in grown:
                    pool.free.extend(take)
                if self._waitq:
                    self._kick(submits, promotes, done)
            self._after(submits, promotes, done)
            if failed is not None:
                raise CacheError(f"set_budget({budget_bytes}): grow stopped at {after} slots: {failed}")
            return {"slots_before": before, "slots_after": after, "slots_target": target_total,
                    "bytes_released": released, "bytes_restored": restored}

    def set_ghost(self, per_class: dict) -> None:
        """Keep ``per_class[cid]`` ghost entries per size class (``moecached.daemon.split``: the keys
        evicted last, as many as one more step of budget would add; a demanded load of one
        counts in ``ghost_hits``). 0 or absent: none. Per-layer pools share their class's
        count evenly."""
        with self._lock:
            for cid, (c, pools) in self._cls.items():
                n = int(per_class.get(cid, 0)) // len(pools)
                for pool in pools:
                    pool.ghost_n = n
                    g = pool.ghost
                    while len(g) > n:
                        del g[next(iter(g))]

    @property
    def model_changed(self) -> str | None:
        """Why the model file is no longer the one indexed (one line), or None while it is."""
        return self.readers.model_changed

    def pinned_count(self) -> int:
        """Distinct pinned keys over all pools (leased or loading)."""
        with self._lock:
            return sum(p.lru.pinned for p in self._pools)

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
                       for cid, (c, pools) in self._cls.items()]
            layers = {str(l): {s.key: getattr(self, s.value)[l] for s in LAYER_STATS} for l in sorted(self._layers)}
            caps = dict.fromkeys(self._cls, 0)
            for p in self._pools:
                caps[p.cid] += p.cap
            cur = arena_bytes(self.index, caps, self.arena.page_size)
            out = {s.key: (getattr(self, s.value) if isinstance(s.value, str) else s.value(self))
                   for s in CACHE_STATS if s.value is not None}
            out.update({
                "classes": classes, "layers": layers,
                "budget": {"configured_bytes": self._max_bytes, "current_bytes": cur},
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
            self._closed = True
            err = CacheClosed()
            for req in list(self._reqs.values()):
                if req.state != _Req.DONE:
                    req.state = _Req.DONE
                    done.append((req.cb, err))
            self._reqs.clear()
            self._waitq.clear()
        for cb, res in done:
            try:
                cb(res)
            except Exception:
                self.log.exception("moecached cache: acquire callback raised")
        for f in list(self._shm.files):
            self.close_pin_file(f)
        with self._lock:
            self._shm.close()
            self._gens = self._gens_mv = {}   # views of the mapping: let it be unmapped
        try:
            self.readers.close()
        finally:
            self.arena.close(unlink=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
