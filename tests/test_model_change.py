"""A model file changed under a running daemon: noticed at once, never served as the indexed
model, one clear state (`model changed`, `model_changed` errors), then reload or exit."""
import os
import shutil
import stat

import pytest

from daemon_util import start_daemon, stop_daemon, wait_for
from moecache_client import Client, DaemonRestarted, ServerError
from moecached.engine.index import open_index
from moecached.tools.synth import verify_expert_bytes

LAYOUT = "qwen3-30b-a3b-Q4_K_M"
LAYERS = [0, 6, 7, 8]


@pytest.fixture
def models(model_factory, tmp_path):
    """(path of a private copy of the seed-0 model, path of the same model written with seed 1)."""
    a = model_factory(LAYOUT, layers=LAYERS, experts=16, seed=0)
    b = model_factory(LAYOUT, layers=LAYERS, experts=16, seed=1)
    d = tmp_path / "models"
    d.mkdir()
    mine = d / "model.gguf"
    shutil.copyfile(a, mine)
    return str(mine), b


def rewrite_in_place_keep_mtime(path: str, src: str) -> None:
    """What `rsync --inplace -t` / `cp -p` onto the file do: same inode, same size, same mtime."""
    st = os.stat(path)
    with open(src, "rb") as f, open(path, "r+b") as g:
        shutil.copyfileobj(f, g)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    st2 = os.stat(path)
    assert (st2.st_ino, st2.st_size, st2.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def replace_by_rename(path: str, src: str) -> None:
    tmp = path + ".new"
    shutil.copyfile(src, tmp)
    os.rename(tmp, path)


def check_bytes(lease, idx, layer, experts, seed):
    bad = []
    for e in experts:
        for sp in idx.parts(layer, e):
            r = verify_expert_bytes(lease.part(e, sp.part, layer=layer), layer, sp.part, e, seed)
            if r:
                bad.append(r)
    return bad


def control_words(c):
    """(epoch, state) words of the arena control block the client said hello to."""
    import numpy as np
    a = c.info["arena"]
    w = np.memmap(a["path"], dtype=np.uint64, mode="r", shape=(4,))
    return int(w[a["control"]["epoch_off"] // 8]), int(w[a["control"]["state_off"] // 8])


def test_rewrite_in_place_with_mtime_restored_is_never_served(models, tmp_path):
    """Rewritten in place, same size, mtime restored, with another model's expert bytes under a
    header that cannot be indexed (so the daemon stays in the changed state): every miss is
    refused with model_changed, never served from the new bytes."""
    path, other = models
    idx = open_index(path)
    L = idx.expert_layers[0]
    broken = str(tmp_path / "broken.gguf")
    shutil.copyfile(other, broken)
    with open(broken, "r+b") as f:
        f.write(b"\0" * 64)      # no GGUF magic: cannot be re-indexed
    sock = str(tmp_path / "d.sock")
    d = start_daemon(path, sock, "--slots", "64", "--on-model-change", "reload")
    try:
        with Client(f"ipc://{sock}", name="t") as c:
            with c.acquire(L, [0]) as lease:
                assert check_bytes(lease, idx, L, [0], 0) == []
            rewrite_in_place_keep_mtime(path, broken)
            for e in range(1, 16):
                try:
                    with c.acquire(L, [e]) as lease:
                        bad = check_bytes(lease, idx, L, [e], 0)
                        pytest.fail(f"expert {e}: a load after the rewrite was granted; "
                                    f"mismatches: {bad[:1]}")
                except ServerError as err:
                    # the line says what ends the state (a file that stays unindexable never does by itself)
                    assert err.code == "model_changed" and "put the model back" in str(err), err
            with c.acquire(L, [0]) as lease:   # resident: still the old model's bytes
                assert check_bytes(lease, idx, L, [0], 0) == []
            st = c.status()
            assert st["state"] == "model changed" and "since it was indexed" in st["model_changed"]
    finally:
        out = stop_daemon(d)
    assert out.count("since it was indexed") == 1, out


def test_replaced_by_unreadable_file_gives_one_clear_state(models, tmp_path):
    """Replaced via rename by a file that cannot be indexed (reload mode keeps waiting for a
    good one): status says `model changed`, misses get `model_changed`, resident hits keep
    the old bytes, nothing is evicted, read_errors stays 0, the log says it once."""
    path, _ = models
    idx = open_index(path)
    L = idx.expert_layers[0]
    sock = str(tmp_path / "d.sock")
    # 8 slots per size class, 4 layers share them: the cache is full after 8 experts of L
    d = start_daemon(path, sock, "--slots", "16", "--on-model-change", "reload")
    try:
        with Client(f"ipc://{sock}", name="t") as c:
            with c.acquire(L, list(range(8))) as lease:
                assert check_bytes(lease, idx, L, range(8), 0) == []
            before = c.stats()
            assert c.status()["state"] == "serving"
            held = c.acquire(L, [3])   # held across the change
            assert control_words(c) == (before["session"], 1)
            bad = path + ".bad"
            with open(bad, "wb") as f:
                f.write(b"not a gguf file" * 1000)
            os.rename(bad, path)
            # noticed without any miss
            wait_for(lambda: c.status()["state"] == "model changed", "status 'model changed'")
            for _ in range(50):
                with pytest.raises(ServerError) as ei:
                    c.acquire(L, [8, 9])
                assert ei.value.code == "model_changed"
            with c.acquire(L, [0, 1, 2]) as lease:   # resident: the old model's bytes
                assert check_bytes(lease, idx, L, [0, 1, 2], 0) == []
            after = c.stats()
            assert after["read_errors"] == 0
            assert after["evictions"] == before["evictions"]
            assert after["classes"] == before["classes"] or \
                [x["used"] for x in after["classes"]] == [x["used"] for x in before["classes"]]
            assert after["model_changed"]
            assert c.status()["state"] == "model changed"
            # the control block says so; a lease held across the change stays valid (same
            # session, its slot untouched) and its bytes are the indexed model's
            assert control_words(c) == (before["session"], 2)
            assert held.valid() and check_bytes(held, idx, L, [3], 0) == []
            held.release()
    finally:
        out = stop_daemon(d)
    assert out.count("since it was indexed") == 1, out
    assert "load of layer" not in out, out


def test_exit_mode_exits_nonzero(models, tmp_path):
    path, other = models
    sock = str(tmp_path / "d.sock")
    d = start_daemon(path, sock, "--slots", "16", "--on-model-change", "exit")
    try:
        replace_by_rename(path, other)
        d.wait(30)
        assert d.returncode not in (0, None)
    finally:
        out = stop_daemon(d)
    lines = [l for l in out.splitlines() if "since it was indexed" in l]
    assert len(lines) == 1 and "exit" in lines[0], out


@pytest.mark.parametrize("how", ["in_place", "rename"])
def test_reload_mode_serves_the_new_file(models, tmp_path, how):
    path, other = models
    sock = str(tmp_path / "d.sock")
    d = start_daemon(path, sock, "--slots", "16", "--on-model-change", "reload")
    try:
        with Client(f"ipc://{sock}", name="t") as c:
            idx = open_index(path)
            L = idx.expert_layers[1]
            with c.acquire(L, [0, 1]) as lease:
                assert check_bytes(lease, idx, L, [0, 1], 0) == []
            s0 = c.stats()["session"]
            held = c.acquire(L, [2])
            (rewrite_in_place_keep_mtime if how == "in_place" else replace_by_rename)(path, other)

            def new_session():
                try:
                    return c.stats()["session"] != s0
                except DaemonRestarted:
                    return True
            wait_for(new_session, "a new session after the reload")
            idx2 = open_index(path)
            got = None
            for _ in range(3):
                try:
                    got = c.acquire(L, [0, 1, 5])
                    break
                except DaemonRestarted:
                    continue
            assert got is not None
            assert not held.valid()   # the reload voided every lease of the old session
            with got as lease:
                assert check_bytes(lease, idx2, L, [0, 1, 5], 1) == []
            st2 = c.stats()
            assert control_words(c) == (st2["session"], 1) and st2["session"] != s0
            st = c.stats()
            assert st["read_errors"] == 0 and not st["model_changed"]
            assert c.status()["state"] == "serving"
    finally:
        out = stop_daemon(d)
    assert out.count("since it was indexed") == 1, out
    assert "reloaded" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["in_place", "rename"])
def test_change_while_the_arena_is_reserved_is_noticed(models, tmp_path, how):
    """The file changes after it was indexed but before the readers open it (the daemon is
    reserving and locking the arena, which takes minutes for a big one), with size and mtime
    kept (``rsync --inplace -t``, ``cp -p`` + ``mv``): the readers must compare with what was
    indexed, not adopt the new file's identity and serve its bytes as the indexed model's."""
    from moecached.engine.cache import ExpertCache, ModelChangedError
    from moecached.engine.readers import ReadError
    path, other = models
    idx = open_index(path)
    st = os.stat(path)
    (rewrite_in_place_keep_mtime if how == "in_place" else replace_by_rename)(path, other)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    try:
        cache = ExpertCache(idx, slots=16, lock_memory=False, readers=2, arena_dir=str(tmp_path))
    except ReadError as e:     # refused at start, naming the change: as good
        assert "since it was indexed" in str(e), e
        return
    try:
        L = idx.expert_layers[1]
        with pytest.raises(ModelChangedError):
            lease = cache.acquire(L, [0, 1])
            bad = [verify_expert_bytes(cache.arena.view(cid, slot, sp.part), l, sp.part, e, 0)
                   for l, e, cid, slot in lease.items for sp in idx.parts(l, e)]
            raise AssertionError(f"served after the change; seed-0 mismatches: {[b for b in bad if b]}")
        assert cache.readers.model_changed
    finally:
        cache.close()


def test_failing_load_does_not_evict(model_factory, tmp_path):
    from moecached.engine.cache import ExpertCache, LoadError
    src = model_factory(LAYOUT, layers=LAYERS, experts=16, seed=0)
    path = str(tmp_path / "m.gguf")
    shutil.copyfile(src, path)
    idx = open_index(path)
    L = idx.expert_layers[0]
    with ExpertCache(idx, slots=16, readers=2, arena_dir=str(tmp_path), lock_memory=False) as cache:
        lease = cache.acquire(L, list(range(8)))
        cache.release(lease)
        before = cache.stats()

        def resident():
            return [cache.acquire_resident(L, [e]) is not None for e in range(16)]

        # a read that fails before touching the slot (the reader pool refuses it)
        real = cache.readers.submit

        def refuse(*a, **kw):
            from moecached.engine.readers import ReadError
            raise ReadError("refused for the test")
        cache.readers.submit = refuse
        try:
            with pytest.raises(LoadError):
                cache.acquire(L, [9])
        finally:
            cache.readers.submit = real
        mid = cache.stats()
        assert mid["evictions"] == before["evictions"]
        assert [x["used"] for x in mid["classes"]] == [x["used"] for x in before["classes"]]
        # the model changes (ctime only: a chmod), every miss is refused without evicting
        os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) ^ stat.S_IWGRP)
        for e in range(8, 16):
            with pytest.raises(LoadError):
                cache.acquire(L, [e])
        after = cache.stats()
        assert after["evictions"] == before["evictions"]
        assert after["read_errors"] == 1  # only the refused read above
        assert [x["used"] for x in after["classes"]] == [x["used"] for x in before["classes"]]
        got = resident()
        assert got == [True] * 8 + [False] * 8, got
