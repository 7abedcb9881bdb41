"""Real other users for tests of what one uid can do to another (the tests run as root, as in CI).

* :func:`temp_group`, :func:`temp_user`: a group / user with a unique name for the length of a
  ``with`` block (``groupadd`` / ``useradd``, then ``groupdel`` / ``userdel``).
* :func:`run_as`: run a function in a forked child that has become that user for good (groups,
  gid, then uid: real, effective and saved), and return what it returned. The child already holds
  every module the test imported (root's home, where the interpreter lives, is 0700: a process
  started afresh as that user could not even start Python); what it does from there it does with
  that user's credentials only, and the kernel says so to the daemon (SO_PEERCRED).
* :func:`shared_dir`: a directory under /tmp that every user can traverse (pytest's tmp_path is
  0700), removed afterwards.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import pwd
import grp
import shutil
import subprocess
import tempfile
import traceback
import uuid

import pytest

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                                reason="creates users: needs root and useradd")


def _name(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


@contextlib.contextmanager
def temp_group():
    """A new group; yields its ``grp`` entry."""
    name = _name("mcg")
    subprocess.run(["groupadd", name], check=True, capture_output=True)
    try:
        yield grp.getgrnam(name)
    finally:
        subprocess.run(["groupdel", name], capture_output=True)


@contextlib.contextmanager
def temp_user(groups=()):
    """A new user (no home, no login shell) in the supplementary ``groups`` (names); yields its
    ``pwd`` entry."""
    name = _name("mcu")
    cmd = ["useradd", "-M", "-U", "-s", "/usr/sbin/nologin", name]
    if groups:
        cmd[1:1] = ["-G", ",".join(groups)]
    subprocess.run(cmd, check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", name], capture_output=True)


def run_as(user, fn, *args, timeout: float = 60.0):
    """``fn(*args)`` in a child running as ``user`` (a ``pwd`` entry): its return value (it must
    pickle), or the child's exception re-raised here as AssertionError with its traceback."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups(os.getgrouplist(user.pw_name, user.pw_gid))
            os.setresgid(user.pw_gid, user.pw_gid, user.pw_gid)
            os.setresuid(user.pw_uid, user.pw_uid, user.pw_uid)
            assert os.getresuid() == (user.pw_uid,) * 3
            out = ("ok", fn(*args))
        except BaseException:
            out = ("err", traceback.format_exc())
        try:
            os.write(w, pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    try:
        import select
        while True:
            ready, _, _ = select.select([r], [], [], timeout)
            if not ready:
                os.kill(pid, 9)
                raise AssertionError(f"run_as {user.pw_name}: no answer in {timeout} s")
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    kind, val = pickle.loads(data)
    if kind == "err":
        raise AssertionError(f"as {user.pw_name}:\n{val}")
    return val


@contextlib.contextmanager
def shared_dir(mode: int = 0o755):
    """A directory under /tmp every user can traverse."""
    d = tempfile.mkdtemp(prefix="mcsec-", dir="/tmp")
    os.chmod(d, mode)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
