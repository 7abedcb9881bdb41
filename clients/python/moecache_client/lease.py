"""What a client holds: the read-only mapping of the daemon's arena (:class:`Arena`), a
:class:`Lease` on experts in it, a :class:`LeaseFuture` of one, and the :class:`Subst`
options of an acquire. A lease's validity is the shared-memory rule of
``clients/c/include/moecache_shm.h`` (through the compiled extension) or, socket-only,
the daemon's word."""
from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING, Iterable, Self, Sequence

import numpy as np

from ._call import _Call
from .errors import ClientError, LeaseInvalid

if TYPE_CHECKING:
    from . import Client

DESCRIPTOR_VERSION = 2     # the arena descriptor this client reads (control block included)
_CONTROL_MAGIC = b"MOECTL01"


class _Arena:
    """A read-only mapping of the daemon's arena file plus its layout descriptor
    (``Client.arena``): ``address`` (base address of the mapping, for an engine that hands the
    slot arrays to its kernels), ``size`` (bytes), ``descriptor`` (hello's ``arena`` map)."""

    shm = None   # the session's moecache_client._shm.Shm (compiled client only)

    def __init__(self, desc: dict):
        self.desc = desc
        if desc.get("version") != DESCRIPTOR_VERSION:
            raise ClientError(f"arena descriptor version {desc.get('version')!r}: this client reads "
                              f"version {DESCRIPTOR_VERSION}; install the client that matches the daemon")
        fd = os.open(desc["path"], os.O_RDONLY)
        try:
            self.mm = mmap.mmap(fd, desc["size"], mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self.mm, dtype=np.uint8)
        self.classes = {int(c["id"]): c for c in desc["classes"]}
        ctl = desc["control"]
        if bytes(self.buf[ctl["off"]:ctl["off"] + 8]) != _CONTROL_MAGIC:
            raise ClientError(f"arena {desc['path']}: no control block at offset {ctl['off']} "
                              "(not a moecached arena, or a newer layout); upgrade the client")
        self._epoch = np.frombuffer(self.mm, dtype=np.uint64, count=1, offset=ctl["off"] + ctl["epoch_off"])

    @property
    def descriptor(self) -> dict:
        """The arena descriptor of the hello reply (docs/protocol.md, "The arena")."""
        return self.desc

    @property
    def size(self) -> int:
        """Bytes mapped."""
        return int(self.desc["size"])

    @property
    def address(self) -> int:
        """Base address of the read-only mapping in this process."""
        return int(self.buf.__array_interface__["data"][0])

    def epoch(self) -> int:
        """Session id of the daemon serving this arena now (0: none)."""
        return int(self.shm.epoch() if self.shm is not None else self._epoch[0])

    def part(self, class_id: int, slot: int, part: str) -> np.ndarray:
        c = self.classes[class_id]
        n = c["part_bytes"][part]
        off = c["part_off"][part] + slot * n
        return self.buf[off:off + n]

    def close(self):
        self.shm = None
        self.buf = self._epoch = None
        try:
            self.mm.close()
        except BufferError:
            pass  # views still alive; the mapping goes when they do


class Subst:
    """Substitution for one acquire (docs/protocol.md, "Substitution").

    Args:
        r: tolerance in [0, 1]: a candidate may replace a missing expert when its score is at
            least ``r`` x the missing expert's score.
        cap: at most this many swaps per layer (None: no cap).
        layers: ``{layer: (scores, candidates)}``: ``scores`` one per requested expert of the
            layer (request order), ``candidates`` ``[(expert, score), ...]`` further experts
            the router ranked (none of them requested). Layers left out get no substitution.
    """
    __slots__ = ("r", "cap", "layers")

    def __init__(self, r: float, cap: int | None,
                 layers: dict[int, tuple[Sequence[float], Iterable[tuple[int, float]]]]):
        if not (isinstance(r, (int, float)) and 0.0 <= r <= 1.0):
            raise ClientError(f"Subst r: found {r!r}, expected a number in [0, 1]")
        if cap is not None and (not isinstance(cap, int) or cap < 0):
            raise ClientError(f"Subst cap: found {cap!r}, expected an integer >= 0 or None")
        self.r, self.cap, self.layers = float(r), cap, layers

    def wire(self) -> dict:
        """The ``subst`` field of the acquire request."""
        out = {"r": self.r, "layers": [[int(l), [float(x) for x in sc],
                                        [[int(e), float(v)] for e, v in cands]]
                                       for l, (sc, cands) in self.layers.items()]}
        if self.cap is not None:
            out["cap"] = int(self.cap)
        return out


class Lease:
    """Experts pinned in the daemon's arena until ``release()`` (or the ``with`` block ends).

    Attributes:
        id: lease id (int).
        items: [(layer, expert, class_id, slot), ...] in request order.
        slots: slot index of each requested expert, in request order.
        hits / prefetch_hits / misses: what the daemon found for this request.
        substituted: ``[(layer, missing, substitute), ...]``: experts the daemon replaced by a
            resident candidate (``acquire(..., subst=)``); ``items`` name the substitutes.
        stall_us: microseconds the daemon waited for reads for this request.

    A lease pinned through shared memory (no message) has a negative ``id``, counts every
    expert as a hit (the daemon counts it as a hit or a prefetch hit when it drains the ring)
    and is released by a store.
    """

    _shm_items = None   # moecache_client._shm.Items: valid() through mcshm_valid; a fast lease unpins

    def __init__(self, client: "Client", session: int, arena: _Arena, reply: dict, shm_items=None):
        self._client = client
        self.session = session
        self._arena = arena
        self.id = reply["lease"]
        self.items = reply["items"]  # [[layer, expert, class_id, slot], ...]
        self.hits = reply.get("hits", 0)
        self.prefetch_hits = reply.get("prefetch_hits", 0)
        self.misses = reply.get("misses", 0)
        self.stall_us = reply.get("stall_us", 0)
        self.substituted = [tuple(x) for x in reply.get("subst", ())]
        self.released = False
        self._where_map = None
        if shm_items is None and arena is not None and arena.shm is not None:
            shm_items = arena.shm.items(self.items, reply["gens"])
        if shm_items is not None:
            self._shm_items = shm_items
            return
    @classmethod
    def _pinned(cls, client, session, arena, lid, shm_items) -> "Lease":
        """A lease pinned without a message (all hits)."""
        self = cls.__new__(cls)
        self._client = client
        self.session = session
        self._arena = arena
        self.id = lid
        self.items = shm_items.rows
        self.hits = len(self.items)
        self.prefetch_hits = self.misses = self.stall_us = 0
        self.substituted = []
        self.released = False
        self._where_map = None
        self._shm_items = shm_items
        return self

    _refused = None   # socket only: why the daemon's check said this lease is no longer held

    def _invalid_because(self, ask: bool = True) -> str | None:
        """Why the lease is no longer valid, or None. ``ask`` False (``part()``), socket only:
        what this client knows without a message (released, closed, another session, a
        ``check`` that said no); True asks the daemon."""
        if self.released:
            return "it was released"
        if self._client._closed:
            return "its client was closed (its bye released it)"
        if self._client.session != self.session:
            return "the daemon that granted it restarted or went away"
        a = self._arena
        if a is None or a.buf is None:
            return "its arena is no longer mapped"
        it = self._shm_items
        if it is not None:   # the shared-memory rule, compiled from moecache_shm.h
            if it.valid():
                return None
            if a.epoch() != self.session:
                return "the daemon that granted it no longer serves this arena"
            return "the daemon revoked it and reused its slots"
        # socket only (no compiled rule here): the daemon says whether it still holds the lease
        if self._refused is not None or not ask:
            return self._refused
        try:
            held = self._client._call({"op": "check", "leases": [self.id]})["held"][0]
        except ClientError as e:
            return f"the daemon could not confirm it ({e})"
        if self._client.session != self.session:
            return "the daemon that granted it restarted or went away"
        if not held:
            self._refused = "the daemon revoked it (released its pins; its slots may be reused)"
        return self._refused

    def valid(self) -> bool:
        """True while the lease pins its experts: bytes read through it before this call
        returned True are the granted experts'. With the compiled extension a few
        shared-memory loads and no message; socket only, one ``check`` round trip."""
        return self._invalid_because() is None

    def check(self, ask: bool = True) -> None:
        """Raise :class:`LeaseInvalid` (saying why) unless :meth:`valid` (``ask`` False, socket
        only: without a message, as :meth:`part` does)."""
        why = self._invalid_because(ask)
        if why is not None:
            raise LeaseInvalid(f"lease {self.id} is no longer valid: {why}")

    @property
    def slots(self) -> list[int]:
        """Slot index of each requested expert, in request order (MUL_MAT_ID expert ids)."""
        return [s for _, _, _, s in self.items]

    @property
    def _where(self) -> dict:
        if self._where_map is None:
            self._where_map = {(l, e): (c, s) for l, e, c, s in self.items}
        return self._where_map

    def part(self, expert: int, part: str, layer: int | None = None) -> np.ndarray:
        """Zero-copy read-only uint8 view of one part ('gate', 'up', 'down', ...) of an expert.

        ``layer`` may be left out when the lease covers one layer. Raises KeyError when the
        expert is not in this lease, :class:`LeaseInvalid` when the lease is no longer valid
        (call :meth:`valid` again after using the bytes: a revocation may come at any time).
        Socket only (no compiled extension), it sends no message: it knows what the client
        knows (released, closed, another session, a :meth:`valid` that said no).
        """
        self.check(ask=False)
        if layer is None:
            layers = {l for l, _, _, _ in self.items}
            if len(layers) != 1:
                raise KeyError("lease covers several layers: pass layer=")
            layer = next(iter(layers))
        cls, slot = self._where[(layer, expert)]
        return self._arena.part(cls, slot, part)

    def parts(self, expert: int, layer: int | None = None) -> dict[str, np.ndarray]:
        """All parts of one expert as {part: uint8 view} (:class:`LeaseInvalid` as :meth:`part`)."""
        self.check(ask=False)
        if layer is None:
            layer = self.items[0][0]
        cls, _ = self._where[(layer, expert)]
        return {p: self.part(expert, p, layer) for p in self._arena.classes[cls]["parts"]}

    def release(self) -> None:
        """Unpin (idempotent). A lease from before a daemon restart is dropped silently."""
        if not self.released:
            self.released = True
            if self.id < 0:      # pinned without a message: unpin is a store
                self._shm_items.release()
            else:
                self._client._release_lease(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LeaseFuture:
    """Pending acquire; ``result(timeout)`` returns the Lease (or raises the call's error)."""

    def __init__(self, client: Client, fut: _Call | None, lease: Lease | None = None):
        self._client = client
        self._fut = fut
        self._lease = lease      # already granted (pinned without a message)

    def done(self) -> bool:
        """True once the reply (lease or error) is in."""
        return self._fut is None or self._fut.done()

    def result(self, timeout: float | None = None) -> Lease:
        """Wait up to ``timeout`` seconds (None: forever) for the Lease. Raises ServerError,
        Timeout (a lease arriving later is released by the client), DaemonRestarted."""
        if self._fut is None:
            return self._lease
        rep = self._client._wait(self._fut, timeout, "acquire")
        return Lease(self._client, rep["session"], rep["_arena"], rep)
