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
