"""Acquire requests and their waiters (a part of ``moecached.engine.cache.ExpertCache``).

* ``acquire`` is all-or-nothing: a request is granted only when every expert in it is resident
  or can get a slot right now (free, or by evicting an unpinned key from the cold end); then it
  pins all of its experts, starts one read per absent expert (demand priority; a queued
  prefetch of a wanted expert is promoted; an in-flight read is shared, never repeated) and
  completes when the last of its reads lands. A request that cannot get its slots yet waits
  in a FIFO queue holding no pins (so waiters can never deadlock each other); a request whose
  experts are all resident or already loading never waits in that queue (it needs no new
  slot). Queued requests are granted FIFO per pool (a blocked pool blocks later ones) when a
  release, a landed or withdrawn load, a budget grow or a fast-path pin let go frees a slot.
* A read that fails fails every request waiting on it (:class:`~moecached.engine.errors.LoadError`);
  once the model changed, a request that needs a read fails at once
  (:class:`~moecached.engine.errors.ModelChangedError`, no slot taken).
* A cancelled request (client gone, timeout) drops its pins; its reads go on as prefetches.
* Counting (per requested expert, disjoint): ``hits`` (resident and demanded before),
  ``prefetch_hits`` (first demand of an expert a prefetch brought in, resident or in flight),
  ``substituted`` (a resident substitute granted in its place: ``moecached.engine.substitute``),
  ``misses`` (a new demand read, or waiting on another request's in-flight demand read).
* Admission (config ``admit_cold``, ``scan_admit``): a demanded miss of a request tagged
  ``prompt`` (``"prompt"``), or naming more than N experts of its layer (an int N), enters the
  LRU at the cold end, or at the probation point with ``scan_admit = "probation"``.

Lock discipline: every method runs under the cache's lock (the caller holds it). Reads to
submit, loads to promote and callbacks to run are returned in the caller's ``submits``,
``promotes`` and ``done`` lists, which it handles after dropping the lock; the reader pool is
passed in (its ``model_changed`` is read at the moment a request needs a read). Counters:
``c_waits`` (requests that had to queue); per layer ``Tally.hits``, ``pf``, ``miss``,
``subst``; leases granted in the lease table (``moecached.engine._hits.HitPath``).
"""
from __future__ import annotations

import time

from moecached.engine.errors import CacheError, CapacityError, ModelChangedError, RequestError
from moecached.engine.pins import Lease
from moecached.engine.substitute import substitute

__all__ = ["Requests"]


def _file_order(submit) -> tuple:
    """Where a load's first read starts in the model files: (file, offset). A cold layer's
    missing experts queued in this order are read front to back (the experts of one tensor lie
    back to back), not in the order a router named them."""
    reads = submit[1]
    return (reads[0][0], reads[0][1]) if reads else (-1, -1)


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


class Requests:
    """The acquires of one cache (see module doc) over ``layout``, ``pools``, ``loads`` and
    the lease table ``leases`` (``HitPath``: lease ids, granted leases). ``waitq``: the list
    that is to hold the requests waiting for slots (the hit path reads it too, so it is this
    one list for the cache's life). ``shrunk_policy``, ``admit_cold``, ``scan_admit``: the
    config keys (a reload sets the attributes).

    Attributes: ``reqs`` (ticket -> request not yet completed), ``waitq`` (FIFO of requests
    waiting for slots).
    """

    def __init__(self, layout, pools, loads, leases, tally, waitq: list, *,
                 shrunk_policy="wait", admit_cold="off", scan_admit="cold"):
        self.layout = layout
        self.pools = pools
        self.loads = loads
        self.leases = leases
        self.tally = tally
        self.shrunk_policy = shrunk_policy
        self.admit_cold = admit_cold   # "off" | "prompt" | int N (config key admit_cold)
        self.scan_admit = scan_admit   # where admit_cold puts a miss: "cold" | "probation"
        self.reqs: dict[int, _Req] = {}
        self.waitq: list[_Req] = waitq
        self.c_waits = 0

    # ---- a new request --------------------------------------------------------------------
    def validate(self, requests) -> tuple[list, dict]:
        """-> (groups [(_Layer, experts)], by_pool {pool: [keys]}); RequestError when bad."""
        layers, ne = self.layout.layers, self.layout.n_experts
        groups = []
        by_pool: dict = {}
        for layer, experts in requests:
            L = layers.get(layer)
            if L is None:
                raise RequestError(f"layer {layer!r}: not a layer with routed experts "
                                   f"(expected one of {sorted(layers)})")
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
                raise RequestError(f"duplicate in request: layer {pool.layers[k // ne]} "
                                   f"expert {k % ne} listed twice")
            n = len(keys)
            where = (f"size class {pool.cid}" if self.layout.policy == "global"
                     else f"layer {pool.layers[0]} (size class {pool.cid})")
            if n > pool.max_cap:
                raise RequestError(f"request needs {n} slots of {where}, which holds at most "
                                   f"{pool.max_cap}; raise the budget or split the request")
            if n > pool.cap and self.shrunk_policy == "error":
                raise CapacityError(f"request needs {n} slots of {where}, which holds {pool.cap} "
                                    f"now (budget shrunk from {pool.max_cap})")
        return groups, by_pool

    def submit(self, requests, callback, tag, subst, readers, submits, promotes, done) -> int:
        """A new acquire (``ExpertCache.acquire_async``): validated, substitutes chosen,
        granted now or queued. Returns its ticket (= the lease id). RequestError when bad."""
        groups, by_pool = self.validate(requests)
        swaps = []
        if subst is not None:
            requests, swaps = substitute(groups, subst)
            if swaps:
                groups, by_pool = self.validate(requests)
        rid = self.leases.new_id()
        req = _Req(rid, groups, by_pool, callback, tag)
        if swaps:
            req.swaps = swaps
            req.subst = frozenset((l, c) for l, _, c in swaps)
        self.reqs[rid] = req
        waitq = self.waitq
        blocked = waitq and self.needs_slots(req) and any(
            p in q.by_pool for q in waitq for p in by_pool)
        if self.refuse_reads(req, readers, done):
            pass
        elif not blocked and self.can_grant(req) and self.grant(req, submits, promotes):
            if req.pending == 0:
                self.finish(req, done)
        else:
            self.c_waits += 1
            req.stalled = True
            waitq.append(req)
        return rid

    def waiting_pools(self):
        """Pools some queued request waits in (a prefetch does not jump their queue)."""
        return {p for q in self.waitq for p in q.by_pool} if self.waitq else ()

    # ---- granting ---------------------------------------------------------------------------
    def _cold(self, tag, width: int) -> bool:
        """Whether a demanded miss enters the LRU at the cold end (config key admit_cold: the
        acquire is tagged prompt, or names more than N experts of the layer)."""
        a = self.admit_cold
        return (tag == "prompt") if a == "prompt" else (a != "off" and width > a)

    def can_grant(self, req: _Req) -> bool:
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

    @staticmethod
    def needs_slots(req: _Req) -> bool:
        for pool, keys in req.by_pool.items():
            alloc = pool.alloc
            for k in keys:
                if alloc[k] < 0:
                    return True
        return False

    def grant(self, req: _Req, submits: list, promotes: list) -> bool:
        """Pin everything of ``req``, start its missing loads (caller checked can_grant).
        Returns False, granting nothing, when a fast-path pin held a victim the count relied on
        (the slots already freed stay free)."""
        taken = self.take_slots(req)
        if taken is None:
            return False
        loads, tally = self.loads, self.tally
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
                        loads.take_over(load)
                        lp += 1
                        if load.priority:
                            promotes.append(load)
                    else:
                        lm += 1
            pins.append((pool, keys))
            tally.hits[layer] += lh
            tally.pf[layer] += lp
            tally.miss[layer] += lm
            if ls:
                tally.subst[layer] += ls
            hits += lh
            pf += lp
            miss += lm
        probation = self.scan_admit == "probation"
        n0 = len(submits)
        for (i, L, e, cold), (s, victim) in zip(misses, taken):   # slots taken before anything changed
            load = loads.start(L, e, s, True, submits, victim, cold, cold and probation)
            L.pool.lru.pin(load.key)
            load.waiters.append(req)
            req.pending += 1
            items[i] = (L.layer, e, L.cid, s)
        if len(submits) - n0 > 1:   # the missing set of a request: queued in file order
            submits[n0:] = sorted(submits[n0:], key=_file_order)
        req.items = items
        req.pins = pins
        if req.pending:
            req.stalled = True
        req.hits, req.pf, req.misses = hits, pf, miss
        req.state = _Req.LOADING
        return True

    def take_slots(self, req: _Req) -> list | None:
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
                s, victim = self.pools.take_slot(pool)
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

    def refuse_reads(self, req: _Req, readers, done: list) -> bool:
        """The model changed and ``req`` needs a read: fail it now (no slot taken)."""
        why = readers.model_changed
        if why is None or not self.needs_slots(req):
            return False
        self.fail(req, ModelChangedError(f"{why}: acquire needs a read of the changed model; only resident "
                                         f"experts are served until it is re-indexed (the daemon does so once the "
                                         f"file is unchanged for 1 s and indexes as a model, with on_model_change "
                                         f"= \"reload\"; put the model back if it does not)"),
                  done)
        return True

    def kick(self, readers, submits, promotes, done) -> None:
        """Grant queued requests that fit now, FIFO per pool (a blocked pool blocks later ones)."""
        blocked = set()
        for req in list(self.waitq):
            if req.state != _Req.QUEUED:
                continue
            if blocked and any(p in blocked for p in req.by_pool):
                blocked.update(req.by_pool)
                continue
            if self.refuse_reads(req, readers, done):
                continue
            if self.can_grant(req) and self.grant(req, submits, promotes):
                self.waitq.remove(req)
                if req.pending == 0:
                    self.finish(req, done)
            else:
                blocked.update(req.by_pool)

    # ---- the end of a request ---------------------------------------------------------------
    def finish(self, req: _Req, done: list) -> None:
        req.state = _Req.DONE
        self.reqs.pop(req.id, None)
        self.leases.add(req.id, req.pins)
        stall = time.perf_counter() - req.t0 if req.stalled else 0.0
        done.append((req.cb, Lease(req.id, req.items, req.hits, req.pf, req.misses, stall,
                                   req.swaps)))

    @staticmethod
    def unpin(pins) -> None:
        for pool, keys in pins:
            unpin = pool.lru.unpin
            for k in keys:
                unpin(k)

    def fail(self, req: _Req, err: CacheError, done: list) -> None:
        if req.state == _Req.LOADING:
            self.unpin(req.pins)
        elif req.state == _Req.QUEUED:
            try:
                self.waitq.remove(req)
            except ValueError:
                pass
        req.state = _Req.DONE
        req.pins = []
        self.reqs.pop(req.id, None)
        done.append((req.cb, err))

    def cancel(self, ticket: int, readers, submits, promotes, done) -> bool:
        """Drop a waiting acquire: unpin what it pinned; its reads go on as prefetches. False
        when the ticket is unknown or already completed/failed."""
        req = self.reqs.pop(ticket, None)
        if req is None or req.state == _Req.DONE:
            return False
        if req.state == _Req.QUEUED:
            self.waitq.remove(req)
        else:
            self.unpin(req.pins)
            for pool, keys in req.pins:
                for k in keys:
                    load = pool.loading.get(k)
                    if load is not None and req in load.waiters:
                        load.waiters.remove(req)
                        if not any(w.state == _Req.LOADING for w in load.waiters):
                            self.loads.give_up(load)
        req.state = _Req.DONE
        req.pins = []
        if self.waitq:
            self.kick(readers, submits, promotes, done)
        return True

    def on_read(self, load, error, nbytes: int, readers, submits, promotes, done):
        """A load's read ended: the load lands (``Loads.land``), its waiters complete (the
        last read of a request finishes it) or fail, the load settles, and queued requests
        may get the slots. Returns the LoadError to log, or None."""
        fail, err = self.loads.land(load, error, nbytes)
        for req in load.waiters:
            if req.state == _Req.LOADING:
                if fail is None:
                    req.pending -= 1
                    if req.pending == 0:
                        self.finish(req, done)
                else:
                    self.fail(req, fail, done)
        self.loads.settle(load, error, fail)
        load.waiters = []
        if self.waitq:
            self.kick(readers, submits, promotes, done)
        return err

    def abandon(self, load, err: CacheError, done: list) -> None:
        """Completing ``load`` raised (a bookkeeping bug): its waiters fail with ``err`` rather
        than hang."""
        for req in load.waiters:
            if req.state != _Req.DONE:
                req.state = _Req.DONE
                self.reqs.pop(req.id, None)
                done.append((req.cb, err))
        load.waiters = []

    def close(self, err: CacheError, done: list) -> None:
        """The cache closes: every request not done fails with ``err``."""
        for req in list(self.reqs.values()):
            if req.state != _Req.DONE:
                req.state = _Req.DONE
                done.append((req.cb, err))
        self.reqs.clear()
        self.waitq.clear()
