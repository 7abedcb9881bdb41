"""Pins and leases (a part of ``moecached.engine.cache.ExpertCache``).

A key is *pinned* while something may read its slot: a lease, a load, or a client's pin
through shared memory. Pinned keys are never evicted, never given back by ``set_budget``.

* Socket leases: :class:`Lease`, what an acquire returns; the lease table (lease id -> the
  keys it pins) and the resident-hit path are ``moecached.engine._hits.HitPath`` (Cython).
* Shared-memory pins (:class:`ShmPins`): each fast-path client has a pin file beside the
  arena (``moecached.engine._shm``; rules in ``clients/c/include/moecache_shm.h``): it pins
  resident slots and records its hits in a ring there, without a message. The cache drains the
  rings (the hits count as socket hits would; the rings of one uid at most
  ``fast_path_hit_rate`` entries per second together, the rest skipped and counted), and a
  victim a pin file holds is pinned in the LRU (*held*) until a sweep finds the pin gone.

Lock discipline: every method of :class:`ShmPins` runs under the cache's lock (the caller
holds it) except :meth:`ShmPins.create_file` and :meth:`ShmPins.unlink_file` (file system
work, outside it); ``ShmArena.pending`` is read without it (the rings are the clients').
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from moecached.engine._shm import PinFile

__all__ = ["Lease", "ShmPins"]


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
        hits, prefetch_hits, misses, substituted: how the experts were found (see module doc
            of ``moecached.engine.cache``; they sum to ``len(items)``).
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


class ShmPins:
    """The shared-memory pins of one cache (see module doc).

    Attributes: ``shm`` (the layout's ``ShmArena``: pin files, rings, resident map), ``held``
    (``{(pool, key)}`` pinned in the LRU because a pin file holds its slot), ``fast_log``
    (a list while shared-memory hits are to be recorded: the server sets it while a trace is
    recorded; None otherwise).
    """

    def __init__(self, layout, tally):
        self.layout = layout
        self.tally = tally
        self.shm = layout.shm
        self.held: set = set()
        self.fast_log = None
        lmap = layout.layers
        self.shm.set_targets([(layer, lmap[layer].pool.lru, lmap[layer].base, lmap[layer].pool.res,
                               lmap[layer].pool.unused) for layer in layout.moe_layers])

    # ---- the rings (under the cache's lock) ----------------------------------------------
    def drain(self) -> int:
        """Apply the hits clients took through shared memory (their rings, merged by time) to
        the LRU and the hit counters, as a socket hit counts; entries naming an expert that is
        not resident are dropped, entries over their uid's budget (``ShmArena.hit_rate``, config
        ``fast_path_hit_rate``) skipped (both counted per client), entries past ``DRAIN_MAX``
        left for the next drain. The per-entry work is ``ShmArena.drain`` (C). Returns entries
        applied."""
        got = self.shm.drain(self.fast_log)
        if got is None:
            return 0
        n, hits, pf = got
        l_hits, l_pf = self.tally.hits, self.tally.pf
        for layer, c in hits.items():
            l_hits[layer] += c
        for layer, c in pf.items():
            l_pf[layer] += c
        return n

    def take_fast_log(self) -> list:
        """The shared-memory hits applied since the last call (see ``ExpertCache.take_fast_log``)."""
        log = self.fast_log
        if not log:
            return []
        self.fast_log = []
        return log

    # ---- victims (under the cache's lock) -------------------------------------------------
    def let_go(self, pool, k: int, slot: int) -> bool:
        """Before ``k`` (in ``slot``) is evicted: clear it from the resident map and move the
        slot's generation (old leases on it go invalid) -- True; or, when a pin file holds the
        slot, pin ``k`` in the LRU until :meth:`sweep` finds the pin gone -- False."""
        if self.shm.try_evict(self.layout.shm_key(pool, k), pool.cid, slot):
            return True
        pool.lru.pin(k)
        self.held.add((pool, k))
        return False

    def sweep(self) -> bool:
        """Unpin, in the LRU, keys no honoured fast-path pin holds any more. True when some key
        became evictable."""
        held = self.shm.sweep()
        freed = False
        if self.held:
            gs = self.shm.global_slot
            for pool, k in list(self.held):
                if gs(pool.cid, pool.alloc[k]) not in held:
                    self.held.discard((pool, k))
                    pool.lru.unpin(k)
                    freed = True
        return freed

    # ---- pin files ------------------------------------------------------------------------
    @property
    def n_files(self) -> int:
        """Pin files open now (and found truncated, not yet taken by :meth:`take_broken`)."""
        return len(self.shm.files) + len(self.shm.broken)

    def take_broken(self) -> list:
        """Pin files found truncated since the last call (under the cache's lock)."""
        out, self.shm.broken = self.shm.broken, []
        return out

    def default_quota(self, index, arena) -> int:
        """Slots whose fast-path pins are honoured per client when the configuration gives no
        quota: four tokens' worth of top-k over every MoE layer, at most half the slots."""
        top_k = max(1, int(getattr(index, "top_k", 0) or 8))
        total = sum(c.n_slots for c in arena.classes)
        return max(1, min(4 * top_k * len(self.layout.moe_layers), total // 2))

    def create_file(self, path: str, epoch: int, quota: int, uid: int | None = None) -> PinFile:
        """Create the pin file ``path`` (mode 0600, owned by ``uid`` when given, an exclusive
        ``flock`` held while it lives, so stale cleanup leaves it alone); outside the lock. It
        is honoured once :meth:`add` adds it. OSError when it cannot be made (nothing is left
        behind)."""
        import fcntl
        shm = self.shm
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, shm.file_size)
            os.pwrite(fd, shm.header(epoch, quota), 0)   # magic last seen by cleanup: locked
            if uid is not None:
                os.fchown(fd, uid, -1)
            return PinFile(path, fd, shm.file_size, quota)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise

    def add(self, f: PinFile, uid: int | None = None) -> None:
        """Honour ``f``'s pins from now on (under the cache's lock); its hit ring shares the
        budget of ``uid``'s other pin files (None: one of its own)."""
        self.shm.add(f, uid)

    def remove(self, f: PinFile) -> None:
        """Stop honouring ``f``'s pins (under the cache's lock); :meth:`sweep` then lets go of
        the keys they held."""
        self.shm.remove(f)

    @staticmethod
    def unlink_file(f: PinFile) -> None:
        """Unlink (when the path still names it) and close a removed pin file; outside the
        lock. Idempotent."""
        fd, f.fd = f.fd, None
        if fd is not None:
            try:
                st, cur = os.fstat(fd), os.stat(f.path)
                if (st.st_dev, st.st_ino) == (cur.st_dev, cur.st_ino):
                    os.unlink(f.path)
            except OSError:
                pass
            os.close(fd)
