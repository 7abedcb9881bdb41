# cython: language_level=3
"""The reader threads' inner loop: one chunk = pread (O_DIRECT, widened to alignment) + memcpy.

Runs entirely without the GIL so 16 reader threads overlap their I/O and copies.
Self-contained (no cimports of other moecached modules).
"""
from libc.string cimport memcpy
from libc.errno cimport errno, EINTR

cdef extern from "<unistd.h>" nogil:
    ssize_t pread(int fd, void *buf, size_t count, long long offset)

cdef extern from "<fcntl.h>" nogil:
    int posix_fadvise(int fd, long long offset, long long len, int advice)
    int POSIX_FADV_DONTNEED


cdef inline long long _pread_full(int fd, char *buf, long long n, long long off) noexcept nogil:
    """pread until n bytes, EOF (returns fewer) or error (returns -errno)."""
    cdef long long got = 0
    cdef ssize_t r
    while got < n:
        r = pread(fd, buf + got, <size_t>(n - got), off + got)
        if r < 0:
            if errno == EINTR:
                continue
            return -errno
        if r == 0:
            break
        got += r
    return got


cdef long long _chunk(int fd, long long offset, long long nbytes, char *d, char *b,
                      long long bounce_bytes, long long align, bint direct) noexcept nogil:
    cdef long long mask = align - 1
    cdef long long aoff, aend, need, got
    if nbytes <= 0:
        return 0
    if not direct:
        got = _pread_full(fd, d, nbytes, offset)
        if got > 0:
            posix_fadvise(fd, offset, got, POSIX_FADV_DONTNEED)
        return got
    if (offset & mask) == 0 and (nbytes & mask) == 0 and ((<long long> d) & mask) == 0:
        return _pread_full(fd, d, nbytes, offset)
    aoff = offset & ~mask
    aend = (offset + nbytes + mask) & ~mask
    if aend - aoff > bounce_bytes:
        return -22  # EINVAL: caller sized the bounce buffer wrong
    got = _pread_full(fd, b, aend - aoff, aoff)
    if got < 0:
        return got
    need = offset - aoff
    got -= need
    if got <= 0:
        return 0
    if got > nbytes:
        got = nbytes
    memcpy(d, b + need, <size_t> got)
    return got


def read_chunk(int fd, long long offset, long long nbytes, size_t dest, size_t bounce,
               long long bounce_bytes, long long align, bint direct):
    """Read ``nbytes`` at ``offset`` of ``fd`` into memory at address ``dest``.

    direct: the range is widened to ``align`` (power of two, bytes) and read into the aligned
    ``bounce`` buffer (``bounce_bytes`` long, must hold ``nbytes + 2*align``), then copied;
    if offset, nbytes and dest are all aligned it is read straight into ``dest``.
    Buffered (``direct`` false): read straight into dest, then POSIX_FADV_DONTNEED the range.
    Returns the bytes delivered to dest (``nbytes`` on success, fewer on EOF = short read),
    or ``-errno`` on a read error. The GIL is released for the whole chunk.
    """
    cdef long long r
    with nogil:
        r = _chunk(fd, offset, nbytes, <char *> dest, <char *> bounce, bounce_bytes, align, direct)
    return r


cdef enum:
    MAX_BATCH = 64


def read_many(list chunks, list fds, list aligns, list directs, size_t bounce, long long bounce_bytes):
    """Read several chunks with one GIL release: ``chunks`` is a list of
    ``(file_id, offset, nbytes, dest)``; ``fds`` / ``aligns`` / ``directs`` are per file id.

    Stops at the first chunk that does not deliver all its bytes. Returns ``(i, r)``: ``i`` the
    number of chunks fully read (``len(chunks)`` when all were), ``r`` the result of chunk ``i``
    as :func:`read_chunk` returns it (bytes delivered, or ``-errno``; 0 when all were read).
    At most 64 chunks per call.
    """
    cdef int n = len(chunks)
    cdef int c_fd[MAX_BATCH]
    cdef long long c_off[MAX_BATCH]
    cdef long long c_n[MAX_BATCH]
    cdef size_t c_dest[MAX_BATCH]
    cdef long long c_align[MAX_BATCH]
    cdef bint c_direct[MAX_BATCH]
    cdef int i
    cdef long long r = 0
    if n > MAX_BATCH:
        raise ValueError(f"read_many: {n} chunks, at most {MAX_BATCH}")
    for i in range(n):
        fid, off, nb, dest = chunks[i]
        c_fd[i] = fds[fid]
        c_off[i] = off
        c_n[i] = nb
        c_dest[i] = dest
        c_align[i] = aligns[fid]
        c_direct[i] = directs[fid]
    with nogil:
        i = 0
        while i < n:
            r = _chunk(c_fd[i], c_off[i], c_n[i], <char *> c_dest[i], <char *> bounce, bounce_bytes,
                       c_align[i], c_direct[i])
            if r != c_n[i]:
                break
            i += 1
        if i == n:
            r = 0
    return i, r
