"""``moecache-ctl status | stats | trace``: talk to a running daemon.

Output is memcached-style ``STAT name value`` lines (``--json`` for scripts); ``stats`` prints
a short human summary (:func:`summary`) unless ``--all`` or ``--json`` asks for every counter.

The daemon's endpoint (:func:`resolve_endpoint`, shared by every command that talks to the
daemon): ``--endpoint`` > ``$MOECACHED_ENDPOINT`` > the ``endpoint`` key of the daemon's config
file (``/etc/moecached/moecached.toml``) > ``ipc:///run/moecached/moecached.sock``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from moecached import MoecacheError

#: environment variable naming the daemon's endpoint for ``moecache-ctl``
ENDPOINT_ENV = "MOECACHED_ENDPOINT"
ENDPOINT_HELP = (f"daemon endpoint (default: ${ENDPOINT_ENV}, else the endpoint of the daemon's "
                 f"config file, else ipc:///run/moecached/moecached.sock)")


def resolve_endpoint(flag: str | None = None) -> tuple[str, str]:
    """``(endpoint, where it came from)``: ``flag`` (``--endpoint``) if given, else
    ``$MOECACHED_ENDPOINT``, else the ``endpoint`` key of the daemon's config file (read by
    :func:`moecached.daemon.config.load_config`), else the built-in default. A config file that cannot
    be read or is invalid is skipped (the reason goes into the source, shown on failures).

    Raises:
        MoecacheError: the flag or the environment variable is not an endpoint.
    """
    from moecached.daemon.config import DEFAULT_ENDPOINT, KEYS, ConfigError, _Bad, load_config
    if flag is not None:
        value, where = flag, "--endpoint"
    elif os.environ.get(ENDPOINT_ENV):
        value, where = os.environ[ENDPOINT_ENV], f"${ENDPOINT_ENV}"
    else:
        try:
            cfg = load_config(None, check_runnable=False)
        except ConfigError as e:
            return DEFAULT_ENDPOINT, f"the built-in default; config file skipped: {e}"
        src = cfg.sources.get("endpoint", "default")
        return cfg.endpoint, ("the built-in default" if src == "default" else src)
    try:
        return KEYS["endpoint"].check(value), where
    except _Bad as e:
        raise MoecacheError(f"{where} {value!r}: expected {e.expected}") from None


def _client(endpoint: str, timeout: float, source: str = "--endpoint", model: str = "*"):
    """A ``Client`` for ``endpoint``; failures are one line naming the endpoint and ``source``
    (where it came from, see :func:`resolve_endpoint`). ``model``: the model to talk to when
    the daemon serves several (``*``: the endpoint's own, the daemon-wide view)."""
    try:
        from moecache_client import Client, ServerError
    except ImportError as e:  # pragma: no cover
        raise MoecacheError(f"moecache_client is not installed: {e}")
    try:
        return Client(endpoint, name="moecache-ctl", timeout=timeout, connect_timeout=timeout,
                      map_arena=False, model=model)
    except ServerError as e:   # reached: the daemon refused the hello (its line says why)
        raise MoecacheError(f"moecached at {endpoint} (endpoint from {source}): {e}") from None
    except Exception as e:
        raise MoecacheError(f"cannot reach moecached at {endpoint} (endpoint from {source}): {e}")


def _positive(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r}: expected seconds > 0") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{v!r}: expected seconds > 0")
    return x


def _parser(prog: str, desc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog=f"moecache-ctl {prog}", description=desc)
    p.add_argument("--endpoint", "-e", default=None, help=ENDPOINT_HELP)
    p.add_argument("--timeout", type=_positive, default=5.0, help="seconds to wait for the daemon")
    p.add_argument("--json", action="store_true", help="print JSON (every counter)")
    p.add_argument("--model", default="*", help="with several models: this model's own view "
                   "(default: the daemon's endpoint, with one line per model)")
    return p


def _endpoint_of(a: argparse.Namespace) -> tuple:
    endpoint, source = resolve_endpoint(a.endpoint)
    return endpoint, a.timeout, source, getattr(a, "model", "*")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) >= 1e5 else f"{v:.6g}"  # timestamps keep their precision
    if v is None:
        return "-"
    return str(v)


def _stat_lines(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _stat_lines(v, f"{prefix}{k}.")
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            names = [x.get("name") for x in v]
            for i, x in enumerate(v):
                tag = x.get("name", x.get("id", i))
                if "name" in x and names.count(x["name"]) > 1:
                    tag = f"{x['name']}#{x.get('id', i)}"  # same name twice: tell apart (ids differ at the end)
                out += _stat_lines(x, f"{prefix}{k}.{tag}.")
        elif isinstance(v, list):
            out.append(f"STAT {prefix}{k} {','.join(_fmt(x) for x in v)}")
        else:
            out.append(f"STAT {prefix}{k} {_fmt(v)}")
    return out


def _print(d: dict, as_json: bool) -> None:
    if as_json:
        json.dump(d, sys.stdout, indent=1, sort_keys=True, default=str)
        print()
    else:
        print("\n".join(_stat_lines(d)))
        print("END")


def status_main(argv) -> int:
    a = _parser("status", "one-screen status of a running moecached").parse_args(argv)
    c = _client(*_endpoint_of(a))
    try:
        _print(c.status(), a.json)
    finally:
        c.close()
    return 0


GiB = 1 << 30


def _gib(n) -> str:
    return f"{(n or 0) / GiB:.2f} GiB"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _ms(us) -> str:
    return "-" if us is None else f"{us / 1000:.2f} ms"


def _duration(s) -> str:
    s = int(s or 0)
    d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
    return f"{d}d{h:02d}h" if d else f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s"


def _floor_line(floor) -> list[str]:
    """The memory floor's line of the summary ([] while it is off): the budget (with several
    models, the total they split) it leaves of the configured one."""
    if not floor:
        return []
    return [f"floor     {_gib(floor.get('floor_bytes'))} ({_gib(floor.get('available'))} available): "
            f"budget {_gib(floor.get('current_budget'))} of {_gib(floor.get('configured_budget'))}, "
            f"{floor.get('shrinks', 0)} shrinks, {floor.get('grows', 0)} grows"]


def summary(st: dict, layers: bool = False) -> list[str]:
    """The short human view of a ``stats`` reply: hit rate, budget and use (GiB), the memory
    floor, reads, read latency, one line per client; per-layer lines when ``layers``."""
    from moecached.facts.stats import hit_rate
    budget = st.get("budget") or {}
    classes = st.get("classes") or []
    used = sum(x.get("used", 0) * x.get("slot_bytes", 0) for x in classes)
    cur, conf = budget.get("current_bytes"), budget.get("configured_bytes")
    lat = st.get("read_latency") or {}
    hits, pf, miss = st.get("hits", 0), st.get("prefetch_hits", 0), st.get("demand_misses", 0)
    clients = st.get("clients") or []
    out = [f"moecached {st.get('version', '?')}, pid {st.get('pid', '?')}, up {_duration(st.get('uptime_s'))}, "
           f"{st.get('endpoint', '?')}",
           f"hit rate  {_pct(hit_rate(hits, pf, miss))} ({hits} hits, {pf} prefetch hits, {miss} demand misses)",
           f"budget    {_gib(cur)}" + (f" (configured {_gib(conf)})" if cur != conf else "")
           + (f", used {_gib(used)} ({sum(x.get('used', 0) for x in classes)} of "
              f"{sum(x.get('slots', 0) for x in classes)} slots, {st.get('pinned', 0)} pinned)"
              if classes or not st.get("models") else   # the several-models endpoint: sums
              f", {sum(x.get('resident', 0) for x in st['models'])} of "
              f"{sum(x.get('slots', 0) for x in st['models'])} slots resident, "
              f"{st.get('pinned', 0)} pinned"),
           *_floor_line(st.get("floor")),
           f"reads     {st.get('reads', 0)} ({_gib(st.get('bytes_read'))}, {st.get('read_errors', 0)} errors, "
           f"{st.get('reads_in_flight', 0)} in flight), latency p50 {_ms(lat.get('p50_us'))}, "
           f"p99 {_ms(lat.get('p99_us'))}",
           f"clients   {len(clients)}" + (f" of yours, {st['clients_other']} of other users (an admin sees them)"
                                         if st.get("clients_other") else "")]
    for x in clients:
        out.append(f"  {x.get('name')} pid {x.get('pid')}: hit rate {_pct(x.get('hit_rate'))}, "
                   f"{x.get('acquires', 0)} acquires, {x.get('leases', 0)} leases, {x.get('pending', 0)} pending, "
                   f"stall {x.get('stall_s', 0):.2f} s, idle {x.get('idle_s', 0):.1f} s")
    models = st.get("models") or []
    if models:
        sp = st.get("split") or {}
        out.append(f"models    {len(models)} under one budget of {_gib(sp.get('total_bytes'))}, "
                   f"{sp.get('moves', 0)} moves of the split (step {_gib(sp.get('step_bytes'))})")
        for x in models:
            out.append(f"  {x['name']} ({x['state']}): share {_gib(x['share_bytes'])}, "
                       f"{x['resident']} of {x['slots']} slots resident, hit rate "
                       f"{_pct(x['hit_rate'])}, read {_gib(x['bytes_read'])}, {x['ghost_hits']} ghost "
                       f"hits, {x['clients']} clients, {x['leases']} leases"
                       + (f", {x['fast_pins']} slots pinned through shared memory"
                          if x.get("fast_pins") else ""))
    if layers:
        for name, x in (st.get("layers") or {}).items():
            out.append(f"layer {name}: hit rate {_pct(hit_rate(x['hits'], x['prefetch_hits'], x['demand_misses']))} "
                       f"({x['hits']} hits, {x['prefetch_hits']} prefetch hits, "
                       f"{x['demand_misses']} demand misses), {x['reads']} reads")
    return out


def stats_main(argv) -> int:
    p = _parser("stats", "counters of a running moecached: a short summary, or every counter "
                         "(--all as STAT lines, --json)")
    p.add_argument("--layers", action="store_true", help="add one line per layer to the summary")
    p.add_argument("--all", action="store_true", help="every counter as STAT lines")
    a = p.parse_args(argv)
    c = _client(*_endpoint_of(a))
    try:
        st = c.stats()
    finally:
        c.close()
    # leave out the ctl's own connection from the per-client list
    st["clients"] = [x for x in st.get("clients", []) if x.get("name") != "moecache-ctl"]
    if a.json or a.all:
        _print(st, a.json)
    else:
        print("\n".join(summary(st, a.layers)))
    return 0


def trace_main(argv) -> int:
    """``moecache-ctl trace start FILE | stop`` (``trace convert`` is routed to
    ``moecached.tools.tracetools`` before this)."""
    p = _parser("trace", "record the acquires a running daemon serves into a trace file "
                         "(docs/trace-format.md); 'trace convert IN.jsonl OUT.npz' converts logs")
    p.add_argument("action", choices=["start", "stop", "convert"],
                   help="start FILE | stop | convert IN.jsonl OUT.npz (see 'trace convert --help')")
    p.add_argument("file", nargs="?", help="output .npz (start)")
    p.add_argument("--client", help="record only this client's acquires")
    a = p.parse_args(argv)
    c = _client(*_endpoint_of(a))
    try:
        if a.action == "start":
            if not a.file:
                raise MoecacheError("trace start needs FILE")
            import os
            r = c.trace_start(os.path.abspath(a.file), a.client)
        else:
            r = c.trace_stop()
    except Exception as e:
        raise MoecacheError(str(e))
    finally:
        c.close()
    r = {k: v for k, v in r.items() if k in ("path", "info")}
    _print(r, a.json)
    return 0


def model_main(argv) -> int:
    """``moecache-ctl model list | add NAME PATH | remove NAME | rebalance``."""
    p = _parser("model", "the models a daemon serves under one budget: list them, add or "
                         "remove one live, or rebalance the split now")
    p.add_argument("action", choices=["list", "add", "remove", "rebalance"])
    p.add_argument("name", nargs="?", help="model name (add, remove)")
    p.add_argument("path", nargs="?", help="GGUF model file (add)")
    p.add_argument("--min-budget", help="add: the smallest share, e.g. 4GiB")
    p.add_argument("--max-budget", help="add: the largest share")
    p.add_argument("--weight", type=float, help="add: multiplies the model's gains (default 1)")
    a = p.parse_args(argv)
    from moecached.facts.units import parse_size
    fields: dict = {}
    if a.action in ("add", "remove") and not a.name:
        raise MoecacheError(f"model {a.action}: expected NAME" + (" PATH" if a.action == "add" else ""))
    if a.action == "add":
        if not a.path:
            raise MoecacheError("model add: expected NAME PATH")
        fields = {"name": a.name, "path": os.path.abspath(a.path)}
        for k in ("min_budget", "max_budget"):
            if getattr(a, k):
                fields[k] = parse_size(getattr(a, k))
        if a.weight is not None:
            fields["weight"] = a.weight
    elif a.action == "remove":
        fields = {"name": a.name}
    a.model = "*"
    c = _client(*_endpoint_of(a))
    try:
        r = c.models(a.action, **fields)
        if a.action == "add":   # indexed and started in the background: wait for it
            import time
            deadline = time.monotonic() + 600
            while True:
                sp = c.models()["split"]
                if a.name in (sp.get("failed") or {}):
                    raise MoecacheError(sp["failed"][a.name])
                if a.name not in (sp.get("adding") or []):
                    break
                if time.monotonic() > deadline:
                    raise MoecacheError(f"still adding {a.name} after 600 s (see the daemon's log)")
                time.sleep(0.2)
            m = next(x for x in c.models()["models"] if x["name"] == a.name)
            r = {"added": a.name, "endpoint": m["endpoint"], "share_bytes": m["share_bytes"]}
    except Exception as e:
        raise MoecacheError(f"model {a.action}: {e}")
    finally:
        c.close()
    r = {k: v for k, v in r.items() if k not in ("v", "id", "ok", "session")}
    if a.action == "list" and not a.json:
        if not r.get("models"):
            print("no model served now (add one: moecache-ctl model add NAME PATH)")
            return 0
        st = {"models": r.get("models"), "split": r.get("split")}
        print("\n".join(summary(st)[-len(r.get("models") or []) - 1:]))
        return 0
    _print(r, a.json)
    return 0
