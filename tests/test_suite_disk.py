"""The test suite cleans up after itself: a run (even a failing one) leaves no model files
under pytest's temporary root; only a failing test's own tmp_path stays, for debugging."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

INNER = '''
import os

def test_uses_a_model(model_factory):
    assert os.path.getsize(model_factory("qwen3-30b-a3b-Q4_K_M", layers=2, experts=4)) > 0

def test_writes_a_model_into_its_tmp_path(tmp_path):
    from fixtures import make_model
    assert os.path.getsize(make_model(tmp_path, "qwen3-30b-a3b-Q4_K_M", layers=1, experts=2)) > 0

def test_fails(tmp_path):
    (tmp_path / "kept.txt").write_text("for debugging")
    assert False
'''


@pytest.mark.slow   # a pytest run of its own
def test_a_run_leaves_no_models_behind(tmp_path):
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "test_inner.py").write_text(INNER)
    root = tmp_path / "temproot"
    root.mkdir()
    env = dict(os.environ, PYTEST_DEBUG_TEMPROOT=str(root),
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    # the suite's conftest as a plugin, the project's pytest settings
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                        "-c", str(HERE.parent / "pyproject.toml"), "--rootdir", str(tmp_path / "inner"),
                        str(tmp_path / "inner" / "test_inner.py")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and "1 failed, 2 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    left = [p.relative_to(root) for p in root.rglob("*") if p.is_file()]
    assert [p.name for p in left] == ["kept.txt"], left
