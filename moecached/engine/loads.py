"""The life of a load (a part of ``moecached.engine.cache.ExpertCache``): one expert's read
into one slot (docs/operations.md, "The life of a load").

A load is *queued* (slot taken, key in the LRU and pinned by the load, read submitted),
then *in flight* (a reader took its first chunk), then it *lands*: *published* (the read
succeeded and the slot's generation is the one the load took: the resident map names the
slot), *discarded* (the generation moved while it was in flight: nothing is published; the
life of a load never gets there, the check keeps a lease from lying if it ever did) or
*failed* (its slot given back as it was found: ``moecached.engine.pools.Pools.give_back``).
A queued prefetch load not yet started may be *withdrawn* at a prefetch cap for one of
higher confidence (:meth:`Loads.withdraw`): its read is taken back and its slot given back.

A prefetch load (not demanded) counts in ``pf_loading`` and in its sender's
``PrefetchQuota`` until it lands, is withdrawn, or a demand takes it over
(:meth:`Loads.take_over`); a cancelled acquire gives its loads back to prefetch
(:meth:`Loads.give_up`). What a landing does to the requests waiting on it is theirs
(``moecached.engine.requests.Requests.landed``): :meth:`Loads.land` does the load's part
before them, :meth:`Loads.settle` after.

Lock discipline: every method runs under the cache's lock (the caller holds it); reads are
submitted and withdrawn through the reader pool the caller passes (its own lock). Counters:
``c_inflight`` (loads queued or reading), ``c_reads`` (landed), ``c_bytes``,
``c_read_errors``, ``c_reads_discarded``, ``pf_loading``; per layer ``Tally.reads``.
"""
from __future__ import annotations

from moecached.engine.errors import LoadError, ModelChangedError
from moecached.engine.readers import ModelChanged

__all__ = ["Loads"]


class _Load:
    __slots__ = ("pool", "key", "slot", "layer", "expert", "demanded", "prefetched", "waiters",
                 "job_id", "priority", "fids", "victim", "quota", "conf", "gen", "run")

    def __init__(self, pool, key, slot, layer, expert, demanded, fids, victim=None):
        self.pool, self.key, self.slot, self.layer, self.expert = pool, key, slot, layer, expert
        self.demanded = demanded
        self.prefetched = not demanded
        self.waiters: list = []     # requests (moecached.engine.requests._Req) waiting on it
        self.job_id = None
        self.priority = 0 if demanded else 1
        self.fids = fids
        self.victim = victim    # (key, was_unused) evicted to free the slot, or None
        self.quota = None   # PrefetchQuota of the prefetch's sender while it counts there
        self.conf = 1.0     # the prefetch's confidence (lower ones are withdrawn first at a cap)
        self.gen = -1       # the slot's generation when the load took it (checked at publish)
        self.run = None     # (bytes, buffered): its reads may join its neighbours' in one run


class Loads:
    """Every load of one cache (see module doc): ``layout`` (``moecached.engine.slots``),
    ``pools`` (``moecached.engine.pools.Pools``), ``tally``, ``log``, ``file_names`` (the
    model's files, for messages)."""

    def __init__(self, layout, pools, tally, log, file_names):
        self.layout = layout
        self.pools = pools
        self.tally = tally
        self.log = log
        self.file_names = file_names
        self.pf_loading = 0   # prefetch loads queued or reading that no request waits for
        self.c_inflight = 0
        self.c_reads = 0
        self.c_bytes = 0
        self.c_read_errors = 0
        self.c_reads_discarded = 0   # landed in a slot whose generation had moved (never published)
        self.c_run_reads = 0         # read jobs that loaded a run of several consecutive experts
        self.c_run_loads = 0         # loads read in such runs

    def start(self, L, expert: int, slot: int, demanded: bool, submits: list, victim=None,
              cold: bool = False, probation: bool = False, quota=None, conf: float = 1.0):
        """Queue the load of ``expert`` of layer ``L`` into ``slot`` (taken by the caller,
        ``victim`` evicted for it): the key enters the LRU (``cold``: at the cold end;
        ``probation``: at the probation point) pinned by the load, and its reads go to
        ``submits``. A prefetch (not ``demanded``) counts in ``pf_loading`` and ``quota``."""
        pool = L.pool
        k = L.base + expert
        self.pools.ghost_hit(pool, k, demanded)
        # the LRU first: it refuses a key already present, before anything else has changed
        if probation:
            pool.lru.insert_probation(k)     # scan-resistant admission at the probation point
        else:
            pool.lru.insert(k, cold or not demanded)
        load = _Load(pool, k, slot, L.layer, expert, demanded, L.fids[expert], victim)
        load.gen = self.layout.gens[pool.cid][slot]
        pool.alloc[k] = slot
        pool.loading[k] = load
        pool.lru.pin(k)                  # the load's own pin, dropped when it ends
        self.c_inflight += 1
        self.tally.reads[L.layer] += 1
        submits.append((load, self.layout.reads_for(L, expert, slot)))
        if not demanded:
            load.conf = conf
            self.pf_loading += 1
            if quota is not None:
                load.quota = quota
                quota.in_flight += 1
        return load

    def _prefetch_ends(self, load) -> None:
        """A prefetch load stops counting as one (landed, withdrawn or taken over)."""
        self.pf_loading -= 1
        if load.quota is not None:
            load.quota.in_flight -= 1
            load.quota = None

    def take_over(self, load) -> None:
        """A demand takes over a prefetch load in flight."""
        load.demanded = True
        self._prefetch_ends(load)

    def give_up(self, load) -> None:
        """No request waits on a demanded load any more: it goes on as a prefetch."""
        load.demanded = False
        self.pf_loading += 1

    def land(self, load, error, nbytes: int):
        """A load's read ended (``error`` None: it succeeded): its part before its waiters are
        told. Returns ``(fail, err)``: ``fail`` None when the load was published, else the
        error its waiters fail with; ``err`` the LoadError to log (a read error), or None."""
        pool, k = load.pool, load.key
        if not load.demanded:
            self._prefetch_ends(load)
        self.c_inflight -= 1
        self.c_reads += 1
        del pool.loading[k]
        gens = self.layout.gens
        if error is None and gens[pool.cid][load.slot] != load.gen:
            # the slot is no longer this load's: publish nothing, leave it to its holder
            self.c_reads_discarded += 1
            if pool.alloc[k] == load.slot:
                pool.alloc[k] = -1
            pool.unused[k] = 0
            pool.lru.unpin(k)
            fail = LoadError(f"load of layer {load.layer} expert {load.expert} discarded: size "
                             f"class {pool.cid} slot {load.slot} changed hands while its read was "
                             f"in flight (generation {load.gen} -> {gens[pool.cid][load.slot]}); "
                             f"internal error, counted in reads_discarded: please report it")
            self.log.error("moecached cache: %s", fail)
            return fail, None
        if error is None:
            self.c_bytes += nbytes
            pool.res[k] = load.slot
            self.layout.publish(pool, k, load.slot)
            pool.lru.unpin(k)
            if not load.demanded:
                pool.unused[k] = 1
            return None, None
        msg = str(error).splitlines()[0] if str(error) else type(error).__name__
        names = self.file_names
        fname = ", ".join(dict.fromkeys(names[f] if 0 <= f < len(names) else "?" for f in load.fids))
        if isinstance(error, ModelChanged):
            # not an I/O error, and said once by the reader pool: neither counted nor logged
            return ModelChangedError(f"load of layer {load.layer} expert {load.expert} from "
                                     f"{fname} refused: {msg}"), None
        self.c_read_errors += 1
        err = LoadError(f"load of layer {load.layer} expert {load.expert} from {fname} failed: {msg}")
        return err, err

    def settle(self, load, error, fail) -> None:
        """A landed load's part after its waiters were told (their pins are gone): a failed
        load gives its slot back; a discarded one leaves the LRU when nothing holds its key."""
        if fail is None:
            return
        if error is None:   # discarded
            pool, k = load.pool, load.key
            if pool.alloc[k] < 0 and pool.lru.pin_count(k) == 0:
                pool.lru.remove(k)
        else:
            self.pools.give_back(load, not getattr(error, "dest_written", True))

    def withdraw(self, conf: float, quota, readers) -> bool:
        """Withdraw the queued, not yet started prefetch read of lowest confidence below
        ``conf`` (of ``quota``'s sender when given) and give its slot back. True when one was
        withdrawn."""
        cands = [ld for p in self.layout.pools for ld in p.loading.values()
                 if not ld.demanded and ld.job_id is not None and ld.conf < conf
                 and (quota is None or ld.quota is quota)]
        cands.sort(key=lambda ld: ld.conf)
        for load in cands:
            if not readers.withdraw(load.job_id):
                continue   # started already: it goes on
            self._prefetch_ends(load)
            self.c_inflight -= 1
            self.tally.reads[load.layer] -= 1
            del load.pool.loading[load.key]
            self.pools.give_back(load, True)
            return True
        return False
