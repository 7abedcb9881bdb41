"""Eviction policies: the pure-Python face of the Cython core ``moecached._policy``.

The daemon's cache and the trace simulator (``moecached.simulate``) use these same classes,
so a simulated hit rate is what the daemon gets on the same trace and size.
"""
from ._policy import LRU  # noqa: F401

__all__ = ["LRU"]
