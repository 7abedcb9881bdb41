"""What a client of another uid can and cannot do to the daemon and to other clients.

Each test here reproduces one attack an ordinary account in the daemon's client group made on a
daemon running as root, with that account for real: a user the test creates and removes
(tests/as_user.py), a process that runs as it and connects through the socket's permissions,
the daemon learning its uid and pid from the kernel.
"""
from __future__ import annotations

import inspect
import os

import msgpack
import pytest
import zmq

from moecache_client import Client
from moecached.service.endpoint import process_start_time
from moecached.service.server import Server

from as_user import needs_root, run_as, shared_dir, temp_group, temp_user
from daemon_util import Daemon

pytestmark = needs_root


def ask(endpoint, *msgs, hello=None):
    """Send ``msgs`` (op maps) one by one on one new connection; the replies (None: no reply in 5 s)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    out = []
    try:
        for i, m in enumerate(msgs):
            s.send(msgpack.packb({"v": 1, "id": i + 1, **m}))
            out.append(msgpack.unpackb(s.recv(), raw=False) if s.poll(5000) else None)
    finally:
        s.close()
        ctx.term()
    return out


def own_hello():
    return {"op": "hello", "pid": os.getpid(), "pid_start": process_start_time(os.getpid())}


@pytest.fixture
def world(model_factory):
    """An in-process daemon as root on a socket of group G (mode 0660) in a directory anyone
    may traverse; ``user``: an ordinary account in G; ``admin``: one in G and in the
    admin_group A; ``model_dirs``: [a directory of public models]."""
    path = model_factory("qwen3-30b-a3b-Q4_K_M", layers=4, experts=8)
    with temp_group() as g, temp_group() as a, temp_user([g.gr_name]) as user, \
            temp_user([g.gr_name, a.gr_name]) as adm, shared_dir() as d:
        models = os.path.join(d, "models")
        os.mkdir(models)
        os.chmod(models, 0o755)
        access = {"admin_gid": a.gr_gid, "model_dirs": [models]}
        if "admin_gid" not in inspect.signature(Server).parameters:
            access = {}   # a daemon from before the control plane: the attacks as they were
        with Daemon(path, d, gid=g.gr_gid, heartbeat_s=30, **access) as dm:
            dm.user, dm.admin, dm.models = user, adm, models
            dm.added = []
            dm.server.models_handler = lambda msg: (dm.added.append(msg) if msg.get("action", "list")
                                                    != "list" else None) or {"models": []}
            yield dm


def code(rep):
    return None if rep is None or rep.get("ok") else rep["error"]["code"]


# ---- 1: a client cannot claim another process's pid; an admin can drop a client ----------------

def test_hello_claiming_another_process_pid_is_refused(world):
    """The attacker claimed pid 1 (with its true start time): the daemon watched pid 1 and kept
    the attacker's pins for good. Now the claim is checked against the pid the kernel gives for
    the connection and refused; the attacker's own pid is watched as before."""
    ep = world.endpoint
    start1 = process_start_time(1)
    claim, = run_as(world.user, ask, ep, {"op": "hello", "pid": 1, "pid_start": start1})
    assert code(claim) == "pid_mismatch", claim
    assert "pid 1" in claim["error"]["message"] and "\n" not in claim["error"]["message"]
    honest, = run_as(world.user, lambda: ask(ep, own_hello()))
    assert honest["ok"] and honest["lease_watch"] == "process", honest
    assert not any(c.pidfd is not None and c.pid == 1 for c in world.server.clients.values())


def test_admin_lists_and_drops_a_client_others_may_not(world):
    """No command could drop a client. ``clients`` lists them (uid, pid, leases, pins) and
    ``clients drop ID`` releases one, for an admin only."""
    L = world.idx.expert_layers
    with Client(world.endpoint, name="victim") as v:
        lease = v.acquire(L[0], [1, 2])
        assert world.cache.pinned_count() == 2
        rows = {r["name"]: r for r in ask(world.endpoint, {"op": "clients"})[0]["clients"]}
        me = rows["victim"]
        assert (me["uid"], me["pid"], me["leases"], me["pins"]) == (0, os.getpid(), 1, 2)
        # an ordinary user sees only itself, and may not drop anyone
        listed, drop = run_as(world.user, ask, world.endpoint, {"op": "clients"},
                              {"op": "clients", "action": "drop", "client": me["id"]})
        assert [r["uid"] for r in listed["clients"]] == [world.user.pw_uid] and listed["others"] >= 1
        assert code(drop) == "not_permitted" and "clients drop" in drop["error"]["message"]
        assert world.cache.pinned_count() == 2
        # an admin may
        drop, = run_as(world.admin, ask, world.endpoint,
                       {"op": "clients", "action": "drop", "client": me["id"]})
        assert drop["ok"] and drop["dropped"]["name"] == "victim", drop
        assert world.cache.pinned_count() == 0
        lease.released = True


# ---- 2 and 3: the control plane is the admins' ---------------------------------------------------

def test_ordinary_client_cannot_change_the_daemon(world):
    """Any client could add a model, remove any model, start and stop traces; now each is
    refused ``not_permitted`` naming the operation, and nothing happens. Listing stays open."""
    ep = world.endpoint
    secret = os.path.join(world.models, "m.gguf")
    trace = os.path.join(os.path.dirname(world.models), "trace-never.npz")
    reps = run_as(world.user, ask, ep,
                  {"op": "models", "action": "add", "name": "x", "path": secret},
                  {"op": "models", "action": "remove", "name": "qwen"},
                  {"op": "models", "action": "rebalance"},
                  {"op": "trace_start", "path": trace},
                  {"op": "trace_stop"},
                  {"op": "models"}, {"op": "stats"}, {"op": "status"})
    for rep, what in zip(reps, ("models add", "models remove", "models rebalance", "trace start",
                                "trace stop")):
        assert code(rep) == "not_permitted", (what, rep)
        assert rep["error"]["message"].startswith(f"{what}: not permitted"), rep
    assert world.added == [] and world.server.recorder is None
    assert not os.path.exists(trace)
    lst, stats, status = reps[5:]
    assert lst["ok"] and status["ok"] and stats["ok"]
    assert world.server.counters["not_permitted"] == 5


def test_non_admin_sees_other_clients_only_as_counts(world):
    with Client(world.endpoint, name="engine-secret"):
        st, = run_as(world.user, ask, world.endpoint, {"op": "stats"})
        names = [c["name"] for c in st["stats"]["clients"]]
        assert "engine-secret" not in names and st["stats"]["clients_other"] >= 1
        assert isinstance(st["stats"]["departed_clients"], int)


def test_model_add_only_what_the_asking_uid_can_read(world):
    """Any client could add a GGUF from a root-only 0700 directory it cannot read, and the
    refusals told whether a path existed there. Now: admins only, files under model_dirs only,
    readable by the asking uid; missing and unreadable read the same."""
    ep, models = world.endpoint, world.models
    private = os.path.join(models, "private")
    os.mkdir(private, 0o700)
    with open(os.path.join(private, "secret.gguf"), "wb") as f:
        f.write(b"GGUF")
    public = os.path.join(models, "public.gguf")
    with open(public, "wb") as f:
        f.write(b"GGUF")
    os.chmod(public, 0o644)
    link = os.path.join(models, "link.gguf")
    os.symlink("/etc/shadow", link)
    secret, missing = os.path.join(private, "secret.gguf"), os.path.join(private, "nope.gguf")

    def add(p):
        return {"op": "models", "action": "add", "name": "m", "path": p}
    reps = run_as(world.admin, ask, ep, add(secret), add(missing), add(link), add("/etc/passwd"),
                  add(models + "/../../etc/passwd"), add(public))
    s, m, ln, out, dots, ok = reps
    assert code(s) == code(m) == code(ln) == code(out) == code(dots) == "refused"
    uid = world.admin.pw_uid
    assert s["error"]["message"] == f"models add: {secret}: no file under model_dirs there that uid {uid} can read"
    assert m["error"]["message"] == s["error"]["message"].replace(secret, missing)
    assert "not under model_dirs" in out["error"]["message"]
    assert ok["ok"], ok
    assert [a["path"] for a in world.added] == [public]
    # root (the daemon's uid) may add what it can read, under model_dirs only
    r1, r2 = ask(ep, add(secret), add("/etc/passwd"))
    assert r1["ok"] and code(r2) == "refused"


def test_ctl_clients_and_client_drop(world, capsys):
    """``moecache-ctl clients`` lists; ``moecache-ctl client drop ID`` releases (admins only)."""
    from moecached.tools.ctl import main
    L = world.idx.expert_layers
    ep = world.endpoint
    with Client(ep, name="engine-7") as v:
        lease = v.acquire(L[1], [3])
        assert main(["clients", "-e", ep]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].split() == ["id", "name", "pid", "uid", "leases", "pins", "fast_pins",
                                  "pending", "watched"]
        row = next(x.split() for x in out if "engine-7" in x)
        assert row[2:6] == [str(os.getpid()), "0", "1", "1"], out
        rc = run_as(world.user, main, ["client", "drop", row[0], "-e", ep])
        assert rc == 1 and world.cache.pinned_count() == 1
        assert main(["client", "drop", row[0], "-e", ep]) == 0
        assert "dropped client" in capsys.readouterr().out
        assert world.cache.pinned_count() == 0
        lease.released = True


def test_model_dirs_default_to_the_configured_models_directories():
    from types import SimpleNamespace
    from moecached.daemon.assemble import model_dirs
    cfg = SimpleNamespace(model_dirs=[], model=None,
                          models=[{"name": "a", "path": "/srv/a/x.gguf"}, {"name": "b", "path": "/srv/b/y.gguf"}])
    assert model_dirs(cfg) == ("/srv/a", "/srv/b")
    cfg.model_dirs = ["/opt/models"]
    assert model_dirs(cfg) == ("/opt/models",)


# ---- fairness: one user's connections share one control share --------------------------------

def _hello_answered(endpoint, name, wait_s=1.0):
    """Open a connection, say hello; whether the reply came within ``wait_s`` (the socket kept
    open: returned too)."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send(msgpack.packb({"v": 1, "id": 1, "op": "hello", "client": name}))
    return bool(s.poll(int(wait_s * 1000))), s


def _two_connections(endpoint):
    import time
    first, a = _hello_answered(endpoint, "mine-1", 5.0)
    time.sleep(0.3)        # the loop has counted the clients active
    second, b = _hello_answered(endpoint, "mine-2")
    a.close()
    b.close()
    return first, second


def test_one_user_opening_connections_gets_no_more_of_the_loop(world, monkeypatch):
    """Requests that are not the hot path (stats, hello, ping, ...) are charged to a share of
    the loop; for clients that are no admin the share is their uid's, so a user flooding from
    many connections gets no more of the loop than from one. An admin's share is per
    connection. (A burst of a microsecond and a share that does not refill here: each share is
    spent by one hello.)"""
    from moecached.service import fairness
    monkeypatch.setattr(fairness, "LOOP_BURST_S", 1e-6)
    world.server.set_loop_share(1e-9)
    with Client(world.endpoint, name="engine", fast_path=False) as c:
        c.ping()
        import time
        time.sleep(0.3)
        r1, s1 = _hello_answered(world.endpoint, "root-1", 5.0)
        time.sleep(0.3)
        r2, s2 = _hello_answered(world.endpoint, "root-2")
        assert r1 and r2     # admins: a share per connection
        first, second = run_as(world.user, _two_connections, world.endpoint)
        s1.close()
        s2.close()
    assert first and not second   # the user's second connection waits on the first's share


def test_a_non_admins_stats_builds_no_row_for_the_others(world, monkeypatch):
    """A non-admin's ``stats`` shows the other clients only as a count, yet built a row for
    each of them first: with a thousand idle connections of another user a 5-10 Hz poller
    spent its whole loop share and waited seconds. Now only its own row is built."""
    from moecached.service.clients import _Client
    built = []
    real = _Client.summary
    monkeypatch.setattr(_Client, "summary", lambda self: built.append(self.name) or real(self))
    others = [Client(world.endpoint, name=f"idle-{i}", fast_path=False) for i in range(20)]
    try:
        rep = run_as(world.user, ask, world.endpoint, {"op": "hello", "client": "poller"}, {"op": "stats"})[1]
        built_by_stats = list(built)
    finally:
        for o in others:
            o.close()
    built = built_by_stats
    assert rep["ok"], rep
    st = rep["stats"]
    assert [x["name"] for x in st["clients"]] == ["poller"] and st["clients_other"] >= 20, st["clients"]
    assert built == ["poller"], built


def _many_hellos(endpoint, n, hold_s):
    import time
    first, f = _hello_answered(endpoint, "many-first", 5.0)   # spends the user's share
    time.sleep(0.3)        # the loop has counted the clients active
    ctx = zmq.Context.instance()
    socks = [f]
    for i in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        s.send(msgpack.packb({"v": 1, "id": 1, "op": "hello", "client": f"many-{i}"}))
        socks.append(s)
    time.sleep(hold_s)
    answered = sum(1 for s in socks[1:] if s.poll(0))
    for s in socks:
        s.close()
    return answered


def test_many_waiting_connections_of_one_user_are_not_walked_every_few_ms(world, monkeypatch):
    """4,000 connections of one non-admin user, each with a hello waiting on the user's drained
    control share, took another user's acquires from 89 us to 1.6 ms: every 3 ms the loop
    walked every waiting client. Now, while the share has not refilled, it looks again only
    when it may have (at most every 0.1 s, when it recounts the active clients)."""
    import threading
    import time
    from moecached.service import fairness
    monkeypatch.setattr(fairness, "LOOP_BURST_S", 1e-6)
    world.server.set_loop_share(1e-9)
    calls = []
    real = world.server._fair_timer
    world.server._fair_timer = lambda now: (calls.append(now), real(now))
    with Client(world.endpoint, name="engine", fast_path=False) as c:
        c.ping()
        out = []
        t = threading.Thread(target=lambda: out.append(run_as(world.user, _many_hellos, world.endpoint, 200, 2.0)))
        t.start()
        time.sleep(1.0)
        n0, t0 = len(calls), time.monotonic()
        time.sleep(0.8)
        rate = (len(calls) - n0) / (time.monotonic() - t0)
        t.join(30)
        waiting = sum(len(x.held) for x in world.server.clients.values())
    assert out and out[0] <= 1, out          # the user's hellos waited (one may have spent the share)
    assert rate < 40, f"the fairness timer ran {rate:.0f} times a second with {waiting} waiting"
