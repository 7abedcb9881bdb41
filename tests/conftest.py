"""Test setup: makes tests/ importable (``from fixtures import make_model``) and offers the
session-scoped ``model_factory`` fixture: ``model_factory(layout_name, layers=4, experts=8,
split=None, legacy=False, seed=0) -> path`` (see tests/fixtures.py).

Disk: the models ``make_model`` wrote are deleted when the session ends (passed or not), and
``tmp_path_retention_policy = "failed"`` (pyproject.toml) has pytest delete the ``tmp_path`` of
every passing test, so a run leaves only what failing tests wrote."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixtures import make_model, remove_models  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    remove_models()


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe-models")

    def make(layout_name, **kw):
        return make_model(base, layout_name, **kw)

    return make


@pytest.fixture(scope="module", params=["hot_path_on", "hot_path_off"])
def hot_path(request):
    """Runs a module twice: every Server built in it (in-process, or a daemon a test starts,
    which inherits the environment) with the Cython hot path on, then off
    (``MOECACHED_HOT_PATH=0``: everything takes ``Server._handle``). The value is True when on.
    Server-facing modules use it for the whole module::

        pytestmark = pytest.mark.usefixtures("hot_path")
    """
    from moecached.server import HOT_PATH_ENV
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(HOT_PATH_ENV, "1" if request.param == "hot_path_on" else "0")
        yield request.param == "hot_path_on"


@pytest.fixture
def daemon_procs(model, tmp_path):
    """Real ``moecached`` processes on the test module's ``model`` fixture, arena files in the
    test's tmp dir: ``start(*args, sock=None) -> (endpoint, Popen)``; ``sock`` names the socket
    file (by default a new one per start; the same name again is a restart at one endpoint).
    At teardown each is stopped and its output checked for a traceback."""
    from daemon_util import start_daemon, stop_daemon
    procs = []

    def start(*args, sock=None):
        path = str(tmp_path / (sock or f"d{len(procs)}.sock"))
        procs.append(start_daemon(str(model), path, "--arena-dir", str(tmp_path), *args))
        return f"ipc://{path}", procs[-1]
    yield start
    for p in procs:
        out = stop_daemon(p)
        assert "Traceback" not in out, out
