"""Test setup: makes tests/ importable (``from fixtures import make_model``) and offers the
session-scoped ``model_factory`` fixture: ``model_factory(layout_name, layers=4, experts=8,
split=None, legacy=False, seed=0) -> path`` (see tests/fixtures.py)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixtures import make_model  # noqa: E402


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe-models")

    def make(layout_name, **kw):
        return make_model(base, layout_name, **kw)

    return make
