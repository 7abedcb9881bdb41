"""moecached: a shared, mlock'd expert cache for mixture-of-experts inference.

Data flows one way: ``index`` (where each expert's bytes live in the GGUF files) ->
``arena`` / ``readers`` (pinned slots, O_DIRECT loads) -> ``cache`` (acquire / prefetch /
release, eviction ``policy``) -> ``server`` (ZeroMQ) -> ``moecache_client``.
"""

__version__ = "0.1.0"


class MoecacheError(Exception):
    """Base class of every error moecached raises on purpose; ``str(e)`` is one clear line."""
