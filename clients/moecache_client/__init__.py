"""Python client of the moecached expert cache daemon (see docs/protocol.md)."""
