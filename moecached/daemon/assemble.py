"""How a validated :class:`moecached.daemon.config.Config` becomes the daemon's parts: the arena's size
fitted to the memory this process may use, a model's :class:`moecached.engine.cache.ExpertCache` (its
arena file given the configured mode and group), the arguments every
:class:`moecached.service.server.Server` gets, and the budgets the memory floor works between.
Used by :mod:`moecached.daemon.runtime` (one model or several alike) and :mod:`moecached.daemon.multi`.
"""
from __future__ import annotations

import grp
import logging
import os

import psutil

from moecached.engine.arena import arena_bytes, plan_slots, planned_size, smallest_budget
from moecached.engine.cache import ExpertCache
from moecached.daemon.floor import fit_arena, read_memory_limit
from moecached.facts.units import format_bytes

log = logging.getLogger("moecached")


def budget_bytes(cfg, cache) -> int | None:
    """The arena bytes a config's budget or slots asks for (None when neither is set)."""
    if cfg.budget is not None:
        return int(cfg.budget)
    if cfg.slots is not None:
        return arena_bytes(cache.index, plan_slots(cache.index, slots=cfg.slots), cache.arena.page_size)
    return None


def min_budget_for(index, cache) -> int:
    """Smallest budget the memory floor may shrink to: two layers' top-k of every size class
    (one layer computing, the next loading), in bytes."""
    per_class = {sc.id: 2 * index.top_k for sc in index.size_classes}
    return min(arena_bytes(index, per_class, cache.arena.page_size), cache.arena.size)


_warned: dict = {}


def floor_min_budget(cfg, cache, configured_budget: int) -> int:
    """``min_budget`` for the floor, never above ``configured_budget``: the configured one,
    raised (with one warning per value) to the daemon's minimum when it is below what serving
    needs (two layers' top-k of every size class, :func:`min_budget_for`); the daemon's minimum
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


def fit_budget(cfg, idx) -> tuple[int | None, int | None]:
    """(budget_bytes, slots) for the arena, checked against the memory this process may use
    before anything is reserved (``moecached.daemon.floor.fit_arena``): raises MemoryLimitError when
    it does not fit, or with a floor returns a smaller budget that does (logged once)."""
    budget, slots = cfg.budget, cfg.slots
    if budget is None and slots is None:
        slots = sum(len(sc.layers) for sc in idx.size_classes) * int(idx.n_experts)
    if cfg.hugetlb:   # huge pages come from their own pool, not MemAvailable or the cgroup
        return budget, slots
    size = planned_size(idx, budget_bytes=budget, slots=slots)
    swap = 0
    if not cfg.lock_memory:   # an unlocked arena may go to swap
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


def make_cache(cfg, idx, progress=None, fitted=None, read_queue=None):
    """The ExpertCache of ``idx`` for ``cfg`` (its budget fitted to the memory this process may
    use: ``fitted``, else :func:`fit_budget`), its arena file given the configured mode/group;
    ``read_queue``: the daemon's ``ReadQueue`` (every model's reads go through it)."""
    budget, slots = fitted if fitted is not None else fit_budget(cfg, idx)
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
        if cfg.arena_dir_refused:
            skipped = []
            for d, why in cfg.arena_dir_refused.items():
                if why is None:
                    break
                skipped.append(f"{d}: {why}")
            log.info("arena_dir: %s, the first usable entry of %s%s", cfg.arena_dir, cfg.arena_dir_choices,
                     f" (passed over: {'; '.join(skipped)})" if skipped else "")
        if arena.huge_pages in ("never", "deny", "advise"):
            log.info("arena %s: 4 KiB pages (%s is a tmpfs with huge=%s); for 2 MiB pages, as a model "
                     "file's page cache has, set arena_dir to a tmpfs mounted with huge=within_size "
                     "(docs/operations.md, Limits: \"Huge pages for the arena without a reservation\")",
                     arena.path, cfg.arena_dir, arena.huge_pages)
    except BaseException:
        cache.close()
        raise
    return cache


def server_kwargs(cfg) -> dict:
    """The Server arguments a config gives (every socket of the daemon alike)."""
    gid = grp.getgrnam(cfg.group).gr_gid if cfg.group else None
    return dict(heartbeat_s=cfg.heartbeat_s, socket_mode=cfg.socket_mode, gid=gid,
                tick_s=min(1.0, cfg.floor_interval_s),
                max_request_experts=cfg.max_request_experts,
                max_message_bytes=cfg.max_message_bytes,
                acquire_timeout_s=cfg.pressure_timeout_s if cfg.on_pressure == "wait" else None,
                client_rate_limit=cfg.client_rate_limit,
                client_rate_burst=cfg.client_rate_burst,
                client_max_prefetch=cfg.client_max_prefetch,
                client_loop_share=cfg.client_loop_share,
                pin_files=cfg.fast_path, pin_quota=cfg.fast_path_quota,
                pin_hit_rate=cfg.fast_path_hit_rate,
                admin_gid=grp.getgrnam(cfg.admin_group).gr_gid if cfg.admin_group else None,
                model_dirs=model_dirs(cfg))


def model_dirs(cfg) -> tuple:
    """Where ``models add`` may take files from: ``model_dirs``, else the directories of the
    models the configuration names (an operator's own choice of place)."""
    if cfg.model_dirs:
        return tuple(cfg.model_dirs)
    paths = [m.get("path") for m in (cfg.models or []) if isinstance(m, dict)]
    if cfg.model:
        p = cfg.model
        paths.append(p.split("=", 1)[1] if "=" in p and not os.path.exists(p) else p)
    return tuple(sorted({os.path.dirname(os.path.abspath(p)) for p in paths if p}))
