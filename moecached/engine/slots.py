"""The arena's slots as the cache sees them: size classes, pools, layers, slot generations and
the resident map (a part of ``moecached.engine.cache.ExpertCache``).

* A *pool* (:class:`_Pool`) is a set of slots of one size class with one eviction order (an
  ``LRU``): policy ``"global"`` has one pool per size class (all its layers share the class's
  slots); ``"per-layer"`` gives every layer of a class an equal share of the class's slots
  (``n_slots // len(layers)``) with its own order. A key is ``position of the layer in its
  pool x n_experts + expert``.
* A layer (:class:`_Layer`) names its pool, the key of its expert 0 there, and where each
  expert's parts lie in the model files.
* :class:`Layout` builds both from the index and the arena, keeps the slot generations (the
  arena's control block: a generation moves whenever a slot changes hands, so a lease can
  tell it is void) and the resident map (``moecached.engine._shm.ShmArena``, the rules of
  ``clients/c/include/moecache_shm.h``), says where a load's bytes go, and checks the
  resident map it published against the pools (``check_map``, ``vacate``: another process
  of the daemon's uid could have written it).
* :class:`Tally`: the per-layer counters.

Lock discipline: the structure is built once and never changes; the pools' arrays, the
generations and the tallies are read and changed only under the cache's lock (every part
writes them there; nothing here takes a lock).
"""
from __future__ import annotations

import numpy as np

from moecached.engine._shm import ShmArena
from moecached.engine.errors import CacheError
from moecached.engine.policy import make_eviction

__all__ = ["Layout", "Tally"]


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
        self.loading: dict = {}            # key -> its _Load (moecached.engine.loads)
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


class Tally:
    """Per-layer counters (lists indexed by GGUF block number), under the cache's lock:
    ``hits``, ``pf`` (prefetch hits) -- written by the requests, the resident-hit path and the
    shared-memory drain; ``miss`` and ``subst`` -- by the requests; ``reads`` -- by the loads."""
    __slots__ = ("hits", "pf", "miss", "reads", "subst")

    def __init__(self, n_layers: int):
        self.hits = [0] * n_layers
        self.pf = [0] * n_layers
        self.miss = [0] * n_layers
        self.reads = [0] * n_layers
        self.subst = [0] * n_layers


class Layout:
    """The size classes, pools and layers of one cache over ``arena`` (see module doc).

    Attributes: ``n_experts``, ``policy``, ``cls`` (``{cid: (arena class, [pools])}``),
    ``layers`` (``{layer: _Layer}``), ``pools`` (all, class by class), ``moe_layers`` (the
    index's expert layers in order), ``gens`` (``{cid: memoryview of the class's slot
    generations}``), ``shm`` (the resident map and pin files: ``ShmArena``), ``base_addr``,
    ``max_bytes`` (the arena file's size: budgets count all of it).

    Raises:
        CacheError: ``"per-layer"`` with fewer slots than layers in a class, or an index whose
            ``parts()`` and ``part_table()`` disagree.
    """

    def __init__(self, index, arena, policy: str, eviction: str):
        ne = self.n_experts = int(index.n_experts)
        self.policy = policy
        self.base_addr = arena.base_address
        # slot generations in the arena's control block (written under the cache's lock)
        self.gens = {c.id: memoryview(arena.generations(c.id)).cast("B").cast("Q")
                     for c in arena.classes}
        self.cls = {}            # cid -> (layout, [pools])
        self.layers: dict[int, _Layer] = {}
        self.max_bytes = arena.size   # budgets count the whole arena file (control block too)
        for c in arena.classes:
            pools = []
            if policy == "global":
                pools.append((_Pool(c.id, list(c.layers), ne, list(range(c.n_slots)), eviction),
                              c.layers))
            else:
                share = c.n_slots // len(c.layers)
                if share < 1:
                    raise CacheError(
                        f"policy 'per-layer': size class {c.id} has {c.n_slots} slots for "
                        f"{len(c.layers)} layers, expected >= 1 per layer; raise the budget")
                for i, layer in enumerate(c.layers):
                    pools.append((_Pool(c.id, [layer], ne,
                                        list(range(i * share, (i + 1) * share)), eviction),
                                  [layer]))
            self.cls[c.id] = (c, [p for p, _ in pools])
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
                    self.layers[int(layer)] = _Layer(int(layer), pool, li * ne, c.id,
                                                     offs.tolist(), fids.tolist(), ne)
        self.pools = [p for _, ps in self.cls.values() for p in ps]
        # the resident map and the fast-path pin files (rules: clients/c/include/moecache_shm.h)
        moe = {int(l): i for i, l in enumerate(index.expert_layers)}
        for pool in self.pools:
            pool.gbase = [moe[int(l)] * ne for l in pool.layers]
        self.moe_layers = [int(l) for l in index.expert_layers]
        self.shm = ShmArena(arena.base_address, ne, arena.n_keys,
                            [(c.gen_off, c.n_slots) for c in arena.classes], arena.resmap_off)
        # the resident map as published, checked against the pools (check_map, vacate): a
        # process that can write the arena (the daemon's uid) may have changed it
        self.resmap = arena.resident_map()
        self.class_keys = {c.id: np.concatenate([np.arange(moe[int(l)] * ne, (moe[int(l)] + 1) * ne)
                                                 for l in c.layers]).astype(np.int64)
                           for c in arena.classes}
        self.map_repairs = 0

    def reads_for(self, L: _Layer, expert: int, slot: int) -> list:
        """The reads of one load: ``(file, offset, nbytes, dest address)`` per part."""
        c = self.cls[L.cid][0]
        offs, fids = L.offs[expert], L.fids[expert]
        out = []
        for p, name in enumerate(c.parts):
            pb = c.part_bytes[name]
            out.append((fids[p], offs[p], pb, self.base_addr + c.part_off[name] + slot * pb))
        return out

    def publish(self, pool: _Pool, k: int, slot: int) -> None:
        """The resident map says ``k`` is in ``slot`` (its bytes are complete)."""
        ne = self.n_experts
        self.shm.publish(pool.gbase[k // ne] + k % ne, slot)

    def expected_map(self) -> np.ndarray:
        """The resident map as the pools say it must be (0, or slot + 1, per key)."""
        want = np.zeros(len(self.resmap), dtype=np.uint64)
        ne = self.n_experts
        for pool in self.pools:
            res, gbase = pool.res, pool.gbase
            for k, slot in enumerate(res):
                if slot >= 0:
                    want[gbase[k // ne] + k % ne] = slot + 1
        return want

    def check_map(self) -> int:
        """Compare the published resident map with the pools and write back every entry some
        other process changed (under the cache's lock, so never in the middle of a publish
        or an eviction's handshake); returns the entries repaired (counted in
        ``map_repairs``). Clients pin through this map: after a repair every pin reads the
        daemon's truth again."""
        want = self.expected_map()
        bad = np.flatnonzero(self.resmap != want)
        if len(bad):
            self.resmap[bad] = want[bad]
            self.map_repairs += len(bad)
        return len(bad)

    def vacate(self, cid: int, slot: int) -> int:
        """Before ``slot`` of class ``cid`` takes a new expert: no key of the class may name it
        in the resident map any more (its expert left it, cleared by the eviction); an entry
        that still does was written by another process and is cleared, so no pin through it
        can reach the new expert's bytes as another's. Returns the entries cleared."""
        keys = self.class_keys[cid]
        bad = keys[self.resmap[keys] == slot + 1]
        if len(bad):
            self.resmap[bad] = 0
            self.map_repairs += len(bad)
        return len(bad)

    def shm_key(self, pool: _Pool, k: int) -> int:
        """The resident-map key of pool key ``k``."""
        ne = self.n_experts
        return pool.gbase[k // ne] + k % ne

    def release_views(self) -> None:
        """Drop the views of the arena's mapping (closing: let it be unmapped)."""
        self.gens = {}
