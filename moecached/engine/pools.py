"""The size-class pools' slots: eviction, giving a slot back, the budget (shrink / grow) and
the ghost lists (a part of ``moecached.engine.cache.ExpertCache``).

* A load takes a free slot, or evicts the coldest unpinned key of its pool (:meth:`Pools.evict`):
  the hits clients took through shared memory are applied first, so the victim is the one the
  socket path would pick; a victim a pin file holds is *held* (pinned in the LRU) and the
  next one tried. For a prefetch, a victim that is *demand-hot* (demanded since it came in and
  not among the colder half of its pool's recency order) is not evicted (docs/policies.md,
  "Prefetch confidence").
* A load that published nothing gives its slot back as it found it (:meth:`Pools.give_back`):
  to the expert it evicted, resident again at the cold end with its counters restored, when
  no byte was read into the slot; else to the free list.
* ``set_budget``: per pool, free slots are given back first, then unpinned keys evicted from
  the cold end, their memory released (``arena.release_memory``); pinned slots are never
  touched, so a shrink may stop short (``resize(..., finish=True)`` takes the rest later). A
  grow restores given-back slots (``arena.restore_memory``).
* Ghosts (``moecached.daemon.split``): per pool, the keys evicted last, as many as one more
  step of budget would add; a demanded load of one counts in ``ghost_hits``.

Lock discipline: every method runs under the cache's lock (the caller holds it), except
:meth:`Pools.move_memory`, :meth:`Pools.settle` and :meth:`Pools.punch_again`, which run under
the budget lock only and take the cache's lock itself where they read or change a pool (the
arena's memory calls run outside it). Counters: ``c_evictions``, ``c_wasted`` (prefetched
experts evicted unused), ``c_ghost_hits``, ``c_shrinks``, ``c_grows``, ``c_repunched`` (bytes
of given-back slots faulted back in and punched again).
"""
from __future__ import annotations

from moecached.engine.arena import arena_bytes

__all__ = ["Pools"]


class Pools:
    """The slots of every pool of ``layout`` (see module doc); ``pins``: the cache's
    ``ShmPins`` (victims a pin file holds are skipped)."""

    def __init__(self, layout, pins):
        self.layout = layout
        self.pins = pins
        self.c_evictions = 0
        self.c_wasted = 0
        self.c_ghost_hits = 0
        self.c_shrinks = 0
        self.c_grows = 0
        self.c_repunched = 0      # bytes of given-back slots faulted back in and punched again
        self._uncounted = False   # the last shrink asked for slots and pins held every one
        self._counts = None       # slots per class the last resize asked for
        self._mark = None         # the arena's allocated bytes right after its holes were punched

    # ---- slots for loads ------------------------------------------------------------------
    def evict(self, pool, prefetch: bool = False) -> tuple:
        """Evict the coldest unpinned key of ``pool`` that no fast-path pin holds: ``(slot,
        (key, was_unused))``, or ``(-1, None)``. ``prefetch``: ``(-2, None)``, evicting
        nothing, when the victim is demand-hot."""
        pins = self.pins
        if pins.shm.files:
            pins.drain()
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
            if not pins.let_go(pool, k, s):
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

    def take_slot(self, pool, prefetch: bool = False) -> tuple:
        """A slot for a load: ``(slot, victim)``; victim ``(key, was_unused)`` when a resident
        expert was evicted for it (given back if the load fails untouched), slot -1 if none
        (-2: for a prefetch, the victim would have been demand-hot)."""
        if pool.free:
            slot, victim = pool.free.pop(), None
        else:
            slot, victim = self.evict(pool, prefetch)
        if slot >= 0:
            self.layout.vacate(pool.cid, slot)   # no stale map entry may name the slot
        return slot, victim

    def give_back(self, load, untouched: bool) -> None:
        """A load that published nothing gives its slot back: to the expert it evicted when
        ``untouched`` (no byte read into the slot), else to the free list. The slot's
        generation moves."""
        pool, k = load.pool, load.key
        pool.alloc[k] = -1
        pool.res[k] = -1
        pool.unused[k] = 0
        pool.lru.unpin(k)
        pool.lru.remove(k)
        self.layout.gens[pool.cid][load.slot] += 1
        v = load.victim
        if v is not None and untouched and pool.alloc[v[0]] < 0:
            # the slot still holds the evicted expert's bytes: it gets its place back
            vk, was_unused = v
            pool.alloc[vk] = pool.res[vk] = load.slot
            self.layout.publish(pool, vk, load.slot)
            pool.unused[vk] = was_unused
            pool.lru.insert(vk, True)
            self.c_evictions -= 1
            if was_unused:
                self.c_wasted -= 1
        else:
            pool.free.append(load.slot)

    def ghost_hit(self, pool, k: int, demanded: bool) -> None:
        """A load of ``k`` starts: it leaves the ghost list; a demanded one found there counts
        (a hit one more step of budget would have had)."""
        if pool.ghost and pool.ghost.pop(k, 0) is None and demanded:
            self.c_ghost_hits += 1

    # ---- budget ---------------------------------------------------------------------------
    def resize(self, counts: dict, finish: bool = False) -> tuple:
        """Plan and start a resize to ``counts`` (slots per class, ``arena.plan_slots``; per-layer
        pools get ``target // layers``): slots to give back are taken out of their pools now
        (free first, then evicted), slots to restore taken off the given-back list. Returns
        ``(shrink, grow, before, after, target)``: ``[(pool, [slots])]`` twice, then slot counts
        summed over all pools (``after`` before any restore can fail). ``finish``: only the
        rest of a shrink that pins stopped short (no grow; counted as a shrink only when the
        pins had held every slot it asked for)."""
        shrink, grow = [], []
        before = after = target_total = 0
        wanted = False
        if not finish:
            self._counts = counts
        for cid, (c, pools) in self.layout.cls.items():
            t = min(counts.get(cid, c.n_slots), c.n_slots)
            if self.layout.policy == "per-layer":
                t = t // len(c.layers)
            for pool in pools:
                tgt = min(t, pool.max_cap)
                target_total += tgt
                cur = pool.cap
                before += cur
                if tgt < cur:
                    wanted = True
                    take = []
                    while len(take) < cur - tgt and pool.free:
                        take.append(pool.free.pop())
                    while len(take) < cur - tgt:
                        s = self.evict(pool)[0]
                        if s < 0:
                            break
                        take.append(s)
                    pool.disabled.extend(take)
                    if take:
                        shrink.append((pool, take))
                elif tgt > cur and not finish:
                    take = pool.disabled[:tgt - cur]
                    del pool.disabled[:tgt - cur]
                    grow.append((pool, take))
                after += pool.cap
        if shrink and (not finish or self._uncounted):
            self.c_shrinks += 1
        if not finish or shrink:
            self._uncounted = wanted and not shrink and not finish
        if grow:
            self.c_grows += 1
        return shrink, grow, before, after, target_total

    def move_memory(self, arena, shrink: list, grow: list, lock) -> tuple:
        """Release the memory of the slots :meth:`resize` gave back and restore that of the
        slots it takes back (outside the cache's ``lock``; a restore that fails puts its slots
        back on the given-back list, under it). Returns ``(bytes released, bytes restored,
        [(pool, [slots])] restored, slots not restored, the error or None)``; the restored
        slots are not free yet (:meth:`add_free`)."""
        released = 0
        for pool, take in shrink:
            released += arena.release_memory(pool.cid, take)
        restored = lost = 0
        failed = None
        grown = []
        for pool, take in grow:
            try:
                arena.restore_memory(pool.cid, take)
                restored += len(take) * self.layout.cls[pool.cid][0].slot_bytes
                grown.append((pool, take))
            except Exception as e:  # keep them given back, report
                failed = e
                with lock:
                    pool.disabled.extend(take)
                    lost += len(take)
        return released, restored, grown, lost, failed

    def settle(self, arena, lock, closed) -> dict:
        """``ExpertCache.settle_memory`` (under the budget lock; takes ``lock`` itself): the
        rest of a shrink that pins stopped short (:meth:`resize` with ``finish``), then
        :meth:`punch_again`. ``closed()``: the cache is closed (nothing done)."""
        out = {"bytes_released": 0, "bytes_repunched": 0}
        with lock:
            if closed():
                return out
            shrink = self.resize(self._counts, finish=True)[0] if self._counts is not None else []
        if shrink:
            out["bytes_released"] = self.move_memory(arena, shrink, [], lock)[0]
        out["bytes_repunched"] = self.punch_again(arena, lock, fresh=bool(shrink))
        return out

    def punch_again(self, arena, lock, fresh: bool = False) -> int:
        """(Under the budget lock: given-back slots stay so.) Punch the given-back slots again
        when the arena file holds more than its slots need (``st_blocks``, one ``fstat``) and
        more than right after the last punch (a page shared with a live slot, a huge page that
        did not split, a file system's own blocks stay and do not count). Returns the bytes
        that fell (``c_repunched``). ``fresh``: memory just moved (a shrink or grow): forget
        the last punch and count nothing; what falls is taken for the shrink's own (pages that
        slots given back apart share; pages a reader faulted in meanwhile, counted by the
        periodic punch once it reads them again)."""
        if fresh:
            self._mark = None
        with lock:
            given = self.given_back()
        if not given:
            self._mark = None
            return 0
        have = arena.allocated_bytes()
        need = arena.size - sum(arena.hole_bytes(cid, slots) for cid, slots in given.items())
        if have <= need or (self._mark is not None and have <= self._mark):
            return 0
        for cid, slots in given.items():
            arena.release_memory(cid, slots)
        self._mark = after = arena.allocated_bytes()
        fell = 0 if fresh else max(0, have - after)
        self.c_repunched += fell
        return fell

    def given_back(self) -> dict:
        """``{class id: [slots]}``: the slots given back now (their pages are holes), the pools
        of a class together."""
        out: dict = {}
        for p in self.layout.pools:
            if p.disabled:
                out.setdefault(p.cid, []).extend(p.disabled)
        return out

    @staticmethod
    def add_free(grown: list) -> None:
        """Slots whose memory is back become free."""
        for pool, take in grown:
            pool.free.extend(take)

    def set_ghost(self, per_class: dict) -> None:
        """Keep ``per_class[cid]`` ghost entries per size class (per-layer pools share their
        class's count evenly); 0 or absent: none."""
        for cid, (c, pools) in self.layout.cls.items():
            n = int(per_class.get(cid, 0)) // len(pools)
            for pool in pools:
                pool.ghost_n = n
                g = pool.ghost
                while len(g) > n:
                    del g[next(iter(g))]

    def current_bytes(self, index, arena) -> int:
        """What the arena would take at the pools' current sizes."""
        caps = dict.fromkeys(self.layout.cls, 0)
        for p in self.layout.pools:
            caps[p.cid] += p.cap
        return arena_bytes(index, caps, arena.page_size)

    def pinned(self) -> int:
        """Distinct pinned keys over all pools (leased, loading or held)."""
        return sum(p.lru.pinned for p in self.layout.pools)
