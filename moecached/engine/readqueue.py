"""The read queue: the reader threads and the one priority queue of read jobs they serve, for
one or several ``moecached.engine.readers.ReaderPool`` (one per model; a daemon serving several
models runs one queue for all of them, so every model's reads wait in one queue for one drive).

A *job* is one expert's reads (all its parts), already cut into chunks by its pool. Chunks of
all jobs of every pool on the queue are shared by all threads: a priority queue of jobs,
demand (0) before prefetch (1), FIFO within a priority; the first queued job hands out its next
chunk (or, for a demand job when many chunks are queued, its next ``batch`` chunks to one
thread, read back to back in one ``moecached.engine._io.read_many`` call: fewer GIL
hand-offs). Prefetch chunks yield to demand at chunk level: they are handed out one at a time,
at most ``prefetch_chunks`` of them are in flight at any time (so a demand job arriving finds
at most that many prefetch chunks ahead of it in the drive's queue, not one per thread), and at
most ``prefetch_with_demand`` while a demand job is unfinished. Before a job's first chunk is
handed out, its pool checks its files (a changed model fails the job before any byte is
written). A job's callback runs once, from a reader thread, after every chunk finished or after
the first failure (once chunks already in flight have finished).

Lock discipline: one ``threading.Condition`` (``ReadQueue._cond``) guards the heap, the chunk
counts and every pool's job table (``ReaderPool._jobs``, ``_finishing``, ``_stats``); the reads
themselves and the callbacks run outside it (the reads without the GIL).
"""
from __future__ import annotations

import ctypes
import heapq
import itertools
import mmap
import threading
import time

from moecached import MoecacheError

__all__ = ["ReadError", "ModelChanged", "ReadQueue"]


class ReadError(MoecacheError):
    """A load failed (short read, I/O error, file changed, pool closed); names file and offset."""


class ModelChanged(ReadError):
    """A model file is no longer the one indexed (size, mtime, ctime or inode differ): the load
    was refused or its bytes withheld. Not an I/O error; every later load fails the same way."""


class _Job:
    __slots__ = ("id", "pool", "priority", "chunks", "next", "inflight", "done", "error",
                 "callback", "t0", "nbytes", "finished", "touched", "shared", "buffered")

    def __init__(self, jid, pool, priority, chunks, callback, nbytes):
        self.id = jid
        self.pool = pool          # the ReaderPool whose files the chunks name
        self.priority = priority
        self.chunks = chunks      # list of (file_id, offset, nbytes, dest) or [None] for an empty job
        self.next = 0             # index of the next chunk to hand out
        self.inflight = 0
        self.done = 0
        self.error = None
        self.callback = callback
        self.t0 = time.perf_counter()
        self.nbytes = nbytes
        self.finished = False
        self.touched = False      # a chunk was handed to a reader: dest may have been written
        self.shared = False       # the reads of several loads (a run): never withdrawn
        self.buffered = False     # read through the page cache (read-ahead), dropped behind


class ReadQueue:
    """The reader threads and the one job queue they serve, for one or several
    ``moecached.engine.readers.ReaderPool``.

    Every pool on a queue puts its jobs in the same priority heap, so the rules of the module
    docstring hold across all of them: a demand job of any pool goes before every prefetch job,
    and ``prefetch_chunks`` / ``prefetch_with_demand`` cap the prefetch chunks in flight of all
    pools together. A pool owns its files; the queue owns the threads (named ``name-<i>``) and
    their bounce buffers.

    ``threads``: reader threads. ``chunk_bytes``: largest chunk (bytes, >= 4096); every pool on
    the queue cuts its reads at this size. ``batch``, ``prefetch_chunks``,
    ``prefetch_with_demand``: as ``ReaderPool`` describes them.
    """

    def __init__(self, *, threads: int = 16, chunk_bytes: int = 256 * 1024, batch: int = 4,
                 prefetch_chunks: int | None = None, prefetch_with_demand: int | None = None,
                 name: str = "moecached-reader"):
        if threads < 1 or chunk_bytes < 4096:
            raise ReadError(f"threads={threads}, chunk_bytes={chunk_bytes}: need threads >= 1 and "
                            f"chunk_bytes >= 4096")
        self.chunk_bytes = int(chunk_bytes)
        self.name = name
        self._cond = threading.Condition(threading.Lock())
        self._heap: list = []
        self._seq = itertools.count()
        self._ids = itertools.count(1)
        self._closing = False
        self._pools: set = set()   # pools attached (not closed)
        self._batch = max(1, min(int(batch), 64))
        self._queued_chunks = 0
        self._demand_jobs = 0      # demand-priority jobs not finished (submitted or promoted)
        self._pf_chunks = 0        # prefetch chunks being read now
        self._pf_max = max(1, int(prefetch_chunks) if prefetch_chunks is not None else threads // 2)
        self._pf_with_demand = min(self._pf_max, max(
            1, int(prefetch_with_demand) if prefetch_with_demand is not None else threads // 8))
        self._threads = []
        for t in range(threads):
            th = threading.Thread(target=self._run, name=f"{name}-{t}", daemon=True)
            th.start()
            self._threads.append(th)

    @property
    def threads(self) -> int:
        return len(self._threads)

    # ---- jobs (caller holds self._cond) ---------------------------------------------------
    def _push(self, job: _Job) -> None:
        """Queue a new job (its pool registered it)."""
        if job.priority == 0:
            self._demand_jobs += 1
        heapq.heappush(self._heap, (job.priority, next(self._seq), job))
        self._queued_chunks += len(job.chunks)
        # wake only threads that may take a chunk (prefetch: up to its cap), not a herd
        self._cond.notify(min(len(job.chunks), len(self._threads) if job.priority == 0
                              else max(0, self._pf_limit() - self._pf_chunks)))

    def _cancel(self, job: _Job) -> None:
        """Hand out no more chunks of ``job`` (its heap entry goes stale)."""
        self._queued_chunks -= len(job.chunks) - job.next
        job.next = len(job.chunks)

    def _pf_limit(self) -> int:
        """Most prefetch chunks in flight now."""
        return self._pf_with_demand if self._demand_jobs else self._pf_max

    def _take(self):
        """Next (job, [chunks], priority taken at, error) or None when closing. Caller holds
        self._cond.

        Takes up to ``batch`` consecutive chunks of the first job when it is a demand job and
        the queue is deep enough (queued chunks >= threads * k), else one. Waits instead of
        taking a prefetch chunk when ``prefetch_chunks`` prefetch chunks are in flight
        (``prefetch_with_demand`` while a demand job is unfinished). Before a job's first chunk
        is handed out its pool's files are checked: a changed model fails the job (``error``:
        :class:`ModelChanged`, the rest cancelled) before any byte of dest is written."""
        heap = self._heap
        while True:
            if self._closing:
                return None
            while heap:
                prio, _seq, job = heap[0]
                if prio != job.priority or job.next >= len(job.chunks) or job.error is not None:
                    heapq.heappop(heap)  # stale (promoted, exhausted, failed, withdrawn)
                    continue
                if prio:
                    if self._pf_chunks >= self._pf_limit():
                        break  # leave the drive to demand reads
                    k = 1
                    self._pf_chunks += 1
                else:
                    k = min(self._batch, self._queued_chunks // len(self._threads),
                            len(job.chunks) - job.next)
                    k = max(k, 1)
                pre = job.pool._check_job_files(job) if job.next == 0 else None
                take = job.chunks[job.next:job.next + k]
                job.next += k
                job.inflight += k
                self._queued_chunks -= k
                if pre is not None:
                    job.error = pre
                    self._cancel(job)
                else:
                    job.touched = True
                if job.next >= len(job.chunks):
                    heapq.heappop(heap)
                return job, take, prio, pre
            self._cond.wait()

    def _run(self) -> None:
        cond = self._cond
        buf, bounce, size = None, 0, 0
        try:
            while True:
                with cond:
                    got = self._take()
                if got is None:
                    return
                job, chunks, prio, pre = got
                pool = job.pool
                if pre is not None:
                    ok, err = 0, pre
                else:
                    try:
                        if pool._bounce_bytes > size:   # aligned bounce buffer for this pool's files
                            if buf is not None:
                                buf.close()
                                buf, bounce, size = None, 0, 0
                            buf, bounce, size = _bounce(pool._bounce_bytes)
                        ok, err = pool._read(chunks, bounce, size, job.buffered)
                    except Exception as e:  # never let a reader thread die
                        ok, err = 0, ReadError(f"reader crashed on {pool.files[chunks[0][0]]} offset "
                                               f"{chunks[0][1]}: {e!r}")
                with cond:
                    k = len(chunks)
                    if prio:
                        self._pf_chunks -= k
                    job.inflight -= k
                    job.done += k
                    if chunks[0] is not None and pre is None:
                        pool._stats["reads"] += ok + (err is not None)
                        pool._stats["bytes"] += sum(c[2] for c in chunks[:ok])
                    if err is not None and job.error is None:
                        job.error = err
                        self._cancel(job)
                    fin = job.inflight == 0 and (job.error is not None or job.done == len(job.chunks))
                    if fin:
                        job.finished = True
                        del pool._jobs[job.id]
                        pool._finishing += 1   # its close waits for this callback
                        if job.priority == 0:
                            self._demand_jobs -= 1
                            if not self._demand_jobs:  # prefetch chunks held back may go now
                                cond.notify(max(0, self._pf_max - self._pf_chunks))
                        dt = time.perf_counter() - job.t0
                        if not pool._closed:
                            pool._finish_stats(job, dt)
                if fin:
                    try:
                        if job.buffered:   # what read-ahead brought back behind the chunks
                            pool._drop_cached(job)
                        if job.error is None:
                            # Bytes are published only if the file is still the one indexed (size,
                            # mtime, ctime, inode): a model rewritten while this job read it must
                            # not mix old and new bytes.
                            job.error = pool._check_job_files(job)
                        pool._callback(job, dt)
                    finally:
                        with cond:
                            pool._finishing -= 1
                            if pool._closed:
                                cond.notify_all()
        finally:
            if buf is not None:
                buf.close()

    # ---- introspection / lifetime ---------------------------------------------------------
    def stats(self) -> dict:
        """The queue over all its pools: ``threads``, ``chunk_bytes``, ``pools`` (attached),
        ``queued_demand`` / ``queued_prefetch`` (jobs with no chunk issued yet),
        ``reading_demand`` / ``reading_prefetch`` (jobs started, not finished),
        ``queued_chunks`` (chunks not handed out), ``prefetch_chunks_reading`` (now)."""
        with self._cond:
            n = {(q, p): 0 for q in (True, False) for p in (0, 1)}
            for pool in self._pools:
                for j in pool._jobs.values():
                    n[(j.next == 0 and j.inflight == 0 and j.error is None, j.priority)] += 1
            return {"threads": len(self._threads), "chunk_bytes": self.chunk_bytes,
                    "pools": len(self._pools),
                    "queued_demand": n[(True, 0)], "queued_prefetch": n[(True, 1)],
                    "reading_demand": n[(False, 0)], "reading_prefetch": n[(False, 1)],
                    "queued_chunks": self._queued_chunks, "prefetch_chunks_reading": self._pf_chunks}

    def close(self) -> None:
        """Close every pool still attached (their jobs fail with "reader pool closed"), then stop
        the threads. Idempotent."""
        with self._cond:
            if self._closing:
                return
            pools = list(self._pools)
        for pool in pools:
            pool.close()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for th in self._threads:
            th.join()
        with self._cond:
            self._heap.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _bounce(nbytes: int):
    """A page-aligned anonymous buffer: (mmap, address, size)."""
    buf = mmap.mmap(-1, nbytes)
    anchor = ctypes.c_char.from_buffer(buf)
    addr = ctypes.addressof(anchor)
    del anchor
    return buf, addr, nbytes

