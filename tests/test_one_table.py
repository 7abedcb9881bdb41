"""Facts declared once, every copy held to the declaration.

* The shared-memory layout: ``clients/c/include/moecache_shm.h`` declares it; the daemon reads it
  through ``moecached.engine._shm`` (compiled from the header), the arena uses those values; the few
  copies that cannot include the header (the socket-only Python client, docs/protocol.md) are
  checked here.
* The error codes: ``moecached.facts.protocol.ERROR_CODES`` declares them; docs/protocol.md's table and
  the C client's code map (``DAEMON_CODES`` and ``mc_code``) must name exactly those.
"""
from __future__ import annotations

import re
from pathlib import Path

from moecached.engine import _shm, arena
from moecached.facts import protocol

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "clients/c/include/moecache_shm.h"


def header_values() -> dict:
    """NAME -> int of every ``#define MCSHM_*`` number and explicit ``MCSHM_* = n`` enum value."""
    text = HEADER.read_text()
    out = {m[1]: int(m[2].rstrip("ULul"), 0)
           for m in re.finditer(r"#define\s+(MCSHM_\w+)\s+(0x[0-9a-fA-F]+[UL]*|\d+[UL]*)\b", text)}
    out.update({m[1]: int(m[2]) for m in re.finditer(r"\b(MCSHM_\w+)\s*=\s*(\d+)", text)})
    return out


def test_header_is_parsed():
    h = header_values()
    for name in ("MCSHM_CTL_MAGIC", "MCSHM_PIN_MAGIC", "MCSHM_MAX_CLASSES", "MCSHM_CTL_HEADER_BYTES",
                 "MCSHM_PIN_HEADER_BYTES", "MCSHM_CTL_W_RESMAP_OFF", "MCSHM_PIN_W_TAIL",
                 "MCSHM_STATE_MODEL_CHANGED"):
        assert name in h, name


def test_daemon_takes_the_layout_from_the_header():
    h = header_values()
    assert _shm.CTL_MAGIC == h["MCSHM_CTL_MAGIC"].to_bytes(8, "little") == b"MOECTL01"
    assert _shm.PIN_MAGIC == h["MCSHM_PIN_MAGIC"].to_bytes(8, "little") == b"MOEPIN01"
    assert _shm.CTL_HEADER_BYTES == h["MCSHM_CTL_HEADER_BYTES"]
    assert _shm.PIN_HEADER_BYTES == h["MCSHM_PIN_HEADER_BYTES"]
    assert _shm.MAX_CLASSES == h["MCSHM_MAX_CLASSES"]
    assert (arena.CONTROL_MAGIC, arena.PIN_MAGIC, arena.CONTROL_HEADER_BYTES) == \
        (_shm.CTL_MAGIC, _shm.PIN_MAGIC, _shm.CTL_HEADER_BYTES)
    words = {"EPOCH": arena.EPOCH_OFF, "STATE": arena.STATE_OFF, "NCLASSES": arena.NCLASSES_OFF,
             "NKEYS": arena.NKEYS_OFF, "RESMAP_OFF": arena.RESMAP_OFF_OFF}
    for w, off in words.items():
        assert off == 8 * h[f"MCSHM_CTL_W_{w}"], w
    for s in ("STOPPED", "SERVING", "MODEL_CHANGED"):
        assert getattr(arena, f"STATE_{s}") == h[f"MCSHM_STATE_{s}"], s
    for name, w in _shm.PIN_WORDS.items():
        key = {"n_slots": "NSLOTS"}.get(name, name.upper())
        assert w == h[f"MCSHM_PIN_W_{key}"], name


def test_copies_outside_the_daemon_match_the_header():
    """The socket-only Python client (no compiler) and the protocol document repeat a few facts."""
    client = (ROOT / "clients/python/moecache_client/lease.py").read_text()
    m = re.search(r'_CONTROL_MAGIC\s*=\s*b"(\w+)"', client)
    assert m and m[1].encode() == _shm.CTL_MAGIC
    doc = (ROOT / "docs/protocol.md").read_text()
    for magic in (_shm.CTL_MAGIC, _shm.PIN_MAGIC):
        assert magic.decode() in doc, magic


def test_error_codes_one_table():
    codes = protocol.ERROR_CODES
    assert len(set(codes)) == len(codes) and "unknown_model" in codes and "internal" in codes
    doc = (ROOT / "docs/protocol.md").read_text()
    table = doc[doc.index("## Error codes"):]
    table = table[:table.index("\n## ", 1)]
    documented = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert sorted(documented) == sorted(codes), "docs/protocol.md 'Error codes' vs protocol.ERROR_CODES"


def test_c_client_knows_every_error_code():
    src = (ROOT / "clients/c/src/moecache.c").read_text()
    hdr = (ROOT / "clients/c/include/moecache.h").read_text()
    table = src[src.index("DAEMON_CODES[]"):]
    table = table[:table.index("};")]
    pairs = re.findall(r'\{"(\w+)", (MC_ERR_D_\w+)\}', table)
    assert sorted(s for s, _ in pairs) == sorted(protocol.ERROR_CODES), "DAEMON_CODES vs ERROR_CODES"
    for s, name in pairs:
        assert name == f"MC_ERR_D_{s.upper()}", (s, name)
        assert re.search(rf"\b{name}\b", hdr), f"{name} not in mc_code (moecache.h)"
        assert f'case {name}: return "{name}";' in src, f"{name} has no name in mc_code_name"


def test_the_c_client_releases_within_the_protocols_lease_limit():
    src = (ROOT / "clients/c/src/moecache.c").read_text()
    m = re.search(r"#define MC_MAX_LEASES_PER_REQUEST (\d+)", src)
    assert m and int(m.group(1)) == protocol.MAX_LEASES_PER_REQUEST


def test_the_python_client_copies_no_lease_rule():
    """Lease validity is written once, in C (mcshm_valid): the Python client calls it through
    its extension or asks the daemon (``check``); it reads no slot generations itself."""
    src = "".join(p.read_text() for p in (ROOT / "clients/python/moecache_client").glob("*.py"))
    assert "gen_off" not in src and ".gens[" not in src
    assert '"op": "check"' in src
