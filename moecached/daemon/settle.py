"""The budget's periodic work on a served model's cache (``ExpertCache.settle_memory``): a
shrink that pinned experts stopped short goes on once they are released, and pages a reader
faulted back into given-back slots are punched again (docs/operations.md, "The memory floor"
and "Security model").

:func:`settle` runs from each model's periodic task (``moecached.daemon.multi.Models``), which
also says, in at most one warning a minute per model (``WARN_S``), how many bytes were punched
again since it last said so (also those found when the memory floor sampled, ``warn=False``):
a reader that keeps reading holes makes one line a minute, not one a tick.
"""
from __future__ import annotations

import logging
import time

from moecached import MoecacheError
from moecached.facts.units import format_bytes

log = logging.getLogger("moecached")

#: seconds between two warnings of one model about bytes punched again
WARN_S = 60.0


def settle(m, reported: dict, warn: bool = True, now: float | None = None) -> None:
    """Settle served model ``m``'s cache (none: nothing). ``reported``: model name -> (cache,
    ``repunched_bytes`` last warned about, no warning before), kept by the caller between
    calls; ``now``: ``time.monotonic()`` (the default)."""
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
    now = time.monotonic() if now is None else now
    last, seen, until = reported.get(m.name, (None, 0, 0.0))
    seen = seen if last is cache else 0   # a new cache (the model rebuilt) counts from 0
    total = cache.c_repunched
    if total > seen and now >= until:
        log.warning("model %s: %s punched again in the arena's given-back slots since the last "
                    "warning: processes read them back into memory through their mappings of %s "
                    "(reading a hole of a tmpfs file allocates a page); repunched_bytes counts "
                    "them, one line a minute at most", m.name, format_bytes(total - seen),
                    cache.arena.path)
        seen, until = total, now + WARN_S
    reported[m.name] = (cache, seen, until)
