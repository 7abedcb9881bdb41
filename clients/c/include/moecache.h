/* moecache.h -- C client of the moecached expert cache daemon (docs/protocol.md).
 *
 *   mc_error err;
 *   mc_client *c = mc_connect("ipc:///run/moecached/moecached.sock", "engine-0", NULL, &err);
 *   if (!c) { fprintf(stderr, "%s\n", err.message); ... }
 *   int experts[] = {5, 17, 42};
 *   mc_lease *l;
 *   if (mc_acquire(c, 3, experts, 3, 0, -1, &l, &err) == MC_OK) {
 *       const void *gate = mc_lease_part(l, 1, "gate");   // expert 17's gate, zero-copy
 *       ... compute ...
 *       if (!mc_lease_valid(l)) { ... the bytes read were not (all) the granted experts' ... }
 *       mc_release(l);
 *   }
 *   mc_close(c);
 *
 * Includable from C and C++. Every handle is opaque; no atomics are exposed (the
 * shared-memory rules live in moecache_shm.h, used by the library only).
 *
 * THREADS. One mc_client may be shared by any number of threads:
 *   - socket calls (acquire that misses, prefetch, ping, stats...) are serialised on one mutex
 *     around the socket; the thread that finds the socket free reads replies for everyone
 *     (leader/followers), so a single-threaded engine pays no thread hand-off;
 *   - fast-path pins (no message) are serialised by a second, short mutex (the pin file's hit
 *     ring has one producer); they never wait for the socket;
 *   - mc_release of a fast-path lease is lock-free (atomic decrements); of a socket lease it
 *     sends one `release` (noreply) under the socket mutex;
 *   - mc_lease_valid / mc_lease_part / the arena accessors are lock-free.
 *   A lease may be used and released from any thread, but not concurrently with its own
 *   mc_release. mc_close must not race with other calls on the same client; leases outlive
 *   it (their mapping stays until the last one is released).
 *
 * HEARTBEAT. By default a background thread pings while the client is idle for a third of the
 * daemon's heartbeat_s (a watched local client keeps its leases without it, an unwatched one
 * -- tcp, other pid namespace -- would lose them), drains late replies, and notices a dropped
 * connection. With mc_options.heartbeat_thread = 0 there is no thread: the engine calls
 * mc_tick(c) at least every heartbeat interval (mc_heartbeat_ms) instead.
 *
 * RESTARTS. When the daemon restarts (a reply's session changes, the connection drops, or the
 * arena's epoch is no longer the session) the calls in flight fail with MC_ERR_RESTARTED and
 * the next call says hello again and maps the new arena. mc_arena() then describes the new
 * arena; leases from before stay readable-but-invalid (mc_lease_valid() == 0,
 * mc_lease_part() == NULL) until released. Layouts are fetched again with mc_arena() after
 * a restart (the pointer of an earlier call stays valid until mc_close).
 */
#ifndef MOECACHE_H
#define MOECACHE_H

#include <stddef.h>
#include <stdint.h>

/* MC_API marks the public functions: libmoecache.so is built with -fvisibility=hidden, so these
 * are the only symbols it exports. */
#ifndef MC_API
#if defined(__GNUC__) && __GNUC__ >= 4
#define MC_API __attribute__((visibility("default")))
#else
#define MC_API
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define MC_DEFAULT_ENDPOINT "ipc:///run/moecached/moecached.sock"

/* Error codes. The daemon's error code strings (docs/protocol.md, "Error codes") map to the
 * MC_ERR_D_* values; a code this library does not know maps to MC_ERR_D_OTHER (the string is
 * kept in mc_error.daemon_code). */
typedef enum mc_code {
    MC_OK = 0,
    MC_ERR_INVALID_ARG = 1,   /* a bad argument (NULL, layer without experts, too many experts) */
    MC_ERR_SYSTEM = 2,        /* an OS or ZeroMQ call failed (errno text in the message) */
    MC_ERR_PROTOCOL = 3,      /* the daemon's reply could not be understood */
    MC_ERR_TIMEOUT = 4,       /* no reply within the call's timeout (an acquire is cancelled in the
                                 daemon; a lease arriving anyway is released) */
    MC_ERR_RESTARTED = 5,     /* the daemon restarted or went away; the next call says hello again */
    MC_ERR_CLOSED = 6,        /* the client is closed */
    MC_ERR_UNSUPPORTED = 7,   /* an arena descriptor version or layout this library cannot read */
    MC_ERR_OTHER_MODEL = 8,   /* the engine's model file is not the file the daemon serves */
    /* the daemon refused the request */
    MC_ERR_D_MALFORMED = 100,
    MC_ERR_D_VERSION,
    MC_ERR_D_UNKNOWN_OP,
    MC_ERR_D_BAD_TYPE,
    MC_ERR_D_OUT_OF_RANGE,
    MC_ERR_D_TOO_LARGE,
    MC_ERR_D_UNKNOWN_LEASE,
    MC_ERR_D_STALE_LEASE,
    MC_ERR_D_NOT_OWNER,
    MC_ERR_D_LOAD_FAILED,
    MC_ERR_D_TIMEOUT,         /* the daemon's `timeout`: timeout_ms passed before the reads finished */
    MC_ERR_D_UNAVAILABLE,
    MC_ERR_D_SHUTDOWN,
    MC_ERR_D_INVALID_STATE,
    MC_ERR_D_REFUSED,
    MC_ERR_D_INTERNAL,
    MC_ERR_D_MODEL_CHANGED,
    MC_ERR_D_RATE_LIMITED,
    MC_ERR_D_UNKNOWN_MODEL,   /* hello names a model the daemon does not serve (or is removing) */
    MC_ERR_D_PID_MISMATCH,    /* hello claimed a pid other than the connecting process's */
    MC_ERR_D_NOT_PERMITTED,   /* an op that changes the daemon, and this uid is no admin */
    MC_ERR_D_OTHER            /* a code string this library does not know */
} mc_code;

typedef struct mc_error {
    int code;                 /* mc_code */
    char daemon_code[32];     /* the daemon's code string ("" when the error is local) */
    char message[512];        /* one line: what failed, and the fix when there is one (a longer
                                 line keeps its head and its last 200 bytes, joined by " ... ") */
} mc_error;

/* The name of a code ("MC_OK", "MC_ERR_TIMEOUT", ...). */
MC_API const char *mc_code_name(int code);
/* The daemon's code string -> mc_code (MC_ERR_D_OTHER for an unknown one). */
MC_API int mc_code_from_daemon(const char *code);

typedef struct mc_options {
    int timeout_ms;           /* default wait for a reply (-1: forever). Default 30000 */
    int connect_timeout_ms;   /* wait for hello. Default 10000 */
    int fast_path;            /* ask for the shared-memory hit path (ipc only). Default 1 */
    int heartbeat_thread;     /* 1: background pings (default); 0: the engine calls mc_tick */
    int heartbeat_ms;         /* ping period when idle; 0: a third of the daemon's heartbeat_s */
    int send_pid;             /* send pid + pid_start in hello (be watched). Default 1 */
    const char *model;        /* the model to use when the daemon serves several (its name; the
                               * daemon's endpoint redirects hello to the model's own socket;
                               * every new session says hello to mc_connect's endpoint again,
                               * so a removed model's calls fail at once with the daemon's
                               * unknown_model line, and work again once it is added back).
                               * NULL: none (a daemon serving one model). Default NULL */
    int warm_wait_ms;         /* mc_connect waits while the daemon's warm fill of the model runs
                               * (a cold start reading the whole model, a restart's state file:
                               * as a memory-mapped load waits for its reads), at most this long,
                               * then connects anyway; 0: no wait; -1: until it ends. Default
                               * 600000, or the environment's MOECACHE_WARM_WAIT_MS (mc_warm_wait;
                               * a wait says so on stderr, one line as it starts and one as it
                               * ends, unless quiet) */
    int quiet;                /* 1: the library writes nothing to stderr (the warm wait's lines;
                               * errors still come back as mc_error). Default 0, or 1 when the
                               * environment's MOECACHE_QUIET is set and not "0" */
    int populate;             /* 1: the page tables of the experts the arena holds filled at
                               * connect (as llama.cpp maps a model file), so that a hit's first
                               * touch of a slot costs no page fault while a token runs; slots
                               * the budget gave back are never read. About 0.1 s per GiB.
                               * Default 1, or 0 when the environment's MOECACHE_POPULATE is "0" */
} mc_options;

/* Fill *opt with the defaults. */
MC_API void mc_options_init(mc_options *opt);

typedef struct mc_client mc_client;
typedef struct mc_lease mc_lease;

/* ----------------------------------------------------------------- connection */

/* Connect, say hello (with pid/pid_start, and fast_path when opt->fast_path), map the arena
 * read-only and, when the daemon offers it, the pin file read-write. NULL on error (*err set;
 * err may be NULL): an ipc endpoint without a socket file fails at once (MC_ERR_SYSTEM, "no
 * daemon socket at ..."), a daemon that does not answer after connect_timeout_ms
 * (MC_ERR_TIMEOUT). Then waits for a running warm fill (opt->warm_wait_ms, mc_warm_wait; a
 * fill still running after it does not fail the connect). opt may be NULL (defaults). name may
 * be NULL ("pid<N>"). */
MC_API mc_client *mc_connect(const char *endpoint, const char *name, const mc_options *opt, mc_error *err);

/* Wait while the daemon's warm fill of this client's model runs (ping's warm_pending > 0),
 * polling every 20 ms, at most timeout_ms (-1: until it ends). MC_OK once none runs (at once when
 * none does, or the daemon does not report warm_pending); MC_ERR_TIMEOUT when it still runs
 * (*pending, may be NULL, gets the experts it has yet to load). A daemon that restarts meanwhile
 * is waited for (a new hello, then its own fill, e.g. from its state file) as long as it stays
 * away at most connect_timeout_ms; longer, the call returns its error (MC_ERR_RESTARTED,
 * MC_ERR_SYSTEM, MC_ERR_TIMEOUT). */
MC_API int mc_warm_wait(mc_client *c, int timeout_ms, uint64_t *pending, mc_error *err);

/* Say bye (the daemon releases this client's leases), stop the heartbeat, close the socket. */
MC_API void mc_close(mc_client *c);

/* Round trip to the daemon; *rtt_us (may be NULL) gets the microseconds. */
MC_API int mc_ping(mc_client *c, double *rtt_us, mc_error *err);

/* Without a client: whether a daemon answers at `endpoint` (NULL: the default) within timeout_ms
 * (> 0; -1: no limit), e.g. for an engine's health check on a thread of its own. A socket of its
 * own sends one ping, then bye, and is closed; no hello, no lease, no arena mapped. Thread-safe;
 * each call is a ZeroMQ context of its own for up to timeout_ms: a caller probing often (a health
 * endpoint) should share one probe's answer between its callers. MC_OK, *rtt_us and *session (the
 * daemon's session: another one than a client's means the daemon restarted; each may be NULL);
 * MC_ERR_SYSTEM naming the missing socket file, MC_ERR_TIMEOUT when nothing answered in time, the
 * daemon's error code otherwise. */
MC_API int mc_probe(const char *endpoint, int timeout_ms, double *rtt_us, uint64_t *session, mc_error *err);

/* Without the heartbeat thread: ping if idle, read late replies, notice a dropped connection.
 * Call at least every mc_heartbeat_ms(c) milliseconds. Harmless with the thread. */
MC_API int mc_tick(mc_client *c, mc_error *err);
MC_API int mc_heartbeat_ms(const mc_client *c);

/* The daemon's session of the current hello (0 while none: after a restart, before the next
 * call). */
MC_API uint64_t mc_session(const mc_client *c);
/* 1 when the daemon watches this process (lease_watch "process"), 1 when the fast path is on. */
MC_API int mc_watched(const mc_client *c);
MC_API int mc_fast_path(const mc_client *c);

/* The daemon's `stats` reply (every counter) as text in msgpack-c's JSON-like rendering
 * (malloc'd; free() it). NULL on error. */
MC_API char *mc_stats_text(mc_client *c, mc_error *err);

/* ----------------------------------------------------------------- the arena */

typedef struct mc_part {
    const char *name;         /* "gate", "up", "down", ... */
    uint64_t part_off;        /* byte offset of slot 0's part in the arena */
    uint64_t part_bytes;      /* bytes per slot (part p of slot i is at part_off + i*part_bytes) */
    const char *type;         /* ggml type name ("Q4_K", ...) */
} mc_part;

typedef struct mc_class {
    uint32_t id;
    uint32_t n_layers;
    const int32_t *layers;    /* GGUF block numbers in this class */
    uint32_t n_parts;
    const mc_part *parts;
    uint32_t n_slots;
    uint64_t slot_bytes;
} mc_class;

/* A model file as the daemon indexed it, or as an engine loaded it (mc_file_id_of). */
typedef struct mc_file_id {
    const char *path;         /* the daemon's path (NULL in what mc_file_id_of fills) */
    uint64_t size;
    int64_t mtime_ns;
    uint64_t dev;
    uint64_t ino;
} mc_file_id;

typedef struct mc_arena {
    const void *base;         /* the read-only mapping */
    uint64_t size;
    uint32_t n_classes;
    const mc_class *classes;  /* classes[i].id == i */
    uint32_t n_expert_layers;
    const int32_t *expert_layers;   /* GGUF block numbers with routed experts */
    uint32_t n_experts;
    uint32_t top_k;
    uint64_t session;
    uint32_t n_model_files;   /* the model's files (shards in order) as the daemon indexed them */
    const mc_file_id *model_files;
} mc_arena;

/* The arena of the current hello (says hello first when the last one was voided by a restart;
 * NULL then on error). The description stays readable until mc_close, even after a restart;
 * its `base` mapping stays while it is the current arena or a lease granted on it is held
 * (after MC_ERR_RESTARTED, call mc_arena_get again for the new one). */
MC_API const mc_arena *mc_arena_get(mc_client *c, mc_error *err);
/* Class id of a GGUF block (-1 when it has no routed experts). */
MC_API int mc_layer_class(const mc_arena *a, int layer);
/* The identity (size, modification time, device, inode) of the file at `path` now. */
MC_API int mc_file_id_of(const char *path, mc_file_id *out, mc_error *err);
/* MC_OK when `mine` (the file an engine loaded its model from, taken with mc_file_id_of when it
 * loaded it) is the daemon's model file number `i` (0: the first shard): the same size and
 * modification time, as the file itself, a link or another mount of it, or a copy made with its
 * times (cp -p, rsync -t) have. Else MC_ERR_OTHER_MODEL, the message naming both files: the
 * daemon's experts are another model's, and computing with them gives wrong output. Check at
 * load and again for every new arena (a daemon restarted or reloaded on a changed file). */
MC_API int mc_check_model_file(const mc_arena *a, uint32_t i, const mc_file_id *mine, const char *mine_path,
                               mc_error *err);

/* ----------------------------------------------------------------- leases */

typedef struct mc_item {
    int32_t layer;
    int32_t expert;
    uint32_t cls;
    uint32_t slot;            /* the MUL_MAT_ID expert id within the class's slot arrays */
} mc_item;

typedef struct mc_request {
    int layer;
    const int *experts;
    uint32_t n;
} mc_request;

enum {
    MC_ACQ_NO_FAST = 1,       /* skip the shared-memory hit path, ask the daemon */
    MC_ACQ_DECODE = 2,        /* tag "decode" (kept in daemon traces) */
    MC_ACQ_PROMPT = 4         /* tag "prompt" */
};

/* Pin `experts[0..n)` of `layer` (GGUF block number); *out gets the lease. All or nothing.
 * First the shared-memory hit path (all resident: no message), else one acquire over the
 * socket for the whole set. timeout_ms: -1 = the client's default wait (mc_options.timeout_ms);
 * >= 0 is sent as the daemon's timeout_ms and the client waits one second longer, so the
 * daemon's answer (MC_ERR_D_TIMEOUT, nothing pinned) wins over a local MC_ERR_TIMEOUT. */
MC_API int mc_acquire(mc_client *c, int layer, const int *experts, uint32_t n, int flags, int timeout_ms,
               mc_lease **out, mc_error *err);
/* Several layers in one lease. */
MC_API int mc_acquire_many(mc_client *c, const mc_request *reqs, uint32_t n_reqs, int flags, int timeout_ms,
                    mc_lease **out, mc_error *err);
/* Substitution (docs/protocol.md, "Substitution"): the router's scores and further ranked
 * candidates; for each missing expert the daemon may grant a resident candidate scoring
 * >= r x the missing one's score instead (at most `cap` swaps per layer, -1 = no cap). */
typedef struct mc_cand {
    int expert;
    double score;
} mc_cand;

typedef struct mc_subst_layer {
    const double *scores;     /* one per requested expert of the layer, request order; NULL:
                                 no substitution for this layer */
    const mc_cand *cands;     /* experts ranked after the requested ones (none requested) */
    uint32_t n_cands;
} mc_subst_layer;

typedef struct mc_subst {
    double r;                 /* tolerance in [0, 1] */
    int cap;                  /* swaps per layer at most; -1: no cap */
    const mc_subst_layer *layers;   /* one per mc_request, same order */
} mc_subst;

/* mc_acquire_many with substitution: first the shared-memory hit path (all resident: nothing
 * to substitute, no message), else one acquire carrying the candidates. subst NULL: exactly
 * mc_acquire_many. The items name the substitutes in the places of the experts they replace;
 * mc_lease_subst says which. */
MC_API int mc_acquire_subst(mc_client *c, const mc_request *reqs, uint32_t n_reqs, const mc_subst *subst, int flags,
                     int timeout_ms, mc_lease **out, mc_error *err);
/* Substitutions the daemon made in this lease (0 for a fast-path lease). */
MC_API uint32_t mc_lease_n_subst(const mc_lease *l);
/* Substitution i: the layer, the missing expert and its substitute; 0 when i is out of range. */
MC_API int mc_lease_subst(const mc_lease *l, uint32_t i, int *layer, int *missing, int *substitute);

/* Queue reads only (no pins, noreply). */
MC_API int mc_prefetch(mc_client *c, int layer, const int *experts, uint32_t n, mc_error *err);
MC_API int mc_prefetch_many(mc_client *c, const mc_request *reqs, uint32_t n_reqs, mc_error *err);
/* mc_prefetch_many with the predictor's confidence of each expert: conf[i][j] in [0, 1] for
 * expert j of reqs[i] (docs/protocol.md, prefetch "conf"). The daemon drops experts below its
 * prefetch_min_confidence and, at its prefetch caps, keeps the most confident. conf NULL:
 * exactly mc_prefetch_many. MC_ERR_INVALID_ARG (nothing sent) for a value outside [0, 1]. */
MC_API int mc_prefetch_conf(mc_client *c, const mc_request *reqs, uint32_t n_reqs, const double *const *conf,
                     mc_error *err);

/* The items in request order (layers in the order given, experts in the order given). */
MC_API uint32_t mc_lease_n(const mc_lease *l);
MC_API const mc_item *mc_lease_items(const mc_lease *l);
/* Slot of item i (== mc_lease_items(l)[i].slot). */
MC_API uint32_t mc_lease_slot(const mc_lease *l, uint32_t i);
/* Copies the slot of each item (request order) into out[0..cap); returns the item count. */
MC_API uint32_t mc_lease_slots(const mc_lease *l, uint32_t *out, uint32_t cap);
/* 1 when the lease came from the shared-memory hit path (no message). */
MC_API int mc_lease_fast(const mc_lease *l);
/* The daemon's counters for this request (0 for fast-path leases, which are all hits). */
MC_API void mc_lease_counts(const mc_lease *l, uint32_t *hits, uint32_t *prefetch_hits, uint32_t *misses,
                     uint64_t *stall_us);

/* Zero-copy read-only bytes of part `part` of item idx; *bytes (may be NULL) gets the length.
 * NULL when the lease is not valid (released, restart, revoked), idx out of range or no such
 * part. Check mc_lease_valid() again after using the bytes. */
MC_API const void *mc_lease_part(const mc_lease *l, uint32_t idx, const char *part, uint64_t *bytes);

/* 1 while the lease pins its experts: the arena epoch is the granting session and every
 * slot generation is the one granted. Bytes read before a call that returns 1 were the
 * granted experts'. A few shared-memory loads, no message, no lock. */
MC_API int mc_lease_valid(const mc_lease *l);

/* Unpin and free the lease (fast path: atomic decrements; socket: a noreply release). */
MC_API void mc_release(mc_lease *l);

/* ------------------------------------------------------------------ peeks */

/* Where an expert lies in the arena, seen without a lease (mc_peek). */
typedef struct mc_peek_item {
    uint64_t session;         /* the arena's session when peeked (0: not found) */
    uint64_t gen;             /* the slot's generation then */
    uint32_t cls;
    uint32_t slot;            /* UINT32_MAX: not resident when peeked */
} mc_peek_item;

/* Where the experts of `layer` lie in the current arena now, without a lease and without a
 * message: out[i] gets experts[i]'s class, slot and generation, or slot UINT32_MAX when it is not
 * resident (absent, loading, out of range). For a reader that cannot hold a lease while it reads
 * (a GPU kernel over the registered arena): nothing stops the daemon from evicting a peeked
 * expert, so the reader calls mc_peek_valid on each item it used after reading; 1 means what it
 * read was the expert's bytes (the lease's seqlock, docs/protocol.md). Nothing is counted as a
 * hit: mc_note_hits does that. Returns the number found; 0 without an arena map or resident map,
 * or when the daemon restarted and no call said hello since. Each item carries the session of
 * the arena it was found in: after another call said hello to a new daemon that is the new
 * arena's, which a reader that registered the old one (its addresses, its pages) must refuse. */
MC_API uint32_t mc_peek(mc_client *c, int layer, const int *experts, uint32_t n, mc_peek_item *out);
/* 1 while a peeked item still names its expert: the current arena's epoch is the item's
 * session and the slot's generation is the peeked one. Bytes read from the slot before a call
 * that returns 1 were the expert's. */
MC_API int mc_peek_valid(mc_client *c, const mc_peek_item *it);
/* Count uses of the experts of `layer` in the daemon's LRU without pinning them (the hit path's
 * ring, as a pin does). 1 when recorded; 0 without the hit path or when its ring is full. */
MC_API int mc_note_hits(mc_client *c, int layer, const int *experts, uint32_t n);
/* The releases count of the arena of daemon session `session` (mc_arena's session): it moves
 * before the daemon gives pages of the arena back (a smaller budget punches holes in free slots,
 * refilled later with new pages). A client that registered the arena's pages with a device (e.g.
 * cudaHostRegister, which keeps the pages it found) treats what the device read through the
 * registration while it moved as unchecked, and registers again or stops reading through it.
 * 0 when the current arena is not that session's (a restart: the epoch tells), without an arena,
 * or from a daemon that does not count them. */
MC_API uint64_t mc_arena_releases(mc_client *c, uint64_t session);

#ifdef __cplusplus
}
#endif
#endif /* MOECACHE_H */
