"""``moecached``: the daemon's entry point (what ``systemctl start moecached`` runs).

    moecached --model PATH [--budget SIZE | --slots N] [--endpoint ipc://...] [--config FILE]

Start-up order: configuration (file + flags, validated) -> index of the model's experts ->
arena reserved and locked + readers -> ZeroMQ socket bound -> READY=1 to systemd. A failure
at any step prints one line and exits 1 (systemd restarts it per the unit file). SIGTERM
stops gracefully (pending requests fail with ``shutdown``, socket and arena files removed);
SIGHUP re-reads the config file and applies what can change without a restart.
"""
from __future__ import annotations

import argparse
import grp
import logging
import os
import sys

from . import MoecacheError, __version__
from . import config as C
from . import notify
from .logs import setup_logging

log = logging.getLogger("moecached")


def _notify(*lines: str) -> None:
    notify.notify("\n".join(lines))


def _budget_bytes(cfg: C.Config, cache) -> int | None:
    """The arena bytes a config's budget or slots asks for (None when neither is set)."""
    if cfg.budget is not None:
        return int(cfg.budget)
    if cfg.slots is not None:
        from .arena import plan_slots
        n = plan_slots(cache.index, slots=cfg.slots)
        return sum(n[c.id] * c.slot_bytes for c in cache.arena.classes)
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


def _make_floor(cfg: C.Config, cache, configured_budget: int):
    from .floor import MemoryFloor
    return MemoryFloor(cfg.floor, cfg.floor_hysteresis, configured_budget,
                       _floor_min_budget(cfg, cache, configured_budget),
                       cache.set_budget, interval=cfg.floor_interval_s,
                       min_change_interval=cfg.floor_min_change_s,
                       log=logging.getLogger("moecached.floor"))


def _apply_live(key: str, new: C.Config, server, cache, floor_box: dict):
    """Apply one changed key to the running daemon. True when applied, else why not.

    ``floor_box["floor"]`` is the running MemoryFloor or None; turning the floor on creates
    one (the server's periodic task drives it), turning it off drops it and gives the cache
    back its configured budget."""
    floor = floor_box["floor"]
    if key == "log_level":
        logging.getLogger().setLevel(new.log_level.upper())
    elif key == "heartbeat_s":
        server.heartbeat_s = new.heartbeat_s
    elif key == "max_request_experts":
        server.checker.max_experts = new.max_request_experts
    elif key == "max_message_bytes":
        server.max_message_bytes = new.max_message_bytes
    elif key in ("client_rate_limit", "client_rate_burst", "client_max_prefetch"):
        server.set_client_limits(new.client_rate_limit, new.client_rate_burst, new.client_max_prefetch)
    elif key == "on_pressure":
        cache.shrunk_policy = new.on_pressure
        server.acquire_timeout_s = new.pressure_timeout_s if new.on_pressure == "wait" else None
    elif key == "pressure_timeout_s":
        if new.on_pressure == "wait":
            server.acquire_timeout_s = new.pressure_timeout_s
    elif key in ("budget", "slots"):
        want = _budget_bytes(new, cache)
        if want is None:
            return "neither budget nor slots set"
        if want > cache.arena.size:
            return f"larger than the {cache.arena.size} bytes the arena was created with"
        from .arena import smallest_budget
        if want < smallest_budget(cache.index):
            return (f"{want} bytes is under the smallest arena this model runs with "
                    f"({smallest_budget(cache.index)} bytes: one slot per size class)")
        if floor is not None:   # the floor owns the budget while it is on
            floor.reconfigure(configured_budget=want,
                              min_budget=_floor_min_budget(new, cache, want))
        else:
            cache.set_budget(want)
    elif key in ("floor", "floor_hysteresis", "min_budget", "floor_interval_s", "floor_min_change_s"):
        configured = _budget_bytes(new, cache) or cache.arena.size
        if new.floor is None:
            if floor is not None:  # off: the budget the floor took goes back to the cache
                floor_box["floor"], floor_box["off"] = None, floor  # kept: its counts go on
                server.extra_stats = None
                cache.set_budget(configured)
                log.info("memory floor off; budget back to %d bytes",
                         cache.stats()["budget"]["current_bytes"])
            return True
        server.tick_s = min(1.0, new.floor_interval_s)
        if floor is None:      # on: starts with the next periodic tick
            floor = floor_box.pop("off", None)
            if floor is None:
                floor = _make_floor(new, cache, configured)
            else:              # the one turned off earlier: counters go on where they were
                floor.resume(configured)
            floor_box["floor"] = floor
            server.extra_stats = lambda: {"floor": floor.stats()}
            log.info("memory floor on at %d bytes available", new.floor)
        floor.reconfigure(floor_bytes=new.floor, hysteresis_bytes=new.floor_hysteresis,
                          configured_budget=configured,
                          min_budget=_floor_min_budget(new, cache, configured))
        floor.interval = new.floor_interval_s
        floor.min_change_interval = new.floor_min_change_s
    else:
        return "not changeable live"
    return True


def min_budget_for(index, cache) -> int:
    """Smallest budget the memory floor may shrink to: two layers' top-k of every size class
    (one layer computing, the next loading), in bytes."""
    need = 0
    for sc in index.size_classes:
        need += 2 * index.top_k * sc.slot_bytes
    return min(need, cache.arena.size)


def build(cfg: C.Config):
    """Index + cache + (floor) + server for a validated Config. Returns (server, cache,
    floor_box): ``floor_box["floor"]`` is the MemoryFloor or None (SIGHUP may switch it)."""
    from .cache import ExpertCache
    from .index import open_index
    from .server import Server

    _notify("STATUS=indexing " + cfg.model)
    idx = open_index(cfg.model)
    gid = grp.getgrnam(cfg.group).gr_gid if cfg.group else None
    from .arena import remove_stale_arenas
    remove_stale_arenas(cfg.arena_dir, log)  # arenas of daemons that were killed pin shm
    _notify("STATUS=reserving and locking the arena")
    cache = ExpertCache(idx, budget_bytes=cfg.budget, slots=cfg.slots, policy=cfg.policy,
                        readers=cfg.readers, chunk_bytes=cfg.chunk, arena_dir=cfg.arena_dir,
                        hugetlb=cfg.hugetlb, lock_memory=cfg.lock_memory, direct_io=cfg.direct_io,
                        shrunk_policy=cfg.on_pressure, max_prefetch_loads=cfg.max_prefetch_loads)
    try:
        os.chmod(cache.arena.path, cfg.arena_mode)
        if gid is not None:
            os.chown(cache.arena.path, -1, gid)
        floor_box = {"floor": _make_floor(cfg, cache, cache.arena.size) if cfg.floor is not None else None}

        watchdog = notify.watchdog_ping if notify.watchdog_interval() else None

        def on_tick(now):
            floor = floor_box["floor"]
            if floor is not None:
                floor.tick(now)
            if watchdog is not None:
                watchdog()

        server = Server(cache, endpoint=cfg.endpoint, model_path=cfg.model,
                        heartbeat_s=cfg.heartbeat_s, socket_mode=cfg.socket_mode, gid=gid,
                        on_tick=on_tick, tick_s=min(1.0, cfg.floor_interval_s),
                        max_request_experts=cfg.max_request_experts,
                        max_message_bytes=cfg.max_message_bytes,
                        acquire_timeout_s=cfg.pressure_timeout_s if cfg.on_pressure == "wait" else None,
                        client_rate_limit=cfg.client_rate_limit,
                        client_rate_burst=cfg.client_rate_burst,
                        client_max_prefetch=cfg.client_max_prefetch)
        floor = floor_box["floor"]
        if floor is not None:
            server.extra_stats = lambda: {"floor": floor.stats()}
    except BaseException:
        cache.close()
        raise
    return server, cache, floor_box


def run(cfg: C.Config) -> int:
    """Run the daemon until SIGTERM/SIGINT. Returns the process exit code."""
    try:
        server, cache, floor_box = build(cfg)
    except MoecacheError as e:
        log.error("%s", e)
        _notify(f"STATUS=failed: {e}")
        return 1
    state = {"cfg": cfg}

    def reload():
        """SIGHUP: re-read the config file (command-line flags still win) and apply what can
        change live; say exactly what was applied and what needs a restart."""
        old = state["cfg"]
        try:
            new = C.load_config(cfg.path, {k: v for k, v in cfg.as_dict().items()
                                           if cfg.sources.get(k) == "command line"},
                                origin="command line", cli=False)
        except MoecacheError as e:
            log.error("SIGHUP: config not reloaded: %s", e)
            return
        changes, restart = C.reload_changes(old, new)
        applied = []
        for key in list(changes):
            try:
                ok = _apply_live(key, new, server, cache, floor_box)
            except (MoecacheError, ValueError) as e:  # e.g. the cache refused the size
                ok = f"failed: {e}"
            if ok is True:
                applied.append(key)
            else:
                restart.append(f"{key} ({ok})" if isinstance(ok, str) else key)
                setattr(new, key, getattr(old, key))  # not applied: keep reporting the old value
        if restart:
            log.warning("SIGHUP: not applied, need a restart: %s", ", ".join(restart))
        log.info("SIGHUP: applied %s", ", ".join(applied) or "nothing (no live-changeable key changed)")
        state["cfg"] = new

    server.install_signal_handlers(on_hup=reload)

    def ready():
        slots = sum(c.n_slots for c in cache.arena.classes)
        msg = (f"serving {os.path.basename(cfg.model)} on {cfg.endpoint}: {slots} slots, "
               f"{cache.arena.size / 2**30:.2f} GiB arena")
        log.info("moecached %s %s", __version__, msg)
        _notify("READY=1", f"STATUS={msg}", f"MAINPID={os.getpid()}")

    try:
        server.serve_forever(ready=ready)
    finally:
        _notify("STOPPING=1")
        cache.close()
    log.info("stopped")
    return 0


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
