"""``moecache-ctl``: control and tools.

Each subcommand lives in the module named for its concept and exposes ``main(argv) -> int``;
this dispatcher only routes, so modules stay independent.
"""
import importlib
import os
import sys

from moecached import MoecacheError, __version__

# name -> ("module", "function", one-line help)
COMMANDS = {
    "demo": ("moecached.tools.demo", "main", "write a scaled model, run the daemon, replay a workload, print results"),
    "inspect": ("moecached.tools.inspect", "main", "index the routed experts of a GGUF model (or split set)"),
    "synth": ("moecached.tools.synth", "main", "write a real-layout GGUF fixture with stamped expert bytes"),
    "status": ("moecached.tools.ctlstats", "status_main", "ask a running daemon for its status"),
    "stats": ("moecached.tools.ctlstats", "stats_main", "ask a running daemon for its counters"),
    "model": ("moecached.tools.ctlstats", "model_main", "list, add or remove the models a daemon serves under one budget"),
    "clients": ("moecached.tools.ctlclients", "clients_main", "list a running daemon's clients (id, pid, uid, leases, pins)"),
    "client": ("moecached.tools.ctlclients", "client_main", "client drop ID: release one client's leases and pins (admins)"),
    "trace": ("moecached.tools.tracetools", "main", "start/stop routing-trace recording in the daemon; convert JSONL logs"),
    "metrics": ("moecached.tools.metrics", "main", "serve the daemon's counters to Prometheus (HTTP exporter)"),
    "policy": ("moecached.tools.policycli", "main", "replay routing traces through cache policies (simulator)"),
    "replay": ("moecached.tools.replay", "main", "replay a routing trace against a live daemon"),
    "warm": ("moecached.tools.warm", "main", "fill a running daemon's cache from its state file or a trace"),
    "guard": ("moecached.tools.guard", "main", "run a command, kill it if MemAvailable falls under a floor"),
}


def usage() -> str:
    lines = ["usage: moecache-ctl COMMAND [ARGS...]", "", "commands:"]
    for name, (_, _, help_) in COMMANDS.items():
        lines.append(f"  {name:<9} {help_}")
    lines.append("")
    lines.append("moecache-ctl COMMAND --help for a command's options; moecache-ctl --version")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"moecache-ctl {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"moecache-ctl: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    modname, func, _ = COMMANDS[name]
    fn = getattr(importlib.import_module(modname), func)
    try:
        rc = fn(rest)
    except MoecacheError as e:
        print(f"moecache-ctl {name}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into head & co.
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
