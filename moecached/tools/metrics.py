"""``moecache-ctl metrics``: a Prometheus exporter for a running moecached (sidecar process).

Serves the Prometheus text format over HTTP (``prometheus_client``'s registry and server). Every
scrape asks the daemon for ``stats`` once, over one long-lived client connection, and turns the
reply into metric families (:class:`StatsCollector`). A daemon that cannot be reached does not
fail the scrape: it exposes ``moecached_up 0`` and nothing else. ``--once`` prints one scrape to
stdout and exits (tests, cron, a quick look).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time

from moecached import MoecacheError
from moecached.facts.stats import CACHE_STATS, CLASS_STATS, CLIENT_STATS, FAST_PATH_STATS, LAYER_STATS, SERVER_COUNTERS

CLIENT_NAME = "moecache-metrics"  # how the exporter's own connection shows in the daemon's stats
#: the name a client that gave none has (moecache_client: ``pid<its pid>``): labelled ``unnamed``
DEFAULT_NAME = re.compile(r"pid\d+")

# every declared counter and gauge (moecached.facts.stats) becomes one family; counters get ``_total``
# from prometheus_client.


def _prometheus():
    try:
        import prometheus_client
        import prometheus_client.core  # noqa: F401 (the *MetricFamily classes)
    except ImportError:
        raise MoecacheError("prometheus-client is not installed: pip install 'moecached[metrics]'") from None
    return prometheus_client


class StatsCollector:
    """``prometheus_client`` collector: one daemon ``stats`` request per ``collect()``.

    Metric names start with ``moecached_``; bytes are ``_bytes``, durations ``_seconds``,
    counters ``_total`` (values are counts since the daemon started, so they reset when it
    restarts). Families (labels in braces):

    * ``up`` 1 if the daemon answered this scrape, else 0 -- and then nothing else is exposed;
      ``info{version,model,policy}`` 1; ``tracing`` 1 while a routing trace is recorded;
      ``model_changed`` 1 while the model file differs from the one indexed.
    * one family per row declared in ``moecached.facts.stats``: ``CACHE_STATS`` and
      ``SERVER_COUNTERS`` (``server_*``), ``FAST_PATH_STATS`` (``fast_*``), ``CLASS_STATS``
      (``class_*{size_class}``), ``LAYER_STATS`` (``layer_*{layer}``) and ``CLIENT_STATS``
      (``client_*{client}``, by the name the client gave, ``unnamed`` for the clients that gave
      none (their default name carries their pid): no label takes a pid, so an engine that
      restarts adds no new series; the exporter's own connection left out; clients sharing a
      label are summed, ``idle_seconds`` the least); ``clients`` (connected, gauge).
    * gauges ``budget_configured_bytes``, ``budget_current_bytes``; reader pool: counters
      ``reader_chunk_reads``, ``reader_jobs``, gauge ``reader_queued_jobs{queue=demand|prefetch}``.
    * ``read_latency_seconds`` summary: ``_count``, ``_sum`` over the run, ``quantile`` 0.5 and
      0.99 over the last 8192 reads (absent before the first read); ``read_latency_max_seconds``.
      ``reader_job_latency_seconds`` histogram (the reader pool's fixed buckets, ``_count`` and
      ``_sum``).
    * memory floor, only while it is on: gauges ``floor_bytes``, ``floor_hysteresis_bytes``,
      ``floor_min_budget_bytes``, ``floor_available_bytes``, ``floor_at_min``; counters
      ``floor_{shrinks,grows,errors,reconfigures}`` (reconfigures: budget changes a SIGHUP made).

    Args:
        endpoint: the daemon's ZeroMQ endpoint.
        source: where the endpoint came from (see ``ctlstats.resolve_endpoint``), named in
            the line a failed scrape prints.
        timeout: seconds one scrape waits for the daemon (connect or reply).
    Raises:
        MoecacheError: prometheus-client is not installed. Errors reaching the daemon never
        raise: they give ``moecached_up 0`` (and one line on stderr when the error changes).
    """

    def __init__(self, endpoint: str, timeout: float = 2.0, source: str = "--endpoint"):
        self._core = _prometheus().core
        self.endpoint, self.timeout, self.source = endpoint, timeout, source
        self._client = None
        self._lock = threading.Lock()  # concurrent scrapes share one connection
        self._last_error = None

    def close(self) -> None:
        """Drop the connection to the daemon (the next scrape opens a new one)."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None

    def fetch(self) -> dict | None:
        """The daemon's ``stats`` reply, or None if it cannot be reached within ``timeout``
        (scrapes at once share one connection: one waiting behind another gives up, and
        reports the daemon down, when its own ``timeout`` has passed)."""
        if not self._lock.acquire(timeout=self.timeout):
            return None
        try:
            try:
                if self._client is None:
                    from moecache_client import Client
                    self._client = Client(self.endpoint, name=CLIENT_NAME, timeout=self.timeout,
                                          connect_timeout=self.timeout, map_arena=False,
                                          model="*")
                st = self._client.stats()
            except Exception as e:  # down, restarted, timed out: reconnect on the next scrape
                self._drop()
                msg = (f"moecache-ctl metrics: cannot reach moecached at {self.endpoint} "
                       f"(endpoint from {self.source}): {e}")
                if msg != self._last_error:
                    print(msg, file=sys.stderr, flush=True)
                self._last_error = msg
                return None
            self._last_error = None
            return st
        finally:
            self._lock.release()

    def collect(self):
        """Yield the metric families of one scrape (see the class docstring)."""
        core = self._core
        st = self.fetch()
        up = core.GaugeMetricFamily("moecached_up", "1 if moecached answered this scrape, else 0")
        up.add_metric([], 0 if st is None else 1)
        yield up
        if st is None:
            return
        yield from self._families(st)

    def _families(self, st: dict):
        core = self._core

        def single(kind, name, help_, value):
            if not isinstance(value, (int, float)):  # absent or None: left out
                return None
            f = self._family(kind)(f"moecached_{name}", help_)
            f.add_metric([], float(value))
            return f

        info = core.InfoMetricFamily("moecached", "the daemon instance")
        info.add_metric([], {k: str(st.get(k, "")) for k in ("version", "model", "policy")})
        out = [info, single("gauge", "tracing", "1 while a routing trace is recorded", bool(st.get("tracing"))),
               single("gauge", "model_changed", "1 while the model file differs from the one indexed "
                      "(misses fail with model_changed)", bool(st.get("model_changed")))]
        for row in CACHE_STATS:
            out.append(single(row.kind, row.metric, row.help, st.get(row.key)))
        for key in ("configured", "current"):
            v = (st.get("budget") or {}).get(f"{key}_bytes")
            out.append(single("gauge", f"budget_{key}_bytes", f"cache budget, {key}", v))
        server, fp = st.get("server") or {}, st.get("fast_path") or {}
        for row in SERVER_COUNTERS:
            out.append(single(row.kind, row.metric, row.help, server.get(row.key, 0)))
        for row in FAST_PATH_STATS:
            out.append(single(row.kind, row.metric, row.help, fp.get(row.key)))
        out += self._latency(st.get("read_latency") or {}, st.get("readers") or {})
        out += self._classes(st.get("classes") or [])
        out += self._layers(st.get("layers") or {})
        out += self._clients(st.get("clients") or [])
        if isinstance(st.get("floor"), dict):
            out += self._floor(st["floor"])
        if isinstance(st.get("models"), list):
            out += self._models(st["models"])
        return [f for f in out if f is not None]

    def _latency(self, lat: dict, rd: dict):
        core, out = self._core, []
        s = core.SummaryMetricFamily("moecached_read_latency_seconds",
                                     "expert read latency; quantiles over the last 8192 reads")
        n = int(lat.get("count") or 0)
        s.add_metric([], n, (lat.get("mean_us") or 0.0) * n / 1e6)
        for q in ("50", "99"):
            v = lat.get(f"p{q}_us")
            if v is not None:
                s.add_sample(s.name, {"quantile": str(int(q) / 100)}, v / 1e6)
        out.append(s)
        if lat.get("max_us") is not None:
            g = core.GaugeMetricFamily("moecached_read_latency_max_seconds", "slowest expert read")
            g.add_metric([], lat["max_us"] / 1e6)
            out.append(g)
        if rd:
            for key, name, help_ in (("reads", "reader_chunk_reads", "chunk reads issued by the reader pool"),
                                     ("jobs", "reader_jobs", "read jobs the reader pool finished")):
                if key in rd:
                    c = core.CounterMetricFamily(f"moecached_{name}", help_)
                    c.add_metric([], rd[key])
                    out.append(c)
            q = core.GaugeMetricFamily("moecached_reader_queued_jobs", "read jobs not started yet",
                                       labels=["queue"])
            for k in ("demand", "prefetch"):
                q.add_metric([k], rd.get(f"queued_{k}", 0))
            out.append(q)
            edges, hist = rd.get("latency_edges_s"), rd.get("latency_hist")
            if edges and hist and len(hist) == len(edges) + 1:
                acc, buckets = 0, []
                for le, c in zip([repr(float(e)) for e in edges] + ["+Inf"], hist):
                    acc += c
                    buckets.append((le, acc))
                h = core.HistogramMetricFamily("moecached_reader_job_latency_seconds",
                                               "read job latency in the reader pool")
                h.add_metric([], buckets, rd.get("latency_sum_s"))
                out.append(h)
        return out

    def _family(self, kind: str):
        return self._core.CounterMetricFamily if kind == "counter" else self._core.GaugeMetricFamily

    def _labelled(self, rows, labels: list, entries):
        """One family per declared row of ``rows``, labelled ``labels``; ``entries``: (label
        values, stats dict) pairs, each adding its sample where the row's key is in its dict."""
        out = []
        for row in rows:
            f = self._family(row.kind)(f"moecached_{row.metric}", row.help, labels=labels)
            for lab, d in entries:
                if row.key in d:
                    f.add_metric(lab, d[row.key])
            out.append(f)
        return out

    def _classes(self, classes: list):
        return self._labelled(CLASS_STATS, ["size_class"], [([str(c.get("id"))], c) for c in classes])

    def _layers(self, layers: dict):
        return self._labelled(LAYER_STATS, ["layer"],
                              [([str(layer)], d) for layer, d in sorted(layers.items(), key=lambda kv: int(kv[0]))])

    def _clients(self, clients: list):
        core = self._core
        merged: dict[tuple, dict] = {}
        for c in clients:
            if (c.get("name"), str(c.get("pid"))) == (CLIENT_NAME, str(os.getpid())):
                continue  # this exporter
            name = str(c.get("name") or "")
            lab = ("unnamed" if not name or DEFAULT_NAME.fullmatch(name) else name,)
            m = merged.setdefault(lab, {})
            for k, v in c.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "pid":
                    m[k] = min(m[k], v) if k == "idle_s" and k in m else m.get(k, 0) + v
        n = core.GaugeMetricFamily("moecached_clients", "clients connected now (the exporter not counted)")
        n.add_metric([], sum(1 for c in clients
                             if (c.get("name"), str(c.get("pid"))) != (CLIENT_NAME, str(os.getpid()))))
        return [n] + self._labelled(CLIENT_STATS, ["client"], [(list(lab), m) for lab, m in merged.items()])

    def _models(self, models: list):
        """Several models under one budget: per model ``{model}``."""
        core = self._core
        out = []
        for kind, key, name, help_ in (
                ("g", "share_bytes", "model_share_bytes", "the model's share of the budget (the split's)"),
                ("g", "budget_current_bytes", "model_budget_current_bytes", "the model's arena bytes in use as slots now"),
                ("g", "slots", "model_slots", "the model's slots at its share"),
                ("g", "resident", "model_resident_slots", "the model's slots holding experts now"),
                ("c", "hits", "model_hits", "hits of the model's clients"),
                ("c", "prefetch_hits", "model_prefetch_hits", "prefetch hits of the model's clients"),
                ("c", "demand_misses", "model_demand_misses", "demand misses of the model's clients"),
                ("c", "ghost_hits", "model_ghost_hits", "misses one more step of budget would have made hits"),
                ("c", "bytes_read", "model_read_bytes", "bytes read from the model's files")):
            f = (core.CounterMetricFamily if kind == "c" else core.GaugeMetricFamily)(
                f"moecached_{name}", help_, labels=["model"])
            for m in models:
                if isinstance(m.get(key), (int, float)):
                    f.add_metric([str(m["name"])], m[key])
            out.append(f)
        return out

    def _floor(self, fl: dict):
        core = self._core
        out = []
        for key, name, help_ in (("floor_bytes", "floor_bytes", "memory floor: available memory kept free"),
                                 ("hysteresis_bytes", "floor_hysteresis_bytes", "grow back above floor + this"),
                                 ("min_budget", "floor_min_budget_bytes", "the floor never shrinks the cache below"),
                                 ("available", "floor_available_bytes", "available memory at the last sample"),
                                 ("at_min", "floor_at_min", "1 while the cache is at its minimum budget")):
            v = fl.get(key)
            if isinstance(v, (int, float)):
                g = core.GaugeMetricFamily(f"moecached_{name}", help_)
                g.add_metric([], float(v))
                out.append(g)
        for key in ("shrinks", "grows", "errors", "reconfigures"):
            if isinstance(fl.get(key), (int, float)):
                c = core.CounterMetricFamily(f"moecached_floor_{key}", f"memory floor {key}")
                c.add_metric([], fl[key])
                out.append(c)
        return out


def _listen(v: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6ADDR]:PORT`` or ``:PORT`` (all IPv4 interfaces) -> (host, port)."""
    host, sep, port = v.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        port = ""  # a bare IPv6 address: ambiguous
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{v!r}: expected HOST:PORT or :PORT (port 1-65535)")
    return host or "0.0.0.0", int(port)


def main(argv) -> int:
    """``moecache-ctl metrics``: serve the exporter until killed (or ``--once``). Returns 0.

    Raises:
        MoecacheError: prometheus-client missing, or the listen address cannot be bound.
    """
    from moecached.tools.ctlstats import ENDPOINT_HELP, _positive, resolve_endpoint
    p = argparse.ArgumentParser(allow_abbrev=False, prog="moecache-ctl metrics",
                                description="Prometheus exporter: serves the daemon's counters at "
                                            "http://LISTEN/metrics, one stats request per scrape")
    p.add_argument("--endpoint", "-e", default=None, help=ENDPOINT_HELP)
    p.add_argument("--listen", type=_listen, default="127.0.0.1:9464",
                   help="HOST:PORT, [V6ADDR]:PORT or :PORT (all IPv4 interfaces) to serve on (default %(default)s)")
    p.add_argument("--timeout", type=_positive, default=2.0, help="seconds per scrape to wait for the daemon")
    p.add_argument("--once", action="store_true", help="print one scrape to stdout and exit")
    a = p.parse_args(argv)
    a.endpoint, source = resolve_endpoint(a.endpoint)
    pc = _prometheus()
    registry = pc.CollectorRegistry(auto_describe=False)
    collector = StatsCollector(a.endpoint, a.timeout, source)
    registry.register(collector)
    if a.once:
        try:
            sys.stdout.write(pc.generate_latest(registry).decode())
        finally:
            collector.close()
        return 0
    host, port = a.listen
    try:
        pc.start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise MoecacheError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    shown = f"[{host}]" if ":" in host else host   # an IPv6 address in a URL takes brackets
    print(f"moecache-ctl metrics: serving http://{shown}:{port}/metrics for {a.endpoint} (from {source})",
          file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        collector.close()
