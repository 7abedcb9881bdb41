"""The models a daemon serves: a list, of one model or several (``moecached --model PATH``, or
``--model NAME=PATH ...`` / ``[[models]]``), behind one interface the daemon drives.

One model given as ``--model PATH`` is a list of one served *on the daemon's endpoint*: its
server binds the endpoint (no router, no redirect), its cache gets the whole budget (fitted to
the memory the process may use) and the memory floor drives that budget; nothing else differs
(index, cache, server, file watch, views are built by the same code). The rest of this text is
about several models.

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
from moecached.daemon.served import ALONE, ANY_MODEL, DRAIN_S, ModelsError, Served, model_endpoint
from moecached.engine.index import open_index
from moecached.daemon.assemble import budget_bytes, floor_min_budget
from moecached.daemon.logs import stage
from moecached.engine.arena import planned_size, smallest_budget
from moecached.facts.units import format_bytes
from moecached.daemon.reload import ModelReloader
from moecached.daemon.settle import settle
from moecached.service.router import Router
from moecached.service.server import Server
from moecached.daemon.split import Member, Split, SplitError, least_share
from moecached.facts.stats import CACHE_STATS
from moecached.daemon import modelviews as V

log = logging.getLogger("moecached.models")

class Models:
    """The models served and their split; built by :func:`start`, driven from the endpoint's
    loop (its periodic task) and from any socket's hello (``route``). The daemon
    (``moecached.daemon.runtime.Daemon``) drives it the same way for one or several: ``start``, ``tick``,
    ``targets``, ``floor_target``, ``live_*``, ``stats``, ``status``, ``ready_message``,
    ``close``.

    Args:
        cfg: the daemon's Config at start.
        make_cache: ``(cfg, index, (budget_bytes, slots), progress=None) -> ExpertCache``.
        fit: alone: ``(cfg, index) -> (budget_bytes, slots)`` that fit the memory allowed.
        extend: alone: optional callable(seconds) while the arena is reserved and locked: the
            start may take that much longer (systemd's ``EXTEND_TIMEOUT_USEC``).
        floor_hooks: alone: (gone, back) called when the model's cache is replaced / served
            again after its file changed (the floor drives that cache's budget).
        server_kwargs: the Server arguments every socket gets.
        live_cfg: callable -> the running Config (SIGHUP replaces it): ``on_model_change``.
        exit: callable(status) that stops the daemon with that exit status.
        notify: optional callable(str): a systemd STATUS line.
    """

    def __init__(self, cfg, make_cache, server_kwargs, live_cfg=None, exit=None, notify=None,
                 fit=None, floor_hooks=(None, None), extend=None):
        self.cfg = cfg
        self._extend = extend             # alone: callable(seconds): more start-up time (systemd)
        #: one model served on the daemon's endpoint (``--model PATH``): a list of one
        self.alone = not cfg.models
        self._fit = fit                   # alone: (cfg, index) -> (budget, slots) that fit
        self._floor_gone, self._floor_back = floor_hooks
        self._make_cache = make_cache
        self._server_kwargs = server_kwargs
        self._live_cfg = live_cfg or (lambda: cfg)
        self._exit = exit
        self._notify = notify
        self.models: dict[str, Served] = {}
        self.lock = threading.RLock()     # models / split / caches: every loop reads them
        self.split: Split | None = None
        self.total = int(cfg.budget) if cfg.budget is not None else 0
        self.next_split = time.monotonic() + cfg.split_interval_s
        self._last_ghost: dict = {}
        self.moves: list = []             # the last moves: (time, donor, receiver, bytes)
        self.adding: dict = {}            # names being added (indexing, arena) now
        self.failed: dict = {}            # name -> why its last add failed
        self.retired = Counter()          # counters of the models removed (daemon totals)
        self.router = None                # the Router on the daemon's endpoint (no model)
        self.timings: dict = {}           # start-up: the daemon's total_s
        self._file_models = list(cfg.models)   # [[models]] as the file said when last read
        self._link: dict = {}             # name -> its arena's link state last seen
        self._repunched: dict = {}        # name -> (its cache, repunched bytes last reported, no warning before)

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
                                      "(Python: Client(endpoint, model=NAME); C: mc_options.model) "
                                      "or use its own socket, ENDPOINT.NAME (what a llama.cpp engine is given)")
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

    def _open(self, spec) -> Served:
        name, path = spec["name"], spec["path"]
        if not os.path.isfile(path) and not self.alone:
            raise ModelsError(f"model {name}: path {path}: expected an existing GGUF file")
        m = Served(name, path)
        m.spec = dict(spec)
        m.endpoint = self.cfg.endpoint if self.alone else model_endpoint(self.cfg.endpoint, name)
        if self.alone:   # its own error lines name the file
            m.index = open_index(path)
            return m
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

    def _new_cache(self, m: Served, index):
        """The cache of ``m`` over ``index``, sized to its share (caller holds the lock)."""
        member = self.split.members[m.name]
        cache = self._make_cache(self.cfg, index, (self._arena_max(member), None))
        try:
            cache.set_budget(self.split.shares[m.name])   # give back what is not its share
            cache.c_shrinks = 0   # that first cut to its share is not a shrink of its budget
            cache.set_ghost(self.split.ghost_slots(m.name))
        except BaseException:
            cache.close()
            raise
        return cache

    def _start_cache(self, m: Served, cache=None, endpoint_lock=None):
        """Cache (sized to its share, or ``cache``), server and file watch of ``m``; its server
        is run by :meth:`_run_thread` (alone: by the daemon, as its endpoint's)."""
        m.cache = cache if cache is not None else self._new_cache(m, m.index)
        try:
            m.server = Server(m.cache, endpoint=m.endpoint, model_path=m.path,
                              endpoint_lock=endpoint_lock, **self._server_kwargs)
        except BaseException:
            m.cache.close()
            raise
        if not self.alone:
            m.server.model_name = m.name
            m.server.route_model = self.route
            m.server.on_tick = lambda now, m=m: self._model_tick(m, now)
        what = f"model {m.path}" if self.alone else f"model {m.name} ({m.path})"
        m.reloader = ModelReloader(
            m.server, m.path, what, mode=lambda: self._live_cfg().on_model_change,
            rebuild=lambda index, m=m: self._rebuild(m, index), guard=self.lock,
            exit=self._exit_daemon,
            failed=None if self.alone else (lambda e, m=m: self._rebuild_failed(m, e)),
            installed=(lambda new: self._floor_back()) if self.alone and self._floor_back else None,
            notify=None if self._notify is None else
            (lambda line, name=m.name: self._notify(line if self.alone else f"model {name}: {line}")))
        self._last_ghost[m.name] = 0

    def _exit_daemon(self, status: int) -> None:
        if self._exit is not None:
            self._exit(status)

    def _model_tick(self, m: Served, now: float) -> None:
        """A model's own periodic task (its loop thread): its arena's link, its budget (a
        shrink to finish, given-back pages to punch again), its file."""
        if m.cache is None:   # not served again after its file changed: being removed
            return
        arena = m.cache.arena
        r = arena.check_link()
        if r == "relinked":
            log.warning("model %s: arena %s was unlinked by some process (multiprocessing."
                        "shared_memory.SharedMemory does that when the process that opened it "
                        "exits); linked it back from %s, clients attach as before", m.name,
                        arena.path, arena.keep_path)
        elif r != "ok" and r != self._link.get(m.name, "ok"):
            log.error("%s", r)
        self._link[m.name] = r
        settle(m, self._repunched, now=now)
        m.reloader.tick(now)

    def settle_memory(self) -> None:
        """Before the memory floor samples: every model's :func:`settle` (its warning is its
        model's next periodic task's), so that the floor samples what the caches hold."""
        for m in list(self.models.values()):
            settle(m, self._repunched, warn=False)

    def _rebuild(self, m: Served, index):
        if self.alone:   # the floor of the old cache goes with it; the new one gets the budget
            if self._floor_gone is not None:
                self._floor_gone()
            m.cache = self._make_cache(self._live_cfg(), index, self._fit(self._live_cfg(), index))
            m.index = index
            return m.cache
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

    def _rebuild_failed(self, m: Served, e: Exception) -> None:
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
        caller to run its loop. Alone: the model's server is the endpoint's (returned)."""
        if self.alone:
            return self._start_alone(held)
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

    def _start_alone(self, held: dict):
        """The one model of ``--model PATH``: index, cache (the whole budget, fitted to the
        memory allowed), and its server bound to the daemon's endpoint (the lock handed over)."""
        cfg = self.cfg
        name = os.path.splitext(os.path.basename(cfg.model))[0]
        self._note("indexing " + cfg.model)
        with stage(f"indexing {cfg.model}") as st_index:
            m = self._open({"name": name, "path": cfg.model})
        idx = m.index
        total = sum(sc.slot_bytes * len(sc.layers) for sc in idx.size_classes) * int(idx.n_experts)
        n_classes = len(idx.size_classes)
        log.info("found %d routed experts (%d layers x %d) in %d size class%s, %s of expert "
                 "weights", len(idx.expert_layers) * int(idx.n_experts), len(idx.expert_layers),
                 int(idx.n_experts), n_classes, "" if n_classes == 1 else "es",
                 format_bytes(total, precision=2))
        fitted = self._fit(cfg, idx)
        page = int(os.statvfs(cfg.arena_dir).f_bsize) if cfg.hugetlb else None
        size = planned_size(idx, budget_bytes=fitted[0], slots=fitted[1],
                            **({"page_size": page} if page else {}))
        what = ("reserving and locking" if cfg.lock_memory else "reserving") + \
            f" {format_bytes(size, precision=2)} for the arena in {cfg.arena_dir}"
        self._note(what)
        tenth, t0 = [0], time.monotonic()

        def progress(done, total):
            st_arena.update(done, total)
            if done * 10 // total > tenth[0]:   # systemctl status shows how far it got
                tenth[0] = done * 10 // total
                self._note(f"{what}: {tenth[0] * 10}%")
                if self._extend is not None:   # a big arena may take longer than TimeoutStartSec
                    left = (time.monotonic() - t0) * (total - done) / max(done, 1)
                    self._extend(max(30.0, 2 * left))

        with stage(what, total=size * (2 if cfg.lock_memory else 1)) as st_arena:
            cache = self._make_cache(cfg, idx, fitted, progress)
        lock_fd, held["lock"] = held["lock"], None   # the server owns it from here
        self._start_cache(m, cache=cache, endpoint_lock=lock_fd)
        self.models[m.name] = m
        self.timings = {"index_s": st_index.elapsed, "arena_s": st_arena.elapsed}
        return m.server

    def _note(self, line: str) -> None:
        if self._notify is not None:
            self._notify(line)

    def _run_thread(self, m: Served):
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
    def _held(m: Served) -> tuple:
        """(leases granted over the socket, slots pinned through shared memory) of ``m``'s
        clients now: what a removal waits for."""
        if m.cache is None:
            return len(m.server.leases), 0
        return len(m.server.leases), m.cache.pins_held()

    def tick(self, now: float):
        """The endpoint's periodic task: the split's period, removals that drained (alone:
        the model's own task, its arena's link and its file)."""
        if self.alone:
            for m in list(self.models.values()):
                self._model_tick(m, now)
            return
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
        if self.alone:
            raise ModelsError(ALONE)
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
        if self.alone:
            raise ModelsError(ALONE)
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

    def _keep_counts(self, m: Served, server: bool = True) -> None:
        """``m``'s cache is going (removed, or its file re-indexed): the daemon's totals keep
        counting what its counters (and, when ``server``, its socket's) counted."""
        st = m.cache.stats() if m.cache is not None else {}
        for row in CACHE_STATS:
            if row.kind == "counter" and isinstance(st.get(row.key), int):
                self.retired[row.key] += st[row.key]
        for k, v in (m.server.counters.items() if server else ()):
            self.retired["server." + k] += v

    def _finish_remove(self, m: Served):
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
        return V.summary(self, views)

    def _views(self) -> list:
        return V.model_views(self)

    def split_info(self) -> dict:
        return V.split_info(self)

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
    keep_new = ("models",)   # applied in part: the file's tables are read as they are now

    @property
    def several(self) -> bool:
        return not self.alone

    def _one(self) -> Served:
        return next(iter(self.models.values()))

    def targets(self, scope: str) -> list:
        """(server, cache) pairs a per-model live change reaches: every model's, and the
        endpoint's (no cache) for what every socket has (``scope`` "socket")."""
        out = [(srv, srv.cache) for srv in self.servers()]
        return out + ([(self.router, None)] if scope == "socket" and self.router else [])

    def floor_target(self, cfg) -> tuple:
        """(configured, least, set_budget): the memory floor shrinks the split's total and the
        split absorbs it; alone, it drives the model's cache budget (never above its arena)."""
        if self.alone:
            cache = self._one().cache
            configured = min(budget_bytes(cfg, cache) or cache.arena.size, cache.arena.size)
            return configured, floor_min_budget(cfg, cache, configured), cache.set_budget
        configured = int(cfg.budget)
        least = min(max(self.least_total(), cfg.min_budget or 0), configured)
        return configured, least, self.set_total

    def live_budget(self, new, floor):
        """SIGHUP changed ``budget`` or ``slots``: None when applied, else why not. While the
        memory floor is on it owns the budget: it gets the new configured budget."""
        if not self.alone:
            return "several models: restart to change it"
        cache = self._one().cache
        want = budget_bytes(new, cache)
        if want is None:
            return "neither budget nor slots set"
        if want > cache.arena.size:
            return f"larger than the {cache.arena.size} bytes the arena was created with"
        if want < smallest_budget(cache.index):
            return (f"{want} bytes is under the smallest arena this model runs with "
                    f"({smallest_budget(cache.index)} bytes: one slot per size class)")
        if floor is not None:   # the floor owns the budget while it is on
            floor.reconfigure(configured_budget=want, min_budget=floor_min_budget(new, cache, want))
        else:
            cache.set_budget(want)
        return None

    def live_split(self, new):
        return "only with several models" if self.alone else self.configure(new)

    def live_models(self, new):
        return ALONE if self.alone else self.reload_models(new)

    def stats(self) -> dict:
        return V.arena_stats(self._one()) if self.alone else V.daemon_stats(self)

    def status(self) -> dict:
        return V.arena_status(self._one()) if self.alone else V.daemon_status(self)

    def ready_message(self) -> tuple[str, str]:
        return V.ready_message(self)

    def close(self):
        """Stop every model's server and close its cache (the endpoint's server closes itself
        when its loop ends)."""
        for m in list(self.models.values()):
            if m.server is not None:
                m.server.stop()
                if m.thread is not None:
                    m.thread.join(timeout=10)
                elif not self.alone:
                    m.server.close()   # never ran: its socket and lock files go
            if m.reloader is not None:
                m.reloader.close()
            if m.cache is not None:
                m.cache.close()
