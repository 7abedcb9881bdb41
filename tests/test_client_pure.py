"""The client's pure-Python implementation (socket only): CI runs the client tests again in a
subprocess with MOECACHE_CLIENT_PURE=1, so both implementations pass the same tests."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CLIENT_TESTS = ["test_client_fast.py", "test_client_fast_daemon.py", "test_client_errors.py",
                "test_lease_validity.py"]


@pytest.mark.slow
@pytest.mark.timeout(900)   # its pytest run may take its 600 s
@pytest.mark.skipif(os.environ.get("MOECACHE_CLIENT_PURE", "") not in ("", "0"),
                    reason="already the pure implementation")
def test_client_tests_pass_without_the_extension():
    env = {**os.environ, "MOECACHE_CLIENT_PURE": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        *(str(HERE / t) for t in CLIENT_TESTS)],
                       cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout.splitlines()[-1]
