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
