# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Eviction policies (Cython core of ``moecached.engine.policy``; import them from there).

One extension, one file per concept, ``include``d here in dependency order:

* ``policy/lru.pyx`` -- the daemon's ``LRU`` (the order ``moecached.engine.cache`` evicts by, and the
  cache's hit path ``grant_resident``);
* ``policy/sim.pyx`` -- the simulator's policies (``_Pol`` and subclasses; ``lru``/``g-lru``
  drive the daemon's ``LRU`` itself, so a simulated hit rate is the daemon's);
* ``policy/kernels.pyx`` -- flattening a trace into an access stream, next use, the replay
  loops.

Keys are non-negative ints < n_keys (the cache uses ``layer_slot * n_experts + expert``).
Policies only order keys; the cache owns slots and decides when to evict (when no slot is
free it asks ``victim()``), so pinned keys (leased or loading) are skipped, never evicted.
"""
from libc.stdlib cimport malloc, calloc, free
from libc.stdint cimport int64_t, uint8_t, uint64_t
import numpy as np

ctypedef int64_t i64

include "policy/lru.pyx"
include "policy/sim.pyx"
include "policy/kernels.pyx"
