"""``moecached``: the daemon's entry point (what ``systemctl start moecached`` runs).

    moecached --model PATH [--budget SIZE | --slots N] [--endpoint ipc://...] [--config FILE]

Start-up order: configuration (file + flags, validated) -> the endpoint's lock (a second daemon
on a live endpoint is refused here, having touched nothing) -> index of the model's experts ->
the arena checked against the memory cgroup limit and MemAvailable (refused, or sized down when
a floor is set) -> arena reserved and locked + readers -> ZeroMQ socket bound -> READY=1 to
systemd. Each stage logs one line as it begins (a live percentage on a terminal). A failure
at any step prints one line and exits 1 (systemd restarts it per the unit file). SIGTERM
stops gracefully (pending requests fail with ``shutdown``, socket and arena files removed);
SIGHUP re-reads the config file and applies what can change without a restart.

A model file that changes under the daemon is noticed at once and handled per
``on_model_change`` (exit with status 3, or re-index it under a new session):
``moecached.reload``. See docs/operations.md, "Model file changed".
"""
from __future__ import annotations

import argparse
import grp
import logging
import os
import sys
import time

from . import MoecacheError, __version__
from . import config as C
from . import notify
from .logs import setup_logging, stage
from .units import format_bytes

log = logging.getLogger("moecached")


def _notify(*lines: str) -> None:
    notify.notify("\n".join(lines))


def _budget_bytes(cfg: C.Config, cache) -> int | None:
    """The arena bytes a config's budget or slots asks for (None when neither is set)."""
    if cfg.budget is not None:
        return int(cfg.budget)
    if cfg.slots is not None:
        from .arena import arena_bytes, plan_slots
        return arena_bytes(cache.index, plan_slots(cache.index, slots=cfg.slots), cache.arena.page_size)
    return None


_warned: dict = {}


def _floor_min_budget(cfg: C.Config, cache, configured_budget: int) -> int:
    """``min_budget`` for the floor, never above ``configured_budget``: the configured one,
    raised (with one warning per value) to the daemon's minimum when it is below what serving
    needs (two layers' top-k of every size class, ``min_budget_for``); the daemon's minimum
    when none is configured."""
    least = min(min_budget_for(cache.index, cache), configured_budget)
    if cfg.min_budget is None:
        return least
    if cfg.min_budget < least:
        if _warned.get("min_budget") != (cfg.min_budget, least):
            _warned["min_budget"] = (cfg.min_budget, least)
            log.warning("min_budget = %d bytes is below what serving needs (two layers' top-k "
                        "of every size class); the floor uses %d", cfg.min_budget, least)
        return least
    return min(cfg.min_budget, configured_budget)


def _floor_target(cfg: C.Config, cache, floor_box: dict) -> tuple:
    """What the memory floor drives: (configured budget, least budget, set_budget) of the
    cache, or with several models (``floor_box["models"]``) of the split's total."""
    models = floor_box.get("models")
    if models is not None:
        configured = int(cfg.budget)
        least = min(max(models.least_total(), cfg.min_budget or 0), configured)
        return configured, least, models.set_total
    # never above the arena (sized down at start when the budget did not fit)
    configured = min(_budget_bytes(cfg, cache) or cache.arena.size, cache.arena.size)
    return configured, _floor_min_budget(cfg, cache, configured), cache.set_budget


def _make_floor(cfg: C.Config, cache, floor_box: dict):
    from .floor import MemoryFloor
    configured, least, set_budget = _floor_target(cfg, cache, floor_box)
    return MemoryFloor(cfg.floor, cfg.floor_hysteresis, configured, least, set_budget,
                       interval=cfg.floor_interval_s, min_change_interval=cfg.floor_min_change_s,
                       log=logging.getLogger("moecached.floor"))


def _apply_live(key: str, new: C.Config, server, cache, floor_box: dict):
    """Apply one changed key to the running daemon with its ``reload`` function (its row in
    ``config.KEYS``). True when applied, else why not."""
    apply = C.KEYS[key].reload
    if apply is None:
        return "not changeable live"
    why = apply(new, server, cache, floor_box)
    return True if why is None else why


def apply_budget(new: C.Config, cache, floor_box: dict):
    """SIGHUP changed ``budget`` or ``slots``: None when applied, else why not. While the
    memory floor is on it owns the budget: it gets the new configured budget."""
    if floor_box.get("models") is not None:
        return "several models: restart to change it"
    want = _budget_bytes(new, cache)
    if want is None:
        return "neither budget nor slots set"
    if want > cache.arena.size:
        return f"larger than the {cache.arena.size} bytes the arena was created with"
    from .arena import smallest_budget
    if want < smallest_budget(cache.index):
        return (f"{want} bytes is under the smallest arena this model runs with "
                f"({smallest_budget(cache.index)} bytes: one slot per size class)")
    floor = floor_box["floor"]
    if floor is not None:   # the floor owns the budget while it is on
        floor.reconfigure(configured_budget=want,
                          min_budget=_floor_min_budget(new, cache, want))
    else:
        cache.set_budget(want)
    return None


def apply_floor(new: C.Config, server, cache, floor_box: dict):
    """SIGHUP changed a memory-floor key. ``floor_box["floor"]`` is the running MemoryFloor or
    None; turning the floor on creates one (the server's periodic task drives it), turning it
    off drops it and gives the cache (or the models' split) back its configured budget."""
    floor = floor_box["floor"]
    configured, least, set_budget = _floor_target(new, cache, floor_box)
    if new.floor is None:
        if floor is not None:  # off: the budget the floor took goes back
            floor_box["floor"], floor_box["off"] = None, floor  # kept: its counts go on
            set_budget(configured)
            log.info("memory floor off; budget back to %d bytes", configured)
        return None
    server.tick_s = min(1.0, new.floor_interval_s)
    if floor is None:      # on: starts with the next periodic tick
        floor = floor_box.pop("off", None)
        if floor is None:
            floor = _make_floor(new, cache, floor_box)
        else:              # the one turned off earlier: counters go on where they were
            floor.resume(configured)
        floor_box["floor"] = floor
        log.info("memory floor on at %d bytes available", new.floor)
    floor.reconfigure(floor_bytes=new.floor, hysteresis_bytes=new.floor_hysteresis,
                      configured_budget=configured, min_budget=least)
    floor.interval = new.floor_interval_s
    floor.min_change_interval = new.floor_min_change_s
    return None


def min_budget_for(index, cache) -> int:
    """Smallest budget the memory floor may shrink to: two layers' top-k of every size class
    (one layer computing, the next loading), in bytes."""
    from .arena import arena_bytes
    per_class = {sc.id: 2 * index.top_k for sc in index.size_classes}
    return min(arena_bytes(index, per_class, cache.arena.page_size), cache.arena.size)


def _fit_budget(cfg: C.Config, idx) -> tuple[int | None, int | None]:
    """(budget_bytes, slots) for the arena, checked against the memory this process may use
    before anything is reserved (``moecached.floor.fit_arena``): raises MemoryLimitError when
    it does not fit, or with a floor returns a smaller budget that does (logged once)."""
    from .arena import planned_size, smallest_budget
    from .floor import fit_arena, read_memory_limit
    budget, slots = cfg.budget, cfg.slots
    if budget is None and slots is None:
        slots = sum(len(sc.layers) for sc in idx.size_classes) * int(idx.n_experts)
    if cfg.hugetlb:   # huge pages come from their own pool, not MemAvailable or the cgroup
        return budget, slots
    size = planned_size(idx, budget_bytes=budget, slots=slots)
    swap = 0
    if not cfg.lock_memory:   # an unlocked arena may go to swap
        import psutil
        swap = int(psutil.swap_memory().free)
    fit = fit_arena(size, read_memory_limit(), floor=cfg.floor, swap_free=swap,
                    smallest=smallest_budget(idx), what="budget")
    if fit < size:
        log.warning("budget %s does not fit above the floor %s in the memory left now: sized the "
                    "arena down to %s (restart when memory is free to get the whole budget)",
                    format_bytes(size, precision=2), format_bytes(cfg.floor, precision=2),
                    format_bytes(fit, precision=2))
        return fit, None
    return budget, slots


def _make_cache(cfg: C.Config, idx, progress=None, fitted=None, read_queue=None):
    """The ExpertCache of ``idx`` for ``cfg`` (its budget fitted to the memory this process may
    use: ``fitted``, else ``_fit_budget``), its arena file given the configured mode/group;
    ``read_queue``: the daemon's shared ``ReadQueue`` (several models), else its own."""
    from .cache import ExpertCache
    budget, slots = fitted if fitted is not None else _fit_budget(cfg, idx)
    cache = ExpertCache(idx, budget_bytes=budget, slots=slots, policy=cfg.policy,
                        readers=cfg.readers, chunk_bytes=cfg.chunk, arena_dir=cfg.arena_dir,
                        hugetlb=cfg.hugetlb, lock_memory=cfg.lock_memory, direct_io=cfg.direct_io,
                        shrunk_policy=cfg.on_pressure, max_prefetch_loads=cfg.max_prefetch_loads,
                        arena_progress=progress, admit_cold=cfg.admit_cold,
                        eviction=cfg.eviction, scan_admit=cfg.scan_admit,
                        prefetch_min_confidence=cfg.prefetch_min_confidence,
                        read_queue=read_queue)
    try:
        arena = cache.arena
        os.chmod(arena.path, cfg.arena_mode)
        if cfg.group:
            os.chown(arena.path, -1, grp.getgrnam(cfg.group).gr_gid)
        if arena.keep_error:
            log.warning("%s; a client that unlinks the arena cannot be repaired", arena.keep_error)
    except BaseException:
        cache.close()
        raise
    return cache


def _server_kwargs(cfg: C.Config, gid) -> dict:
    """The Server arguments a config gives (every model's server alike)."""
    return dict(heartbeat_s=cfg.heartbeat_s, socket_mode=cfg.socket_mode, gid=gid,
                tick_s=min(1.0, cfg.floor_interval_s),
                max_request_experts=cfg.max_request_experts,
                max_message_bytes=cfg.max_message_bytes,
                acquire_timeout_s=cfg.pressure_timeout_s if cfg.on_pressure == "wait" else None,
                client_rate_limit=cfg.client_rate_limit,
                client_rate_burst=cfg.client_rate_burst,
                client_max_prefetch=cfg.client_max_prefetch,
                pin_files=cfg.fast_path, pin_quota=cfg.fast_path_quota)


def run_models(cfg: C.Config) -> int:
    """Run the daemon with several models (``[[models]]`` / ``--model NAME=PATH``) until
    SIGTERM/SIGINT (``moecached.multi``). Returns the process exit code."""
    from .arena import remove_stale_arenas
    from .multi import Models
    from .readers import ReadQueue
    from .server import lock_endpoint, unlock_endpoint
    gid = grp.getgrnam(cfg.group).gr_gid if cfg.group else None
    try:
        lock = lock_endpoint(cfg.endpoint)
    except MoecacheError as e:
        log.error("%s", e)
        return 1
    remove_stale_arenas(cfg.arena_dir, log)
    state = {"cfg": cfg, "base": cfg, "exit": 0}

    def stop_with(status):
        state["exit"] = status
        models.router.stop()

    # one set of reader threads and one queue for every model: one NVMe queue
    read_queue = ReadQueue(threads=cfg.readers, chunk_bytes=cfg.chunk)
    models = Models(cfg, lambda c, idx, size: _make_cache(c, idx, fitted=(size, None),
                                                          read_queue=read_queue),
                    _server_kwargs(cfg, gid), live_cfg=lambda: state["cfg"], exit=stop_with,
                    notify=lambda line: _notify(f"STATUS={line}"))
    try:
        with stage(f"indexing and reserving {len(cfg.models)} models"):
            router = models.start(lock)
    except MoecacheError as e:
        read_queue.close()
        if models.router is None:
            unlock_endpoint(cfg.endpoint, lock)
        log.error("%s", e)
        _notify(f"STATUS=failed: {e}")
        return 1
    floor_box = {"floor": None, "models": models}
    if cfg.floor is not None:
        floor_box["floor"] = _make_floor(cfg, None, floor_box)
    watchdog = notify.watchdog_ping if notify.watchdog_interval() else None

    def on_tick(now):
        if floor_box["floor"] is not None:
            floor_box["floor"].tick(now)
        models.tick(now)
        if watchdog is not None:
            watchdog()

    def extra_stats():
        st = models.daemon_stats()
        st["read_queue"] = read_queue.stats()
        if floor_box["floor"] is not None:
            st["floor"] = floor_box["floor"].stats()
        return st

    router.on_tick = on_tick
    router.extra_stats = extra_stats
    def extra_status():
        st = models.daemon_status()
        if floor_box["floor"] is not None:
            st["floor"] = floor_box["floor"].stats()
        return st

    router.extra_status = extra_status
    router.models_handler = models.handle

    def apply_key(key, new):
        """A changed key: once for the daemon, or to every model (and socket) it reaches."""
        scope = C.KEYS[key].scope
        if scope in ("daemon", "budget"):   # budget: the floor drives the split's total
            return _apply_live(key, new, router, None, floor_box)
        targets = models.servers() + ([router] if scope == "socket" else [])
        for srv in targets:
            ok = _apply_live(key, new, srv, srv.cache, floor_box)
            if ok is not True:
                return ok
        return True

    router.install_signal_handlers(on_hup=lambda: reload_config(state, apply_key,
                                                                keep_new=("models",)))

    def ready():
        msg = (f"serving {len(models.models)} models ("
               + ", ".join(f"{n} {s / 2**30:.2f} GiB" for n, s in models.split.shares.items())
               + f") on {cfg.endpoint}")
        log.info("moecached %s ready: %s", __version__, msg)
        _notify("READY=1", f"STATUS={msg}", f"MAINPID={os.getpid()}")

    try:
        router.serve_forever(ready=ready)
    finally:
        _notify("STOPPING=1")
        models.close()
        read_queue.close()
    if state["exit"]:
        return state["exit"]
    log.info("stopped")
    return 0


def build(cfg: C.Config):
    """Index + cache + (floor) + server for a validated Config. Returns (server, cache,
    floor_box): ``floor_box["floor"]`` is the MemoryFloor or None (SIGHUP may switch it);
    ``floor_box["timings"]`` the seconds each start-up stage took."""
    from .server import lock_endpoint, unlock_endpoint

    t0 = time.monotonic()
    held = {"lock": lock_endpoint(cfg.endpoint)}  # before anything is read or reserved
    try:
        return _build(cfg, held, t0)
    except BaseException:
        if held["lock"] is not None:   # not handed to a Server yet
            unlock_endpoint(cfg.endpoint, held["lock"])
        raise


def _build(cfg: C.Config, held: dict, t0: float):
    from .index import open_index
    from .server import Server

    _notify("STATUS=indexing " + cfg.model)
    with stage(f"indexing {cfg.model}") as st_index:
        idx = open_index(cfg.model)
    total = sum(sc.slot_bytes * len(sc.layers) for sc in idx.size_classes) * int(idx.n_experts)
    n_classes = len(idx.size_classes)
    log.info("found %d routed experts (%d layers x %d) in %d size class%s, %s of expert weights",
             len(idx.expert_layers) * int(idx.n_experts), len(idx.expert_layers), int(idx.n_experts),
             n_classes, "" if n_classes == 1 else "es", format_bytes(total, precision=2))
    gid = grp.getgrnam(cfg.group).gr_gid if cfg.group else None
    from .arena import remove_stale_arenas, planned_size
    remove_stale_arenas(cfg.arena_dir, log)  # arenas of daemons that were killed pin shm
    budget, slots = _fit_budget(cfg, idx)
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
        cache = _make_cache(cfg, idx, progress, fitted=(budget, slots))
    try:
        floor_box = {"floor": _make_floor(cfg, cache, {}) if cfg.floor is not None else None,
                     "timings": {"index_s": st_index.elapsed, "arena_s": st_arena.elapsed}}

        watchdog = notify.watchdog_ping if notify.watchdog_interval() else None
        seen = {"link": "ok"}

        def check_arena():
            arena = server.cache.arena     # the current one: a model reload makes a new arena
            r = arena.check_link()
            if r == "relinked":
                log.warning("arena %s was unlinked by some process (multiprocessing.shared_memory"
                            ".SharedMemory does that when the process that opened it exits); linked "
                            "it back from %s, clients attach as before", arena.path, arena.keep_path)
            elif r != "ok" and r != seen["link"]:
                log.error("%s", r)
            seen["link"] = r

        def on_tick(now):
            check_arena()
            floor = floor_box["floor"]
            if floor is not None:
                floor.tick(now)
            if watchdog is not None:
                watchdog()

        lock_fd, held["lock"] = held["lock"], None   # the server owns it from here
        server = Server(cache, endpoint=cfg.endpoint, model_path=cfg.model, on_tick=on_tick,
                        endpoint_lock=lock_fd, **_server_kwargs(cfg, gid))

        def extra_stats():
            arena = server.cache.arena
            st = {"arena": {"path": arena.path, "private_link": arena.keep_path,
                            "relinks": arena.relinks, "problem": arena.link_problem}}
            floor = floor_box["floor"]
            if floor is not None:
                st["floor"] = floor.stats()
            return st

        def extra_status():
            arena = server.cache.arena
            if arena.link_problem is None:
                return {}
            return {"state": "degraded", "problem": arena.link_problem}

        server.extra_stats = extra_stats
        server.extra_status = extra_status
        floor_box["timings"]["total_s"] = time.monotonic() - t0
    except BaseException:
        cache.close()
        raise
    return server, cache, floor_box


def run(cfg: C.Config) -> int:
    """Run the daemon until SIGTERM/SIGINT. Returns the process exit code."""
    from .reload import ModelReloader
    if cfg.models:
        return run_models(cfg)
    try:
        server, cache, floor_box = build(cfg)
    except MoecacheError as e:
        log.error("%s", e)
        _notify(f"STATUS=failed: {e}")
        return 1
    state = {"cfg": cfg, "base": cfg, "exit": 0}

    def stop_with(status):
        state["exit"] = status
        server.stop()

    def rebuild(idx):
        floor_box["floor"] = None       # the floor of the old cache goes with it
        floor_box.pop("off", None)
        return _make_cache(state["cfg"], idx)

    def installed(new):
        new_cfg = state["cfg"]
        if new_cfg.floor is not None:
            floor_box["floor"] = _make_floor(new_cfg, new, floor_box)

    reloader = ModelReloader(server, cfg.model, f"model {cfg.model}",
                             mode=lambda: state["cfg"].on_model_change, rebuild=rebuild,
                             installed=installed, exit=stop_with,
                             notify=lambda line: _notify(f"STATUS={line}"))
    base_tick = server.on_tick

    def on_tick(now):
        if base_tick is not None:
            base_tick(now)
        reloader.tick(now)

    server.on_tick = on_tick
    server.install_signal_handlers(on_hup=lambda: reload_config(
        state, lambda key, new: _apply_live(key, new, server, server.cache, floor_box)))

    def ready():
        slots = sum(c.n_slots for c in cache.arena.classes)
        msg = (f"serving {os.path.basename(cfg.model)} on {cfg.endpoint}: {slots} slots, "
               f"{cache.arena.size / 2**30:.2f} GiB arena")
        t = floor_box["timings"]
        log.info("moecached %s ready: %s (started in %.1f s: index %.1f s, arena %.1f s)", __version__,
                 msg, t["total_s"], t["index_s"], t["arena_s"])
        _notify("READY=1", f"STATUS={msg}", f"MAINPID={os.getpid()}")

    try:
        server.serve_forever(ready=ready)
    finally:
        _notify("STOPPING=1")
        reloader.close()
        server.cache.close()
    if state["exit"]:
        return state["exit"]
    log.info("stopped")
    return 0


def reload_config(state: dict, apply_key, keep_new=()) -> None:
    """SIGHUP: re-read the config file (command-line flags still win) and apply what can change
    live with ``apply_key(key, new_cfg) -> True | why not``; say exactly what was applied and
    what needs a restart. ``state["cfg"]`` is the running config (replaced by the new one),
    ``state["base"]`` the one it started with (its file and command line are read again); a
    key not applied keeps reporting its old value, except those in ``keep_new`` (applied in
    part: ``models``)."""
    old, base = state["cfg"], state["base"]   # base: the config the daemon started with
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
            ok = apply_key(key, new)
        except (MoecacheError, ValueError) as e:  # e.g. the cache refused the size
            ok = f"failed: {e}"
        if ok is True:
            applied.append(key)
        else:
            restart.append(f"{key} ({ok})" if isinstance(ok, str) else key)
            if key not in keep_new:
                setattr(new, key, getattr(old, key))  # not applied: keep reporting the old value
    if restart:
        log.warning("SIGHUP: not applied, need a restart: %s", ", ".join(restart))
    log.info("SIGHUP: applied %s", ", ".join(applied) or "nothing (no live-changeable key changed)")
    state["cfg"] = new


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moecached", description="Expert cache daemon for mixture-of-experts models "
                                "(see docs/operations.md)")
    p.add_argument("--version", action="version", version=f"moecached {__version__}")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration as TOML and exit")
    C.add_cli_args(p)
    args = p.parse_args(argv)
    try:
        cfg = C.config_from_args(args, check_runnable=not args.print_config)
    except MoecacheError as e:
        print(f"moecached: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(C.dump_toml(cfg), end="")
        return 0
    setup_logging(cfg.log_level)
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
