"""MemoryFloor: shrink under the floor, grow back above the band, no flapping, failures survive."""
import logging

import pytest

from moecached.daemon.floor import MIN_MARGIN, MemoryFloor

GiB = 1 << 30
MiB = 1 << 20


class FakeProbe:
    def __init__(self, available):
        self.value = available

    def available(self):
        return self.value


class FakeCache:
    """set_budget that records calls; can be told to fail."""

    def __init__(self, fail=False):
        self.calls = []
        self.fail = fail

    def set_budget(self, b):
        self.calls.append(b)
        if self.fail:
            raise RuntimeError("arena busy")
        return {"slots_before": 0, "slots_after": 0, "bytes_released": 123}


def make(avail=20 * GiB, floor=8 * GiB, hyst=1 * GiB, budget=12 * GiB, min_budget=1 * GiB, **kw):
    probe, cache = FakeProbe(avail), FakeCache()
    f = MemoryFloor(floor, hyst, budget, min_budget, cache.set_budget, probe=probe,
                    interval=1.0, min_change_interval=5.0, **kw)
    return f, probe, cache


def test_nothing_happens_above_floor():
    f, probe, cache = make()
    for t in range(20):
        assert f.tick(float(t)) is None
    assert cache.calls == []
    assert f.current_budget == 12 * GiB


def test_shrink_target_is_deficit_plus_margin():
    f, probe, cache = make()
    probe.value = 7 * GiB          # 1 GiB under the floor
    ev = f.tick(100.0)
    margin = max(GiB // 2, MIN_MARGIN)
    assert f.margin == margin
    assert cache.calls == [12 * GiB - 1 * GiB - margin]
    assert ev["kind"] == "shrink" and ev["from"] == 12 * GiB and ev["to"] == cache.calls[0]
    assert ev["available"] == 7 * GiB and ev["floor"] == 8 * GiB
    assert ev["result"]["bytes_released"] == 123
    s = f.stats()
    assert s["current_budget"] == cache.calls[0] and s["configured_budget"] == 12 * GiB
    assert s["shrinks"] == 1 and s["grows"] == 0 and s["events"][0]["kind"] == "shrink"


def test_never_below_min_budget_and_reports_at_min(caplog):
    f, probe, cache = make(min_budget=4 * GiB)
    probe.value = 0                       # target 12 - 8 - 0.5 GiB = 3.5 GiB < min_budget
    f.tick(0.0)
    assert cache.calls == [4 * GiB]
    with caplog.at_level(logging.WARNING, logger="moecached.daemon.floor"):
        for t in range(1, 10):
            assert f.tick(float(t)) is None
    assert cache.calls == [4 * GiB]
    assert f.stats()["at_min"] is True
    assert sum("cannot shrink further" in r.getMessage() for r in caplog.records) == 1


def test_consecutive_shrinks_spaced_by_interval():
    f, probe, cache = make()
    probe.value = 7 * GiB
    f.tick(0.0)
    assert f.tick(0.5) is None          # too soon
    assert f.tick(1.0)["kind"] == "shrink"   # still under: shrink again
    assert len(cache.calls) == 2 and cache.calls[1] < cache.calls[0]


def test_shrink_based_on_used_bytes_when_smaller():
    f, probe, cache = make(used_bytes=lambda: 4 * GiB)
    probe.value = 7 * GiB
    f.tick(0.0)
    assert cache.calls == [4 * GiB - 1 * GiB - f.margin]


def test_grow_back_needs_sustained_surplus_and_spends_only_it():
    f, probe, cache = make()
    probe.value = 7 * GiB
    f.tick(0.0)
    shrunk = f.current_budget
    # memory freed by others: 8 + 1 (band) + 0.5 GiB surplus
    probe.value = 9 * GiB + 512 * MiB
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        assert f.tick(t) is None, t        # surplus not held for 5 s / last change too recent
    ev = f.tick(6.0)
    assert ev["kind"] == "grow"
    assert ev["to"] == shrunk + 512 * MiB  # grows by the surplus above floor + hysteresis only
    # another grow needs another min_change_interval
    probe.value = 11 * GiB
    assert f.tick(7.0) is None
    assert f.tick(11.0) is None           # surplus seen since t=7 only
    ev = f.tick(12.0)
    assert ev["kind"] == "grow" and ev["to"] == 12 * GiB   # capped at the configured budget
    assert f.tick(20.0) is None
    assert f.stats()["grows"] == 2


def test_hovering_at_floor_does_not_flap():
    f, probe, cache = make()
    # available hovers +-200 MiB around the floor for a minute, ticks every second
    kinds = []
    for t in range(60):
        # each shrink frees memory for real: available rises by what was released
        base = 8 * GiB + (200 * MiB if t % 2 else -200 * MiB)
        probe.value = base + (12 * GiB - f.current_budget)
        ev = f.tick(float(t))
        if ev:
            kinds.append(ev["kind"])
    assert kinds == ["shrink"], kinds
    assert "grow" not in kinds


def test_band_holds_still():
    f, probe, cache = make()
    probe.value = 7 * GiB
    f.tick(0.0)
    probe.value = 8 * GiB + 512 * MiB      # inside [floor, floor + hysteresis]
    for t in range(1, 30):
        assert f.tick(float(t)) is None
    assert len(cache.calls) == 1


def test_set_budget_failure_is_recorded_and_retried(caplog):
    f, probe, cache = make()
    cache.fail = True
    probe.value = 7 * GiB
    with caplog.at_level(logging.ERROR, logger="moecached.daemon.floor"):
        ev = f.tick(0.0)
    assert ev["kind"] == "error" and ev["attempted"] == "shrink"
    assert ev["error"] == "RuntimeError: arena busy"
    assert f.current_budget == 12 * GiB          # unchanged: the cache did not shrink
    assert any("failed: RuntimeError: arena busy" in r.getMessage() for r in caplog.records)
    assert f.tick(0.5) is None                   # no tight retry loop
    cache.fail = False
    ev = f.tick(1.0)
    assert ev["kind"] == "shrink" and f.current_budget == ev["to"]
    s = f.stats()
    assert s["errors"] == 1 and s["shrinks"] == 1
    assert [e["kind"] for e in s["events"]] == ["error", "shrink"]


def test_callable_probe_and_reconfigure():
    vals = [20 * GiB]
    cache = FakeCache()
    f = MemoryFloor(8 * GiB, GiB, 12 * GiB, GiB, cache.set_budget, probe=lambda: vals[0])
    assert f.tick(0.0) is None
    f.reconfigure(floor_bytes=21 * GiB)          # raising the floor causes a shrink
    ev = f.tick(1.0)
    assert ev["kind"] == "shrink" and ev["to"] == 12 * GiB - GiB - f.margin
    f.reconfigure(configured_budget=4 * GiB)     # a smaller configured budget applies at once
    assert cache.calls[-1] == 4 * GiB and f.current_budget == 4 * GiB


def test_invalid_arguments():
    with pytest.raises(ValueError):
        MemoryFloor(GiB, 0, GiB, 2 * GiB, lambda b: None)
    with pytest.raises(ValueError):
        MemoryFloor(-1, 0, GiB, 0, lambda b: None)


def test_reconfigure_keeps_a_pressure_shrink_and_honours_min_budget():
    """SIGHUP changes through reconfigure: a new configured budget does not undo a shrink the
    floor made under pressure (it only cuts above it), is taken as is while the floor has not
    shrunk the cache, a raised min_budget lifts the budget, counted as ``reconfigures``, and a
    bad value changes nothing."""
    f, probe, cache = make(avail=20 * GiB, floor=8 * GiB, budget=12 * GiB, min_budget=1 * GiB)
    f.reconfigure(configured_budget=10 * GiB)            # not shrunk: follows at once
    assert f.current_budget == 10 * GiB and cache.calls[-1] == 10 * GiB
    probe.value = 5 * GiB                                # 3 GiB under the floor
    ev = f.tick(0.0)
    assert ev["kind"] == "shrink"
    shrunk = f.current_budget
    assert shrunk < 10 * GiB
    calls = len(cache.calls)
    f.reconfigure(configured_budget=11 * GiB)            # a larger budget keeps the shrink
    assert f.current_budget == shrunk and len(cache.calls) == calls
    f.reconfigure(configured_budget=shrunk - GiB)        # a smaller one cuts at once
    assert f.current_budget == shrunk - GiB == cache.calls[-1]
    f.reconfigure(configured_budget=12 * GiB, min_budget=shrunk)   # a min_budget above the
    assert f.current_budget == shrunk == cache.calls[-1] and f.at_min  # budget lifts it
    with pytest.raises(ValueError):
        f.reconfigure(min_budget=13 * GiB)               # min_budget > configured budget
    with pytest.raises(ValueError):
        f.reconfigure(floor_bytes=-1)
    assert f.floor_bytes == 8 * GiB and f.min_budget == shrunk and f.configured_budget == 12 * GiB
    s = f.stats()
    assert s["shrinks"] == 1 and s["reconfigures"] == 3
    assert [e["kind"] for e in s["events"]].count("configure") == 3
