"""A served model's file changed under the daemon: say it once, then exit or re-index it.

A model file that changes (written, truncated, replaced, even with its mtime restored) is
noticed at once: inotify on the files and their directories (``moecached.daemon.watch``), a stat check
on every load (the reader pool) and on every periodic tick. Misses then fail with
``model_changed`` while resident experts are still served, and ``on_model_change`` decides:

* ``"exit"``: the daemon exits with status :data:`EXIT_MODEL_CHANGED` (systemd restarts it on
  the new file);
* ``"reload"``: once the files have been unchanged for :data:`MODEL_SETTLE_S` seconds the model
  is indexed again and served from a new arena under a new session (clients say hello again).
  A file that cannot be indexed is tried again when it changes next.

One :class:`ModelReloader` per served model (``moecached.daemon.multi.Models``, one model or
several), driven from its server's loop thread; each model is handled alone: the others keep
serving. See docs/operations.md, "Model file changed".
"""
from __future__ import annotations

import contextlib
import logging
import os
import time

from moecached import MoecacheError
from moecached.engine.index import open_index
from moecached.daemon.watch import ModelWatch, WatchError

log = logging.getLogger("moecached")

#: exit status when the model file changed and on_model_change = "exit"
EXIT_MODEL_CHANGED = 3
#: on_model_change = "reload": seconds the model file must stay unchanged before re-indexing
MODEL_SETTLE_S = 1.0


def file_sig(paths) -> tuple:
    """What the model files look like now (size, mtime, ctime, inode; None if missing)."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


def model_files(cache) -> list[str]:
    return [str(getattr(f, "path", f)) for f in cache.index.files]


def start_watch(cache):
    """An inotify watch on ``cache``'s model files that rechecks them on every event, or None
    (with one warning) when inotify is unavailable: the periodic check still notices."""
    try:
        return ModelWatch(model_files(cache), cache.readers.recheck,
                          log=logging.getLogger("moecached.daemon.watch"))
    except WatchError as e:
        log.warning("%s; a change of the model file is noticed at the next load or periodic "
                    "check instead", e.strerror)
        return None


class ModelReloader:
    """Watches the model ``server`` serves and handles a change of its files.

    Args:
        server: the ``moecached.service.server.Server`` serving the model (its loop thread calls
            :meth:`changed` and :meth:`tick`).
        path: the model's GGUF path (indexed again on reload).
        label: how the log names it (``model /srv/a.gguf``, ``model qwen (/srv/a.gguf)``).
        mode: callable -> ``"reload"`` or ``"exit"`` (the live config's ``on_model_change``).
        rebuild: callable(index) -> the new ExpertCache for a re-indexed model, called after the
            old cache was retired (its memory given back); raises MoecacheError when it cannot.
        installed: optional callable(cache) run once the new cache is served.
        exit: callable(status) that stops the daemon with that exit status.
        failed: optional callable(error) when ``rebuild`` raised (default: log it and exit 1).
        guard: optional lock held from retiring the old cache to serving the new one (others
            that read the model's cache take it too).
        notify: optional callable(str): a systemd STATUS line.
    """

    def __init__(self, server, path, label, *, mode, rebuild, exit, installed=None, failed=None,
                 guard=None, notify=None):
        self.server, self.path, self.label = server, path, label
        self._mode, self._rebuild, self._exit = mode, rebuild, exit
        self._installed, self._notify = installed, notify or (lambda s: None)
        self._failed = failed or self._exit_on_failure
        self._guard = guard if guard is not None else contextlib.nullcontext()
        self.pending = None   # a change waiting to be re-indexed
        self.reloads = 0
        server.on_model_change = self.changed
        self._follow(server.cache)

    def _follow(self, cache) -> None:
        cache.readers.on_change = self.server.model_changed
        self.watch = start_watch(cache)

    def changed(self, msg: str) -> None:
        """Loop thread, once per change: say it once, then exit or wait to re-index."""
        if self._mode() == "exit":
            log.error("%s; on_model_change = \"exit\": exiting with status %d so the service "
                      "manager restarts the daemon on the new file", msg, EXIT_MODEL_CHANGED)
            self._notify("model file changed: exiting")
            self._exit(EXIT_MODEL_CHANGED)
            return
        log.error("%s; on_model_change = \"reload\": misses fail with model_changed, resident "
                  "experts are still served; re-indexing once the file has been unchanged for "
                  "%g s", msg, MODEL_SETTLE_S)
        self._notify("model file changed: waiting to re-index")
        self.pending = {"msg": msg, "sig": file_sig(model_files(self.server.cache)),
                        "since": time.monotonic(), "failed": None}

    def tick(self, now: float) -> None:
        """Periodic task of the model's loop: notice a change without inotify, re-index a
        changed file that settled."""
        c = self.server.cache
        if c.readers.model_changed is None:
            c.readers.recheck()   # without inotify this is how a change is noticed
            return
        r = self.pending
        if r is None:
            return
        sig = file_sig(model_files(c))
        if sig != r["sig"]:
            r["sig"], r["since"] = sig, now
        elif now - r["since"] >= MODEL_SETTLE_S and r["failed"] != sig:
            self._reload(r, sig)

    def _reload(self, r: dict, sig: tuple) -> None:
        """Re-index the model file and serve it under a new session (loop thread)."""
        try:
            idx = open_index(self.path)
        except (MoecacheError, OSError) as e:
            r["failed"] = sig
            log.error("%s cannot be indexed (%s); still serving resident experts only, trying "
                      "again when the file changes", self.label, e)
            return
        if file_sig(model_files(self.server.cache)) != sig:
            return  # changed while being indexed: wait for it to settle again
        with self._guard:
            self.server.retire_cache("model_changed", f"{r['msg']}; the daemon is re-indexing it")
            self.close()
            try:
                new = self._rebuild(idx)
            except MoecacheError as e:
                self.pending = None
                self._failed(e)
                return
            self.pending = None
            self.reloads += 1
            self.server.install_cache(new)
            self._follow(new)
        if self._installed is not None:
            self._installed(new)
        slots = sum(c.n_slots for c in new.arena.classes)
        log.info("%s re-indexed and reloaded: %d slots, fingerprint %s, new session; clients "
                 "say hello again", self.label, slots, idx.fingerprint())
        self._notify(f"serving {os.path.basename(self.path)} (reloaded)")
        # a change after the index was read and before the readers opened the files
        if file_sig(model_files(new)) != sig:
            new.readers.recheck()

    def _exit_on_failure(self, e: Exception) -> None:
        log.error("%s re-indexed but its cache could not be rebuilt: %s; exiting", self.label, e)
        self._exit(1)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None
