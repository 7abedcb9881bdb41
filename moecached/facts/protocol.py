"""The moecached wire protocol: message framing, limits and request validation.

Every message is one ZeroMQ frame holding a msgpack map (see docs/protocol.md, which is the
normative description a C or C++ engine can implement from). The server is a ROUTER socket,
clients are DEALER sockets; a client may put an empty delimiter frame before the payload
(REQ-style envelope) and gets the same envelope back.

Requests: ``{"v": 1, "id": <uint>, "op": <str>, ...}``.
Replies:  ``{"v": 1, "id": <same>, "ok": true, "session": <uint>, ...}`` or
          ``{"v": 1, "id": <same>, "ok": false, "session": <uint>,
             "error": {"code": <str>, "message": <str>}}``.
"""
from __future__ import annotations

import math

import msgpack

from moecached import MoecacheError

PROTOCOL_VERSION = 1

#: Limits applied while unpacking, so a small message declaring a huge array or string is
#: refused before anything is allocated (msgpack checks declared lengths against these).
MAX_MESSAGE_BYTES = 4 << 20        # 4 MiB: ~500k expert ids per message, far above real batches
MAX_ARRAY_LEN = 1 << 16            # 65536 entries: (layers x top-k) of the largest batches
MAX_MAP_LEN = 64
MAX_LEASES_PER_REQUEST = 1024      # lease ids one release or check may name
MAX_STR_LEN = 4096
MAX_BIN_LEN = 0                    # the protocol never carries binary payloads

#: msgpack.unpackb arguments of every request frame (the limits above, str keys, no raw bytes)
UNPACK_LIMITS = dict(raw=False, strict_map_key=True, max_str_len=MAX_STR_LEN, max_bin_len=MAX_BIN_LEN,
                     max_array_len=MAX_ARRAY_LEN, max_map_len=MAX_MAP_LEN, max_ext_len=0)

OPS = ("hello", "acquire", "prefetch", "release", "cancel", "check", "stats", "status", "ping", "bye",
       "trace_start", "trace_stop", "models", "clients", "warm")

#: What each op that changes the daemon (rather than one client's own leases) is, as a
#: ``not_permitted`` refusal names it: only the daemon's uid, root and the ``admin_group`` may
#: send these (docs/operations.md, "Security model"). ``models`` and ``clients`` are admin ops
#: only for the actions named in :data:`ADMIN_ACTIONS`; their listing is open to every client.
ADMIN_OPS = {"trace_start": "trace start", "trace_stop": "trace stop", "models": "models",
             "clients": "clients", "warm": "warm"}
#: op -> the ``action`` values of it that change the daemon
ADMIN_ACTIONS = {"models": frozenset({"add", "remove", "rebalance"}), "clients": frozenset({"drop"})}

#: The request shapes the server's hot path (``moecached.service._serve.FastPath``) may serve: op ->
#: its exact field set. A request of that op with any other fields, or any other op, always
#: takes the general path (``Server._handle``), so these sets only bound what the hot path
#: looks at; the reply is the same either way.
HOT_PATH_FIELDS = {
    "acquire": frozenset({"v", "id", "op", "layer", "experts"}),
    "release": frozenset({"v", "id", "op", "lease", "noreply"}),
    "prefetch": frozenset({"v", "id", "op", "layer", "experts", "noreply"}),
}

# Error codes (stable strings; docs/protocol.md lists them with meanings).
E_MALFORMED = "malformed"          # not msgpack, not a map, over the size limits
E_VERSION = "version"              # protocol version not supported
E_UNKNOWN_OP = "unknown_op"
E_BAD_TYPE = "bad_type"            # a field has the wrong type or is missing
E_OUT_OF_RANGE = "out_of_range"    # layer or expert id not in the model
E_TOO_LARGE = "too_large"          # request larger than its size class can ever hold / limits
E_UNKNOWN_LEASE = "unknown_lease"  # released twice, expired, or never existed
E_STALE_LEASE = "stale_lease"      # lease id from another daemon instance (before a restart)
E_NOT_OWNER = "not_owner"          # releasing another client's lease
E_LOAD_FAILED = "load_failed"      # reading an expert from the model file failed
E_MODEL_CHANGED = "model_changed"  # the model file changed since it was indexed: no reads until re-indexed
E_TIMEOUT = "timeout"
E_UNAVAILABLE = "unavailable"      # cannot be satisfied at the current (shrunk) budget
E_SHUTDOWN = "shutdown"            # the daemon is stopping
E_INVALID_STATE = "invalid_state"  # the op does not apply now (trace_stop with no trace running)
E_REFUSED = "refused"              # a valid request the daemon will not carry out (unsafe trace path)
E_RATE_LIMITED = "rate_limited"    # the client is over its request rate limit (client_rate_limit)
E_UNKNOWN_MODEL = "unknown_model"  # hello names a model this daemon does not serve (or is removing)
E_PID_MISMATCH = "pid_mismatch"    # hello claims a pid other than the one the kernel says sent it
E_NOT_PERMITTED = "not_permitted"  # an op that changes the daemon, from a client that is no admin
E_INTERNAL = "internal"

#: Every error code, in declaration order: the one table the views are held to (docs/protocol.md
#: "Error codes", the C client's ``DAEMON_CODES`` / ``mc_code``; tests/test_one_table.py).
ERROR_CODES = tuple(v for k, v in list(globals().items()) if k.startswith("E_"))


class ProtocolError(MoecacheError):
    """A request the server refuses; becomes a structured error reply ``{code, message}``."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def pack(msg: dict) -> bytes:
    """Encode one message (a dict) as msgpack bytes."""
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    """Decode one request frame with the protocol's limits (``max_bytes``: frame size cap).

    Raises:
        ProtocolError(E_MALFORMED): over MAX_MESSAGE_BYTES, not msgpack, trailing bytes,
            a declared length over the limits, or not a map.
    """
    if len(data) > max_bytes:
        raise ProtocolError(E_MALFORMED, f"message of {len(data)} bytes: expected at most {max_bytes}")
    try:
        msg = msgpack.unpackb(data, **UNPACK_LIMITS)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        detail = f": {e}" if str(e) else ""
        raise ProtocolError(E_MALFORMED, f"message is not valid msgpack within limits ({type(e).__name__}{detail})"[:300])
    except Exception as e:  # any other decoder failure is still the client's malformed input
        raise ProtocolError(E_MALFORMED, f"message is not valid msgpack: {type(e).__name__}: {e}"[:300])
    if not isinstance(msg, dict):
        raise ProtocolError(E_MALFORMED, f"message is a msgpack {type(msg).__name__}: expected a map")
    return msg


def _int(msg: dict, key: str, *, lo: int | None = None, hi: int | None = None, default=None):
    v = msg.get(key, default)
    if v is None:
        raise ProtocolError(E_BAD_TYPE, f"field {key!r} missing: expected an integer")
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(E_BAD_TYPE, f"field {key!r} is {type(v).__name__} {v!r:.40}: expected an integer")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ProtocolError(E_OUT_OF_RANGE, f"field {key!r} = {v}: expected {lo}..{hi}")
    return v


def header(msg: dict) -> tuple[int, str]:
    """Check ``v``, ``id`` and ``op``; returns (request id, op).

    A request whose id cannot be read is answered with id 0.
    """
    if "id" not in msg:
        raise ProtocolError(E_BAD_TYPE, "field 'id' missing: expected an unsigned 64-bit request id")
    rid = msg["id"]
    if isinstance(rid, bool) or not isinstance(rid, int) or not (0 <= rid < 2**64):
        raise ProtocolError(E_BAD_TYPE, f"field 'id' = {rid!r:.40}: expected an unsigned 64-bit integer")
    if "v" not in msg:
        raise ProtocolError(E_VERSION, f"field 'v' missing: expected the protocol version {PROTOCOL_VERSION}")
    v = msg.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:  # true and 1.0 are not the version 1
        raise ProtocolError(E_VERSION, f"protocol version {v!r:.20}: expected {PROTOCOL_VERSION}")
    op = msg.get("op")
    if not isinstance(op, str):
        raise ProtocolError(E_BAD_TYPE, f"field 'op' is {type(op).__name__}: expected a string")
    if op not in OPS:
        raise ProtocolError(E_UNKNOWN_OP, f"unknown op {op!r:.40}: expected one of {', '.join(OPS)}")
    return rid, op


class RequestChecker:
    """Validates (layer, experts) requests against a model's index.

    Args:
        expert_layers: GGUF block numbers that have routed experts.
        n_experts: experts per layer.
        max_experts: cap on the total expert ids in one request.
    """

    def __init__(self, expert_layers, n_experts: int, max_experts: int = MAX_ARRAY_LEN):
        self.layers = frozenset(int(x) for x in expert_layers)
        # no layers (a socket without a model): every layer is out of range
        self.lo, self.hi = (min(self.layers), max(self.layers)) if self.layers else (0, -1)
        self.n_experts = n_experts
        self.max_experts = max_experts

    def requests(self, msg: dict) -> list[tuple[int, list[int]]]:
        """Normalize ``{"layer", "experts"}`` or ``{"layers": [[layer, [experts]], ...]}``.

        Returns [(layer, [expert, ...]), ...]. Raises ProtocolError (bad_type, out_of_range,
        too_large) naming the field and value.
        """
        if "layers" in msg:
            if "layer" in msg or "experts" in msg:
                raise ProtocolError(E_BAD_TYPE, "give either 'layers' or 'layer' + 'experts', not both")
            raw = msg["layers"]
            if not isinstance(raw, list) or not raw:
                raise ProtocolError(E_BAD_TYPE, "field 'layers' must be a non-empty array of [layer, [experts]]")
            items = []
            for i, it in enumerate(raw):
                if not isinstance(it, (list, tuple)) or len(it) != 2:
                    raise ProtocolError(E_BAD_TYPE, f"layers[{i}] must be [layer, [experts]]")
                items.append((it[0], it[1], f"layers[{i}]"))
        else:
            items = [(msg.get("layer"), msg.get("experts"), "")]
        out, total, seen_layers = [], 0, set()
        for layer, experts, where in items:
            p = f"{where}." if where else ""
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise ProtocolError(E_BAD_TYPE, f"field '{p}layer' is {type(layer).__name__}: expected an integer")
            if layer not in self.layers:
                raise ProtocolError(E_OUT_OF_RANGE, f"field '{p}layer' = {layer}: expected a layer with routed experts ({self.lo}..{self.hi})")
            if layer in seen_layers:
                raise ProtocolError(E_BAD_TYPE, f"field '{p}layer' = {layer} appears twice in one request")
            seen_layers.add(layer)
            if not isinstance(experts, list) or not experts:
                raise ProtocolError(E_BAD_TYPE, f"field '{p}experts' must be a non-empty array of integers")
            total += len(experts)
            if total > self.max_experts:
                raise ProtocolError(E_TOO_LARGE, f"request names {total}+ experts: expected at most {self.max_experts}")
            if len(experts) > self.n_experts:   # told before each id is looked at (a flood of these is cheap)
                raise ProtocolError(E_BAD_TYPE, f"field '{p}experts' of layer {layer} names {len(experts)} experts: "
                                                f"the layer has {self.n_experts} (expected each at most once)")
            for e in experts:
                if isinstance(e, bool) or not isinstance(e, int):
                    raise ProtocolError(E_BAD_TYPE, f"field '{p}experts' holds {type(e).__name__} {e!r:.20}: expected integers")
                if not 0 <= e < self.n_experts:
                    raise ProtocolError(E_OUT_OF_RANGE, f"expert {e} in layer {layer}: expected 0..{self.n_experts - 1}")
            if len(set(experts)) != len(experts):
                raise ProtocolError(E_BAD_TYPE, f"field '{p}experts' of layer {layer} repeats an expert id")
            out.append((layer, list(experts)))
        return out

    def confidence(self, msg: dict, reqs: list) -> list | None:
        """The prefetch's optional ``conf`` field: with ``layers``, ``[[c, ...], ...]`` (one
        array per layer entry, one number per expert); with ``layer`` + ``experts``, ``[c,
        ...]`` (one per expert); numbers in [0, 1]. Returns None without the field, else
        ``[[c, ...], ...]`` parallel to ``reqs`` (from :meth:`requests`). Raises ProtocolError
        naming the field and value."""
        raw = msg.get("conf")
        if raw is None:
            return None
        per_layer = "layers" in msg
        if not per_layer:
            raw = [raw]
        shape = "[[c, ...], ...], one array per layers entry" if per_layer else "[c, ...], one per expert"
        if not isinstance(raw, list) or len(raw) != len(reqs):
            raise ProtocolError(E_BAD_TYPE, f"field 'conf' must be {shape}")
        out = []
        for i, (cs, (layer, ex)) in enumerate(zip(raw, reqs)):
            w = f"conf[{i}]" if per_layer else "conf"
            if not isinstance(cs, list) or len(cs) != len(ex):
                n = len(cs) if isinstance(cs, list) else type(cs).__name__
                raise ProtocolError(E_BAD_TYPE, f"field '{w}' has {n} values for {len(ex)} experts of "
                                    f"layer {layer}: expected one number in [0, 1] per expert")
            for c in cs:
                if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c <= 1.0:
                    raise ProtocolError(E_BAD_TYPE, f"field '{w}' holds {c!r:.20}: expected a "
                                        "number in [0, 1] (the predictor's confidence)")
            out.append([float(c) for c in cs])
        return out

    def subst(self, msg: dict, reqs: list) -> tuple | None:
        """The acquire's optional ``subst`` field (docs/protocol.md, "Substitution"):
        ``{"r": float in [0, 1], "cap": int >= 0 (optional: no cap), "layers": [[layer,
        [score per requested expert of that layer], [[expert, score], ...]], ...]}``, checked
        against ``reqs`` (from :meth:`requests`). Returns None without the field, else
        ``(r, cap, {layer: (scores, [(expert, score), ...])})`` with ``cap`` -1 for none.
        Raises ProtocolError naming the field and value."""
        sub = msg.get("subst")
        if sub is None:
            return None
        if not isinstance(sub, dict):
            raise ProtocolError(E_BAD_TYPE, f"field 'subst' is {type(sub).__name__}: expected a map "
                                "{r, cap, layers}")
        r = sub.get("r")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise ProtocolError(E_BAD_TYPE, f"field 'subst.r' = {r!r:.20}: expected a number in [0, 1] "
                                "(a candidate needs at least r x the missing expert's score)")
        cap = sub.get("cap", -1)
        if isinstance(cap, bool) or not isinstance(cap, int) or (cap < 0 and "cap" in sub):
            raise ProtocolError(E_BAD_TYPE, f"field 'subst.cap' = {cap!r:.20}: expected an integer >= 0 "
                                "(swaps per layer; leave it out for no cap)")
        raw = sub.get("layers")
        if not isinstance(raw, list):
            raise ProtocolError(E_BAD_TYPE, "field 'subst.layers' must be an array of "
                                "[layer, [scores], [[expert, score], ...]]")
        asked = dict(reqs)
        out, n = {}, 0

        def score(v, where):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ProtocolError(E_BAD_TYPE, f"field '{where}' = {v!r:.20}: expected a finite "
                                    "number >= 0 (the router's score)")
            return float(v)
        for i, it in enumerate(raw):
            w = f"subst.layers[{i}]"
            if not isinstance(it, list) or len(it) != 3 or not isinstance(it[1], list) \
                    or not isinstance(it[2], list):
                raise ProtocolError(E_BAD_TYPE, f"field '{w}' must be [layer, [scores], [[expert, score], ...]]")
            layer, scores, cands = it
            if isinstance(layer, bool) or not isinstance(layer, int) or layer not in asked:
                raise ProtocolError(E_OUT_OF_RANGE, f"field '{w}' layer {layer!r:.20}: expected a layer "
                                    "of this acquire")
            if layer in out:
                raise ProtocolError(E_BAD_TYPE, f"field '{w}' layer {layer} appears twice")
            ex = asked[layer]
            if len(scores) != len(ex):
                raise ProtocolError(E_BAD_TYPE, f"field '{w}' has {len(scores)} scores for {len(ex)} "
                                    f"experts of layer {layer}: expected one per requested expert")
            sc = [score(v, f"{w} scores") for v in scores]
            n += len(cands)
            if n > self.max_experts:
                raise ProtocolError(E_TOO_LARGE, f"field 'subst' names {n}+ candidates: expected at "
                                    f"most {self.max_experts}")
            seen = set(ex)
            cl = []
            for c in cands:
                if not isinstance(c, list) or len(c) != 2 or isinstance(c[0], bool) \
                        or not isinstance(c[0], int):
                    raise ProtocolError(E_BAD_TYPE, f"field '{w}' candidate {c!r:.30}: expected "
                                        "[expert, score]")
                e = c[0]
                if not 0 <= e < self.n_experts:
                    raise ProtocolError(E_OUT_OF_RANGE, f"candidate {e} in layer {layer}: expected "
                                        f"0..{self.n_experts - 1}")
                if e in seen:
                    raise ProtocolError(E_BAD_TYPE, f"candidate {e} in layer {layer}: requested or "
                                        "listed already (candidates are other experts, each once)")
                seen.add(e)
                cl.append((e, score(c[1], f"{w} candidate {e}")))
            out[layer] = (sc, cl)
        return float(r), cap, out
