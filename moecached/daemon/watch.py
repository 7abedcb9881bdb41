"""Watch the model file(s) with Linux inotify (libc through ctypes), so a change is seen at once.

:class:`ModelWatch` watches each file (written to, attributes changed, deleted, moved) and the
directories holding them (an entry of one of those names created, moved in or out, deleted: a
replace by rename). On any such event a thread calls ``on_event()``; the caller then compares
the files with what was indexed (``ReaderPool.recheck``), so an event that changed nothing
(a file opened for writing and closed untouched) changes nothing. The watch only triggers the
check: loads check the files themselves too, and the daemon's periodic tick rechecks them, so
a system without inotify (or out of watches) still notices, one tick later.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import select
import struct
import threading

__all__ = ["ModelWatch", "WatchError"]

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

FILE_MASK = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_DELETE_SELF | IN_MOVE_SELF
DIR_MASK = IN_CREATE | IN_MOVED_TO | IN_MOVED_FROM | IN_DELETE

_EVENT = struct.Struct("iIII")   # wd, mask, cookie, len (struct inotify_event, then the name)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class WatchError(OSError):
    """inotify is unavailable or a watch could not be added; ``str(e)`` names path and reason."""


class ModelWatch:
    """Call ``on_event()`` from a thread whenever one of ``paths`` may have changed.

    Args:
        paths: the model file(s), as indexed.
        on_event: callable(), run in the watch thread once per batch of relevant events;
            must be quick (it should stat the files and, on a change, wake the server).
        log: a ``logging.Logger``.
    Raises:
        WatchError: inotify_init1 or inotify_add_watch failed (e.g. the per-user watch limit,
            ``fs.inotify.max_user_watches``); the caller falls back to periodic checks.
    """

    def __init__(self, paths, on_event, log=None):
        self.log = log or logging.getLogger("moecached.daemon.watch")
        self.paths = [os.path.abspath(os.fspath(p)) for p in paths]
        self.on_event = on_event
        self._fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self._fd < 0:
            e = ctypes.get_errno()
            raise WatchError(e, f"inotify_init1 failed: {os.strerror(e)}")
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._files: set[int] = set()          # watch descriptors of the files
        self._dirs: dict[int, set[str]] = {}   # wd of a directory -> model file names in it
        try:
            by_dir: dict[str, set[str]] = {}
            for p in self.paths:
                self._files.add(self._add(p, FILE_MASK))
                by_dir.setdefault(os.path.dirname(p) or ".", set()).add(os.path.basename(p))
            for d, names in by_dir.items():
                self._dirs.setdefault(self._add(d, DIR_MASK), set()).update(names)
        except BaseException:
            self._close_fds()
            raise
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="moecached-watch", daemon=True)
        self._thread.start()

    def _add(self, path: str, mask: int) -> int:
        wd = _libc.inotify_add_watch(self._fd, os.fsencode(path), ctypes.c_uint32(mask))
        if wd < 0:
            e = ctypes.get_errno()
            hint = " (raise fs.inotify.max_user_watches)" if e == errno.ENOSPC else ""
            raise WatchError(e, f"cannot watch {path}: {os.strerror(e)}{hint}")
        return wd

    def _relevant(self, data: bytes) -> bool:
        """True when a batch of events may concern a model file."""
        off, hit = 0, False
        while off + _EVENT.size <= len(data):
            wd, mask, _cookie, n = _EVENT.unpack_from(data, off)
            name = data[off + _EVENT.size: off + _EVENT.size + n].split(b"\0", 1)[0]
            off += _EVENT.size + n
            if mask & IN_Q_OVERFLOW:
                hit = True          # events were lost: check
            elif mask & IN_IGNORED:
                continue            # a watch went away (its file was deleted): the dir watch says why
            elif wd in self._files:
                hit = True
            elif wd in self._dirs and os.fsdecode(name) in self._dirs[wd]:
                hit = True
        return hit

    def _run(self) -> None:
        while not self._stop:
            try:
                ready, _, _ = select.select([self._fd, self._wake_r], [], [])
            except InterruptedError:
                continue
            except (OSError, ValueError):
                return
            if self._stop:
                return
            hit = False
            while True:
                try:
                    data = os.read(self._fd, 64 * 1024)
                except BlockingIOError:
                    break
                except OSError as e:
                    self.log.error("model watch stopped: %s; changes are still noticed at the "
                                   "next load or periodic check", e.strerror)
                    return
                if not data:
                    break
                hit = self._relevant(data) or hit
            if hit:
                try:
                    self.on_event()
                except Exception:
                    self.log.exception("model watch handler raised")

    def _close_fds(self) -> None:
        for fd in (self._fd, self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Stop the thread and drop the watches. Idempotent."""
        if self._stop:
            return
        self._stop = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self._thread.join()
        self._close_fds()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
