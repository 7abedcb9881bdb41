"""What the daemon says of its models (``stats``, ``status``, ``models list``, the exporter):
per model its share, residency, hit rate and bytes read; over all of them the sums, the
budget, the split. Functions of a :class:`moecached.daemon.multi.Models`; they read it and
change nothing."""
from __future__ import annotations

import os

from moecached.facts.stats import CACHE_STATS, SERVER_COUNTERS, hit_rate


def summary(models, views=None) -> list:
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
            for m, st, state, share, mb, pins in (views if views is not None else model_views(models))]


def model_views(models) -> list:
    """(model, its cache's stats, state, share, split member, slots pinned through shared
    memory) of every model with a cache."""
    out = []
    with models.lock:
        for m in list(models.models.values()):
            if m.cache is None:
                continue
            state = ("removing" if m.draining is not None else
                     "model changed" if m.cache.model_changed else "serving")
            out.append((m, m.cache.stats(), state, models.split.shares.get(m.name, 0),
                        models.split.members.get(m.name), m.cache.pins_held()))
    return out


def daemon_stats(models) -> dict:
    """The daemon's endpoint's ``stats``: every cache counter and gauge summed over the
    models (counters of removed models included), the budget, each model, the split."""
    views = model_views(models)
    st = {}
    for row in CACHE_STATS:
        vals = [v[1].get(row.key) for v in views]
        if row.value is None or not all(isinstance(x, (int, float)) for x in vals):
            continue
        st[row.key] = sum(vals) + (models.retired[row.key] if row.kind == "counter" else 0)
    st["budget"] = {"configured_bytes": int(models.cfg.budget), "current_bytes":
                    sum(v[1]["budget"]["current_bytes"] for v in views)}
    st["model_changed"] = next((f"model {v[0].name}: {v[1]['model_changed']}"
                                for v in views if v[1]["model_changed"]), None)
    # every model's clients, and the sockets' counters summed (the endpoint's own too)
    st["clients"] = [dict(c.summary(), model=v[0].name) for v in views
                     for c in list(v[0].server.clients.values())]
    servers = [v[0].server.counters for v in views]
    if models.router is not None:
        servers.append(models.router.counters)
    st["server"] = {row.key: sum(x.get(row.key, 0) for x in servers)
                    + models.retired["server." + row.key] for row in SERVER_COUNTERS}
    st["models"] = summary(models, views)   # the same snapshot: each cache read once
    st["split"] = split_info(models)
    return st


def daemon_status(models) -> dict:
    """The daemon's endpoint's ``status``: sums over the models, and each model."""
    ms = summary(models)
    hits, pf, miss = (sum(x[k] for x in ms) for k in ("hits", "prefetch_hits", "demand_misses"))
    changed = [x for x in ms if x["model_changed"]]
    return {"state": "model changed" if changed else "serving",
            "model_changed": (f"model {changed[0]['name']}: {changed[0]['model_changed']}"
                              if changed else None),
            "budget_configured_bytes": int(models.cfg.budget),
            "budget_current_bytes": sum(x["budget_current_bytes"] for x in ms),
            "slots": sum(x["slots"] for x in ms), "slots_used": sum(x["resident"] for x in ms),
            "hits": hits, "prefetch_hits": pf, "demand_misses": miss,
            "hit_rate": hit_rate(hits, pf, miss),
            "clients": sum(x["clients"] for x in ms), "leases": sum(x["leases"] for x in ms),
            "models": ms}


def split_info(models) -> dict:
    with models.lock:
        return {"adding": list(models.adding), "failed": dict(models.failed),
                "total_bytes": models.total, "step_bytes": models.split.step,
                "hysteresis": models.split.hysteresis, "interval_s": models.cfg.split_interval_s,
                "moves": models.split.moves,
                "last_moves": [{"t": t, "from": d, "to": r, "bytes": b}
                               for t, d, r, b in models.moves]}



def arena_stats(m) -> dict:
    """One model on the daemon's endpoint: what the daemon adds to its socket's stats."""
    arena = m.cache.arena
    return {"arena": {"path": arena.path, "private_link": arena.keep_path,
                      "relinks": arena.relinks, "problem": arena.link_problem}}


def arena_status(m) -> dict:
    arena = m.cache.arena
    return {} if arena.link_problem is None else {"state": "degraded", "problem": arena.link_problem}


def ready_message(models) -> tuple[str, str]:
    """The log line (and systemd STATUS) once the daemon serves: (message, timings)."""
    if models.alone:
        m, t = next(iter(models.models.values())), models.timings
        slots = sum(c.n_slots for c in m.cache.arena.classes)
        return (f"serving {os.path.basename(m.path)} on {models.cfg.endpoint}: {slots} slots, "
                f"{m.cache.arena.size / 2**30:.2f} GiB arena",
                f" (started in {t['total_s']:.1f} s: index {t['index_s']:.1f} s, arena "
                f"{t['arena_s']:.1f} s)")
    return (f"serving {len(models.models)} models ("
            + ", ".join(f"{n} {s / 2**30:.2f} GiB" for n, s in models.split.shares.items())
            + f") on {models.cfg.endpoint}", "")
