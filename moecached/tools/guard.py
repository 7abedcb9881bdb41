"""Memory-floor guard: ``moecache-ctl guard --floor SIZE [--interval S] -- CMD [ARGS...]``.

Runs ``CMD`` in its own session and process group, samples available memory every
``--interval`` seconds, and when it falls under ``--floor`` sends SIGTERM to the whole group,
SIGKILL after ``--grace`` seconds, and exits with :data:`EXIT_FLOOR` (75) after printing one line
to stderr::

    moecache-ctl guard: available memory 1.90 GiB (MemAvailable) fell under the floor 2.00 GiB (by 102.4 MiB); killed process group 4242: python3 load.py

Exit status:

* the command's own exit status when it ends by itself (``128 + N`` when killed by signal N,
  as shells report it);
* ``75`` (:data:`EXIT_FLOOR`, sysexits' EX_TEMPFAIL: "try again when memory is free") when the
  guard killed it, or refused to start it because memory was already under the floor;
* ``127`` when the command is not found, ``126`` when it cannot be executed;
* ``2`` for a usage error.

"Available" is :class:`MemoryProbe`'s figure: the smaller of the kernel's MemAvailable (via
``psutil.virtual_memory().available``; never MemFree, which ignores reclaimable page cache)
and, inside a memory-limited cgroup, the cgroup's headroom. Shared memory (tmpfs, /dev/shm,
the moecached arena) is not reclaimable, so it is never counted as available.

:class:`MemoryProbe` lives in :mod:`moecached.daemon.floor`, the daemon's core: the daemon's
:class:`~moecached.daemon.floor.MemoryFloor` and its start-up check sample the same figure.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from moecached.daemon.floor import MemoryProbe, MemorySample
from moecached.facts.units import SizeError, format_bytes, parse_size

__all__ = ["EXIT_FLOOR", "MemoryProbe", "MemorySample", "GuardResult", "run_guarded", "main"]

#: Exit status when the guard killed the command (or refused to start it) for lack of memory.
EXIT_FLOOR = 75

@dataclass
class GuardResult:
    """What :func:`run_guarded` did: ``returncode`` is the guard's exit status."""
    returncode: int
    killed: bool = False
    sample: Optional[MemorySample] = None
    pid: Optional[int] = None
    message: str = ""


def _one_line(text: str, limit: int = 300) -> str:
    """The command as shown in messages: newlines escaped, long ones cut with an ellipsis."""
    text = text.replace("\n", "\\n").replace("\r", "\\r")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _status_to_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def run_guarded(cmd: list[str], floor: int, *, interval: float = 0.2, grace: float = 3.0,
                probe: Optional[MemoryProbe] = None, stderr=None,
                on_start: Optional[Callable[[int], None]] = None) -> GuardResult:
    """Run ``cmd`` under the memory floor; see the module docstring for exit statuses.

    ``floor`` is bytes, ``interval`` and ``grace`` are seconds. ``probe`` is anything with a
    ``sample() -> MemorySample`` method (default :class:`MemoryProbe`). SIGINT, SIGTERM and
    SIGHUP sent to the guard are forwarded to the command's process group. ``on_start(pid)``
    is called once the command is running (tests).
    """
    stderr = sys.stderr if stderr is None else stderr
    probe = MemoryProbe() if probe is None else probe
    shown = _one_line(shlex.join(cmd))

    def say(msg: str) -> None:
        print(f"moecache-ctl guard: {msg}", file=stderr, flush=True)

    s = probe.sample()
    if s.available < floor:
        msg = (f"available memory {format_bytes(s.available, precision=2)} ({s.source}) is already under the floor "
               f"{format_bytes(floor, precision=2)}; not starting: {shown}")
        say(msg)
        return GuardResult(EXIT_FLOOR, False, s, None, msg)

    try:
        proc = subprocess.Popen(cmd, start_new_session=True)
    except FileNotFoundError:
        msg = f"command not found: {cmd[0]}"
        say(msg)
        return GuardResult(127, message=msg)
    except PermissionError:
        msg = f"cannot execute: {cmd[0]}"
        say(msg)
        return GuardResult(126, message=msg)
    except OSError as e:
        msg = f"cannot execute {cmd[0]}: {e.strerror or e}"
        say(msg)
        return GuardResult(126, message=msg)
    pgid = proc.pid  # start_new_session: the child leads its own session and process group

    forwarded = []
    old_handlers = {}

    def forward(signum, _frame):
        forwarded.append(signum)
        _kill_group(pgid, signum)

    in_main_thread = _is_main_thread()
    if in_main_thread:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old_handlers[sig] = signal.signal(sig, forward)
    try:
        if on_start:
            on_start(proc.pid)
        while True:
            try:
                rc = proc.wait(timeout=interval)
                return GuardResult(_status_to_code(rc), False, None, proc.pid)
            except subprocess.TimeoutExpired:
                pass
            s = probe.sample()
            if s.available >= floor:
                continue
            # under the floor: stop the whole group, hard after the grace period
            _kill_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and _group_alive(pgid):
                if proc.poll() is None:
                    try:
                        proc.wait(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
                    except subprocess.TimeoutExpired:
                        pass
                else:
                    time.sleep(0.05)
            _kill_group(pgid, signal.SIGKILL)
            proc.wait()
            msg = (f"available memory {format_bytes(s.available, precision=2)} ({s.source}) fell under the floor "
                   f"{format_bytes(floor, precision=2)} (by {format_bytes(floor - s.available)}); killed process group {pgid}: {shown}")
            say(msg)
            return GuardResult(EXIT_FLOOR, True, s, proc.pid, msg)
    finally:
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
        if proc.poll() is None:  # an exception escaped: do not leave the command unguarded
            _kill_group(pgid, signal.SIGKILL)
            proc.wait()


def _is_main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False,
        prog="moecache-ctl guard",
        description="Run CMD in its own process group; kill the group when available memory "
                    "(min of MemAvailable and the cgroup's headroom) falls under --floor.",
        epilog=f"exit status: CMD's own (128+N if killed by signal N); {EXIT_FLOOR} if the guard "
               "killed it or refused to start it for lack of memory; 126/127 if CMD cannot be "
               "executed / is not found; 2 for usage errors.")
    p.add_argument("--floor", required=True, metavar="SIZE",
                   help="kill the command when available memory falls under SIZE (e.g. 8GiB, 512M)")
    p.add_argument("--interval", type=float, default=0.2, metavar="S",
                   help="seconds between memory samples (default 0.2)")
    p.add_argument("--grace", type=float, default=3.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL (default 3)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")
    return p


def main(argv=None) -> int:
    """Entry point of ``moecache-ctl guard``; returns the exit status (see module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = _parser()
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    cmd = args.cmd
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        p.print_usage(sys.stderr)
        print("moecache-ctl guard: error: no command given (put it after --)", file=sys.stderr)
        return 2
    try:
        floor = parse_size(args.floor, what="--floor")
    except SizeError as e:
        print(f"moecache-ctl guard: error: {e}", file=sys.stderr)
        return 2
    if not (args.interval > 0):
        print(f"moecache-ctl guard: error: --interval {args.interval}: expected seconds > 0", file=sys.stderr)
        return 2
    if not (args.grace >= 0):
        print(f"moecache-ctl guard: error: --grace {args.grace}: expected seconds >= 0", file=sys.stderr)
        return 2
    return run_guarded(cmd, floor, interval=args.interval, grace=args.grace).returncode


if __name__ == "__main__":
    sys.exit(main())
