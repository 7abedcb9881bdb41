"""The budget's periodic work on a served model's cache (``ExpertCache.settle_memory``): a
shrink that pinned experts stopped short goes on once they are released, and pages a reader
faulted back into given-back slots are punched again (docs/operations.md, "The memory floor"
and "Security model").

:func:`settle` runs from each model's periodic task (``moecached.daemon.multi.Models``), which
also says, in at most one warning a period, how many bytes were punched again since it last
said so (also those found when the memory floor sampled, ``warn=False``).
"""
from __future__ import annotations

import logging

from moecached import MoecacheError
from moecached.facts.units import format_bytes

log = logging.getLogger("moecached")


def settle(m, reported: dict, warn: bool = True) -> None:
    """Settle served model ``m``'s cache (none: nothing). ``reported``: model name -> (cache,
    ``repunched_bytes`` last warned about), kept by the caller between calls."""
    cache = m.cache
    if cache is None:
        return
    try:
        got = cache.settle_memory()
    except MoecacheError as e:
        log.error("model %s: %s", m.name, e)
        return
    if got["bytes_released"]:
        log.info("model %s: the budget shrink that pinned experts had stopped short went on now "
                 "that they are released (released %s)", m.name, format_bytes(got["bytes_released"]))
    if not warn:
        return
    last, seen = reported.get(m.name, (None, 0))
    now = cache.c_repunched
    if now > (seen if last is cache else 0):
        log.warning("model %s: %s of the arena's given-back slots were in memory again (a process "
                    "read them through its mapping of %s: reading a hole of a tmpfs file allocates "
                    "a page); punched them again (repunched_bytes)", m.name,
                    format_bytes(now - (seen if last is cache else 0)), cache.arena.path)
    reported[m.name] = (cache, now)
