"""Several models in one daemon under one budget (``moecached.multi``), with real-layout synth
models of two different models (Qwen3-30B-A3B and Mixtral-8x7B, two layers each) and their
real traces:

* hello names the model (redirected to its endpoint); no name / unknown name: one-line refusal;
* driven step by step in the simulator's interleaving (``mixsim.interleaving``), with the split
  rebalanced at the simulator's points, the daemon's per-model hits, ghost hits, shares and
  moves are exactly the simulator's (``moecache-ctl policy --mix``), and every byte is right;
* a model removed and added while another model's client decodes: that client sees no error,
  its warm experts stay (no eviction but the shrink of its share), every byte of both models
  is right, and hellos for a removed model are refused with one line.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from moecache_client import Client, ServerError
from moecached.index import open_index
from moecached.tools.mixsim import MixModel, interleaving, replay_mix
from moecached.trace import load_trace

from fixtures import make_model, trace_path

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("multi")
    return {"qwen": make_model(d, "qwen3-30b-a3b-Q4_K_M", layers=2, experts=128),
            "mix": make_model(d, "mixtral-8x7b-Q4_K_M", layers=2, experts=8)}


def traces():
    q = load_trace(trace_path("qwen3_30b_a3b_sharegpt_prefill_2050.npz")).window(0, 400, layers=2)
    m = load_trace(trace_path("mixtral8x7b_humaneval0_full.npz")).window(0, None, layers=2)
    return {"qwen": q, "mix": m}


class MultiDaemon:
    def __init__(self, models, tmp_path, budget, *args, config=None):
        self.sock = str(tmp_path / "m.sock")
        self.endpoint = f"ipc://{self.sock}"
        cmd = [sys.executable, "-P", "-m", "moecached.daemon", "--endpoint", self.endpoint,
               "--budget", str(budget), "--no-lock-memory", "--readers", "4",
               "--arena-dir", str(tmp_path)]
        if config is not None:   # the models come from the file (SIGHUP re-reads them)
            cmd += ["--config", str(config)]
        else:
            for name, path in models.items():
                cmd += ["--model", f"{name}={path}"]
        self.p = subprocess.Popen(cmd + list(args), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 90
        while True:
            if self.p.poll() is not None:
                raise RuntimeError(f"daemon exited {self.p.returncode}: {self.p.stdout.read()}")
            try:
                if os.path.exists(self.sock):
                    self.ctl = Client(self.endpoint, model="*", name="test-ctl", timeout=60,
                                      connect_timeout=2, map_arena=False)
                    break
            except Exception:
                pass
            if time.time() > deadline:
                self.p.kill()
                raise RuntimeError("daemon did not come up: " + self.p.stdout.read())
            time.sleep(0.2)

    def models(self):
        return {m["name"]: m for m in self.ctl.models()["models"]}

    def stop(self) -> str:
        try:
            self.ctl.close()
        except Exception:
            pass
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        return self.p.stdout.read()


def step_client(endpoint, model):
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "mix_client.py"), endpoint, model, "0"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready = json.loads(p.stdout.readline())
    assert ready["ready"], ready
    return p


def ask(p, sets):
    p.stdin.write(json.dumps(sets) + "\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


def test_hello_names_the_model(models, tmp_path):
    d = MultiDaemon(models, tmp_path, "1GiB")
    try:
        q = Client(d.endpoint, model="qwen", fast_path=False)
        m = Client(d.endpoint, model="mix", fast_path=False)
        assert q.endpoint == d.endpoint and m.endpoint == d.endpoint + ".mix"
        assert (q.info["model_name"], m.info["model_name"]) == ("qwen", "mix")
        assert q.n_experts == 128 and m.n_experts == 8
        q.close()
        # traces are per model: the mix socket records mix's acquires only
        tc = Client(d.endpoint, model="mix", map_arena=False, name="tracer")
        tc.trace_start(str(tmp_path / "mix.npz"))
        with m.__class__(d.endpoint, model="mix", fast_path=False) as m2:
            m2.acquire(m2.expert_layers[0], [1, 2]).release()
        with q.__class__(d.endpoint, model="qwen", fast_path=False) as q2:
            q2.acquire(q2.expert_layers[0], [5]).release()
        info = tc.trace_stop()["info"]
        tc.close()
        assert info["tokens"] == 1 and info["top_k"] == 2   # Mixtral's, one acquire
        m.close()
        with pytest.raises(ServerError, match=r"unknown_model: this daemon serves several models "
                                              r"\(qwen, mix\): name one in hello"):
            Client(d.endpoint)
        with pytest.raises(ServerError, match=r"unknown_model: model 'nope' is not served here"):
            Client(d.endpoint, model="nope")
    finally:
        d.stop()


def test_daemon_equals_simulator_step_by_step(models, tmp_path):
    tr = traces()
    mms = [MixModel(n, tr[n], open_index(models[n])) for n in ("qwen", "mix")]
    budget, every = 1024 * MiB, 32
    sim = replay_mix(mms, budget, dynamic=True, split_every=every)
    assert sim["moves"] >= 1            # the split moves here: not a trivial comparison
    order = interleaving(mms)
    d = MultiDaemon(models, tmp_path, budget, "--split-interval", "86400")
    clients = {}
    try:
        clients = {n: step_client(d.endpoint, n) for n in ("qwen", "mix")}
        got = {n: [0, 0] for n in clients}
        for i, (name, sets, counted) in enumerate(order, 1):
            r = ask(clients[name], sets)
            assert not r["bad"], r["bad"]
            if counted:
                got[name][0] += r["hits"]
                got[name][1] += r["accesses"]
            if i % every == 0:
                d.ctl.models("rebalance")
        ms = d.models()
        split = d.ctl.models()["split"]
    finally:
        for p in clients.values():
            p.stdin.close()
            p.wait(30)
        log = d.stop()
    for n in ("qwen", "mix"):
        s = sim["models"][n]
        assert tuple(got[n]) == (s["hits"], s["accesses"]), (n, got[n], s, log[-2000:])
        assert ms[n]["ghost_hits"] == s["ghost_hits"], (n, ms[n], s)
        assert ms[n]["share_bytes"] == sim["shares"][n]
    assert split["moves"] == sim["moves"]


def test_add_and_remove_while_another_model_decodes(models, tmp_path):
    tr = traces()
    mms = [MixModel("qwen", tr["qwen"], open_index(models["qwen"]))]
    steps = [(sets, counted) for _, sets, counted in interleaving(mms)]
    sf = tmp_path / "qwen_steps.json"
    sf.write_text(json.dumps(steps))
    d = MultiDaemon(models, tmp_path, "1GiB", "--split-interval", "86400")
    free = None
    try:
        from moecached.tools.synth import verify_expert_bytes
        m = Client(d.endpoint, model="mix", fast_path=False)
        held = m.acquire(m.expert_layers[1], [2, 3])    # held across the removal
        free = subprocess.Popen([sys.executable, os.path.join(HERE, "mix_client.py"), d.endpoint,
                                 "qwen", "0", "--free", str(sf), "40"],
                                stdout=subprocess.PIPE, text=True)
        deadline = time.time() + 60
        while d.models()["qwen"]["resident"] < d.models()["qwen"]["slots"] and time.time() < deadline:
            time.sleep(0.05)
        before = d.models()["qwen"]
        assert before["resident"] == before["slots"]   # warm: its share is full
        assert free.poll() is None                     # and still decoding
        r = d.ctl.models("remove", name="mix")
        assert r["removing"] == "mix"
        with pytest.raises(ServerError, match="unknown_model: model 'mix' is being removed"):
            Client(d.endpoint, model="mix")
        time.sleep(1.5)                              # a few periodic ticks: still draining
        assert d.models()["mix"]["state"] == "removing"
        for e in (2, 3):                             # its lease still holds the right bytes
            for part, view in held.parts(e).items():
                assert verify_expert_bytes(view, m.expert_layers[1], part, e, 0) is None
        held.release()
        m.close()
        deadline = time.time() + 30
        while "mix" in d.models() and time.time() < deadline:
            time.sleep(0.1)
        assert "mix" not in d.models()
        after_remove = d.models()["qwen"]
        # mix's share went to qwen; none of qwen's warm experts went anywhere
        assert after_remove["share_bytes"] > before["share_bytes"]
        assert after_remove["slots"] > before["slots"]
        assert after_remove["resident"] >= before["resident"]
        with pytest.raises(ServerError, match="unknown_model: model 'mix' is not served here"):
            Client(d.endpoint, model="mix")
        q1 = d.models()["qwen"]
        r = d.ctl.models("add", name="mix2", path=models["mix"])
        assert r["adding"] == "mix2" and r["endpoint"] == d.endpoint + ".mix2"
        with pytest.raises(ServerError, match="refused: model mix2 is already served"):
            d.ctl.models("add", name="mix2", path=models["mix"])
        deadline = time.time() + 120
        while "mix2" in d.ctl.models()["split"]["adding"] and time.time() < deadline:
            time.sleep(0.1)
        assert d.models()["mix2"]["state"] == "serving"
        q2 = d.models()["qwen"]
        # qwen gave the newcomer its share's cold tail only: what still fits stays resident
        assert q2["slots"] < q1["slots"]
        assert q2["resident"] >= min(q1["resident"], q2["slots"]) - 0
        m2 = step_client(d.endpoint, "mix2")
        assert not ask(m2, [[0, [0, 7]], [1, [3, 4]]])["bad"]
        m2.stdin.close()
        m2.wait(30)
        out, _ = free.communicate(timeout=300)
        res = json.loads(out.strip().splitlines()[-1])
    finally:
        if free is not None and free.poll() is None:
            free.kill()
        log = d.stop()
    assert res["errors"] == 0 and res["n_bad"] == 0, (res, log[-2000:])
    assert res["accesses"] == sum(len(e) for sets, _ in steps for _, e in sets)
    assert "model mix removed" in log and "model mix2 added" in log


def test_add_refusals(models, tmp_path):
    d = MultiDaemon(models, tmp_path, "1GiB")
    try:
        with pytest.raises(ServerError, match="refused: model qwen is already served"):
            d.ctl.models("add", name="qwen", path=models["qwen"])
        with pytest.raises(ServerError, match="refused: model x: path /nonexistent.gguf: expected "
                                              "an existing GGUF file"):
            d.ctl.models("add", name="x", path="/nonexistent.gguf")
        with pytest.raises(ServerError, match="refused: model name 'a b'"):
            d.ctl.models("add", name="a b", path=models["qwen"])
        # no room above the others' minimums: refused after indexing, said in the list
        d.ctl.models("add", name="big", path=models["mix"], min_budget=900 * MiB)
        deadline = time.time() + 60
        while "big" in d.ctl.models()["split"]["adding"] and time.time() < deadline:
            time.sleep(0.1)
        assert "minimum shares" in d.ctl.models()["split"]["failed"]["big"]
        assert set(d.models()) == {"qwen", "mix"}
        with pytest.raises(ServerError, match="refused: model qwen is served on the daemon's endpoint"):
            d.ctl.models("remove", name="qwen")
    finally:
        d.stop()


C_PROG = r"""
#include <stdio.h>
#include <stdlib.h>
#include "moecache.h"
int main(int argc, char **argv) {
    mc_options opt; mc_error err;
    mc_options_init(&opt);
    opt.model = argv[2];
    mc_client *c = mc_connect(argv[1], "c-multi", &opt, &err);
    if (!c) { printf("ERROR %s %s\n", mc_code_name(err.code), err.message); return 1; }
    const mc_arena *a = mc_arena_get(c, &err);
    if (!a) { printf("ERROR %s\n", err.message); return 1; }
    int layer = a->expert_layers[0], ex[2] = {0, 1};
    mc_lease *l = NULL;
    if (mc_acquire(c, layer, ex, 2, 0, -1, &l, &err) != 0) { printf("ERROR %s\n", err.message); return 1; }
    printf("N_EXPERTS %u LAYER %d\n", a->n_experts, layer);
    const mc_class *cl = &a->classes[mc_layer_class(a, layer)];
    for (uint32_t i = 0; i < 2; i++)
        for (uint32_t p = 0; p < cl->n_parts; p++) {
            uint64_t n = 0;
            const void *d = mc_lease_part(l, i, cl->parts[p].name, &n);
            char path[512];
            snprintf(path, sizeof path, "%s/%d_%s.bin", argv[3], ex[i], cl->parts[p].name);
            FILE *f = fopen(path, "wb"); fwrite(d, 1, n, f); fclose(f);
            printf("PART %d %s %s\n", ex[i], cl->parts[p].name, path);
        }
    mc_release(l);
    mc_close(c);
    return 0;
}
"""


def test_c_client_names_its_model(models, tmp_path):
    import shutil
    from moecached.tools.synth import verify_expert_bytes
    cdir = os.path.join(os.path.dirname(HERE), "clients", "c")
    if not shutil.which("cc") or not shutil.which("make"):
        pytest.skip("no C compiler or make")
    build = tmp_path / "cbuild"
    r = subprocess.run(["make", "-C", cdir, f"B={build}", f"{build}/libmoecache.a"],
                       capture_output=True, text=True)
    if r.returncode != 0 and "zmq.h" in r.stdout + r.stderr:
        pytest.skip("no libzmq headers")
    assert r.returncode == 0, r.stdout + r.stderr
    src = tmp_path / "multi.c"
    src.write_text(C_PROG)
    exe = tmp_path / "multi"
    r = subprocess.run(["cc", "-std=c11", "-I", os.path.join(cdir, "include"), str(src),
                        str(build / "libmoecache.a"), "-lzmq", "-lmsgpackc", "-lpthread",
                        "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = MultiDaemon(models, tmp_path, "1GiB")
    try:
        for model, n_experts in (("mix", 8), ("qwen", 128)):
            out = tmp_path / model
            out.mkdir()
            r = subprocess.run([str(exe), d.endpoint, model, str(out)], capture_output=True,
                               text=True, timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr
            lines = r.stdout.split("\n")
            assert lines[0].startswith(f"N_EXPERTS {n_experts} ")
            layer = int(lines[0].split()[3])
            parts = [x.split() for x in lines if x.startswith("PART")]
            assert len(parts) >= 4
            for _, e, part, path in parts:
                with open(path, "rb") as f:
                    assert verify_expert_bytes(f.read(), layer, part, int(e), 0) is None
        r = subprocess.run([str(exe), d.endpoint, "nope", str(tmp_path)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and "model 'nope' is not served here" in r.stdout
    finally:
        d.stop()


def test_sighup_adds_and_removes_models_of_the_file(models, tmp_path):
    import signal
    cfg = tmp_path / "m.toml"

    def write(names):
        cfg.write_text("".join(f'[[models]]\nname = "{n}"\npath = "{models[n.rstrip("2")]}"\n'
                               for n in names))
    write(["qwen", "mix"])
    d = MultiDaemon(models, tmp_path, "1GiB", config=cfg)
    try:
        write(["qwen", "mix2"])
        d.p.send_signal(signal.SIGHUP)
        deadline = time.time() + 60
        while set(d.models()) != {"qwen", "mix2"} and time.time() < deadline:
            time.sleep(0.1)
        assert set(d.models()) == {"qwen", "mix2"}
        assert d.models()["mix2"]["state"] == "serving"
    finally:
        log = d.stop()
    assert "model mix removed" in log and "model mix2 added" in log


def test_sighup_applies_a_live_key_to_every_model(models, tmp_path):
    # a key that changes live (here max_request_experts, which each model's socket announces in
    # its hello reply) reaches every model's socket, not only the first model's
    import signal
    cfg = tmp_path / "m.toml"

    def write(limit):
        cfg.write_text(f"max_request_experts = {limit}\n"
                       + "".join(f'[[models]]\nname = "{n}"\npath = "{models[n]}"\n' for n in ("qwen", "mix")))

    def limit_of(name):
        with Client(d.endpoint, model=name, fast_path=False) as c:
            return c.info["limits"]["max_request_experts"]
    write(64)
    d = MultiDaemon(models, tmp_path, "1GiB", config=cfg)
    try:
        assert limit_of("qwen") == limit_of("mix") == 64
        write(2)
        d.p.send_signal(signal.SIGHUP)
        deadline = time.time() + 30
        while limit_of("qwen") != 2 and time.time() < deadline:
            time.sleep(0.2)
        assert limit_of("qwen") == 2
        assert limit_of("mix") == 2, "the reloaded limit reached only the first model's socket"
    finally:
        d.stop()


def test_one_reader_queue_for_every_model(models, tmp_path):
    """The models of a daemon share one set of reader threads (``readers`` in all) and one
    queue: the daemon's threads grow by the change of ``readers``, not by it once per model,
    and both models' experts load bit-exact through it."""
    from moecached.tools.synth import verify_expert_bytes

    def tasks(d):
        return len(os.listdir(f"/proc/{d.p.pid}/task"))

    counts, stats = {}, {}
    for readers in (4, 12):
        (tmp_path / str(readers)).mkdir()
        d = MultiDaemon(models, tmp_path / str(readers), "1GiB", "--readers", str(readers),
                        "--split-interval", "86400")
        try:
            for name, experts in (("qwen", [3, 70, 127]), ("mix", [0, 5])):
                with Client(d.endpoint, model=name, fast_path=False) as c:
                    for layer in c.expert_layers:
                        with c.acquire(layer, experts) as lease:
                            for e in experts:
                                for part, view in lease.parts(e).items():
                                    assert verify_expert_bytes(view, layer, part, e, 0) is None
            stats[readers] = d.ctl.stats(), d.models()
            counts[readers] = tasks(d)
        finally:
            d.stop()
    assert counts[12] - counts[4] == 12 - 4, counts    # not (12 - 4) x 2 models
    for readers, (st, ms) in stats.items():
        rq = st["read_queue"]
        assert rq["threads"] == readers and rq["pools"] == 2, rq
        assert rq["queued_demand"] == rq["reading_demand"] == 0
        assert st["readers"]["threads"] == readers
        assert ms["qwen"]["bytes_read"] > 0 and ms["mix"]["bytes_read"] > 0
