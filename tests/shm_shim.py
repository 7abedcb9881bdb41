"""A test client of the shared-memory hit path: the client half of ``moecache_shm.h``
(``mcshm_pin``, ``mcshm_unpin``, ``mcshm_valid``), compiled into a tiny shared library and
called through ctypes, plus a raw ZeroMQ DEALER for hello and socket acquires.

Tests drive the daemon through this the way a C engine would, and read pin files, the
resident map and slot bytes directly. Not a client library: a harness.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import os
import subprocess
import tempfile

import msgpack
import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INCLUDE = os.path.join(ROOT, "clients", "c", "include")

_SHIM_C = r"""
#include "moecache_shm.h"
#include <stdlib.h>
typedef struct { mcshm_layout m; uint32_t kc[4096]; } shim_t;
void *shim_new(void *ctl, void *pin, uint64_t session, uint32_t n_experts, uint32_t n_keys,
               uint32_t n_classes, uint32_t ring_n, const uint32_t *key_class, uint32_t n_moe,
               const uint64_t *gen_off, const uint32_t *n_slots, uint64_t resmap_off,
               uint64_t pins_off, uint64_t ring_off) {
    shim_t *h = calloc(1, sizeof *h);
    uint32_t base = 0;
    h->m.ctl = ctl; h->m.pin = pin; h->m.session = session; h->m.n_experts = n_experts;
    h->m.n_keys = n_keys; h->m.n_classes = n_classes; h->m.ring_n = ring_n;
    for (uint32_t i = 0; i < n_moe && i < 4096; i++) h->kc[i] = key_class[i];
    h->m.key_class = h->kc;
    for (uint32_t c = 0; c < n_classes; c++) {
        h->m.gen_word[c] = gen_off[c] / 8; h->m.slot_base[c] = base; h->m.n_slots[c] = n_slots[c];
        base += n_slots[c];
    }
    h->m.resmap_word = resmap_off / 8; h->m.pins_word32 = pins_off / 4; h->m.ring_word = ring_off / 8;
    return h;
}
int shim_pin(void *h, const uint32_t *keys, uint32_t n, mcshm_item *out) {
    return mcshm_pin(&((shim_t *)h)->m, keys, n, out);
}
void shim_unpin(void *h, const mcshm_item *it, uint32_t n) { mcshm_unpin(&((shim_t *)h)->m, it, n); }
int shim_valid(void *h, uint64_t s, const mcshm_item *it, uint32_t n) {
    return mcshm_valid(&((shim_t *)h)->m, s, it, n);
}
"""

OK, MISS, STALE, RING_FULL, BAD = 0, 1, 2, 3, 4

_lib = None
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT_READ, PROT_WRITE, MAP_SHARED = 1, 2, 1


class Item(ctypes.Structure):
    _fields_ = [("cls", ctypes.c_uint32), ("slot", ctypes.c_uint32), ("gen", ctypes.c_uint64)]


def lib():
    """The compiled shim (built once per process into a temporary directory)."""
    global _lib
    if _lib is None:
        d = tempfile.mkdtemp(prefix="moecache-shim-")
        src, so = os.path.join(d, "shim.c"), os.path.join(d, "shim.so")
        with open(src, "w") as f:
            f.write(_SHIM_C)
        subprocess.run(["cc", "-std=c11", "-O2", "-shared", "-fPIC", "-I", INCLUDE, src, "-o", so],
                       check=True)
        _lib = ctypes.CDLL(so)
        _lib.shim_new.restype = ctypes.c_void_p
        _lib.shim_new.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64] + \
            [ctypes.c_uint32] * 4 + [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p] + \
            [ctypes.c_uint64] * 3
        _lib.shim_pin.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p]
        _lib.shim_unpin.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32]
        _lib.shim_valid.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint32]
    return _lib


def fetch_pin_fd(pins):
    """The pin file's fd from the daemon's door (a sealed memfd; docs/protocol.md)."""
    import socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(pins["door"])
        s.sendall(pins["token"].encode())
        msg, fds, _, _ = socket.recv_fds(s, 16, 1)
    assert msg == b"ok" and len(fds) == 1, msg
    return fds[0]


def _map(path, size, writable, fd=None):
    """Map ``path`` (or the open ``fd``, which this closes)."""
    if fd is None:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        prot = PROT_READ | (PROT_WRITE if writable else 0)
        a = _libc.mmap(None, size, prot, MAP_SHARED, fd, 0)
        if a in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        return a
    finally:
        os.close(fd)


def shim_layout(arena, pins, session, ctl_addr, pin_addr):
    """An ``mcshm_layout`` (in the shim) from an arena descriptor (``hello.arena`` or
    ``ExpertCache.descriptor()``) and a ``pins`` map, over mappings at these addresses."""
    layers = list(arena["expert_layers"])
    classes = sorted(arena["classes"], key=lambda c: c["id"])
    kc = (ctypes.c_uint32 * len(layers))(*[arena["layer_class"][str(l)] for l in layers])
    go = (ctypes.c_uint64 * len(classes))(*[c["gen_off"] for c in classes])
    ns = (ctypes.c_uint32 * len(classes))(*[c["n_slots"] for c in classes])
    return lib().shim_new(ctl_addr, pin_addr, session, arena["n_experts"], arena["control"]["n_keys"],
                          len(classes), pins["ring_n"], kc, len(layers), go, ns,
                          arena["control"]["resmap_off"], pins["pins_off"], pins["ring_off"])


def map_file(path, size, writable):
    """Map ``path`` shared (read-only unless ``writable``); returns the address."""
    return _map(path, size, writable)


def process_start_time(pid):
    from moecached.service.server import process_start_time as pst
    return pst(pid)


class FastClient:
    """One DEALER connection that says hello with ``fast_path`` and pins through shared memory.

    ``pin(layer, experts)`` -> list of :class:`Item` or an int result code (nothing pinned);
    ``unpin(items)``; ``valid(items)``; ``acquire(layer, experts)`` -> reply dict (socket);
    ``release(lease)``; ``call(op, **fields)``. Attributes after hello: ``hello`` (reply),
    ``pins`` (its ``pins`` field), ``arena`` (descriptor), ``session``.
    """

    def __init__(self, endpoint, *, fast_path=True, watched=True, name="fast"):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 20000)
        self.sock.connect(endpoint)
        self.ids = itertools.count(1)
        self.name = name
        hello = {"client": name, "fast_path": fast_path, "pin_fd": True}
        if watched:
            hello.update(pid=os.getpid(), pid_start=process_start_time(os.getpid()))
        self.hello = self.call("hello", **hello)
        self.session = self.hello["session"]
        self.arena = a = self.hello["arena"]
        self.pins = self.hello.get("pins")
        self.n_experts = a["n_experts"]
        self.layers = list(a["expert_layers"])
        self.ctl = _map(a["path"], a["size"], False)
        self.h = None
        self.pin_addr = None
        if self.pins:
            self.pin_fd = fetch_pin_fd(self.pins)    # kept open: tests look at the file through it
            self.pin_addr = _map(None, self.pins["size"], True, os.dup(self.pin_fd))
            self.h = shim_layout(a, self.pins, self.session, self.ctl, self.pin_addr)

    # ---- socket ----------------------------------------------------------------------------
    def call(self, op, **fields):
        rid = next(self.ids)
        self.sock.send(msgpack.packb({"v": 1, "id": rid, "op": op, **fields}))
        while True:
            r = msgpack.unpackb(self.sock.recv(), strict_map_key=False)
            if r["id"] == rid:
                return r

    def acquire(self, layer, experts):
        r = self.call("acquire", layer=layer, experts=list(experts))
        assert r["ok"], r
        return r

    def release(self, lease):
        r = self.call("release", lease=lease)
        assert r["ok"], r

    def stats(self):
        return self.call("stats")["stats"]

    def me(self, st=None):
        """This client's entry in ``stats`` (by name)."""
        st = st or self.stats()
        return next(c for c in st["clients"] if c["name"] == self.name)

    # ---- shared memory -----------------------------------------------------------------------
    def key(self, layer, expert):
        return self.layers.index(layer) * self.n_experts + expert

    def pin(self, layer, experts):
        keys = (ctypes.c_uint32 * len(experts))(*[self.key(layer, e) for e in experts])
        out = (Item * len(experts))()
        r = lib().shim_pin(self.h, keys, len(experts), out)
        return list(out) if r == OK else r

    def unpin(self, items):
        arr = (Item * len(items))(*items)
        lib().shim_unpin(self.h, arr, len(items))

    def valid(self, items):
        arr = (Item * len(items))(*items)
        return bool(lib().shim_valid(self.h, self.session, arr, len(items)))

    # ---- raw views ---------------------------------------------------------------------------
    def ctl_word(self, i):
        return ctypes.c_uint64.from_address(self.ctl + 8 * i).value

    def resident(self, layer, expert):
        """Resident map entry (0, or slot + 1)."""
        return self.ctl_word(self.arena["control"]["resmap_off"] // 8 + self.key(layer, expert))

    def generation(self, cls, slot):
        c = next(c for c in self.arena["classes"] if c["id"] == cls)
        return self.ctl_word(c["gen_off"] // 8 + slot)

    def part(self, cls, slot, part):
        c = next(c for c in self.arena["classes"] if c["id"] == cls)
        off = c["part_off"][part] + slot * c["part_bytes"][part]
        return ctypes.string_at(self.ctl + off, c["part_bytes"][part])

    def pin_words(self):
        """The pin file as a writable ctypes u64 array (for tests that scribble on it)."""
        return (ctypes.c_uint64 * (self.pins["size"] // 8)).from_address(self.pin_addr)

    def close(self):
        try:
            self.call("bye")
        except Exception:
            pass
        self.sock.close(linger=0)
