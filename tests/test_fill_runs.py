"""Warm fills read runs of consecutive experts as one job (``fill_run``): one read per part over
the run's slots, the bytes of every expert still exactly the file's; a run is never withdrawn,
a demand for one of its experts promotes it, and a failed run fails each of its loads and gives
their slots back."""
import threading

import pytest

from daemon_util import Gate
from fixtures import file_bytes
from moecached.engine import readers as readers_mod
from moecached.engine.cache import ExpertCache
from moecached.engine.index import open_index
from moecached.engine.readers import ReaderPool
from moecached.engine.warmth import WarmFill


@pytest.fixture
def model(model_factory):
    # 4 blocks x 16 experts of real Qwen3-30B-A3B Q4_K_M sizes (two size classes)
    return model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 7, 8], experts=16)


def _resident_bytes_ok(cache, idx, pairs) -> None:
    """Every expert of ``pairs`` is resident and its slot holds the file's bytes, part by part."""
    for layer, expert in pairs:
        L = cache._layers[layer]
        slot = L.pool.res[L.base + expert]
        assert slot >= 0, (layer, expert)
        for part, data in file_bytes(idx, layer, expert).items():
            got = cache.arena.view(L.cid, slot, part).tobytes()
            assert got == data, (layer, expert, part)


def _everything(idx):
    return [(l, e) for l in idx.expert_layers for e in range(int(idx.n_experts))]


def _cache(idx, tmp_path, slots, **kw):
    return ExpertCache(idx, slots=slots, readers=4, lock_memory=False, arena_dir=str(tmp_path),
                       chunk_bytes=64 << 10, **kw)


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_whole_model_fill_reads_runs_and_every_byte_is_the_files(model, tmp_path, io):
    """A whole-model fill with runs: far fewer read jobs than experts, every expert's bytes
    exactly the file's (two size classes, parts cut into chunks across expert boundaries),
    read with O_DIRECT or through the page cache's read-ahead."""
    idx = open_index(model)
    allx = _everything(idx)
    with _cache(idx, tmp_path, len(allx), max_prefetch_loads=16) as cache:
        f = WarmFill(cache, allx, run_bytes=64 << 20, run_io=io).start()
        assert f.join(60) and f.done == len(allx), (f.done, len(allx))
        st = cache.stats()
        # a run ends at a layer's end and at a run's size: a few experts may be read alone
        assert st["run_loads"] >= len(allx) * 3 // 4 and 0 < st["run_reads"] <= len(allx) // 2, st
        assert st["reads"] == len(allx) and st["read_errors"] == 0
        _resident_bytes_ok(cache, idx, allx)


def test_without_runs_each_expert_is_its_own_read(model, tmp_path):
    """``fill_run`` 0: one read job per expert, as before (no run counted)."""
    idx = open_index(model)
    allx = _everything(idx)[:24]
    with _cache(idx, tmp_path, len(_everything(idx))) as cache:
        f = WarmFill(cache, allx, run_bytes=0).start()
        assert f.join(60) and f.done == len(allx)
        st = cache.stats()
        assert st["run_reads"] == 0 and st["run_loads"] == 0
        _resident_bytes_ok(cache, idx, allx)


def test_runs_join_only_neighbours_within_the_run_size(model, tmp_path):
    """Experts 1-3 and 7-8 of a layer: two runs (a gap ends one), each no larger than the run
    size; a run size below two experts reads one expert per job."""
    idx = open_index(model)
    layer = idx.expert_layers[1]
    wanted = [(layer, e) for e in (1, 2, 3, 7, 8)]
    with _cache(idx, tmp_path, 64, max_prefetch_loads=16) as cache:
        f = WarmFill(cache, wanted, run_bytes=64 << 20).start()
        assert f.join(30) and f.done == 5
        st = cache.stats()
        assert (st["run_reads"], st["run_loads"]) == (2, 5), st
        _resident_bytes_ok(cache, idx, wanted)
    one = sum(s.nbytes for s in idx.parts(layer, 0))
    with _cache(idx, tmp_path, 64, max_prefetch_loads=16) as cache:
        f = WarmFill(cache, wanted, run_bytes=one + one // 2).start()
        assert f.join(30) and f.done == 5
        st = cache.stats()
        assert (st["run_reads"], st["run_loads"]) == (0, 0), st
        _resident_bytes_ok(cache, idx, wanted)


def test_a_demand_for_an_expert_of_a_queued_run_promotes_it(model, tmp_path, monkeypatch):
    """An acquire of an expert whose run is queued (reads held back) takes the load over; once
    the reads go, it gets the file's bytes and the run's other experts land too."""
    idx = open_index(model)
    layer = idx.expert_layers[0]
    wanted = [(layer, e) for e in range(8)]
    gate = Gate(readers_mod.read_many)
    monkeypatch.setattr(readers_mod, "read_many", gate)
    with _cache(idx, tmp_path, 64, max_prefetch_loads=16) as cache:
        f = WarmFill(cache, wanted, run_bytes=64 << 20).start()
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("lease", cache.acquire(layer, [5], timeout=30)))
        import time
        deadline = time.monotonic() + 10
        while cache.stats()["run_loads"] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        t.start()
        time.sleep(0.2)
        gate.ev.set()
        t.join(30)
        assert f.join(30) and f.done == 8
        lease = got["lease"]
        cache.release(lease)
        st = cache.stats()
        assert st["run_loads"] == 8 and st["demand_misses"] + st["prefetch_hits"] >= 1, st
        _resident_bytes_ok(cache, idx, wanted)


def test_two_runs_are_in_flight_past_the_prefetch_cap(model, tmp_path, monkeypatch):
    """With runs the fill keeps two of them queued (one reads while the next waits, so the
    drive's queue does not drain between runs), past the cache's prefetch cap (4 here: before,
    the window was half the cap, two experts, and no run formed); its window is two runs."""
    import time
    idx = open_index(model)
    allx = _everything(idx)
    gate = Gate(readers_mod.read_many)
    monkeypatch.setattr(readers_mod, "read_many", gate)
    with _cache(idx, tmp_path, len(allx), max_prefetch_loads=4) as cache:
        f = WarmFill(cache, allx, run_bytes=64 << 20).start()
        deadline = time.monotonic() + 10
        while cache.stats()["run_reads"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        st = cache.stats()
        assert st["run_reads"] >= 2 and 4 < st["prefetch_loads_in_flight"] <= f.window, st
        assert f.window >= 2 * f.group and f.group > 4, (f.window, f.group)
        gate.ev.set()
        assert f.join(60) and f.done == len(allx)
        _resident_bytes_ok(cache, idx, allx)


def _mapped_bytes(addr: int) -> int:
    """Rss of this process's mapping that holds ``addr`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("Rss:"):
                return int(head[1]) * 1024
    return 0


def test_runs_map_their_slots_ahead_of_the_readers(model, tmp_path, monkeypatch):
    """An unlocked arena's pages are mapped on first use, by the O_DIRECT reads one page at a
    time; a fill maps each run's slots when it queues the run, so with every read held back
    the queued runs' slots are mapped already."""
    import time
    idx = open_index(model)
    allx = _everything(idx)
    gate = Gate(readers_mod.read_many)
    monkeypatch.setattr(readers_mod, "read_many", gate)
    with _cache(idx, tmp_path, len(allx), max_prefetch_loads=16) as cache:
        before = _mapped_bytes(cache.arena.base_address + cache.arena.size - 1)
        f = WarmFill(cache, allx, run_bytes=64 << 20).start()
        deadline = time.monotonic() + 10
        while cache.stats()["run_reads"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        one = min(sum(s.nbytes for s in idx.parts(l, 0)) for l in idx.expert_layers)
        # a run is counted in flight as it is queued, its slots mapped right after: under load
        # the two are looked at again until they agree (every read is still held back)
        deadline = time.monotonic() + 10
        while True:
            time.sleep(0.2)
            queued = cache.stats()["prefetch_loads_in_flight"]
            mapped = _mapped_bytes(cache.arena.base_address + cache.arena.size - 1) - before
            ok = mapped >= queued * one * 9 // 10 and f.populated >= queued * one * 9 // 10
            if ok or time.monotonic() > deadline:
                break
        assert queued >= 2 and ok, (queued, mapped, f.populated, queued * one)
        gate.ev.set()
        assert f.join(60) and f.done == len(allx)
        _resident_bytes_ok(cache, idx, allx)


def test_a_shared_job_is_never_withdrawn(model, tmp_path):
    """ReaderPool.withdraw refuses a job that reads for several loads (it would take back all
    of them), and takes back an ordinary queued prefetch job."""
    idx = open_index(model)
    gate = Gate(readers_mod.read_many)
    import mmap
    buf = mmap.mmap(-1, 1 << 20)
    import ctypes
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    with ReaderPool(idx.files, threads=1, file_sizes=idx.file_sizes,
                    file_mtimes_ns=idx.file_mtimes_ns) as pool:
        pool.queue._pf_max = 0  # hold every prefetch chunk back: both jobs stay queued
        done = []
        j1 = pool.submit([(0, 0, 4096, addr)], priority=1, callback=lambda *a: done.append(a), shared=True)
        j2 = pool.submit([(0, 4096, 4096, addr + 4096)], priority=1, callback=lambda *a: done.append(a))
        assert pool.withdraw(j1) is False
        assert pool.withdraw(j2) is True
        with pool.queue._cond:
            pool.queue._pf_max = 1
            pool.queue._cond.notify_all()
        import time
        deadline = time.monotonic() + 10
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [d[0] for d in done] == [j1] and done[0][1] is None
    del gate
    with open(idx.files[0], "rb") as fh:
        assert bytes(buf[:4096]) == fh.read(4096)


def test_a_failed_run_fails_each_load_and_gives_the_slots_back(model, tmp_path, monkeypatch):
    """A run whose read fails publishes none of its experts and frees their slots; the next
    fill reads them again, byte for byte."""
    idx = open_index(model)
    layer = idx.expert_layers[2]
    wanted = [(layer, e) for e in range(6)]
    real = readers_mod.read_many
    fail = {"on": True}

    def broken(chunks, *a):
        if fail["on"]:
            return 0, -5   # EIO on the first chunk
        return real(chunks, *a)
    monkeypatch.setattr(readers_mod, "read_many", broken)
    with _cache(idx, tmp_path, 64, max_prefetch_loads=16) as cache:
        f = WarmFill(cache, wanted, run_bytes=64 << 20, passes=1).start()
        assert f.join(30)
        st = cache.stats()
        assert st["run_loads"] >= 2 and st["read_errors"] >= 2 and f.done == 0, st
        assert sum(c["used"] for c in st["classes"]) == 0, st["classes"]
        for l, e in wanted:
            L = cache._layers[l]
            assert L.pool.res[L.base + e] < 0 and L.pool.alloc[L.base + e] < 0
        fail["on"] = False
        f = WarmFill(cache, wanted, run_bytes=64 << 20).start()
        assert f.join(30) and f.done == len(wanted)
        _resident_bytes_ok(cache, idx, wanted)


def test_buffered_runs_leave_no_copy_in_the_page_cache(model, tmp_path):
    """``fill_io = "buffered"``: the runs' pages are dropped from the page cache once copied
    (the experts' bytes live in the arena only), and the bytes are the file's."""
    import mmap
    import os
    import time
    from moecached.engine.warmth import DROP_AGAIN_S
    idx = open_index(model)
    layer = idx.expert_layers[0]
    wanted = [(layer, e) for e in range(16)]
    fd = os.open(idx.files[0], os.O_RDONLY)
    os.fsync(fd)   # just written: clean pages only, which DONTNEED drops
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    spans = [s for e in range(16) for s in idx.parts(layer, e)]
    lo, hi = min(s.offset for s in spans), max(s.offset + s.nbytes for s in spans)
    with _cache(idx, tmp_path, 64, max_prefetch_loads=16) as cache:
        f = WarmFill(cache, wanted, run_bytes=64 << 20, run_io="buffered").start()
        assert f.join(30) and f.done == 16 and cache.stats()["run_loads"] == 16
        time.sleep(2 * DROP_AGAIN_S)
        cached = _cached_pages(fd, lo, hi)   # before the check below reads the file itself
        _resident_bytes_ok(cache, idx, wanted)
    os.close(fd)
    # the experts' pages are gone, also what the read-ahead brought back behind the chunks
    # and past each run's end (dropping each chunk alone left 80 % here)
    assert cached * mmap.PAGESIZE < (hi - lo) // 50, (cached, (hi - lo) // mmap.PAGESIZE)


def _cached_pages(fd, lo, hi) -> int:
    """Pages of bytes lo..hi of the file at ``fd`` in the page cache now (mincore)."""
    import ctypes
    import mmap
    m = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)   # writable for ctypes, never written
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        a, b = (lo // page) * page, -(-hi // page) * page
        vec = (ctypes.c_ubyte * ((b - a) // page))()
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        assert libc.mincore(ctypes.c_void_p(base + a), ctypes.c_size_t(b - a), vec) == 0
        del base
        return sum(v & 1 for v in vec)
    finally:
        m.close()


def test_fill_run_is_a_config_key_read_by_the_fill():
    """``fill_run``: a size (0 turns runs off), on the command line and in the file, changed
    live (read when a fill starts); ``fill_io``: direct or buffered, the same way."""
    from moecached.daemon import config as C
    io = C.KEYS["fill_io"]
    assert io.flag == "--fill-io" and io.reload == "read_when_used"
    assert io.check("buffered") == "buffered" and C.Config.__dataclass_fields__["fill_io"].default == "direct"
    key = C.KEYS["fill_run"]
    assert key.flag == "--fill-run" and key.reload == "read_when_used"
    assert key.check("16MiB") == 16 << 20 and key.check(0) == 0
    from moecached.daemon.confvalues import _Bad
    with pytest.raises(_Bad):
        key.check("2GiB")
    assert C.Config.__dataclass_fields__["fill_run"].default == 64 << 20
