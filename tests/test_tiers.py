"""The test tiers of tests/conftest.py keep their word: the fast tier (``pytest -m fast``, the
inner loop of README.md) starts no daemon process and builds nothing, yet still covers the core;
and a test that starts a daemon process without being sorted as ``daemon`` fails, naming itself.
Both look from outside, through a pytest subprocess (collect-only for the first)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# what no test of the fast tier may name in its own source, whatever conftest's sorting says
HEAVY_SOURCE = re.compile(r"start_daemon|[\"']moecached\.(daemon|tools\.ctl)[\"']|memory_hog|\bHOG\b|"
                          r"engine_llama|[\"']make[\"']|\b_make\(")
# modules whose unit and in-process tests the fast tier must keep
CORE = ["test_cache.py", "test_readers.py", "test_index.py", "test_policies.py", "test_policy_suite.py",
        "test_server.py", "test_protocol_fuzz.py", "test_config.py", "test_split.py", "test_load_lifecycle.py",
        "test_arena.py", "test_trace.py", "test_floor.py", "test_refusals.py"]
# modules that only start daemons, soak or build: none of their tests is fast
HEAVY_MODULES = ["test_soak.py", "test_soak_prefetch.py", "test_daemon_processes.py", "test_c_client.py",
                 "test_fast_path_daemon.py", "test_client_fast_daemon.py", "test_multi_model.py", "test_service.py"]


def _pytest(*args, cwd=HERE.parent, env=None):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow   # collects the whole suite (its source names what it looks for, so conftest sorts it heavy)
def test_fast_tier_starts_no_daemons_and_builds_nothing(tmp_path):
    dump = tmp_path / "fast.json"
    r = _pytest("--collect-only", "-m", "fast", env=dict(os.environ, MOECACHED_TIERS_DUMP=str(dump)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    rows = json.loads(dump.read_text())
    assert len(rows) > 500, len(rows)
    for row in rows:
        assert "daemon_procs" not in row["fixtures"], row["id"]
        assert not HEAVY_SOURCE.search(row["source"]), row["id"]
        assert not {"daemon", "build", "engine", "slow"} & set(row["markers"]), row
    modules = {row["id"].split("::")[0].rsplit("/", 1)[-1] for row in rows}
    assert not modules & set(HEAVY_MODULES), modules & set(HEAVY_MODULES)
    assert set(CORE) <= modules, set(CORE) - modules


INNER = '''
import subprocess
import sys

import pytest

MODULE = "moecached." + "daemon"   # not spelled out: conftest's sorting does not see it


def test_hidden_daemon():
    subprocess.run([sys.executable, "-P", "-m", MODULE, "--help"], capture_output=True)


@pytest.mark.daemon
def test_marked_daemon():
    assert subprocess.run([sys.executable, "-P", "-m", MODULE, "--help"], capture_output=True).returncode == 0
'''


def test_unsorted_daemon_process_fails_naming_itself(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))
    r = _pytest("-p", "conftest", "-c", str(HERE.parent / "pyproject.toml"), "--rootdir", str(tmp_path),
                str(tmp_path / "test_inner.py"), cwd=tmp_path, env=env)
    assert "1 failed, 1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    assert re.search(r"test_hidden_daemon starts .*moecached\.daemon.* but is not marked 'daemon'", r.stdout), \
        r.stdout[-3000:]


@pytest.mark.parametrize("marker", ["daemon", "build", "engine", "slow", "fast"])
def test_markers_are_registered(pytestconfig, marker):
    assert any(line.startswith(marker + ":") for line in pytestconfig.getini("markers")), marker
