"""``moecache-ctl clients`` and ``moecache-ctl client drop ID``: a running daemon's clients.

``clients`` lists every client of the socket it talks to (``--model NAME``: that model's): id,
pid and uid (as the kernel gave them to the daemon), leases, the slots its leases pin, the
slots it pins through shared memory now, pending acquires, how its leases are watched. A caller
that is no admin of the daemon sees itself and a count of the others. ``client drop ID``
(admins only: root, the daemon's uid, the ``admin_group``) releases one client's leases,
pending acquires and shared-memory pins at once, as if its process had exited.
"""
from __future__ import annotations

from moecached import MoecacheError
from moecached.tools.ctlstats import _client, _endpoint_of, _parser, _print

COLUMNS = ("id", "name", "pid", "uid", "leases", "pins", "fast_pins", "pending", "watched")


def _call(a, msg: dict) -> dict:
    c = _client(*_endpoint_of(a))
    try:
        r = c._call(msg)
    except Exception as e:
        raise MoecacheError(f"{msg.get('op')} {msg.get('action', 'list')}: {e}") from None
    finally:
        c.close()
    return {k: v for k, v in r.items() if k not in ("v", "id", "ok", "session")}


def table(rows: list, others: int = 0) -> list[str]:
    """The clients as aligned text lines (header first)."""
    cells = [list(COLUMNS)] + [["-" if r.get(k) is None else str(r.get(k)) for k in COLUMNS]
                               for r in rows]
    width = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    out = ["  ".join(v.ljust(w) for v, w in zip(row, width)).rstrip() for row in cells]
    if others:
        out.append(f"(and {others} other client{'s' if others != 1 else ''}: only an admin sees them)")
    return out


def clients_main(argv) -> int:
    """``moecache-ctl clients [--json]``."""
    p = _parser("clients", "list a running daemon's clients (id, pid, uid, leases, pins, "
                           "fast-path pins)")
    a = p.parse_args(argv)
    r = _call(a, {"op": "clients"})
    if a.json:
        _print(r, True)
    else:
        print("\n".join(table(r.get("clients") or [], r.get("others") or 0)))
    return 0


def client_main(argv) -> int:
    """``moecache-ctl client drop ID``."""
    p = _parser("client", "drop one client of a running daemon: its leases, pending acquires "
                          "and shared-memory pins are released (admins only)")
    p.add_argument("action", choices=["drop"])
    p.add_argument("client", help="the client's id, as 'moecache-ctl clients' lists it")
    a = p.parse_args(argv)
    r = _call(a, {"op": "clients", "action": "drop", "client": a.client})
    d = r.get("dropped") or {}
    if a.json:
        _print(r, True)
    else:
        print(f"dropped client {d.get('id')} ({d.get('name')}, pid {d.get('pid')}, uid "
              f"{d.get('uid')}): {d.get('leases')} leases, {d.get('pins')} pinned slots, "
              f"{d.get('fast_pins')} shared-memory pins released")
    return 0
