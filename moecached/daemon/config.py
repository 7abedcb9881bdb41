"""Daemon configuration: ``/etc/moecached/moecached.toml`` (``tomllib``), overridden by CLI flags.

Precedence: built-in defaults < the config file < command-line flags (or ``overrides``). The
default file is read only if it exists; a file named with ``--config`` must exist.

Every value is validated; a bad one raises :class:`ConfigError` with one line naming where it
came from, the key, the value and what was expected, for example::

    /etc/moecached/moecached.toml: readers = 0: expected an integer from 1 to 1024
    command line: --budget = "8GG": expected a size such as 8GiB, 512M, ...
    /etc/moecached/moecached.toml: unknown key "budjet" (did you mean "budget"?)

The keys, their defaults and meaning are in :data:`KEYS` (and ``docs/operations.md``,
``systemd/moecached.toml.example``). Sizes take units (see :mod:`moecached.facts.units`), modes are
octal (``0o660`` in TOML, or the string ``"0660"``).

API: :class:`Config`, :func:`load_config`, :func:`add_cli_args`, :func:`config_from_args`,
:func:`reload_changes` (what a SIGHUP may apply without a restart), :func:`dump_toml`.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import grp
import json
import os
import re
import shlex
import stat
import tomllib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from moecached import MoecacheError
from moecached.daemon.confvalues import (MAX_IPC_PATH, MODEL_NAME, GiB, KiB, MiB, _abs_path, _admit_cold,  # noqa: F401
                                         _arena_dir,
                         _Bad, _bool, _choice, _endpoint, _float_range, _fraction, _group, _human,
                         _hysteresis, _int_range, _log_level, _mode, _model, _MODEL_FIELDS, _models,
                         _hit_rate, _rate, _size, _state_dir)
from moecached.daemon.confvalues import _dirs

__all__ = ["Config", "ConfigError", "KEYS", "DEFAULT_PATH", "DEFAULT_ENDPOINT", "RELOADABLE",
           "load_config", "add_cli_args", "config_from_args", "reload_changes", "dump_toml"]

DEFAULT_PATH = "/etc/moecached/moecached.toml"
DEFAULT_ENDPOINT = "ipc:///run/moecached/moecached.sock"
DEFAULT_GROUP = "moecached"


class ConfigError(MoecacheError):
    """An invalid configuration value, unknown key or unreadable file; ``str(e)`` is one line."""




@dataclass
class Config:
    """The daemon's settings. Sizes are bytes, times seconds, modes ints (e.g. ``0o660``)."""
    model: Optional[str] = None              # GGUF file (first file of a split set)
    models: list = field(default_factory=list)  # several models: [{name, path, min_budget, max_budget, weight}]
    budget: Optional[int] = None             # cache size in bytes (or give slots)
    slots: Optional[int] = None              # cache size in expert slots (or give budget)
    endpoint: str = DEFAULT_ENDPOINT         # ZeroMQ endpoint, ipc:// (tcp:// needs allow_tcp)
    allow_tcp: bool = False                  # permit a tcp:// endpoint (no access control!)
    arena_dir: str = "/dev/shm"              # where the arena file lives (tmpfs or hugetlbfs)
    hugetlb: bool = False                    # back the arena with huge pages
    lock_memory: bool = True                 # mlock the arena
    direct_io: bool = True                   # O_DIRECT reads of the model
    readers: int = 16                        # reader threads
    chunk: int = 256 * KiB                   # read size, bytes (multiple of 4 KiB)
    policy: str = "global"                   # eviction scope: global | per-layer
    admit_cold: object = "off"               # misses entering at the cold end: off | prompt | N
    eviction: str = "lru"                    # eviction order: lru | lfu-decay | lfu-subst | slru
    scan_admit: str = "cold"                 # where admit_cold puts a miss: cold | probation
    max_prefetch_loads: Optional[int] = None # prefetch loads in flight before dropping (None: auto)
    client_max_prefetch: Optional[int] = None  # per client prefetch loads in flight (None: auto, 0: no cap)
    prefetch_min_confidence: float = 0.0     # prefetched experts below this confidence are dropped
    client_rate_limit: float = 40000.0       # requests/s per client (0: off)
    client_rate_burst: int = 40000           # requests a client may send at once
    client_loop_share: float = 0.02          # share of the daemon's loop one client may use while others are active (0: off)
    floor: Optional[int] = None              # memory floor, bytes; None = off
    floor_hysteresis: int = 1 * GiB          # grow back above floor + this
    floor_interval_s: float = 1.0            # floor sampling period
    floor_min_change_s: float = 5.0          # least time between a change and a grow
    min_budget: Optional[int] = None         # the floor never shrinks below this (None: daemon picks)
    on_pressure: str = "error"               # acquire that cannot fit: error | wait
    pressure_timeout_s: float = 30.0         # on_pressure = wait: give up after this
    on_model_change: str = "reload"          # model file changed under the daemon: reload | exit
    heartbeat_s: float = 5.0                 # client lease heartbeat period
    socket_mode: int = 0o660                 # mode of the ipc socket file
    arena_mode: int = 0o640                  # mode of the arena file
    group: Optional[str] = None              # group owning socket and arena (None: leave as is)
    admin_group: Optional[str] = None        # group whose members may change the daemon (None: only root and its uid)
    model_dirs: list = field(default_factory=list)  # directories `models add` may take files from
    log_level: str = "info"                  # debug | info | warning | error
    max_request_experts: int = 16384         # experts named in one request, at most
    max_message_bytes: int = 4 * MiB         # largest request message accepted
    fast_path: bool = True                   # pin files for shared-memory hits (watched clients)
    fast_path_quota: int = 0                 # slots whose fast-path pins are honoured per client (0: auto)
    fast_path_hit_rate: float = 2_000_000.0  # hit-ring entries/s drained per uid, bursts of one ring (0: off)
    split_interval_s: float = 10.0           # several models: seconds between two rebalances of the split
    split_step: Optional[int] = None         # several models: bytes a share moves by (None: budget / 32)
    split_hysteresis: float = 0.25           # several models: a move's gain must beat its loss by this factor
    state_dir: str = "/var/lib/moecached"    # warm-start state files ("" : none; used when it exists)
    state_interval_s: float = 60.0           # seconds between two saves of the state files (0: at stop only)
    fill_run: int = 64 * MiB                 # a warm fill's largest run of consecutive experts read at once (0: one per expert)
    fill_io: str = "direct"                  # how a fill's runs are read: direct (O_DIRECT) or buffered (read-ahead)
    # where each value came from: "default", the config file's path, or "command line"
    sources: dict = field(default_factory=dict, repr=False, compare=False)
    # arena_dir given as a list: the list (arena_dir is then the one taken); None otherwise
    arena_dir_choices: Optional[list] = field(default=None, repr=False, compare=False)
    # and why each entry could not take the arena (None: it could); None when the list was not
    # looked at (no list, or a SIGHUP with the running list)
    arena_dir_refused: Optional[dict] = field(default=None, repr=False, compare=False)
    path: Optional[str] = field(default=None, compare=False)   # config file read, if any

    @property
    def ipc_path(self) -> Optional[str]:
        """Filesystem path of an ``ipc://`` endpoint, else None."""
        return self.endpoint[len("ipc://"):] if self.endpoint.startswith("ipc://") else None

    def as_dict(self) -> dict:
        """The settings (no bookkeeping fields) as a plain dict."""
        return {k: getattr(self, k) for k in KEYS}


# -- live reload ---------------------------------------------------------------------------------
# A key that can change while the daemon runs declares *how* in its row: ``reload`` names the
# change ("floor", "client_limits", ...; several keys may share one name, their values are then
# applied together) and ``scope`` what it reaches. The table only declares: the daemon
# (``moecached.daemon.runtime.Daemon.apply``) maps each name to the method that applies it.

@dataclass(frozen=True)
class Key:
    """One configuration key: its validator, CLI flag, metavar, help, and ``reload``: None when
    a change needs a restart, else the name of the live change a SIGHUP applies it with (see
    above)."""
    check: Callable
    flag: str
    help: str
    metavar: Optional[str] = None
    kind: str = "str"    # str | int | float | bool | size | mode (how CLI strings are read)
    reload: Optional[str] = None
    #: what a live change reaches: "model" (each model's cache and socket), "socket" (every
    #: socket, the several-models endpoint's too), "daemon" (applied once), "budget" (the
    #: budget and the memory floor: with several models, a restart)
    scope: str = "model"


KEYS: dict[str, Key] = {
    "model": Key(_model, "--model", "GGUF model file (first file of a split set); NAME=PATH, "
                 "repeated, serves several models under one budget", "[NAME=]PATH"),
    "models": Key(_models, "--model", "several models ([[models]] tables in the file; on the "
                  "command line give --model NAME=PATH per model)", "-", "list",
        reload="models", scope="daemon"),
    "budget": Key(_size(lo=1), "--budget", "cache size, e.g. 16GiB (or give --slots)", "SIZE", "size",
        reload="budget", scope="budget"),
    "slots": Key(_int_range(1, 1 << 24), "--slots", "cache size in expert slots (or give --budget)", "N", "int",
        reload="budget", scope="budget"),
    "endpoint": Key(_endpoint, "--endpoint", f"ZeroMQ endpoint (default {DEFAULT_ENDPOINT})", "URL"),
    "allow_tcp": Key(_bool, "--allow-tcp", "permit a tcp:// endpoint (it has no access control)", kind="bool"),
    "arena_dir": Key(_arena_dir, "--arena-dir", "directory of the arena file (default /dev/shm); in the file "
                     "also a list, of which the first mount point this user can write to is taken "
                     '(e.g. ["/run/moecached-arena", "/dev/shm"]: 2 MiB pages where that mount is)', "DIR"),
    "hugetlb": Key(_bool, "--hugetlb", "back the arena with huge pages (arena_dir on hugetlbfs)", kind="bool"),
    "lock_memory": Key(_bool, "--lock-memory", "mlock the arena (default on)", kind="bool"),
    "direct_io": Key(_bool, "--direct-io", "read the model with O_DIRECT (default on)", kind="bool"),
    "readers": Key(_int_range(1, 1024), "--readers", "reader threads, shared by all models "
                   "(default 16)", "N", "int"),
    "chunk": Key(_size(lo=4 * KiB, hi=64 * MiB, multiple=4 * KiB), "--chunk", "read size (default 256KiB)",
                 "SIZE", "size"),
    "policy": Key(_choice("global", "per-layer"), "--policy", "eviction scope: global or per-layer", "NAME"),
    "eviction": Key(_choice("lru", "lfu-decay", "lfu-subst", "slru"), "--eviction",
                    "eviction order: lru (default), lfu-decay (fewest decayed uses, ties "
                    "least recent), lfu-subst (same over a short window, substitute "
                    "candidates offered count half a use) or slru (segmented LRU: a miss "
                    "enters probation, a second use protects it)", "NAME"),
    "scan_admit": Key(_choice("cold", "probation"), "--scan-admit",
                      "where admit_cold puts a miss: the cold end (cold, default) or the "
                      "probation point, a fifth of the cached experts from the cold end "
                      "(probation)", "cold|probation", reload="scan_admit"),
    "admit_cold": Key(_admit_cold, "--admit-cold",
                      "scan-resistant admission: the misses of prompt-tagged acquires (prompt) "
                      "or of one layer's experts wider than N (N) enter the LRU at the cold "
                      "end (default off)", "off|prompt|N", reload="admit_cold"),
    "max_prefetch_loads": Key(_int_range(0, 1 << 20), "--max-prefetch-loads",
                              "prefetch loads in flight before new prefetches are dropped "
                              "(default: 2 x top-k x size classes, at least 16; 0 turns prefetch off)",
                              "N", "int"),
    "client_max_prefetch": Key(_int_range(0, 1 << 20), "--client-max-prefetch",
                               "prefetch loads one client may have in flight before its new "
                               "prefetches are dropped (default: a fair share, max_prefetch_loads "
                               "split evenly between the engines active now; 0: no per-client cap)",
                               "N", "int",
        reload="client_limits", scope="socket"),
    "prefetch_min_confidence": Key(_fraction, "--prefetch-min-confidence",
                                   "prefetched experts whose confidence (the prefetch's conf "
                                   "field) is below C are dropped (default 0: none)", "C", "float",
        reload="prefetch_min_confidence"),
    "client_rate_limit": Key(_rate, "--client-rate-limit",
                             "requests per second per client before it is refused rate_limited "
                             "(noreply prefetches dropped); releases never count (default 40000; "
                             "0 turns it off)", "R", "float",
        reload="client_limits", scope="socket"),
    "client_rate_burst": Key(_int_range(1, 1 << 30), "--client-rate-burst",
                             "requests a client may send at once above its rate (default 40000)",
                             "N", "int",
        reload="client_limits", scope="socket"),
    "client_loop_share": Key(_fraction, "--client-loop-share",
                             "share of the daemon's loop time one client may use while other "
                             "clients are active; over it its prefetches, and its requests that "
                             "are not the hot path (stats, ping, ...), wait their turn (the newest "
                             "noreply prefetch runs later) (default 0.02; 0: off)", "F", "float",
        reload="client_limits", scope="socket"),
    "floor": Key(_size(optional_zero=True), "--floor",
                 "shrink the cache when available memory falls under SIZE (default off)", "SIZE", "size",
        reload="floor", scope="budget"),
    "floor_hysteresis": Key(_size(), "--floor-hysteresis", "grow back above floor + SIZE (default 1GiB)",
                            "SIZE", "size",
        reload="floor", scope="budget"),
    "floor_interval_s": Key(_float_range(0, 60, lo_open=True), "--floor-interval",
                            "seconds between memory samples (default 1)", "S", "float",
        reload="floor", scope="budget"),
    "floor_min_change_s": Key(_float_range(0, 3600), "--floor-min-change",
                              "seconds a surplus must last before growing back (default 5)", "S", "float",
        reload="floor", scope="budget"),
    "min_budget": Key(_size(), "--min-budget", "the floor never shrinks the cache below SIZE", "SIZE", "size",
        reload="floor", scope="budget"),
    "on_pressure": Key(_choice("error", "wait"), "--on-pressure",
                       "an acquire that cannot fit: error (default) or wait", "MODE",
        reload="on_pressure"),
    "pressure_timeout_s": Key(_float_range(0, 3600), "--pressure-timeout",
                              "with on_pressure=wait, give up after S seconds (default 30)", "S", "float",
        reload="pressure_timeout"),
    "on_model_change": Key(_choice("reload", "exit"), "--on-model-change",
                           "the model file changed under the daemon: reload (default: re-index "
                           "it once quiet, new session) or exit (non-zero: the service manager "
                           "restarts it)", "MODE",
        reload="read_when_used", scope="daemon"),
    "heartbeat_s": Key(_float_range(0, 3600, lo_open=True), "--heartbeat",
                       "client heartbeat period, seconds (default 5)", "S", "float",
        reload="heartbeat", scope="socket"),
    "socket_mode": Key(_mode, "--socket-mode", "mode of the socket file (default 0660)", "MODE", "mode"),
    "arena_mode": Key(_mode, "--arena-mode", "mode of the arena file (default 0640)", "MODE", "mode"),
    "group": Key(_group, "--group", 'group owning socket and arena (default "moecached" if it exists; "" for none)',
                 "GROUP"),
    "admin_group": Key(_group, "--admin-group", "group whose members may change the running "
                       "daemon (models add/remove/rebalance, trace start/stop, client drop) "
                       "besides root and the daemon's uid (default none)", "GROUP"),
    "model_dirs": Key(_dirs, "--model-dirs", "directories `models add` may take model files from, "
                      "separated by ':' (default: the configured models' directories)", "DIR[:DIR...]"),
    "log_level": Key(_log_level, "--log-level", "debug, info (default), warning or error", "LEVEL",
        reload="log_level", scope="daemon"),
    "max_request_experts": Key(_int_range(1, 1 << 24), "--max-request-experts",
                               "most experts one request may name (default 16384)", "N", "int",
        reload="request_limits", scope="socket"),
    "max_message_bytes": Key(_size(lo=4 * KiB, hi=1 * GiB), "--max-message-bytes",
                             "largest request message (default 4MiB)", "SIZE", "size",
        reload="request_limits", scope="socket"),
    "fast_path": Key(_bool, "--fast-path", "offer local clients the shared-memory hit path (default on)",
                     kind="bool"),
    "fast_path_quota": Key(_int_range(0, 1 << 24), "--fast-path-quota",
                           "slots whose shared-memory pins are honoured per client "
                           "(default 0: 4 x top-k x MoE layers, at most half the slots)", "N", "int"),
    "fast_path_hit_rate": Key(_hit_rate, "--fast-path-hit-rate",
                              "hit-ring entries per second the daemon takes from the shared-memory "
                              "rings of one uid's clients together, bursts of one ring (16384); the rest are "
                              "skipped and counted (ring_skipped) (default 2000000; 0: no limit)",
                              "R", "float",
        reload="client_limits", scope="socket"),
    "split_interval_s": Key(_float_range(0, 86400, lo_open=True), "--split-interval",
                            "several models: seconds between rebalances of the shared budget (default 10)",
                            "S", "float", reload="split", scope="daemon"),
    "split_step": Key(_size(lo=1), "--split-step", "several models: bytes a share moves by "
                      "(default: budget / 32, at least one slot of every size class)", "SIZE", "size",
        reload="split", scope="daemon"),
    "split_hysteresis": Key(_hysteresis, "--split-hysteresis", "several models: a move's gain "
                            "must beat its loss by this factor (default 0.25)", "X", "float",
        reload="split", scope="daemon"),
    "state_dir": Key(_state_dir, "--state-dir", "directory of the warm-start state files: each "
                     "model's resident experts, saved periodically and at stop, read back in "
                     "file order at start (default /var/lib/moecached when it exists; \"\" for "
                     "none)", "DIR"),
    "state_interval_s": Key(_float_range(0, 86400), "--state-interval",
                            "seconds between two saves of the state files (default 60; 0: only "
                            "when the daemon stops)", "S", "float",
        reload="read_when_used", scope="daemon"),
    "fill_run": Key(_size(lo=0, hi=1 << 30), "--fill-run", "warm fills (the state file, the "
                    "whole model at a cold start, moecache-ctl warm): consecutive experts are "
                    "read as runs of at most this many bytes, one read per part over their "
                    "slots (default 64MiB; 0: a read per expert)", "SIZE", "size",
        reload="read_when_used", scope="daemon"),
    "fill_io": Key(_choice("direct", "buffered"), "--fill-io", "how a warm fill's runs are "
                   "read: direct (O_DIRECT, default) or buffered (through the page cache's "
                   "read-ahead, each piece dropped from it once copied)", "direct|buffered",
        reload="read_when_used", scope="daemon"),
}

#: Keys a SIGHUP can apply to a running daemon (those with a ``reload`` name); others need
#: a restart.
RELOADABLE = frozenset(k for k, key in KEYS.items() if key.reload is not None)

assert set(KEYS) == {f.name for f in dataclasses.fields(Config)} - {"sources", "path", "arena_dir_choices",
                                                                     "arena_dir_refused"}
assert all(k.scope in ("model", "socket", "daemon", "budget") for k in KEYS.values())


def _show(v: Any) -> str:
    """A value as it would be written in TOML (strings quoted)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{...}"
    if isinstance(v, list) and not any(isinstance(x, dict) for x in v):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    return repr(v)


def _from_cli(key: str, v: Any) -> Any:
    """Turn a command-line string into the type a TOML file would hold, where unambiguous."""
    if not isinstance(v, str):
        return v
    kind = KEYS[key].kind
    s = v.strip()
    if kind == "int" and re.fullmatch(r"[+-]?[0-9]+", s):
        return int(s)
    if kind == "float":
        try:
            return float(s)
        except ValueError:
            return v
    return v


def _fmt(where: str, key: str, value: Any, cli: bool) -> str:
    """``path: key = value`` for files, ``command line: --flag value`` for flags."""
    if cli:
        shown = shlex.quote(value) if isinstance(value, str) else _show(value)
        return f"{where}: {KEYS[key].flag} {shown}"
    return f"{where}: {key} = {_show(value)}"


def load_config(path: Optional[str] = None, overrides: Optional[dict] = None, *,
                check_runnable: bool = True, origin: str = "override", cli: bool = False,
                running: Optional[Config] = None) -> Config:
    """Build a :class:`Config` from defaults, the TOML file and ``overrides``.

    * ``path``: the file to read; None means :data:`DEFAULT_PATH` if it exists, else no file.
      An explicit path that cannot be read is an error.
    * ``overrides``: ``{key: value}`` applied after the file (None values are ignored); values
      are TOML-typed (``int``, ``str``, ...), or CLI strings when ``cli`` is true. Giving one of
      ``budget`` / ``slots`` here replaces the other one from the file.
    * ``origin``: how override errors name their source ("command line" for flags).
    * ``check_runnable``: also require what the daemon needs to start: ``model`` set and an
      existing file, one of ``budget`` / ``slots``, an existing ``arena_dir``.
    * ``running``: the running daemon's config (a SIGHUP): an ``arena_dir`` list equal to its
      list keeps its directory, usable now or not.

    Raises :class:`ConfigError` (one line) on any problem.
    """
    if path is None and os.path.exists(DEFAULT_PATH):
        path = DEFAULT_PATH
    raw: dict = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{path}: cannot read the config file: no such file") from None
        except IsADirectoryError:
            raise ConfigError(f"{path}: cannot read the config file: it is a directory") from None
        except PermissionError:
            raise ConfigError(f"{path}: cannot read the config file: permission denied") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: invalid TOML: not UTF-8 text") from None

    cfg = Config(path=path)
    cfg.sources = {k: "default" for k in KEYS}
    given: dict = {}   # key -> the value as written, for cross-key errors
    group_given = False

    def apply(src: dict, where: str, is_cli: bool) -> None:
        nonlocal group_given
        for key, value in src.items():
            if not is_cli and isinstance(value, dict):
                raise ConfigError(f"{where}: [{key}] is a table: expected top-level keys only "
                                  f"(key = value lines, no [section] headers, dotted keys or "
                                  f"inline tables)")
            if not is_cli and key != "models" and isinstance(value, list) and value and all(
                    isinstance(x, dict) for x in value):
                raise ConfigError(f"{where}: [[{key}]] is an array of tables: expected "
                                  f"top-level keys only (key = value lines)")
            if key not in KEYS:
                names = list(KEYS)
                if is_cli:
                    shown_key = "--" + key.replace("_", "-")
                    guess = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
                    hint = f' (did you mean "{KEYS[guess[0]].flag}"?)' if guess else ""
                else:
                    shown_key = key
                    guess = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
                    hint = f' (did you mean "{guess[0]}"?)' if guess else ""
                raise ConfigError(f'{where}: unknown key "{shown_key}"{hint}')
            if value is None:
                continue
            v = _from_cli(key, value) if is_cli else value
            try:
                parsed = KEYS[key].check(v)
            except _Bad as e:
                raise ConfigError(f"{_fmt(where, key, value, is_cli)}: expected {e.expected}") from None
            setattr(cfg, key, parsed)
            cfg.sources[key] = where
            given[key] = value
            if key == "group":
                group_given = True

    if raw:
        apply(raw, path, False)
    if overrides:
        ov = {k: v for k, v in overrides.items() if v is not None}
        # --budget replaces the file's slots and --slots the file's budget
        if "budget" in ov and "slots" not in ov:
            cfg.slots, cfg.sources["slots"] = None, "default"
        if "slots" in ov and "budget" not in ov:
            cfg.budget, cfg.sources["budget"] = None, "default"
        apply(ov, origin, cli)

    if not group_given:
        try:
            grp.getgrnam(DEFAULT_GROUP)
            cfg.group = DEFAULT_GROUP
        except KeyError:
            cfg.group = None

    if isinstance(cfg.arena_dir, list):
        cfg.arena_dir_choices = list(cfg.arena_dir)
        if running is not None and running.arena_dir_choices == cfg.arena_dir_choices:
            # a SIGHUP with the same list: the running arena stays where it is, whichever entry
            # the list resolves to now (a mount that appeared or went since counts at the next start)
            cfg.arena_dir = running.arena_dir
        else:
            # the first usable one; none: the last (the check below then names them all, with why)
            cfg.arena_dir_refused = {d: arena_dir_refusal(d, cfg.hugetlb) for d in cfg.arena_dir_choices}
            usable = [d for d, why in cfg.arena_dir_refused.items() if why is None]
            # (the mount point itself: what clients are told to open, with no link on the way)
            cfg.arena_dir = os.path.realpath(usable[0]) if usable else cfg.arena_dir_choices[-1]
    _cross_check(cfg, cli, given)
    if check_runnable:
        _check_runnable(cfg, cli, given)
    return cfg


ARENA_FS_TYPES = ("tmpfs", "hugetlbfs")


def mount_fs_type(d: str) -> Optional[str]:
    """The file system type of the mount whose root ``d`` is (the last one mounted there, from
    /proc/self/mountinfo), or None when ``d`` is not a mount point."""
    fstype = None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, sep, right = line.partition(" - ")
                fields = left.split()
                if sep and len(fields) > 4 and right.split() and \
                        re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]) == d:
                    fstype = right.split()[0]
    except OSError:
        return "unknown" if os.path.ismount(d) else None
    return fstype


def arena_dir_refusal(d: str, hugetlb: bool = False) -> Optional[str]:
    """None when one entry of an ``arena_dir`` list can take the arena, else why not (a few
    words): the directory it names (symbolic links resolved: the daemon then uses that path) must
    be the root of a tmpfs or hugetlbfs mount (such as /dev/shm or /run/moecached-arena; not the
    empty directory a mount that failed leaves, not a disk), hugetlbfs when ``hugetlb`` is set,
    owned by root or this user (no other user can swap the files in it) and writable by this user."""
    real = os.path.realpath(d)
    try:
        st = os.stat(real)
    except OSError:
        return "missing"
    if not os.path.isdir(real):
        return "not a directory"
    fstype = mount_fs_type(real)
    if fstype is None:
        return "not a mount point"
    if fstype not in ARENA_FS_TYPES:
        return f"a {fstype} mount, not tmpfs or hugetlbfs"
    if hugetlb and fstype != "hugetlbfs":
        return "not hugetlbfs (hugetlb = true)"
    if st.st_uid not in (0, os.geteuid()):
        return f"owned by uid {st.st_uid}"
    # nor can another user move it away and put a directory of its own at its path: every directory
    # above it belongs to root or this user, and is writable by no one else unless sticky (/tmp)
    up = os.path.dirname(real)
    while True:
        pst = os.stat(up)
        if pst.st_uid not in (0, os.geteuid()):
            return f"under {up}, owned by uid {pst.st_uid}"
        if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
            return f"under {up}, writable by other users"
        if up == "/":
            break
        up = os.path.dirname(up)
    if not os.access(real, os.W_OK | os.X_OK):
        return "not writable by this user"
    return None


def _where(cfg: Config, key: str) -> str:
    s = cfg.sources.get(key, "default")
    return s if s != "default" else (cfg.path or "configuration")


def _from_flag(cfg: Config, key: str, cli: bool) -> bool:
    return cli and cfg.sources.get(key) not in ("default", cfg.path)


def _at(cfg: Config, key: str, cli: bool, given: dict) -> str:
    """``where: key = value`` (or ``where: --flag value``), the value as it was written."""
    v = given.get(key, getattr(cfg, key))
    return _fmt(_where(cfg, key), key, v, _from_flag(cfg, key, cli))


def _cross_check(cfg: Config, cli: bool, given: dict) -> None:
    if cfg.budget is not None and cfg.slots is not None:
        raise ConfigError(f"{_where(cfg, 'slots')}: budget and slots are both set: expected only one of them")
    if cfg.endpoint.startswith("tcp://") and not cfg.allow_tcp:
        raise ConfigError(f"{_at(cfg, 'endpoint', cli, given)}: expected an ipc:// endpoint; tcp:// has no access "
                          "control and needs allow_tcp = true (or --allow-tcp)")
    if cfg.min_budget is not None and cfg.budget is not None and cfg.min_budget > cfg.budget:
        raise ConfigError(f"{_at(cfg, 'min_budget', cli, given)}: expected at most the budget ({cfg.budget} bytes)")


def _check_runnable(cfg: Config, cli: bool, given: dict) -> None:
    where = cfg.path or "configuration"
    if cfg.models:
        if cfg.model is not None:
            raise ConfigError(f"{where}: both model and [[models]] are set: expected one of them "
                              "(a model of its own is [[models]] name = ..., path = ...)")
        for m in cfg.models:
            if not os.path.isfile(m["path"]):
                why = "no such file" if not os.path.exists(m["path"]) else "not a regular file"
                raise ConfigError(f"{_where(cfg, 'models')}: model {m['name']}: path = "
                                  f"{json.dumps(m['path'])}: expected an existing GGUF file ({why})")
        if cfg.budget is None:
            raise ConfigError(f'{where}: several models need budget = "SIZE" (or --budget): '
                              "the one budget they share")
    elif cfg.model is None:
        raise ConfigError(f'{where}: model is not set: expected model = "/path/to/model.gguf" '
                          "in the config file or --model PATH")
    elif not os.path.isfile(cfg.model):
        why = "no such file" if not os.path.exists(cfg.model) else "not a regular file"
        raise ConfigError(f"{_at(cfg, 'model', cli, given)}: expected an existing GGUF file ({why})")
    if cfg.budget is None and cfg.slots is None:
        raise ConfigError(f'{where}: neither budget nor slots is set: expected budget = "SIZE" or slots = N '
                          "in the config file, or --budget / --slots")
    refused = cfg.arena_dir_refused
    if refused and all(refused.values()):
        why = ", ".join(f"{d}: {w}" for d, w in refused.items())
        raise ConfigError(f"{_at(cfg, 'arena_dir', cli, given)}: expected among them a "
                          f"{'hugetlbfs' if cfg.hugetlb else 'tmpfs or hugetlbfs'} mount point owned by root or "
                          f"this user and writable by it (none is: {why}); mount one (systemd/"
                          "run-moecached\\x2darena.mount) or add /dev/shm")
    if not os.path.isdir(cfg.arena_dir):
        raise ConfigError(f"{_at(cfg, 'arena_dir', cli, given)}: expected an existing directory")


# -- command line -------------------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--config`` and one flag per key (``--budget``, ``--floor``, ...; booleans get
    ``--x/--no-x``). Every default is None so only flags actually given override the file.
    Values are validated by :func:`config_from_args`, not by argparse."""
    g = parser.add_argument_group("configuration (flags override the config file)")
    g.add_argument("--config", metavar="PATH", default=None,
                   help=f"TOML config file (default {DEFAULT_PATH} if it exists)")
    for key, k in KEYS.items():
        if k.kind == "bool":
            g.add_argument(k.flag, dest=key, action=argparse.BooleanOptionalAction, default=None, help=k.help)
        elif k.kind == "list":
            continue   # models: --model NAME=PATH (see config_from_args)
        elif key == "model":
            g.add_argument(k.flag, dest=key, metavar=k.metavar, default=None, action="append",
                           help=k.help)
        else:
            g.add_argument(k.flag, dest=key, metavar=k.metavar, default=None, help=k.help)
    return parser


def config_from_args(args: argparse.Namespace, *, check_runnable: bool = True) -> Config:
    """The :class:`Config` for parsed ``args`` (from a parser given :func:`add_cli_args`)."""
    overrides = {k: getattr(args, k, None) for k in KEYS}
    given = overrides.get("model")
    if isinstance(given, list):   # --model PATH, or --model NAME=PATH per model
        named = [v for v in given if "=" in v and MODEL_NAME.fullmatch(v.split("=", 1)[0])]
        if len(given) == 1 and not named:
            overrides["model"] = given[0]
        elif len(named) == len(given):
            overrides["model"] = None
            overrides["models"] = [{"name": v.split("=", 1)[0], "path": v.split("=", 1)[1]}
                                   for v in given]
        else:
            raise ConfigError("command line: --model: expected one --model PATH, or "
                              "--model NAME=PATH for each of several models (NAME: letters, "
                              "digits, _ . -)")
    return load_config(getattr(args, "config", None), overrides, check_runnable=check_runnable,
                       origin="command line", cli=True)


# -- reload & dump ------------------------------------------------------------------------------

def reload_changes(old: Config, new: Config) -> tuple[dict, list]:
    """Compare two configs for SIGHUP: ``({key: (old, new)} a running daemon can apply,
    [keys that changed but need a restart])``. (``new`` read with ``load_config(running=old)``
    keeps the running arena's directory when its ``arena_dir`` list is the running one.)"""
    apply, restart = {}, []
    for k in KEYS:
        a, b = getattr(old, k), getattr(new, k)
        if a != b:
            if k in RELOADABLE:
                apply[k] = (a, b)
            else:
                restart.append(k)
    return apply, restart


def dump_toml(cfg: Config) -> str:
    """The settings as TOML (None values commented out), e.g. for ``--print-config``."""
    lines, tables = [], []
    for k in KEYS:
        v = getattr(cfg, k)
        if k == "models":   # [[models]] tables go last (TOML: after every top-level key)
            for m in v:
                tables += ["", "[[models]]"] + [
                    f'{f} = "{_human(m[f]).replace(" ", "")}"' if f.endswith("budget") else
                    f"{f} = {_show(m[f])}" for f in _MODEL_FIELDS if m.get(f) is not None]
            continue
        if k == "arena_dir" and cfg.arena_dir_choices:
            v = cfg.arena_dir_choices   # (the list as given, not the entry it resolved to)
        if v is None:
            lines.append(f"# {k} =")
        elif k in ("socket_mode", "arena_mode"):
            lines.append(f"{k} = 0o{v:03o}")
        elif KEYS[k].kind == "size":
            lines.append(f'{k} = "{_human(v).replace(" ", "")}"')
        else:
            lines.append(f"{k} = {_show(v)}")
        if k == "arena_dir" and cfg.arena_dir_choices:
            lines[-1] += f"   # takes {_show(cfg.arena_dir)}"
    return "\n".join(lines + tables) + "\n"
