"""llama.cpp through moecached with the engine's gate-ahead prefetch off, one block ahead and two
blocks ahead, at a fraction of the experts in the arena: decode speed, reads, guess quality.

    python benchmarks/engine_prefetch.py --model MODEL.gguf [--fractions 0.5,0.75]
        [--modes off,next,two] [--rounds 3] [--steps 64] [--threads 2] [--prompt-file F]
        [--prompt-chars 400] [--daemon-arg=--KEY=VALUE]... [--bin DIR] [--json out.json]

Every run is mc-decode (the patched llama.cpp's checking driver: greedy steps, every logits row
dumped) with ``--moecached-prefetch MODE`` against a fresh daemon (no state file, so the arena
starts empty) of ``--slots`` f x all routed experts, the page cache dropped first (the daemon
reads with O_DIRECT; the drop makes the engine's own load cold too). Rounds are interleaved: in
each round every fraction runs every mode, the modes' order rotated by one per round. Each
row is the median over the rounds (decode and prompt tokens per second; "paired": the median of
each round's decode speed over the first mode's in that round, the steadier figure on a busy
machine); the counts are the
last round's (a run is deterministic in what it routes; what arrives in time varies).

Columns: the engine's demand misses (``misses`` of mc-decode's moecached line: experts an
acquire had to wait for) and its acquire time; the daemon's ``bytes_read`` and ``prefetches``
(reads queued for prefetches), ``prefetch_hits`` (requested experts a prefetch had brought in or
was bringing in), ``wasted_prefetches`` (prefetched experts evicted before use); the engine's
``recall`` (block l+1's routed experts that block l's guess named, over all routed ones) and
``recall2`` (two ahead). Every run's logits must equal the first ``off`` run's of its fraction
byte for byte (``identical`` column; prefetch only changes when bytes arrive). A mode
``MODE@C`` (e.g. ``next@0.05``) runs MODE against a daemon started with
``--prefetch-min-confidence C`` (it drops guesses whose predicted probability is below C).
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import filecmp
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from benchutil import start_daemon, stop_daemon, write_json  # noqa: E402
from read_path import drop_caches  # noqa: E402
from moecached.tools import engine_llama  # noqa: E402
from moecached.engine.index import open_index  # noqa: E402

TRAINED = ROOT / "benchmarks" / "models" / "qwen3moe-stdlib-8x32-q8_0.gguf"
HELDOUT = ROOT / "benchmarks" / "models" / "qwen3moe-stdlib-heldout.txt"


def parse_prefetch(stdout: str) -> dict:
    """mc-decode's ``prefetch mode=... recall=R ...`` line as a dict (numbers parsed)."""
    m = re.search(r"^prefetch (mode=.*)$", stdout, re.M)
    if not m:
        return {}
    out = {}
    for kv in m.group(1).split():
        k, v = kv.split("=", 1)
        out[k] = v if k == "mode" else (float(v) if "." in v else int(v))
    return out


def engine(bin_dir, model, prompt, steps, threads, endpoint, mode, dump) -> dict:
    cmd = [str(bin_dir / "mc-decode"), "-m", model, "-p", prompt, "-n", str(steps), "-t", str(threads),
           "--dump", str(dump), "--moecached", endpoint, "--moecached-prefetch", mode]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"mc-decode exited {p.returncode}: {p.stderr.strip()[-1500:]}")
    r = engine_llama.parse_timing(p.stdout)
    r.update(wall_s=time.monotonic() - t0, served=engine_llama.parse_stats(p.stdout),
             prefetch=parse_prefetch(p.stdout))
    return r


def daemon_stats(ep: str) -> dict:
    from moecache_client import Client
    with Client(ep, name="bench-stats", map_arena=False) as c:
        return c.stats()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", help="directory of the patched build's binaries")
    ap.add_argument("--model", default=str(TRAINED), help="a runnable MoE GGUF (default: the trained model)")
    ap.add_argument("--fractions", default="0.5,0.75")
    ap.add_argument("--modes", default="off,next,two")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-file", default=str(HELDOUT), help="the prompt's text (default: the held-out text)")
    ap.add_argument("--prompt-chars", type=int, default=400)
    ap.add_argument("--daemon-arg", action="append", default=[],
                    help="one more daemon argument (repeatable), e.g. --daemon-arg=--prefetch-min-confidence=0.1")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new one under $TMPDIR)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "engine_prefetch.json"))
    a = ap.parse_args(argv)
    bin_dir = Path(a.bin) if a.bin else engine_llama.llama_bin()
    if bin_dir is None or not (bin_dir / "mc-decode").exists():
        sys.exit("engine_prefetch: no patched llama.cpp (clients/llama.cpp/build.sh, or --bin DIR)")
    fractions = [float(x) for x in a.fractions.split(",")]
    modes = a.modes.split(",")
    prompt = open(a.prompt_file, encoding="utf-8", errors="replace").read()[: a.prompt_chars]
    work = Path(a.dir or tempfile.mkdtemp(prefix="engine-prefetch-"))
    work.mkdir(parents=True, exist_ok=True)
    idx = open_index(a.model)
    n_all = idx.n_experts * len(idx.expert_layers)
    routed = idx.routed_expert_bytes
    print(f"model {a.model}: {len(idx.expert_layers)} MoE blocks, {n_all} experts, "
          f"{routed / 2**20:.1f} MiB routed; {a.steps} steps, {a.threads} threads, prompt {len(prompt)} chars")
    dropped = drop_caches()
    if not dropped:
        print("note: cannot drop the page cache (not root): the engine's own load is warm; the daemon reads O_DIRECT")
    runs: list[dict] = []
    ref: dict[float, Path] = {}
    for rnd in range(a.rounds):
        for f in fractions:
            slots = max(1, int(round(f * n_all)))
            order = modes[rnd % len(modes):] + modes[: rnd % len(modes)]
            for mode in order:
                sock = str(work / "d.sock")
                drop_caches()
                flag, _, conf = mode.partition("@")
                extra = [f"--prefetch-min-confidence={conf}"] if conf else []
                d = start_daemon(a.model, sock, "--slots", str(slots), "--state-dir", str(work / f"state-{rnd}-{f}-{mode}"),
                                 *a.daemon_arg, *extra)
                try:
                    dump = work / f"logits-{f}-{mode}-{rnd}.bin"
                    r = engine(bin_dir, a.model, prompt, a.steps, a.threads, f"ipc://{sock}", flag, dump)
                    st = daemon_stats(f"ipc://{sock}")
                finally:
                    stop_daemon(d)
                if f not in ref and mode == "off":
                    ref[f] = dump
                same = filecmp.cmp(ref[f], dump, shallow=False) if f in ref else None
                row = dict(round=rnd, fraction=f, slots=slots, mode=mode, decode_tps=r["decode_tps"],
                           prompt_tps=r["prompt_tps"], misses=r["served"].get("misses"),
                           acquire_us=r["served"].get("acquire_us"), engine=r["served"], prefetch=r["prefetch"],
                           bytes_read=st.get("bytes_read"), prefetches=st.get("prefetches"),
                           prefetch_hits=st.get("prefetch_hits"), wasted_prefetches=st.get("wasted_prefetches"),
                           prefetches_dropped=st.get("prefetches_dropped"), demand_misses=st.get("misses"),
                           identical=same)
                runs.append(row)
                print(f"round {rnd} {f:.0%} {mode:4s}: decode {r['decode_tps']:.1f} tok/s, prompt {r['prompt_tps']:.1f} tok/s, "
                      f"misses {row['misses']}, read {row['bytes_read'] / 2**20:.1f} MiB, "
                      f"recall {r['prefetch'].get('recall', 0):.3f}, identical {same}", flush=True)
                if same is False:
                    print("ERROR: logits differ from the off run's", file=sys.stderr)
    table = []
    for f in fractions:
        for mode in modes:
            rs = [x for x in runs if x["fraction"] == f and x["mode"] == mode]
            last = rs[-1]
            offs = {x["round"]: x["decode_tps"] for x in runs if x["fraction"] == f and x["mode"] == modes[0]}
            paired = [x["decode_tps"] / offs[x["round"]] for x in rs if offs.get(x["round"])]
            pf = last["prefetch"]
            table.append(dict(fraction=f, mode=mode, slots=last["slots"],
                              decode_tps=statistics.median(x["decode_tps"] for x in rs),
                              decode_tps_all=[round(x["decode_tps"], 2) for x in rs],
                              paired=statistics.median(paired) if paired else None,
                              prompt_tps=statistics.median(x["prompt_tps"] for x in rs),
                              misses=last["misses"], acquire_ms=last["acquire_us"] / 1e3,
                              bytes_read=last["bytes_read"], prefetches=last["prefetches"],
                              prefetch_hits=last["prefetch_hits"], wasted=last["wasted_prefetches"],
                              recall=pf.get("recall"), recall2=pf.get("recall2"), sent=pf.get("sent"),
                              useful=pf.get("useful"), identical=all(x["identical"] is not False for x in rs)))
    print()
    print(f"| in arena | prefetch | decode tok/s | paired (/ {modes[0]}) | prompt tok/s | misses | acquire ms | MiB read | prefetches | "
          "prefetch hits | wasted | recall | recall2 | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for t in table:
        rec = "-" if t["mode"] == "off" else f"{t['recall']:.3f}"
        rec2 = "-" if not t["mode"].startswith("two") else f"{t['recall2']:.3f}"
        print(f"| {t['fraction']:.0%} ({t['slots']}) | {t['mode']} | {t['decode_tps']:.2f} | {t['paired']:.3f} | {t['prompt_tps']:.1f} | "
              f"{t['misses']} | {t['acquire_ms']:.0f} | {t['bytes_read'] / 2**20:.1f} | {t['prefetches']} | "
              f"{t['prefetch_hits']} | {t['wasted']} | {rec} | {rec2} | {'yes' if t['identical'] else 'NO'} |")
    write_json(a.json, dict(model=a.model, daemon_args=a.daemon_arg, steps=a.steps, threads=a.threads, rounds=a.rounds,
                            prompt_chars=len(prompt), page_cache_dropped=dropped, table=table, runs=runs))
    return 0 if all(t["identical"] for t in table) else 1


if __name__ == "__main__":
    sys.exit(main())
