"""Slot arena: budget split, page alignment, descriptor round-trip, release/restore, error paths."""
import contextlib
import ctypes
import json
import mmap
import shutil
import os
import resource
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np
import pytest

from moecached.engine.arena import Arena, ArenaError, plan_slots

PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class FakeClass:
    id: int
    layers: list
    parts: list
    part_bytes: dict
    part_types: dict = field(default_factory=dict)

    @property
    def slot_bytes(self):
        return sum(self.part_bytes.values())


@dataclass
class FakeIndex:
    n_experts: int
    size_classes: list


def two_class_index(n_experts=8):
    # odd part sizes (multiples of 32 like GGUF, not of the page) so packing is visible
    a = FakeClass(0, [0, 1, 2], ["gate", "up", "down"], {"gate": 4640, "up": 4640, "down": 5216})
    b = FakeClass(1, [3], ["gate", "up", "down"], {"gate": 2080, "up": 2080, "down": 9248})
    return FakeIndex(n_experts, [a, b])


def total_bytes(idx, counts):
    """Bytes of the whole arena file: the control block (64-byte header, 8 per slot and per
    key of the resident map) and the
    page-rounded part arrays."""
    keys = sum(len(c.layers) for c in idx.size_classes) * idx.n_experts
    ctl = -(-(64 + 8 * sum(counts.values()) + 8 * keys) // PAGE) * PAGE
    return ctl + sum(-(-counts[c.id] * c.part_bytes[p] // PAGE) * PAGE for c in idx.size_classes for p in c.parts)


def test_plan_same_share_per_class():
    idx = two_class_index()
    full = plan_slots(idx, slots=10**6)
    assert full == {0: 24, 1: 8}
    half = plan_slots(idx, slots=16)
    assert half == {0: 12, 1: 4}
    # bytes budget: largest fraction that fits, same fraction for both classes
    for budget in [200_000, 300_000, 500_000, 10**7]:
        got = plan_slots(idx, budget_bytes=budget)
        assert total_bytes(idx, got) <= budget
        f0, f1 = got[0] / 24, got[1] / 8
        assert abs(f0 - f1) <= 1 / 8 + 1e-9
        # one more step of the fraction would not fit (unless already full)
        if got != full:
            bigger = [plan_slots(idx, slots=s) for s in range(sum(got.values()) + 1, 33)]
            assert all(total_bytes(idx, g) > budget for g in bigger if g[0] >= got[0] and g[1] >= got[1] and g != got)


def test_plan_too_small_names_minimum():
    idx = two_class_index()
    with pytest.raises(ArenaError, match=r"minimum is \d+ bytes"):
        plan_slots(idx, budget_bytes=PAGE)
    with pytest.raises(ArenaError, match="minimum is 4 slots"):
        plan_slots(idx, slots=3)  # class 1 holds 1/4 of the layers: needs 4 total for 1 slot


def test_layout_alignment_views_and_descriptor_roundtrip(tmp_path):
    idx = two_class_index()
    with Arena(idx, slots=16, dir=str(tmp_path), lock=False) as ar:
        assert ar.size % PAGE == 0 and os.path.getsize(ar.path) == ar.size
        assert ar.base_address % PAGE == 0
        spans = []
        for c in ar.classes:
            for p in c.parts:
                assert c.part_off[p] % PAGE == 0
                spans.append((c.part_off[p], c.part_off[p] + c.n_slots * c.part_bytes[p]))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "part arrays overlap"
        assert spans[-1][1] <= ar.size
        rng = np.random.default_rng(0)
        want = {}
        for c in ar.classes:
            for s in range(c.n_slots):
                for p in c.parts:
                    v = ar.view(c.id, s, p)
                    assert v.shape == (c.part_bytes[p],) and v.flags.writeable
                    data = rng.integers(0, 256, c.part_bytes[p], dtype=np.uint8)
                    v[:] = data
                    want[c.id, s, p] = data
                    assert ar.part_offset(c.id, s, p) == c.part_off[p] + s * c.part_bytes[p]
        desc = json.loads(json.dumps(ar.descriptor()))
        # what a client does with the descriptor (docs/protocol.md): map read-only, find parts
        with open(desc["path"], "rb") as f:
            mm = mmap.mmap(f.fileno(), desc["size"], mmap.MAP_SHARED, mmap.PROT_READ)
        by_id = {int(c["id"]): c for c in desc["classes"]}
        try:
            for (cid, s, p), data in want.items():
                cl = by_id[cid]
                off = cl["part_off"][p] + s * cl["part_bytes"][p]
                assert mm[off:off + cl["part_bytes"][p]] == data.tobytes()
            with pytest.raises(TypeError):
                mm[0] = 1  # read-only
        finally:
            mm.close()
        with pytest.raises(ArenaError, match="out of range"):
            ar.view(0, 12, "gate")
    assert not os.path.exists(ar.path)


def test_existing_file_refused(tmp_path):
    idx = two_class_index()
    (tmp_path / "x").write_bytes(b"")
    with pytest.raises(ArenaError, match="already exists"):
        Arena(idx, slots=8, dir=str(tmp_path), name="x", lock=False)


def test_lock_and_release_restore(tmp_path):
    # big parts so whole pages exist inside a slot
    idx = FakeIndex(8, [FakeClass(0, [0, 1], ["gate", "down"], {"gate": 3 * PAGE + 96, "down": 5 * PAGE + 32})])
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
    except (ValueError, OSError):
        pass
    try:
        with Arena(idx, slots=16, dir="/dev/shm") as ar:
            assert ar.locked
            vmlck = [l for l in open("/proc/self/status") if l.startswith("VmLck")][0]
            assert int(vmlck.split()[1]) * 1024 >= ar.size
            for s in range(16):
                for p in ar.classes[0].parts:
                    ar.view(0, s, p)[:] = s + 1
            blocks0 = os.stat(ar.path).st_blocks
            releases = ar.descriptor()["control"]["releases_off"]
            ctl = np.frombuffer(open(ar.path, "rb").read(64), dtype=np.uint64)
            assert ctl[releases // 8] == 0
            freed = ar.release_memory(0, [3, 4, 9])
            assert freed > 0 and freed % PAGE == 0
            # the releases word moved (a client that registered the pages registers them again)
            ctl = np.frombuffer(open(ar.path, "rb").read(64), dtype=np.uint64)
            assert ctl[releases // 8] == 1
            assert os.stat(ar.path).st_blocks * 512 <= blocks0 * 512 - freed
            # neighbours untouched (partial pages kept)
            for s in [2, 5, 8, 10]:
                for p in ar.classes[0].parts:
                    assert (ar.view(0, s, p) == s + 1).all()
            ar.restore_memory(0, [3, 4, 9])
            assert os.stat(ar.path).st_blocks == blocks0
            for s in [3, 4, 9]:
                for p in ar.classes[0].parts:
                    ar.view(0, s, p)[:] = 7
                    assert (ar.view(0, s, p) == 7).all()
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


@contextlib.contextmanager
def without_cap_ipc_lock():
    """Drop CAP_IPC_LOCK from the effective set (root ignores RLIMIT_MEMLOCK with it); restore after."""
    libc = ctypes.CDLL(None, use_errno=True)
    hdr, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    if libc.capget(ctypes.byref(hdr), data) != 0:
        pytest.skip("capget failed")
    saved = data[0].effective
    data[0].effective = saved & ~(1 << 14)
    if libc.capset(ctypes.byref(hdr), data) != 0:
        pytest.skip("capset failed")
    try:
        yield
    finally:
        data[0].effective = saved
        libc.capset(ctypes.byref(hdr), data)


def test_memlock_too_low_names_fix(tmp_path):
    idx = two_class_index()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, hard))
    try:
        with without_cap_ipc_lock():
            with pytest.raises(ArenaError, match=r"RLIMIT_MEMLOCK.*LimitMEMLOCK=infinity.*ulimit -l"):
                Arena(idx, slots=32, dir=str(tmp_path), name="a")
            assert not os.path.exists(tmp_path / "a")
            # lock=False needs no locked memory
            Arena(idx, slots=32, dir=str(tmp_path), name="b", lock=False).close()
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


CHILD = """
import sys
from moecached.engine.arena import Arena, ArenaError
class C: pass
c = C(); c.id = 0; c.layers = [0, 1]; c.parts = ["gate"]; c.part_bytes = {"gate": 64 * 1024}
i = C(); i.n_experts = 8; i.size_classes = [c]
try:
    Arena(i, slots=16, dir=sys.argv[1])
except ArenaError as e:
    print("ERR", e); sys.exit(3)
"""


def test_memlock_low_in_fresh_process(tmp_path):
    """As a daemon started from a shell with `ulimit -l 64` and no CAP_IPC_LOCK would see it."""
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) missing")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(["bash", "-c", 'ulimit -S -l 64; exec setpriv --inh-caps=-ipc_lock '
                        '--bounding-set=-ipc_lock "$@"', "sh", sys.executable, "-c", CHILD, str(tmp_path)],
                       capture_output=True, text=True, cwd=root,
                       env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "ulimit -l" in r.stdout and "LimitMEMLOCK=infinity" in r.stdout
    assert os.listdir(tmp_path) == []


def test_small_shm_fails_at_start():
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    d = tempfile.mkdtemp()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d], capture_output=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip("cannot mount tmpfs: " + r.stderr.decode().strip())
    try:
        idx = FakeIndex(8, [FakeClass(0, [0, 1], ["gate"], {"gate": 256 * 1024})])
        with pytest.raises(ArenaError, match=r"cannot reserve .*enlarge it"):
            Arena(idx, slots=16, dir=d, name="big", lock=False)  # 4 MiB > 1 MiB
        assert os.listdir(d) == []
        Arena(idx, slots=2, dir=d, name="ok", lock=False).close()  # 512 KiB fits
    finally:
        subprocess.run(["umount", d])
        os.rmdir(d)


def test_real_index_two_classes(model_factory, tmp_path):
    from moecached.engine.index import open_index
    idx = open_index(model_factory("deepseek-v2-lite-Q4_K_M", layers=4, experts=8, split=2))
    assert len(idx.size_classes) >= 2
    whole = sum(len(c.layers) * idx.n_experts * c.slot_bytes for c in idx.size_classes)
    with Arena(idx, budget_bytes=whole // 2, dir=str(tmp_path), lock=False) as ar:
        assert ar.size <= whole // 2
        for c, sc in zip(ar.classes, idx.size_classes):
            assert c.parts == list(sc.parts) and c.slot_bytes == sc.slot_bytes
            # same share of each class's experts (within one slot of rounding)
            assert abs(c.n_slots / (len(c.layers) * idx.n_experts) - 0.5) <= 1 / (len(c.layers) * idx.n_experts) + 0.05
        d = ar.descriptor()
        assert d["layer_class"] == {str(l): c for l, c in idx.layer_class.items()}
        assert {k: v for k, v in d["classes"][0]["part_types"].items()} == dict(idx.size_classes[0].part_types)


def test_plan_matches_exhaustive_search():
    """The per-weight binary search finds the same fraction as trying every step point."""
    from fractions import Fraction
    rng = np.random.default_rng(5)
    for trial in range(30):
        n_exp = int(rng.integers(2, 20))
        classes = [FakeClass(i, list(range(int(rng.integers(1, 6)))), ["a", "b"],
                             {"a": int(rng.integers(1, 3000)) * 32, "b": int(rng.integers(1, 3000)) * 32})
                   for i in range(int(rng.integers(1, 4)))]
        idx = FakeIndex(n_exp, classes)
        budget = int(rng.integers(10_000, 3_000_000))
        ws = [len(c.layers) * n_exp for c in classes]
        best = None
        for f in sorted({Fraction(k, w) for w in ws for k in range(1, w + 1)}):
            cnt = {c.id: int(f * len(c.layers) * n_exp) for c in classes}
            if total_bytes(idx, cnt) <= budget:
                best = cnt
        if best is None or min(best.values()) < 1:
            with pytest.raises(ArenaError):
                plan_slots(idx, budget_bytes=budget)
        else:
            assert plan_slots(idx, budget_bytes=budget) == best


def test_remove_stale_arenas_spares_an_arena_being_created(tmp_path):
    """A daemon creates its arena file (O_EXCL) and flocks it a moment later: a cleanup in
    another daemon starting at that moment found an empty, unlocked file with an arena's name
    and removed it, leaving the new daemon serving an arena no client could open."""
    from moecached.engine.arena import remove_stale_arenas
    new = tmp_path / f"moecached-{os.getpid()}-0badcafe"
    os.close(os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o640))   # created, not yet locked
    assert remove_stale_arenas(str(tmp_path)) == []
    assert new.exists()


def test_remove_stale_arenas_spares_live_ones(tmp_path):
    """A moecached-* file nobody flocks is stale and removed; a live arena is kept."""
    import fcntl
    from moecached.engine.arena import remove_stale_arenas
    stale = tmp_path / "moecached-999999-deadbeef"
    stale.write_bytes(b"\0" * 4096)
    live = tmp_path / "moecached-1-cafecafe"
    live.write_bytes(b"\0" * 4096)
    other = tmp_path / "not-ours"
    other.write_bytes(b"x")
    fd = os.open(live, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert remove_stale_arenas(str(tmp_path)) == [str(stale)]
        assert live.exists() and other.exists() and not stale.exists()
    finally:
        os.close(fd)
    assert remove_stale_arenas(str(tmp_path)) == [str(live)]
