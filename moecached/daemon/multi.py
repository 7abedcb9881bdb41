"""Several models in one daemon under one expert budget (``moecached --model NAME=PATH ...``).

Each model has its own index, arena file, cache and :class:`moecached.service.server.Server` (leases,
the shared-memory fast path, traces and every stats view are per model), served in a thread of
its own on ``<endpoint path>.<name>`` (ipc only). The daemon's endpoint itself serves no model:
a hello there that names one is answered with ``redirect`` (that model's endpoint, where the
client says hello again: docs/protocol.md, "Several models"); one that names none is
redirected while one model is served and refused with one line otherwise, as is an unknown or
departing model. Control tools (``model "*"``) get the daemon's view there: every model's
share, residency, hit rate and bytes read, their sums, the split and the memory floor.

The budget is split by :class:`moecached.daemon.split.Split` (the simulator's own code): every
``split_interval_s`` seconds the ghost hits each cache counted since the last time go to
:meth:`Split.rebalance`; a share that moved is applied with the caches' ``set_budget`` (a
shrink evicts the model's LRU victims and gives their memory back, a grow restores slots),
shrinks first. The memory floor shrinks the total (:meth:`Split.set_total`) and the split
absorbs it.

Models come and go live (``moecache-ctl model add NAME PATH`` / ``model remove NAME``, or a
SIGHUP after editing ``[[models]]``), any of them: an added model gets its share from the
others, their warm experts stay (only their LRU tails are given up); a removed model refuses
new hellos at once, its clients keep their leases until they release them (at most ``DRAIN_S``
seconds), then its server and arena close and its share goes to the others. A model whose file
changes is handled alone, per ``on_model_change`` (``moecached.daemon.reload``): re-indexed in place
under a new session of its socket (its share kept as far as its new size allows), or the
daemon exits.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter

from moecached import MoecacheError
from moecached.facts import protocol as P
from moecached.daemon.confvalues import MODEL_NAME
from moecached.engine.index import open_index
from moecached.daemon.logs import stage
from moecached.daemon.reload import ModelReloader
from moecached.service.router import Router
from moecached.service.server import Server
from moecached.daemon.split import Member, Split, SplitError, least_share
from moecached.facts.stats import CACHE_STATS, SERVER_COUNTERS, hit_rate

log = logging.getLogger("moecached.models")

#: hello's ``model`` for a control connection (moecache-ctl): whichever model the endpoint
#: serves, never redirected or refused (engines name their model)
ANY_MODEL = "*"
#: a removed model's leases are waited for this long at most before its server closes
DRAIN_S = 30.0


class ModelsError(MoecacheError):
    """A model cannot be added or removed (bad name or path, no room in the budget)."""


class _Served:
    __slots__ = ("name", "path", "index", "cache", "server", "thread", "endpoint", "draining",
                 "spec", "reloader")

    def __init__(self, name, path):
        self.name, self.path = name, path
        self.index = self.cache = self.server = self.thread = self.endpoint = None
        self.draining = None   # monotonic time removal began
        self.spec = None
        self.reloader = None


def model_endpoint(endpoint: str, name: str) -> str:
    """Where model ``name`` is served: the daemon's ipc path with ``.<name>`` appended.
    Raises ModelsError for tcp or a path too long."""
    if not endpoint.startswith("ipc://"):
        raise ModelsError(f"endpoint {endpoint}: several models need an ipc:// endpoint (each "
                          "model gets its own socket beside it)")
    ep = f"{endpoint}.{name}"
    if len(ep) - len("ipc://") > 107:
        raise ModelsError(f"model {name}: socket path {ep[6:]} is longer than 107 bytes; use a "
                          "shorter endpoint path or model name")
    return ep


class Models:
    """The models served and their split; built by :func:`start`, driven from the endpoint's
    loop (its periodic task) and from any socket's hello (``route``). The daemon
    (``moecached.daemon.runtime.Daemon``) uses it as it uses ``OneModel``: ``start``, ``tick``,
    ``targets``, ``floor_target``, ``live_*``, ``stats``, ``status``, ``ready_message``,
    ``close``.

    Args:
        cfg: the daemon's Config at start.
        make_cache: ``(cfg, index, arena_bytes) -> ExpertCache``.
        server_kwargs: the Server arguments every socket gets.
        live_cfg: callable -> the running Config (SIGHUP replaces it): ``on_model_change``.
        exit: callable(status) that stops the daemon with that exit status.
        notify: optional callable(str): a systemd STATUS line.
    """

    def __init__(self, cfg, make_cache, server_kwargs, live_cfg=None, exit=None, notify=None):
        self.cfg = cfg
        self._make_cache = make_cache
        self._server_kwargs = server_kwargs
        self._live_cfg = live_cfg or (lambda: cfg)
        self._exit = exit
        self._notify = notify
        self.models: dict[str, _Served] = {}
        self.lock = threading.RLock()     # models / split / caches: every loop reads them
        self.split: Split | None = None
        self.total = int(cfg.budget)
        self.next_split = time.monotonic() + cfg.split_interval_s
        self._last_ghost: dict = {}
        self.moves: list = []             # the last moves: (time, donor, receiver, bytes)
        self.adding: dict = {}            # names being added (indexing, arena) now
        self.failed: dict = {}            # name -> why its last add failed
        self.retired = Counter()          # counters of the models removed (daemon totals)
        self.router = None                # the Router on the daemon's endpoint (no model)
        self.timings: dict = {}           # start-up: the daemon's total_s
        self._file_models = list(cfg.models)   # [[models]] as the file said when last read

    # ------------------------------------------------------------------ routing (any loop)
    def route(self, server, want, names: bool = False):
        """Hello on ``server`` naming ``want``: None when it is served there, else the endpoint
        of the model named; ProtocolError when no model is named while several are served,
        or the model is unknown or being removed. ``names``: the models served (a list)."""
        with self.lock:
            live = [m for m in self.models.values() if m.draining is None]
            if names:
                return [m.name for m in live]
            if want == ANY_MODEL:   # a control connection: whatever the socket serves
                return None
            if want is None:
                if server is not self.router:
                    return None   # a model's own endpoint: no name needed
                if len(live) == 1:
                    return live[0].endpoint
                if not live:
                    raise P.ProtocolError(P.E_UNKNOWN_MODEL, "this daemon serves no model now: "
                                          "add one (moecache-ctl model add NAME PATH)")
                raise P.ProtocolError(P.E_UNKNOWN_MODEL, "this daemon serves several models ("
                                      + ", ".join(m.name for m in live) + "): name one in hello "
                                      "(Client(endpoint, model=NAME))")
            m = self.models.get(want)
            if m is None or m.draining is not None:
                why = "is being removed" if m is not None else "is not served here"
                raise P.ProtocolError(P.E_UNKNOWN_MODEL, f"model {want!r} {why} (served: "
                                      + (", ".join(x.name for x in live) or "none") + ")")
            return None if m.server is server else m.endpoint

    def servers(self) -> list:
        """The servers of the models served now (not those being removed)."""
        with self.lock:
            return [m.server for m in self.models.values()
                    if m.draining is None and m.server is not None]

    # ------------------------------------------------------------------ building
    def _member(self, name, index, spec):
        least = least_share(index, int(getattr(index, "top_k", 0) or 8))
        hi = spec.get("max_budget")
        if hi is not None and hi < least:
            raise ModelsError(f"model {name}: max_budget {hi} bytes is below the least it is "
                              f"served with ({least} bytes: two layers' top-k of every size "
                              "class); raise max_budget")
        w = spec.get("weight")
        return Member(name, index, max(least, spec.get("min_budget") or 0), hi,
                      1.0 if w is None else float(w))

    def _open(self, spec) -> _Served:
        name, path = spec["name"], spec["path"]
        if not os.path.isfile(path):
            raise ModelsError(f"model {name}: path {path}: expected an existing GGUF file")
        m = _Served(name, path)
        m.spec = dict(spec)
        m.endpoint = model_endpoint(self.cfg.endpoint, name)
        try:
            m.index = open_index(path)
        except MoecacheError as e:   # its one line names the file already
            raise ModelsError(f"model {name}: {e}") from None
        except OSError as e:
            raise ModelsError(f"model {name}: {path}: {e.strerror or e}") from None
        return m

    def _arena_max(self, member) -> int:
        """The arena of a model: its largest possible share (its max, or the total less the
        others' minimums); memory above its share is given back at once."""
        others = sum(x.min_bytes for n, x in self.split.members.items() if n != member.name)
        return max(member.min_bytes, min(member.max_bytes, self.total - others))

    def _new_cache(self, m: _Served, index):
        """The cache of ``m`` over ``index``, sized to its share (caller holds the lock)."""
        member = self.split.members[m.name]
        cache = self._make_cache(self.cfg, index, self._arena_max(member))
        try:
            cache.set_budget(self.split.shares[m.name])   # give back what is not its share
            cache.c_shrinks = 0   # that first cut to its share is not a shrink of its budget
            cache.set_ghost(self.split.ghost_slots(m.name))
        except BaseException:
            cache.close()
            raise
        return cache

    def _start_cache(self, m: _Served):
        """Cache (sized to its share), server and file watch of ``m``; its server is run by
        :meth:`_run_thread`."""
        m.cache = self._new_cache(m, m.index)
        try:
            m.server = Server(m.cache, endpoint=m.endpoint, model_path=m.path,
                              **self._server_kwargs)
        except BaseException:
            m.cache.close()
            raise
        m.server.model_name = m.name
        m.server.route_model = self.route
        m.reloader = ModelReloader(
            m.server, m.path, f"model {m.name} ({m.path})",
            mode=lambda: self._live_cfg().on_model_change,
            rebuild=lambda index, m=m: self._rebuild(m, index), guard=self.lock,
            exit=self._exit_daemon, failed=lambda e, m=m: self._rebuild_failed(m, e),
            notify=None if self._notify is None else
            (lambda line, name=m.name: self._notify(f"model {name}: {line}")))
        m.server.on_tick = lambda now, m=m: self._model_tick(m, now)
        self._last_ghost[m.name] = 0

    def _exit_daemon(self, status: int) -> None:
        if self._exit is not None:
            self._exit(status)

    def _model_tick(self, m: _Served, now: float) -> None:
        """A model's own periodic task (its loop thread): its arena's link, its file."""
        if m.cache is None:   # not served again after its file changed: being removed
            return
        r = m.cache.arena.check_link()
        if r == "relinked":
            log.warning("model %s: arena %s was unlinked; linked it back", m.name,
                        m.cache.arena.path)
        m.reloader.tick(now)

    def _rebuild(self, m: _Served, index):
        """``m``'s file was re-indexed (its loop thread, the lock held, its old cache retired):
        its split member takes the new index, keeping its share as far as the new bounds
        allow; the others follow; the new cache is sized to the share."""
        try:
            self.split.replace(self._member(m.name, index, m.spec))
        except SplitError as e:
            raise ModelsError(f"model {m.name}: {e}") from None
        self._keep_counts(m, server=False)   # the retired cache's (its socket goes on)
        m.cache = None
        self.apply()   # the others first: memory for the new arena
        m.cache = self._new_cache(m, index)
        m.index = index
        self._last_ghost[m.name] = 0
        return m.cache

    def _rebuild_failed(self, m: _Served, e: Exception) -> None:
        """``m`` was re-indexed but could not be served again: it is removed, the others go
        on (its clients' hellos are refused, their calls fail with model_changed)."""
        log.error("model %s re-indexed but not served again: %s; removing it (add it again "
                  "with moecache-ctl model add once the cause is fixed)", m.name, e)
        with self.lock:
            self.failed[m.name] = str(e)
            if m.draining is None:
                m.draining = time.monotonic() - DRAIN_S   # nothing to drain: its cache is gone

    def start(self, held: dict):
        """Open every configured model and serve each in its thread; then bind the daemon's
        endpoint (its lock: ``held["lock"]``, handed over) to the router, returned for the
        caller to run its loop."""
        with stage(f"indexing and reserving {len(self.cfg.models)} models"):
            opened = [self._open(s) for s in self.cfg.models]
            try:
                self.split = Split(self.total, [self._member(m.name, m.index, m.spec)
                                                for m in opened],
                                   step=self.cfg.split_step, hysteresis=self.cfg.split_hysteresis)
            except SplitError as e:
                raise ModelsError(str(e)) from None
            try:
                for m in opened:
                    self._start_cache(m)
                    self.models[m.name] = m
                lock_fd, held["lock"] = held["lock"], None   # the router owns it from here
                self.router = Router(self.route, self.handle, endpoint=self.cfg.endpoint,
                                     endpoint_lock=lock_fd, **self._server_kwargs)
            except BaseException:
                self.close()
                raise
        for m in opened:
            self._run_thread(m)
        return self.router

    def _run_thread(self, m: _Served):
        m.thread = threading.Thread(target=m.server.serve_forever, name=f"moecached-{m.name}",
                                    daemon=True)
        m.thread.start()

    # ------------------------------------------------------------------ the split
    def apply(self):
        """Shares -> caches: shrinks first (memory given back before any is taken), then grows;
        ghost sizes follow the shares."""
        live = [m for m in self.models.values() if m.draining is None and m.cache is not None
                and m.name in self.split.shares]
        cur = {m.name: m.cache.stats()["budget"]["current_bytes"] for m in live}
        order = sorted(live, key=lambda m: self.split.shares[m.name] - cur[m.name])
        for m in order:
            try:
                m.cache.set_budget(self.split.shares[m.name])
            except MoecacheError as e:
                log.error("model %s: share %d bytes not applied: %s", m.name,
                          self.split.shares[m.name], e)
            m.cache.set_ghost(self.split.ghost_slots(m.name))

    def rebalance(self):
        """One period of the split: ghost hits since the last period -> at most one move."""
        with self.lock:
            got = {}
            for m in self.models.values():
                if m.draining is None and m.cache is not None:
                    g = m.cache.c_ghost_hits
                    got[m.name] = g - self._last_ghost.get(m.name, 0)
                    self._last_ghost[m.name] = g
            mv = self.split.rebalance(got)
            if mv is not None:
                self.moves.append((time.time(),) + mv)
                del self.moves[:-16]
                log.info("split: %s gives %d MiB to %s (ghost hits this period: %s)", mv[0],
                         mv[2] >> 20, mv[1], ", ".join(f"{k} {v}" for k, v in got.items()))
            self.apply()   # also finishes a shrink that pinned experts stopped short
            return mv

    def least_total(self) -> int:
        """The least total the models are served with: the sum of their minimum shares."""
        with self.lock:
            return sum(m.min_bytes for m in self.split.members.values())

    def set_total(self, total: int) -> dict:
        """The memory floor's ``set_budget``: the split absorbs a new total."""
        with self.lock:
            try:
                self.split.set_total(int(total))
            except SplitError as e:
                raise ModelsError(str(e)) from None
            self.total = int(total)
            self.apply()
            return {"shares": dict(self.split.shares)}

    def configure(self, cfg):
        """SIGHUP changed a split key."""
        with self.lock:
            self.cfg.split_interval_s = cfg.split_interval_s
            self.split.hysteresis = cfg.split_hysteresis
            self.split._step = cfg.split_step
            self.split.step = self.split._pick_step()
            self.next_split = time.monotonic() + cfg.split_interval_s
            for m in self.models.values():
                if m.draining is None and m.cache is not None:
                    m.cache.set_ghost(self.split.ghost_slots(m.name))
        return None

    @staticmethod
    def _held(m: _Served) -> tuple:
        """(leases granted over the socket, slots pinned through shared memory) of ``m``'s
        clients now: what a removal waits for."""
        if m.cache is None:
            return len(m.server.leases), 0
        return len(m.server.leases), m.cache.pins_held()

    def tick(self, now: float):
        """The endpoint's periodic task: the split's period, removals that drained."""
        if now >= self.next_split:
            self.next_split = now + self.cfg.split_interval_s
            self.rebalance()
        for m in list(self.models.values()):
            if m.draining is None:
                continue
            held = self._held(m)
            if not any(held) or now - m.draining >= DRAIN_S:
                if any(held):
                    log.warning("model %s: %d leases and %d shared-memory pins still held after "
                                "%g s; their clients' calls fail from now on", m.name, *held,
                                DRAIN_S)
                self._finish_remove(m)

    # ------------------------------------------------------------------ add / remove
    def add(self, spec: dict) -> dict:
        """Serve one more model: checked here, then indexed, given its share (from the others:
        only their coldest experts go) and started in a thread of its own, so no model's loop
        waits for the index or the new arena. ``model list`` shows it ``adding`` meanwhile, and
        the reason when it could not be added."""
        name = spec.get("name")
        if not isinstance(name, str) or not MODEL_NAME.fullmatch(name):
            raise ModelsError(f"model name {name!r}: expected letters, digits, _ . - (at most 32)")
        path = spec.get("path")
        if not isinstance(path, str) or not os.path.isfile(path):
            raise ModelsError(f"model {name}: path {path}: expected an existing GGUF file")
        with self.lock:
            if name in self.models or name in self.adding:
                m = self.models.get(name)
                raise ModelsError(f"model {name} is already served"
                                  + (" (being removed: try again when it is gone)"
                                     if m is not None and m.draining is not None else "")
                                  + (" (being added)" if name in self.adding else ""))
            self.adding[name] = None
            self.failed.pop(name, None)
        ep = model_endpoint(self.cfg.endpoint, name)
        threading.Thread(target=self._add, args=(dict(spec),), name=f"moecached-add-{name}",
                         daemon=True).start()
        return {"adding": name, "endpoint": ep}

    def _add(self, spec: dict) -> None:
        name = spec["name"]
        try:
            m = self._open(spec)
            with self.lock:
                try:
                    self.split.add(self._member(name, m.index, spec))
                except SplitError as e:
                    raise ModelsError(str(e)) from None
                self.apply()   # the others shrink first: memory for the new arena
                try:
                    self._start_cache(m)
                except BaseException as e:
                    self.split.remove(name)
                    self.apply()
                    raise ModelsError(f"model {name}: {e}") from None
                self.models[name] = m
                self._run_thread(m)
            log.info("model %s added from %s: %d MiB of the budget, served on %s", name, m.path,
                     self.split.shares[name] >> 20, m.endpoint)
        except Exception as e:   # said in the log and in `model list`; the others go on
            log.error("model %s not added: %s", name, e)
            with self.lock:
                self.failed[name] = str(e)
        finally:
            with self.lock:
                self.adding.pop(name, None)

    def remove(self, name: str) -> dict:
        """Stop serving ``name``: new hellos for it are refused at once; its server closes
        once its leases are released (or after ``DRAIN_S``)."""
        with self.lock:
            m = self.models.get(name)
            if m is None:
                raise ModelsError(f"model {name!r} is not served here (served: "
                                  + ", ".join(self.models) + ")")
            if m.draining is None:
                m.draining = time.monotonic()
                log.info("model %s: removing; new hellos refused, %d leases and %d "
                         "shared-memory pins to drain", name, *self._held(m))
        leases, pins = self._held(m)
        return {"removing": name, "leases": leases, "fast_pins": pins}

    def _keep_counts(self, m: _Served, server: bool = True) -> None:
        """``m``'s cache is going (removed, or its file re-indexed): the daemon's totals keep
        counting what its counters (and, when ``server``, its socket's) counted."""
        st = m.cache.stats() if m.cache is not None else {}
        for row in CACHE_STATS:
            if row.kind == "counter" and isinstance(st.get(row.key), int):
                self.retired[row.key] += st[row.key]
        for k, v in (m.server.counters.items() if server else ()):
            self.retired["server." + k] += v

    def _finish_remove(self, m: _Served):
        with self.lock:
            self.models.pop(m.name, None)
            m.server.stop()
        m.thread.join(timeout=10)
        m.reloader.close()
        self._keep_counts(m)
        if m.cache is not None:
            m.cache.close()
        with self.lock:
            self.split.remove(m.name)
            self._last_ghost.pop(m.name, None)
            self.apply()
        log.info("model %s removed; its share went to %s", m.name,
                 ", ".join(self.split.shares) or "no model (none is served now)")

    def reload_models(self, cfg):
        """SIGHUP: the models added to or removed from ``[[models]]`` since the file was last
        read are added / removed live (a model added or removed with ``moecache-ctl model``
        stays so until the file changes for it); a table whose path changed needs the model
        removed and added again."""
        old = {s["name"]: s for s in self._file_models}
        new = {s["name"]: s for s in cfg.models}
        self._file_models = list(cfg.models)
        errors = []
        for n in old:
            if n not in new:
                try:
                    self.remove(n)
                except ModelsError as e:
                    errors.append(str(e))
            elif new[n]["path"] != old[n]["path"]:
                errors.append(f"model {n}: path changed in the file; remove and add it again "
                              "(moecache-ctl model remove / add) to serve the new path")
        for n in new:
            if n not in old:
                try:
                    self.add(new[n])
                except ModelsError as e:
                    errors.append(str(e))
        return "; ".join(errors) or None

    # ------------------------------------------------------------------ views
    def summary(self, views=None) -> list:
        """Per model: share, residency, hit rate, bytes read (stats, status, metrics)."""
        return [dict(name=m.name, path=m.path, endpoint=m.endpoint, state=state,
                     share_bytes=share, budget_current_bytes=st["budget"]["current_bytes"],
                     min_bytes=mb.min_bytes if mb else 0, max_bytes=mb.max_bytes if mb else 0,
                     weight=mb.weight if mb else 0,
                     slots=sum(c["slots"] for c in st["classes"]),
                     resident=sum(c["used"] for c in st["classes"]), hits=st["hits"],
                     prefetch_hits=st["prefetch_hits"], demand_misses=st["demand_misses"],
                     hit_rate=hit_rate(st["hits"], st["prefetch_hits"], st["demand_misses"]),
                     ghost_hits=st["ghost_hits"], bytes_read=st["bytes_read"],
                     model_changed=st["model_changed"], reloads=m.reloader.reloads,
                     clients=len(m.server.clients), leases=len(m.server.leases),
                     fast_pins=pins)
                for m, st, state, share, mb, pins in (views or self._views())]

    def _views(self) -> list:
        """(model, its cache's stats, state, share, split member, slots pinned through shared
        memory) of every model with a cache."""
        out = []
        with self.lock:
            for m in list(self.models.values()):
                if m.cache is None:
                    continue
                state = ("removing" if m.draining is not None else
                         "model changed" if m.cache.model_changed else "serving")
                out.append((m, m.cache.stats(), state, self.split.shares.get(m.name, 0),
                            self.split.members.get(m.name), m.cache.pins_held()))
        return out

    def daemon_stats(self) -> dict:
        """The daemon's endpoint's ``stats``: every cache counter and gauge summed over the
        models (counters of removed models included), the budget, each model, the split."""
        views = self._views()
        st = {}
        for row in CACHE_STATS:
            vals = [v[1].get(row.key) for v in views]
            if row.value is None or not all(isinstance(x, (int, float)) for x in vals):
                continue
            st[row.key] = sum(vals) + (self.retired[row.key] if row.kind == "counter" else 0)
        st["budget"] = {"configured_bytes": int(self.cfg.budget), "current_bytes":
                        sum(v[1]["budget"]["current_bytes"] for v in views)}
        st["model_changed"] = next((f"model {v[0].name}: {v[1]['model_changed']}"
                                    for v in views if v[1]["model_changed"]), None)
        # every model's clients, and the sockets' counters summed (the endpoint's own too)
        st["clients"] = [dict(c.summary(), model=v[0].name) for v in views
                         for c in list(v[0].server.clients.values())]
        servers = [v[0].server.counters for v in views]
        if self.router is not None:
            servers.append(self.router.counters)
        st["server"] = {row.key: sum(x.get(row.key, 0) for x in servers)
                        + self.retired["server." + row.key] for row in SERVER_COUNTERS}
        st["models"] = self.summary(views)   # the same snapshot: each cache read once
        st["split"] = self.split_info()
        return st

    def daemon_status(self) -> dict:
        """The daemon's endpoint's ``status``: sums over the models, and each model."""
        ms = self.summary()
        hits, pf, miss = (sum(x[k] for x in ms) for k in ("hits", "prefetch_hits", "demand_misses"))
        changed = [x for x in ms if x["model_changed"]]
        return {"state": "model changed" if changed else "serving",
                "model_changed": (f"model {changed[0]['name']}: {changed[0]['model_changed']}"
                                  if changed else None),
                "budget_configured_bytes": int(self.cfg.budget),
                "budget_current_bytes": sum(x["budget_current_bytes"] for x in ms),
                "slots": sum(x["slots"] for x in ms), "slots_used": sum(x["resident"] for x in ms),
                "hits": hits, "prefetch_hits": pf, "demand_misses": miss,
                "hit_rate": hit_rate(hits, pf, miss),
                "clients": sum(x["clients"] for x in ms), "leases": sum(x["leases"] for x in ms),
                "models": ms}

    def split_info(self) -> dict:
        with self.lock:
            return {"adding": list(self.adding), "failed": dict(self.failed),
                    "total_bytes": self.total, "step_bytes": self.split.step,
                    "hysteresis": self.split.hysteresis, "interval_s": self.cfg.split_interval_s,
                    "moves": self.split.moves,
                    "last_moves": [{"t": t, "from": d, "to": r, "bytes": b}
                                   for t, d, r, b in self.moves]}

    def handle(self, msg: dict) -> dict:
        """The ``models`` op: ``action`` list (default) | add | remove | rebalance."""
        action = msg.get("action", "list")
        try:
            if action == "list":
                return {"models": self.summary(), "split": self.split_info()}
            if action == "add":
                spec = {"name": msg.get("name"), "path": msg.get("path")}
                for k in ("min_budget", "max_budget", "weight"):
                    if msg.get(k) is not None:
                        spec[k] = msg[k]
                if not isinstance(spec["path"], str) or not spec["path"]:
                    raise P.ProtocolError(P.E_BAD_TYPE, "field 'path' must be the model's GGUF path")
                return self.add(spec)
            if action == "remove":
                name = msg.get("name")
                if not isinstance(name, str):
                    raise P.ProtocolError(P.E_BAD_TYPE, "field 'name' must be a model name")
                return self.remove(name)
            if action == "rebalance":
                mv = self.rebalance()
                return {"moved": None if mv is None else {"from": mv[0], "to": mv[1], "bytes": mv[2]},
                        "shares": dict(self.split.shares)}
        except ModelsError as e:
            raise P.ProtocolError(P.E_REFUSED, str(e)) from None
        raise P.ProtocolError(P.E_BAD_TYPE, f"field 'action' = {action!r:.20}: expected list, add, "
                              "remove or rebalance")

    # ------------------------------------------------------------------ the daemon's view
    several = True
    keep_new = ("models",)   # applied in part: the file's tables are read as they are now

    def targets(self, scope: str) -> list:
        """(server, cache) pairs a per-model live change reaches: every model's, and the
        endpoint's (no cache) for what every socket has (``scope`` "socket")."""
        out = [(srv, srv.cache) for srv in self.servers()]
        return out + ([(self.router, None)] if scope == "socket" else [])

    def floor_target(self, cfg) -> tuple:
        """(configured total, least total, set_total): the memory floor shrinks the split's
        total and the split absorbs it."""
        configured = int(cfg.budget)
        least = min(max(self.least_total(), cfg.min_budget or 0), configured)
        return configured, least, self.set_total

    def live_budget(self, new, floor):
        return "several models: restart to change it"

    def live_split(self, new):
        return self.configure(new)

    def live_models(self, new):
        return self.reload_models(new)

    def stats(self) -> dict:
        return self.daemon_stats()

    def status(self) -> dict:
        return self.daemon_status()

    def ready_message(self) -> tuple[str, str]:
        return (f"serving {len(self.models)} models ("
                + ", ".join(f"{n} {s / 2**30:.2f} GiB" for n, s in self.split.shares.items())
                + f") on {self.cfg.endpoint}", "")

    def close(self):
        """Stop every model's server and close its cache (the endpoint's server closes itself
        when its loop ends)."""
        for m in list(self.models.values()):
            if m.server is not None:
                m.server.stop()
                if m.thread is not None:
                    m.thread.join(timeout=10)
                elif m.server is not None:
                    m.server.close()   # never ran: its socket and lock files go
            if m.reloader is not None:
                m.reloader.close()
            if m.cache is not None:
                m.cache.close()
