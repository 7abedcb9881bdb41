"""The arena on 2 MiB pages. On hugetlbfs: bytes exact, shrink gives huge pages back, grow
takes them again (needs root to reserve huge pages and mount hugetlbfs; skipped otherwise; the
machine's huge-page reservation is restored afterwards). On a tmpfs mounted with
huge=within_size: backed and mapped with 2 MiB pages."""
import os
import subprocess

import pytest

from moecached.engine.cache import ExpertCache
from moecached.engine.index import open_index
from moecached.tools.synth import verify_expert_bytes

NR = "/proc/sys/vm/nr_hugepages"


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


@pytest.fixture
def hugetlbfs(tmp_path):
    if os.geteuid() != 0 or not os.path.exists(NR):
        pytest.skip("needs root and /proc/sys/vm/nr_hugepages")
    old = open(NR).read().strip()
    try:
        with open(NR, "w") as f:
            f.write(str(int(old) + 128))  # 256 MiB of 2 MiB pages
    except OSError as e:
        pytest.skip(f"cannot reserve huge pages: {e}")
    mnt = tmp_path / "huge"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "hugetlbfs", "none", str(mnt)], capture_output=True).returncode:
        with open(NR, "w") as f:
            f.write(old)
        pytest.skip("cannot mount hugetlbfs here")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
        with open(NR, "w") as f:
            f.write(old)


def test_arena_on_hugetlbfs(model_factory, hugetlbfs):
    idx = open_index(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8))
    free0 = _meminfo("HugePages_Free")
    c = ExpertCache(idx, slots=32, arena_dir=hugetlbfs, hugetlb=True, lock_memory=True, readers=4)
    try:
        assert c.arena.page_size == 2 << 20
        assert all(off % (2 << 20) == 0 for cl in c.arena.classes for off in cl.part_off.values())
        used = free0 - _meminfo("HugePages_Free")
        assert used * 2048 * 1024 >= c.arena.size  # reserved up front
        L = idx.expert_layers
        for layer in L:
            lease = c.acquire(layer, [0, 3, 7], timeout=30)
            for lyr, e, cid, slot in lease.items:
                for part in c.arena.classes[cid].parts:
                    assert verify_expert_bytes(c.arena.view(cid, slot, part), lyr, part, e, 0) is None
            c.release(lease)
        r = c.set_budget(c.arena.size // 2)
        assert r["bytes_released"] > 0
        assert free0 - _meminfo("HugePages_Free") < used  # huge pages given back
        r = c.set_budget(c.arena.size)          # back to every slot of the start
        assert r["slots_before"] < r["slots_after"] == sum(cl.n_slots for cl in c.arena.classes)
        with _Lease(c, L[0], [5]) as lease:
            for lyr, e, cid, slot in lease.items:
                for part in c.arena.classes[cid].parts:
                    assert verify_expert_bytes(c.arena.view(cid, slot, part), lyr, part, e, 0) is None
    finally:
        c.close()
    assert os.listdir(hugetlbfs) == []


class _Lease:
    def __init__(self, cache, layer, experts):
        self.cache = cache
        self.lease = cache.acquire(layer, experts, timeout=30)
        self.items = self.lease.items

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cache.release(self.lease)


@pytest.fixture
def huge_tmpfs(tmp_path):
    """A tmpfs mounted with huge=within_size (2 MiB pages for what lies within the file's size)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "hugetmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=within_size,size=512m", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs with huge= here")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _pmd_mapped_kib(path: str) -> int:
    """ShmemPmdMapped (KiB) of this process's mapping of path: the part mapped with 2 MiB pages."""
    with open("/proc/self/smaps") as f:
        blocks = f.read().split("\n")
    inside = False
    for line in blocks:
        if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:
            inside = line.rstrip().endswith(path)
        elif inside and line.startswith("ShmemPmdMapped:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping of {path}")


def test_arena_on_a_huge_tmpfs(model_factory, huge_tmpfs):
    """An arena on a tmpfs with huge=within_size is backed and mapped with 2 MiB pages (the
    model file's page cache is, in large folios: with 4 KiB arena pages an engine's expert
    reads missed the TLB where the page cache's did not), it says so in its descriptor, and
    its bytes are the file's."""
    idx = open_index(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8))
    c = ExpertCache(idx, slots=32, arena_dir=huge_tmpfs, lock_memory=False, readers=4)
    try:
        a = c.arena
        assert a.huge_pages == "within_size" and a.descriptor()["huge_pages"] == "within_size"
        for k in a.classes:
            a.populate(k.id, list(range(k.n_slots)))
        for layer in idx.expert_layers:
            lease = c.acquire(layer, [0, 3, 7], timeout=30)
            for lyr, e, cid, slot in lease.items:
                for part in a.classes[cid].parts:
                    assert verify_expert_bytes(a.view(cid, slot, part), lyr, part, e, 0) is None
            c.release(lease)
        huge = _pmd_mapped_kib(a.path) * 1024
        assert huge >= (a.size // (2 << 20) - 1) * (2 << 20), f"{huge} of {a.size} bytes on 2 MiB pages"
    finally:
        c.close()


def test_arena_on_dev_shm_says_its_pages(model_factory, tmp_path):
    """Where the arena's tmpfs has no huge pages the descriptor says "never"; off a tmpfs, None."""
    from moecached.engine.hostmem import tmpfs_huge
    if tmpfs_huge("/dev/shm") is None:
        pytest.skip("/dev/shm is not a tmpfs here")
    idx = open_index(model_factory("qwen3-30b-a3b-Q4_K_M", layers=2, experts=8))
    c = ExpertCache(idx, slots=8, lock_memory=False, readers=2)
    try:
        assert c.arena.huge_pages == tmpfs_huge("/dev/shm") and c.arena.huge_pages is not None
    finally:
        c.close()
