"""Soak with prefetch: a real ``moecached`` process with small caps (2 prefetch loads in flight,
16 slots for 64 experts, 2 reader threads, 16 KiB chunks) serves client processes of three
kinds at once, each checking every byte of every expert it acquires against the model file:

* engines (two threads sharing one Client): prefetch the next 1-3 layers' predicted experts
  with confidences, then acquire the current layer's (mostly the ones predicted one step
  before, so their prefetch reads are often still queued or running: demand takes them over),
  sometimes several layers in one lease, sometimes holding the lease a while;
* a predictor (two threads) sending prefetches of random experts with random confidences,
  fast enough that the 2-load cap is always full: queued reads of lower confidence are
  withdrawn for higher ones all the time;
* a staller: holds one or two leases for a fraction of a second while everything churns
  (their bytes are checked again before release), then sleeps.

Two variants: ``socket`` (the daemon offers no shared-memory pins: every acquire is a
message) and ``fast`` (the clients pin resident experts through shared memory without a
message, and fall back to the socket on a miss).

Done when: 0 wrong bytes, no lease revoked under its holder, no error reply, no read error,
no client dropped, every worker done in time; afterwards nothing pinned or in flight, and every
expert still reads exact. The withdrawals (``prefetches_displaced``), the prefetch hits and the
demand take-overs of prefetch reads in flight, and the evictions (slot reuse) exercised are
printed (``pytest -s``) and must each be > 0.

Bounded: ``MOECACHED_SOAK_S`` seconds per variant (default 25); set it higher for a long run.
``MOECACHED_SOAK_SEED`` picks the workers' random choices (default 1; the interleaving differs
from run to run anyway). A wrong byte is written at once to the worker's output file (kept with
the test's ``tmp_path`` when it fails) as ``WRONG {json}``: layer, expert, part, class, slot,
lease, first wrong offset, how many bytes differ, whether the lease still said valid.

The worker processes run this file as a script:

    python test_soak_prefetch.py ROLE ENDPOINT MODEL OUT_FILE SEED SECONDS
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

SOAK_S = float(os.environ.get("MOECACHED_SOAK_S", "25"))
SEED = int(os.environ.get("MOECACHED_SOAK_SEED", "1"))
pytestmark = pytest.mark.timeout(600 + 2 * SOAK_S)   # a long soak is not a hang
HERE = Path(__file__).resolve()

#: the daemon's caps: few slots (evictions), 2 prefetch loads (withdrawals at the cap), few
#: readers and small chunks (reads stay in flight long enough to be taken over)
DAEMON_ARGS = ("--slots", "16", "--readers", "2", "--chunk", "16KiB", "--max-prefetch-loads", "2",
               "--fast-path-quota", "12")
#: worker processes: (role, threads)
WORKERS = (("engine", 2), ("engine", 2), ("predictor", 2), ("staller", 1))


# ------------------------------------------------------------------------------ worker side

class Truth:
    """Expected bytes of (layer, expert) by part, read from the model file with ``os.pread``
    (no shared file offset: safe from any thread)."""

    def __init__(self, model: str):
        from moecached.engine.index import open_index
        self.idx = open_index(model)
        self.fds = [os.open(f, os.O_RDONLY) for f in self.idx.files]

    def get(self, layer: int, expert: int) -> dict:
        out = {}
        for sp in self.idx.parts(layer, expert):
            b = os.pread(self.fds[sp.file], sp.nbytes, sp.offset)
            if len(b) != sp.nbytes:
                raise AssertionError(f"short read of the model file at {sp.offset}: {len(b)} of {sp.nbytes}")
            out[sp.part] = np.frombuffer(b, dtype=np.uint8)
        return out


class Worker:
    """One worker process: its role's loop in ``threads`` threads sharing one Client (a watched
    one, so its leases are never revoked under it), until ``seconds`` have passed; then bye
    and a ``DONE {counts}`` line. Anything wrong is written to the output file at once."""

    def __init__(self, role, endpoint, model, out_path, seed, seconds):
        from moecache_client import Client
        self.role, self.seed = role, seed
        self.truth = Truth(model)
        self.out = open(out_path, "a", buffering=1)
        self.lock = threading.Lock()
        self.n = {"acquires": 0, "fast_leases": 0, "experts_verified": 0, "bytes_verified": 0,
                  "rechecks": 0, "wrong": 0, "invalid": 0, "hits": 0, "prefetch_hits": 0,
                  "misses": 0, "takeovers": 0, "prefetch_msgs": 0, "queued": 0, "errors": 0}
        self.deadline = time.monotonic() + seconds
        self.c = Client(endpoint, name=f"{role}{seed}", timeout=60, connect_timeout=30)
        self.layers = self.c.expert_layers
        self.n_exp = self.c.n_experts

    def count(self, **kw):
        with self.lock:
            for k, v in kw.items():
                self.n[k] += v

    def log(self, kind, **what):
        with self.lock:
            self.out.write(f"{kind} " + json.dumps(what) + "\n")

    def verify(self, lease, wanted, again=False):
        """Check every byte of every item of ``lease`` against the file; ``wanted``: the
        (layer, expert) pairs asked for, in request order."""
        got = [(l, e) for l, e, _, _ in lease.items]
        if got != wanted:
            self.count(errors=1)
            self.log("ERROR", what="items do not match the request", wanted=wanted, items=lease.items)
            return
        nbytes = 0
        for layer, e, cid, slot in lease.items:
            want = self.truth.get(layer, e)
            views = lease.parts(e, layer)              # LeaseInvalid when revoked
            for part, w in want.items():
                v = views[part]
                if v.shape != w.shape or not np.array_equal(v, w):
                    still = lease.valid()
                    diff = (np.flatnonzero(v != w) if v.shape == w.shape else np.arange(1))
                    self.count(wrong=1)
                    self.log("WRONG", role=self.role, seed=self.seed, layer=layer, expert=e, part=part,
                             cls=cid, slot=slot, lease=lease.id, fast=lease.id < 0, recheck=again,
                             first=int(diff[0]), n_wrong=int(diff.size), nbytes=int(w.size),
                             valid_after=still, session=lease.session, t=time.time())
                nbytes += w.size
        if not lease.valid():                          # a watched client's lease is never revoked
            self.count(invalid=1)
            self.log("INVALID", role=self.role, lease=lease.id, items=lease.items)
            return
        self.count(experts_verified=len(wanted), bytes_verified=nbytes, rechecks=int(again))

    def acquire(self, req):
        """``req``: [(layer, [experts])]; returns (lease, wanted pairs)."""
        if len(req) == 1:
            lease = self.c.acquire(req[0][0], req[0][1])
        else:
            lease = self.c.acquire_many(req)
        self.count(acquires=1, fast_leases=int(lease.id < 0), hits=lease.hits,
                   prefetch_hits=lease.prefetch_hits, misses=lease.misses,
                   # a demand request that found prefetch-brought experts and waited for reads
                   # with no demand read of its own: it took over prefetch reads in flight
                   takeovers=int(lease.prefetch_hits > 0 and lease.misses == 0 and lease.stall_us > 0))
        return lease, [(l, e) for l, ex in req for e in ex]

    def guarded(self, body, rng):
        from moecache_client import ClientError, LeaseInvalid
        while time.monotonic() < self.deadline:
            try:
                body(rng)
            except LeaseInvalid as e:
                self.count(invalid=1)
                self.log("INVALID", role=self.role, why=str(e))
            except ClientError as e:
                self.count(errors=1)
                self.log("ERROR", role=self.role, what=f"{type(e).__name__}: {e}")
                time.sleep(0.05)
            except Exception as e:                     # a bug in this thread: it stops, said
                import traceback
                self.count(errors=1)
                self.log("ERROR", role=self.role, what=f"{type(e).__name__}: {e}",
                         where=traceback.format_exc(limit=4))
                return

    def pick(self, rng, k):
        """``k`` distinct experts, a few hot ones more often than the rest (so that some stay
        resident: hits, and pins through shared memory)."""
        hot = range(min(3, self.n_exp))
        out = []
        while len(out) < k:
            e = rng.choice(hot) if rng.random() < 0.5 else rng.randrange(self.n_exp)
            if e not in out:
                out.append(e)
        return out

    # -- roles
    def engine(self, rng):
        """One decode pass over the layers: prefetch ahead with confidences, acquire this
        layer's experts (mostly those predicted one step before), check, release."""
        L, n = self.layers, len(self.layers)
        m, plan = rng.randrange(n), None
        while time.monotonic() < self.deadline:
            ahead = rng.randint(1, 3)
            nxt = [(L[(m + j) % n], self.pick(rng, 2)) for j in range(1, ahead + 1)]
            # sure of the next layer (it displaces the predictor's guesses), less of later ones
            conf = [[round(rng.uniform(0.8, 1.0) if j == 0 else rng.random(), 3) for _ in ex]
                    for j, (_, ex) in enumerate(nxt)]
            if rng.random() < 0.1:
                self.count(queued=self.c.prefetch(None, layers=nxt, conf=conf, wait=True), prefetch_msgs=1)
            else:
                self.c.prefetch(None, layers=nxt, conf=conf)
                self.count(prefetch_msgs=1)
            if plan is not None and rng.random() < 0.7:
                ex = list(plan)
            else:
                ex = self.pick(rng, rng.randint(1, 3))
            req = [(L[m], ex)]
            if rng.random() < 0.15:                    # two layers in one lease
                other = L[(m + 2) % n]
                req.append((other, rng.sample(range(self.n_exp), 1)))
            lease, wanted = self.acquire(req)
            try:
                self.verify(lease, wanted)
                if rng.random() < 0.1:                 # hold it a while, check it again
                    time.sleep(rng.uniform(0.02, 0.1))
                    self.verify(lease, wanted, again=True)
            finally:
                lease.release()
            if rng.random() < 0.2:
                time.sleep(rng.uniform(0, 0.02))
            plan = nxt[0][1]
            m = (m + 1) % n

    def predictor(self, rng):
        """Prefetches of random experts with random confidences, in bursts."""
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.3:                     # the flat form: one layer
                ex = rng.sample(range(self.n_exp), rng.randint(1, 3))
                conf = [rng.choice((0.0, 1.0, rng.random())) for _ in ex]
                self.c.prefetch(rng.choice(self.layers), ex, conf=conf)
            else:
                req = [(l, rng.sample(range(self.n_exp), rng.randint(1, 3)))
                       for l in rng.sample(self.layers, rng.randint(2, 3))]
                conf = [[rng.random() for _ in ex] for _, ex in req]
                if rng.random() < 0.05:
                    self.count(queued=self.c.prefetch(None, layers=req, conf=conf, wait=True))
                else:
                    self.c.prefetch(None, layers=req, conf=conf)
            self.count(prefetch_msgs=1)
        time.sleep(rng.uniform(0.002, 0.03))

    def staller(self, rng):
        """Holds one or two leases for a while under the churn, checks them again, sleeps."""
        held = []
        try:
            for _ in range(rng.randint(1, 2)):
                req = [(rng.choice(self.layers), self.pick(rng, rng.randint(1, 2)))]
                lease, wanted = self.acquire(req)
                held.append((lease, wanted))
                self.verify(lease, wanted)
            time.sleep(rng.uniform(0.2, 0.8))
            for lease, wanted in held:
                self.verify(lease, wanted, again=True)
        finally:
            for lease, _ in held:
                lease.release()
        time.sleep(rng.uniform(0.05, 0.4))

    def run(self, threads: int) -> None:
        body = getattr(self, self.role)
        ts = [threading.Thread(target=self.guarded, args=(body, random.Random(self.seed * 100 + i)))
              for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        self.c.close()
        self.log("DONE", **self.n)
        self.out.close()


def worker_main(argv) -> int:
    role, endpoint, model, out, seed, seconds, threads = argv
    Worker(role, endpoint, model, out, int(seed), float(seconds)).run(int(threads))
    return 0


# ------------------------------------------------------------------------------ test side

def read_outputs(outs):
    done, bad = [], []
    for out in outs:
        lines = out.read_text().splitlines() if out.exists() else []
        for line in lines:
            kind, _, rest = line.partition(" ")
            if kind == "DONE":
                done.append(json.loads(rest))
            else:
                bad.append(f"{out.name}: {line}")
        if not any(line.startswith("DONE") for line in lines):
            bad.append(f"{out.name}: the worker did not finish")
    return done, bad


@pytest.mark.slow
@pytest.mark.parametrize("path", ["socket", "fast"])
def test_soak_prefetch_bytes_exact(path, model_factory, tmp_path):
    from daemon_util import start_daemon, stop_daemon, wait_for
    from moecache_client import Client
    model = model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 7, 8], experts=16)
    sock = str(tmp_path / "d.sock")
    ep = f"ipc://{sock}"
    args = DAEMON_ARGS + ("--arena-dir", str(tmp_path)) + (("--no-fast-path",) if path == "socket" else ())
    daemon_log = open(tmp_path / "daemon.log", "w")
    d = start_daemon(model, sock, *args, output=daemon_log)
    procs, outs, errs = [], [], []
    t0 = time.monotonic()
    try:
        for i, (role, threads) in enumerate(WORKERS):
            out = tmp_path / f"{role}{i}.txt"
            outs.append(out)
            errs.append(open(tmp_path / f"{role}{i}.err", "w"))
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE), role, ep, str(model), str(out), str(SEED * 1000 + i),
                 str(SOAK_S), str(threads)], stdout=subprocess.DEVNULL, stderr=errs[-1]))
        peak = {"prefetch_loads_in_flight": 0, "reads_in_flight": 0, "pinned": 0}
        with Client(ep, name="observer", fast_path=False, map_arena=False) as obs:
            while any(p.poll() is None for p in procs):
                assert time.monotonic() - t0 < SOAK_S + 90, "workers did not finish in time"
                st = obs.stats()
                for k in peak:
                    peak[k] = max(peak[k], st[k])
                time.sleep(0.5)
            for i, (p, (role, _)) in enumerate(zip(procs, WORKERS)):
                err = (tmp_path / f"{role}{i}.err").read_text()
                assert p.returncode == 0 and "Traceback" not in err, \
                    f"{role} worker exited {p.returncode}: {err[-2000:]}"
            # every worker said bye: nothing pinned, every read lands
            st = wait_for(lambda: (lambda s: s if (s["pinned"] == 0 and s["reads_in_flight"] == 0
                                                   and s["leases_open"] == 0) else None)(obs.stats()),
                          "pins released and reads landed", timeout=20)
        assert st["prefetch_loads_in_flight"] == 0 and st["fast_path"]["pins_honoured"] == 0, st["fast_path"]
        # afterwards every expert still reads exact (socket leases, from this process)
        truth = Truth(model)
        with Client(ep, name="sweep", fast_path=False) as c:
            for layer in c.expert_layers:
                for e0 in range(0, c.n_experts, 4):
                    ex = list(range(e0, min(e0 + 4, c.n_experts)))
                    with c.acquire(layer, ex) as lease:
                        for e in ex:
                            for part, v in lease.parts(e).items():
                                assert np.array_equal(v, truth.get(layer, e)[part]), (layer, e, part)
                        assert lease.valid()
            final = c.stats()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        said = stop_daemon(d)
        daemon_log.close()
        for f in errs:
            f.close()
    wall = time.monotonic() - t0
    done, bad = read_outputs(outs)
    tot = {k: sum(n[k] for n in done) for k in done[0]} if done else {}
    clients = final["clients"] + final["departed_clients"]
    client_errors = {c["name"]: c["errors"] for c in clients if c.get("errors")}
    seen = {k: final[k] for k in ("prefetches", "prefetches_dropped", "prefetches_displaced", "prefetch_hits",
                                  "wasted_prefetches", "evictions", "demand_misses", "hits", "reads")}
    print(f"\nsoak-prefetch [{path}] {SOAK_S:.0f}s seed {SEED}, {wall:.1f}s wall: "
          f"{seen['prefetches_displaced']} withdrawals (prefetches_displaced), "
          f"{seen['prefetch_hits']} prefetch hits of which {tot.get('takeovers')} acquires took over reads "
          f"in flight, {seen['evictions']} evictions (slot reuses); {tot.get('acquires')} acquires "
          f"({tot.get('fast_leases')} through shared memory), {tot.get('experts_verified')} experts / "
          f"{tot.get('bytes_verified', 0) / 2**30:.2f} GiB verified ({tot.get('rechecks')} held and rechecked), "
          f"{tot.get('wrong')} wrong; peaks {peak}; daemon {seen}")
    assert not bad, (f"outputs in {tmp_path}", bad[:20])
    assert tot["wrong"] == 0 and tot["invalid"] == 0 and tot["errors"] == 0, tot
    assert len(done) == len(WORKERS)
    assert not client_errors, client_errors
    srv = final["server"]
    assert all(srv[k] == 0 for k in ("errors", "malformed", "undeliverable", "rate_limited")), srv
    left = {c["name"]: c["left"] for c in final["departed_clients"] if c["left"] != "said bye"}
    assert not left, f"clients dropped by the daemon: {left}"
    assert final["read_errors"] == 0 and final["pinned"] == 0
    assert final["reads_discarded"] == 0, "a read landed in a slot that had changed hands"
    assert "Traceback" not in said and "Traceback" not in (tmp_path / "daemon.log").read_text()
    assert tot["experts_verified"] > 100, "the soak read too little to mean anything"
    assert seen["prefetches_displaced"] > 0, "no queued prefetch read was withdrawn"
    assert seen["prefetch_hits"] > 0 and tot["takeovers"] > 0, "demand never took over a prefetch read"
    assert seen["evictions"] > 0, "no slot was reused"
    assert tot["rechecks"] > 0
    if path == "fast":
        assert tot["fast_leases"] > 0 and final["fast_path"]["fast_hits"] > 0, final["fast_path"]
    else:
        assert tot["fast_leases"] == 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
