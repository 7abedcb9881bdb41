"""What a server shows and records, apart from serving: ``stats``, ``status``, ``models``
and the trace ops (``trace_start`` / ``trace_stop``: the routing trace of one client, its
shared-memory hits included). :class:`moecached.service.server.Server` has them from
:class:`ServerViews`; they read the server's state and never change what it serves.
"""
from __future__ import annotations

import os
import time

from moecached import __version__
from moecached.facts import protocol as P
from moecached.service.clients import _Client
from moecached.facts.stats import SERVER_COUNTERS, hit_rate
from moecached.engine.trace import TraceRecorder


class ServerViews:
    """The view and trace ops of :class:`moecached.service.server.Server` (a part of it)."""

    def _cache_stats(self) -> dict:
        return dict(self.cache.stats())

    def stats(self, only=None) -> dict:
        """Everything ``moecache-ctl stats`` shows: cache counters + server + per client
        (without a model: the server's own, and what ``extra_stats`` adds). ``only``: the
        client that is no admin asking, whose view lists itself alone (the rows of the others
        are not built: what they cost grew with every idle connection)."""
        st = self._cache_stats()
        if only is not None:
            st["clients_other"] = len(self.clients) - (only.ident in self.clients)
        st.update(uptime_s=round(time.time() - self.started, 3), pid=os.getpid(),
                  version=__version__, model=self.model_path, model_name=self.model_name,
                  endpoint=self.endpoint,
                  session=self.session,
                  fingerprint=self.index.fingerprint() if self.index is not None else None,
                  leases_held=len(self.leases),
                  server={**{k.key: 0 for k in SERVER_COUNTERS}, **self.counters},
                  clients=[c.summary() for c in (self.clients.values() if only is None else [only])],
                  departed_clients=list(self.departed),
                  tracing=(self.recorder.path if self.recorder is not None else None))
        if self.extra_stats is not None:
            st.update(self.extra_stats())
        return st

    def _op_models(self, c: _Client, rid: int, msg: dict) -> None:
        if self.models_handler is None:
            raise P.ProtocolError(P.E_REFUSED, "this daemon serves one model (--model PATH); start "
                                  "it with --model NAME=PATH (or [[models]]) to add models live")
        if msg.get("action") == "add":
            msg = self._check_model_add(c, msg)
        self._reply(c.ident, rid, **self.models_handler(msg))

    def _op_warm(self, c: _Client, rid: int, msg: dict) -> None:
        """Fill the cache from its state file or the experts named (``moecached.daemon.state``)."""
        handler = getattr(self, "warm_handler", None)
        if handler is None:
            raise P.ProtocolError(P.E_REFUSED, "this server has no warm starts (a daemon's model "
                                  "socket has them)")
        self._reply(c.ident, rid, **handler(msg))

    def _op_stats(self, c: _Client, rid: int, msg: dict) -> None:
        self._reply(c.ident, rid, stats=self._visible_stats(c, self.stats(None if c.admin else c)))

    def _op_status(self, c: _Client, rid: int, msg: dict) -> None:
        st = self._cache_stats()
        budget = st.get("budget", {})
        classes = st.get("classes", [])
        changed = getattr(self.cache, "model_changed", None)
        status = {
            "state": "model changed" if changed else "serving", "model_changed": changed,
            "pid": os.getpid(), "version": __version__,
            "uptime_s": round(time.time() - self.started, 3), "model": self.model_path,
            "model_name": self.model_name,
            "endpoint": self.endpoint, "clients": len(self.clients), "leases": len(self.leases),
            "budget_configured_bytes": budget.get("configured_bytes"),
            "budget_current_bytes": budget.get("current_bytes"),
            "slots": sum(x.get("slots", 0) for x in classes),
            "slots_used": sum(x.get("used", 0) for x in classes),
            "pinned": st.get("pinned"), "fast_pins": st.get("fast_path", {}).get("pinned"),
            "hits": st.get("hits"),
            "prefetch_hits": st.get("prefetch_hits"), "demand_misses": st.get("demand_misses"),
            "hit_rate": hit_rate(st.get("hits", 0), st.get("prefetch_hits", 0), st.get("demand_misses", 0)),
            "reads_in_flight": st.get("reads_in_flight")}
        if self.extra_status is not None:
            status.update(self.extra_status())
        self._reply(c.ident, rid, status=status)

    def _op_trace_start(self, c: _Client, rid: int, msg: dict) -> None:
        path = msg.get("path")
        if not isinstance(path, str) or not path:
            raise P.ProtocolError(P.E_BAD_TYPE, "field 'path' must be a file path string")
        who = msg.get("client")
        if who is not None and not isinstance(who, str):
            raise P.ProtocolError(P.E_BAD_TYPE, "field 'client' must be a string")
        # The daemon may run as root: it only ever creates a new file in an existing directory.
        if not os.path.isabs(path):
            raise P.ProtocolError(P.E_REFUSED, f"trace path {path!r}: expected an absolute path")
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise P.ProtocolError(P.E_REFUSED, f"trace path {path}: directory {parent} does not exist")
        if self.recorder is not None:
            raise P.ProtocolError(P.E_INVALID_STATE, f"a trace is already being recorded to {self.recorder.path}; stop it first")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640)
            os.close(fd)
        except FileExistsError:
            raise P.ProtocolError(P.E_REFUSED, f"trace path {path}: file exists; the daemon never overwrites a file")
        except OSError as e:
            raise P.ProtocolError(P.E_REFUSED, f"trace path {path}: {e.strerror}")
        idx = self.index
        self.cache.drain_pins()   # hits from before the start are not part of the trace
        self.cache.take_fast_log()
        self.cache.fast_log = []
        self.recorder = TraceRecorder(path, len(idx.expert_layers), idx.top_k, idx.n_experts, client=who)
        self.recorder_client = who
        if self._hooks is not None:
            self._hooks.tracing = True
        self._reply(c.ident, rid, path=path)

    def _record_fast_hits(self) -> None:
        """Put the acquires clients took through shared memory into the trace being recorded,
        in the order the daemon applied them: the entries of one pin call (one time stamp)
        are one acquire, grouped by layer; recorded as decode (a fast acquire has no tag)."""
        log = self.cache.take_fast_log()
        if not log:
            return
        names = {id(c.pins): c.name for c in self.clients.values() if getattr(c, "pins", None) is not None}
        i = 0
        while i < len(log):
            f, t = log[i][0], log[i][1]
            j = i
            by_layer: dict = {}
            while j < len(log) and log[j][0] is f and log[j][1] == t:
                by_layer.setdefault(log[j][2], []).append(log[j][3])
                j += 1
            name = names.get(id(f), "?")
            if self.recorder_client in (None, name):
                for layer, experts in by_layer.items():
                    self.recorder.record(self.moe_index[layer], experts, False, name)
            i = j

    def _trace_stop(self) -> dict:
        self.cache.drain_pins()
        if self.recorder is not None:
            self._record_fast_hits()
        self.cache.fast_log = None
        rec, self.recorder = self.recorder, None
        if self._hooks is not None:
            self._hooks.tracing = False
        tr = rec.close() if rec is not None else None
        info = None
        if tr is not None and hasattr(tr, "experts"):
            info = {"tokens": int(tr.experts.shape[0]), "moe_layers": int(tr.experts.shape[1]),
                    "top_k": int(tr.experts.shape[2]),
                    "prompt_tokens": int(tr.is_prompt.sum()),
                    "decode_tokens": int((~tr.is_prompt).sum())}
        return {"path": getattr(rec, "path", None), "info": info}

    def _op_trace_stop(self, c: _Client, rid: int, msg: dict) -> None:
        if self.recorder is None:
            raise P.ProtocolError(P.E_INVALID_STATE, "no trace is being recorded")
        self._reply(c.ident, rid, **self._trace_stop())
