"""The running daemon: one :class:`Daemon` object, built from the configuration by
``moecached.daemon.cli`` and run until SIGTERM/SIGINT.

The daemon owns the read queue (one set of reader threads for every model: one NVMe queue),
the models it serves, the memory floor and live reload. The models are a set with one
interface, whether one model or several: :class:`OneModel` serves ``--model PATH`` on the
daemon's own endpoint (the floor drives its cache's budget); ``moecached.daemon.multi.Models`` serves
several under one split budget, each on its own socket beside the endpoint (the floor drives
the split's total). The daemon runs either the same way: endpoint lock -> stale arenas ->
read queue -> models -> floor -> signal handlers -> the endpoint's loop, whose periodic task
ticks the floor, the models (their split, file watches, arena links) and systemd's watchdog.

Live reload: SIGHUP re-reads the config file (:meth:`Daemon.reload_config`) and applies each
changed key with :meth:`Daemon.apply`. Which keys change live, and how, is declared in
``moecached.daemon.config.KEYS`` (a name per key: ``reload``; what it reaches: ``scope``); the daemon
maps each name to its own method here (``_live_<name>``), or, for what reaches every model's
cache and socket, to a function of :data:`PER_MODEL`.
"""
from __future__ import annotations

import logging
import os
import time

from moecached import MoecacheError, __version__
from moecached.daemon import config as C
from moecached.daemon import notify
from moecached.engine.arena import remove_stale_arenas, planned_size, smallest_budget
from moecached.daemon.assemble import budget_bytes, fit_budget, floor_min_budget, make_cache, server_kwargs
from moecached.daemon.floor import MemoryFloor
from moecached.daemon.state import WarmStates
from moecached.engine.index import open_index
from moecached.daemon.logs import stage
from moecached.daemon.multi import Models
from moecached.engine.readers import ReadQueue
from moecached.daemon.reload import ModelReloader
from moecached.service.server import Server, lock_endpoint, unlock_endpoint
from moecached.facts.units import format_bytes

log = logging.getLogger("moecached")


def _notify(*lines: str) -> None:
    notify.notify("\n".join(lines))


# -- live changes that reach each model's cache and socket: (new config, server, cache) ----------
# ``cache`` is None on the several-models endpoint (a socket without a model).

def _on_heartbeat(new, server, cache):
    server.heartbeat_s = new.heartbeat_s


def _on_request_limits(new, server, cache):
    server.set_request_limits(new.max_request_experts, new.max_message_bytes)


def _on_client_limits(new, server, cache):
    server.set_client_limits(new.client_rate_limit, new.client_rate_burst, new.client_max_prefetch)


def _on_admit_cold(new, server, cache):
    cache.admit_cold = new.admit_cold


def _on_scan_admit(new, server, cache):
    cache.scan_admit = new.scan_admit


def _on_prefetch_min_confidence(new, server, cache):
    cache.prefetch_min_confidence = new.prefetch_min_confidence


def _on_on_pressure(new, server, cache):
    cache.shrunk_policy = new.on_pressure
    server.acquire_timeout_s = new.pressure_timeout_s if new.on_pressure == "wait" else None


def _on_pressure_timeout(new, server, cache):
    if new.on_pressure == "wait":
        server.acquire_timeout_s = new.pressure_timeout_s


#: ``reload`` name (config.KEYS) -> how it is applied to one model's (server, cache)
PER_MODEL = {"heartbeat": _on_heartbeat, "request_limits": _on_request_limits,
             "client_limits": _on_client_limits, "admit_cold": _on_admit_cold,
             "scan_admit": _on_scan_admit, "prefetch_min_confidence": _on_prefetch_min_confidence,
             "on_pressure": _on_on_pressure, "pressure_timeout": _on_pressure_timeout}


class OneModel:
    """One model served on the daemon's own endpoint (``--model PATH``): its index, cache
    (the whole budget), server and file watch. A model file that changes is re-indexed under a
    new session of the same socket (or the daemon exits), per ``on_model_change``."""

    several = False
    keep_new = ()     # config keys reported as read even when not applied

    def __init__(self, daemon: "Daemon"):
        self.daemon = daemon
        self.path = daemon.cfg.model
        self.server = self.reloader = None
        self.timings: dict = {}
        self._link = "ok"

    @property
    def cache(self):
        return self.server.cache   # the current one: a model reload makes a new cache

    def start(self, held: dict):
        """Index, arena, cache and server of the model; the endpoint's lock (``held["lock"]``)
        goes to the server. Returns the server of the daemon's endpoint."""
        d, cfg = self.daemon, self.daemon.cfg
        _notify("STATUS=indexing " + cfg.model)
        with stage(f"indexing {cfg.model}") as st_index:
            idx = open_index(cfg.model)
        total = sum(sc.slot_bytes * len(sc.layers) for sc in idx.size_classes) * int(idx.n_experts)
        n_classes = len(idx.size_classes)
        log.info("found %d routed experts (%d layers x %d) in %d size class%s, %s of expert "
                 "weights", len(idx.expert_layers) * int(idx.n_experts), len(idx.expert_layers),
                 int(idx.n_experts), n_classes, "" if n_classes == 1 else "es",
                 format_bytes(total, precision=2))
        budget, slots = fit_budget(cfg, idx)
        page = int(os.statvfs(cfg.arena_dir).f_bsize) if cfg.hugetlb else None
        size = planned_size(idx, budget_bytes=budget, slots=slots,
                            **({"page_size": page} if page else {}))
        what = ("reserving and locking" if cfg.lock_memory else "reserving") + \
            f" {format_bytes(size, precision=2)} for the arena in {cfg.arena_dir}"
        _notify("STATUS=" + what)
        tenth = [0]

        def progress(done, total):
            st_arena.update(done, total)
            if done * 10 // total > tenth[0]:   # systemctl status shows how far it got
                tenth[0] = done * 10 // total
                _notify(f"STATUS={what}: {tenth[0] * 10}%")

        with stage(what, total=size * (2 if cfg.lock_memory else 1)) as st_arena:
            cache = make_cache(cfg, idx, progress, fitted=(budget, slots),
                               read_queue=d.read_queue)
        try:
            lock_fd, held["lock"] = held["lock"], None   # the server owns it from here
            self.server = Server(cache, endpoint=cfg.endpoint, model_path=cfg.model,
                                 endpoint_lock=lock_fd, **server_kwargs(cfg))
        except BaseException:
            cache.close()
            raise
        self.timings = {"index_s": st_index.elapsed, "arena_s": st_arena.elapsed}
        self.reloader = ModelReloader(self.server, cfg.model, f"model {cfg.model}",
                                      mode=lambda: d.cfg.on_model_change, rebuild=self._rebuild,
                                      installed=self._installed, exit=d.stop,
                                      notify=lambda line: _notify(f"STATUS={line}"))
        return self.server

    def _rebuild(self, idx):
        self.daemon.floor_gone()       # the floor of the old cache goes with it
        return make_cache(self.daemon.cfg, idx, read_queue=self.daemon.read_queue)

    def _installed(self, new):
        self.daemon.floor_back()

    def targets(self, scope: str) -> list:
        """(server, cache) pairs a per-model live change reaches: the one model's."""
        return [(self.server, self.server.cache)]

    def tick(self, now: float) -> None:
        """The periodic task: the arena's link, the model file."""
        arena = self.server.cache.arena
        r = arena.check_link()
        if r == "relinked":
            log.warning("arena %s was unlinked by some process (multiprocessing.shared_memory"
                        ".SharedMemory does that when the process that opened it exits); linked "
                        "it back from %s, clients attach as before", arena.path, arena.keep_path)
        elif r != "ok" and r != self._link:
            log.error("%s", r)
        self._link = r
        self.reloader.tick(now)

    def floor_target(self, cfg) -> tuple:
        """(configured budget, least budget, set_budget) the memory floor works between."""
        cache = self.server.cache
        # never above the arena (sized down at start when the budget did not fit)
        configured = min(budget_bytes(cfg, cache) or cache.arena.size, cache.arena.size)
        return configured, floor_min_budget(cfg, cache, configured), cache.set_budget

    def live_budget(self, new, floor):
        """SIGHUP changed ``budget`` or ``slots``: None when applied, else why not. While the
        memory floor is on it owns the budget: it gets the new configured budget."""
        cache = self.server.cache
        want = budget_bytes(new, cache)
        if want is None:
            return "neither budget nor slots set"
        if want > cache.arena.size:
            return f"larger than the {cache.arena.size} bytes the arena was created with"
        if want < smallest_budget(cache.index):
            return (f"{want} bytes is under the smallest arena this model runs with "
                    f"({smallest_budget(cache.index)} bytes: one slot per size class)")
        if floor is not None:   # the floor owns the budget while it is on
            floor.reconfigure(configured_budget=want,
                              min_budget=floor_min_budget(new, cache, want))
        else:
            cache.set_budget(want)
        return None

    def live_split(self, new):
        return "only with several models"

    def live_models(self, new):
        return "the daemon was started with one model (--model PATH): restart it with --model NAME=PATH"

    def stats(self) -> dict:
        arena = self.server.cache.arena
        return {"arena": {"path": arena.path, "private_link": arena.keep_path,
                          "relinks": arena.relinks, "problem": arena.link_problem}}

    def status(self) -> dict:
        arena = self.server.cache.arena
        if arena.link_problem is None:
            return {}
        return {"state": "degraded", "problem": arena.link_problem}

    def ready_message(self) -> tuple[str, str]:
        cfg, cache = self.daemon.cfg, self.server.cache
        slots = sum(c.n_slots for c in cache.arena.classes)
        t = self.timings
        return (f"serving {os.path.basename(cfg.model)} on {cfg.endpoint}: {slots} slots, "
                f"{cache.arena.size / 2**30:.2f} GiB arena",
                f" (started in {t['total_s']:.1f} s: index {t['index_s']:.1f} s, arena "
                f"{t['arena_s']:.1f} s)")

    def close(self) -> None:
        if self.reloader is not None:
            self.reloader.close()
        if self.server is not None:
            self.server.cache.close()


class Daemon:
    """The daemon: read queue, models (one or several), memory floor, live reload.

    ``Daemon(cfg).run()`` serves until SIGTERM/SIGINT and returns the exit status.
    Attributes: ``cfg`` (the running config; SIGHUP replaces it), ``base`` (the one it started
    with), ``models`` (:class:`OneModel` or ``moecached.daemon.multi.Models``), ``server`` (the
    daemon's endpoint), ``floor`` (the running ``MemoryFloor`` or None), ``read_queue``.
    """

    def __init__(self, cfg: C.Config):
        self.cfg = self.base = cfg
        self.exit_status = 0
        self.read_queue = None
        self.server = None
        self.floor = None
        self.states = None       # warm starts: the models' state files and fills
        self._floor_off = None   # a floor turned off by SIGHUP: its counters go on if back
        self._watchdog = notify.watchdog_ping if notify.watchdog_interval() else None
        if cfg.models:
            self.models = Models(cfg, lambda c, idx, size: make_cache(
                c, idx, fitted=(size, None), read_queue=self.read_queue),
                server_kwargs(cfg), live_cfg=lambda: self.cfg, exit=self.stop,
                notify=lambda line: _notify(f"STATUS={line}"))
        else:
            self.models = OneModel(self)

    # ------------------------------------------------------------------ start, run, stop
    def start(self) -> None:
        """Endpoint lock (before anything is read or reserved), stale arenas, read queue,
        models, floor, signal handlers. Raises MoecacheError (nothing left behind)."""
        t0 = time.monotonic()
        cfg = self.cfg
        held = {"lock": lock_endpoint(cfg.endpoint)}
        try:
            remove_stale_arenas(cfg.arena_dir, log)  # arenas of killed daemons pin shm
            self.read_queue = ReadQueue(threads=cfg.readers, chunk_bytes=cfg.chunk)
            self.server = self.models.start(held)
        except BaseException:
            if held["lock"] is not None:   # not handed to a Server yet
                unlock_endpoint(cfg.endpoint, held["lock"])
            if self.read_queue is not None:
                self.read_queue.close()
            raise
        if cfg.floor is not None:
            self.floor = self._make_floor(cfg)
        self.states = WarmStates(self)
        self.server.on_tick = self._tick
        self.server.extra_stats = self._stats
        self.server.extra_status = self._status
        self.server.install_signal_handlers(on_hup=self.reload_config)
        self.models.timings["total_s"] = time.monotonic() - t0

    def run(self) -> int:
        """Start and serve until SIGTERM/SIGINT. Returns the process exit code."""
        try:
            self.start()
        except MoecacheError as e:
            log.error("%s", e)
            _notify(f"STATUS=failed: {e}")
            return 1
        try:
            self.server.serve_forever(ready=self._ready)
        finally:
            _notify("STOPPING=1")
            if self.states is not None:   # the resident sets, for the next start
                self.states.close()
            self.models.close()
            self.read_queue.close()
        if self.exit_status:
            return self.exit_status
        log.info("stopped")
        return 0

    def stop(self, status: int = 0) -> None:
        """Stop serving; the process exits with ``status``."""
        self.exit_status = status
        if self.server is not None:
            self.server.stop()

    def _ready(self) -> None:
        msg, more = self.models.ready_message()
        log.info("moecached %s ready: %s%s", __version__, msg, more)
        _notify("READY=1", f"STATUS={msg}", f"MAINPID={os.getpid()}")
        if self.states is not None:   # fill back what the last run held, while serving
            self.states.start()

    def _tick(self, now: float) -> None:
        if self.floor is not None:
            self.floor.tick(now)
        self.models.tick(now)
        if self.states is not None:
            self.states.tick(now)
        if self._watchdog is not None:
            self._watchdog()

    def _stats(self) -> dict:
        st = self.models.stats()
        if self.models.several:   # one queue under every model: the daemon's view has it
            st["read_queue"] = self.read_queue.stats()
        if self.floor is not None:
            st["floor"] = self.floor.stats()
        if self.states is not None:
            st["warm"] = self.states.stats()
        return st

    def _status(self) -> dict:
        st = self.models.status()
        if self.models.several and self.floor is not None:
            st["floor"] = self.floor.stats()
        return st

    # ------------------------------------------------------------------ the memory floor
    def _make_floor(self, cfg) -> MemoryFloor:
        configured, least, set_budget = self.models.floor_target(cfg)
        return MemoryFloor(cfg.floor, cfg.floor_hysteresis, configured, least, set_budget,
                           interval=cfg.floor_interval_s, min_change_interval=cfg.floor_min_change_s,
                           log=logging.getLogger("moecached.daemon.floor"))

    def floor_gone(self) -> None:
        """The cache the floor drives is being replaced (its model re-indexed)."""
        self.floor = self._floor_off = None

    def floor_back(self) -> None:
        """A new cache is served: a floor that is configured drives it."""
        if self.cfg.floor is not None:
            self.floor = self._make_floor(self.cfg)

    # ------------------------------------------------------------------ live reload
    def apply(self, key: str, new: C.Config):
        """Apply one changed key (SIGHUP) to the running daemon the way its row in
        ``config.KEYS`` declares: True when applied, else why not."""
        row = C.KEYS[key]
        if row.reload is None:
            return "not changeable live"
        if row.reload in PER_MODEL:   # each model's cache and socket (and the endpoint's)
            for server, cache in self.models.targets(row.scope):
                why = PER_MODEL[row.reload](new, server, cache)
                if why is not None:
                    return why
            return True
        why = getattr(self, "_live_" + row.reload)(new)
        return True if why is None else why

    def _live_log_level(self, new):
        logging.getLogger().setLevel(new.log_level.upper())

    def _live_read_when_used(self, new):
        """Nothing to do: the daemon reads the value when it needs it (``on_model_change``)."""

    def _live_budget(self, new):
        return self.models.live_budget(new, self.floor)

    def _live_split(self, new):
        return self.models.live_split(new)

    def _live_models(self, new):
        return self.models.live_models(new)

    def _live_floor(self, new):
        """A memory-floor key changed. Turning the floor on creates one (the endpoint's periodic
        task drives it), turning it off drops it and gives the cache (or the models' split)
        back its configured budget."""
        floor = self.floor
        configured, least, set_budget = self.models.floor_target(new)
        if new.floor is None:
            if floor is not None:  # off: the budget the floor took goes back
                self.floor, self._floor_off = None, floor  # kept: its counts go on
                set_budget(configured)
                log.info("memory floor off; budget back to %d bytes", configured)
            return None
        self.server.tick_s = min(1.0, new.floor_interval_s)
        if floor is None:      # on: starts with the next periodic tick
            floor, self._floor_off = self._floor_off, None
            if floor is None:
                floor = self._make_floor(new)
            else:              # the one turned off earlier: counters go on where they were
                floor.resume(configured)
            self.floor = floor
            log.info("memory floor on at %d bytes available", new.floor)
        floor.reconfigure(floor_bytes=new.floor, hysteresis_bytes=new.floor_hysteresis,
                          configured_budget=configured, min_budget=least)
        floor.interval = new.floor_interval_s
        floor.min_change_interval = new.floor_min_change_s
        return None

    def reload_config(self) -> None:
        """SIGHUP: re-read the config file (command-line flags still win) and apply what can
        change live (:meth:`apply`); say exactly what was applied and what needs a restart. A
        key not applied keeps reporting its old value, except those the models apply in part
        (``models``)."""
        old, base = self.cfg, self.base
        try:
            new = C.load_config(base.path, {k: v for k, v in base.as_dict().items()
                                            if base.sources.get(k) == "command line"},
                                origin="command line", cli=False)
        except MoecacheError as e:
            log.error("SIGHUP: config not reloaded: %s", e)
            return
        changes, restart = C.reload_changes(old, new)
        applied = []
        for key in list(changes):
            try:
                ok = self.apply(key, new)
            except (MoecacheError, ValueError) as e:  # e.g. the cache refused the size
                ok = f"failed: {e}"
            if ok is True:
                applied.append(key)
            else:
                restart.append(f"{key} ({ok})" if isinstance(ok, str) else key)
                if key not in self.models.keep_new:
                    setattr(new, key, getattr(old, key))  # not applied: the old value stays
        if restart:
            log.warning("SIGHUP: not applied, need a restart: %s", ", ".join(restart))
        log.info("SIGHUP: applied %s", ", ".join(applied) or "nothing (no live-changeable key changed)")
        self.cfg = new
