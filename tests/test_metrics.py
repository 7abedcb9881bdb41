"""``moecache-ctl metrics``: the Prometheus exporter against a real daemon."""
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from daemon_util import start_daemon, stop_daemon  # noqa: E402
from moecache_client import Client  # noqa: E402
from moecached.tools.metrics import StatsCollector, _listen  # noqa: E402

CTL = [sys.executable, "-P", "-m", "moecached.tools.ctl", "metrics"]


@pytest.fixture
def model(model_factory):
    # real Qwen3-30B-A3B Q4_K_M sizes; these blocks give two slot-size classes
    return model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 7, 8], experts=8)


def samples(text: str) -> dict:
    """{(sample name, ((label, value), ...)): value} of a Prometheus text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def work(c: Client, experts) -> None:
    """One acquire per expert layer of ``experts``, released at once."""
    for layer in c.expert_layers:
        c.acquire(layer, experts).release()


def test_collector_matches_daemon_stats(model, tmp_path):
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "32", "--floor", "1MiB")
    try:
        # no pings during the test: the engine's request count stays put between the two reads
        with Client(f"ipc://{sock}", name="engine-a", heartbeat_s=600, map_arena=False) as eng:
            work(eng, [1, 2])      # misses
            work(eng, [1, 2, 3])   # hits + one miss per layer
            with Client(f"ipc://{sock}", name="watch", heartbeat_s=600, map_arena=False) as w:
                st = w.stats()
            reg = CollectorRegistry(auto_describe=False)
            col = StatsCollector(f"ipc://{sock}", timeout=5)
            reg.register(col)
            try:
                m = samples(generate_latest(reg).decode())
            finally:
                col.close()
            once = subprocess.run(CTL + ["--once", "-e", f"ipc://{sock}"], capture_output=True,
                                  text=True, timeout=60)
    finally:
        stop_daemon(d)
    assert m[("moecached_up", ())] == 1
    assert st["hits"] > 0 and st["demand_misses"] > 0
    assert m[("moecached_hits_total", ())] == st["hits"]
    assert m[("moecached_demand_misses_total", ())] == st["demand_misses"]
    assert m[("moecached_prefetch_hits_total", ())] == st["prefetch_hits"]
    assert m[("moecached_read_bytes_total", ())] == st["bytes_read"]
    assert m[("moecached_reads_total", ())] == st["reads"]
    assert m[("moecached_evictions_total", ())] == st["evictions"]
    # `leases` is the cache's granted counter (2 x 4 layers, all released), not open leases
    assert st["leases"] == 2 * len(st["layers"]) and st["leases_open"] == st["leases_held"] == 0
    assert m[("moecached_leases_total", ())] == st["leases"]
    assert m[("moecached_budget_configured_bytes", ())] == st["budget"]["configured_bytes"]
    assert m[("moecached_read_latency_seconds_count", ())] == st["read_latency"]["count"]
    assert len(st["classes"]) == 2
    for c in st["classes"]:
        lab = (("size_class", str(c["id"])),)
        assert m[("moecached_class_slots", lab)] == c["slots"]
        assert m[("moecached_class_used_slots", lab)] == c["used"]
        assert m[("moecached_class_slot_size_bytes", lab)] == c["slot_bytes"]
    for layer, x in st["layers"].items():
        assert m[("moecached_layer_hits_total", (("layer", layer),))] == x["hits"]
    (eng_st,) = [x for x in st["clients"] if x["name"] == "engine-a"]
    lab = (("client", "engine-a"),)
    assert m[("moecached_client_requests_total", lab)] == eng_st["requests"]
    assert m[("moecached_client_hits_total", lab)] == eng_st["hits"]
    assert m[("moecached_client_demand_misses_total", lab)] == eng_st["demand_misses"]
    for key in ("prefetches_dropped", "rate_limited"):
        assert m[(f"moecached_client_{key}_total", lab)] == eng_st[key]
    assert m[("moecached_client_prefetch_loads_in_flight", lab)] == eng_st["prefetch_loads_in_flight"]
    assert m[("moecached_server_rate_limited_total", ())] == st["server"].get("rate_limited", 0)
    assert m[("moecached_floor_bytes", ())] == 1 << 20
    assert m[("moecached_reader_job_latency_seconds_sum", ())] == pytest.approx(st["readers"]["latency_sum_s"], rel=0.5)
    assert st["readers"]["latency_sum_s"] > 0
    # the exporter leaves its own connection out
    assert not [k for k in m if k[0].startswith("moecached_client_") and ("client", "moecache-metrics") in k[1]]
    assert once.returncode == 0, once.stderr
    m1 = samples(once.stdout)
    assert m1[("moecached_up", ())] == 1
    assert m1[("moecached_hits_total", ())] == st["hits"]


def test_http_exporter_counts_up_and_follows_daemon_restart(model, tmp_path):
    sock = str(tmp_path / "d.sock")
    d = start_daemon(model, sock, "--slots", "32")
    port = free_port()
    exp = subprocess.Popen(CTL + ["-e", f"ipc://{sock}", "--listen", f"127.0.0.1:{port}"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/metrics"

    def scrape():
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            return samples(r.read().decode())

    try:
        deadline = time.time() + 30
        while True:
            try:
                first = scrape()
                break
            except OSError:
                assert exp.poll() is None, exp.communicate()
                assert time.time() < deadline, "exporter did not come up"
                time.sleep(0.1)
        with Client(f"ipc://{sock}", name="engine-b", map_arena=False) as eng:
            work(eng, [0, 1])
            work(eng, [0, 1, 4])
            n_acquires = 2 * len(eng.expert_layers)
            second = scrape()
        stop_daemon(d)
        gone = scrape()
        assert exp.poll() is None  # a vanished daemon does not end the exporter
        d = start_daemon(model, sock, "--slots", "32")  # restarted: the exporter reconnects
        deadline = time.time() + 20
        while (back := scrape())[("moecached_up", ())] != 1 and time.time() < deadline:
            time.sleep(0.2)
    finally:
        stop_daemon(d)
        exp.terminate()
        exp.wait(10)
    assert first[("moecached_up", ())] == 1 and second[("moecached_up", ())] == 1
    for name in ("moecached_hits_total", "moecached_demand_misses_total", "moecached_read_bytes_total",
                 "moecached_reads_total"):
        assert second[(name, ())] > first[(name, ())], name
    lab = (("client", "engine-b"),)
    assert second[("moecached_client_acquires_total", lab)] == n_acquires
    assert second[("moecached_clients", ())] == 1
    assert gone == {("moecached_up", ()): 0}
    assert back[("moecached_up", ())] == 1 and back[("moecached_hits_total", ())] == 0


def test_once_without_daemon_reports_down(tmp_path):
    r = subprocess.run(CTL + ["--once", "-e", f"ipc://{tmp_path}/nothing.sock"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert samples(r.stdout) == {("moecached_up", ()): 0}
    assert len(r.stderr.strip().splitlines()) == 1 and "nothing.sock" in r.stderr


def test_listen_values():
    assert _listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert _listen(":9100") == ("0.0.0.0", 9100)
    assert _listen("[::1]:80") == ("::1", 80)
    for bad in ("9464", "host:", "host:0", "host:70000", "::1:80", "h:x"):
        with pytest.raises(Exception, match="HOST:PORT"):
            _listen(bad)


def test_bad_listen_is_one_line_error(tmp_path):
    r = subprocess.run(CTL + ["--listen", "nonsense"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--listen" in r.stderr.strip().splitlines()[-1] and "HOST:PORT" in r.stderr
    with socket.socket() as busy:  # a port that is taken: exit 1, one line
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = subprocess.run(CTL + ["--listen", f"127.0.0.1:{busy.getsockname()[1]}",
                                  "-e", f"ipc://{tmp_path}/nothing.sock"],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "cannot listen" in r.stderr


def test_declared_stats_reach_every_view_and_the_docs(model, tmp_path, capsys):
    """Each counter and gauge declared in moecached.facts.stats is in the daemon's stats reply (at its
    table's place), in ``moecache-ctl stats --all`` as a STAT line, in the exporter's families
    under its declared name, kind and labels, and both its stat key and metric name are in
    docs/operations.md. The expectations come from the declarations: a new row that misses a
    view fails here. The reply's numeric keys at each place are all declared."""
    import re
    from pathlib import Path
    from daemon_util import Daemon
    from moecached.facts import stats as S
    from moecached.tools.ctlstats import stats_main
    with Daemon(model, tmp_path) as d:
        with Client(d.endpoint, name="engine", map_arena=False, heartbeat_s=600) as c:
            work(c, [1, 2])
            st = d.server.stats()
            assert stats_main(["-e", d.endpoint, "--all"]) == 0
    lines = set(capsys.readouterr().out.splitlines())
    (eng,) = [x for x in st["clients"] if x["name"] == "engine"]
    cls, (layer, lay) = st["classes"][0], next(iter(st["layers"].items()))
    # table -> (the reply's dict, STAT line prefix, labels of its families)
    places = {S.CACHE_STATS: (st, "", ()), S.SERVER_COUNTERS: (st["server"], "server.", ()),
              S.FAST_PATH_STATS: (st["fast_path"], "fast_path.", ()),
              S.CLASS_STATS: (cls, f"classes.{cls['id']}.", ("size_class",)),
              S.LAYER_STATS: (lay, f"layers.{layer}.", ("layer",)),
              S.CLIENT_STATS: (eng, "clients.engine.", ("client",))}
    assert set(places) == {getattr(S, n) for n in S.__all__ if n.isupper()}, "a declared table has no place here"
    fams = {f.name: (f.type, {tuple(sorted(x.labels)) for x in f.samples})
            for f in StatsCollector("ipc:///nonexistent")._families(st)}
    doc = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    stat_rows = doc[doc.index("## What each stat means"):doc.index("## Prometheus metrics")]
    metric_rows = doc[doc.index("## Prometheus metrics"):]
    numeric = (int, float)
    for table, (reply, prefix, labels) in places.items():
        keys = {s.key for s in table}
        assert len(keys) == len(table), f"a key declared twice in {[s.key for s in table]}"
        if table is not S.CACHE_STATS:   # the top level also holds the nested places
            extra = {k for k, v in reply.items() if isinstance(v, numeric) and not isinstance(v, bool)}
            assert extra - keys <= {"id", "pid", "hit_rate"}, f"{prefix}: undeclared {extra - keys}"
        for s in table:
            assert s.kind in ("counter", "gauge"), s
            assert s.key in reply, f"{prefix}{s.key} not in the stats reply"
            assert any(line.startswith(f"STAT {prefix}{s.key} ") for line in lines), \
                f"STAT {prefix}{s.key} not in moecache-ctl stats --all"
            kind, seen = fams.get(f"moecached_{s.metric}", (None, set()))
            assert kind == s.kind, (s.metric, kind)
            assert seen == {tuple(sorted(labels))}, (s.metric, seen)
            assert re.search(rf"`{s.key}`", stat_rows), f"stat {prefix}{s.key} not in docs/operations.md"
            shown = s.metric + ("_total" if s.kind == "counter" else "")
            assert re.search(rf"`{shown}`", metric_rows), f"metric {shown} not in docs/operations.md"


def test_no_label_takes_a_pid_and_the_histogram_has_its_sum():
    """Engines that restart (a new pid each time) add no new series: clients are labelled by
    the name they gave, those that gave none (``pid<N>``) as ``unnamed``; the reader pool's
    job latency histogram carries ``_sum`` beside its buckets."""
    pytest.importorskip("prometheus_client")
    from moecached.tools.metrics import StatsCollector
    clients = [{"name": "pid101", "pid": 101, "acquires": 2}, {"name": "pid202", "pid": 202, "acquires": 3},
               {"name": "engine-a", "pid": 303, "acquires": 5}]
    readers = {"latency_edges_s": [0.001, 0.01], "latency_hist": [4, 2, 1], "latency_sum_s": 0.125,
               "reads": 7, "jobs": 7}
    fams = StatsCollector("ipc:///nonexistent")._families({"clients": clients, "readers": readers})
    samples = [(s.name, s.labels, s.value) for f in fams if f is not None for s in f.samples]
    assert not [s for s in samples if "pid" in s[1]], "a label takes a pid"
    acq = {s[1]["client"]: s[2] for s in samples if s[0] == "moecached_client_acquires_total"}
    assert acq == {"unnamed": 5, "engine-a": 5}
    hist = {s[0]: s[2] for s in samples if s[0].startswith("moecached_reader_job_latency_seconds")}
    assert hist["moecached_reader_job_latency_seconds_sum"] == 0.125
    assert hist["moecached_reader_job_latency_seconds_count"] == 7
