"""A scripted stand-in for moecached, for the C client's socket behaviour that a real daemon
does not produce on demand: a reply after the caller's timeout, a reply from another session,
an error code, an arena descriptor of an unknown version.

    python fake_daemon.py BUILD_DIR SCRATCH_DIR

Binds a ROUTER on ipc://SCRATCH_DIR/fake.sock, runs BUILD_DIR/test_fake against it, then
checks what the client sent (hello fields, the release of the late lease, bye). Exit 0 on
success.
"""
import os
import subprocess
import sys
import time

import msgpack
import numpy as np
import zmq

S1, S2, S3 = 0x1111_2222_3333, 0x4444_5555_6666, 0x7777_8888_9999
LAYERS, E, SLOTS, PART = [0, 1], 4, 4, 64
# an error line longer than mc_error.message and than 4 KiB (a model file's long path): the client keeps its head
# and its end, where the fix is, cut between UTF-8 characters
LONG_MESSAGE = "slow down: model file /dee/" + "modèles/" * 700 + "m.gguf changed since it was indexed; the fix: wait 1 s"


def make_arena(path: str, session: int, version: int = 2) -> dict:
    ctl = 4096
    gen_off, resmap_off = 64, 64 + 8 * SLOTS
    size = ctl + PART * SLOTS
    buf = np.zeros(size, dtype=np.uint8)
    w = buf[:ctl].view(np.uint64)
    buf[:8] = np.frombuffer(b"MOECTL01", dtype=np.uint8)
    w[1], w[2], w[3], w[4], w[5] = session, 1, 1, len(LAYERS) * E, resmap_off
    for s in range(SLOTS):
        w[gen_off // 8 + s] = 100 + s
        buf[ctl + s * PART: ctl + (s + 1) * PART] = s + 1
    buf.tofile(path)
    return {"version": version, "path": path, "size": size, "page_size": 4096,
            "control": {"off": 0, "bytes": ctl, "magic": "MOECTL01", "epoch_off": 8, "state_off": 16,
                        "n_keys": len(LAYERS) * E, "resmap_off": resmap_off},
            "classes": [{"id": 0, "layers": LAYERS, "parts": ["gate"], "part_bytes": {"gate": PART},
                         "part_off": {"gate": ctl}, "part_types": {"gate": "Q8_0"}, "n_slots": SLOTS,
                         "slot_bytes": PART, "gen_off": gen_off}],
            "layer_class": {str(l): 0 for l in LAYERS}}


def make_pins(path: str, session: int) -> dict:
    """A pin file as the daemon creates it for a fast-path client (docs/protocol.md)."""
    ring_n, pins_off, ring_off = 8, 192, 256
    size = ring_off + 16 * ring_n
    w = np.zeros(size // 8, dtype=np.uint64)
    w[0] = int.from_bytes(b"MOEPIN01", "little")
    w[1], w[2], w[3], w[4], w[5], w[6] = session, SLOTS, ring_n, pins_off, ring_off, 64
    w.tofile(path)
    return {"path": path, "size": size, "ring_n": ring_n, "pins_off": pins_off, "ring_off": ring_off, "quota": 64}


def start_time(pid: int) -> int:
    st = open(f"/proc/{pid}/stat", "rb").read()
    return int(st[st.rindex(b")") + 2:].split()[19])


def main(build: str, d: str) -> int:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind(f"ipc://{d}/fake.sock")
    arenas = {S1: make_arena(f"{d}/arena1", S1), S2: make_arena(f"{d}/arena2", S2)}
    v3 = make_arena(f"{d}/arena3", S1, version=3)
    # the fast-path client: expert 2 of block 1 (key 1 * E + 2) resident in slot 3
    fast_arena = make_arena(f"{d}/arena4", S3)
    fast_pins = make_pins(f"{d}/pins4", S3)
    ctl = np.memmap(f"{d}/arena4", dtype=np.uint64, mode="r+", shape=(512,))
    ctl[fast_arena["control"]["resmap_off"] // 8 + 1 * E + 2] = 3 + 1
    ctl.flush()
    pinw = np.memmap(f"{d}/pins4", dtype=np.uint64, mode="r", shape=(fast_pins["size"] // 8,))
    fast_pings = 0
    warm_polls = {}
    restart_hellos, restart_pings = [], []   # warmrestart: its hellos; per ping, its hellos so far
    cancels, late_rid = [], None
    hb_wait = None
    proc = subprocess.Popen([os.path.join(build, "test_fake"), f"ipc://{d}/fake.sock"])
    session, hellos, releases, byes, delayed, problems = S1, [], [], 0, [], []

    def reply(ident, rid, sess, **kw):
        sock.send_multipart([ident, msgpack.packb({"v": 1, "id": rid, "ok": True, "session": sess, **kw})])

    def lease_reply(ident, rid, sess, lid, layer, experts):
        items = [[layer, e, 0, e % SLOTS] for e in experts]
        reply(ident, rid, sess, lease=lid, items=items, gens=[100 + e % SLOTS for e in experts], hits=len(experts),
              prefetch_hits=0, misses=0, stall_us=0)

    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    deadline = time.time() + 60
    while proc.poll() is None and time.time() < deadline:
        for t, ident, rid, sess, lid, layer, ex in list(delayed):
            if time.time() >= t:
                lease_reply(ident, rid, sess, lid, layer, ex)
                delayed.remove((t, ident, rid, sess, lid, layer, ex))
        if not poller.poll(20):
            continue
        ident, data = sock.recv_multipart()
        m = msgpack.unpackb(data)
        op, rid = m["op"], m["id"]
        if op == "hello":
            hellos.append(m)
            if m.get("client") == "warmrestart":
                # the first hello: session S1; after the "restart" (a ping answered from S2),
                # the client says hello again and gets S2
                restart_hellos.append(m)
                sess = S1 if len(restart_hellos) == 1 else S2
                reply(ident, rid, sess, arena=arenas[S1] if sess == S1 else arenas[S2], expert_layers=LAYERS,
                      n_experts=E, top_k=2, heartbeat_s=5.0, lease_watch="heartbeat",
                      limits={"max_request_experts": 64}, pins=None)
                continue
            if m.get("client") in ("hbwait", "warmwait", "warmquiet", "warmslow"):
                reply(ident, rid, S1, arena=arenas[S1], expert_layers=LAYERS, n_experts=E, top_k=2,
                      heartbeat_s=5.0, lease_watch="heartbeat", limits={"max_request_experts": 64}, pins=None)
                continue
            if m.get("client") == "fastc":
                reply(ident, rid, S3, arena=fast_arena, expert_layers=LAYERS, n_experts=E, top_k=2,
                      heartbeat_s=5.0, lease_watch="process", limits={"max_request_experts": 64}, pins=fast_pins)
                continue
            if m.get("client") == "v3":
                reply(ident, rid, S1, arena=v3, expert_layers=LAYERS, n_experts=E, top_k=2, heartbeat_s=5.0,
                      lease_watch="process", limits={"max_request_experts": 64}, pins=None)
                continue
            if m.get("pid") != proc.pid or m.get("pid_start") != start_time(proc.pid) or m.get("fast_path") is not True:
                problems.append(f"hello fields: {m}")
            reply(ident, rid, session, arena=arenas[session], expert_layers=LAYERS, n_experts=E, top_k=2,
                  heartbeat_s=5.0, lease_watch="process", limits={"max_request_experts": 64}, pins=None)
        elif op == "acquire":
            ex = m["experts"]
            if ex == [1, 2]:
                lease_reply(ident, rid, session, 11, m["layer"], ex)
            elif ex == [1] and hellos[-1].get("client") == "hbwait":   # a long wait for reads
                delayed.append((time.time() + 1.5, ident, rid, S1, 55, m["layer"], ex))
                hb_wait = [time.time(), 0]
            elif ex == [2]:     # answered after the client's timeout
                late_rid = rid
                delayed.append((time.time() + 1.0, ident, rid, session, 22, m["layer"], ex))
            elif ex == [3]:
                sock.send_multipart([ident, msgpack.packb({"v": 1, "id": rid, "ok": False, "session": session,
                                                           "error": {"code": "rate_limited", "message": LONG_MESSAGE}})])
            elif ex == [2, 3] and hellos[-1].get("client") == "fastc":   # expert 3 not resident: socket
                lease_reply(ident, rid, S3, 44, m["layer"], ex)
            elif ex == [0]:     # the daemon "restarted": the answer comes from another session
                session = S2
                lease_reply(ident, rid, S2, 33, m["layer"], ex)
            else:
                problems.append(f"unexpected acquire {m}")
        elif op == "release":
            releases.append(m.get("lease"))
            if m.get("noreply") is not True:
                problems.append(f"release without noreply: {m}")
        elif op == "ping" and hellos and hellos[-1].get("client") == "warmrestart":
            # 2 left from S1, then the daemon "restarts": S2 answers (the client says hello
            # again), its own fill has 2, 1, 0 left
            restart_pings.append(len(restart_hellos))
            n1 = restart_pings.count(1)
            if len(restart_hellos) == 1:
                reply(ident, rid, S1 if n1 <= 2 else S2, t=time.time(), warm_pending=2)
            else:
                reply(ident, rid, S2, t=time.time(), warm_pending=max(0, 3 - restart_pings.count(2)))
        elif op == "ping" and hellos and (hellos[-1].get("client") in ("warmwait", "warmquiet", "warmslow")
                                          or hellos[-1].get("client") not in warm_polls):
            # mc_connect's poll of the warm fill (the first ping of each client name), and every
            # ping of warmwait and warmquiet (3 experts left, one fewer at each ask) and warmslow
            # (never ends)
            who = hellos[-1].get("client")
            warm_polls[who] = warm_polls.get(who, 0) + 1
            pending = {"warmwait": max(0, 4 - warm_polls[who]), "warmquiet": max(0, 4 - warm_polls[who]),
                       "warmslow": 5}.get(who, 0)
            reply(ident, rid, {"fastc": S3, "hbwait": S1, "warmwait": S1, "warmquiet": S1,
                               "warmslow": S1}.get(who, session),
                  t=time.time(), warm_pending=pending)
        elif op == "ping" and hellos and hellos[-1].get("client") == "hbwait":
            if hb_wait is not None and time.time() - hb_wait[0] < 1.5:
                hb_wait[1] += 1
            reply(ident, rid, S1, t=time.time())
        elif op == "ping" and hellos and hellos[-1].get("client") == "fastc":
            fast_pings += 1
            pins = pinw[192 // 8:256 // 8].view(np.uint32)
            if fast_pings == 1:     # the client holds a fast-path lease on slot 3
                if list(pins[:SLOTS]) != [0, 0, 0, 1] or pinw[8] != 1 or pinw[256 // 8] != 1 * E + 2 + 1:
                    problems.append(f"fast pin: counts {list(pins[:SLOTS])}, head {pinw[8]}, ring[0] {pinw[32]}")
            elif fast_pings == 2:   # released; then the "daemon" goes away (epoch cleared)
                if list(pins[:SLOTS]) != [0, 0, 0, 0]:
                    problems.append(f"fast release left pins {list(pins[:SLOTS])}")
                ctl[1] = 0
                ctl.flush()
            reply(ident, rid, S3, t=time.time())
        elif op == "ping":
            reply(ident, rid, session, t=time.time())
        elif op == "cancel":
            cancels.append(m.get("request"))
            if m.get("noreply") is not True:
                problems.append(f"cancel without noreply: {m}")
        elif op == "bye":
            byes += 1
            reply(ident, rid, session, released=0)
        else:
            problems.append(f"unexpected op {m}")
    if proc.poll() is None:
        proc.kill()
        problems.append("test_fake did not finish within 60 s")
    rc = proc.wait()
    if rc:
        problems.append(f"test_fake exited {rc}")
    if releases != [22, 44, 55]:
        problems.append(f"releases sent: {releases} (expected the late lease 22 and the socket leases 44, 55)")
    if [h.get("client") for h in hellos] != ["fake", "fake", "v3", "fastc", "hbwait", "warmwait", "warmquiet",
                                             "warmslow", "warmrestart", "warmrestart"]:
        problems.append(f"hellos: {[h.get('client') for h in hellos]} (expected fake, fake again, v3, fastc, "
                        f"hbwait, warmwait, warmquiet, warmslow, warmrestart twice)")
    # warmrestart: 3 pings to the first daemon (2 left, 2 left, then answered by the restarted one),
    # hello again, 3 to the second (2, 1, 0 left), 1 more by the test's mc_warm_wait
    if restart_pings != [1, 1, 1, 2, 2, 2, 2]:
        problems.append(f"warmrestart pings (hellos so far at each): {restart_pings}, expected "
                        f"[1, 1, 1, 2, 2, 2, 2]")
    # mc_connect pings once when no fill runs; warmwait: 4 pings in mc_connect (3, 2, 1, 0 left) and
    # one more by mc_warm_wait; warmslow connects without waiting, then mc_warm_wait asks for 100 ms
    if {k: warm_polls.get(k) for k in ("fake", "fastc", "hbwait", "warmwait", "warmquiet")} != \
            {"fake": 1, "fastc": 1, "hbwait": 1, "warmwait": 5, "warmquiet": 5} \
            or not 2 <= warm_polls.get("warmslow", 0) <= 10:
        problems.append(f"warm fill polls (pings): {warm_polls} (expected fake, fastc, hbwait 1 each, warmwait "
                        f"and warmquiet 5, warmslow 2-10)")
    if hb_wait is None or hb_wait[1] < 3:
        problems.append(f"pings while an acquire waited 1.5 s (heartbeat every 0.1 s): "
                        f"{hb_wait and hb_wait[1]}, expected at least 3")
    if fast_pings != 2:
        problems.append(f"{fast_pings} pings from the fast-path client, expected 2")
    if cancels != [late_rid]:
        problems.append(f"cancels sent: {cancels} (expected one, for the acquire that timed out: id {late_rid})")
    if byes != 6:
        problems.append(f"{byes} bye(s), expected 6 (fake after its restart, hbwait, warmwait, warmquiet, "
                        f"warmslow, warmrestart)")
    for p in problems:
        print("fake_daemon: FAIL:", p)
    if not problems:
        print("fake_daemon: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
