"""moecached: a shared, mlock'd expert cache for mixture-of-experts inference.

The package stands in wings, each importing only from those below it (tests/test_layers.py):
``facts`` (units, formats, protocol, counters) -> ``engine`` (one model's cache: index, arena,
readers, policies, cache) -> ``service`` (one socket: server, clients, router) -> ``daemon``
(N models, configuration, floor, reload) -> ``tools`` (moecache-ctl, simulator, benchmarks'
helpers). The Cython of a wing sits in ``cython_ext/<wing>/``.
"""

__version__ = "0.1.0"


class MoecacheError(Exception):
    """Base class of every error moecached raises on purpose; ``str(e)`` is one clear line."""
