"""A server's session and the cache it serves: a new session (the model was re-indexed, the
daemon reloaded), retiring the cache and installing its successor, and the model-changed
signal. :class:`ServerSession` is a part of :class:`moecached.service.server.Server`.
"""
from __future__ import annotations

import logging
import os

from moecached.engine.arena import STATE_SERVING
from moecached.facts import protocol as P

log = logging.getLogger("moecached.service.server")


class ServerSession:
    """Sessions and cache changes of :class:`moecached.service.server.Server` (a part of it)."""

    def model_changed(self, message: str) -> None:
        """The model file changed (any thread): run ``on_model_change(message)`` in the loop."""
        self._model_change = message
        self._wake()

    def new_session(self) -> None:
        """Start a new session: a new ``session`` id in every reply, so clients fail their calls
        in flight with DaemonRestarted and say hello again (re-mapping the arena). The one
        place the session changes after start."""
        self.session = int.from_bytes(os.urandom(8), "little") >> 1 | 1
        # the arena's control block names the session it serves: leases of any other are void
        self.cache.arena.set_epoch(self.session, STATE_SERVING)
        if self._fast is not None:
            self._fast = self._fast_handler()  # the hot path holds the session and the cache

    def retire_cache(self, code: str, message: str) -> None:
        """Close the cache being served (loop thread): every pending acquire fails with
        ``code``/``message``, every lease is forgotten (it dies with the arena; clients learn
        of it from the next session), a trace being recorded stops. Follow with
        :meth:`install_cache`."""
        old = self.cache
        for c in self.clients.values():
            for ticket, rid in list(c.pending.items()):
                if old.cancel(ticket):
                    del c.pending[ticket]
                    self._send_error(c.ident, rid, code, message)
        old.close()   # joins the readers: every callback has run, its result is in self.done
        while self.done:
            ident, rid, box, _tag, _result = self.done.popleft()
            ticket = box[0] if box else None
            c = self.clients.get(ident)
            if c is not None and ticket is not None and c.pending.pop(ticket, None) is not None:
                self._send_error(ident, rid, code, message)
        self.leases.clear()
        self.deadlines.clear()
        for c in self.clients.values():
            c.leases.clear()
            c.pending.clear()
            c.fold_pins()   # closed with the cache: the client says hello again
        if self.recorder is not None:
            path = self._trace_stop()["path"]
            log.warning("trace %s stopped: the model it recorded is no longer served", path)

    def install_cache(self, cache) -> None:
        """Serve ``cache`` (after :meth:`retire_cache`) under a new session."""
        self.cache = cache
        self.index = cache.index
        cache._shm.hit_rate = self.pin_hit_rate
        self.checker = P.RequestChecker(self.index.expert_layers, self.index.n_experts,
                                        max_experts=self.checker.max_experts)
        self.moe_index = {l: i for i, l in enumerate(self.index.expert_layers)}
        self.new_session()

    def _check_resident_map(self) -> None:
        """Every tick: the resident map clients pin through must say what the cache says; a
        process that can write the arena may have changed it (repaired, counted, logged)."""
        try:
            n = self.cache.check_resident_map()
        except Exception:
            log.exception("internal error checking the resident map")
            return
        if n:
            log.warning("resident map: %d entries were changed by another process (one with the "
                        "daemon's uid can write the arena); repaired", n)
