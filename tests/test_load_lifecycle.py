"""The life of a load (docs/operations.md, "The life of a load"), driven step by step.

The cache here reads through :class:`ManualReads`, a reader pool whose jobs move only when the
test says so: started (a chunk handed to a reader: the slot may be written), landed (every byte
written, callback run) or failed (touched or not), in any order. That turns every interleaving
of a withdrawal, a demand take-over, a read landing, an eviction, a shrink or a grow into a
sequence of calls, so a test can force one (the deterministic tests) or search them (the
stateful test, ``hypothesis``), with the invariants checked after every step: every published
slot holds exactly its expert's bytes, no slot has two owners or a read of a former owner
outstanding, pins and in-flight counts add up, nothing leaks.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fixtures import make_model
from moecached.engine.cache import CacheClosed, CacheError, LoadError
from moecached.engine.index import open_index
from moecached.engine.readers import ReadError
from moecached.tools.synth import verify_expert_bytes

from test_cache import FileTruth, new_cache


@pytest.fixture(scope="module")
def idx(tmp_path_factory):
    return open_index(make_model(tmp_path_factory.mktemp("lifecycle"), "qwen3-30b-a3b-Q4_K_M",
                                 layers=2, experts=8))


# ---------------------------------------------------------------------------- the test oracle
def test_truth_oracle_survives_an_interleaved_read(idx):
    """The bytes a test expects must not depend on another thread's read of the same file: a
    read of expert 3 forced in between expert 2's positioning and its read (at every point where
    the oracle touches the file before reading) must leave expert 2's expected bytes exact."""
    truth = FileTruth(idx)
    layer = idx.expert_layers[0]

    class Interposer:
        """A file whose first use runs another expert's whole read in between."""

        def __init__(self, f):
            self.f, self.armed = f, True

        def _interfere(self):
            if self.armed:
                self.armed = False
                truth.get(layer, 3)

        def seek(self, *a):
            r = self.f.seek(*a)
            self._interfere()
            return r

        def fileno(self):
            self._interfere()
            return self.f.fileno()

        def read(self, *a):
            return self.f.read(*a)

        def close(self):
            self.f.close()

    truth._f = [Interposer(f) for f in truth._f]
    try:
        got = truth.get(layer, 2)
        for part, b in got.items():
            assert not verify_expert_bytes(b.tobytes(), layer, part, 2, 0), part
        assert not truth._f[0].armed   # the interleaving did happen
    finally:
        truth.close()


# ---------------------------------------------------------------------------- manual readers
class _Job:
    __slots__ = ("id", "reads", "priority", "callback", "started")

    def __init__(self, jid, reads, priority, callback):
        self.id, self.reads, self.priority, self.callback = jid, reads, priority, callback
        self.started = False


class ManualReads:
    """The reader pool's contract (submit / promote / withdraw / model_changed) with jobs that
    move only when :meth:`start`, :meth:`land` or :meth:`fail` is called. Bytes come from the
    model files with ``os.pread``, written to the job's destination addresses."""

    def __init__(self, files):
        self.model_changed = None
        self._fds = [os.open(f, os.O_RDONLY) for f in files]
        self.jobs: dict[int, _Job] = {}
        self.promotions: list[int] = []
        self._next = 1
        self.withdrawn = self.landed = 0

    def submit(self, reads, *, priority, callback):
        jid = self._next
        self._next += 1
        self.jobs[jid] = _Job(jid, list(reads), priority, callback)
        return jid

    def promote(self, job_id):
        """Noted, applied by :meth:`apply_promotions` (a reader pool takes its own lock for it:
        the cache's lock is already dropped, so anything may happen in between)."""
        self.promotions.append(job_id)
        return True

    def apply_promotions(self):
        for job_id in self.promotions:
            j = self.jobs.get(job_id)
            if j is not None and not j.started:
                j.priority = 0
        self.promotions = []

    def withdraw(self, job_id):
        j = self.jobs.get(job_id)
        if j is None or j.priority == 0 or j.started:
            return False
        del self.jobs[job_id]
        self.withdrawn += 1
        return True

    def _write(self, reads, nbytes=None):
        for fid, off, n, dest in reads:
            n = n if nbytes is None else min(n, nbytes)
            b = os.pread(self._fds[fid], n, off)
            ctypes.memmove(dest, b, len(b))

    def start(self, jid):
        """A chunk is handed to a reader: the job can no longer be withdrawn, its first bytes land."""
        j = self.jobs[jid]
        j.started = True
        self._write(j.reads[:1], 4096)

    def land(self, jid):
        j = self.jobs.pop(jid)
        self._write(j.reads)
        self.landed += 1
        j.callback(jid, None, sum(r[2] for r in j.reads), 0.0)

    def fail(self, jid, touched):
        j = self.jobs.pop(jid)
        if touched:
            j.started = True
            for fid, off, n, dest in j.reads[:1]:
                ctypes.memset(dest, 0xA5, min(n, 4096))
        e = ReadError("injected read error")
        e.dest_written = j.started
        j.callback(jid, e, 0, 0.0)

    def stats(self):
        return {}

    def latency(self):
        return {}

    def close(self):
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def manual_cache(idx, **kw):
    """A cache whose reads move only through the returned :class:`ManualReads`."""
    cache = new_cache(idx, readers=1, **kw)
    cache.readers.close()
    cache.readers = ManualReads(idx.files)
    return cache, cache.readers


@contextlib.contextmanager
def manual(idx, **kw):
    """``(cache, reads, truth)``: :func:`manual_cache` and a byte oracle, both closed after."""
    truth = FileTruth(idx)
    cache, reads = manual_cache(idx, **kw)
    try:
        yield cache, reads, truth
    finally:
        cache.close()
        truth.close()


def acquire_async(cache, layer, experts, box):
    """Start an acquire; its result lands in ``box[ticket]`` (inline when all are resident:
    then before the ticket is returned, so the lease names it)."""
    holder = {}

    def cb(res):
        box[holder.get("t", getattr(res, "id", None))] = res
    holder["t"] = t = cache.acquire_async([(layer, experts)], cb)
    return t


def check_invariants(cache, reads, truth, *, full=False):
    """Everything the life of a load promises, checked on the cache's own state (under its lock).
    ``full``: compare every byte of every published slot (else a few KiB at both ends of each
    part, where the model's per-expert stamps lie)."""
    ne = cache.n_experts
    with cache._lock:
        jobs_by_slot = {}
        for j in reads.jobs.values():
            dests = tuple(r[3] for r in j.reads)
            assert dests not in jobs_by_slot, f"two outstanding reads into one slot: jobs {j.id}, {jobs_by_slot[dests]}"
            jobs_by_slot[dests] = j.id
        loads_by_job = {}
        expect_pins = {}
        for pins in cache._leases.values():
            for pool, keys in pins:
                for k in keys:
                    expect_pins[(id(pool), k)] = expect_pins.get((id(pool), k), 0) + 1
        for req in cache._reqs.values():
            if req.state == 1:   # LOADING: its pins are held
                for pool, keys in req.pins:
                    for k in keys:
                        expect_pins[(id(pool), k)] = expect_pins.get((id(pool), k), 0) + 1
        n_loading = pf_loading = 0
        for pool in cache._pools:
            owners = {}
            for k in range(pool.n_keys):
                s = pool.alloc[k]
                if s >= 0:
                    assert s not in owners, f"slot {s} has two owners: keys {owners[s]} and {k}"
                    owners[s] = k
                    assert pool.lru.contains(k), f"key {k} holds slot {s} but is not in the LRU"
                else:
                    assert pool.res[k] < 0 and k not in pool.loading
                    assert not pool.lru.contains(k), f"absent key {k} is in the LRU"
                if pool.res[k] >= 0:
                    assert pool.res[k] == s and k not in pool.loading
                pins = expect_pins.get((id(pool), k), 0)
                if k in pool.loading:
                    load = pool.loading[k]
                    assert pool.res[k] < 0 and load.slot == s
                    pins += 1
                    n_loading += 1
                    pf_loading += not load.demanded
                    if load.job_id is not None:
                        loads_by_job[load.job_id] = load
                if pool.lru.contains(k):
                    assert pool.lru.pin_count(k) == pins, \
                        f"key {k}: {pool.lru.pin_count(k)} pins, expected {pins}"
            free, disabled = set(pool.free), set(pool.disabled)
            assert len(free) == len(pool.free) and len(disabled) == len(pool.disabled)
            assert not free & disabled and not free & set(owners) and not disabled & set(owners)
            assert len(free) + len(disabled) + len(owners) == pool.max_cap, "a slot leaked"
            for (pid, k), n in expect_pins.items():
                if pid == id(pool):
                    assert pool.alloc[k] >= 0, f"key {k} pinned {n} times by leases but absent"
            # every published slot holds exactly its expert's bytes
            for k in range(pool.n_keys):
                s = pool.res[k]
                if s < 0:
                    continue
                layer = pool.layers[k // ne]
                want = truth.get(layer, k % ne)
                for part, w in want.items():
                    v = cache.arena.view(pool.cid, s, part)
                    if full:
                        ok = np.array_equal(v, w)
                    else:
                        ok = np.array_equal(v[:4096], w[:4096]) and np.array_equal(v[-4096:], w[-4096:])
                    assert ok, f"layer {layer} expert {k % ne} published in slot {s} holds other bytes ({part})"
        for jid in reads.jobs:
            assert jid in loads_by_job, f"read job {jid} outstanding for no load"
        for jid, load in loads_by_job.items():
            if jid not in reads.jobs:
                raise AssertionError(f"load of key {load.key} waits on job {jid} that no longer exists")
        assert cache.c_inflight == n_loading
        assert cache._pf_loading == pf_loading
        assert cache.c_reads_discarded == 0


# ---------------------------------------------------------------------------- forced interleavings
def test_read_landing_after_its_slot_changed_hands_is_never_published(idx):
    """The slot's generation is part of a load: a read that lands after its slot's generation
    moved (the slot given to someone else while the read was in flight) is discarded, never
    published; its waiters fail; the slot stays with whoever holds it now."""
    cache, reads = manual_cache(idx, slots=4)
    box = {}
    layer = idx.expert_layers[0]
    try:
        t = acquire_async(cache, layer, [5], box)
        (jid,) = reads.jobs
        load = cache._layers[layer].pool.loading[cache._layers[layer].base + 5]
        reads.start(jid)
        cache._gens[load.pool.cid][load.slot] += 1     # the slot changes hands mid-read
        reads.land(jid)
        assert isinstance(box[t], LoadError) and "changed hands" in str(box[t])
        pool = load.pool
        assert pool.res[load.key] < 0 and pool.alloc[load.key] < 0
        assert cache.stats()["reads_discarded"] == 1
        assert load.slot not in pool.free   # not given out twice: its new holder keeps it
    finally:
        cache.close()


def test_withdrawn_prefetch_gives_its_victim_back_with_exact_bytes(idx):
    layer = idx.expert_layers[0]
    box = {}
    with manual(idx, slots=2, max_prefetch_loads=1) as (cache, reads, truth):
        for e in (0, 1):
            acquire_async(cache, layer, [e], box)
        for jid in list(reads.jobs):
            reads.land(jid)
        for lease in box.values():
            cache.release(lease)
        assert cache.prefetch_many([(layer, [2])], conf=[[0.2]]) == 1   # evicts expert 0
        assert cache.prefetch_many([(layer, [3])], conf=[[0.9]]) == 1   # withdraws it, evicts again
        assert reads.withdrawn == 1
        check_invariants(cache, reads, truth, full=True)
        for jid in list(reads.jobs):
            reads.land(jid)
        check_invariants(cache, reads, truth, full=True)


def test_started_prefetch_is_not_withdrawn_and_a_take_over_is_not_withdrawn(idx):
    layer = idx.expert_layers[1]
    box = {}
    with manual(idx, slots=4, max_prefetch_loads=2) as (cache, reads, truth):
        cache.prefetch_many([(layer, [0])], conf=[[0.1]])
        cache.prefetch_many([(layer, [1])], conf=[[0.2]])
        j0, j1 = sorted(reads.jobs)
        reads.start(j0)                            # started: may no longer be withdrawn
        t = acquire_async(cache, layer, [1], box)  # demand takes the other over
        reads.apply_promotions()
        assert cache.prefetch_many([(layer, [2])], conf=[[0.9]]) == 1   # the cap has room for one
        assert cache.prefetch_many([(layer, [3])], conf=[[0.9]]) == 0   # nothing may be withdrawn
        assert reads.withdrawn == 0 and {j0, j1} <= set(reads.jobs)
        assert cache.stats()["prefetches_dropped"] == 1
        check_invariants(cache, reads, truth)
        reads.land(j1)
        truth.check(cache, box[t])
        reads.land(j0)
        check_invariants(cache, reads, truth, full=True)


def test_take_over_before_its_promotion_is_never_withdrawn(idx):
    """A demand takes a queued prefetch read over; before the reader pool hears of the promotion
    (the cache's lock is already dropped) a prefetch of higher confidence arrives at the cap:
    the withdrawal must pick another queued read, never the one the demand waits for."""
    layer = idx.expert_layers[0]
    box = {}
    with manual(idx, slots=6, max_prefetch_loads=2) as (cache, reads, truth):
        cache.prefetch_many([(layer, [0])], conf=[[0.1]])
        cache.prefetch_many([(layer, [1])], conf=[[0.2]])
        ja, jb = sorted(reads.jobs)
        t = acquire_async(cache, layer, [0], box)       # takes ja over; promotion not applied yet
        assert reads.promotions == [ja] and reads.jobs[ja].priority == 1
        assert cache.prefetch_many([(layer, [2])], conf=[[0.5]]) == 1
        assert cache.prefetch_many([(layer, [3])], conf=[[0.9]]) == 1   # withdraws jb (0.2)
        assert ja in reads.jobs and jb not in reads.jobs and reads.withdrawn == 1
        check_invariants(cache, reads, truth)
        reads.apply_promotions()
        reads.land(ja)
        truth.check(cache, box[t])
        for jid in list(reads.jobs):
            reads.land(jid)
        check_invariants(cache, reads, truth, full=True)


def test_withdrawal_that_gives_back_the_expert_being_prefetched(idx):
    """Found by the stateful search: at the cap, a prefetch of expert X withdraws a queued read
    whose victim was X itself, so X is resident again in its old slot; the prefetch must then
    not start a second load of X into a free slot (that left X owning two slots, the LRU
    refusing the key half-way through, and a later hit served from the wrong slot)."""
    layer0, layer1 = idx.expert_layers
    slot_bytes = idx.size_classes[0].slot_bytes
    with manual(idx, slots=3, max_prefetch_loads=2) as (cache, reads, truth):
        cache.set_budget(2 * slot_bytes + 8192)            # 2 of 3 slots
        assert cache.prefetch_many([(layer1, [6])], conf=[[0.0]]) == 1
        reads.land(max(reads.jobs))                       # X = layer 1 expert 6, resident, unused
        assert cache.prefetch_many([(layer0, [0])], conf=[[0.0]]) == 1
        reads.start(max(reads.jobs))                      # started: cannot be withdrawn
        assert cache.prefetch_many([(layer0, [1])], conf=[[0.0]]) == 1   # evicts X for its slot
        x_slot = cache._layers[layer1].pool.loading[cache._layers[layer0].base + 1].slot
        cache.set_budget(3 * slot_bytes + 8192)            # a free slot again
        assert cache.prefetch_many([(layer1, [6])], conf=[[1.0]]) == 0   # withdraws; X is back
        assert reads.withdrawn == 1
        pool = cache._layers[layer1].pool
        assert pool.res[cache._layers[layer1].base + 6] == x_slot
        check_invariants(cache, reads, truth, full=True)
        box = {}
        t = acquire_async(cache, layer1, [6], box)
        truth.check(cache, box[t])
        assert box[t].items[0][3] == x_slot


# ---------------------------------------------------------------------------- stateful search
class LoadLife(RuleBasedStateMachine):
    """Acquire, prefetch with confidence (withdrawals at a cap of 2), release, cancel, shrink and
    grow, with reads starting, landing and failing in any order; invariants after each step."""

    idx = None
    truth = None
    seen = None   # collections.Counter over every run: what the search exercised

    def __init__(self):
        super().__init__()
        self.cache, self.reads = manual_cache(self.idx, slots=5, max_prefetch_loads=2)
        self.box = {}
        self.tickets = []
        self.layers = list(self.idx.expert_layers)
        self.ne = self.idx.n_experts
        self.slot_bytes = self.idx.size_classes[0].slot_bytes

    def teardown(self):
        st_ = self.cache.stats()
        self.seen.update(withdrawn=self.reads.withdrawn, landed=self.reads.landed,
                         take_overs=st_["prefetch_hits"], evictions=st_["evictions"],
                         read_errors=st_["read_errors"], shrinks=st_["shrink_events"],
                         grows=st_["grow_events"])
        self.cache.close()

    @rule(layer=st.integers(0, 1), experts=st.lists(st.integers(0, 7), min_size=1, max_size=3,
                                                     unique=True))
    def acquire(self, layer, experts):
        self.tickets.append(acquire_async(self.cache, self.layers[layer], experts, self.box))

    @rule(data=st.data())
    def prefetch(self, data):
        req = data.draw(st.lists(st.tuples(st.integers(0, 1), st.lists(
            st.integers(0, 7), min_size=1, max_size=3, unique=True)), min_size=1, max_size=2,
            unique_by=lambda t: t[0]))
        conf = [[data.draw(st.floats(0, 1)) for _ in ex] for _, ex in req]
        self.cache.prefetch_many([(self.layers[l], ex) for l, ex in req], conf=conf)

    @precondition(lambda self: any(hasattr(v, "items") for v in self.box.values()))
    @rule(data=st.data())
    def release(self, data):
        held = [t for t, v in self.box.items() if hasattr(v, "items")]
        t = data.draw(st.sampled_from(sorted(held)))
        lease = self.box.pop(t)
        self.truth.check(self.cache, lease)        # still exact while it was held
        self.cache.release(lease)

    @precondition(lambda self: bool(self.reads.jobs))
    @rule(data=st.data(), what=st.sampled_from(["start", "land", "land", "land", "fail", "fail_touched"]))
    def read(self, data, what):
        jid = data.draw(st.sampled_from(sorted(self.reads.jobs)))
        if what == "start":
            if not self.reads.jobs[jid].started:
                self.reads.start(jid)
        elif what == "land":
            self.reads.land(jid)
        else:
            self.reads.fail(jid, what == "fail_touched")

    @precondition(lambda self: bool(self.reads.promotions))
    @rule()
    def promote(self):
        self.reads.apply_promotions()

    @precondition(lambda self: bool(self.tickets))
    @rule(data=st.data())
    def cancel(self, data):
        t = data.draw(st.sampled_from(self.tickets))
        self.tickets.remove(t)
        self.cache.cancel(t)

    @rule(n=st.integers(1, 5))
    def budget(self, n):
        try:
            self.cache.set_budget(n * self.slot_bytes + 8192)
        except CacheError:
            pass

    @invariant()
    def leases_hold_their_bytes(self):
        for t, v in list(self.box.items()):
            if hasattr(v, "items"):
                if t in self.tickets:
                    self.tickets.remove(t)
                self.truth.check(self.cache, v)
            else:
                assert isinstance(v, (LoadError, CacheClosed)), v
                assert "injected" in str(v), v
                self.box.pop(t)
                if t in self.tickets:
                    self.tickets.remove(t)

    @invariant()
    def state_is_consistent(self):
        check_invariants(self.cache, self.reads, self.truth)


def test_life_of_a_load_stateful(idx):
    truth = FileTruth(idx)
    LoadLife.idx, LoadLife.truth, LoadLife.seen = idx, truth, collections.Counter()
    try:
        run = LoadLife.TestCase
        run.settings = settings(max_examples=int(os.environ.get("MOECACHED_LIFECYCLE_EXAMPLES", "300")),
                                stateful_step_count=40, deadline=None, derandomize=True,
                                suppress_health_check=list(HealthCheck))
        run().runTest()
    finally:
        truth.close()
    print("stateful search exercised:", dict(LoadLife.seen))
    for what in ("withdrawn", "landed", "take_overs", "evictions", "read_errors", "shrinks", "grows"):
        assert LoadLife.seen[what] > 0, (what, dict(LoadLife.seen))


def test_concurrent_truth_reads_agree(idx):
    """Threads sharing one oracle each get their own expert's bytes (the oracle the concurrent
    cache tests share)."""
    truth = FileTruth(idx)
    keys = [(l, e) for l in idx.expert_layers for e in range(idx.n_experts)]
    errs = []

    def go(ks):
        try:
            for l, e in ks:
                for part, b in truth.get(l, e).items():
                    r = verify_expert_bytes(b.tobytes(), l, part, e, 0)
                    if r:
                        errs.append(r)
        except Exception as ex:   # reported below
            errs.append(repr(ex))
    ts = [threading.Thread(target=go, args=(keys[i::3],)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    truth.close()
    assert not errs, errs[:3]
