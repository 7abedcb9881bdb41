"""The control plane of a server: who may change the daemon, and the ``clients`` op.

Every op that changes the daemon rather than the sender's own leases (``models`` add /
remove / rebalance, ``trace_start`` / ``trace_stop``, ``clients`` drop: the rows of
``moecached.facts.protocol.ADMIN_OPS``) is carried out only for an *admin*: a connection whose
kernel-verified uid (``moecached.service.identity``) is root or the daemon's own, or whose
groups hold the configured ``admin_group``. Anyone else is answered ``not_permitted`` naming the
operation, and nothing happens. Read-only ops stay open, but a client that is no admin sees the
other clients only as counts (``stats``, ``clients``).

``models add`` also opens only files under the configured ``model_dirs`` that the requesting
uid itself could read (checked as that uid would be, directory by directory, symlinks
followed): the daemon may run as root, and must not read for a client what the client could
not. Its refusal is one message for a missing file and an unreadable one, so it never tells
whether a file exists where the caller cannot look.

:class:`ServerAdmin` is a part of :class:`moecached.service.server.Server`.
"""
from __future__ import annotations

import os

from moecached.facts import protocol as P
from moecached.service.identity import readable_as, under


class ServerAdmin:
    """The permission checks and the ``clients`` op of a server (a part of it)."""

    def _permit(self, c, op: str, msg: dict) -> None:
        """Raise ``not_permitted`` when ``c`` is no admin and ``op`` (with its ``action``)
        changes the daemon."""
        acts = P.ADMIN_ACTIONS.get(op)
        action = msg.get("action", "list") if acts is not None else None
        if c.admin or (acts is not None and action not in acts):
            return
        what = P.ADMIN_OPS[op] + (f" {action}" if acts is not None else "")
        who = f"uid {c.peer.uid}" if c.peer.local else "a tcp client"
        grp = f", the admin_group (gid {self.admin_gid})" if self.admin_gid is not None else ""
        self.counters["not_permitted"] += 1
        raise P.ProtocolError(P.E_NOT_PERMITTED, f"{what}: not permitted: only root, the daemon's "
                              f"uid ({os.geteuid()}){grp} may change the daemon; {who} is none of them")

    def _replaced(self, c) -> None:
        """A request under ``c``'s routing id came over another connection (``c``'s went away
        and a new peer took its id): that peer is not ``c``; ``c`` is gone."""
        self._drop_client(c, "connection gone (its routing id was taken by another connection)")

    # ---- the clients op ------------------------------------------------------------------
    def _client_row(self, x) -> dict:
        """One client as ``clients`` lists it."""
        pins = sum(len(self.leases[lid][1].items) for lid in x.leases if lid in self.leases)
        return {"id": x.ident.hex(), "name": x.name, "pid": x.pid, "uid": x.peer.uid,
                "leases": len(x.leases), "pins": pins, "fast_pins": x.fast_pins(),
                "pending": len(x.pending), "fast_path": x.pins is not None,
                "watched": "process" if x.pidfd is not None else "heartbeat", "admin": x.admin}

    def _op_clients(self, c, rid: int, msg: dict) -> None:
        """``action`` list (default): the clients (an admin sees all of them, anyone else
        itself and a count of the others); drop (admin only): release client ``id``'s leases,
        pending acquires and fast-path pins and forget it."""
        action = msg.get("action", "list")
        if action == "list":
            rows = [self._client_row(x) for x in self.clients.values() if c.admin or x is c]
            self._reply(c.ident, rid, clients=rows, others=len(self.clients) - len(rows))
            return
        if action != "drop":
            raise P.ProtocolError(P.E_BAD_TYPE, f"field 'action' = {action!r:.20}: expected list or drop")
        want = msg.get("client")
        if not isinstance(want, str) or not want:
            raise P.ProtocolError(P.E_BAD_TYPE, "field 'client' must be a client id (hex, as "
                                  "clients lists it)")
        x = next((x for x in self.clients.values() if x.ident.hex() == want.lower()), None)
        if x is None:
            raise P.ProtocolError(P.E_REFUSED, f"clients drop: no client {want} on this socket")
        row = self._client_row(x)
        self._drop_client(x, f"dropped by uid {c.peer.uid}")
        self._reply(c.ident, rid, dropped=row)

    def _visible_stats(self, c, st: dict) -> dict:
        """``stats`` as ``c`` may see it: a client that is no admin sees its own entry and a
        count of the others (``clients_other``), and of the departed only their number."""
        if c.admin:
            return st
        mine = c.ident.hex()
        rows = st.get("clients") or []
        st["clients"] = [x for x in rows if x.get("id") == mine]
        st.setdefault("clients_other", len(rows) - len(st["clients"]))
        st["departed_clients"] = len(st.get("departed_clients") or [])
        return st

    # ---- models add ------------------------------------------------------------------------
    def _check_model_add(self, c, msg: dict) -> dict:
        """``msg`` of a ``models add`` with its path replaced by the file it resolves to, once
        it is under ``model_dirs`` and readable by ``c``'s uid; else ``refused``."""
        path = msg.get("path")
        if not isinstance(path, str) or not path:
            raise P.ProtocolError(P.E_BAD_TYPE, "field 'path' must be the model's GGUF path")
        dirs = self.model_dirs
        if not dirs:
            raise P.ProtocolError(P.E_REFUSED, "models add: the daemon has no model_dirs configured: "
                                  "it adds models only from the directories model_dirs names")
        shown = ", ".join(dirs)
        if not os.path.isabs(path):
            raise P.ProtocolError(P.E_REFUSED, f"models add: {path}: expected an absolute path under "
                                  f"model_dirs ({shown})")
        norm = os.path.normpath(path)
        if not under(norm, dirs):
            raise P.ProtocolError(P.E_REFUSED, f"models add: {path} is not under model_dirs ({shown})")
        got = readable_as(norm, c.peer)
        if got is None or not (under(got[0], dirs) or under(got[0], map(os.path.realpath, dirs))):
            raise P.ProtocolError(P.E_REFUSED, f"models add: {path}: no file under model_dirs there "
                                  f"that uid {c.peer.uid} can read")
        return dict(msg, path=got[0])
