"""The running daemon: one :class:`Daemon` object, built from the configuration by
``moecached.daemon.cli`` and run until SIGTERM/SIGINT.

The daemon owns the read queue (one set of reader threads for every model: one NVMe queue),
the models it serves, the memory floor and live reload. The models are a list
(``moecached.daemon.multi.Models``), of one or several, built and driven by the same code: one
model given as ``--model PATH`` is a list of one served on the daemon's own endpoint (the floor
drives its cache's budget); several share one split budget, each on its own socket beside the
endpoint (the floor drives the split's total). The daemon runs the same way either way: endpoint lock -> stale arenas ->
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
from moecached.engine.arena import BudgetError, remove_stale_arenas
from moecached.daemon.assemble import fit_budget, make_cache, server_kwargs
from moecached.daemon.floor import MemoryFloor
from moecached.daemon.state import WarmStates
from moecached.daemon.multi import Models
from moecached.engine.readers import ReadQueue
from moecached.service.server import lock_endpoint, unlock_endpoint

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
    server.set_loop_share(new.client_loop_share)
    server.set_pin_hit_rate(new.fast_path_hit_rate)


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


class Daemon:
    """The daemon: read queue, models (one or several), memory floor, live reload.

    ``Daemon(cfg).run()`` serves until SIGTERM/SIGINT and returns the exit status.
    Attributes: ``cfg`` (the running config; SIGHUP replaces it), ``base`` (the one it started
    with), ``models`` (``moecached.daemon.multi.Models``: one model or several), ``server`` (the
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
        self.models = Models(cfg, lambda c, idx, fitted, progress=None: make_cache(
            c, idx, progress, fitted=fitted, read_queue=self.read_queue),
            server_kwargs(cfg), live_cfg=lambda: self.cfg, exit=self.stop,
            notify=lambda line: _notify(f"STATUS={line}"), fit=fit_budget,
            floor_hooks=(self.floor_gone, self.floor_back),
            extend=lambda s: _notify(f"EXTEND_TIMEOUT_USEC={int(s * 1e6)}"))

    # ------------------------------------------------------------------ start, run, stop
    def start(self) -> None:
        """Endpoint lock (before anything is read or reserved), stale arenas, read queue,
        models, floor, signal handlers. Raises MoecacheError (nothing left behind)."""
        t0 = time.monotonic()
        cfg = self.cfg
        held = {"lock": lock_endpoint(cfg.endpoint)}
        try:
            # arenas of killed daemons pin shm: in every directory of an arena_dir list that could
            # take the arena (an earlier start may have taken another one), by its resolved path;
            # never in one that another user could swap
            usable = [os.path.realpath(d) for d, why in (cfg.arena_dir_refused or {}).items() if why is None]
            for d in dict.fromkeys([cfg.arena_dir] + usable):
                if os.path.isdir(d):
                    remove_stale_arenas(d, log)
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
            # 2: a budget no start can serve with (systemd does not restart it: the unit's
            # RestartPreventExitStatus); 1: a start that failed
            return 2 if isinstance(e, BudgetError) else 1
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
            self.models.settle_memory()   # pages a reader faulted back in go before it samples
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
        notify.reloading()   # systemd: RELOADING=1 now, READY=1 when done (also when refused)
        try:
            self._reload_config()
        finally:
            notify.ready(self.models.ready_message()[0])

    def _reload_config(self) -> None:
        old, base = self.cfg, self.base
        try:
            new = C.load_config(base.path, {k: v for k, v in base.as_dict().items()
                                            if base.sources.get(k) == "command line"},
                                origin="command line", cli=False, running=old)
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
        for key in restart:   # (a failed apply's entry carries its reason: put back above)
            if key in C.KEYS and key not in self.models.keep_new:
                setattr(new, key, getattr(old, key))   # a restart applies it; until then the old value runs
                if key == "arena_dir":
                    new.arena_dir_choices = old.arena_dir_choices
        if restart:
            log.warning("SIGHUP: not applied, need a restart: %s", ", ".join(restart))
        log.info("SIGHUP: applied %s", ", ".join(applied) or "nothing (no live-changeable key changed)")
        self.cfg = new
