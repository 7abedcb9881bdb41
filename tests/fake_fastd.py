"""A scripted daemon side of the shared-memory hit path, for the client's tests.

It writes an arena file (control block: header, generations, resident map; slot arrays) and a
pin file exactly as docs/protocol.md ("The arena", "Shared-memory hit path") lays them out,
with numpy, and answers hello / acquire / release / ping / bye / stats on a ZeroMQ ROUTER from
a thread, counting every request by op. The test plays the rest of the daemon: it publishes
experts in the resident map, bumps generations, changes the epoch, reads pin counts and the
ring. Two size classes (different part sizes) so class slot bases are exercised.
"""
from __future__ import annotations

import collections
import threading

import msgpack
import numpy as np
import zmq

PAGE = 4096
EXPERT_LAYERS = [3, 4, 5]          # blocks 0-2 dense; class 0: layers 3 and 5, class 1: layer 4
LAYER_CLASS = {3: 0, 5: 0, 4: 1}
N_EXPERTS = 8
CLASSES = [  # id, n_slots, part bytes
    {"id": 0, "n_slots": 10, "parts": {"gate": 96, "down": 64}},
    {"id": 1, "n_slots": 5, "parts": {"gate": 40, "down": 24}},
]
RING_N = 16
PIN_HEADER = 192


def expert_bytes(layer: int, expert: int, part: str, n: int) -> np.ndarray:
    """The 'model file' bytes of one part of one expert (distinct per layer, expert, part)."""
    seed = layer * 1000 + expert * 10 + (1 if part == "gate" else 2)
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class FakeDaemon:
    def __init__(self, tmp, session: int = 0x1234_5678):
        self.dir = str(tmp)
        self.endpoint = f"ipc://{self.dir}/fake.sock"
        self.session = session
        self.counts = collections.Counter()
        self.hellos: list[dict] = []
        self.offer_pins = True
        self.max_request_experts = 64
        self.drain_on_request = True
        n_keys = len(EXPERT_LAYERS) * N_EXPERTS
        total_slots = sum(c["n_slots"] for c in CLASSES)
        self.gen_off, off = {}, 64
        for c in CLASSES:
            self.gen_off[c["id"]] = off
            off += 8 * c["n_slots"]
        self.resmap_off = off
        ctl_bytes = -(-(off + 8 * n_keys) // PAGE) * PAGE
        self.part_off, off = {}, ctl_bytes
        for c in CLASSES:
            for p, n in c["parts"].items():
                self.part_off[(c["id"], p)] = off
                off += -(-(n * c["n_slots"]) // PAGE) * PAGE
        self.size = off
        self.path = f"{self.dir}/moecached-fake-arena"
        with open(self.path, "wb") as f:
            f.truncate(self.size)
        self.mem = np.memmap(self.path, dtype=np.uint8, mode="r+")
        self.ctl = self.mem[:ctl_bytes].view(np.uint64)
        self.ctl[0] = int.from_bytes(b"MOECTL01", "little")
        self.ctl[1] = session
        self.ctl[2] = 1
        self.ctl[3] = len(CLASSES)
        self.ctl[4] = n_keys
        self.ctl[5] = self.resmap_off
        self.slot_base = {0: 0, 1: CLASSES[0]["n_slots"]}
        self.desc = {
            "version": 2, "path": self.path, "size": self.size, "page_size": PAGE, "hugetlb": False,
            "n_experts": N_EXPERTS,
            "control": {"off": 0, "bytes": ctl_bytes, "magic": "MOECTL01", "epoch_off": 8,
                        "state_off": 16, "n_keys": n_keys, "resmap_off": self.resmap_off},
            "classes": [{"id": c["id"], "layers": [l for l in EXPERT_LAYERS if LAYER_CLASS[l] == c["id"]],
                         "parts": list(c["parts"]), "part_bytes": dict(c["parts"]),
                         "part_off": {p: self.part_off[(c["id"], p)] for p in c["parts"]},
                         "part_types": {p: "Q8_0" for p in c["parts"]}, "n_slots": c["n_slots"],
                         "slot_bytes": sum(c["parts"].values()), "gen_off": self.gen_off[c["id"]]}
                        for c in CLASSES],
            "layer_class": {str(l): c for l, c in LAYER_CLASS.items()}}
        # pin file
        self.pins_off = PIN_HEADER
        self.ring_off = -(-(PIN_HEADER + 4 * total_slots) // 64) * 64
        self.pin_size = self.ring_off + 16 * RING_N
        self.pin_path = f"{self.dir}/moecached-fake-pins"
        with open(self.pin_path, "wb") as f:
            f.truncate(self.pin_size)
        self.pmem = np.memmap(self.pin_path, dtype=np.uint8, mode="r+")
        pw = self.pmem[:PIN_HEADER].view(np.uint64)
        pw[0] = int.from_bytes(b"MOEPIN01", "little")
        pw[1], pw[2], pw[3], pw[4], pw[5], pw[6] = session, total_slots, RING_N, self.pins_off, self.ring_off, 64
        self.pw = pw
        self.pin_counts = self.pmem[self.pins_off:self.pins_off + 4 * total_slots].view(np.uint32)
        self.ring = self.pmem[self.ring_off:self.ring_off + 16 * RING_N].view(np.uint64).reshape(RING_N, 2)
        self.drained: list[int] = []   # keys (not key + 1) taken from the ring, in order
        self.leases: dict[int, list] = {}
        self.lease_gens: dict[int, list] = {}
        self._next_lease = 1
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    # ---- the test plays the daemon's cache ---------------------------------------------
    def key(self, layer: int, expert: int) -> int:
        return EXPERT_LAYERS.index(layer) * N_EXPERTS + expert

    def resmap(self) -> np.ndarray:
        return self.ctl[self.resmap_off // 8: self.resmap_off // 8 + len(EXPERT_LAYERS) * N_EXPERTS]

    def gens(self, cls: int) -> np.ndarray:
        return self.ctl[self.gen_off[cls] // 8: self.gen_off[cls] // 8 + CLASSES[cls]["n_slots"]]

    def load(self, layer: int, expert: int, slot: int | None = None) -> int:
        """Make an expert resident: write its bytes into a slot, then publish it."""
        cls = LAYER_CLASS[layer]
        rm = self.resmap()
        k = self.key(layer, expert)
        if rm[k]:
            return int(rm[k]) - 1
        if slot is None:
            used = {int(rm[self.key(l, e)]) - 1 for l in EXPERT_LAYERS if LAYER_CLASS[l] == cls
                    for e in range(N_EXPERTS) if rm[self.key(l, e)]}
            slot = min(set(range(CLASSES[cls]["n_slots"])) - used)
        for p, n in CLASSES[cls]["parts"].items():
            off = self.part_off[(cls, p)] + slot * n
            self.mem[off:off + n] = expert_bytes(layer, expert, p, n)
        rm[k] = slot + 1
        return slot

    def pinned(self, cls: int, slot: int) -> int:
        return int(self.pin_counts[self.slot_base[cls] + slot])

    def evict(self, layer: int, expert: int) -> bool:
        """The daemon's eviction rule (pins first; a pinned slot is not taken)."""
        k = self.key(layer, expert)
        rm = self.resmap()
        slot = int(rm[k]) - 1
        cls = LAYER_CLASS[layer]
        if slot < 0 or self.pinned(cls, slot):
            return False
        rm[k] = 0
        self.gens(cls)[slot] += 1
        return True

    def restart(self, session: int) -> None:
        """A new daemon instance serving the same file (the client sees a new epoch)."""
        self.session = session
        self.ctl[1] = session
        self.pw[1] = session

    def ring_pending(self) -> int:
        return int(self.pw[8] - self.pw[16])

    def drain(self) -> None:
        head, tail = int(self.pw[8]), int(self.pw[16])
        for j in range(tail, head):
            self.drained.append(int(self.ring[j % RING_N][0]) - 1)
        self.pw[16] = head

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        del self.mem, self.pmem, self.ctl, self.pw, self.pin_counts, self.ring

    # ---- the socket -------------------------------------------------------------------------
    def _serve(self):
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(20):
                continue
            frames = self._sock.recv_multipart()
            msg = msgpack.unpackb(frames[-1], raw=False)
            op = msg["op"]
            self.counts[op] += 1
            if self.drain_on_request:
                self.drain()
            rep = {"v": 1, "id": msg["id"], "ok": True, "session": self.session}
            try:
                rep.update(getattr(self, "_op_" + op)(msg))
            except KeyError as e:
                rep.update(ok=False, error={"code": "bad_type", "message": str(e)})
            if rep.pop("_noreply", False) or (msg.get("noreply") and rep["ok"]):
                continue
            self._sock.send_multipart(frames[:-1] + [msgpack.packb(rep, use_bin_type=True)])

    def _op_hello(self, msg):
        self.hellos.append(msg)
        fast = msg.get("fast_path") is True and "pid_start" in msg and self.offer_pins
        return {"protocol": 1, "server": "fake", "fingerprint": "f", "model": "fake",
                "arena": self.desc, "expert_layers": EXPERT_LAYERS, "n_experts": N_EXPERTS, "top_k": 2,
                "index": {}, "heartbeat_s": 5.0, "lease_watch": "process",
                "limits": {"max_request_experts": self.max_request_experts},
                "pins": ({"path": self.pin_path, "size": self.pin_size, "ring_n": RING_N,
                          "pins_off": self.pins_off, "ring_off": self.ring_off, "quota": 64}
                         if fast else None)}

    def _op_acquire(self, msg):
        groups = msg["layers"] if "layers" in msg else [[msg["layer"], msg["experts"]]]
        items, gens = [], []
        for layer, experts in groups:
            if layer not in LAYER_CLASS or len(set(experts)) != len(experts):
                raise KeyError(f"bad request {groups}")
            for e in experts:
                slot = self.load(layer, e)
                cls = LAYER_CLASS[layer]
                items.append([layer, e, cls, slot])
                gens.append(int(self.gens(cls)[slot]))
        lid = self._next_lease
        self._next_lease += 1
        self.leases[lid] = items
        self.lease_gens[lid] = gens
        return {"lease": lid, "items": items, "gens": gens, "hits": 0, "prefetch_hits": 0,
                "misses": len(items), "stall_us": 0}

    def _op_release(self, msg):
        self.leases.pop(msg["lease"], None)
        return {"released": 1}

    def _op_check(self, msg):
        """Held: granted, not released, and (a fake's revocation) no slot of it reused since."""
        def held(lid):
            items = self.leases.get(lid)
            return items is not None and all(
                int(self.gens(cls)[slot]) == g for (_, _, cls, slot), g in zip(items, self.lease_gens[lid]))
        return {"held": [held(lid) for lid in msg["leases"]]}

    def _op_ping(self, msg):
        return {"t": 0.0}

    def _op_bye(self, msg):
        return {"released": 0}

    def _op_stats(self, msg):
        return {"stats": dict(self.counts)}
