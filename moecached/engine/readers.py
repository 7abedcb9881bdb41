"""Reader pool: threads loading byte ranges of the model files into memory, O_DIRECT by default.

Two parts: a ``moecached.engine.readqueue.ReadQueue`` (the reader threads, their bounce buffers
and one priority queue of jobs: demand before prefetch, prefetch chunks capped; its module
doc has the rules) and a :class:`ReaderPool` per model (its files and fds, O_DIRECT alignment
and the buffered fallback, model-change detection, its jobs' stats and latency). A pool either
makes a queue of its own (one model) or is given a shared one: a daemon serving several models
runs one queue for all of them, so every model's reads wait in one queue for one drive and the
queue's rules hold across models (a demand load of one model goes before the prefetches of
every model; the prefetch caps count the prefetch chunks of all models together).

A *job* is a list of reads ``(file_id, file_offset, nbytes, dest_address)`` (one expert, all its
parts). Each read is cut into the fewest chunks of at most ``chunk_bytes`` (equal sizes, inner
cuts on the file's direct-I/O alignment, so widening adds < one alignment unit at the ends of a
read, not per chunk). Each chunk runs without the GIL: an O_DIRECT ``pread`` of the range
widened to alignment into the thread's aligned bounce buffer, then ``memcpy`` to dest (straight
into dest when offset, length and dest are all aligned).

A job's callback runs once, from a reader thread, after every chunk finished or after the first
failure (once chunks already in flight have finished: no thread writes to dest after the
callback). ``error`` is None on success, else a :class:`ReadError`; on error dest holds partial
data that must never be published, unless ``error.dest_written`` is False (the job failed
before any chunk was handed to a reader: dest still holds what it held before).

Filesystems that refuse O_DIRECT (EINVAL at open or at the first read: ramfs, some overlays,
FUSE) are read buffered, with one warning per pool through ``log`` and ``POSIX_FADV_DONTNEED``
after each read so the page cache does not keep a second copy of the experts.

Lock discipline: a pool's job table, stats and latency are under its queue's condition
(``ReadQueue._cond``); its O_DIRECT fallback under ``_fallback_lock``; the first model change
found under ``_change_lock``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import heapq
import logging
import os
import threading
import time

from moecached.engine._io import read_chunk, read_many  # noqa: F401  (read_chunk: tests wrap it)
from moecached.engine.readqueue import ModelChanged, ReadError, ReadQueue, _Job
from moecached.facts.stats import LatencyHistogram

__all__ = ["ReadError", "ModelChanged", "ReadQueue", "ReaderPool", "dio_alignment", "LATENCY_EDGES_S"]

# job latency histogram bucket upper edges, seconds (last bucket: > 5 s)
LATENCY_EDGES_S = [50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3,
                   100e-3, 200e-3, 500e-3, 1.0, 2.0, 5.0]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_STATX_DIOALIGN = 0x2000
_AT_FDCWD = -100

_CHANGED_FIX = ("load refused; the daemon re-indexes the model once its file is unchanged "
                "(on_model_change = \"reload\") or exits so its service manager restarts it "
                "(\"exit\")")


def dio_alignment(path: str) -> int:
    """Direct-I/O alignment of ``path`` in bytes: max(mem, offset) from statx STATX_DIOALIGN, else 4096."""
    try:
        statx = _libc.statx
    except AttributeError:
        return 4096
    buf = ctypes.create_string_buffer(256)
    if statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_DIOALIGN, buf) != 0:
        return 4096
    raw = buf.raw
    mask = int.from_bytes(raw[0:4], "little")
    mem_align = int.from_bytes(raw[152:156], "little")
    off_align = int.from_bytes(raw[156:160], "little")
    if not mask & _STATX_DIOALIGN or not mem_align or not off_align:
        return 4096
    a = max(mem_align, off_align, 512)
    return a if a & (a - 1) == 0 else 4096


class ReaderPool:
    """Loads byte ranges of ``files`` (one model) into raw memory; see the module docstring.

    ``files``: absolute paths, indexed by ``file_id`` in reads. ``queue``: a shared
    :class:`ReadQueue` whose threads read this pool's jobs (several models of one daemon: one
    queue); None (default): the pool makes its own, from ``threads``, ``chunk_bytes``, ``batch``,
    ``prefetch_chunks`` and ``prefetch_with_demand`` (these belong to the queue and must be left
    out when one is given). ``threads``: reader threads (default 16). ``chunk_bytes``: largest
    chunk (bytes, >= 4096, default 256 KiB). ``direct``: try O_DIRECT (False: buffered
    reads + DONTNEED). ``file_sizes`` / ``file_mtimes_ns`` / ``file_identity`` (``(ctime_ns,
    dev, ino)`` per file): what the index saw (default: what fstat sees at open); a difference
    at open raises :class:`ReadError`. Later, a file whose size, mtime, ctime or inode differs
    is *changed*: checked before a job's
    first chunk is read and after its last, and by :meth:`recheck` (the daemon calls it on an
    inotify event). The first change found is kept in :attr:`model_changed` (logged once, then
    ``on_change(message)`` is called); from then on every load of this pool fails with
    :class:`ModelChanged` without reading (other pools on the queue are not affected).
    ctime cannot be set from user space, so a file rewritten in place with its
    mtime restored (``rsync --inplace -t``, ``cp -p``, ``touch -r``) is caught too.
    ``log``: a ``logging.Logger`` (default ``logging.getLogger("moecached.engine.readers")``).
    ``batch``: most consecutive chunks of one job a thread takes at once (read one after another
    in a single GIL release) when at least ``threads * batch`` chunks are queued; fewer queued
    chunks are spread one per thread so a lone demand load still uses every thread. Prefetch
    chunks are always taken one at a time (default 4).
    ``prefetch_chunks``: most prefetch chunks in flight (default ``threads // 2``, at least 1);
    ``prefetch_with_demand``: most while a demand job is unfinished (default ``threads // 8``,
    at least 1).
    Raises :class:`ReadError` at construction if a file cannot be opened or already differs.
    """

    def __init__(self, files: list[str], *, threads: int | None = None,
                 chunk_bytes: int | None = None, direct: bool = True, file_sizes=None,
                 file_mtimes_ns=None, file_identity=None, log=None, batch: int | None = None,
                 on_change=None, prefetch_chunks: int | None = None,
                 prefetch_with_demand: int | None = None, queue: ReadQueue | None = None):
        own = {"threads": threads, "chunk_bytes": chunk_bytes, "batch": batch,
               "prefetch_chunks": prefetch_chunks, "prefetch_with_demand": prefetch_with_demand}
        if queue is not None:
            given = [k for k, v in own.items() if v is not None]
            if given:
                raise ReadError(f"{', '.join(given)}: set on the shared ReadQueue, not on a pool "
                                f"that uses one")
        else:
            threads = 16 if threads is None else threads
            chunk_bytes = 256 * 1024 if chunk_bytes is None else chunk_bytes
            if threads < 1 or chunk_bytes < 4096:
                raise ReadError(f"threads={threads}, chunk_bytes={chunk_bytes}: need threads >= 1 "
                                f"and chunk_bytes >= 4096")
        self.log = log or logging.getLogger("moecached.engine.readers")
        self.files = [os.fspath(f) for f in files]
        self._fds: list[int] = []
        self._bfds: list[int] = []   # the same files opened buffered (read-ahead): ``buffered`` jobs
        self._direct: list[bool] = []
        self._align: list[int] = []
        self._warned = False
        self._fallback_lock = threading.Lock()
        #: why the model is no longer the one indexed (one line), or None while it is
        self.model_changed: str | None = None
        self.on_change = on_change
        self._change_lock = threading.Lock()
        try:
            for i, f in enumerate(self.files):
                self._open(i, f, direct)
            self._expect = []
            for i, fd in enumerate(self._fds):
                st = os.fstat(fd)
                size = int(file_sizes[i]) if file_sizes is not None else st.st_size
                mt = int(file_mtimes_ns[i]) if file_mtimes_ns is not None else st.st_mtime_ns
                ct, dev, ino = (file_identity[i] if file_identity is not None
                                else (st.st_ctime_ns, st.st_dev, st.st_ino))
                self._expect.append((size, mt, int(ct), int(dev), int(ino)))
            self.check_files()
        except BaseException:
            self._close_fds()
            raise
        self._own_queue = queue is None
        if queue is None:
            queue = ReadQueue(threads=threads, chunk_bytes=chunk_bytes,
                              batch=4 if batch is None else batch, prefetch_chunks=prefetch_chunks,
                              prefetch_with_demand=prefetch_with_demand)
        #: the :class:`ReadQueue` whose threads read this pool's jobs
        self.queue = queue
        self.chunk_bytes = queue.chunk_bytes
        self._max_align = max(self._align, default=4096)
        # a chunk is <= chunk_bytes (+ up to one alignment unit from rounding a cut down), widened
        # by < one alignment unit at each end
        self._bounce_bytes = self.chunk_bytes + 3 * max(self._max_align, 4096)
        self._jobs: dict[int, _Job] = {}   # this pool's unfinished jobs (under queue._cond)
        self._finishing = 0                # callbacks of this pool running now
        self._closed = False
        self._stats = {"reads": 0, "bytes": 0, "jobs": 0, "errors": 0}
        # read job latency, submit to completion: the one measurement of read latency; the
        # cache's ``read_latency`` and this pool's histogram are views of it
        self._latency = LatencyHistogram(edges=LATENCY_EDGES_S)
        with queue._cond:
            if queue._closing:
                self._close_fds()
                raise ReadError("read queue closed: cannot add a reader pool")
            queue._pools.add(self)

    # ---- files ---------------------------------------------------------------------------
    def _open(self, i: int, path: str, direct: bool) -> None:
        fd = -1
        if direct:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise ReadError(f"cannot open {path}: {e.strerror}; check the model path and "
                                    f"permissions") from None
                self._warn_fallback(path, "open")
        if fd < 0:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise ReadError(f"cannot open {path}: {e.strerror}; check the model path and "
                                f"permissions") from None
        self._fds.append(fd)
        self._direct.append(bool(_fcntl_getfl(fd) & os.O_DIRECT))
        self._align.append(dio_alignment(path))
        try:   # the same file (its inode, checked), buffered, for jobs that read it ahead
            bfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise ReadError(f"cannot open {path}: {e.strerror}; check the model path and "
                            f"permissions") from None
        self._bfds.append(bfd)
        a, b = os.fstat(fd), os.fstat(bfd)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            raise ReadError(f"model file {path} was replaced while it was opened; restart the "
                            f"daemon (or reload) so the index is rebuilt")
        os.posix_fadvise(bfd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def _warn_fallback(self, path: str, where: str) -> None:
        if not self._warned:
            self._warned = True
            self.log.warning("O_DIRECT refused (%s of %s): reading buffered with POSIX_FADV_DONTNEED "
                             "instead; expect page-cache churn and lower bandwidth", where, path)

    def _to_buffered(self, fid: int) -> None:
        """The filesystem refused an O_DIRECT read: clear O_DIRECT on this file's fd."""
        with self._fallback_lock:
            if not self._direct[fid]:
                return
            import fcntl
            fd = self._fds[fid]
            fcntl.fcntl(fd, fcntl.F_SETFL, _fcntl_getfl(fd) & ~os.O_DIRECT)
            self._direct[fid] = False
            self._warn_fallback(self.files[fid], "first read")

    def _changed(self, fid: int) -> str | None:
        """How file ``fid`` differs from what the index saw, or None."""
        try:
            st = os.fstat(self._fds[fid])
            st2 = os.stat(self.files[fid])
        except OSError as e:
            return f"cannot stat ({e.strerror})"
        size, mt, ct, dev, ino = self._expect[fid]
        if st.st_ino != st2.st_ino or st.st_dev != st2.st_dev or st.st_ino != ino or st.st_dev != dev:
            return "was replaced (another inode now at the path)"
        if st.st_size != size:
            return f"size changed from {size} to {st.st_size} bytes"
        if st.st_mtime_ns != mt:
            return f"mtime changed from {mt} to {st.st_mtime_ns} ns"
        if st.st_ctime_ns != ct:
            return f"was modified (ctime changed from {ct} to {st.st_ctime_ns} ns, mtime unchanged)"
        return None

    def _note_change(self, fid: int, why: str) -> ModelChanged:
        """Record the first change (log it once, call ``on_change``); the error for this load."""
        first = False
        with self._change_lock:
            if self.model_changed is None:
                self.model_changed = f"model file {self.files[fid]} {why} since it was indexed"
                first = True
            msg = self.model_changed
        err = ModelChanged(f"{msg}; {_CHANGED_FIX}")
        if first:
            if self.on_change is not None:
                try:
                    self.on_change(msg)
                except Exception:
                    self.log.exception("model change handler raised")
            else:
                self.log.error("%s: loads fail with model_changed until the model is re-indexed", msg)
        return err

    def _check_job_files(self, job) -> ModelChanged | None:
        if self.model_changed is not None:
            return ModelChanged(f"{self.model_changed}; {_CHANGED_FIX}")
        for fid in {c[0] for c in job.chunks if c is not None}:
            why = self._changed(fid)
            if why:
                return self._note_change(fid, why)
        return None

    def recheck(self) -> str | None:
        """Compare every file with what was indexed now (the inotify watch calls this); returns
        :attr:`model_changed` (set by this call or earlier) or None."""
        if self.model_changed is None:
            for fid in range(len(self.files)):
                why = self._changed(fid)
                if why:
                    self._note_change(fid, why)
                    break
        return self.model_changed

    def check_files(self) -> None:
        """Raise :class:`ReadError` if a file's size, mtime or inode differs from the index's view."""
        for fid in range(len(self.files)):
            why = self._changed(fid)
            if why:
                raise ReadError(f"model file {self.files[fid]} {why} since it was indexed; restart "
                                f"the daemon (or reload) so the index is rebuilt")

    # ---- jobs ----------------------------------------------------------------------------
    def _split(self, reads) -> tuple[list, int]:
        chunks, total = [], 0
        cb = self.chunk_bytes
        nfiles = len(self._fds)
        for fid, off, n, dest in reads:
            fid, off, n, dest = int(fid), int(off), int(n), int(dest)
            if not 0 <= fid < nfiles or off < 0 or n < 0 or (n and not dest):
                raise ReadError(f"bad read (file_id={fid}, offset={off}, nbytes={n}, dest={dest:#x}); "
                                f"file ids are 0..{nfiles - 1}, offsets and sizes >= 0, dest non-null")
            total += n
            if n == 0:
                continue
            # fewest chunks (ceil(n / chunk_bytes)), equal sizes, inner boundaries on the direct-I/O
            # alignment: widening then adds at most one alignment unit at each end of a read
            a = self._align[fid]
            k = -(-n // cb)
            cuts = sorted({off, off + n} | {(off + i * n // k) // a * a for i in range(1, k)})
            cuts = [c for c in cuts if off <= c <= off + n]
            for lo, hi in zip(cuts, cuts[1:]):
                chunks.append((fid, lo, hi - lo, dest + (lo - off)))
        return chunks, total

    def submit(self, reads, *, priority: int, callback, shared: bool = False,
               buffered: bool = False) -> int:
        """Queue one job; returns its id (int > 0).

        ``reads``: iterable of ``(file_id, file_offset, nbytes, dest_address)`` (bytes; dest is a raw
        address that must stay valid and writable until the callback). ``priority``: 0 demand,
        1 prefetch. ``callback(job_id, error, nbytes, seconds)`` runs once from a reader thread:
        error None or :class:`ReadError`; nbytes = total requested bytes; seconds = submit to
        completion. Must not block for long (it holds up a reader thread of every pool on the
        queue). ``shared``: the job reads for several owners (a run of consecutive experts of a
        fill, one read per part spanning their slots): :meth:`withdraw` refuses it, since taking
        it back would take back every owner's read. ``buffered``: read through the page cache
        (the files' buffered descriptors, ``POSIX_FADV_SEQUENTIAL``: the kernel's read-ahead
        reads the file in large requests ahead of the chunks), straight into dest, each chunk's
        range dropped from the page cache (``POSIX_FADV_DONTNEED``) once copied: for long
        front-to-back runs. Raises :class:`ReadError` if the pool is closed or a read is
        malformed.
        """
        if priority not in (0, 1):
            raise ReadError(f"priority {priority!r}: expected 0 (demand) or 1 (prefetch)")
        if self.model_changed is not None:
            raise ModelChanged(f"{self.model_changed}; {_CHANGED_FIX}")
        chunks, total = self._split(reads)
        if not chunks:
            chunks = [None]  # empty job: still completes through a reader thread
        q = self.queue
        with q._cond:
            if self._closed or q._closing:
                raise ReadError("reader pool closed: cannot submit")
            jid = next(q._ids)
            job = _Job(jid, self, priority, chunks, callback, total)
            job.shared = bool(shared)
            job.buffered = bool(buffered)
            self._jobs[jid] = job
            q._push(job)
        return jid

    def promote(self, job_id: int) -> bool:
        """Move a prefetch job's not-yet-issued chunks to demand priority (behind queued demand
        jobs, of every pool on the queue).

        Returns True if the job was prefetch priority and still had chunks waiting; False if it is
        unknown (or another pool's), finished, already demand, or all its chunks are already being
        read.
        """
        q = self.queue
        with q._cond:
            job = self._jobs.get(job_id)
            if job is None or job.priority == 0 or job.error is not None or job.next >= len(job.chunks):
                return False
            job.priority = 0
            q._demand_jobs += 1
            heapq.heappush(q._heap, (0, next(q._seq), job))  # old entry goes stale
            q._cond.notify()
            return True

    def withdraw(self, job_id: int) -> bool:
        """Take back a prefetch job no chunk of which was handed to a reader yet: it is
        forgotten and its callback never runs (dest untouched). Returns False, changing
        nothing, when the job is unknown (or another pool's), finished, demand priority,
        already started or ``shared``."""
        q = self.queue
        with q._cond:
            job = self._jobs.get(job_id)
            if (job is None or job.priority == 0 or job.next or job.inflight or job.error is not None
                    or job.shared):
                return False
            del self._jobs[job_id]
            q._cancel(job)   # its heap entry goes stale
            job.finished = True
            return True

    def _read(self, chunks, bounce: int, bounce_bytes: int, buffered: bool = False):
        """Read a run of chunks through the bounce buffer at ``bounce`` (``bounce_bytes`` long;
        ``buffered``: through the page cache, see :meth:`submit`); returns (chunks done, None)
        or (chunks done, ReadError)."""
        if chunks[0] is None:
            return 1, None
        done = 0
        retried = False
        fds, directs = (self._bfds, [False] * len(self._bfds)) if buffered else (self._fds, self._direct)
        while done < len(chunks):
            i, got = read_many(chunks[done:], fds, self._align, directs, bounce,
                               bounce_bytes)
            done += i
            if done == len(chunks):
                return done, None
            fid, off, n, dest = chunks[done]
            if got == -errno.EINVAL and directs[fid] and not retried:
                self._to_buffered(fid)  # filesystem refused O_DIRECT at read time
                retried = True
                continue
            return done, self._error(fid, off, n, got)
        return done, None

    def _drop_cached(self, job) -> None:
        """A ``buffered`` job ended: drop its ranges from the page cache once more, whole (each
        chunk dropped its own range when copied, but a chunk read later by another thread may
        have had the read-ahead bring an earlier chunk's pages back)."""
        self.drop_cached((c[0], c[1], c[2]) for c in job.chunks if c is not None)

    def drop_cached(self, ranges, join_gap: int = 0) -> None:
        """Drop ``ranges`` (``(file_id, offset, nbytes)``) of the model files from the page
        cache (``POSIX_FADV_DONTNEED``: clean pages no process maps), adjacent ones joined, and
        those at most ``join_gap`` bytes apart, each widened by ``join_gap`` at both ends (a
        large folio across the gap between two tensors, or across a range's end, is dropped only
        by a range that holds it whole; the read-ahead ran past the end): what ``buffered``
        reads and their read-ahead left there."""
        spans: list = []
        for fid, off, n in sorted(ranges):
            if spans and spans[-1][0] == fid and spans[-1][2] + join_gap >= off:
                spans[-1][2] = max(spans[-1][2], off + n)
            else:
                spans.append([fid, off, off + n])
        for fid, lo, hi in spans:
            lo, hi = max(0, lo - join_gap), hi + join_gap
            try:
                os.posix_fadvise(self._bfds[fid], lo, hi - lo, os.POSIX_FADV_DONTNEED)
            except (OSError, IndexError):
                pass   # closed meanwhile: nothing to drop

    def _error(self, fid: int, off: int, n: int, got: int) -> ReadError:
        path = self.files[fid]
        why = self._changed(fid)
        if why:
            return self._note_change(fid, why)
        if got < 0:
            return ReadError(f"read of {n} bytes at offset {off} of {path} failed: "
                             f"{os.strerror(-got)} (errno {-got}); check the disk (dmesg)")
        return ReadError(f"short read at offset {off} of {path}: got {got} of {n} bytes; the file "
                         f"is shorter than the index expects: re-index the model")

    def _finish_stats(self, job: _Job, dt: float) -> None:
        self._stats["jobs"] += 1
        if job.error is not None and not isinstance(job.error, ModelChanged):
            self._stats["errors"] += 1
        self._latency.add(dt)

    def _callback(self, job: _Job, dt: float) -> None:
        if job.error is not None:
            job.error.dest_written = job.touched  # False: dest still holds what it held before
        try:
            job.callback(job.id, job.error, job.nbytes, dt)
        except Exception:
            self.log.exception("reader callback for job %d raised", job.id)

    # ---- introspection / lifetime ---------------------------------------------------------
    def stats(self) -> dict:
        """Counters of this pool's jobs: ``reads`` (chunk reads issued), ``bytes`` (read OK),
        ``jobs`` (finished), ``errors`` (failed jobs), ``in_flight`` (jobs submitted, not
        finished), ``queued_demand`` / ``queued_prefetch`` (jobs with no chunk issued yet),
        ``latency_edges_s`` + ``latency_hist`` (job latency counts; last bucket > last edge) +
        ``latency_sum_s`` (their sum, seconds),
        ``p50_s`` / ``p99_s`` (over the last 8192 jobs; None if none; see :meth:`latency`),
        ``direct`` (bool per file), ``align`` (per file), ``threads`` (of its queue, shared or
        not). ``errors`` leaves out jobs refused because the model changed (:class:`ModelChanged`).
        """
        with self.queue._cond:
            s = dict(self._stats)
            s["in_flight"] = len(self._jobs)
            qd = qp = 0
            for j in self._jobs.values():
                if j.next == 0 and j.inflight == 0 and j.error is None:
                    if j.priority == 0:
                        qd += 1
                    else:
                        qp += 1
            s["queued_demand"], s["queued_prefetch"] = qd, qp
            s["latency_edges_s"] = list(LATENCY_EDGES_S)
            s["latency_hist"] = list(self._latency.edge_counts)
            s["latency_sum_s"] = self._latency.sum_s   # the histogram's _sum
            lat = self._latency.to_dict()
        s["p50_s"] = None if lat["p50_us"] is None else lat["p50_us"] / 1e6
        s["p99_s"] = None if lat["p99_us"] is None else lat["p99_us"] / 1e6
        s["direct"] = list(self._direct)
        s["align"] = list(self._align)
        s["threads"] = self.queue.threads
        return s

    def latency(self) -> dict:
        """Read job latency, submit to completion (``LatencyHistogram.to_dict``: count, mean_us,
        max_us, p50_us, p99_us, buckets_us): the cache's ``read_latency``."""
        with self.queue._cond:
            return self._latency.to_dict()

    def close(self) -> None:
        """Finish this pool: its jobs not being read now fail at once, and a job being read
        fails once its chunks in flight are done (the rest cancelled); every unfinished job's
        callback gets ``ReadError("reader pool closed")`` and has returned when this returns.
        Then its files are closed, and its own queue's threads stopped (a shared queue keeps
        serving its other pools). Idempotent. Must not be called from a callback."""
        q = self.queue
        left = []
        if threading.current_thread() in q._threads:
            raise ReadError("reader pool closed from one of its reader callbacks: it would wait "
                            "for itself; close it from another thread")
        with q._cond:
            if self._closed:
                return
            self._closed = True
            for job in list(self._jobs.values()):
                if job.error is None:
                    job.error = ReadError("reader pool closed")
                    q._cancel(job)
                if job.inflight == 0:   # no reader holds it: finished here
                    del self._jobs[job.id]
                    job.finished = True
                    if job.priority == 0:
                        q._demand_jobs -= 1
                    left.append(job)
            q._cond.notify_all()   # fewer demand jobs: held-back prefetch chunks may go
            q._cond.wait_for(lambda: not self._jobs and not self._finishing)
            q._pools.discard(self)
        for job in left:
            self._callback(job, time.perf_counter() - job.t0)
        self._close_fds()
        if self._own_queue:
            q.close()

    def _close_fds(self) -> None:
        for fd in self._fds + self._bfds:
            os.close(fd)
        self._fds, self._bfds = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _fcntl_getfl(fd: int) -> int:
    import fcntl
    return fcntl.fcntl(fd, fcntl.F_GETFL)
