"""llama-server through moecached: two servers share one daemon and answer as a resident one.

Needs the patched llama.cpp with its server (``clients/llama.cpp/build.sh --server``, or
``--tools``); skipped with one line when ``llama-server`` is not in the build. One daemon holds
every expert of a small runnable model; two ``llama-server -np 1 --moecached`` processes and a
resident ``llama-server`` (no daemon) get the same greedy requests over plain HTTP: the three
answer the same tokens and text, and the daemon read each expert at most once for both servers.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from daemon_util import start_daemon, stop_daemon
from moecache_client import Client
from moecached.engine.index import open_index
from moecached.tools import engine_llama
from moecached.tools.synth_runnable import write_runnable

BIN = engine_llama.llama_bin()
SERVER = BIN / "llama-server" if BIN else None
pytestmark = [pytest.mark.skipif(SERVER is None or not os.access(SERVER, os.X_OK),
                                 reason="patched llama-server not built: run clients/llama.cpp/build.sh --server "
                                        "(or set MOECACHED_LLAMA_BIN to its bin directory)"),
              pytest.mark.timeout(300)]
PROMPT = "Experts in shared memory, served to every engine."
N_PREDICT = 24
# the same flags for every server: one slot, one thread, the file's layout (no repacked CPU
# buffers, as the daemon-served model runs: the same kernels over the same bytes)
SERVER_ARGS = ["-np", "1", "-c", "512", "-t", "1", "-tb", "1", "--no-repack", "--no-webui"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(port: int, path: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    """GET (``body`` None) or POST JSON to 127.0.0.1:PORT; (status, decoded JSON reply)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class Server:
    """A llama-server process on 127.0.0.1 (a free port); its output goes to ``log``."""

    def __init__(self, model: str, log, *extra: str):
        self.port = free_port()
        self.log = log
        self.out = open(log, "w")
        self.p = subprocess.Popen([str(SERVER), "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
                                   *SERVER_ARGS, *extra],
                                  stdout=self.out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def tail(self, n: int = 3000) -> str:
        self.out.flush()
        with open(self.log, errors="replace") as f:
            return f.read()[-n:]

    def wait_ready(self, timeout: float = 90):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.p.poll() is None, f"llama-server exited {self.p.returncode}:\n{self.tail()}"
            try:
                if http(self.port, "/health", timeout=5)[0] == 200:
                    return
            except (OSError, ValueError):
                pass   # not listening yet, or answering while loading
            time.sleep(0.2)
        raise AssertionError(f"llama-server did not answer /health in {timeout:.0f} s:\n{self.tail()}")

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.out.close()


def ask(port: int) -> dict:
    """The same greedy request over both APIs: /completion (native, with the token ids) and
    /v1/completions (OpenAI-style). Returns {tokens, content, oai_text}."""
    st, r = http(port, "/completion", {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0, "seed": 1,
                                      "ignore_eos": True, "cache_prompt": False, "return_tokens": True})
    assert st == 200, r
    assert r["tokens_predicted"] == N_PREDICT and len(r["tokens"]) == N_PREDICT, r
    st, o = http(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": N_PREDICT, "temperature": 0,
                                          "seed": 1, "ignore_eos": True, "cache_prompt": False})
    assert st == 200, o
    assert o["usage"]["completion_tokens"] == N_PREDICT, o
    return {"tokens": r["tokens"], "content": r["content"], "oai_text": o["choices"][0]["text"]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama-server-model")
    return write_runnable(str(d / "q8_0.gguf"), arch="qwen3moe", blocks=3, experts=16, top_k=4,
                          quant="q8_0", seed=2)


def test_two_servers_through_one_daemon_answer_as_the_resident_server(model, tmp_path):
    idx = open_index(model).to_json()
    n_experts = len(idx["expert_layers"]) * idx["n_experts"]
    sock = str(tmp_path / "d.sock")
    servers: list[Server] = []
    with contextlib.ExitStack() as stack:
        p = start_daemon(model, sock, "--slots", str(n_experts))   # every expert fits: one copy each
        stack.callback(stop_daemon, p)
        for i in range(2):
            s = Server(model, tmp_path / f"served{i}.log", "--moecached", f"ipc://{sock}")
            stack.callback(s.stop)
            servers.append(s)
        resident = Server(model, tmp_path / "resident.log")
        stack.callback(resident.stop)
        for s in servers + [resident]:
            s.wait_ready()

        # the two served servers answer at the same time, then the resident one
        got, errors = {}, []

        def run(i):
            try:
                got[i] = ask(servers[i].port)
            except BaseException as e:   # noqa: BLE001 (reported below)
                errors.append(f"server {i}: {e!r}\n{servers[i].tail()}")
        ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not errors and len(got) == 2, "\n".join(errors) or "a request did not finish in 120 s"
        want = ask(resident.port)

        with Client(f"ipc://{sock}", name="test") as c:
            st = c.stats()
        pids = {s.p.pid for s in servers}
        for s in servers + [resident]:
            assert s.p.poll() is None, f"llama-server exited {s.p.returncode}:\n{s.tail()}"

    assert len(set(want["tokens"])) > 1, f"greedy decode is degenerate: {want['tokens']}"
    for i in range(2):
        assert got[i] == want, f"server {i} through the daemon answers {got[i]}, the resident one {want}"
    # one copy of each expert, both servers its clients and both served from it
    assert 0 < st["reads"] <= n_experts, st["reads"]
    mine = [c for c in st["clients"] if c["pid"] in pids]
    assert {c["pid"] for c in mine} == pids, st["clients"]
    for c in mine:
        assert c["acquires"] > 0 and c["hits"] + c["demand_misses"] > 0, c


@contextlib.contextmanager
def served(model, tmp_path):
    """A daemon holding every expert of ``model`` and a llama-server through it, ready. Yields
    (server, restart): restart(path, slots) stops the daemon and starts one on ``path`` with
    ``slots`` slots on the same socket."""
    idx = open_index(model).to_json()
    n_experts = len(idx["expert_layers"]) * idx["n_experts"]
    sock = str(tmp_path / "d.sock")
    daemon = [start_daemon(model, sock, "--slots", str(n_experts))]
    try:
        s = Server(model, tmp_path / "served.log", "--moecached", f"ipc://{sock}")
        try:
            s.wait_ready()

            def restart(path, slots):
                stop_daemon(daemon.pop())
                daemon.append(start_daemon(path, sock, "--slots", str(slots)))
            yield s, restart
        finally:
            s.stop()
    finally:
        for p in daemon:
            stop_daemon(p)


def refused(s: Server, body: dict) -> str:
    """``body`` to /completion of server ``s``, which answers an HTTP error and goes on running:
    the reply as text."""
    st, r = http(s.port, "/completion", body)
    assert s.p.poll() is None, f"llama-server exited {s.p.returncode}:\n{s.tail()}"
    assert st >= 400, (st, r)
    return json.dumps(r)


def test_a_server_whose_daemon_serves_another_model_answers_the_error_and_goes_on(model, tmp_path):
    """The daemon restarted on another model file of the same shape: the request under way gets
    the daemon's one-line error (an HTTP error, not a crash: llama-server took the failed decode
    for a full KV cache, halved its batch to 0 and aborted); the server keeps running, and once
    the daemon serves its model again it answers as before."""
    other = write_runnable(str(tmp_path / "other.gguf"), arch="qwen3moe", blocks=3, experts=16, top_k=4,
                           quant="q8_0", seed=3)
    idx = open_index(model).to_json()
    n_experts = len(idx["expert_layers"]) * idx["n_experts"]
    with served(model, tmp_path) as (s, restart):
        before = ask(s.port)
        restart(other, n_experts)
        msg = refused(s, {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0, "cache_prompt": False})
        assert "another model file" in msg and "other.gguf" in msg, msg
        restart(model, n_experts)
        after = ask(s.port)
        assert s.p.poll() is None, f"llama-server exited {s.p.returncode}:\n{s.tail()}"
    assert after == before, f"after the daemon served its model again: {after}, before: {before}"


def test_a_server_whose_daemon_restarts_with_fewer_slots_says_to_restart_it(model, tmp_path):
    """The daemon restarted with a smaller budget (a class of fewer slots than the server's model
    was attached to): a prompt's acquire planned for the old class is refused as too large, and
    the answer says why (another layout: restart the engine), not to raise the budget (which
    does not help unless the slots come back to the old count); the server keeps running."""
    with served(model, tmp_path) as (s, restart):
        ask(s.port)
        restart(model, open_index(model).to_json()["n_experts"] * 3 // 4)   # fewer than a prompt's experts of a block
        msg = refused(s, {"prompt": PROMPT * 4, "n_predict": 4, "temperature": 0, "cache_prompt": False})
        assert "another layout" in msg and "restart the engine" in msg and "raise the budget" not in msg, msg
        # /health says so while this daemon runs (every request would fail the same way) ...
        time.sleep(1.1)   # (past the shared probe's second)
        st, r = http(s.port, "/health")
        assert st == 503 and "another layout" in r["error"]["message"], (st, r)
        # ... and gives a restarted daemon another chance
        restart(model, open_index(model).to_json()["n_experts"] * len(open_index(model).to_json()["expert_layers"]))
        time.sleep(1.1)
        assert http(s.port, "/health") == (200, {"status": "ok"})



def test_health_says_503_while_the_daemon_does_not_answer(model, tmp_path):
    """/health of a server through the daemon: 200 while the daemon answers; 503 with the reason
    while it is stopped (no socket file) and after it was killed (a socket file nothing answers
    on), the server running on, a flood of checks sharing one probe a second; 200 again, and the
    same answer, once a daemon serves the model again. A resident server's /health does not look
    for a daemon."""
    idx = open_index(model).to_json()
    n_experts = len(idx["expert_layers"]) * idx["n_experts"]
    sock = str(tmp_path / "d.sock")
    daemon = start_daemon(model, sock, "--slots", str(n_experts))
    s = Server(model, tmp_path / "served.log", "--moecached", f"ipc://{sock}")
    try:
        s.wait_ready()
        before = ask(s.port)
        assert http(s.port, "/health") == (200, {"status": "ok"})
        stop_daemon(daemon)
        daemon = None
        time.sleep(1.1)   # (past the probe's answer the server shares for a second)
        st, r = http(s.port, "/health")
        assert st == 503 and "no daemon socket at" in r["error"]["message"] and sock in r["error"]["message"], (st, r)
        daemon = start_daemon(model, sock, "--slots", str(n_experts))
        time.sleep(1.1)
        assert http(s.port, "/health")[0] == 200
        daemon.kill()   # no goodbye: the socket file stays, nothing answers on it
        daemon.wait()
        daemon = None
        assert os.path.exists(sock)
        time.sleep(1.1)
        t0 = time.monotonic()
        st, r = http(s.port, "/health")
        assert st == 503 and "no answer from the daemon" in r["error"]["message"], (st, r)
        assert time.monotonic() - t0 < 10
        # a flood of health checks while nothing answers: one probe a second, shared; the
        # server stays up and every answer is the 503
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            t0 = time.monotonic()
            got = list(pool.map(lambda _: http(s.port, "/health", timeout=30)[0], range(256)))
        assert got == [503] * 256 and time.monotonic() - t0 < 15, (collections.Counter(got), time.monotonic() - t0)
        assert s.p.poll() is None, f"llama-server exited {s.p.returncode}:\n{s.tail()}"
        daemon = start_daemon(model, sock, "--slots", str(n_experts))
        time.sleep(1.1)
        assert http(s.port, "/health") == (200, {"status": "ok"})
        assert ask(s.port) == before
    finally:
        s.stop()
        if daemon is not None:
            stop_daemon(daemon)
    resident = Server(model, tmp_path / "resident.log")
    try:
        resident.wait_ready()
        assert http(resident.port, "/health") == (200, {"status": "ok"})
    finally:
        resident.stop()
