"""Who is on the other end of a connection, as the kernel says, and what they may do.

On an ``ipc://`` endpoint libzmq reads the peer's credentials with ``SO_PEERCRED`` when the
connection is accepted and attaches them to every message of that connection as the
``Peer-Address`` property (``"<addr>:<uid>:<gid>:<pid>"``; libzmq >= 4.3 built with
``ZMQ_HAVE_SO_PEERCRED``). The pid is the process that called ``connect`` (its thread-group
id, in the daemon's pid namespace) and nothing the client sends can change it, so the server
takes a client's identity from there and from nothing a ``hello`` claims: no side channel,
no change in the clients. It is read from the routing-id frame of each request (cheap: one
``zmq_msg_gets``), so a connection that takes over the routing id of one that went away is a
new client, never the old one (``Server._replaced``).

* :class:`Peer`: the verified uid, gid, pid of a connection (None fields over tcp).
* :func:`admin`: whether a peer may change the daemon (its uid, root, ``admin_group``).
* :func:`readable_as`: whether a uid (with its groups) could open a file for reading, walking
  every directory on the way as that uid would (the daemon may run as root, or as its own
  user: it cannot take the caller's credentials), without saying whether a file the caller
  cannot reach exists.
"""
from __future__ import annotations

import os
import stat
from typing import NamedTuple, Optional

#: pids a hello may claim at all (Linux's pid_max is at most 2**22; pid_t is 32-bit)
PID_MAX = 2**31 - 1


class Peer(NamedTuple):
    """A connection's kernel-verified credentials; all None over tcp (nothing is verified)."""
    uid: Optional[int]
    gid: Optional[int]
    pid: Optional[int]   # None also when the peer's pid namespace is not visible from here (0)

    @property
    def local(self) -> bool:
        return self.uid is not None

    def show(self) -> str:
        if not self.local:
            return "remote peer (tcp: no credentials)"
        return f"uid {self.uid}, pid {self.pid if self.pid is not None else '?'}"


REMOTE = Peer(None, None, None)


def parse_peer(addr: Optional[str]) -> Peer:
    """``Peer-Address`` of a message -> :class:`Peer` (:data:`REMOTE` unless it carries the
    ``:uid:gid:pid`` suffix libzmq adds for unix-domain peers)."""
    if not addr:
        return REMOTE
    parts = addr.rsplit(":", 3)
    if len(parts) != 4:
        return REMOTE
    try:
        uid, gid, pid = int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        return REMOTE
    return Peer(uid, gid, pid if pid > 0 else None)


def _status(pid: int) -> dict:
    """``/proc/PID/status`` as {field: [values]} ({} when the process is gone)."""
    out = {}
    try:
        with open(f"/proc/{int(pid)}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k] = v.split()
    except (OSError, ValueError):
        pass
    return out


def claimed_pid_matches(peer: Peer, claimed: int) -> bool:
    """Whether a hello's ``pid`` names the connecting process: its pid here, or its pid in
    its own pid namespace (a client in a container sees another number; ``NSpid``'s last)."""
    if peer.pid is None:
        return False
    if claimed == peer.pid:
        return True
    ns = _status(peer.pid).get("NSpid")
    return bool(ns) and ns[-1] == str(claimed)


def process_uid(pid: int) -> Optional[int]:
    """Real uid of process ``pid`` (None when it is gone)."""
    uids = _status(pid).get("Uid")
    return int(uids[0]) if uids else None


def groups(peer: Peer) -> set:
    """The peer's gids: its primary gid (from the kernel, at connect) plus the supplementary
    groups of its process while that process still runs as the peer's uid."""
    out = {peer.gid} if peer.gid is not None else set()
    if peer.pid is not None:
        st = _status(peer.pid)
        uids = st.get("Uid") or []
        if uids and all(int(u) == peer.uid for u in uids):
            out.update(int(g) for g in st.get("Groups", []))
    return out


def admin(peer: Peer, admin_gid: Optional[int]) -> bool:
    """May this peer change the daemon: root, the daemon's own uid, or a member of the
    configured ``admin_group``. A tcp peer never may (nothing about it is verified)."""
    if not peer.local:
        return False
    if peer.uid in (0, os.geteuid()):
        return True
    return admin_gid is not None and admin_gid in groups(peer)


def _may(st, uid: int, gids: set, bit: int) -> bool:
    """Permission ``bit`` (4 read, 1 search) of inode ``st`` for ``uid`` with ``gids``."""
    if uid == 0:
        return bit != 1 or bool(st.st_mode & 0o111) or stat.S_ISDIR(st.st_mode)
    if st.st_uid == uid:
        return bool(st.st_mode & (bit << 6))
    if st.st_gid in gids:
        return bool(st.st_mode & (bit << 3))
    return bool(st.st_mode & bit)


def readable_as(path: str, peer: Peer) -> Optional[tuple]:
    """Whether the peer (its uid, primary and supplementary groups) could open ``path`` for
    reading: every directory on the way, through each symlink, searchable by it, and the file
    readable by it (the permission bits; ACLs are not consulted, so they can only make this
    refuse more). Returns ``(realpath, st_dev, st_ino)``, or None for every failure alike
    (missing, unreadable, a directory on the way it may not search: one answer, so a refusal
    never tells whether a file exists where the peer cannot look)."""
    if not peer.local or not os.path.isabs(path):
        return None
    uid, gids = peer.uid, groups(peer)
    todo = [c for c in path.split("/") if c]
    cur, links = "/", 0
    try:
        while todo:
            name = todo.pop(0)
            if not _may(os.stat(cur), uid, gids, 1):
                return None
            if name == ".":
                continue
            if name == "..":
                cur = os.path.dirname(cur.rstrip("/")) or "/"
                continue
            nxt = os.path.join(cur, name)
            st = os.lstat(nxt)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > 40:
                    return None
                target = os.readlink(nxt)
                todo = [c for c in target.split("/") if c] + todo
                if target.startswith("/"):
                    cur = "/"
                continue
            cur = nxt
        st = os.stat(cur)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or not _may(st, uid, gids, 4):
        return None
    return cur, st.st_dev, st.st_ino


def under(path: str, dirs) -> bool:
    """``path`` (absolute, normalised) lies inside one of ``dirs``."""
    p = os.path.normpath(path)
    for d in dirs:
        d = os.path.normpath(d)
        if p.startswith(d.rstrip("/") + "/"):
            return True
    return False
