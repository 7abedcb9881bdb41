"""Slot arena: one shared-memory file holding every cached expert, reserved and mlock'd up front.

Layout (bytes, all offsets relative to the start of the arena file)::

    control block                                                  offset 0, page-rounded
      header (64 bytes): magic "MOECTL01", epoch u64, state u64, n_classes u64, n_keys u64,
                         resident map offset u64, reserved
      generations: one u64 per slot, class by class (class c's at ``gen_off``)
      resident map: one u64 per key (moe layer index * n_experts + expert): 0, or slot + 1
    class 0: part "gate"  array  [n_slots x part_bytes["gate"]]   page-aligned start
             part "up"    array  [n_slots x part_bytes["up"]]     page-aligned start
             part "down"  array  ...
    class 1: ...

Part ``p`` of slot ``i`` of a class lives at ``part_off[p] + i * part_bytes[p]``: each part is one
packed array in ggml's expert-tensor layout (``[ne0, ne1, n_slots]``), so an engine can run
``MUL_MAT_ID`` over the slots directly. ``Arena.descriptor()`` is a JSON-able description of all
of this; another process maps the file read-only (the client does; docs/protocol.md).

The control block is written by the daemon only. ``epoch`` is the serving daemon's session id
(0 once it stopped, or when a later daemon found the file left by a crash); ``state`` is 1
serving, 2 model file changed, 0 stopped. A slot's *generation* moves whenever the expert it
held leaves it (eviction, a failed load, a budget shrink): a holder that finds the epoch and
every generation of its lease unchanged *after* reading the bytes read the expert it was
granted (a seqlock; docs/protocol.md, "Lease validity"). The resident map says where each
resident expert is, for clients that pin without a message; the rules of both live once, in
``clients/c/include/moecache_shm.h``.

Budget: each size class gets the same share (one ``fraction`` for all classes) of its layers'
experts, ``n_slots(class) = floor(fraction * len(class.layers) * n_experts)``, with the largest
fraction (<= 1) whose total (page-rounded) bytes fit the budget. ``slots=N`` picks the largest
fraction whose total slot count is <= N.

Errors are :class:`ArenaError`, one line naming the path/value, what was expected, and the fix.
"""
from __future__ import annotations

import ctypes
import fcntl
import ctypes.util
import errno
import mmap
import os
import re
import resource
import secrets
import stat
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from moecached.engine import _shm
from moecached.engine.errors import ArenaError, BudgetError
from moecached.engine.hostmem import memlock_room, tmpfs_huge

__all__ = ["ArenaError", "BudgetError", "ClassLayout", "Arena", "plan_slots", "planned_size"]

DESCRIPTOR_VERSION = 2
# The control block's layout comes from clients/c/include/moecache_shm.h (through ._shm), a pin
# file's magic too (a fast-path client's pin file: daemon-owned, same cleanup).
CONTROL_MAGIC, PIN_MAGIC, CONTROL_HEADER_BYTES = _shm.CTL_MAGIC, _shm.PIN_MAGIC, _shm.CTL_HEADER_BYTES
_OLD_ARENA_NAME = re.compile(r"\.?moecached-\d+-[0-9a-f]{8}")  # arenas from before the control block
EPOCH_OFF, STATE_OFF, NCLASSES_OFF, NKEYS_OFF, RESMAP_OFF_OFF, RELEASES_OFF = (   # header words, as byte offsets
    8 * w for w in (_shm.CTL_W_EPOCH, _shm.CTL_W_STATE, _shm.CTL_W_NCLASSES, _shm.CTL_W_NKEYS,
                    _shm.CTL_W_RESMAP_OFF, _shm.CTL_W_RELEASES))
STATE_STOPPED, STATE_SERVING, STATE_MODEL_CHANGED = (
    _shm.STATE_STOPPED, _shm.STATE_SERVING, _shm.STATE_MODEL_CHANGED)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MADV_REMOVE = 9
MADV_POPULATE_WRITE = 23   # Linux 5.14+; older kernels say EINVAL and the pages fault on first use


@dataclass
class ClassLayout:
    """Where one size class's slots live in the arena.

    ``part_off[p]``: byte offset (page-aligned) of part ``p``'s packed array in the arena file;
    ``part_bytes[p]``: bytes of part ``p`` of one expert (= the array's slot stride);
    ``slot_bytes``: sum of ``part_bytes`` (bytes of one expert); ``n_slots``: slots in the class.
    """
    id: int
    layers: list[int]
    parts: list[str]
    part_bytes: dict[str, int]
    part_off: dict[str, int]
    n_slots: int
    slot_bytes: int
    part_types: dict = field(default_factory=dict)
    gen_off: int = 0   # byte offset of this class's slot generations (u64 each) in the control block

    def to_dict(self) -> dict:
        return {"id": self.id, "layers": list(self.layers), "parts": list(self.parts),
                "part_bytes": dict(self.part_bytes), "part_off": dict(self.part_off),
                "n_slots": self.n_slots, "slot_bytes": self.slot_bytes, "gen_off": self.gen_off,
                "part_types": {k: (v if isinstance(v, (int, str)) else str(v))
                               for k, v in self.part_types.items()}}


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _class_bytes(sc, n: int, page: int) -> int:
    return sum(_round_up(n * int(sc.part_bytes[p]), page) for p in sc.parts)


def n_keys(index) -> int:
    """Keys of the resident map: every (moe layer, expert) pair."""
    return sum(len(sc.layers) for sc in index.size_classes) * int(index.n_experts)


def arena_bytes(index, counts: dict[int, int], page_size: int = mmap.PAGESIZE) -> int:
    """Bytes of an arena holding ``counts`` slots per size class id: control block + part arrays."""
    return (control_bytes(sum(counts.values()), n_keys(index), page_size)
            + sum(_class_bytes(sc, counts[sc.id], page_size) for sc in index.size_classes))


def control_bytes(total_slots: int, keys: int, page: int) -> int:
    """Bytes of the control block (header, one generation word per slot, one resident-map
    word per key), page-rounded."""
    return _round_up(CONTROL_HEADER_BYTES + 8 * total_slots + 8 * keys, page)


def smallest_budget(index, page_size: int = mmap.PAGESIZE) -> int:
    """Bytes of the smallest arena :func:`plan_slots` accepts (every size class >= 1 slot).

    Raises :class:`ArenaError` when the index has no size classes.
    """
    classes = list(index.size_classes)
    if not classes:
        raise ArenaError("index has no size classes (no routed experts found); check the model file")
    weights = {sc.id: len(sc.layers) * int(index.n_experts) for sc in classes}
    fmin = max(Fraction(1, w) for w in weights.values())
    return arena_bytes(index, {sc.id: int(fmin * weights[sc.id]) for sc in classes}, page_size)


def plan_slots(index, *, budget_bytes: int | None = None, slots: int | None = None,
               page_size: int = mmap.PAGESIZE) -> dict[int, int]:
    """Slots per size class id for a budget in bytes or a total slot count (exactly one given).

    One fraction ``f`` in (0, 1] for all classes: ``n(c) = floor(f * len(c.layers) * n_experts)``;
    ``f`` is the largest value whose total fits (bytes: sum of page-rounded part arrays <=
    ``budget_bytes``; slots: sum of ``n(c)`` <= ``slots``). Raises :class:`ArenaError` if some
    class would get 0 slots, naming the minimum budget.
    """
    if (budget_bytes is None) == (slots is None):
        raise ArenaError(f"give exactly one of budget_bytes or slots (got budget_bytes={budget_bytes}, "
                         f"slots={slots})")
    classes = list(index.size_classes)
    if not classes:
        raise ArenaError("index has no size classes (no routed experts found); check the model file")
    n_exp = int(index.n_experts)
    weights = {sc.id: len(sc.layers) * n_exp for sc in classes}

    def counts(f: Fraction) -> dict[int, int]:
        return {sc.id: int(f * weights[sc.id]) for sc in classes}

    def cost(f: Fraction) -> int:
        c = counts(f)
        if budget_bytes is not None:   # the whole file: control block and slots
            return arena_bytes(index, c, page_size)
        return sum(c.values())

    limit = budget_bytes if budget_bytes is not None else slots
    # The best f is a point where some class's floor() steps up: k / w for a class weight w.
    # cost is monotone in f, so binary-search k for each distinct weight and keep the largest f.
    best = None
    for w in sorted(set(weights.values())):
        lo, hi, k_ok = 1, w, 0
        while lo <= hi:
            mid = (lo + hi) // 2
            if cost(Fraction(mid, w)) <= limit:
                k_ok, lo = mid, mid + 1
            else:
                hi = mid - 1
        if k_ok and (best is None or Fraction(k_ok, w) > best):
            best = Fraction(k_ok, w)
    got = counts(best) if best is not None else {sc.id: 0 for sc in classes}
    if min(got.values()) < 1:
        need = (smallest_budget(index, page_size) if budget_bytes is not None
                 else cost(max(Fraction(1, w) for w in weights.values())))
        unit = "bytes" if budget_bytes is not None else "slots"
        raise BudgetError(
            f"budget {limit} {unit} gives size class(es) "
            f"{[cid for cid, n in got.items() if n < 1]} no slot; every class needs >= 1 slot, "
            f"so the minimum is {need} {unit}"
            + (f" ({need / 2**20:.1f} MiB)" if unit == "bytes" else "") + "; raise the budget")
    return got


def planned_size(index, *, budget_bytes: int | None = None, slots: int | None = None,
                 page_size: int = mmap.PAGESIZE) -> int:
    """Bytes of the arena :class:`Arena` makes for this budget or slot count (nothing reserved),
    so the daemon can check it against the memory limits first."""
    counts = plan_slots(index, budget_bytes=budget_bytes, slots=slots, page_size=page_size)
    return max(arena_bytes(index, counts, page_size), page_size)


class Arena:
    """The shared slot pool of one cache: a file under ``dir``, fallocate'd, mmap'd shared, mlock'd.

    Exactly one of ``budget_bytes`` (total arena bytes, page rounding included) or ``slots``
    (total slots over all classes) is given. ``hugetlb=True`` expects ``dir`` on hugetlbfs (page
    size from statvfs). ``lock=False`` skips mlock (and the RLIMIT_MEMLOCK check; the check
    also passes when the process holds CAP_IPC_LOCK, since the kernel then ignores the limit). ``mode``/``gid``
    set the file's permissions/group so client processes can map it read-only.

    Attributes: ``path`` (str), ``size`` (bytes), ``page_size`` (bytes), ``classes``
    (list of :class:`ClassLayout`, in the index's size-class order), ``base_address`` (int,
    virtual address of the writable mapping; valid until :meth:`close`), ``locked`` (bool),
    ``keep_path`` (the private second name, see below; None when the file system refused it),
    ``relinks`` (times :meth:`check_link` put the public name back), ``link_problem`` (None, or
    why new clients cannot open ``path``).

    The file has a second, private hard link, ``keep_path`` (``.<name>`` beside it, a name no
    client uses): a client that unlinks ``path`` (``multiprocessing.shared_memory.SharedMemory``
    does when its process exits) leaves the memory and this name, and :meth:`check_link`
    puts ``path`` back. ``progress(done, total)`` is called as the file is reserved and locked
    (in chunks; ``total`` counts both passes).

    Raises :class:`ArenaError` on: a budget too small for one slot per class, a file that already
    exists, ``dir`` too small (ENOSPC at fallocate), RLIMIT_MEMLOCK below the arena size, mlock
    failure. Nothing is left behind (file unlinked) when construction fails.
    """

    def __init__(self, index, *, budget_bytes: int | None = None, slots: int | None = None,
                 dir: str = "/dev/shm", name: str | None = None, hugetlb: bool = False,
                 lock: bool = True, mode: int = 0o640, gid: int | None = None, progress=None):
        self._mm = None
        self._ctl = None
        self._fd = -1
        self._ino = None
        self.keep_path = None
        self.keep_error = None
        self.relinks = 0
        self.link_problem = None
        self.locked = False
        self.page_size = int(os.statvfs(dir).f_bsize) if hugetlb else mmap.PAGESIZE
        self.hugetlb = bool(hugetlb)
        #: what backs the arena's pages: "hugetlb", the tmpfs's huge= option (2 MiB pages where it
        #: is always / within_size: an engine's expert reads then miss the TLB 512x less often, as
        #: with a model file's page cache in large folios; not advise: fallocate allocates the
        #: pages, and no advice reaches it), or None (not a tmpfs)
        self.huge_pages = "hugetlb" if hugetlb else tmpfs_huge(dir)
        self.n_experts = int(index.n_experts)
        counts = plan_slots(index, budget_bytes=budget_bytes, slots=slots, page_size=self.page_size)
        page = self.page_size
        gen_off = CONTROL_HEADER_BYTES
        gen_offs = {}
        for sc in index.size_classes:
            gen_offs[sc.id] = gen_off
            gen_off += 8 * counts[sc.id]
        self.n_keys = n_keys(index)
        self.resmap_off = gen_off
        self.control_bytes = control_bytes(sum(counts.values()), self.n_keys, page)
        off = self.control_bytes
        self.classes: list[ClassLayout] = []
        for sc in index.size_classes:
            n = counts[sc.id]
            part_off, part_bytes = {}, {}
            for p in sc.parts:
                part_bytes[p] = int(sc.part_bytes[p])
                part_off[p] = off
                off += _round_up(n * part_bytes[p], page)
            self.classes.append(ClassLayout(
                id=int(sc.id), layers=[int(x) for x in sc.layers], parts=list(sc.parts),
                part_bytes=part_bytes, part_off=part_off, n_slots=n,
                slot_bytes=sum(part_bytes.values()),
                part_types=dict(getattr(sc, "part_types", {}) or {}), gen_off=gen_offs[sc.id]))
        self._by_id = {c.id: c for c in self.classes}
        self.size = max(off, page)
        name = name or f"moecached-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = os.path.join(dir, name)
        self.lock = bool(lock)

        if lock:
            self._check_memlock()
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        except FileExistsError:
            raise ArenaError(f"arena file {self.path} already exists (another daemon, or a stale one); "
                             f"remove it or pass another name") from None
        except OSError as e:
            raise ArenaError(f"cannot create arena file {self.path}: {e.strerror}; "
                             f"check that {dir} exists and is writable") from None
        # The owner holds an exclusive flock for the arena's life: a file under this name
        # pattern that nobody has locked was left by a daemon that died (remove_stale_arenas).
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st = os.fstat(self._fd)
        self._ino = (st.st_dev, st.st_ino)
        try:
            keep = os.path.join(dir, "." + name)
            try:
                os.link(self.path, keep)
                self.keep_path = keep
            except OSError as e:
                self.keep_error = f"cannot make the private link {keep}: {e.strerror}"
            os.fchmod(self._fd, mode)  # umask must not narrow what clients were promised
            if gid is not None:
                os.fchown(self._fd, -1, gid)
            total = self.size * (2 if lock else 1)
            step = max(CHUNK_BYTES, _round_up(self.size // 100, page))
            try:
                if not hugetlb:   # the whole size first: a huge=within_size tmpfs then backs all of it
                    os.ftruncate(self._fd, self.size)
                for a in range(0, self.size, step):
                    os.posix_fallocate(self._fd, a, min(step, self.size - a))
                    if progress is not None:
                        progress(min(a + step, self.size), total)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    st = os.statvfs(dir)
                    raise ArenaError(
                        f"cannot reserve {self.size} bytes ({self.size / 2**20:.1f} MiB) for {self.path}: "
                        f"{dir} has {st.f_bavail * st.f_frsize} bytes free of "
                        f"{st.f_blocks * st.f_frsize}; enlarge it (mount -o remount,size=... {dir}) "
                        f"or lower the budget") from None
                raise ArenaError(f"posix_fallocate({self.path}, {self.size}) failed: {e.strerror}; "
                                 f"use a tmpfs/hugetlbfs dir that supports fallocate") from None
            self._mm = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
            anchor = ctypes.c_char.from_buffer(self._mm)
            self.base_address = ctypes.addressof(anchor)
            del anchor
            self._np = np.frombuffer(self._mm, dtype=np.uint8)
            self._ctl = np.frombuffer(self._mm, dtype=np.uint64, count=self.control_bytes // 8)
            self._ctl[:] = 0
            self._ctl[0] = np.frombuffer(CONTROL_MAGIC, dtype=np.uint64)[0]
            self._ctl[NCLASSES_OFF // 8] = len(self.classes)
            self._ctl[NKEYS_OFF // 8] = self.n_keys
            self._ctl[RESMAP_OFF_OFF // 8] = self.resmap_off
            self.set_epoch(int.from_bytes(os.urandom(8), "little") >> 1 | 1, STATE_SERVING)
            if lock:
                self.locked = True   # teardown munlocks the whole range, also after a failure
                for a in range(0, self.size, step):
                    self._mlock(a, min(step, self.size - a))
                    if progress is not None:
                        progress(self.size + min(a + step, self.size), total)
        except BaseException:
            self._teardown(unlink=True)
            raise

    # ---- locking -------------------------------------------------------------------------
    def _check_memlock(self) -> None:
        have = memlock_room()
        if have is not None and have < self.size:
            soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            raise ArenaError(
                f"RLIMIT_MEMLOCK is {soft} bytes ({soft // 1024} KiB), {max(have, 0)} left, but arena "
                f"{self.path} needs {self.size} bytes locked; set LimitMEMLOCK=infinity in the systemd "
                f"unit or run 'ulimit -l unlimited' before starting (or pass lock=False / --no-lock-memory)")

    def _mlock(self, off: int, length: int) -> None:
        if length <= 0:
            return
        if _libc.mlock(ctypes.c_void_p(self.base_address + off), ctypes.c_size_t(length)) != 0:
            err = ctypes.get_errno()
            _libc.munlock(ctypes.c_void_p(self.base_address + off), ctypes.c_size_t(length))
            raise ArenaError(
                f"mlock of {length} bytes at offset {off} of {self.path} failed: {os.strerror(err)}; "
                f"raise the locked-memory limit (systemd LimitMEMLOCK=infinity, ulimit -l unlimited), "
                f"free RAM, or pass lock=False")

    # ---- addressing ----------------------------------------------------------------------
    def layout(self, class_id: int) -> ClassLayout:
        """The :class:`ClassLayout` of class ``class_id`` (KeyError-safe: raises ArenaError)."""
        try:
            return self._by_id[class_id]
        except KeyError:
            raise ArenaError(f"no size class {class_id} in arena {self.path}; classes are "
                             f"{sorted(self._by_id)}") from None

    def part_offset(self, class_id: int, slot: int, part: str) -> int:
        """Byte offset in the arena file of part ``part`` of slot ``slot`` of class ``class_id``."""
        c = self.layout(class_id)
        if not 0 <= slot < c.n_slots:
            raise ArenaError(f"slot {slot} out of range for class {class_id} of {self.path} "
                             f"(0..{c.n_slots - 1})")
        return c.part_off[part] + slot * c.part_bytes[part]

    def view(self, class_id: int, slot: int, part: str) -> np.ndarray:
        """Writable uint8 view, shape ``(part_bytes[part],)``, of one slot's part."""
        off = self.part_offset(class_id, slot, part)
        return self._np[off:off + self._by_id[class_id].part_bytes[part]]

    def descriptor(self) -> dict:
        """JSON-able layout: everything another process needs to map the file and find a part.

        Keys: ``version``, ``path``, ``size`` (bytes), ``page_size``, ``hugetlb``, ``huge_pages``
        (what backs the pages: ``hugetlb``, the tmpfs's ``huge=`` option, or None), ``n_experts``,
        ``classes`` (list of dicts: id, layers, parts, part_bytes, part_off, n_slots, slot_bytes,
        part_types, gen_off), ``layer_class`` ({str(layer): class id}), ``control`` (off,
        bytes, magic, epoch_off, state_off: the control block, see the module doc).
        """
        return {"version": DESCRIPTOR_VERSION, "path": self.path, "size": self.size,
                "page_size": self.page_size, "hugetlb": self.hugetlb, "huge_pages": self.huge_pages,
                "n_experts": self.n_experts,
                "control": {"off": 0, "bytes": self.control_bytes, "magic": CONTROL_MAGIC.decode(),
                            "epoch_off": EPOCH_OFF, "state_off": STATE_OFF, "releases_off": RELEASES_OFF,
                            "n_keys": self.n_keys, "resmap_off": self.resmap_off},
                "classes": [c.to_dict() for c in self.classes],
                "layer_class": {str(l): c.id for c in self.classes for l in c.layers}}

    # ---- control block (epoch, state, slot generations) ------------------------------------
    @property
    def epoch(self) -> int:
        return int(self._ctl[EPOCH_OFF // 8])

    def set_epoch(self, epoch: int, state: int | None = None) -> None:
        """Publish the serving daemon's session id (0: nobody serves this arena any more) and,
        when given, the state word. Every lease of an earlier epoch reads as invalid."""
        if state is not None:
            self._ctl[STATE_OFF // 8] = state
        self._ctl[EPOCH_OFF // 8] = epoch

    def set_state(self, state: int) -> None:
        self._ctl[STATE_OFF // 8] = state

    def resident_map(self) -> np.ndarray:
        """The writable u64 resident map (one word per key: 0, or slot + 1)."""
        return self._ctl[self.resmap_off // 8: self.resmap_off // 8 + self.n_keys]

    def generations(self, class_id: int) -> np.ndarray:
        """The writable u64 generation array of class ``class_id`` (one word per slot)."""
        c = self.layout(class_id)
        return self._ctl[c.gen_off // 8: c.gen_off // 8 + c.n_slots]

    # ---- release / restore ---------------------------------------------------------------
    def _slot_ranges(self, class_id: int, slots: list[int]) -> list[tuple[int, int]]:
        """Merged [start, end) byte ranges of the given slots' parts, sorted."""
        c = self.layout(class_id)
        ss = sorted(set(int(s) for s in slots))
        for s in ss:
            if not 0 <= s < c.n_slots:
                raise ArenaError(f"slot {s} out of range for class {class_id} of {self.path} "
                                 f"(0..{c.n_slots - 1})")
        out = []
        for p in c.parts:
            pb, po = c.part_bytes[p], c.part_off[p]
            run_start = prev = None
            for s in ss:
                if prev is not None and s == prev + 1:
                    prev = s
                    continue
                if run_start is not None:
                    out.append((po + run_start * pb, po + (prev + 1) * pb))
                run_start = prev = s
            if run_start is not None:
                out.append((po + run_start * pb, po + (prev + 1) * pb))
        return sorted(out)

    def _hole_ranges(self, class_id: int, slots: list[int]) -> list[tuple[int, int]]:
        """The [start, end) ranges of whole pages inside these slots' part ranges: what
        :meth:`release_memory` punches."""
        page = self.page_size
        out = []
        for a, b in self._slot_ranges(class_id, slots):
            a2, b2 = _round_up(a, page), b // page * page
            if b2 > a2:
                out.append((a2, b2))
        return out

    def hole_bytes(self, class_id: int, slots: list[int]) -> int:
        """Bytes :meth:`release_memory` gives back for these slots (whole pages only)."""
        return sum(b - a for a, b in self._hole_ranges(class_id, slots))

    def allocated_bytes(self) -> int:
        """Bytes the arena file holds in memory now (``st_blocks``: a hole holds none). A
        process that reads a hole through a mapping of a tmpfs file makes the kernel allocate
        a page there, so this can grow back after :meth:`release_memory`."""
        return os.fstat(self._fd).st_blocks * 512 if self._fd >= 0 else 0

    def release_memory(self, class_id: int, slots: list[int]) -> int:
        """Give back the pages lying wholly inside these slots' part ranges (munlock + punch hole).

        Pages shared with a neighbouring slot stay. The slots' contents become undefined (zeros);
        call :meth:`restore_memory` before reusing them. Returns bytes released. The control
        block's releases word moves first: a client that registered the arena's pages (a GPU
        reading it in place) registers them again, else it would keep reading the pages given
        back after the slots are refilled with new ones.
        """
        total = 0
        bumped = False
        for a2, b2 in self._hole_ranges(class_id, slots):
            if not bumped and self._ctl is not None:
                self._ctl[RELEASES_OFF // 8] += 1
                bumped = True
            n = b2 - a2
            if self.locked:
                _libc.munlock(ctypes.c_void_p(self.base_address + a2), ctypes.c_size_t(n))
            if _libc.fallocate(self._fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, a2, n) != 0:
                err = ctypes.get_errno()
                if _libc.madvise(ctypes.c_void_p(self.base_address + a2), ctypes.c_size_t(n),
                                 MADV_REMOVE) != 0:
                    if self.locked:
                        self._mlock(a2, n)
                    raise ArenaError(f"cannot release {n} bytes at offset {a2} of {self.path}: "
                                     f"{os.strerror(err)}; the filesystem must support hole punching")
            total += n
        return total

    def populate(self, class_id: int, slots: list[int]) -> int:
        """Map these slots' pages into this process now (``MADV_POPULATE_WRITE``; a locked
        arena is mapped already): a fill does it for the next run's slots while the readers read
        the one before, so their O_DIRECT reads do not fault the pages in one by one. Best
        effort; returns bytes populated (0 where the kernel lacks it)."""
        if self.locked or self._mm is None:
            return 0
        page, total = self.page_size, 0
        for a, b in self._slot_ranges(class_id, slots):
            a2, b2 = a // page * page, _round_up(b, page)
            if _libc.madvise(ctypes.c_void_p(self.base_address + a2), ctypes.c_size_t(b2 - a2),
                             MADV_POPULATE_WRITE) != 0:
                return total
            total += b2 - a2
        return total

    def restore_memory(self, class_id: int, slots: list[int]) -> None:
        """Re-reserve (fallocate) and re-lock every page touching these slots' parts.

        Raises :class:`ArenaError` if the filesystem is full or locking fails. Contents are zero
        where pages had been released.
        """
        page = self.page_size
        for a, b in self._slot_ranges(class_id, slots):
            a2, b2 = a // page * page, _round_up(b, page)
            try:
                os.posix_fallocate(self._fd, a2, b2 - a2)
            except OSError as e:
                raise ArenaError(f"cannot re-reserve {b2 - a2} bytes at offset {a2} of {self.path}: "
                                 f"{e.strerror}; free space in {os.path.dirname(self.path)}") from None
            if self.locked:
                self._mlock(a2, b2 - a2)

    # ---- lifetime ------------------------------------------------------------------------
    def _teardown(self, unlink: bool) -> None:
        self._np = None
        if getattr(self, "_ctl", None) is not None:
            self._ctl[EPOCH_OFF // 8] = 0        # every lease on this arena is void from now
            self._ctl[STATE_OFF // 8] = STATE_STOPPED
            self._ctl = None
        if self._mm is not None:
            if self.locked:
                _libc.munlock(ctypes.c_void_p(self.base_address), ctypes.c_size_t(self.size))
                self.locked = False
            try:
                self._mm.close()
            except BufferError:
                pass  # views still alive: the mapping goes when the last one does
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if unlink:
            for p in (self.path, self.keep_path):
                if p is not None and self._is_ours(p):  # never another file put under the name
                    try:
                        os.unlink(p)
                    except FileNotFoundError:
                        pass
            self.keep_path = None

    def _is_ours(self, path: str):
        """True when ``path`` names this arena's file, False when it is missing, None when it
        names another file."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        return True if (st.st_dev, st.st_ino) == self._ino else None

    def check_link(self) -> str:
        """Check that clients can still open ``path`` and repair it: ``"ok"``, ``"relinked"``
        (the name had been unlinked and is back: same file, same bytes), or a one-line problem
        (also kept in ``link_problem``) when it cannot be repaired. A missing private link is
        made again. Cheap (two ``stat``); the daemon calls it at every periodic tick."""
        if self._fd < 0:
            return "ok"
        pub = self._is_ours(self.path)
        if self.keep_path is not None and self._is_ours(self.keep_path) is False and pub:
            try:
                os.link(self.path, self.keep_path)
            except OSError:
                pass
        if pub:
            self.link_problem = None
            return "ok"
        if pub is None:
            self.link_problem = (f"arena path {self.path} names another file now; new clients would map "
                                 f"it: remove that file (the daemon then puts the arena back)")
            return self.link_problem
        err = None
        for src, follow in ((self.keep_path, False), (f"/proc/self/fd/{self._fd}", True)):
            if src is None or (not follow and not self._is_ours(src)):
                continue
            try:
                os.link(src, self.path, follow_symlinks=follow)
            except OSError as e:
                err = e.strerror
                continue
            if self._is_ours(self.path):
                self.relinks += 1
                self.link_problem = None
                return "relinked"
        self.link_problem = (f"arena file {self.path} was unlinked and cannot be put back "
                             f"({err or 'no other name left'}); new clients cannot attach: restart the daemon")
        return self.link_problem

    def close(self, unlink: bool = True) -> None:
        """Unlock, unmap and (default) unlink the arena file. Idempotent."""
        self._teardown(unlink)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if self._mm is not None or self._fd >= 0:
                self._teardown(unlink=True)  # nobody can reach it any more: give the memory back
        except Exception:
            pass


ARENA_PREFIX = "moecached-"

#: Bytes reserved (fallocate) and locked (mlock) per step, for progress; at least 1% of the arena.
CHUNK_BYTES = 64 << 20


def remove_stale_arenas(dir: str = "/dev/shm", log=None) -> list[str]:
    """Unlink arena files in ``dir`` left by daemons that died without cleaning up.

    A live arena's owner holds an exclusive ``flock`` on it; a ``moecached-*`` file nobody
    locks is stale (its owner was SIGKILLed or crashed). Shared memory is not reclaimable,
    so each one pins its whole size until removed. An arena has two names, ``moecached-*``
    and its private ``.moecached-*`` (:class:`Arena`); both go, and a private name whose public
    one a client unlinked goes too. Returns one path per arena removed (its public name, or the
    private one when that was all that was left); files that cannot be opened or locked are
    left alone, and so are empty ones (a daemon between creating and locking its arena: it
    holds no memory), and so are files that are not ours (no arena or pin-file magic and not an
    arena name of older versions) whatever their names. One log line per arena.
    """
    removed = []
    try:
        names = sorted(os.listdir(dir))
    except OSError:
        return removed
    stale: dict = {}   # (dev, ino) -> [size, [paths]], in listing order
    for name in names:
        if not (name.startswith(ARENA_PREFIX) or name.startswith("." + ARENA_PREFIX)):
            continue
        path = os.path.join(dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            magic = os.pread(fd, 8, 0)
            if magic not in (CONTROL_MAGIC, PIN_MAGIC) and not _OLD_ARENA_NAME.fullmatch(name):
                continue  # not a file of ours, whatever its name says
            if st.st_size == 0:
                continue  # a daemon created it and locks it next (nothing reserved yet)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # owned by a live daemon
            if magic == CONTROL_MAGIC:
                # clients that still map it see epoch 0: their leases read as invalid
                os.pwrite(fd, bytes(16), EPOCH_OFF)
            # unlinked while we hold the lock: a daemon starting now cannot take it first
            os.unlink(path)
            stale.setdefault((st.st_dev, st.st_ino), [st.st_size, []])[1].append(name)
        finally:
            os.close(fd)
    for size, ns in stale.values():
        shown = os.path.join(dir, min(ns, key=lambda n: n.startswith(".")))  # public name first
        removed.append(shown)
        if log is not None:
            log.warning("removed stale arena %s (%.1f MiB) left by a daemon that died", shown, size / 2**20)
    return sorted(removed)
