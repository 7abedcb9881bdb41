"""The daemon: N models behind one endpoint (``runtime.Daemon``), its configuration (keys
declared in ``config``), memory floor, split of the budget, reload and file watch, systemd
notification and logs. ``python -m moecached.daemon`` and the ``moecached`` command run
:func:`moecached.daemon.cli.main`."""


def main(argv=None) -> int:
    """The ``moecached`` command (see :mod:`moecached.daemon.cli`)."""
    from moecached.daemon.cli import main as _main
    return _main(argv)
