"""Slots pinned through shared memory are visible: per client, in total, in status and to the
Prometheus exporter (they were invisible: with 4 slots pinned through shared memory, stats said
0 pinned, since only socket leases counted)."""
import pytest

import moecache_client
from moecache_client import Client

from daemon_util import Daemon

pytestmark = pytest.mark.skipif(moecache_client.IMPLEMENTATION != "cython",
                                reason="the shared-memory hit path needs the compiled client")


def test_fast_path_pins_show_in_stats_status_and_metrics(model_factory, tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest
    from moecached.tools.metrics import StatsCollector
    with Daemon(model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8), tmp_path) as d, \
            Client(d.endpoint, name="fast-pins") as c, Client(d.endpoint, name="ctl") as ctl:
        L = c.expert_layers
        c.acquire_many([(L[0], [1, 2]), (L[1], [3, 4])]).release()    # resident now
        r0 = d.server.clients[next(k for k, x in d.server.clients.items() if x.name == "fast-pins")].requests
        lease = c.acquire_many([(L[0], [1, 2]), (L[1], [3, 4])])       # through shared memory
        me = next(x for x in d.server.clients.values() if x.name == "fast-pins")
        assert me.requests == r0, "the second acquire went over the socket"
        st = ctl.stats()
        row = next(x for x in st["clients"] if x["name"] == "fast-pins")
        assert row["fast_pins"] == 4 and row["leases"] == 0
        assert st["fast_path"]["pinned"] == 4
        assert ctl.status()["fast_pins"] == 4
        reg = CollectorRegistry(auto_describe=False)
        col = StatsCollector(d.endpoint, timeout=5)
        reg.register(col)
        try:
            text = generate_latest(reg).decode()
        finally:
            col.close()
        assert "moecached_fast_pinned_slots 4.0" in text
        assert any(l.startswith("moecached_client_fast_pins{") and l.endswith(" 4.0")
                   for l in text.splitlines()), text
        lease.release()
        st = ctl.stats()
        assert st["fast_path"]["pinned"] == 0
        assert next(x for x in st["clients"] if x["name"] == "fast-pins")["fast_pins"] == 0
