"""Several models in one daemon under one budget (``moecached.daemon.multi``), with real-layout synth
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
from moecached.engine.index import open_index
from moecached.tools.mixsim import MixModel, interleaving, replay_mix
from moecached.engine.trace import load_trace

from daemon_util import wait_for
from fixtures import file_bytes, make_model, trace_path

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


def lease_bad(lease, layer, experts, seed) -> list:
    """What is wrong with the bytes ``lease`` holds for ``experts`` of ``layer`` (synth stamps
    of ``seed``): empty when every part is right."""
    from moecached.tools.synth import verify_expert_bytes
    return [r for e in experts for part, view in lease.parts(e).items()
            if (r := verify_expert_bytes(view, layer, part, e, seed)) is not None]


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
        assert q.endpoint == d.endpoint + ".qwen" and m.endpoint == d.endpoint + ".mix"
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
        # the endpoint serves no model itself: its stats sum the models', engines' ops refused
        per = d.models()
        st = d.ctl.stats()
        assert st["hits"] + st["demand_misses"] == sum(x["hits"] + x["demand_misses"]
                                                       for x in per.values()) > 0
        assert st["bytes_read"] == sum(x["bytes_read"] for x in per.values())
        assert {x["name"] for x in st["models"]} == {"qwen", "mix"}
        assert d.ctl.status()["slots"] == sum(x["slots"] for x in per.values())
        with Client(d.endpoint, model="qwen", name="who", fast_path=False):
            st = d.ctl.stats()    # the models' clients, not the endpoint's redirected hellos
        assert [(x["name"], x["model"]) for x in st["clients"]] == [("who", "qwen")]
        assert st["server"]["requests"] > sum(1 for _ in st["clients"])
        assert st["shrink_events"] == 0      # cutting each arena to its share is no shrink
        with pytest.raises(ServerError, match="unknown_model: op acquire: the daemon's endpoint "
                                              "serves several models and none itself"):
            d.ctl.acquire(0, [1])
        out = subprocess.run([sys.executable, "-m", "moecached.tools.ctl", "stats", "-e",
                              d.endpoint], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        total_slots = sum(x["slots"] for x in per.values())
        assert f"of {total_slots} slots resident" in out.stdout, out.stdout
        assert "models    2 under one budget" in out.stdout and "  qwen (serving)" in out.stdout
        # the daemon was reached and said no: its line, not "cannot reach"
        out = subprocess.run([sys.executable, "-m", "moecached.tools.ctl", "stats", "-e",
                              d.endpoint, "--model", "zz"], capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and out.stdout == ""
        assert out.stderr.strip().splitlines() == [
            f"moecache-ctl stats: error: moecached at {d.endpoint} (endpoint from --endpoint): "
            "unknown_model: model 'zz' is not served here (served: qwen, mix)"], out.stderr
    finally:
        d.stop()


@pytest.mark.timeout(1200)   # 480 s seen on 2 busy cores
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
        m = Client(d.endpoint, model="mix", fast_path=False)
        held = m.acquire(m.expert_layers[1], [2, 3])    # held across the removal
        free = subprocess.Popen([sys.executable, os.path.join(HERE, "mix_client.py"), d.endpoint,
                                 "qwen", "0", "--free", str(sf), "40"],
                                stdout=subprocess.PIPE, text=True)
        wait_for(lambda: d.models()["qwen"]["resident"] >= d.models()["qwen"]["slots"],
                 "qwen's share filled", 60)
        before = d.models()["qwen"]
        assert before["resident"] == before["slots"]   # warm: its share is full
        assert free.poll() is None                     # and still decoding
        r = d.ctl.models("remove", name="mix")
        assert r["removing"] == "mix"
        with pytest.raises(ServerError, match="unknown_model: model 'mix' is being removed"):
            Client(d.endpoint, model="mix")
        time.sleep(1.5)                              # a few periodic ticks: still draining
        assert d.models()["mix"]["state"] == "removing"
        assert lease_bad(held, m.expert_layers[1], (2, 3), 0) == []   # its lease is still right
        held.release()
        m.close()
        wait_for(lambda: "mix" not in d.models(), "mix removed", 30)
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
        wait_for(lambda: "mix2" not in d.ctl.models()["split"]["adding"], "mix2 added", 120)
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
        # only files under model_dirs (by default the configured models' directories), and one
        # answer for a missing file and an unreadable one (docs/operations.md, "Security model")
        with pytest.raises(ServerError, match="refused: models add: /nonexistent.gguf is not under "
                                              "model_dirs"):
            d.ctl.models("add", name="x", path="/nonexistent.gguf")
        missing = os.path.join(os.path.dirname(models["qwen"]), "nope.gguf")
        with pytest.raises(ServerError, match=f"refused: models add: {missing}: no file under "
                                              "model_dirs there that uid 0 can read"):
            d.ctl.models("add", name="x", path=missing)
        with pytest.raises(ServerError, match="refused: model name 'a b'"):
            d.ctl.models("add", name="a b", path=models["qwen"])
        # no room above the others' minimums: refused after indexing, said in the list
        d.ctl.models("add", name="big", path=models["mix"], min_budget=900 * MiB)
        wait_for(lambda: "big" not in d.ctl.models()["split"]["adding"], "big refused", 60)
        assert "minimum shares" in d.ctl.models()["split"]["failed"]["big"]
        assert set(d.models()) == {"qwen", "mix"}
        with pytest.raises(ServerError, match=r"refused: model 'nope' is not served here"):
            d.ctl.models("remove", name="nope")
        # bounds and weights are refused naming the bound, not the split's arithmetic
        for fields, why in (({"max_budget": 1 << 20}, "max_budget 1048576 bytes is below the "
                             "least it is served with"),
                            ({"weight": 0}, "weight = 0.0: expected a number > 0")):
            d.ctl.models("add", name="w", path=models["mix"], **fields)
            wait_for(lambda: "w" not in d.ctl.models()["split"]["adding"], "w refused", 60)
            assert why in d.ctl.models()["split"]["failed"]["w"]
        # not a GGUF file: one line naming it once, without quoting its bytes
        junk = os.path.join(os.path.dirname(models["qwen"]), f"junk-{os.getpid()}.gguf")  # in model_dirs
        with open(junk, "w") as f:
            f.write("root:x:0:0:root:/root:/bin/bash\n")
        try:
            d.ctl.models("add", name="junk", path=junk)
            wait_for(lambda: "junk" not in d.ctl.models()["split"]["adding"], "junk refused", 60)
        finally:
            os.unlink(junk)
        assert d.ctl.models()["split"]["failed"]["junk"] == (
            f"model junk: {junk}: not a GGUF file (expected the magic GGUF at its start)")
        # every model removed: the daemon serves none, and says so
        for n in ("qwen", "mix"):
            d.ctl.models("remove", name=n)
        wait_for(lambda: not d.models(), "every model removed")
        with pytest.raises(ServerError, match=r"unknown_model: this daemon serves no model now"):
            Client(d.endpoint)
        out = subprocess.run([sys.executable, "-m", "moecached.tools.ctl", "model", "list", "-e",
                              d.endpoint], capture_output=True, text=True, timeout=60)
        assert out.stdout.startswith("no model served now"), out.stdout + out.stderr
    finally:
        log = d.stop()
    assert "its share went to no model" in log


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


def c_program(tmp_path, text, name):
    """``text`` built against the C client library; the executable's path (skips without a C
    toolchain or libzmq headers)."""
    import shutil
    cdir = os.path.join(os.path.dirname(HERE), "clients", "c")
    if not shutil.which("cc") or not shutil.which("make"):
        pytest.skip("no C compiler or make")
    build = tmp_path / "cbuild"
    r = subprocess.run(["make", "-C", cdir, f"B={build}", f"{build}/libmoecache.a"],
                       capture_output=True, text=True)
    if r.returncode != 0 and "zmq.h" in r.stdout + r.stderr:
        pytest.skip("no libzmq headers")
    assert r.returncode == 0, r.stdout + r.stderr
    src = tmp_path / f"{name}.c"
    src.write_text(text)
    exe = tmp_path / name
    r = subprocess.run(["cc", "-std=c11", "-I", os.path.join(cdir, "include"), str(src),
                        str(build / "libmoecache.a"), "-lzmq", "-lmsgpackc", "-lpthread",
                        "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe


def test_c_client_names_its_model(models, tmp_path):
    from moecached.tools.synth import verify_expert_bytes
    exe = c_program(tmp_path, C_PROG, "multi")
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
        wait_for(lambda: set(d.models()) == {"qwen", "mix2"}, "the file's models served", 60)
        assert set(d.models()) == {"qwen", "mix2"}
        assert d.models()["mix2"]["state"] == "serving"
        # removed by hand, still in the file: a SIGHUP that does not change its table leaves
        # it removed (the file is compared with the file, not with what is served)
        d.ctl.models("remove", name="qwen")
        wait_for(lambda: "qwen" not in d.models(), "qwen removed")
        cfg.write_text("client_rate_burst = 5000\n" + cfg.read_text())
        d.p.send_signal(signal.SIGHUP)


        def burst():
            with Client(d.endpoint, model="mix2", fast_path=False) as c:
                return c.info["limits"]["client_rate_burst"]
        wait_for(lambda: burst() == 5000, "the reload applied")
        assert set(d.models()) == {"mix2"}
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
        wait_for(lambda: limit_of("qwen") == 2, "the new limit on qwen's socket", 30)
        assert limit_of("qwen") == 2
        assert limit_of("mix") == 2, "the reloaded limit reached only the first model's socket"
    finally:
        d.stop()


def test_any_model_can_be_removed_and_added_back(models, tmp_path):
    # the model named first is no different: removed while its client holds a lease and the
    # other model's client decodes, then added back under its name
    d = MultiDaemon(models, tmp_path, "1GiB", "--split-interval", "86400")
    mc = None
    try:
        q = Client(d.endpoint, model="qwen", fast_path=False)
        held = q.acquire(q.expert_layers[0], [3, 4])
        mc = step_client(d.endpoint, "mix")
        assert not ask(mc, [[0, [0, 1]], [1, [2, 3]]])["bad"]
        r = d.ctl.models("remove", name="qwen")
        assert (r["removing"], r["leases"]) == ("qwen", 1)
        with pytest.raises(ServerError, match="unknown_model: model 'qwen' is being removed"):
            Client(d.endpoint, model="qwen")
        assert not ask(mc, [[0, [4, 5]], [1, [6, 7]]])["bad"]   # mix goes on meanwhile
        assert lease_bad(held, q.expert_layers[0], (3, 4), 0) == []   # the held lease is still right
        held.release()
        q.close()
        wait_for(lambda: "qwen" not in d.models(), "qwen removed", 30)
        assert set(d.models()) == {"mix"}
        assert d.models()["mix"]["share_bytes"] == d.ctl.models()["split"]["total_bytes"] or \
            d.models()["mix"]["share_bytes"] == d.models()["mix"]["max_bytes"]
        # one model left: a hello naming none is sent to it
        with Client(d.endpoint, fast_path=False) as only:
            assert only.info["model_name"] == "mix" and only.endpoint == d.endpoint + ".mix"
        assert not ask(mc, [[0, [0, 7]], [1, [1, 2]]])["bad"]
        d.ctl.models("add", name="qwen", path=models["qwen"])
        wait_for(lambda: "qwen" not in d.ctl.models()["split"]["adding"], "qwen added back", 120)
        assert d.models()["qwen"]["state"] == "serving"
        qc = step_client(d.endpoint, "qwen")
        assert not ask(qc, [[0, [0, 127]], [1, [5, 6]]])["bad"]
        qc.stdin.close()
        qc.wait(30)
        assert not ask(mc, [[0, [3, 4]], [1, [5, 6]]])["bad"]
        st = d.ctl.stats()     # the removed model's reads still count in the daemon's total
        assert st["bytes_read"] > sum(x["bytes_read"] for x in st["models"])
    finally:
        if mc is not None:
            mc.stdin.close()
            mc.wait(30)
        log = d.stop()
    assert "model qwen removed" in log and "model qwen added" in log, log[-2000:]


def test_client_of_a_removed_model_is_refused_then_recovers(models, tmp_path):
    # a client whose model goes away says its next hello to the daemon's endpoint (the
    # model's own socket is gone): refused at once with the daemon's line, and served again,
    # the same client, once the model is added back
    d = MultiDaemon(models, tmp_path, "1GiB", "--split-interval", "86400")
    try:
        q = Client(d.endpoint, model="qwen", fast_path=False, connect_timeout=20)
        layer = q.expert_layers[0]
        with q.acquire(layer, [3, 4]) as lease:
            assert lease_bad(lease, layer, (3, 4), 0) == []
        d.ctl.models("remove", name="qwen")
        wait_for(lambda: "qwen" not in d.models(), "qwen removed", 30)
        wait_for(lambda: q.session is None, "the client saw its model's socket go", 30)
        for _ in range(2):    # every call until the model is back
            with pytest.raises(ServerError, match=r"^unknown_model: model 'qwen' is not served "
                                                  r"here \(served: mix\)"):
                q.acquire(layer, [3, 4])
        d.ctl.models("add", name="qwen", path=models["qwen"])
        wait_for(lambda: "qwen" not in d.ctl.models()["split"]["adding"], "qwen added back", 120)
        with q.acquire(layer, [5, 127]) as lease:
            assert lease_bad(lease, layer, (5, 127), 0) == []
        assert q.endpoint == d.endpoint + ".qwen"
        q.close()
    finally:
        d.stop()


C_RECOVER_PROG = r"""
#include <stdio.h>
#include "moecache.h"
/* one acquire of experts 3 and 4 per line read; its parts are written to argv[3] */
int main(int argc, char **argv) {
    mc_options opt; mc_error err;
    mc_options_init(&opt);
    opt.model = argv[2];
    opt.fast_path = 0;
    mc_client *c = mc_connect(argv[1], "c-recover", &opt, &err);
    if (!c) { printf("ERROR %s %s\n", mc_code_name(err.code), err.message); return 1; }
    char line[64];
    int n = 0;
    printf("READY\n"); fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
        const mc_arena *a = NULL;
        mc_lease *l = NULL;
        int r = 0, ex[2] = {3, 4};
        for (int tries = 0; tries < 5; tries++) {   /* a call in flight when the socket went */
            a = mc_arena_get(c, &err);
            r = a ? mc_acquire(c, a->expert_layers[0], ex, 2, 0, -1, &l, &err) : err.code;
            if (r != MC_ERR_RESTARTED) break;
        }
        if (r != 0) {
            printf("ERROR %s %s\n", err.daemon_code, err.message);
            fflush(stdout);
            continue;
        }
        int layer = a->expert_layers[0];
        const mc_class *cl = &a->classes[mc_layer_class(a, layer)];
        n++;
        for (uint32_t i = 0; i < 2; i++)
            for (uint32_t p = 0; p < cl->n_parts; p++) {
                uint64_t nb = 0;
                const void *d = mc_lease_part(l, i, cl->parts[p].name, &nb);
                char path[512];
                snprintf(path, sizeof path, "%s/%d_%d_%s.bin", argv[3], n, ex[i], cl->parts[p].name);
                FILE *f = fopen(path, "wb"); fwrite(d, 1, nb, f); fclose(f);
                printf("PART %d %d %s %s\n", layer, ex[i], cl->parts[p].name, path);
            }
        mc_release(l);
        printf("OK\n"); fflush(stdout);
    }
    mc_close(c);
    return 0;
}
"""


def test_c_client_of_a_removed_model_is_refused_then_recovers(models, tmp_path):
    from moecached.tools.synth import verify_expert_bytes
    exe = c_program(tmp_path, C_RECOVER_PROG, "recover")
    out = tmp_path / "parts"
    out.mkdir()
    d = MultiDaemon(models, tmp_path, "1GiB", "--split-interval", "86400")
    p = None

    def call():
        p.stdin.write("acquire\n")
        p.stdin.flush()
        lines = []
        while True:
            line = p.stdout.readline().rstrip("\n")
            assert line, "the C client exited"
            if line.startswith("ERROR"):
                return line, lines
            if line == "OK":
                return None, lines
            lines.append(line.split())

    def check(parts):
        assert len(parts) >= 4
        for _, layer, e, part, path in parts:
            with open(path, "rb") as f:
                assert verify_expert_bytes(f.read(), int(layer), part, int(e), 0) is None

    try:
        p = subprocess.Popen([str(exe), d.endpoint, "qwen", str(out)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "READY\n"
        err, parts = call()
        assert err is None, err
        check(parts)
        d.ctl.models("remove", name="qwen")
        wait_for(lambda: "qwen" not in d.models(), "qwen removed", 30)
        for _ in range(2):
            err, _ = call()
            assert err == ("ERROR unknown_model hello: unknown_model: model 'qwen' is not served "
                           "here (served: mix)"), err
        d.ctl.models("add", name="qwen", path=models["qwen"])
        wait_for(lambda: "qwen" not in d.ctl.models()["split"]["adding"], "qwen added back", 120)
        err, parts = call()
        assert err is None, err
        check(parts)
    finally:
        if p is not None:
            p.stdin.close()
            p.wait(60)
        d.stop()


@pytest.fixture
def own_models(models, tmp_path):
    """Private copies of the two models (a test rewrites one), and qwen written with seed 1."""
    import shutil
    from fixtures import make_model as mk
    d = tmp_path / "own"
    d.mkdir()
    out = {}
    for n, p in models.items():
        out[n] = str(d / f"{n}.gguf")
        shutil.copyfile(p, out[n])
    other = mk(tmp_path, "qwen3-30b-a3b-Q4_K_M", layers=2, experts=128, seed=1)
    return out, other


def test_changed_model_file_is_reloaded_alone(own_models, tmp_path):
    import shutil
    from moecache_client import DaemonRestarted
    paths, other = own_models
    d = MultiDaemon(paths, tmp_path, "1GiB", "--on-model-change", "reload")
    try:
        q = Client(d.endpoint, model="qwen", fast_path=False)
        m = Client(d.endpoint, model="mix", fast_path=False)
        L, ML = q.expert_layers[0], m.expert_layers[1]
        mheld = m.acquire(ML, [1, 2])
        qheld = q.acquire(L, [7])
        s_q, s_m = q.stats()["session"], m.stats()["session"]
        hits0 = d.ctl.stats()["hits"] + d.ctl.stats()["demand_misses"]
        assert hits0 >= 3
        tmp = paths["qwen"] + ".new"
        shutil.copyfile(other, tmp)
        os.rename(tmp, paths["qwen"])          # qwen's file replaced by another build
        wait_for(lambda: d.models()["qwen"]["reloads"] == 1, "qwen re-indexed", 60)
        assert not qheld.valid()               # qwen's old session is void
        got = None
        for _ in range(3):
            try:
                got = q.acquire(L, [7, 8])
                break
            except DaemonRestarted:
                continue
        assert got is not None and q.stats()["session"] != s_q
        assert lease_bad(got, L, (7, 8), 1) == []          # the new file's bytes (seed 1)
        got.release()
        # mix was not touched: same session, its lease still valid and right
        assert m.stats()["session"] == s_m and mheld.valid()
        assert lease_bad(mheld, ML, (1, 2), 0) == []
        mheld.release()
        assert d.models()["qwen"]["state"] == "serving" and d.ctl.status()["state"] == "serving"
        st = d.ctl.stats()   # the counts of qwen's retired cache stay in the daemon's totals
        assert st["hits"] + st["demand_misses"] >= hits0 + 2
        q.close()
        m.close()
    finally:
        log = d.stop()
    assert "model qwen" in log and "re-indexed and reloaded" in log, log[-2000:]


def test_changed_model_file_exit_mode(own_models, tmp_path):
    paths, other = own_models
    d = MultiDaemon(paths, tmp_path, "1GiB", "--on-model-change", "exit")
    try:
        with open(other, "rb") as f, open(paths["mix"], "r+b") as g:   # in place, same size
            g.write(f.read(4096))
        d.p.wait(30)   # noticed by the watch (or the model's periodic check)
    finally:
        log = d.stop()
    assert d.p.returncode == 3, log[-2000:]
    assert "on_model_change = \"exit\"" in log
def _check_bytes(endpoint, name, path, per_acquire):
    """Acquire every expert of ``name`` (``per_acquire`` at a time) and compare each part with
    the model file; returns the mismatches."""
    idx = open_index(path)
    bad = []
    with Client(endpoint, model=name, fast_path=False) as c:
        for layer in c.expert_layers:
            for lo in range(0, c.n_experts, per_acquire):
                ex = list(range(lo, min(lo + per_acquire, c.n_experts)))
                with c.acquire(layer, ex) as lease:
                    bad += _compare_with_file(lease, idx, layer, ex)
    return bad


def _compare_with_file(lease, idx, layer, experts):
    return [f"layer {layer} expert {e} {part}" for e in experts
            for part, want in file_bytes(idx, layer, e).items() if bytes(lease.parts(e)[part]) != want]


@pytest.mark.slow
def test_memory_floor_shrinks_the_total_and_every_share(models, tmp_path):
    """Available memory falls under the floor (a process holds memory for real, as in
    tests/test_guard.py): the floor shrinks the daemon's total, the split absorbs it (every
    model's share shrinks, none below its minimum, every cache follows its share), every model
    serves the file's bytes during and after (a lease held across the shrink too), stats and
    status show the floor and the shares; when the memory comes back the total grows back."""
    import psutil
    from daemon_util import memory_hog, wait_for
    from moecached.daemon.floor import MIN_MARGIN
    from moecached.tools.ctlstats import summary
    GiB = 1 << 30
    avail = psutil.virtual_memory().available
    if avail < 6 * GiB:
        pytest.skip(f"needs 6 GiB available, have {avail >> 20} MiB")
    budget = 2 * GiB
    # the arenas in tmpfs, as in service: a shrink punches holes and gives memory back for real;
    # the floor 1.5 GiB under what is available once they are reserved
    floor = avail - budget - 3 * GiB // 2
    d = MultiDaemon(models, tmp_path, budget, "--arena-dir", "/dev/shm", "--floor", str(floor),
                    "--floor-hysteresis", "64MiB", "--floor-interval", "0.2",
                    "--floor-min-change", "0.5", "--split-interval", "86400")
    paths = {"qwen": models["qwen"], "mix": models["mix"]}
    per_acquire = {"qwen": 8, "mix": 2}
    try:
        before = d.models()
        st = d.ctl.stats()
        assert st["floor"]["shrinks"] == 0 and st["floor"]["configured_budget"] == budget, st["floor"]
        assert d.ctl.models()["split"]["total_bytes"] == budget
        for n, m in before.items():   # room to shrink above every minimum
            assert m["min_bytes"] < m["share_bytes"] - 256 * MiB, m
        for n in paths:
            assert _check_bytes(d.endpoint, n, paths[n], per_acquire[n]) == []
        held = {n: Client(d.endpoint, model=n, fast_path=False) for n in paths}
        leases = {n: c.acquire(c.expert_layers[1], [0, 1]) for n, c in held.items()}
        # up to 1 GiB under the floor (the floor may act before the hog holds it all)
        hog = psutil.virtual_memory().available - floor + 1024 * MiB
        with memory_hog(hog):
            last = {}

            def shrunk():
                last["st"] = d.ctl.stats()
                return last["st"] if last["st"]["floor"]["shrinks"] >= 1 else None
            try:
                st = wait_for(shrunk, "the floor to shrink", timeout=90)
            except AssertionError:
                raise AssertionError(f"the floor did not shrink: {last['st']['floor']}, "
                                     f"available now {psutil.virtual_memory().available}") from None
            # one reply: the floor, the split and the models as the endpoint's loop saw them
            # together (the floor may shrink again between two replies)
            total = st["floor"]["current_budget"]
            assert total <= budget - MIN_MARGIN, st["floor"]   # the deficit and a margin
            after = {m["name"]: m for m in st["models"]}
            split = st["split"]
            assert split["total_bytes"] == total, (split, st["floor"])
            assert sum(m["share_bytes"] for m in after.values()) == total
            for n, m in after.items():
                assert m["min_bytes"] <= m["share_bytes"] < before[n]["share_bytes"], (n, m, before[n])
                assert m["budget_current_bytes"] <= m["share_bytes"], (n, m)   # the cache follows
                assert m["slots"] <= before[n]["slots"], (n, m, before[n])
            assert sum(m["slots"] for m in after.values()) < sum(m["slots"] for m in before.values())
            # the view operators read: the floor's numbers and each model's share
            assert st["floor"]["floor_bytes"] == floor and st["floor"]["configured_budget"] == budget
            lines = summary(st)
            assert f"models    2 under one budget of {total / GiB:.2f} GiB" in "\n".join(lines), lines
            assert any(x.startswith("floor     ") and f"budget {total / GiB:.2f} GiB of 2.00 GiB, "
                       f"{st['floor']['shrinks']} shrinks, 0 grows" in x for x in lines), lines
            for n, m in after.items():
                assert any(x.startswith(f"  {n} (serving): share {m['share_bytes'] / GiB:.2f} GiB")
                           for x in lines), lines
            status = d.ctl.status()   # its own snapshot: the shares add up to the floor's total
            assert sum(m["share_bytes"] for m in status["models"]) == \
                status["floor"]["current_budget"] <= total
            # serving right bytes under pressure: the held leases, then every expert again
            idxs = {n: open_index(p) for n, p in paths.items()}
            for n, lease in leases.items():
                assert _compare_with_file(lease, idxs[n], held[n].expert_layers[1], [0, 1]) == []
                lease.release()
                held[n].close()
            for n in paths:
                assert _check_bytes(d.endpoint, n, paths[n], per_acquire[n]) == []
        # the memory is back: the total grows back to the budget, the shares with it
        st = wait_for(lambda: (lambda s: s if s["floor"]["current_budget"] == budget else None)(d.ctl.stats()),
                      "the total to grow back", timeout=60)
        assert st["floor"]["grows"] >= 1
        assert d.ctl.models()["split"]["total_bytes"] == budget
        grown = d.models()
        for n, m in grown.items():   # every share and every slot back
            assert (m["share_bytes"], m["slots"]) == (before[n]["share_bytes"], before[n]["slots"]), \
                (n, m, before[n])
        for n in paths:
            assert _check_bytes(d.endpoint, n, paths[n], per_acquire[n]) == []
    finally:
        log = d.stop()
    assert "Traceback" not in log, log[-3000:]


def test_sighup_turns_the_floor_on_and_off(models, tmp_path):
    # with several models the floor's keys reload live too: on, it drives the split's total
    # (here a floor above all the memory there is: the total falls to the models' minimums);
    # off, the total is the budget again
    import signal
    import psutil
    cfg = tmp_path / "m.toml"
    tables = "".join(f'[[models]]\nname = "{n}"\npath = "{models[n]}"\n' for n in ("qwen", "mix"))
    cfg.write_text(tables)
    d = MultiDaemon(models, tmp_path, "1GiB", "--split-interval", "86400", config=cfg)
    try:
        q = Client(d.endpoint, model="qwen", fast_path=False)
        held = q.acquire(q.expert_layers[0], [1, 2])
        before = d.models()
        high = psutil.virtual_memory().total + (8 << 30)
        cfg.write_text(f"floor = {high}\nfloor_interval_s = 0.2\n" + tables)
        d.p.send_signal(signal.SIGHUP)
        least = sum(m["min_bytes"] for m in before.values())
        wait_for(lambda: d.ctl.models()["split"]["total_bytes"] == least, "the total at the minimums")
        ms = d.models()
        assert all(ms[n]["share_bytes"] == ms[n]["min_bytes"] < before[n]["share_bytes"] for n in ms)
        assert d.ctl.stats()["floor"]["shrinks"] >= 1
        assert lease_bad(held, q.expert_layers[0], (1, 2), 0) == []
        held.release()
        with q.acquire(q.expert_layers[1], [5, 6, 7]) as lease:   # still serving, right bytes
            assert lease_bad(lease, q.expert_layers[1], (5, 6, 7), 0) == []
        cfg.write_text(tables)                                        # floor off
        d.p.send_signal(signal.SIGHUP)
        wait_for(lambda: d.ctl.models()["split"]["total_bytes"] == 1 << 30, "the total back")
        assert {n: m["share_bytes"] for n, m in d.models().items()} == \
            {n: m["share_bytes"] for n, m in before.items()}
        q.close()
    finally:
        log = d.stop()
    assert "memory floor off" in log, log[-3000:]


def test_one_reader_queue_for_every_model(models, tmp_path):
    """The models of a daemon share one set of reader threads (``readers`` in all) and one
    queue: the daemon's threads grow by the change of ``readers``, not by it once per model,
    and both models' experts load bit-exact through it."""

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
                            assert lease_bad(lease, layer, experts, 0) == []
                    assert c.stats()["readers"]["threads"] == readers   # the model's view
            stats[readers] = d.ctl.stats(), d.models()
            counts[readers] = tasks(d)
        finally:
            d.stop()
    assert counts[12] - counts[4] == 12 - 4, counts    # not (12 - 4) x 2 models
    for readers, (st, ms) in stats.items():
        rq = st["read_queue"]
        assert rq["threads"] == readers and rq["pools"] == 2, rq
        assert rq["queued_demand"] == rq["reading_demand"] == 0
        assert ms["qwen"]["bytes_read"] > 0 and ms["mix"]["bytes_read"] > 0


def test_remove_waits_for_shared_memory_pins(models, tmp_path):
    # a lease taken through shared memory (no message: the daemon sees the pin, not a lease)
    # holds a removal like a lease granted over the socket
    d = MultiDaemon(models, tmp_path, "1GiB", "--split-interval", "86400")
    try:
        m = Client(d.endpoint, model="mix")          # the shared-memory hit path on
        L = m.expert_layers[0]
        m.acquire(L, [5, 6]).release()               # resident now
        held = m.acquire(L, [5, 6])                  # a hit: taken through shared memory
        wait_for(lambda: d.models()["mix"]["fast_pins"] == 2, "the pins seen by the daemon")
        r = d.ctl.models("remove", name="mix")
        assert (r["leases"], r["fast_pins"]) == (0, 2), r
        time.sleep(1.5)                              # a few periodic ticks: still draining
        assert d.models()["mix"]["state"] == "removing"
        assert held.valid() and lease_bad(held, L, (5, 6), 0) == []
        held.release()
        wait_for(lambda: "mix" not in d.models(), "mix removed once its pins are gone")
        m.close()
    finally:
        log = d.stop()
    assert "0 leases and 2 shared-memory pins to drain" in log, log[-2000:]


def test_changed_model_that_no_longer_fits_is_removed_alone(own_models, tmp_path):
    # qwen's file becomes a model whose least share does not fit beside mix's minimum: qwen
    # cannot be served again and is removed, with one line; mix goes on untouched
    import shutil
    paths, _ = own_models
    d = MultiDaemon(paths, tmp_path, "600MiB", "--on-model-change", "reload")
    try:
        m = Client(d.endpoint, model="mix", fast_path=False)
        ML = m.expert_layers[0]
        held = m.acquire(ML, [1, 2])
        s_m = m.stats()["session"]
        tmp = paths["qwen"] + ".new"
        shutil.copyfile(paths["mix"], tmp)      # a Mixtral where qwen was: 436 MiB at least
        os.rename(tmp, paths["qwen"])
        wait_for(lambda: "qwen" not in d.models(), "qwen removed", 60)
        assert "minimum shares" in d.ctl.models()["split"]["failed"]["qwen"]
        assert m.stats()["session"] == s_m and held.valid()
        assert lease_bad(held, ML, (1, 2), 0) == []
        held.release()
        with m.acquire(m.expert_layers[1], [3, 4]) as lease:
            assert lease_bad(lease, m.expert_layers[1], (3, 4), 0) == []
        with pytest.raises(ServerError, match="unknown_model: model 'qwen' is not served here"):
            Client(d.endpoint, model="qwen")
        m.close()
    finally:
        log = d.stop()
    assert "model qwen re-indexed but not served again" in log, log[-2000:]
