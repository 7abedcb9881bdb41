"""A model as the daemon serves it (:class:`Served`: its index, cache, server, thread, socket
and file watch) and the names every part of the models' code shares: where a model is served
(:func:`model_endpoint`), the errors of adding and removing models."""
from __future__ import annotations

from moecached import MoecacheError

#: hello's ``model`` for a control connection (moecache-ctl): whichever model the endpoint
#: serves, never redirected or refused (engines name their model)
ANY_MODEL = "*"
#: a removed model's leases are waited for this long at most before its server closes
DRAIN_S = 30.0


#: why a daemon of one model (``--model PATH``) adds, removes or splits nothing
ALONE = "the daemon was started with one model (--model PATH): restart it with --model NAME=PATH"


class ModelsError(MoecacheError):
    """A model cannot be added or removed (bad name or path, no room in the budget)."""


class Served:
    __slots__ = ("name", "path", "index", "cache", "server", "thread", "endpoint", "draining",
                 "spec", "reloader")

    def __init__(self, name, path):
        self.name, self.path = name, path
        self.index = self.cache = self.server = self.thread = self.endpoint = None
        self.draining = None   # monotonic time removal began
        self.spec = None
        self.reloader = None


def model_endpoint(endpoint: str, name: str) -> str:
    """Where model ``name`` is served: the daemon's ipc path with ``.<name>`` appended.
    Raises ModelsError for tcp or a path too long."""
    if not endpoint.startswith("ipc://"):
        raise ModelsError(f"endpoint {endpoint}: several models need an ipc:// endpoint (each "
                          "model gets its own socket beside it)")
    ep = f"{endpoint}.{name}"
    if len(ep) - len("ipc://") > 107:
        raise ModelsError(f"model {name}: socket path {ep[6:]} is longer than 107 bytes; use a "
                          "shorter endpoint path or model name")
    return ep
