"""Runs: consecutive loads of a warm fill read as one job (a part of
``moecached.engine.cache.ExpertCache``, used by its ``_after`` with the lock released).

A load queued with ``run = (bytes, buffered)`` (``ExpertCache.prefetch_many(run=...)``, the
``fill_run`` and ``fill_io`` keys) joins the run before it when both are prefetches of the same pool and layer,
it is the next expert into the next slot, each of its reads starts in the same file where the
run's read of that part ends and its bytes go where that read's end in the arena, and the run
stays within ``run`` bytes (:func:`cut`). A run of several loads is one read job
(:func:`submit`): per part one read from the first expert's offset and slot over all of them,
in file order, which the reader pool cuts into ``chunk``-sized pieces as any read (with
``buffered``, read through the page cache's read-ahead and dropped behind: ``fill_io``). When it
ends, every load of the run lands in turn with the job's outcome (a failed run fails each load,
which gives its slot back). The job is *shared*: the reader pool never withdraws it (it would
take back every load of the run), and a promotion of one of its loads (a demand took it over)
promotes the whole run. Counters: ``run_reads`` (jobs of several loads), ``run_loads`` (their
loads), kept in ``moecached.engine.loads.Loads``.
"""
from __future__ import annotations

__all__ = ["cut", "submit"]


def cut(submits) -> list:
    """``submits`` (``[(load, reads)]``, reads ``(file, offset, nbytes, dest)`` per part) cut
    into runs (lists of consecutive entries), each entry that may not join a run alone."""
    out, ends, size = [], None, 0
    for load, reads in submits:
        nb = sum(r[2] for r in reads)
        if _joins(out, ends, size, load, reads, nb):
            out[-1].append((load, reads))
            size += nb
        else:
            out.append([(load, reads)])
            size = nb
        ends = [(fid, off + n, dest + n) for fid, off, n, dest in reads]
    return out


def _joins(out, ends, size, load, reads, nb) -> bool:
    if not out or not load.run or ends is None or size + nb > load.run[0]:
        return False
    prev = out[-1][-1][0]
    if (prev.run != load.run or prev.pool is not load.pool or prev.layer != load.layer
            or load.expert != prev.expert + 1 or load.slot != prev.slot + 1
            or prev.priority != load.priority or len(reads) != len(ends)):
        return False
    return all(fid == e[0] and off == e[1] and dest == e[2] and n > 0
               for (fid, off, n, dest), e in zip(reads, ends))


def submit(cache, run) -> None:
    """Queue one read job for ``run`` (several ``(load, reads)`` that :func:`cut` joined) on
    ``cache``'s reader pool; its loads land through ``cache._on_read`` when it ends."""
    readers = cache.readers
    loads = [load for load, _ in run]
    sizes = [sum(r[2] for r in reads) for _, reads in run]
    merged = [[fid, off, 0, dest] for fid, off, _n, dest in run[0][1]]
    for _, reads in run:
        for m, r in zip(merged, reads):
            m[2] += r[2]
    merged.sort(key=lambda m: (m[0], m[1]))

    def landed(_jid, err, _n, sec):
        for load, nb in zip(loads, sizes):
            cache._on_read(load, err, nb, sec)
    try:
        jid = readers.submit([tuple(m) for m in merged], priority=loads[0].priority,
                             callback=landed, shared=True, buffered=loads[0].run[1])
    except Exception as e:  # pool closed or refused: fail every load like a read error
        e.dest_written = False   # refused before reading: the slots are as they were
        for load in loads:
            cache._on_read(load, e, 0, 0.0)
        return
    with cache._lock:
        cache._loads.c_run_reads += 1
        cache._loads.c_run_loads += len(loads)
    for load in loads:
        load.job_id = jid
    if any(load.priority and load.demanded for load in loads):
        readers.promote(jid)
