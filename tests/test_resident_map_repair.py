"""A process that writes the arena's resident map (any process of the daemon's uid can) made
fast-path clients pin the wrong slot and read another expert's bytes as the one they asked for;
the daemon never looked at what it had published. Now it checks the map against its own state
every tick and before a slot takes a new expert, writes back what was changed and counts it
(``map_repairs``)."""
import time

import numpy as np
import pytest

import moecache_client
from moecache_client import Client

from daemon_util import Daemon
from fixtures import file_bytes

pytestmark = pytest.mark.skipif(moecache_client.IMPLEMENTATION != "cython",
                                reason="the shared-memory hit path needs the compiled client")


def tamper(d, layer, expert, value):
    """Write ``value`` into the resident map entry of (layer, expert), as another process of the
    daemon's uid could (its own read-write mapping of the arena file)."""
    a = d.cache.arena
    m = np.memmap(a.path, dtype=np.uint64, mode="r+", offset=0, shape=(a.resmap_off // 8 + a.n_keys,))
    key = d.idx.expert_layers.index(layer) * d.idx.n_experts + expert
    m[a.resmap_off // 8 + key] = value
    m.flush()
    del m


def test_a_tampered_resident_map_is_repaired_within_a_tick(model_factory, tmp_path):
    with Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8), tmp_path,
                tick_s=0.2) as d, Client(d.endpoint, name="engine") as c:
        L = d.idx.expert_layers[0]
        lease = c.acquire(L, [1, 2])
        (_, _, _, s1), (_, _, _, s2) = lease.items
        lease.release()
        tamper(d, L, 1, s2 + 1)          # expert 1 "is in" expert 2's slot
        time.sleep(0.6)                  # three ticks
        with c.acquire(L, [1]) as lease:
            got = lease.parts(1, L)
            for p, want in file_bytes(d.idx, L, 1).items():
                assert bytes(got[p]) == want, p
            assert lease.items[0][3] == s1
        assert c.stats()["map_repairs"] == 1


def test_a_stale_entry_naming_a_slot_is_cleared_before_the_slot_is_reused(model_factory, tmp_path):
    with Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8), tmp_path,
                tick_s=3600) as d, Client(d.endpoint, name="engine") as c:
        L = d.idx.expert_layers[0]
        lease = c.acquire(L, [1])
        free = lease.items[0][3] + 1     # free slots go lowest first: the next load's slot
        lease.release()
        time.sleep(0.3)                  # the first tick has run; the next is an hour away
        tamper(d, L, 5, free + 1)        # expert 5 (not resident) "is in" that free slot
        with c.acquire(L, [6]) as lease:  # expert 6 is loaded into it
            assert lease.items[0][3] == free
        with c.acquire(L, [5]) as lease:   # a pin of expert 5 reads expert 5's bytes
            got = lease.parts(5, L)
            for p, want in file_bytes(d.idx, L, 5).items():
                assert bytes(got[p]) == want, p
        assert c.stats()["map_repairs"] == 1
