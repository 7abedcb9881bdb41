"""The daemon's endpoint when it serves several models: a :class:`Router`.

It serves no model itself (each model has its own socket beside it: ``moecached.daemon.multi``). A
hello there is redirected by ``route_model`` to the model it names (or refused: unknown or
departing model, none named while several are served); a control connection (``model "*"``)
gets the daemon's ``stats`` / ``status`` / ``models`` (``extra_stats`` / ``extra_status`` add
the models' view, ``models_handler`` answers ``models``); every other op is refused
``unknown_model``. The loop, clients, limits and socket are the server's
(:class:`moecached.service.server.Server`).
"""
from __future__ import annotations

from moecached import __version__
from moecached.facts import protocol as P
from moecached.service.server import Server


class Router(Server):
    """A server of no model on the daemon's endpoint: routes hellos, answers control tools.

    Args:
        route_model: ``(server, name, names=False) -> None | endpoint`` (``Models.route``).
        models_handler: ``(msg) -> dict``: the ``models`` op.
        endpoint, ...: as :class:`moecached.service.server.Server`.
    """

    #: the ops the router answers itself; every other is refused ``unknown_model``
    OPS = ("hello", "ping", "bye", "stats", "status", "models", "clients")

    def __init__(self, route_model, models_handler, **kw):
        super().__init__(None, **kw)
        self.route_model = route_model
        self.models_handler = models_handler

    def _set_model(self, max_request_experts: int) -> None:
        # no model here: nothing is checked against an index
        self.checker = P.RequestChecker((), 0, max_experts=max_request_experts)
        self.moe_index = {}

    def _op_table(self) -> dict:
        return {op: getattr(self, "_op_" + op if op in self.OPS else "_op_no_model")
                for op in P.OPS}

    def _fast_handler(self):
        self._hooks = None
        return lambda frames: False   # no model: no resident acquire to serve

    def _cache_stats(self) -> dict:
        return {}

    def _redirected(self, c) -> None:
        self.clients.pop(c.ident, None)   # it has gone to its model's socket

    def _hello_reply(self, c, rid: int, fast: bool) -> None:
        """A control connection (no model named, or ``"*"``): the models served."""
        self._reply(c.ident, rid, protocol=P.PROTOCOL_VERSION, server=f"moecached {__version__}",
                    fingerprint=None, model=None, model_files=None, model_name=None, arena=None, index=None,
                    models=self.route_model(self, None, names=True), expert_layers=[],
                    n_experts=0, top_k=0, heartbeat_s=self.heartbeat_s,
                    lease_watch="process" if c.pidfd is not None else "heartbeat", pins=None,
                    limits={"max_message_bytes": self.max_message_bytes})

    def _op_clients(self, c, rid: int, msg: dict) -> None:
        """Every model's clients (as ``stats`` has them); a drop is said on the model's socket,
        whose loop owns the client."""
        if msg.get("action", "list") == "drop":
            raise P.ProtocolError(P.E_REFUSED, "clients drop: the daemon serves several models: drop "
                                  "a client on its model's socket (moecache-ctl --model NAME client drop ID)")
        st = self._visible_stats(c, self.stats(None if c.admin else c))
        self._reply(c.ident, rid, clients=st.get("clients", []), others=st.get("clients_other", 0))

    def _op_no_model(self, c, rid: int, msg: dict) -> None:
        raise P.ProtocolError(P.E_UNKNOWN_MODEL, f"op {msg.get('op')}: the daemon's endpoint serves "
                              "several models and none itself: name the model in hello "
                              "(Client(endpoint, model=NAME), moecache-ctl --model NAME)")
