"""Reader pool: bit-exact loads (unaligned, split files), O_DIRECT fallback, truncation, priority."""
import errno
import re
import logging
import mmap
import os
import subprocess
import tempfile
import threading
import time

import numpy as np
import pytest

from moecached.engine import readers as readers_mod
from moecached.engine.readers import ModelChanged, ReadError, ReaderPool


def per_chunk(fn):
    """A stand-in for ``readers.read_many`` built from a per-chunk ``read_chunk``-like function."""
    def many(chunks, fds, aligns, directs, bounce, bb):
        for i, (fid, off, n, dest) in enumerate(chunks):
            r = fn(fds[fid], off, n, dest, bounce, bb, aligns[fid], directs[fid])
            if r != n:
                return i, r
        return len(chunks), 0
    return many


class Waiter:
    """Collects callbacks; wait(jid) returns (error, nbytes, seconds)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.done = {}
        self.order = []
        self.calls = {}

    def __call__(self, jid, err, nbytes, secs):
        with self.cond:
            self.calls[jid] = self.calls.get(jid, 0) + 1
            self.done[jid] = (err, nbytes, secs)
            self.order.append(jid)
            self.cond.notify_all()

    def wait(self, jid, timeout=30):
        with self.cond:
            assert self.cond.wait_for(lambda: jid in self.done, timeout), f"job {jid} never finished"
            return self.done[jid]


def write_random(path, size, seed):
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    data.tofile(path)
    return data


class Dest:
    """An mmap'd destination buffer with a raw address."""

    def __init__(self, n):
        self.buf = mmap.mmap(-1, max(n, 1))
        self.arr = np.frombuffer(self.buf, dtype=np.uint8)
        self.addr = self.arr.ctypes.data


@pytest.fixture
def files(tmp_path):
    """A "split" model: two files of random bytes, on tmp_path (a disk filesystem: O_DIRECT)."""
    d = str(tmp_path)
    paths, datas = [], []
    for i, size in enumerate([3 * 2**20 + 1234, 1 * 2**20 + 96]):  # a "split" model: two files
        p = os.path.join(d, f"model-{i:05d}-of-00002.gguf")
        datas.append(write_random(p, size, i))
        paths.append(p)
    yield paths, datas


def random_reads(datas, rng, n, dest_size):
    """Random (fid, off, nbytes, dest_off) with 32-byte-aligned-ish and odd offsets/lengths."""
    out, pos = [], 0
    for _ in range(n):
        fid = int(rng.integers(len(datas)))
        size = len(datas[fid])
        ln = int(rng.choice([1, 31, 32, 4096, 4097, 65536 + 32, 300_000, 600_001]))
        ln = min(ln, size)
        off = int(rng.integers(0, size - ln + 1))
        if rng.random() < 0.5:
            off = off // 32 * 32
        if pos + ln > dest_size:
            break
        out.append((fid, off, ln, pos))
        pos += ln + int(rng.integers(0, 100))
    return out


@pytest.mark.parametrize("chunk", [4096, 64 * 1024, 256 * 1024])
def test_bit_exact_unaligned_split(files, chunk):
    paths, datas = files
    rng = np.random.default_rng(chunk)
    dest = Dest(8 * 2**20)
    w = Waiter()
    with ReaderPool(paths, threads=4, chunk_bytes=chunk) as pool:
        assert all(pool.stats()["direct"]), "test files should be on an O_DIRECT filesystem"
        jobs = []
        for _ in range(6):
            reads = random_reads(datas, rng, 8, 8 * 2**20)
            # jobs write disjoint areas: offset each job's dests
            jobs.append((reads, pool.submit([(f, o, n, dest.addr + d) for f, o, n, d in reads],
                                            priority=int(rng.integers(2)), callback=w)))
            err, nbytes, secs = w.wait(jobs[-1][1])
            assert err is None and nbytes == sum(r[2] for r in reads) and secs >= 0
            for f, o, n, d in reads:
                assert np.array_equal(dest.arr[d:d + n], datas[f][o:o + n]), (f, o, n, d)
        # an aligned read into an aligned dest goes straight in (and must be right too)
        jid = pool.submit([(0, 8192, 65536, dest.addr)], priority=0, callback=w)
        assert w.wait(jid)[0] is None
        assert np.array_equal(dest.arr[:65536], datas[0][8192:8192 + 65536])
        # the tail of the file (widened read crosses EOF)
        size = len(datas[0])
        jid = pool.submit([(0, size - 777, 777, dest.addr + 5)], priority=0, callback=w)
        assert w.wait(jid)[0] is None
        assert np.array_equal(dest.arr[5:5 + 777], datas[0][-777:])
        st = pool.stats()
        assert st["jobs"] == 8 and st["in_flight"] == 0 and st["bytes"] > 0
        assert sum(st["latency_hist"]) == 8 and st["p50_s"] is not None
    assert all(c == 1 for c in w.calls.values())


def test_empty_job_and_bad_reads(files):
    paths, _ = files
    w = Waiter()
    with ReaderPool(paths, threads=2) as pool:
        jid = pool.submit([], priority=0, callback=w)
        assert w.wait(jid)[:2] == (None, 0)
        with pytest.raises(ReadError, match="file ids are 0..1"):
            pool.submit([(5, 0, 10, 1)], priority=0, callback=w)
        with pytest.raises(ReadError, match="priority"):
            pool.submit([], priority=3, callback=w)


def test_many_concurrent_jobs_bit_exact(files):
    paths, datas = files
    rng = np.random.default_rng(7)
    per = 70_000
    dest = Dest(200 * per)
    w = Waiter()
    want = []
    with ReaderPool(paths, threads=16, chunk_bytes=16384) as pool:
        for j in range(200):
            f = int(rng.integers(2))
            o = int(rng.integers(0, len(datas[f]) - per)) // 32 * 32
            want.append((pool.submit([(f, o, per, dest.addr + j * per)], priority=j % 2, callback=w),
                         f, o, j))
        for jid, f, o, j in want:
            assert w.wait(jid)[0] is None
            assert np.array_equal(dest.arr[j * per:(j + 1) * per], datas[f][o:o + per])


def _ramfs_dir():
    if os.geteuid() != 0:
        pytest.skip("needs root to mount ramfs")
    d = tempfile.mkdtemp()
    r = subprocess.run(["mount", "-t", "ramfs", "-o", "size=64m", "ramfs", d], capture_output=True)
    if r.returncode:
        os.rmdir(d)
        pytest.skip("cannot mount ramfs: " + r.stderr.decode().strip())
    return d


def test_odirect_refused_falls_back_with_one_warning(caplog):
    """ramfs refuses O_DIRECT at open (tmpfs accepts it on Linux >= 6.6): buffered, still exact."""
    d = _ramfs_dir()
    try:
        paths = [os.path.join(d, "a.gguf"), os.path.join(d, "b.gguf")]
        datas = [write_random(p, 2**20 + 333, i) for i, p in enumerate(paths)]
        dest = Dest(2**21)
        w = Waiter()
        with caplog.at_level(logging.WARNING, logger="moecached.engine.readers"):
            with ReaderPool(paths, threads=3, chunk_bytes=8192) as pool:
                assert pool.stats()["direct"] == [False, False]
                jid = pool.submit([(0, 33, 500_000, dest.addr + 1), (1, 4097, 300_000, dest.addr + 600_000)],
                                  priority=0, callback=w)
                assert w.wait(jid)[0] is None
        assert np.array_equal(dest.arr[1:500_001], datas[0][33:500_033])
        assert np.array_equal(dest.arr[600_000:900_000], datas[1][4097:304_097])
        warns = [r for r in caplog.records if "O_DIRECT refused" in r.getMessage()]
        assert len(warns) == 1
    finally:
        subprocess.run(["umount", d])
        os.rmdir(d)


def test_odirect_on_dev_shm_is_correct(tmp_path):
    """/dev/shm: O_DIRECT refused on old kernels, accepted on new ones; either way bytes are exact."""
    p = os.path.join("/dev/shm", f"moecached-test-{os.getpid()}.gguf")
    try:
        data = write_random(p, 2**20 + 5, 3)
        dest = Dest(2**20)
        w = Waiter()
        with ReaderPool([p], threads=2, chunk_bytes=65536) as pool:
            jid = pool.submit([(0, 100, 900_000, dest.addr + 3)], priority=0, callback=w)
            assert w.wait(jid)[0] is None
        assert np.array_equal(dest.arr[3:900_003], data[100:900_100])
    finally:
        os.unlink(p)


def test_odirect_refused_at_first_read(files, monkeypatch, caplog):
    """Some filesystems open O_DIRECT but fail the read with EINVAL: switch to buffered once."""
    paths, datas = files
    real = readers_mod.read_chunk
    calls = {"n": 0}

    def fake(fd, off, n, dest, bounce, bb, align, direct):  # noqa: PLR0913
        if direct:
            calls["n"] += 1
            return -errno.EINVAL
        return real(fd, off, n, dest, bounce, bb, align, direct)

    monkeypatch.setattr(readers_mod, "read_many", per_chunk(fake))
    dest = Dest(2**20)
    w = Waiter()
    with caplog.at_level(logging.WARNING, logger="moecached.engine.readers"):
        with ReaderPool(paths, threads=4, chunk_bytes=4096) as pool:
            jid = pool.submit([(0, 32, 200_000, dest.addr)], priority=0, callback=w)
            assert w.wait(jid)[0] is None
            assert pool.stats()["direct"] == [False, True]
    assert np.array_equal(dest.arr[:200_000], datas[0][32:200_032])
    assert len([r for r in caplog.records if "O_DIRECT refused" in r.getMessage()]) == 1


def test_truncated_mid_run_fails_every_later_load(files):
    """A file shrinks under the running pool: the load fails with ModelChanged (not an I/O
    error), and from then on every load of the model, of any of its files, is refused."""
    paths, datas = files
    dest = Dest(2 * 2**20)
    w = Waiter()
    with ReaderPool(paths, threads=4, chunk_bytes=65536) as pool:
        jid = pool.submit([(0, 2**20, 2**20, dest.addr)], priority=0, callback=w)
        assert w.wait(jid)[0] is None
        os.truncate(paths[0], 2**20 + 100)  # the file shrinks under the running daemon
        bad = pool.submit([(0, 2**20 - 32, 500_000, dest.addr)], priority=0, callback=w)
        err = w.wait(bad)[0]
        assert isinstance(err, ModelChanged)
        msg = str(err)
        assert paths[0] in msg and "size changed" in msg
        assert err.dest_written is False  # refused before any chunk was read
        assert msg.startswith(pool.model_changed)
        with pytest.raises(ModelChanged, match="size changed"):
            pool.submit([(1, 96, 300_000, dest.addr + 2**20)], priority=0, callback=w)
        with pytest.raises(ReadError, match="size changed"):
            pool.check_files()
        assert pool.stats()["errors"] == 0
    assert w.calls[bad] == 1


def test_short_read_vs_index_size(files):
    """The index claims a bigger file than is there: the load fails with a short-read error."""
    paths, datas = files
    with pytest.raises(ReadError, match="size changed"):
        ReaderPool(paths, file_sizes=[len(datas[0]) + 10, len(datas[1])])
    # with the sizes right but a read past EOF: short read, named as such
    dest = Dest(2**20)
    w = Waiter()
    with ReaderPool(paths, threads=2) as pool:
        jid = pool.submit([(1, len(datas[1]) - 100, 200, dest.addr)], priority=0, callback=w)
        err = w.wait(jid)[0]
        assert isinstance(err, ReadError) and "short read" in str(err)
        assert re.search(r"got 100 of 200 bytes", str(err)), err


def test_demand_overtakes_queued_prefetch_and_promote(files):
    paths, datas = files
    dest = Dest(64 * 2**20)
    w = Waiter()
    gate = threading.Event()
    blocked = []

    def slow_cb(jid, err, n, s):
        blocked.append(jid)
        gate.wait(10)  # the single reader thread is held here: queue builds up behind it
        w(jid, err, n, s)

    with ReaderPool(paths, threads=1, chunk_bytes=4096) as pool:
        first = pool.submit([(0, 0, 4096, dest.addr)], priority=0, callback=slow_cb)
        deadline = time.time() + 10
        while not blocked and time.time() < deadline:
            time.sleep(0.001)
        pre = [pool.submit([(0, 4096 * i, 40_000, dest.addr + 2**20 * i)], priority=1, callback=w)
               for i in range(1, 5)]
        dem = [pool.submit([(1, 4096 * i, 40_000, dest.addr + 2**20 * (10 + i))], priority=0, callback=w)
               for i in range(2)]
        st = pool.stats()
        assert st["queued_prefetch"] == 4 and st["queued_demand"] == 2
        assert pool.promote(pre[2]) is True
        assert pool.promote(pre[2]) is False      # already demand
        assert pool.promote(dem[0]) is False      # demand already
        assert pool.promote(first) is False       # running
        assert pool.promote(12345) is False       # unknown
        gate.set()
        for j in pre + dem:
            assert w.wait(j)[0] is None
    order = [j for j in w.order if j != first]
    assert order[:3] == [dem[0], dem[1], pre[2]], (order, dem, pre)
    assert order[3:] == [pre[0], pre[1], pre[3]]
    for i in range(1, 5):
        assert np.array_equal(dest.arr[2**20 * i:2**20 * i + 40_000], datas[0][4096 * i:4096 * i + 40_000])


def test_close_fails_pending_jobs(files):
    paths, _ = files
    dest = Dest(2**20)
    w = Waiter()
    gate = threading.Event()
    started = threading.Event()

    def slow(jid, err, n, s):
        started.set()
        gate.wait(10)
        w(jid, err, n, s)

    pool = ReaderPool(paths, threads=1, chunk_bytes=4096)
    pool.submit([(0, 0, 4096, dest.addr)], priority=0, callback=slow)
    started.wait(10)
    pending = [pool.submit([(0, 0, 100_000, dest.addr)], priority=1, callback=w) for _ in range(3)]
    threading.Timer(0.2, gate.set).start()
    pool.close()
    for j in pending:
        err = w.wait(j)[0]
        assert isinstance(err, ReadError) and "closed" in str(err)
    with pytest.raises(ReadError, match="closed"):
        pool.submit([], priority=0, callback=w)
    assert all(c == 1 for c in w.calls.values())


# ---- real layouts: index -> arena slots -> readers -> stamped bytes verified ----------------

REAL = [("deepseek-v2-lite-Q4_K_M", dict(layers=4, experts=8, split=2)),   # two size classes, split
        ("qwen3-30b-a3b-Q4_K_M", dict(layers=3, experts=8, split=3)),
        ("gpt-oss-20b-MXFP4", dict(layers=2, experts=4)),                  # per-expert biases (tiny parts)
        ("qwen3-next-80b-a3b-Q4_K_M-fused-gate-up", dict(layers=2, experts=4)),
        ("mixtral-8x7b-Q4_K_M", dict(layers=1, experts=2, legacy=True))]   # per-expert tensors


@pytest.mark.parametrize("name,kw", REAL, ids=[r[0] for r in REAL])
def test_real_layout_into_arena_slots(model_factory, name, kw, tmp_path):
    from moecached.engine.arena import Arena
    from moecached.engine.index import open_index
    from moecached.tools.synth import verify_expert_bytes

    idx = open_index(model_factory(name, **kw))
    with Arena(idx, slots=max(4 * len(idx.size_classes), idx.n_experts * len(idx.expert_layers) // 2),
               dir=str(tmp_path), lock=False) as ar, \
            ReaderPool(idx.files, threads=8, chunk_bytes=64 * 1024, file_sizes=idx.file_sizes,
                       file_mtimes_ns=idx.file_mtimes_ns) as pool:
        w = Waiter()
        placed = []  # (layer, expert, class, slot, job)
        next_slot = {c.id: 0 for c in ar.classes}
        rng = np.random.default_rng(1)
        for layer in idx.expert_layers:
            cid = idx.layer_class[layer]
            lay = ar.layout(cid)
            offs, fids = idx.part_table(layer)
            for e in rng.permutation(idx.n_experts)[:3]:
                slot = next_slot[cid] % lay.n_slots
                next_slot[cid] += 1
                placed = [p for p in placed if (p[2], p[3]) != (cid, slot)]
                reads = [(int(fids[e, j]), int(offs[e, j]), lay.part_bytes[p],
                          ar.base_address + ar.part_offset(cid, slot, p)) for j, p in enumerate(lay.parts)]
                jid = pool.submit(reads, priority=int(e) % 2, callback=w)
                assert w.wait(jid)[0] is None
                placed.append((layer, int(e), cid, slot, jid))
        for layer, e, cid, slot, _ in placed:
            for span in idx.parts(layer, e):
                bad = verify_expert_bytes(ar.view(cid, slot, span.part), layer, span.part, e)
                assert bad is None, bad


def test_eio_fails_that_job_only(files, monkeypatch):
    """An I/O error on one range fails its job with errno, file and offset; other jobs are fine."""
    paths, datas = files
    real = readers_mod.read_chunk
    bad_off = 2**20 + 65536

    def flaky(fd, off, n, dest, bounce, bb, align, direct):
        if off <= bad_off < off + n:
            return -errno.EIO
        return real(fd, off, n, dest, bounce, bb, align, direct)

    monkeypatch.setattr(readers_mod, "read_many", per_chunk(flaky))
    dest = Dest(4 * 2**20)
    w = Waiter()
    with ReaderPool(paths, threads=4, chunk_bytes=65536) as pool:
        bad = pool.submit([(0, 2**20, 2**20, dest.addr)], priority=0, callback=w)
        good = pool.submit([(0, 0, 2**20, dest.addr + 2**21)], priority=0, callback=w)
        err = w.wait(bad)[0]
        assert isinstance(err, ReadError)
        assert "Input/output error" in str(err) and paths[0] in str(err) and f"offset {bad_off}" in str(err)
        assert w.wait(good)[0] is None
        assert np.array_equal(dest.arr[2**21:2**21 + 2**20], datas[0][:2**20])
        time.sleep(0.05)
    assert w.calls[bad] == 1


def test_chunking_fewest_equal_aligned(files):
    """Reads split into ceil(n / chunk) pieces, inner cuts aligned, covering the range exactly."""
    paths, _ = files
    with ReaderPool(paths, threads=1, chunk_bytes=256 * 1024) as pool:
        a = pool.stats()["align"][0]
        for off, n in [(32, 884736), (4096, 262144), (100, 1), (96, 3 * 262144 + 5), (0, 262143)]:
            chunks, total = pool._split([(0, off, n, 1 << 20)])
            assert total == n and len(chunks) == -(-n // (256 * 1024))
            assert chunks[0][1] == off and chunks[-1][1] + chunks[-1][2] == off + n
            for c, d in zip(chunks, chunks[1:]):
                assert c[1] + c[2] == d[1] and d[1] % a == 0 and d[3] - c[3] == c[2]
            assert max(c[2] for c in chunks) <= 256 * 1024 + a


def test_file_overwritten_in_place_same_size_fails_loads(tmp_path):
    """A model rewritten in place with other bytes of the same size (new mtime) must fail
    loads, never serve a mix of old and new bytes."""
    import ctypes
    import time as _time
    from moecached.engine.readers import ReaderPool, ReadError
    path = tmp_path / "m.bin"
    path.write_bytes(os.urandom(1 << 20))
    st = os.stat(path)
    pool = ReaderPool([str(path)], threads=2, direct=False, file_sizes=[st.st_size],
                      file_mtimes_ns=[st.st_mtime_ns])
    buf = ctypes.create_string_buffer(65536)
    results = []
    try:
        import threading as _th
        ev = _th.Event()
        pool.submit([(0, 4096, 65536, ctypes.addressof(buf))], priority=0,
                    callback=lambda j, e, n, s: (results.append(e), ev.set()))
        assert ev.wait(10) and results[-1] is None
        _time.sleep(0.01)
        with open(path, "r+b") as f:   # same size, other bytes, new mtime
            f.write(os.urandom(1 << 20))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        ev.clear()
        pool.submit([(0, 4096, 65536, ctypes.addressof(buf))], priority=0,
                    callback=lambda j, e, n, s: (results.append(e), ev.set()))
        assert ev.wait(10)
        assert isinstance(results[-1], ReadError)
        assert "mtime changed" in str(results[-1])
        # what happens next, true in either on_model_change mode
        assert str(results[-1]).endswith(
            '; load refused; the daemon re-indexes the model once its file is unchanged '
            '(on_model_change = "reload") or exits so its service manager restarts it ("exit")')
    finally:
        pool.close()


def test_rewritten_in_place_with_mtime_restored_fails_loads(tmp_path):
    """Same size, same inode, mtime put back (rsync --inplace -t, cp -p, touch -r): only the
    ctime tells; the load is refused with ModelChanged before a byte is read."""
    import ctypes
    import threading as _th
    path = tmp_path / "m.bin"
    path.write_bytes(os.urandom(1 << 20))
    st = os.stat(path)
    pool = ReaderPool([str(path)], threads=2, direct=False)
    buf = ctypes.create_string_buffer(65536)
    results = []
    ev = _th.Event()
    try:
        with open(path, "r+b") as f:
            f.write(os.urandom(1 << 20))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        st2 = os.stat(path)
        assert (st2.st_size, st2.st_mtime_ns, st2.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
        pool.submit([(0, 4096, 65536, ctypes.addressof(buf))], priority=0,
                    callback=lambda j, e, n, s: (results.append(e), ev.set()))
        assert ev.wait(10)
        assert isinstance(results[-1], ModelChanged) and "ctime changed" in str(results[-1])
        assert results[-1].dest_written is False
        assert pool.stats()["errors"] == 0
    finally:
        pool.close()


def test_load_racing_an_in_place_rewrite_is_withheld(tmp_path, monkeypatch):
    """The file is rewritten (mtime put back) while a load reads it, after the check before
    its first chunk: the check after its last chunk sees the ctime and withholds the bytes."""
    import ctypes
    import threading as _th
    path = tmp_path / "m.bin"
    path.write_bytes(os.urandom(1 << 20))
    st = os.stat(path)
    real = readers_mod.read_many
    done = []

    def rewrite_then_read(*a):
        if not done:
            done.append(1)
            with open(path, "r+b") as f:
                f.write(os.urandom(1 << 20))
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        return real(*a)
    monkeypatch.setattr(readers_mod, "read_many", rewrite_then_read)
    pool = ReaderPool([str(path)], threads=1, direct=False)
    buf = ctypes.create_string_buffer(65536)
    results = []
    ev = _th.Event()
    try:
        pool.submit([(0, 4096, 65536, ctypes.addressof(buf))], priority=0,
                    callback=lambda j, e, n, s: (results.append(e), ev.set()))
        assert ev.wait(10) and done
        assert isinstance(results[-1], ModelChanged) and "ctime changed" in str(results[-1])
        assert results[-1].dest_written is True
        assert pool.model_changed is not None
    finally:
        pool.close()


# ---- several pools on one shared queue (several models of one daemon) -------------------------

class GatedReads:
    """Stands in for ``readers.read_many`` and wraps ``ReadQueue._take``: a prefetch read (its
    dest in ``pre``) waits for a token (``release()``), a demand read for the ``demand`` gate.
    ``takes`` logs what each queue handed out, in its order: (pool, kind, chunks, prefetch
    chunks in flight after the take, demand jobs unfinished) summed over ``queues``."""

    def __init__(self, monkeypatch, pre):
        self.real, self.pre = readers_mod.read_many, pre
        self.cond = threading.Condition()
        self.names = {}                     # pool -> name
        self.inside, self.ended, self.takes = {"p": 0, "d": 0}, {"p": 0, "d": 0}, []
        self.tokens = threading.Semaphore(0)
        self.demand = threading.Event()
        self.queues = []
        real_take = readers_mod.ReadQueue._take

        def take(q):
            got = real_take(q)
            if got is not None:
                self.takes.append((self.names[got[0].pool], "p" if got[2] else "d", len(got[1]),
                                   sum(x._pf_chunks for x in self.queues),
                                   sum(x._demand_jobs for x in self.queues)))
            return got
        monkeypatch.setattr(readers_mod.ReadQueue, "_take", take)
        monkeypatch.setattr(readers_mod, "read_many", self)

    def __call__(self, chunks, fds, aligns, directs, bounce, bb):
        dest = chunks[0][3]
        kind = "p" if self.pre.addr <= dest < self.pre.addr + len(self.pre.buf) else "d"
        with self.cond:
            self.inside[kind] += len(chunks)
            self.cond.notify_all()
        try:
            assert (self.tokens.acquire(timeout=30) if kind == "p" else self.demand.wait(30))
            return self.real(chunks, fds, aligns, directs, bounce, bb)
        finally:
            with self.cond:
                self.inside[kind] -= len(chunks)
                self.ended[kind] += len(chunks)
                self.cond.notify_all()

    def wait_for(self, pred):
        with self.cond:
            assert self.cond.wait_for(pred, 30), (self.takes, self.inside, self.ended)

    def release_prefetches(self, n):
        """Let ``n`` prefetch reads go, one at a time (each one ends before the next may)."""
        for _ in range(n):
            done = self.ended["p"]
            self.tokens.release()
            self.wait_for(lambda: self.ended["p"] == done + 1)

    def open_all(self):
        self.demand.set()
        self.tokens.release(1000)


def two_pools(g, files_a, files_b, shared, **kw):
    """Pools a and b on one ReadQueue (``shared``) or each on a queue of its own of the same
    size; returns (a, b, [queues])."""
    if shared:
        q = readers_mod.ReadQueue(**kw)
        a, b, qs = ReaderPool(files_a, queue=q), ReaderPool(files_b, queue=q), [q]
    else:
        a, b = ReaderPool(files_a, **kw), ReaderPool(files_b, **kw)
        qs = [a.queue, b.queue]
    g.names.update({a: "a", b: "b"})
    g.queues[:] = qs
    return a, b, qs


def close_all(pools, queues):
    for p in pools:
        p.close()
    for q in queues:
        q.close()


def demand_of_b_before_prefetch_of_a(paths, datas, monkeypatch, shared):
    pre, dem = Dest(2**20), Dest(2**20)
    g = GatedReads(monkeypatch, pre)
    w, wb = Waiter(), Waiter()   # one per pool: job ids are per queue
    a, b, qs = two_pools(g, paths, [paths[1]], shared, threads=2, chunk_bytes=4096,
                         prefetch_chunks=2, prefetch_with_demand=1)
    try:
        pa = [a.submit([(0, 4096 * i, 4096, pre.addr + 4096 * i)], priority=1, callback=w)
              for i in range(6)]
        g.wait_for(lambda: g.inside["p"] == 2)          # both threads on a's prefetches
        n0 = len(g.takes)
        jb = b.submit([(0, 100, 3 * 4096, dem.addr)], priority=0, callback=wb)   # 3 chunks
        g.release_prefetches(6)     # b's demand read is held meanwhile
        assert wb.done.get(jb) is None
        g.demand.set()
        assert wb.wait(jb)[0] is None
        for j in pa:
            assert w.wait(j)[0] is None
    finally:
        g.open_all()
        close_all([a, b], qs)
    # b's demand load is handed out before any more of a's prefetches ...
    assert g.takes[n0][:2] == ("b", "d"), g.takes
    # ... and while it is unfinished, a's prefetches go one chunk at a time
    # (prefetch_with_demand = 1), not beside it at a's own cap
    assert all(pf <= 1 for name, kind, n, pf, dj in g.takes[n0:] if kind == "p" and dj), g.takes
    assert np.array_equal(dem.arr[:3 * 4096], datas[1][100:100 + 3 * 4096])
    assert np.array_equal(pre.arr[:6 * 4096], datas[0][:6 * 4096])


def test_shared_queue_demand_of_one_pool_before_prefetch_of_another(files, monkeypatch):
    """Two pools (two models) on one queue: a demand load of b goes before prefetches a queued
    earlier and holds them to prefetch_with_demand; with a queue per pool, a's prefetches go
    on beside b's demand reads at a's own cap."""
    paths, datas = files
    demand_of_b_before_prefetch_of_a(paths, datas, monkeypatch, shared=True)


def prefetch_caps_across_pools(paths, datas, monkeypatch, shared):
    pre, dem = Dest(2**20), Dest(2**20)
    g = GatedReads(monkeypatch, pre)
    a, b, qs = two_pools(g, paths, paths, shared, threads=4, chunk_bytes=4096,
                         prefetch_chunks=2, prefetch_with_demand=1)
    ws = {a: Waiter(), b: Waiter()}   # one per pool: job ids are per queue
    try:
        jobs = [(p, p.submit([(0, 4096 * i, 4096, pre.addr + 4096 * i)], priority=1,
                             callback=ws[p])) for i, p in enumerate([a, b] * 4)]
        g.wait_for(lambda: g.inside["p"] >= 2)
        jd = b.submit([(1, 0, 4096, dem.addr)], priority=0, callback=ws[b])
        g.wait_for(lambda: g.inside["d"] == 1)
        g.release_prefetches(8)
        assert ws[b].done.get(jd) is None
        g.demand.set()
        for p, j in jobs + [(b, jd)]:
            assert ws[p].wait(j)[0] is None
    finally:
        g.open_all()
        close_all([a, b], qs)
    pf = [t for t in g.takes if t[1] == "p"]
    assert len(pf) == 8 and {t[0] for t in pf} == {"a", "b"}
    assert max(t[3] for t in pf) == 2, g.takes                  # prefetch_chunks, both pools
    assert all(t[3] <= 1 for t in pf if t[4]), g.takes          # prefetch_with_demand
    assert np.array_equal(pre.arr[:8 * 4096], datas[0][:8 * 4096])
    assert np.array_equal(dem.arr[:4096], datas[1][:4096])


def test_shared_queue_prefetch_caps_hold_across_pools(files, monkeypatch):
    """prefetch_chunks and prefetch_with_demand count the prefetch chunks of every pool on the
    queue together; with a queue per pool each pool has caps of its own."""
    paths, datas = files
    prefetch_caps_across_pools(paths, datas, monkeypatch, shared=True)


def test_closing_one_pool_leaves_the_shared_queue_to_the_other(files, monkeypatch):
    """close() of one pool fails its own jobs (those being read once their chunks in flight are
    done) and returns after their callbacks; the other pool's jobs all load, bit-exact, and it
    keeps loading on the same threads afterwards."""
    paths, datas = files
    real = readers_mod.read_many
    gate, inside = threading.Event(), threading.Semaphore(0)
    fds_a = []

    def held(chunks, fds, *rest):   # a's reads wait for the gate
        if fds is fds_a[0]:
            inside.release()
            assert gate.wait(30)
        return real(chunks, fds, *rest)
    monkeypatch.setattr(readers_mod, "read_many", held)
    q = readers_mod.ReadQueue(threads=3, chunk_bytes=65536)
    a, b = ReaderPool(paths, queue=q), ReaderPool(paths, queue=q)
    fds_a.append(a._fds)
    da, db = Dest(8 * 2**20), Dest(8 * 2**20)
    wa, wb = Waiter(), Waiter()
    try:
        ja = [a.submit([(0, 2**19 * i + 32, 2**19, da.addr + 2**20 * i)], priority=i % 2, callback=wa)
              for i in range(6)]
        assert inside.acquire(timeout=30)          # a's first job is being read
        jb = [b.submit([(i % 2, 4096 * i + 7, 300_000, db.addr + 2**20 * i)], priority=i % 2,
                       callback=wb) for i in range(6)]
        closer = threading.Thread(target=a.close)
        closer.start()
        deadline = time.time() + 30
        while not a._closed and time.time() < deadline:
            time.sleep(0.001)
        with pytest.raises(ReadError, match="closed"):
            a.submit([], priority=0, callback=wa)
        gate.set()
        closer.join(30)
        assert not closer.is_alive()
        # every job of a had its callback, once, before close returned: failed "closed"
        assert sorted(wa.done) == sorted(ja) and all(c == 1 for c in wa.calls.values())
        for j in ja:
            err = wa.done[j][0]
            assert isinstance(err, ReadError) and "reader pool closed" in str(err)
        assert wa.done[ja[0]][0].dest_written is True      # it was being read
        assert wa.done[ja[-1]][0].dest_written is False    # never started
        for i, j in enumerate(jb):
            assert wb.wait(j)[0] is None
            f, off = i % 2, 4096 * i + 7
            assert np.array_equal(db.arr[2**20 * i:2**20 * i + 300_000], datas[f][off:off + 300_000])
        st = q.stats()
        assert st["threads"] == 3 and st["pools"] == 1 and all(t.is_alive() for t in q._threads)
        # b goes on loading on the shared threads
        j = b.submit([(0, 12345, 2**20 + 3, db.addr + 7)], priority=0, callback=wb)
        assert wb.wait(j)[0] is None
        assert np.array_equal(db.arr[7:7 + 2**20 + 3], datas[0][12345:12345 + 2**20 + 3])
        assert b.stats()["jobs"] == 7 and b.stats()["errors"] == 0
    finally:
        gate.set()
        b.close()
        q.close()
    assert not any(t.is_alive() for t in q._threads)


def test_model_change_in_one_pool_leaves_the_other(tmp_path):
    """A changed file refuses the loads of its pool only: the other pool on the shared queue
    keeps loading the right bytes and sees no change."""
    pa, pb = str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf")
    data_a, data_b = write_random(pa, 2**20, 1), write_random(pb, 2**20, 2)
    changes = []
    with readers_mod.ReadQueue(threads=2, chunk_bytes=65536) as q:
        a = ReaderPool([pa], queue=q, on_change=lambda msg: changes.append(("a", msg)))
        b = ReaderPool([pb], queue=q, on_change=lambda msg: changes.append(("b", msg)))
        dest = Dest(2**20)
        w = Waiter()
        os.truncate(pa, 2**19)
        ja = a.submit([(0, 0, 4096, dest.addr)], priority=0, callback=w)
        err = w.wait(ja)[0]
        assert isinstance(err, ModelChanged) and pa in str(err) and "size changed" in str(err)
        assert a.model_changed is not None and b.model_changed is None
        assert [c[0] for c in changes] == ["a"]
        with pytest.raises(ModelChanged):
            a.submit([(0, 0, 4096, dest.addr)], priority=1, callback=w)
        assert b.recheck() is None
        jb = b.submit([(0, 33, 2**20 - 33, dest.addr)], priority=0, callback=w)
        assert w.wait(jb)[0] is None
        assert np.array_equal(dest.arr[:2**20 - 33], data_b[33:])
        assert b.stats()["errors"] == 0 and b.model_changed is None and len(changes) == 1
        a.close()
        b.close()
    del data_a


def test_pool_on_a_shared_queue_takes_its_settings(files):
    """threads, chunk_bytes, batch and the prefetch caps belong to the queue: a pool given one
    says so when they are passed to it too, and cuts its reads at the queue's chunk size."""
    paths, _ = files
    with readers_mod.ReadQueue(threads=2, chunk_bytes=8192) as q:
        with pytest.raises(ReadError, match="threads, chunk_bytes: set on the shared ReadQueue"):
            ReaderPool(paths, queue=q, threads=4, chunk_bytes=65536)
        with ReaderPool(paths, queue=q) as p:
            assert p.chunk_bytes == 8192 and p.stats()["threads"] == 2
            assert len(p._split([(0, 0, 65536, 1 << 20)])[0]) == 8
    with pytest.raises(ReadError, match="closed"):
        ReaderPool(paths, queue=q)
