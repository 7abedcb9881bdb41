"""The client's errors: every one a :class:`ClientError` whose text is one line."""
from __future__ import annotations


class ClientError(Exception):
    """Base class of the client's errors."""


class ServerError(ClientError):
    """The daemon refused a request; ``code`` is the protocol's error code string."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


class DaemonRestarted(ClientError):
    """The daemon went away (or restarted) while the call was in flight; retry it."""


class Timeout(ClientError):
    """No reply within the call's timeout."""


class LeaseInvalid(ClientError):
    """The lease no longer pins its experts (released, daemon restarted, or revoked and its
    slots reused): bytes read through it may belong to another expert."""
