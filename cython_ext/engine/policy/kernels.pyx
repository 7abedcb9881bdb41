# Replay kernels: stream building, next use, replay (included by cython_ext/engine/_policy.pyx).

def build_stream(const short[:, :, ::1] experts, const i64[::1] step_start, i64 n_experts):
    """Flatten a trace into the access stream the policies replay.

    Args:
        experts: int16 ``[T, L, k]`` (-1 skipped).
        step_start: int64 ``[n_steps + 1]`` token index where each step starts (last = T).
        n_experts: experts per layer; key = layer * n_experts + expert.
    Returns:
        (keys int64 [A], set_start int64 [S + 1], set_layer int64 [S], set_step int64 [S]):
        one set per (step, layer) with at least one expert: the union of the step's experts in
        that layer, first-appearance order (token order, then rank order), no duplicates.
    """
    cdef Py_ssize_t T = experts.shape[0], L = experts.shape[1], K = experts.shape[2]
    cdef Py_ssize_t n_steps = step_start.shape[0] - 1
    keys_a = np.empty(T * L * K, dtype=np.int64)
    ss_a = np.empty(n_steps * L + 1, dtype=np.int64)
    sl_a = np.empty(n_steps * L, dtype=np.int64)
    st_a = np.empty(n_steps * L, dtype=np.int64)
    stamp_a = np.full(max(n_experts, 1), -1, dtype=np.int64)
    cdef i64[::1] keys = keys_a, ss = ss_a, sl = sl_a, st = st_a, stamp = stamp_a
    cdef Py_ssize_t s, l, t, j, n = 0, ns = 0, mark = 0
    cdef i64 e
    for s in range(n_steps):
        for l in range(L):
            mark += 1
            ss[ns] = n
            for t in range(step_start[s], step_start[s + 1]):
                for j in range(K):
                    e = experts[t, l, j]
                    if e < 0:
                        continue
                    if e >= n_experts:
                        raise ValueError(f"expert id {e} at token {t} layer {l}: expected "
                                         f"< n_experts = {n_experts}")
                    if stamp[e] != mark:
                        stamp[e] = mark
                        keys[n] = l * n_experts + e
                        n += 1
            if n > ss[ns]:
                sl[ns] = l
                st[ns] = s
                ns += 1
    ss[ns] = n
    return keys_a[:n].copy(), ss_a[:ns + 1].copy(), sl_a[:ns].copy(), st_a[:ns].copy()


def next_use(const i64[::1] keys, i64 n_keys):
    """int64 [A]: index of the next access of ``keys[i]``'s key, or A when there is none."""
    cdef Py_ssize_t A = keys.shape[0], i
    out_a = np.empty(A, dtype=np.int64)
    last_a = np.full(max(n_keys, 1), A, dtype=np.int64)
    cdef i64[::1] out = out_a, last = last_a
    for i in range(A - 1, -1, -1):
        out[i] = last[keys[i]]
        last[keys[i]] = i
    return out_a


def replay(_Pol pol, const i64[::1] keys, const i64[::1] set_start, const i64[::1] set_layer,
           const uint8_t[::1] set_counted, const i64[::1] set_tokens_before, i64 n_layers,
           set_cold=None, bint probation=False):
    """Replay an access stream (from ``build_stream``) through ``pol``.

    For set s: first ``pol.halve()`` once per multiple of ``pol.halve_every`` tokens passed
    (``set_tokens_before[s]`` = tokens of all earlier steps; 0 = never); then, as the daemon's
    cache grants a request, the keys resident when the set starts are accessed (and pinned) in
    set order -- the hits -- then the other keys in set order -- the misses, each of which may
    evict an unpinned key of its group; then all are released. Only sets with
    ``set_counted[s]`` add to the counts. ``set_cold`` (uint8 [S], optional; only for a
    policy with ``admits_cold``): the misses of set s are admitted at the cold end when
    ``set_cold[s]`` (scan-resistant admission), at the probation point instead with
    ``probation`` (``LRU.insert_probation``; ``scan_admit = "probation"``).
    Returns:
        (hits int64 [n_layers], accesses int64 [n_layers]).
    """
    hits_a = np.zeros(n_layers, dtype=np.int64)
    acc_a = np.zeros(n_layers, dtype=np.int64)
    cdef i64[::1] hits = hits_a, acc = acc_a
    cdef Py_ssize_t S = set_layer.shape[0], s, i, a, b
    cdef i64 halve_every = pol.halve_every
    cdef i64 nxt = halve_every, l, t, k, h, nm
    cdef uint8_t *res = pol.res
    cdef const uint8_t[::1] cold
    cdef bint use_cold = set_cold is not None
    if use_cold:
        if not pol.admits_cold:
            raise ValueError(f"policy {pol.name}: no cold admission (only lru, g-lru)")
        cold = set_cold
        pol.cold_probation = probation
        if cold.shape[0] != S:
            raise ValueError(f"set_cold: found {cold.shape[0]} sets, expected {S}")
    for s in range(S):
        if halve_every > 0:
            while set_tokens_before[s] >= nxt:
                pol.halve()
                nxt += halve_every
        a = set_start[s]
        b = set_start[s + 1]
        l = set_layer[s]
        if use_cold:
            pol.cold = cold[s] != 0
        nm = 0
        for i in range(a, b):
            if not res[keys[i]]:
                nm += 1
        if nm:                              # the daemon takes the misses' slots first, its
            for i in range(a, b):           # resident keys held (policies that evict in
                if res[keys[i]]:            # access: no-ops)
                    pol.hold(keys[i], True)
            for i in range(a, b):
                if not res[keys[i]]:
                    pol.reserve(keys[i])
            for i in range(a, b):
                if res[keys[i]]:
                    pol.hold(keys[i], False)
        t = a
        h = 0
        for i in range(a, b):               # hits first (no access of a hit evicts anything)
            k = keys[i]
            if res[k]:
                h += pol.access(k, t)
                t += 1
        for i in range(a, b):               # then the misses, in set order
            k = keys[i]
            if not res[k]:
                pol.access(k, t)
                t += 1
        if set_counted[s]:
            hits[l] += h
            acc[l] += b - a
        for i in range(a, b):
            pol.release(keys[i], i)
    return hits_a, acc_a


def replay_subst(_Pol pol, const i64[::1] keys, const double[::1] key_score,
                 const i64[::1] set_start, const i64[::1] set_layer,
                 const uint8_t[::1] set_counted, const i64[::1] set_tokens_before, i64 n_layers,
                 const i64[::1] cand_start, const i64[::1] cand_keys,
                 const double[::1] cand_score, double r, i64 max_swaps, bint refresh=False):
    """``replay`` with substitution: a routed expert that is not resident may be replaced by a
    resident candidate of the same set.

    Set s routes ``keys[set_start[s]:set_start[s+1]]`` (scores ``key_score``) and offers the
    candidates ``cand_keys[cand_start[s]:cand_start[s+1]]`` (scores ``cand_score``; none of
    them routed in s). Before any access, for each routed key m not resident when the set
    starts, in set order, while fewer than ``max_swaps`` (< 0: no cap) were made in the set:
    the resident candidate not yet given in this set with the highest score >= ``r *
    key_score[m]`` (ties: first in candidate order) is given instead of m. Then, when some
    routed key of the set is not resident (only then does the request reach the cache: the
    client's fast path serves a set that is all resident), ``pol.credit(c)`` for every
    candidate not given, in candidate order (``lfu-subst``: half a use). Then, as the cache
    grants: the resident routed keys (hits) and the given candidates (hits of keys nobody
    asked for, each in the place of the key it replaces) are accessed in set order, then, with
    ``refresh``, every other candidate that is resident (a hit, released at once: eviction
    values an expert offered as a likely substitute like one used, yet a miss may evict it),
    then the routed misses left; each may evict
    as in ``replay``; then all are released (a candidate with
    ``i = set_start[s]``: policies that read the stream position in ``release`` -- ``opt``,
    ``g-opt`` -- must not be replayed here).
    Returns:
        (hits, accesses, substituted) int64 [n_layers] each: a routed key counts as one access;
        hit when resident, substituted when a candidate was given instead.
    """
    hits_a = np.zeros(n_layers, dtype=np.int64)
    acc_a = np.zeros(n_layers, dtype=np.int64)
    sub_a = np.zeros(n_layers, dtype=np.int64)
    stamp_a = np.full(max(pol.n_keys, 1), -1, dtype=np.int64)
    given_a = np.full(max(cand_keys.shape[0], 1), -1, dtype=np.int64)
    cdef i64[::1] hits = hits_a, acc = acc_a, sub = sub_a, stamp = stamp_a, given = given_a
    cdef Py_ssize_t S = set_layer.shape[0], s, i, j, a, b, ca, cb, best
    cdef i64 halve_every = pol.halve_every
    cdef i64 nxt = halve_every, l, t, k, h, ng, c
    cdef double need, bs
    cdef bint miss
    cdef uint8_t *res = pol.res
    for s in range(S):
        if halve_every > 0:
            while set_tokens_before[s] >= nxt:
                pol.halve()
                nxt += halve_every
        a = set_start[s]
        b = set_start[s + 1]
        ca = cand_start[s]
        cb = cand_start[s + 1]
        l = set_layer[s]
        for i in range(a, b):
            stamp[keys[i]] = s
        ng = 0                              # substitutions chosen (given[0:ng] = cand keys)
        for i in range(a, b):
            k = keys[i]
            if res[k] or (max_swaps >= 0 and ng >= max_swaps):
                continue
            need = r * key_score[i]
            best = -1
            bs = 0.0
            for j in range(ca, cb):
                c = cand_keys[j]
                if res[c] and stamp[c] != s and cand_score[j] >= need and \
                        (best < 0 or cand_score[j] > bs):
                    best = j
                    bs = cand_score[j]
            if best >= 0:
                c = cand_keys[best]
                stamp[c] = s                # given once per set
                given[ng] = c
                ng += 1
                stamp[k] = -2 - s           # marks m as substituted in set s
        miss = False
        for i in range(a, b):
            if not res[keys[i]]:
                miss = True
        if miss:                            # the request reaches the cache (the fast path
            for j in range(ca, cb):         # serves a set that is all resident): it credits
                c = cand_keys[j]            # the candidates it carries, except those given
                if stamp[c] != s:
                    pol.credit(c)
        if miss:                            # the misses' slots first (as in replay), the
            for i in range(a, b):           # resident routed keys and the given ones held
                if res[keys[i]]:
                    pol.hold(keys[i], True)
            for j in range(ng):
                pol.hold(given[j], True)
            for i in range(a, b):
                k = keys[i]
                if not res[k] and stamp[k] != -2 - s:
                    pol.reserve(k)
            for i in range(a, b):
                if res[keys[i]]:
                    pol.hold(keys[i], False)
            for j in range(ng):
                pol.hold(given[j], False)
        t = a
        h = 0
        j = 0
        for i in range(a, b):               # hits and given candidates first, in set order (a
            k = keys[i]                     # given one in the place of the key it replaces;
            if res[k]:                      # resident: no eviction)
                h += pol.access(k, t)
                t += 1
            elif stamp[k] == -2 - s:
                pol.access(given[j], t)
                j += 1
                t += 1
        if refresh:                         # then the other resident candidates (unpinned
            for j in range(ca, cb):         # at once: a refresh never blocks a miss's load)
                c = cand_keys[j]
                if res[c] and stamp[c] != s:
                    pol.access(c, t)
                    pol.release(c, a)
                    t += 1
        for i in range(a, b):               # then the misses not substituted
            k = keys[i]
            if not res[k] and stamp[k] != -2 - s:
                pol.access(k, t)
                t += 1
        if set_counted[s]:
            hits[l] += h
            acc[l] += b - a
            sub[l] += ng
        for i in range(a, b):
            k = keys[i]
            if stamp[k] != -2 - s:
                pol.release(k, i)
        for j in range(ng):
            pol.release(given[j], a)
    return hits_a, acc_a, sub_a
