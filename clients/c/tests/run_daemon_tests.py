"""Run the C tests that need a real daemon, and the replay example.

    python tests/run_daemon_tests.py BUILD_DIR

Makes a small synthetic model (tests/fixtures.make_model), writes where each expert part lies
in it (dump_expect.py), then runs BUILD_DIR/test_daemon (which starts and stops daemons itself)
and BUILD_DIR/replay over a generated routing trace. Exit status: the first failure's.
"""
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path[:0] = [str(REPO), str(REPO / "clients"), str(REPO / "tests")]


def main(build: str) -> int:
    import numpy as np
    from fixtures import make_model
    from dump_expect import main as dump

    with tempfile.TemporaryDirectory(prefix="mc-ctest-", dir="/tmp") as d:
        model = make_model(d, "qwen3-30b-a3b-Q4_K_M", layers=4, experts=8)
        expect = os.path.join(d, "expect.txt")
        dump(model, expect)
        env = dict(os.environ, MC_PYTHON=sys.executable, MC_MODEL=model, MC_EXPECT=expect, MC_DIR=d,
                   PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "clients")] +
                                              ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
        print("== test_fake (scripted daemon)", flush=True)
        r = subprocess.call([sys.executable, str(HERE / "fake_daemon.py"), build, d], env=env)
        if r:
            return r
        print("== test_daemon", flush=True)
        r = subprocess.call([os.path.join(build, "test_daemon")], env=env)
        if r:
            sys.stdout.write(Path(d, "daemon.log").read_text() if Path(d, "daemon.log").exists() else "")
            return r
        # a routing trace as text: one line per token per MoE layer, "token layer e1 e2 ..."
        rng = np.random.default_rng(1)
        trace = os.path.join(d, "trace.txt")
        with open(trace, "w") as f:
            for t in range(24):
                for layer in range(4):
                    ids = rng.choice(8, size=4, replace=False, p=np.array([8, 6, 4, 3, 2, 1, 1, 1]) / 26)
                    f.write(f"{t} {layer} {' '.join(map(str, ids))}\n")
        sock = os.path.join(d, "r.sock")
        p = subprocess.Popen([sys.executable, "-P", "-m", "moecached.daemon", "--model", model, "--endpoint",
                              f"ipc://{sock}", "--no-lock-memory", "--slots", "16"], env=env,
                             stdout=open(os.path.join(d, "replay-daemon.log"), "w"), stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 60
            while not os.path.exists(sock) and p.poll() is None and time.time() < deadline:
                time.sleep(0.05)   # a client refuses an ipc endpoint without a socket file
            print("== replay", flush=True)
            r = subprocess.call([os.path.join(build, "replay"), f"ipc://{sock}", trace, expect], env=env)
        finally:
            p.terminate()
            p.wait(15)
        return r


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
