"""The expert cache's errors (``moecached.engine.cache`` re-exports them): every one is a
:class:`CacheError`, but the arena's (:class:`ArenaError`, :class:`BudgetError`), and ``str(e)``
is one line."""
from __future__ import annotations

from moecached import MoecacheError

__all__ = ["CacheError", "RequestError", "CapacityError", "LeaseError", "LoadError",
           "ModelChangedError", "AcquireTimeout", "CacheClosed", "ArenaError", "BudgetError"]


class CacheError(MoecacheError):
    """Base of every cache error; ``str(e)`` is one line."""


class RequestError(CacheError):
    """Bad request, raised at once: unknown layer, expert out of range, duplicate expert, empty
    request, or more experts of one pool than it can ever hold (or holds now, with
    ``shrunk_policy="error"``)."""


class CapacityError(RequestError):
    """The request fits its pool's configured size but not its current (``set_budget``-shrunk)
    size, and ``shrunk_policy="error"``. Retry later."""


class CacheClosed(CacheError):
    """The cache is closed (or closing): ``str(e) == "cache closed"``."""

    def __init__(self, msg: str = "cache closed"):
        super().__init__(msg)


class LeaseError(CacheError):
    """Release of a lease id that is unknown, already released, or from another cache instance."""


class LoadError(CacheError):
    """A read needed by this acquire failed (short read, EIO, file changed); names layer, expert
    and file. The expert stays absent; a later acquire retries the read."""


class ModelChangedError(LoadError):
    """The model file is no longer the one indexed (see ``ExpertCache.model_changed``): an
    acquire that needs a read is refused at once, before any slot is taken (nothing evicted);
    resident experts are still served (their slots hold bytes read before the change)."""


class AcquireTimeout(CacheError):
    """A blocking acquire did not complete within ``timeout``; it was cancelled (no pins held)."""


class ArenaError(MoecacheError):
    """The arena could not be planned, reserved, mapped or locked; the message names the fix."""


class BudgetError(ArenaError):
    """A budget below what the model needs (a slot per size class): no start can serve with it,
    whatever the machine has (the daemon exits 2, the code of a refused configuration)."""
