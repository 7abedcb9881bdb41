"""``moecached``: the daemon's entry point (what ``systemctl start moecached`` runs).

    moecached --model PATH [--budget SIZE | --slots N] [--endpoint ipc://...] [--config FILE]

Start-up order: configuration (file + flags, validated) -> the endpoint's lock (a second daemon
on a live endpoint is refused here, having touched nothing) -> index of the model's experts ->
the arena checked against the memory cgroup limit and MemAvailable (refused, or sized down when
a floor is set) -> arena reserved and locked + readers -> ZeroMQ socket bound -> READY=1 to
systemd. Each stage logs one line as it begins (a live percentage on a terminal). A failure
at any step prints one line and exits 1 (systemd restarts it per the unit file). SIGTERM
stops gracefully (pending requests fail with ``shutdown``, socket and arena files removed);
SIGHUP re-reads the config file and applies what can change without a restart.

A model file that changes under the daemon is noticed at once and handled per
``on_model_change`` (exit with status 3, or re-index it under a new session):
``moecached.daemon.reload``. See docs/operations.md, "Model file changed".

The running daemon is one :class:`moecached.daemon.runtime.Daemon` built from the configuration.
"""
from __future__ import annotations

import argparse
import difflib
import sys

from moecached import MoecacheError, __version__
from moecached.daemon import config as C
from moecached.daemon.logs import setup_logging
from moecached.daemon.runtime import Daemon


#: options other daemons have, and this one's way to say the same
WHERE = {"--socket": "--endpoint ipc://PATH", "--unix-socket": "--endpoint ipc://PATH",
         "--listen": "--endpoint", "--port": "--endpoint tcp://HOST:PORT with --allow-tcp"}


def main(argv=None) -> int:
    # no abbreviations: "--socket PATH" must not be taken as --socket-mode (nor any prefix as a
    # longer option that sets something else)
    p = argparse.ArgumentParser(prog="moecached", allow_abbrev=False,
                                description="Expert cache daemon for mixture-of-experts models (see docs/operations.md)")
    p.add_argument("--version", action="version", version=f"moecached {__version__}")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration as TOML and exit")
    C.add_cli_args(p)
    args, unknown = p.parse_known_args(argv)
    if unknown:
        opt = next((u for u in unknown if u.startswith("-")), None)
        if opt is None:
            p.exit(2, f"moecached: error: unexpected argument {unknown[0]!r}: options only "
                      "(the model: --model PATH); moecached --help lists them\n")
        name = opt.split("=", 1)[0]
        near = WHERE.get(name) or next(iter(difflib.get_close_matches(
            name, [o for a in p._actions for o in a.option_strings], n=1)), None)
        p.exit(2, f"moecached: error: unknown option {name}" + (f" (did you mean {near}?)" if near else "")
                  + "; moecached --help lists them\n")
    try:
        cfg = C.config_from_args(args, check_runnable=not args.print_config)
    except MoecacheError as e:
        print(f"moecached: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(C.dump_toml(cfg), end="")
        return 0
    setup_logging(cfg.log_level)
    return Daemon(cfg).run()

