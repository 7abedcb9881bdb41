"""moecached.daemon.watch.ModelWatch: inotify on the model files and their directory."""
import os
import threading

from moecached.daemon.watch import ModelWatch


def _watch(path):
    ev = threading.Event()
    return ModelWatch([str(path)], ev.set), ev


def test_write_chmod_and_replace_are_seen(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"x" * 4096)
    def write():
        with p.open("r+b") as f:
            f.write(b"y")

    def replace():
        (tmp_path / "n").write_bytes(b"z")
        os.rename(tmp_path / "n", p)

    for change in (write,
                   lambda: os.chmod(p, 0o600),
                   lambda: os.utime(p, ns=(1, 1)),
                   replace):
        w, ev = _watch(p)
        try:
            change()
            assert ev.wait(10)
        finally:
            w.close()


def test_delete_is_seen_and_close_is_idempotent(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"x")
    w, ev = _watch(p)
    try:
        os.unlink(p)
        assert ev.wait(10)
    finally:
        w.close()
        w.close()
