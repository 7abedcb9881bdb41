"""Warm starts in the daemon: each served model's resident set survives a restart.

Per model a state file in ``state_dir`` (``moecached.engine.warmth`` has the format): written
atomically every ``state_interval_s`` seconds (in a thread: the loop only takes the snapshot)
and when the daemon stops gracefully; read once the daemon serves, and filled back in file
order at prefetch priority while it serves (:class:`moecached.engine.warmth.WarmFill`). A
model without a state file (warm starts on) whose arena holds all of its experts is read
whole the same way.
Progress goes to stderr: a live percentage on a terminal, else one line every
:data:`PROGRESS_S` seconds, and one line at the end. A state file of another model (the file
changed: its fingerprint, size, mtime, ctime or inode differ) or one that cannot be read
(truncated, corrupt) is one log line and a cold start.

The ``warm`` op (``moecache-ctl warm``) fills a running model from its state file or from the
experts the request names (a trace's, in first-use order): :meth:`WarmStates.handle`.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time

from moecached.daemon.logs import _live_stream
from moecached.engine.warmth import (StateError, WarmFill, counters_of, identity_mismatch,
                                     load_state, resident_experts, save_state,
                                     whole_model_if_it_fits)
from moecached.facts import protocol as P
from moecached.facts.units import format_bytes

log = logging.getLogger("moecached.warm")

#: seconds between two progress lines of a fill when stderr is not a terminal
PROGRESS_S = 5.0
#: the default state_dir: used when it exists (the unit's StateDirectory= makes it)
DEFAULT_STATE_DIR = "/var/lib/moecached"


def state_path(state_dir: str, endpoint: str, model_path: str, name: str | None = None) -> str:
    """The state file of the model at ``model_path`` served by the daemon of ``endpoint``:
    ``STATE_DIR/NAME-HASH.warm`` (NAME: the model's name, else its file name without
    ``.gguf``; HASH: of the endpoint and the model's absolute path)."""
    stem = name or re.sub(r"\.gguf$", "", os.path.basename(model_path))
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", stem)[:48] or "model"
    h = hashlib.sha256(f"{endpoint}\0{os.path.abspath(model_path)}".encode()).hexdigest()[:10]
    return os.path.join(state_dir, f"{stem}-{h}.warm")


def _served(models) -> list:
    """``[(name or None, path, server)]`` of the models served now (one model or several:
    ``moecached.daemon.multi.Models``; a model alone has no name in its state file's)."""
    return [(m.name if models.several else None, m.path, m.server) for m in list(models.models.values())
            if m.server is not None and m.draining is None]


class _Progress:
    """A fill's progress on stderr: a live percentage on a terminal, else a line every few s."""

    def __init__(self, what: str, total_bytes: int):
        self.what, self.total = what, max(1, total_bytes)
        self.live = _live_stream()
        self.t0 = self.last = time.monotonic()
        self.pct = -1

    def __call__(self, done: int, planned: int, nbytes: int) -> None:
        now = time.monotonic()
        rate = nbytes / max(now - self.t0, 1e-6)
        if self.live is not None:
            pct = min(100, nbytes * 100 // self.total)
            if pct != self.pct:
                self.pct = pct
                self.live.write(f"\r  {self.what}: {pct}% ({done}/{planned} experts, "
                                f"{format_bytes(rate)}/s)")
                self.live.flush()
        elif now - self.last >= PROGRESS_S:
            self.last = now
            log.info("%s: %d/%d experts, %s of %s (%s/s)", self.what, done, planned,
                     format_bytes(nbytes), format_bytes(self.total), format_bytes(rate))

    def end(self) -> None:
        if self.live is not None and self.pct >= 0:
            self.live.write("\n")
            self.live.flush()


class WarmStates:
    """The state files and warm fills of a daemon's models (``daemon``: its ``cfg`` and
    ``models``). The daemon calls :meth:`start` once it serves, :meth:`tick` from its periodic
    task, :meth:`close` when it stops; :meth:`handle` answers the ``warm`` op of a model."""

    def __init__(self, daemon):
        self.daemon = daemon
        cfg = daemon.cfg
        self.dir = self._state_dir(cfg)
        self.last_save = time.monotonic()
        self._saving = None
        self.saved = {}   # state file -> experts last saved

    def _state_dir(self, cfg) -> str | None:
        d = getattr(cfg, "state_dir", DEFAULT_STATE_DIR)
        if not d:
            return None
        if not os.path.isdir(d):
            if (getattr(cfg, "sources", {}) or {}).get("state_dir", "default") == "default":
                log.info("warm starts off: %s does not exist (set state_dir, or the unit's "
                         "StateDirectory= makes it)", d)
                return None
            try:
                os.makedirs(d, mode=0o750, exist_ok=True)
            except OSError as e:
                log.warning("warm starts off: cannot create state_dir %s: %s", d, e.strerror or e)
                return None
        if not os.access(d, os.W_OK | os.X_OK):
            log.warning("warm starts off: state_dir %s is not writable by this process", d)
            return None
        return d

    def path(self, name, model_path) -> str | None:
        if self.dir is None:
            return None
        return state_path(self.dir, self.daemon.cfg.endpoint, model_path, name)

    def install(self) -> None:
        """Give every model's server the ``warm`` op (models added live included)."""
        for name, mpath, server in _served(self.daemon.models):
            if getattr(server, "warm_handler", None) is None:
                server.warm_handler = lambda msg, _s=server, _n=name, _p=mpath: \
                    self.handle(msg, _s, _n, _p)

    # ---- start: fill from the state files ----------------------------------------------------
    def start(self) -> None:
        """The daemon serves: fill each model from its state file (in the background)."""
        self.install()
        for name, mpath, server in _served(self.daemon.models):
            path = self.path(name, mpath)
            wanted = None
            if path is not None:
                try:
                    wanted = self._read(path, server.cache)
                except StateError as e:
                    log.warning("%s; starting cold", e)
            if wanted is not None:
                self._fill(server.cache, wanted, f"state file {path}")
                continue
            # no state file, and the arena holds the whole model: read it all in file order (as
            # a memory-mapped engine's load would) rather than one demand miss per expert
            everything = whole_model_if_it_fits(server.cache) if path is not None else None
            if everything:
                self._fill(server.cache, everything, "the whole model (a cold start; the arena holds it)")

    def _read(self, path, cache):
        """The experts of ``path`` for ``cache``'s model; None (one log line) when there is no
        state file or it is another model's. StateError when it cannot be used."""
        try:
            st = load_state(path)
        except FileNotFoundError:
            log.info("no state file %s: starting cold", path)
            return None
        why = identity_mismatch(st, cache.index)
        if why is not None:
            log.info("state file %s is not this model's (%s): starting cold", path, why)
            return None
        return st["experts"]

    def _fill(self, cache, wanted, source) -> WarmFill:
        fill = WarmFill(cache, wanted, source=source, log=log,
                        run_bytes=getattr(self.daemon.cfg, "fill_run", 0),
                        run_io=getattr(self.daemon.cfg, "fill_io", "direct"))
        nbytes = sum(sum(cache._cls[cache._layers[l].cid][0].part_bytes.values())
                     for l, _ in fill.plan)
        what = f"warm start from {source}"
        prog = _Progress(what, nbytes)
        fill.progress = prog

        def done(f):
            prog.end()
            rate = f.nbytes / max(f.elapsed, 1e-6)
            log.info("%s: %d of %d experts (%s) in %.1f s, %s/s%s", what, f.done, f.planned,
                     format_bytes(f.nbytes), f.elapsed, format_bytes(rate),
                     " (stopped)" if f.stopped else "")
        fill.on_done = done
        if fill.why_not is not None:
            log.warning("%s: nothing loaded: %s", what, fill.why_not)
        log.info("%s: loading %d experts (%s; %d wanted, the rest resident or past the budget) "
                 "in file order", what, fill.planned, format_bytes(nbytes), len(set(wanted)))
        return fill.start()

    # ---- the warm op ------------------------------------------------------------------------
    def handle(self, msg: dict, server, name, mpath) -> dict:
        cache = server.cache
        running = counters_of(cache).running
        if running is not None:
            raise P.ProtocolError(P.E_INVALID_STATE, f"a warm fill is running ({running.done} of "
                                  f"{running.planned} experts loaded); wait for it to end")
        given = msg.get("experts")
        if given is None:
            path = self.path(name, mpath)
            if path is None:
                raise P.ProtocolError(P.E_REFUSED, "warm starts are off (no state_dir): name the "
                                      "experts (moecache-ctl warm --from-trace FILE)")
            try:
                wanted = self._read(path, cache)
            except StateError as e:
                raise P.ProtocolError(P.E_INVALID_STATE, str(e)) from None
            if wanted is None:
                raise P.ProtocolError(P.E_INVALID_STATE, f"no state file of this model at {path}")
            source = f"state file {path}"
        else:
            wanted = self._experts(given, cache)
            source = "a list of experts (moecache-ctl warm)"
        fill = self._fill(cache, wanted, source)
        return {"wanted": len(wanted), "queued": fill.planned, "source": source,
                "bytes": sum(sum(cache._cls[cache._layers[l].cid][0].part_bytes.values())
                             for l, _ in fill.plan)}

    @staticmethod
    def _experts(given, cache) -> list:
        """The ``experts`` field: ``[[layer, expert], ...]`` of the model, else ProtocolError."""
        if not isinstance(given, list):
            raise P.ProtocolError(P.E_BAD_TYPE, f"field 'experts' is {type(given).__name__}: "
                                  "expected a list of [layer, expert] pairs")
        out = []
        for i, x in enumerate(given):
            if (not isinstance(x, list) or len(x) != 2
                    or not all(type(v) is int for v in x)):
                raise P.ProtocolError(P.E_BAD_TYPE, f"experts[{i}] = {x!r:.40}: expected a "
                                      "[layer, expert] pair of integers")
            layer, expert = x
            if layer not in cache._layers or not 0 <= expert < cache.n_experts:
                raise P.ProtocolError(P.E_OUT_OF_RANGE, f"experts[{i}] = [{layer}, {expert}]: "
                                      f"expected a block with routed experts and an expert "
                                      f"0..{cache.n_experts - 1}")
            out.append((layer, expert))
        return out

    # ---- saving -----------------------------------------------------------------------------
    def _snapshot(self) -> list:
        """``[(state file, cache, experts)]`` to save now (models whose file is unchanged)."""
        out = []
        for name, mpath, server in _served(self.daemon.models):
            path, cache = self.path(name, mpath), server.cache
            if path is None or cache.model_changed is not None:
                continue
            experts = resident_experts(cache)
            resident = len(experts)
            running = counters_of(cache).running
            if running is not None:   # what the fill has still to load comes after
                have = set(experts)
                experts += [x for x in running.wanted if x not in have]
            out.append((path, cache, experts, mpath, resident))
        return out

    def _write(self, snap, why: str) -> None:
        for path, cache, experts, mpath, resident in snap:
            try:
                n = save_state(path, cache, experts, model=mpath)
                self.saved[path] = n
                more = f" and {n - resident} a running warm fill had still to load" if n > resident else ""
                log.log(logging.INFO if why == "stop" else logging.DEBUG,
                        "saved %d resident experts%s to %s (%s)", resident, more, path, why)
            except OSError as e:
                log.warning("cannot save the state file %s: %s", path, e.strerror or e)

    def tick(self, now: float) -> None:
        """The periodic task: new models get the ``warm`` op; every ``state_interval_s`` the
        state files are written (in a thread) unless a fill runs or the last write does."""
        self.install()
        interval = getattr(self.daemon.cfg, "state_interval_s", 0)
        if self.dir is None or not interval or now - self.last_save < interval:
            return
        if self._saving is not None and self._saving.is_alive():
            return
        self.last_save = now
        snap = self._snapshot()
        if snap:
            self._saving = threading.Thread(target=self._write, args=(snap, "periodic"),
                                            name="moecached-state", daemon=True)
            self._saving.start()

    def close(self) -> None:
        """The daemon stops: every model's state file is written (with what a running fill
        has still to load after the resident experts), then fills stop."""
        snap = self._snapshot() if self.dir is not None else []
        for _, _, server in _served(self.daemon.models):
            running = counters_of(server.cache).running
            if running is not None:
                running.stop()
        if self._saving is not None:
            self._saving.join(10)
        self._write(snap, "stop")

    def stats(self) -> dict:
        """``warm``: the state directory and the last fill of each model (for ``stats``)."""
        out = []
        for name, mpath, server in _served(self.daemon.models):
            w = counters_of(server.cache)
            r = w.running
            out.append({"model": name or mpath, "state_file": self.path(name, mpath),
                        "running": r is not None, "loaded": w.loaded, "wanted": w.wanted})
        return {"state_dir": self.dir, "models": out}
