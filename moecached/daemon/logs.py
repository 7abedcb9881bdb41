"""Logging to stderr in a journald-friendly form.

Under systemd (``$JOURNAL_STREAM`` set and naming our stderr) each line starts with its
syslog priority, ``<6>`` for info, ``<4>`` for warning..., and carries no timestamp (journald
adds one); journald files it at that priority. Otherwise lines look like
``2026-01-01 12:00:00,123 INFO moecached.service.server: message``.

Multi-line messages (tracebacks) get the prefix on every line, so journald keeps the priority
for each of them.

Start-up stages (:func:`stage`) log one line each as they begin; when stderr is a terminal a
stage with a known size also shows a live percentage under that line.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import Optional, TextIO

__all__ = ["setup_logging", "set_level", "under_journald", "JournalFormatter", "PRIORITY", "stage", "Stage"]

#: logging level -> syslog priority (sd-daemon.h SD_* prefixes)
PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}

_HANDLER_NAME = "moecached-stderr"


def _priority(levelno: int) -> int:
    for lvl in (logging.CRITICAL, logging.ERROR, logging.WARNING, logging.INFO):
        if levelno >= lvl:
            return PRIORITY[lvl]
    return PRIORITY[logging.DEBUG]


class JournalFormatter(logging.Formatter):
    """``<N>logger: message`` on every line."""

    def __init__(self):
        super().__init__("%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        p = f"<{_priority(record.levelno)}>"
        return "\n".join(p + line for line in text.split("\n"))


def under_journald(stream: Optional[TextIO] = None) -> bool:
    """True when ``$JOURNAL_STREAM`` (``DEV:INODE``) matches ``stream`` (default stderr)."""
    js = os.environ.get("JOURNAL_STREAM")
    if not js:
        return False
    stream = sys.stderr if stream is None else stream
    try:
        dev, ino = (int(x) for x in js.split(":", 1))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return st.st_dev == dev and st.st_ino == ino


def _level(level) -> int:
    if isinstance(level, int):
        return level
    name = str(level).upper()
    if name == "WARN":
        name = "WARNING"
    value = logging.getLevelName(name)
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r}: expected debug, info, warning or error")
    return value


def setup_logging(level="info", *, stream: Optional[TextIO] = None, journal: Optional[bool] = None) -> logging.Handler:
    """Send the root logger to ``stream`` (default stderr) at ``level`` ("debug", "info", ...
    or a number). ``journal`` forces (or disables) the ``<N>`` prefixes; by default they are on
    when :func:`under_journald`. Calling it again replaces the previous handler (safe on SIGHUP).
    Returns the handler."""
    stream = sys.stderr if stream is None else stream
    if journal is None:
        journal = under_journald(stream)
    handler = logging.StreamHandler(stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(JournalFormatter() if journal else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        if h.get_name() == _HANDLER_NAME:
            root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(_level(level))
    return handler


def set_level(level) -> None:
    """Change the root level (e.g. on SIGHUP after ``log_level`` changed)."""
    logging.getLogger().setLevel(_level(level))


def _live_stream() -> Optional[TextIO]:
    """The daemon's stderr handler's stream when it is a terminal, else None."""
    for h in logging.getLogger().handlers:
        if h.get_name() == _HANDLER_NAME:
            s = getattr(h, "stream", None)
            try:
                return s if s is not None and s.isatty() else None
            except (AttributeError, ValueError):
                return None
    return None


class Stage:
    """One start-up stage (see :func:`stage`): ``update(done)`` shows progress, ``elapsed``
    is the seconds it took once the ``with`` block ends."""

    def __init__(self, what: str, total: Optional[int] = None, logger: Optional[logging.Logger] = None):
        self.what = what
        self.total = total
        self.log = logger or logging.getLogger("moecached")
        self.elapsed = 0.0
        self._pct = -1
        self._live = None

    def __enter__(self) -> "Stage":
        self.t0 = time.monotonic()
        self.log.info("%s", self.what)   # the one line the journal gets
        self._live = _live_stream() if self.total else None
        return self

    def update(self, done: int, total: Optional[int] = None) -> None:
        """``done`` of ``total`` (default: the stage's) units finished."""
        if total is not None:
            self.total = total
        if self._live is None or not self.total:
            return
        pct = min(100, int(done * 100 // self.total))
        if pct != self._pct:
            self._pct = pct
            self._live.write(f"\r  {self.what}: {pct}%")
            self._live.flush()

    def __exit__(self, *exc) -> None:
        self.elapsed = time.monotonic() - self.t0
        if self._live is not None and self._pct >= 0:
            self._live.write(f" ({self.elapsed:.1f} s)\n")
            self._live.flush()


def stage(what: str, total: Optional[int] = None, logger: Optional[logging.Logger] = None) -> Stage:
    """``with stage("reserving and locking 3.00 GiB", total=n) as s: ... s.update(k)``: logs
    ``what`` once at INFO (one line per stage in the journal); when stderr is a terminal and
    ``total`` is given, a live percentage follows on the line below."""
    return Stage(what, total, logger)
