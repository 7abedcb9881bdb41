/* moecache.c -- C client of moecached (docs/protocol.md). Public API: include/moecache.h.
 * The shared-memory rules (pin, validate, unpin) come from include/moecache_shm.h only. */
#define _GNU_SOURCE
#include "moecache.h"
#include "moecache_shm.h"
#include "moecache_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <msgpack.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/time.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#define PROTOCOL_VERSION 1
#define DESCRIPTOR_VERSION 2
#define SLICE_MS 100

/* ------------------------------------------------------------------ pin file door */

/* The pin file is a memfd whose size the daemon sealed (no process can truncate it under our
 * mapping): connect to the daemon's door (a unix socket beside its endpoint), send the hello's
 * one-time token, receive the fd (SCM_RIGHTS). -1 with errno set on failure. */
static int fetch_pin_fd(const char *door, const char *token) {
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    if (strlen(door) >= sizeof sa.sun_path) { errno = ENAMETOOLONG; return -1; }
    strcpy(sa.sun_path, door);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) return -1;
    struct timeval tv = {5, 0};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    int fd = -1;
    if (connect(s, (struct sockaddr *)&sa, sizeof sa) == 0 &&
        send(s, token, strlen(token), MSG_NOSIGNAL) == (ssize_t)strlen(token)) {
        char buf[16];
        union { struct cmsghdr h; char b[CMSG_SPACE(sizeof(int))]; } u;
        struct iovec iov = {buf, sizeof buf};
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = u.b;
        mh.msg_controllen = sizeof u.b;
        ssize_t n = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
        struct cmsghdr *cm = n > 0 ? CMSG_FIRSTHDR(&mh) : NULL;
        if (cm && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS &&
            cm->cmsg_len == CMSG_LEN(sizeof(int))) {
            memcpy(&fd, CMSG_DATA(cm), sizeof fd);
            if (n != 2 || memcmp(buf, "ok", 2) != 0) { close(fd); fd = -1; errno = EACCES; }
        } else if (n >= 0) {
            errno = EACCES;   /* the door said no: not our token, or not our process */
        }
    }
    int e = errno;
    close(s);
    errno = e;
    return fd;
}

/* ------------------------------------------------------------------ errors */

static const struct { const char *s; int code; } DAEMON_CODES[] = {
    {"malformed", MC_ERR_D_MALFORMED}, {"version", MC_ERR_D_VERSION},
    {"unknown_op", MC_ERR_D_UNKNOWN_OP}, {"bad_type", MC_ERR_D_BAD_TYPE},
    {"out_of_range", MC_ERR_D_OUT_OF_RANGE}, {"too_large", MC_ERR_D_TOO_LARGE},
    {"unknown_lease", MC_ERR_D_UNKNOWN_LEASE}, {"stale_lease", MC_ERR_D_STALE_LEASE},
    {"not_owner", MC_ERR_D_NOT_OWNER}, {"load_failed", MC_ERR_D_LOAD_FAILED},
    {"timeout", MC_ERR_D_TIMEOUT}, {"unavailable", MC_ERR_D_UNAVAILABLE},
    {"shutdown", MC_ERR_D_SHUTDOWN}, {"invalid_state", MC_ERR_D_INVALID_STATE},
    {"refused", MC_ERR_D_REFUSED}, {"internal", MC_ERR_D_INTERNAL},
    {"model_changed", MC_ERR_D_MODEL_CHANGED}, {"rate_limited", MC_ERR_D_RATE_LIMITED},
    {"unknown_model", MC_ERR_D_UNKNOWN_MODEL}, {"pid_mismatch", MC_ERR_D_PID_MISMATCH},
    {"not_permitted", MC_ERR_D_NOT_PERMITTED},
};

int mc_code_from_daemon(const char *code) {
    for (size_t i = 0; i < sizeof DAEMON_CODES / sizeof DAEMON_CODES[0]; i++)
        if (code && strcmp(code, DAEMON_CODES[i].s) == 0)
            return DAEMON_CODES[i].code;
    return MC_ERR_D_OTHER;
}

const char *mc_code_name(int code) {
    switch (code) {
    case MC_OK: return "MC_OK";
    case MC_ERR_INVALID_ARG: return "MC_ERR_INVALID_ARG";
    case MC_ERR_SYSTEM: return "MC_ERR_SYSTEM";
    case MC_ERR_PROTOCOL: return "MC_ERR_PROTOCOL";
    case MC_ERR_TIMEOUT: return "MC_ERR_TIMEOUT";
    case MC_ERR_RESTARTED: return "MC_ERR_RESTARTED";
    case MC_ERR_CLOSED: return "MC_ERR_CLOSED";
    case MC_ERR_UNSUPPORTED: return "MC_ERR_UNSUPPORTED";
    case MC_ERR_OTHER_MODEL: return "MC_ERR_OTHER_MODEL";
    case MC_ERR_D_MALFORMED: return "MC_ERR_D_MALFORMED";
    case MC_ERR_D_VERSION: return "MC_ERR_D_VERSION";
    case MC_ERR_D_UNKNOWN_OP: return "MC_ERR_D_UNKNOWN_OP";
    case MC_ERR_D_BAD_TYPE: return "MC_ERR_D_BAD_TYPE";
    case MC_ERR_D_OUT_OF_RANGE: return "MC_ERR_D_OUT_OF_RANGE";
    case MC_ERR_D_TOO_LARGE: return "MC_ERR_D_TOO_LARGE";
    case MC_ERR_D_UNKNOWN_LEASE: return "MC_ERR_D_UNKNOWN_LEASE";
    case MC_ERR_D_STALE_LEASE: return "MC_ERR_D_STALE_LEASE";
    case MC_ERR_D_NOT_OWNER: return "MC_ERR_D_NOT_OWNER";
    case MC_ERR_D_LOAD_FAILED: return "MC_ERR_D_LOAD_FAILED";
    case MC_ERR_D_TIMEOUT: return "MC_ERR_D_TIMEOUT";
    case MC_ERR_D_UNAVAILABLE: return "MC_ERR_D_UNAVAILABLE";
    case MC_ERR_D_SHUTDOWN: return "MC_ERR_D_SHUTDOWN";
    case MC_ERR_D_INVALID_STATE: return "MC_ERR_D_INVALID_STATE";
    case MC_ERR_D_REFUSED: return "MC_ERR_D_REFUSED";
    case MC_ERR_D_INTERNAL: return "MC_ERR_D_INTERNAL";
    case MC_ERR_D_MODEL_CHANGED: return "MC_ERR_D_MODEL_CHANGED";
    case MC_ERR_D_RATE_LIMITED: return "MC_ERR_D_RATE_LIMITED";
    case MC_ERR_D_UNKNOWN_MODEL: return "MC_ERR_D_UNKNOWN_MODEL";
    case MC_ERR_D_PID_MISMATCH: return "MC_ERR_D_PID_MISMATCH";
    case MC_ERR_D_NOT_PERMITTED: return "MC_ERR_D_NOT_PERMITTED";
    case MC_ERR_D_OTHER: return "MC_ERR_D_OTHER";
    default: return "MC_ERR_?";
    }
}

/* the first UTF-8 character of s (len bytes) that starts at or after byte i */
static size_t utf8_at_or_after(const char *s, size_t i, size_t len) {
    while (i < len && ((unsigned char)s[i] & 0xC0) == 0x80)
        i++;
    return i;
}

/* The line goes into e->message whole when it fits; a longer one keeps its head and its last
 * MSG_TAIL bytes (where a line says the fix), joined by " ... ". */
#define MSG_TAIL 200
static int seterr(mc_error *e, int code, const char *fmt, ...) {
    if (e) {
        e->code = code;
        e->daemon_code[0] = 0;
        char buf[4096], *line = buf;
        va_list ap, again;
        va_start(ap, fmt);
        va_copy(again, ap);
        int n = vsnprintf(buf, sizeof buf, fmt, ap);
        va_end(ap);
        if (n >= (int)sizeof buf && (line = malloc((size_t)n + 1)) != NULL)   /* (the whole line: its end is kept) */
            vsnprintf(line, (size_t)n + 1, fmt, again);
        va_end(again);
        if (!line) {
            line = buf;
            n = (int)sizeof buf - 1;
        }
        size_t len = n < 0 ? 0 : (size_t)n;
        if (len < sizeof e->message) {
            memcpy(e->message, line, len + 1);
        } else {
            /* (cut between UTF-8 characters, not inside one) */
            size_t head = sizeof e->message - 1 - 5 - MSG_TAIL;
            const size_t tail = utf8_at_or_after(line, len - MSG_TAIL, len);
            while (head > 0 && ((unsigned char)line[head] & 0xC0) == 0x80)
                head--;
            memcpy(e->message, line, head);
            memcpy(e->message + head, " ... ", 5);
            memcpy(e->message + head + 5, line + tail, len - tail + 1);
        }
        if (line != buf)
            free(line);
    }
    return code;
}

static int okerr(mc_error *e) {
    if (e) {
        e->code = MC_OK;
        e->daemon_code[0] = 0;
        e->message[0] = 0;
    }
    return MC_OK;
}

/* ------------------------------------------------------------------ time */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void abstime(struct timespec *ts, double t) {
    ts->tv_sec = (time_t)t;
    ts->tv_nsec = (long)((t - (double)ts->tv_sec) * 1e9);
    if (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
}

/* ------------------------------------------------------------------ msgpack helpers */

static const msgpack_object *mget(const msgpack_object *m, const char *key) {
    if (!m || m->type != MSGPACK_OBJECT_MAP)
        return NULL;
    size_t kl = strlen(key);
    for (uint32_t i = 0; i < m->via.map.size; i++) {
        const msgpack_object *k = &m->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == kl && memcmp(k->via.str.ptr, key, kl) == 0)
            return &m->via.map.ptr[i].val;
    }
    return NULL;
}

static int mint(const msgpack_object *o, int64_t *v) {
    if (!o) return 0;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (o->via.u64 > (uint64_t)INT64_MAX) return 0;
        *v = (int64_t)o->via.u64;
        return 1;
    }
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) { *v = o->via.i64; return 1; }
    return 0;
}

static int muint(const msgpack_object *o, uint64_t *v) {
    if (!o || o->type != MSGPACK_OBJECT_POSITIVE_INTEGER) return 0;
    *v = o->via.u64;
    return 1;
}

static int mnum(const msgpack_object *o, double *v) {
    int64_t i;
    if (!o) return 0;
    if (o->type == MSGPACK_OBJECT_FLOAT32 || o->type == MSGPACK_OBJECT_FLOAT64) { *v = o->via.f64; return 1; }
    if (mint(o, &i)) { *v = (double)i; return 1; }
    return 0;
}

static char *mstrdup(const msgpack_object *o) {
    if (!o || o->type != MSGPACK_OBJECT_STR) return NULL;
    char *s = malloc(o->via.str.size + 1);
    if (s) { memcpy(s, o->via.str.ptr, o->via.str.size); s[o->via.str.size] = 0; }
    return s;
}

static void mstrcpy(const msgpack_object *o, char *buf, size_t n) {
    buf[0] = 0;
    if (o && o->type == MSGPACK_OBJECT_STR && n) {
        size_t l = o->via.str.size < n - 1 ? o->via.str.size : n - 1;
        memcpy(buf, o->via.str.ptr, l);
        buf[l] = 0;
    }
}

static int mstreq(const msgpack_object *o, const char *s) {
    return o && o->type == MSGPACK_OBJECT_STR && o->via.str.size == strlen(s) &&
           memcmp(o->via.str.ptr, s, o->via.str.size) == 0;
}

static void pk_str(msgpack_packer *pk, const char *s) {
    size_t l = strlen(s);
    msgpack_pack_str(pk, l);
    msgpack_pack_str_body(pk, s, l);
}

/* Start a request in *sb (msgpack_sbuffer_destroy it after sending): a map of the header
 * fields v, id, op plus n_fields more, which the caller packs next into *pk. */
static void pk_request(msgpack_sbuffer *sb, msgpack_packer *pk, uint64_t id, const char *op, uint32_t n_fields) {
    msgpack_sbuffer_init(sb);
    msgpack_packer_init(pk, sb, msgpack_sbuffer_write);
    msgpack_pack_map(pk, 3 + n_fields);
    pk_str(pk, "v"); msgpack_pack_int(pk, PROTOCOL_VERSION);
    pk_str(pk, "id"); msgpack_pack_uint64(pk, id);
    pk_str(pk, "op"); pk_str(pk, op);
}

/* ------------------------------------------------------------------ the arena of one hello */

static void arena_unmap(mc_arena_map *am) {
    if (am->base) { munmap(am->base, am->size); am->base = NULL; }
    if (am->pin) { munmap(am->pin, am->pin_size); am->pin = NULL; }
}

static void arena_free(mc_arena_map *am) {
    arena_unmap(am);
    free(am->key_class); free(am->layer_moe); free(am->layer_cls);
    free(am->classes); free(am->parts); free(am->ints); free(am->expert_layers); free(am->model_files);
    for (uint32_t i = 0; i < am->n_strings; i++) free(am->strings[i]);
    free(am->strings);
    free(am);
}

void mc_arena_unref_map(mc_arena_map *am) {
    if (atomic_fetch_sub(&am->maprefs, 1) == 1)
        arena_unmap(am);
}

void mc_arena_unref(mc_arena_map *am) {
    if (atomic_fetch_sub(&am->refs, 1) == 1)
        arena_free(am);
}

static char *keep(mc_arena_map *am, char *s) {
    if (!s) return NULL;
    am->strings[am->n_strings++] = s;
    return s;
}

static int fail_arena(mc_arena_map *am, mc_error *err, int code, const char *msg) {
    seterr(err, code, "%s", msg);
    return code;
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22   /* Linux 5.14 */
#endif
/* The page tables of [off, off+len) of the arena filled: MADV_POPULATE_READ (*madv 1), or one
 * read a page where the kernel has no such advice (EINVAL: *madv 0 from then on). Any other
 * failure (EFAULT: a page a read would take SIGBUS on) stops populating (*madv -1): it is best
 * effort, and a hit faults the page in later. */
static void populate_range(char *base, uint64_t off, uint64_t len, uint64_t pg, int *madv) {
    uint64_t a = off & ~(pg - 1), e = off + len;
    if (len == 0 || *madv < 0)
        return;
    if (*madv == 1) {
        if (madvise(base + a, e - a, MADV_POPULATE_READ) == 0)
            return;
        if (errno != EINVAL) {
            *madv = -1;
            return;
        }
        *madv = 0;
    }
    for (uint64_t o = a; o < e; o += pg)
        (void)*(volatile const char *)(base + o);
}

/* populate: the control block's and each resident expert's pages, never a slot the budget gave
 * back: a read of a hole of a tmpfs file allocates a page, which the daemon finds and punches
 * again, moving the arena's releases word (that ends other engines' CUDA registrations of the
 * arena; a slot given back while this runs may still be read once, and is punched again). An
 * arena without a resident map (an older daemon) is filled whole. */
static void populate_resident(const mc_arena_map *am, const mcshm_layout *lay, uint64_t ctl_bytes) {
    char *base = (char *)am->base;
    const uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    int madv = 1;
    if (!am->has_resmap) {
        populate_range(base, 0, am->size, pg, &madv);
        return;
    }
    populate_range(base, 0, ctl_bytes, pg, &madv);
    for (uint32_t key = 0; key < lay->n_keys; key++) {
        const uint64_t r = atomic_load_explicit(mcshm_res_ptr(lay, key), memory_order_acquire);
        const uint32_t cls = lay->key_class[key / lay->n_experts];
        if (r == 0 || cls >= lay->n_classes || r - 1 >= lay->n_slots[cls])
            continue;
        const mc_class *k = &am->classes[cls];
        for (uint32_t p = 0; p < k->n_parts; p++)
            populate_range(base, k->parts[p].part_off + (r - 1) * k->parts[p].part_bytes, k->parts[p].part_bytes, pg, &madv);
    }
}

/* Build the arena description from the hello reply and map the arena (and the pin file). */
static int arena_from_hello(const msgpack_object *rep, uint64_t session, int populate, mc_arena_map **out,
                            mc_error *err) {
    char msg[256];
    const msgpack_object *d = mget(rep, "arena");
    int64_t ver = 0, n_experts = 0, top_k = 0, size = 0, v;
    if (!d || d->type != MSGPACK_OBJECT_MAP)
        return seterr(err, MC_ERR_PROTOCOL, "hello reply: no 'arena' descriptor");
    if (!mint(mget(d, "version"), &ver) || ver != DESCRIPTOR_VERSION)
        return seterr(err, MC_ERR_UNSUPPORTED, "arena descriptor version %lld: this client reads version %d; "
                      "install the client that matches the daemon", (long long)ver, DESCRIPTOR_VERSION);
    mint(mget(rep, "n_experts"), &n_experts);
    mint(mget(rep, "top_k"), &top_k);
    const msgpack_object *el = mget(rep, "expert_layers"), *cl = mget(d, "classes"), *ctl = mget(d, "control");
    if (!mint(mget(d, "size"), &size) || size <= 0 || !el || el->type != MSGPACK_OBJECT_ARRAY || !cl ||
        cl->type != MSGPACK_OBJECT_ARRAY || !ctl || n_experts <= 0)
        return seterr(err, MC_ERR_PROTOCOL, "hello reply: arena descriptor lacks size/classes/control or "
                      "expert_layers/n_experts");
    if (cl->via.array.size == 0 || cl->via.array.size > MCSHM_MAX_CLASSES)
        return seterr(err, MC_ERR_UNSUPPORTED, "arena: %u size classes (this client handles 1..%d)",
                      cl->via.array.size, MCSHM_MAX_CLASSES);
    mc_arena_map *am = calloc(1, sizeof *am);
    if (!am) return seterr(err, MC_ERR_SYSTEM, "out of memory");
    atomic_init(&am->refs, 1);
    atomic_init(&am->maprefs, 1);
    atomic_init(&am->fast_items, 0);
    atomic_init(&am->voided, 0);
    am->session = session;
    am->size = (size_t)size;
    uint32_t nc = cl->via.array.size;
    /* room for strings: path + per part name/type */
    uint32_t nparts_total = 0, nlayers_total = 0;
    for (uint32_t i = 0; i < nc; i++) {
        const msgpack_object *c = &cl->via.array.ptr[i];
        const msgpack_object *p = mget(c, "parts"), *l = mget(c, "layers");
        if (!p || p->type != MSGPACK_OBJECT_ARRAY || !l || l->type != MSGPACK_OBJECT_ARRAY) {
            arena_free(am);
            return seterr(err, MC_ERR_PROTOCOL, "arena: class %u lacks parts/layers", i);
        }
        nparts_total += p->via.array.size;
        nlayers_total += l->via.array.size;
    }
    /* the model's files (older daemons do not send them: an engine's check then refuses) */
    const msgpack_object *mf = mget(rep, "model_files");
    const uint32_t n_mf = mf && mf->type == MSGPACK_OBJECT_ARRAY && mf->via.array.size <= 4096 ? mf->via.array.size : 0;
    am->strings = calloc(2 * nparts_total + 4 + n_mf, sizeof(char *));
    am->model_files = calloc(n_mf + 1, sizeof(mc_file_id));
    if (!am->model_files) {
        arena_free(am);
        return seterr(err, MC_ERR_SYSTEM, "out of memory");
    }
    for (uint32_t i = 0; i < n_mf; i++) {
        const msgpack_object *f = &mf->via.array.ptr[i];
        int64_t fs = -1, mt = 0, dv = 0, in = 0;
        if (!mint(mget(f, "size"), &fs) || fs < 0 || !mint(mget(f, "mtime_ns"), &mt) ||
            !mint(mget(f, "dev"), &dv) || !mint(mget(f, "ino"), &in)) {
            arena_free(am);
            return seterr(err, MC_ERR_PROTOCOL, "hello reply: model_files[%u] lacks size/mtime_ns/dev/ino", i);
        }
        mc_file_id *id = &am->model_files[i];
        id->size = (uint64_t)fs;
        id->mtime_ns = mt;
        id->dev = (uint64_t)dv;
        id->ino = (uint64_t)in;
        am->n_model_files = i + 1;
    }
    am->classes = calloc(nc, sizeof(mc_class));
    am->parts = calloc(nparts_total ? nparts_total : 1, sizeof(mc_part));
    am->ints = calloc(nlayers_total + 1, sizeof(int32_t));
    am->n_expert_layers = el->via.array.size;
    am->expert_layers = calloc(am->n_expert_layers + 1, sizeof(int32_t));
    if (!am->strings || !am->classes || !am->parts || !am->ints || !am->expert_layers) {
        arena_free(am);
        return seterr(err, MC_ERR_SYSTEM, "out of memory");
    }
    int32_t max_layer = 0;
    for (uint32_t i = 0; i < am->n_expert_layers; i++) {
        if (!mint(&el->via.array.ptr[i], &v) || v < 0 || v > 1000000) {
            arena_free(am);
            return seterr(err, MC_ERR_PROTOCOL, "hello reply: expert_layers[%u] is not a block number", i);
        }
        am->expert_layers[i] = (int32_t)v;
        if (v > max_layer) max_layer = (int32_t)v;
    }
    am->max_layer = max_layer;
    am->layer_moe = malloc((size_t)(max_layer + 1) * sizeof(int32_t));
    am->layer_cls = malloc((size_t)(max_layer + 1) * sizeof(int32_t));
    am->key_class = calloc(am->n_expert_layers + 1, sizeof(uint32_t));
    if (!am->layer_moe || !am->layer_cls || !am->key_class) {
        arena_free(am);
        return seterr(err, MC_ERR_SYSTEM, "out of memory");
    }
    for (int32_t i = 0; i <= max_layer; i++) am->layer_moe[i] = am->layer_cls[i] = -1;
    for (uint32_t i = 0; i < am->n_expert_layers; i++) am->layer_moe[am->expert_layers[i]] = (int32_t)i;

    mcshm_layout *lay = &am->lay;
    lay->session = session;
    lay->n_experts = (uint32_t)n_experts;
    lay->n_classes = nc;
    uint32_t pi = 0, li = 0, slot_base = 0;
    int64_t ctl_off = 0, ctl_bytes = 0;
    mint(mget(ctl, "off"), &ctl_off);
    mint(mget(ctl, "bytes"), &ctl_bytes);
    if (ctl_off != 0 || ctl_bytes < MCSHM_CTL_HEADER_BYTES || ctl_bytes > size) {
        arena_free(am);
        return seterr(err, MC_ERR_UNSUPPORTED, "arena: control block at %lld (%lld bytes): this client expects "
                      "it at offset 0", (long long)ctl_off, (long long)ctl_bytes);
    }
    for (uint32_t i = 0; i < nc; i++) {
        const msgpack_object *c = &cl->via.array.ptr[i];
        int64_t id = -1, ns = 0, sb = 0, go = 0;
        if (!mint(mget(c, "id"), &id) || id != (int64_t)i || !mint(mget(c, "n_slots"), &ns) || ns < 0 ||
            !mint(mget(c, "slot_bytes"), &sb) || !mint(mget(c, "gen_off"), &go) || go < 0 || go % 8 ||
            go + 8 * ns > ctl_bytes) {
            arena_free(am);
            return seterr(err, MC_ERR_PROTOCOL, "arena: class %u: id must be %u and n_slots/slot_bytes/gen_off "
                          "inside the control block", i, i);
        }
        mc_class *k = &am->classes[i];
        k->id = i;
        k->n_slots = (uint32_t)ns;
        k->slot_bytes = (uint64_t)sb;
        lay->gen_word[i] = (uint64_t)go / 8;
        lay->n_slots[i] = (uint32_t)ns;
        lay->slot_base[i] = slot_base;
        slot_base += (uint32_t)ns;
        const msgpack_object *l = mget(c, "layers"), *p = mget(c, "parts");
        const msgpack_object *pb = mget(c, "part_bytes"), *po = mget(c, "part_off"), *pt = mget(c, "part_types");
        k->layers = &am->ints[li];
        k->n_layers = l->via.array.size;
        for (uint32_t j = 0; j < l->via.array.size; j++) {
            if (!mint(&l->via.array.ptr[j], &v) || v < 0 || v > max_layer || am->layer_moe[v] < 0) {
                arena_free(am);
                return seterr(err, MC_ERR_PROTOCOL, "arena: class %u lists a layer that is not in expert_layers", i);
            }
            am->ints[li++] = (int32_t)v;
            am->layer_cls[v] = (int32_t)i;
            am->key_class[am->layer_moe[v]] = i;
        }
        k->parts = &am->parts[pi];
        k->n_parts = p->via.array.size;
        for (uint32_t j = 0; j < p->via.array.size; j++) {
            mc_part *q = &am->parts[pi++];
            char *name = keep(am, mstrdup(&p->via.array.ptr[j]));
            int64_t b = -1, o = -1;
            if (!name || !mint(mget(pb, name), &b) || !mint(mget(po, name), &o) || b < 0 || o < ctl_bytes ||
                (uint64_t)o + (uint64_t)b * (uint64_t)ns > (uint64_t)size) {
                arena_free(am);
                return seterr(err, MC_ERR_PROTOCOL, "arena: class %u part %u: part_bytes/part_off missing or "
                              "outside the arena", i, j);
            }
            q->name = name;
            q->part_off = (uint64_t)o;
            q->part_bytes = (uint64_t)b;
            q->type = keep(am, mstrdup(mget(pt, name)));
            if (!q->type) q->type = "";
        }
    }
    for (uint32_t i = 0; i < am->n_expert_layers; i++)
        if (am->layer_cls[am->expert_layers[i]] < 0) {
            arena_free(am);
            return seterr(err, MC_ERR_PROTOCOL, "arena: expert layer %d is in no size class", am->expert_layers[i]);
        }
    lay->key_class = am->key_class;
    int64_t nk = (int64_t)am->n_expert_layers * n_experts, rmo = -1, dnk = -1;
    lay->n_keys = (uint32_t)nk;
    mint(mget(ctl, "n_keys"), &dnk);
    mint(mget(ctl, "resmap_off"), &rmo);
    am->has_resmap = dnk == nk && rmo >= MCSHM_CTL_HEADER_BYTES && rmo % 8 == 0 && rmo + 8 * nk <= ctl_bytes;
    lay->resmap_word = am->has_resmap ? (uint64_t)rmo / 8 : 0;

    /* map the arena read-only */
    char *path = keep(am, mstrdup(mget(d, "path")));
    if (!path) { arena_free(am); return seterr(err, MC_ERR_PROTOCOL, "arena: no path"); }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(msg, sizeof msg, "arena %s: open: %s (run the client as a user the daemon's arena is readable by)",
                 path, strerror(errno));
        return fail_arena(am, err, MC_ERR_SYSTEM, msg) + (arena_free(am), 0);
    }
    void *base = mmap(NULL, am->size, PROT_READ, MAP_SHARED, fd, 0);
    struct stat st;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size < am->size)
        populate = 0;   /* (a file shorter than described: its pages past the end are not read) */
    close(fd);
    if (base == MAP_FAILED) {
        snprintf(msg, sizeof msg, "arena %s: mmap %zu bytes: %s", path, am->size, strerror(errno));
        return fail_arena(am, err, MC_ERR_SYSTEM, msg) + (arena_free(am), 0);
    }
    am->base = base;
    lay->ctl = (mcshm_u64 *)base;
    if (memcmp(base, "MOECTL01", 8) != 0) {
        snprintf(msg, sizeof msg, "arena %s: no control block at offset 0 (not a moecached arena, or a newer "
                 "layout); upgrade the client", path);
        return fail_arena(am, err, MC_ERR_UNSUPPORTED, msg) + (arena_free(am), 0);
    }
    /* populate: the page tables of what the arena holds filled now, as llama.cpp maps a model
     * file, so that a hit's first touch of a slot costs no page fault in the middle of a token */
    if (populate)
        populate_resident(am, lay, (uint64_t)ctl_bytes);

    /* the pin file, when offered */
    const msgpack_object *pins = mget(rep, "pins");
    if (pins && pins->type == MSGPACK_OBJECT_MAP && am->has_resmap) {
        int64_t psize = 0, ring_n = 0, pins_off = 0, ring_off = 0;
        char *ppath = keep(am, mstrdup(mget(pins, "path")));
        char *door = keep(am, mstrdup(mget(pins, "door")));
        char *token = keep(am, mstrdup(mget(pins, "token")));
        if (door && token)
            ppath = door;   /* named in messages: the pin file itself has no path */
        if (!ppath || !mint(mget(pins, "size"), &psize) || !mint(mget(pins, "ring_n"), &ring_n) ||
            !mint(mget(pins, "pins_off"), &pins_off) || !mint(mget(pins, "ring_off"), &ring_off) ||
            ring_n <= 0 || (ring_n & (ring_n - 1)) || pins_off < MCSHM_PIN_HEADER_BYTES || pins_off % 4 ||
            ring_off % 8 || pins_off + 4 * (int64_t)slot_base > psize || ring_off + 16 * ring_n > psize) {
            arena_free(am);
            return seterr(err, MC_ERR_PROTOCOL, "hello reply: 'pins' descriptor incomplete or inconsistent");
        }
        int pfd = (door && token) ? fetch_pin_fd(door, token) : open(ppath, O_RDWR | O_CLOEXEC);
        if (pfd < 0) {
            snprintf(msg, sizeof msg, "pin file %s: %s: %s", ppath, door && token ? "door" : "open",
                     strerror(errno));
            return fail_arena(am, err, MC_ERR_SYSTEM, msg) + (arena_free(am), 0);
        }
        void *pb = mmap(NULL, (size_t)psize, PROT_READ | PROT_WRITE, MAP_SHARED, pfd, 0);
        close(pfd);
        if (pb == MAP_FAILED) {
            snprintf(msg, sizeof msg, "pin file %s: mmap: %s", ppath, strerror(errno));
            return fail_arena(am, err, MC_ERR_SYSTEM, msg) + (arena_free(am), 0);
        }
        am->pin = pb;
        am->pin_size = (size_t)psize;
        mcshm_u64 *pw = (mcshm_u64 *)pb;
        if (atomic_load(&pw[MCSHM_PIN_W_MAGIC]) != MCSHM_PIN_MAGIC ||
            atomic_load(&pw[MCSHM_PIN_W_NSLOTS]) != slot_base) {
            arena_free(am);
            return seterr(err, MC_ERR_PROTOCOL, "pin file %s: bad magic or slot count", ppath);
        }
        lay->pin = pw;
        /* the daemon honours pins on at most `quota` slots: more go over the socket */
        int64_t quota = 0;
        if (!mint(mget(pins, "quota"), &quota) || quota <= 0)
            quota = (int64_t)atomic_load(&pw[MCSHM_PIN_W_QUOTA]);
        am->pin_quota = quota > 0 ? (uint64_t)quota : 0;   /* none given: no bound */
        lay->ring_n = (uint32_t)ring_n;
        lay->pins_word32 = (uint64_t)pins_off / 4;
        lay->ring_word = (uint64_t)ring_off / 8;
    }

    am->pub.base = am->base;
    am->pub.size = am->size;
    am->pub.n_classes = nc;
    am->pub.classes = am->classes;
    am->pub.n_expert_layers = am->n_expert_layers;
    am->pub.expert_layers = am->expert_layers;
    am->pub.n_experts = (uint32_t)n_experts;
    am->pub.top_k = top_k > 0 ? (uint32_t)top_k : 0;
    am->pub.session = session;
    for (uint32_t i = 0; i < am->n_model_files; i++)   /* strings has room for these */
        am->model_files[i].path = keep(am, mstrdup(mget(&mf->via.array.ptr[i], "path")));
    am->pub.n_model_files = am->n_model_files;
    am->pub.model_files = am->model_files;
    *out = am;
    return MC_OK;
}

int mc_file_id_of(const char *path, mc_file_id *out, mc_error *err) {
    struct stat st;
    if (!path || !out) return seterr(err, MC_ERR_INVALID_ARG, "mc_file_id_of: NULL argument");
    if (stat(path, &st) != 0) return seterr(err, MC_ERR_SYSTEM, "%s: %s", path, strerror(errno));
    memset(out, 0, sizeof *out);
    out->size = (uint64_t)st.st_size;
    out->mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    out->dev = (uint64_t)st.st_dev;
    out->ino = (uint64_t)st.st_ino;
    return MC_OK;
}

/* p, or "..." and its last bytes (between UTF-8 characters) when it is longer than n - 1: a line
 * naming two files keeps both names in mc_error.message */
static const char *path_tail(const char *p, char *buf, size_t n) {
    size_t len = strlen(p);
    if (len < n)
        return p;
    const size_t t = utf8_at_or_after(p, len - (n - 4), len);
    memcpy(buf, "...", 3);
    memcpy(buf + 3, p + t, len - t + 1);
    return buf;
}

int mc_check_model_file(const mc_arena *a, uint32_t i, const mc_file_id *mine, const char *mine_path, mc_error *err) {
    if (!a || !mine) return seterr(err, MC_ERR_INVALID_ARG, "mc_check_model_file: NULL argument");
    char mine_short[96], theirs_short[96];
    const char *me = mine_path ? path_tail(mine_path, mine_short, sizeof mine_short) : "this engine's model file";
    if (i >= a->n_model_files)
        return seterr(err, MC_ERR_OTHER_MODEL, "the daemon does not say which model file it serves (file %u of %u; "
                      "an older moecached?): cannot check that it is %s; run the daemon of this client's version",
                      i, a->n_model_files, me);
    const mc_file_id *d = &a->model_files[i];
    if (d->size == mine->size && d->mtime_ns == mine->mtime_ns)
        return MC_OK;
    return seterr(err, MC_ERR_OTHER_MODEL, "the daemon serves %s (%llu bytes, mtime %lld.%09lld), this engine "
                  "loaded %s (%llu bytes, mtime %lld.%09lld)%s: another model file (its experts would give wrong "
                  "output); start the engine on the daemon's file, or a copy with its times (cp -p)",
                  d->path ? path_tail(d->path, theirs_short, sizeof theirs_short) : "its model", (unsigned long long)d->size, (long long)(d->mtime_ns / 1000000000LL),
                  (long long)(d->mtime_ns % 1000000000LL), me, (unsigned long long)mine->size,
                  (long long)(mine->mtime_ns / 1000000000LL), (long long)(mine->mtime_ns % 1000000000LL),
                  d->dev == mine->dev && d->ino == mine->ino ? " (the same file, rewritten on disk after one of them read it)" : "");
}

int mc_layer_class(const mc_arena *a, int layer) {
    const mc_arena_map *am = (const mc_arena_map *)((const char *)a - offsetof(mc_arena_map, pub));
    if (layer < 0 || layer > am->max_layer) return -1;
    return am->layer_cls[layer];
}

/* ------------------------------------------------------------------ the client */

typedef struct call {
    uint64_t id;
    const char *op;
    int state;                 /* 0 waiting, 1 reply in rep, 2 error in err */
    msgpack_unpacked rep;
    mc_error err;
    struct call *next;
} call;

struct mc_client {
    char *endpoint;            /* where the current session's socket connects */
    char *origin;              /* where every new session says hello first (mc_connect's) */
    char *model;              /* opt.model, owned (NULL: none) */
    char name[65];
    mc_options opt;
    int ipc;
    pthread_mutex_t mu;        /* socket, pending, session, cur */
    pthread_cond_t cv;
    pthread_mutex_t pin_mu;    /* fast-path pins (one ring producer); cur is read under it */
    void *ctx, *sock, *mon;
    int wakefd;
    int sock_busy, sock_want, hello_busy;
    int redirects;            /* hello redirects followed in a row */
    call *pending;
    uint64_t next_id;
    _Atomic uint64_t session;  /* written under mu; read without it by the accessors */
    mc_arena_map *cur;
    mc_arena_map *all;         /* every arena since connect (metadata kept until close) */
    _Atomic int watched, fast, hb_ms;
    _Atomic uint32_t max_request_experts;
    double last_tx, last_rx, ping_t;
    uint64_t ping_id;
    uint64_t *relq;            /* socket releases waiting for the socket */
    uint32_t relq_n, relq_cap;
    pthread_t hb;
    int hb_started, closed;
    pthread_cond_t hb_cv;
    int mon_seq;
};

static int read_pid_start(uint64_t *out) {
    char buf[1024];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return 0;
    p += 2;   /* field 3 (state) */
    for (int f = 3; f < 22; f++) {
        p = strchr(p, ' ');
        if (!p) return 0;
        p++;
    }
    *out = strtoull(p, NULL, 10);
    return 1;
}

void mc_options_init(mc_options *opt) {
    opt->timeout_ms = 30000;
    opt->connect_timeout_ms = 10000;
    opt->fast_path = 1;
    opt->heartbeat_thread = 1;
    opt->heartbeat_ms = 0;
    opt->send_pid = 1;
    opt->model = NULL;
    opt->warm_wait_ms = 600000;
    const char *w = getenv("MOECACHE_WARM_WAIT_MS");   /* an engine's user sets it without code */
    if (w && *w) opt->warm_wait_ms = atoi(w);
    const char *q = getenv("MOECACHE_QUIET");
    opt->quiet = q && *q && strcmp(q, "0") != 0;
    const char *p = getenv("MOECACHE_POPULATE");
    opt->populate = !(p && strcmp(p, "0") == 0);
}

static int new_socket(mc_client *c, mc_error *err) {
    char addr[64];
    c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
    if (!c->sock) return seterr(err, MC_ERR_SYSTEM, "zmq_socket: %s", zmq_strerror(zmq_errno()));
    int zero = 0, ivl = 100, ivlmax = 1000;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(c->sock, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl);
    zmq_setsockopt(c->sock, ZMQ_RECONNECT_IVL_MAX, &ivlmax, sizeof ivlmax);
    snprintf(addr, sizeof addr, "inproc://moecache-mon-%p-%d", (void *)c, c->mon_seq++);
    if (zmq_socket_monitor(c->sock, addr, ZMQ_EVENT_DISCONNECTED) != 0) {
        zmq_close(c->sock);
        return seterr(err, MC_ERR_SYSTEM, "zmq_socket_monitor: %s", zmq_strerror(zmq_errno()));
    }
    c->mon = zmq_socket(c->ctx, ZMQ_PAIR);
    zmq_setsockopt(c->mon, ZMQ_LINGER, &zero, sizeof zero);
    if (!c->mon || zmq_connect(c->mon, addr) != 0 || zmq_connect(c->sock, c->endpoint) != 0) {
        int e = zmq_errno();
        if (c->mon) zmq_close(c->mon);
        zmq_close(c->sock);
        c->sock = c->mon = NULL;
        return seterr(err, MC_ERR_SYSTEM, "connect %s: %s", c->endpoint, zmq_strerror(e));
    }
    return MC_OK;
}

static void close_socket(mc_client *c) {
    if (c->sock) {
        zmq_socket_monitor(c->sock, NULL, 0);
        zmq_close(c->sock);
    }
    if (c->mon) zmq_close(c->mon);
    c->sock = c->mon = NULL;
}

/* Wake a reader blocked in zmq_poll (someone wants the socket). */
static void wake_reader(mc_client *c) {
    uint64_t one = 1;
    ssize_t r = write(c->wakefd, &one, sizeof one);
    (void)r;
}

/* With c->mu held: wait until no reader holds the socket; then the caller may use it while it
 * keeps c->mu. */
static void sock_wait_locked(mc_client *c) {
    while (c->sock_busy) {
        c->sock_want++;
        wake_reader(c);
        pthread_cond_wait(&c->cv, &c->mu);
        c->sock_want--;
    }
}

static int send_locked(mc_client *c, msgpack_sbuffer *sb, const char *op, mc_error *err) {
    sock_wait_locked(c);
    if (!c->sock) return seterr(err, MC_ERR_CLOSED, "%s: client is closed", op);
    if (zmq_send(c->sock, sb->data, sb->size, 0) < 0)
        return seterr(err, MC_ERR_SYSTEM, "%s: send failed: %s", op, zmq_strerror(zmq_errno()));
    c->last_tx = now_s();
    return MC_OK;
}

static void send_release_locked(mc_client *c, const uint64_t *ids, uint32_t n) {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    pk_request(&sb, &pk, c->next_id++, "release", 2);
    if (n == 1) {
        pk_str(&pk, "lease"); msgpack_pack_uint64(&pk, ids[0]);
    } else {
        pk_str(&pk, "leases");
        msgpack_pack_array(&pk, n);
        for (uint32_t i = 0; i < n; i++) msgpack_pack_uint64(&pk, ids[i]);
    }
    pk_str(&pk, "noreply"); msgpack_pack_true(&pk);
    if (c->sock && zmq_send(c->sock, sb.data, sb.size, 0) >= 0)
        c->last_tx = now_s();
    msgpack_sbuffer_destroy(&sb);
}

/* An acquire its caller gave up on: the daemon drops it (its pins go now rather than when its
 * reads finish); a lease that still comes is released as a late reply. Best effort, noreply. */
static void send_cancel_locked(mc_client *c, uint64_t rid) {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    pk_request(&sb, &pk, c->next_id++, "cancel", 2);
    pk_str(&pk, "request"); msgpack_pack_uint64(&pk, rid);
    pk_str(&pk, "noreply"); msgpack_pack_true(&pk);
    send_locked(c, &sb, "cancel", NULL);
    msgpack_sbuffer_destroy(&sb);
}

/* The socket's owner sends the releases queued while it was busy. */
/* the most lease ids one release may name (the protocol's MAX_LEASES_PER_REQUEST) */
#define MC_MAX_LEASES_PER_REQUEST 1024

static void flush_releases_locked(mc_client *c) {
    uint32_t i = 0;
    while (i < c->relq_n) {
        uint32_t k = c->relq_n - i > MC_MAX_LEASES_PER_REQUEST ? MC_MAX_LEASES_PER_REQUEST : c->relq_n - i;
        send_release_locked(c, c->relq + i, k);
        i += k;
    }
    c->relq_n = 0;
}

static void fail_pending_locked(mc_client *c, int code, const char *why) {
    for (call *k = c->pending; k; k = k->next) {
        if (k->state == 0) {
            seterr(&k->err, code, "%s: %s", k->op, why);
            k->state = 2;
        }
    }
    c->pending = NULL;
    pthread_cond_broadcast(&c->cv);
}

/* The daemon went away: every call in flight fails; the next call says hello again. */
static void void_session_locked(mc_client *c, const char *why) {
    fail_pending_locked(c, MC_ERR_RESTARTED, why);
    pthread_mutex_lock(&c->pin_mu);
    if (c->cur) {
        atomic_store(&c->cur->voided, 1);
        mc_arena_unref_map(c->cur);
        c->cur = NULL;
    }
    pthread_mutex_unlock(&c->pin_mu);
    c->session = 0;
    c->ping_id = 0;
    c->relq_n = 0;   /* releases of a daemon that is gone */
}

static call *take_pending_locked(mc_client *c, uint64_t id) {
    for (call **p = &c->pending; *p; p = &(*p)->next)
        if ((*p)->id == id) {
            call *k = *p;
            *p = k->next;
            return k;
        }
    return NULL;
}

/* Complete call k with its reply u: on ok, k takes u (state 1); else k gets the daemon's error
 * ("OP: CODE: message", state 2) and u is destroyed. */
static void complete_call(call *k, msgpack_unpacked *u, int ok) {
    if (ok) {
        k->rep = *u;
        k->state = 1;
        return;
    }
    const msgpack_object *e = mget(&u->data, "error");
    char code[32];
    mstrcpy(mget(e, "code"), code, sizeof code);
    const msgpack_object *m = mget(e, "message");   /* (whole: seterr keeps its end) */
    const int has_m = m && m->type == MSGPACK_OBJECT_STR && m->via.str.size < (1u << 30);
    seterr(&k->err, mc_code_from_daemon(code), "%s: %s: %.*s", k->op, code, has_m ? (int)m->via.str.size : 0,
           has_m ? m->via.str.ptr : "");
    snprintf(k->err.daemon_code, sizeof k->err.daemon_code, "%s", code);
    k->state = 2;
    msgpack_unpacked_destroy(u);
}

/* One reply frame; the caller owns the socket and holds c->mu. */
static void dispatch_locked(mc_client *c, const char *frame, size_t len, int hello) {
    c->last_rx = now_s();
    /* msgpack-c's strings point into the buffer they were unpacked from, and the frame goes
     * away when it is closed: unpack a copy that the reply's zone owns */
    char *data = malloc(len ? len : 1);
    if (!data) return;
    memcpy(data, frame, len);
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    if (msgpack_unpack_next(&u, data, len, &off) != MSGPACK_UNPACK_SUCCESS || u.data.type != MSGPACK_OBJECT_MAP ||
        !u.zone || !msgpack_zone_push_finalizer(u.zone, free, data)) {
        msgpack_unpacked_destroy(&u);
        free(data);
        return;
    }
    const msgpack_object *rep = &u.data;
    uint64_t rid = 0, session = 0;
    if (!muint(mget(rep, "id"), &rid)) {
        msgpack_unpacked_destroy(&u);
        return;
    }
    int has_session = muint(mget(rep, "session"), &session);
    const msgpack_object *okv = mget(rep, "ok");
    int ok = okv && okv->type == MSGPACK_OBJECT_BOOLEAN && okv->via.boolean;
    call *k = take_pending_locked(c, rid);
    if (rid && rid == c->ping_id) c->ping_id = 0;
    if (k && strcmp(k->op, "hello") == 0) {
        complete_call(k, &u, ok);
        pthread_cond_broadcast(&c->cv);
        return;
    }
    if (c->session == 0 || (has_session && session != c->session)) {
        /* an answer from a daemon other than the one we said hello to */
        if (k) {
            seterr(&k->err, MC_ERR_RESTARTED, "%s: the daemon restarted", k->op);
            k->state = 2;
        }
        if (c->session != 0) void_session_locked(c, "the daemon restarted");
        pthread_cond_broadcast(&c->cv);
        msgpack_unpacked_destroy(&u);
        (void)hello;
        return;
    }
    if (!k) {
        /* a late reply to a call that gave up: never hand it to anyone; give back its lease */
        uint64_t lid;
        if (ok && muint(mget(rep, "lease"), &lid))
            send_release_locked(c, &lid, 1);
        msgpack_unpacked_destroy(&u);
        return;
    }
    complete_call(k, &u, ok);
    pthread_cond_broadcast(&c->cv);
}

static void check_monitor_locked(mc_client *c, int hello) {
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, c->mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return;
        }
        uint16_t ev = 0;
        if (zmq_msg_size(&m) >= 2) memcpy(&ev, zmq_msg_data(&m), 2);
        int more = zmq_msg_more(&m);
        zmq_msg_close(&m);
        while (more) {   /* the endpoint frame */
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, c->mon, ZMQ_DONTWAIT) < 0) { zmq_msg_close(&m); break; }
            more = zmq_msg_more(&m);
            zmq_msg_close(&m);
        }
        if (ev == ZMQ_EVENT_DISCONNECTED && !hello && c->session != 0)
            void_session_locked(c, "connection to the daemon dropped");
    }
}

/* Read what is queued (no wait); the caller owns the socket and holds c->mu. */
static void drain_locked(mc_client *c, int hello) {
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        int r = zmq_msg_recv(&m, c->sock, ZMQ_DONTWAIT);
        if (r < 0) { zmq_msg_close(&m); break; }
        int more = zmq_msg_more(&m);
        if (zmq_msg_size(&m) == 0 && more) {   /* an empty delimiter frame: take the payload */
            zmq_msg_close(&m);
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, c->sock, ZMQ_DONTWAIT) < 0) { zmq_msg_close(&m); break; }
            more = zmq_msg_more(&m);
        }
        if (!more)
            dispatch_locked(c, zmq_msg_data(&m), zmq_msg_size(&m), hello);
        zmq_msg_close(&m);
        while (more) {  /* unexpected extra frames */
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, c->sock, ZMQ_DONTWAIT) < 0) { zmq_msg_close(&m); break; }
            more = zmq_msg_more(&m);
            zmq_msg_close(&m);
        }
    }
    check_monitor_locked(c, hello);
}

/* Become the reader for up to `wait_s` seconds (or until `k` is done / someone wants the
 * socket). Called with c->mu held and the socket free; returns with c->mu held. */
static void read_slice_locked(mc_client *c, call *k, double wait_s, int hello) {
    c->sock_busy = 1;
    flush_releases_locked(c);
    drain_locked(c, hello);
    if ((k == NULL || k->state == 0) && wait_s > 0 && c->sock && c->sock_want == 0) {
        zmq_pollitem_t it[3] = {{c->sock, 0, ZMQ_POLLIN, 0}, {c->mon, 0, ZMQ_POLLIN, 0},
                                {NULL, c->wakefd, ZMQ_POLLIN, 0}};
        long ms = (long)(wait_s * 1000) + 1;
        if (ms > SLICE_MS) ms = SLICE_MS;
        pthread_mutex_unlock(&c->mu);
        zmq_poll(it, 3, ms);
        if (it[2].revents) {
            uint64_t v;
            ssize_t r = read(c->wakefd, &v, sizeof v);
            (void)r;
        }
        pthread_mutex_lock(&c->mu);
        drain_locked(c, hello);
    }
    c->sock_busy = 0;
    pthread_cond_broadcast(&c->cv);
}

/* Wait for k's outcome (reading the socket while nobody else does). deadline < 0: forever.
 * Returns with k off the pending list (done or given up). */
static void wait_call_locked(mc_client *c, call *k, double deadline, int hello) {
    while (k->state == 0) {
        double left = deadline < 0 ? SLICE_MS / 1000.0 : deadline - now_s();
        if (left <= 0) {
            if (take_pending_locked(c, k->id) != NULL) {
                seterr(&k->err, MC_ERR_TIMEOUT, "%s: no reply within the timeout%s", k->op,
                       hello ? " (is moecached running?)" : "");
                k->state = 2;
            }
            break;
        }
        if (!c->sock_busy && c->sock_want == 0 && c->sock) {
            read_slice_locked(c, k, left, hello);
        } else if (!c->sock) {
            take_pending_locked(c, k->id);
            seterr(&k->err, MC_ERR_CLOSED, "%s: client is closed", k->op);
            k->state = 2;
        } else {
            struct timespec ts;
            abstime(&ts, now_s() + (left < 0.05 ? left : 0.05));
            pthread_cond_timedwait(&c->cv, &c->mu, &ts);
        }
    }
}

static void call_init(call *k, const char *op, uint64_t id) {
    memset(k, 0, sizeof *k);
    k->op = op;
    k->id = id;
    msgpack_unpacked_init(&k->rep);
}

static int hello_locked(mc_client *c, mc_error *err);

/* Replace the socket by one connected to `ep` (owned: taken over, freed on failure). */
static int reconnect_locked(mc_client *c, char *ep, mc_error *err) {
    if (!ep) return seterr(err, MC_ERR_SYSTEM, "out of memory");
    sock_wait_locked(c);
    close_socket(c);
    free(c->endpoint);
    c->endpoint = ep;
    c->ipc = strncmp(ep, "ipc://", 6) == 0;
    return new_socket(c, err);
}

/* A hello reply with "redirect": the model is served on its own endpoint; connect there and
 * say hello again (at most a few times). */
static int follow_redirect_locked(mc_client *c, const msgpack_object *where, mc_error *err) {
    if (where->type != MSGPACK_OBJECT_STR || where->via.str.size == 0 || c->redirects >= 4)
        return seterr(err, MC_ERR_PROTOCOL, "hello: %s redirected model %s again or to no endpoint; "
                      "the daemon's models are inconsistent", c->endpoint, c->model ? c->model : "-");
    int r = reconnect_locked(c, strndup(where->via.str.ptr, where->via.str.size), err);
    if (r != MC_OK) return r;
    c->redirects++;
    r = hello_locked(c, err);
    c->redirects = 0;
    return r;
}

static int hello_locked(mc_client *c, mc_error *err) {
    if (c->redirects == 0 && strcmp(c->endpoint, c->origin) != 0) {
        /* a new session starts where the client was opened (the daemon's endpoint): it
         * redirects again while the model is served, or refuses at once once it is not (the
         * model's own endpoint may be gone with it) */
        int r = reconnect_locked(c, strdup(c->origin), err);
        if (r != MC_OK) return r;
    }
    call k;
    call_init(&k, "hello", c->next_id++);
    msgpack_sbuffer sb;
    msgpack_packer pk;
    uint64_t start = 0;
    int have_start = c->opt.send_pid && read_pid_start(&start);
    int fast = c->opt.fast_path && c->ipc && c->opt.send_pid && have_start;
    pk_request(&sb, &pk, k.id, "hello", 1 + (c->opt.send_pid ? 1 : 0) + (have_start ? 1 : 0) + (fast ? 2 : 0)
                + (c->model ? 1 : 0));
    pk_str(&pk, "client"); pk_str(&pk, c->name);
    if (c->opt.send_pid) { pk_str(&pk, "pid"); msgpack_pack_int64(&pk, getpid()); }
    if (have_start) { pk_str(&pk, "pid_start"); msgpack_pack_uint64(&pk, start); }
    if (fast) {   /* the pin file comes as a sealed fd from the daemon's door */
        pk_str(&pk, "fast_path"); msgpack_pack_true(&pk);
        pk_str(&pk, "pin_fd"); msgpack_pack_true(&pk);
    }
    if (c->model) { pk_str(&pk, "model"); pk_str(&pk, c->model); }
    k.next = c->pending;
    c->pending = &k;
    int r = send_locked(c, &sb, "hello", err);
    msgpack_sbuffer_destroy(&sb);
    if (r != MC_OK) {
        take_pending_locked(c, k.id);
        return r;
    }
    double deadline = c->opt.connect_timeout_ms < 0 ? -1 : now_s() + c->opt.connect_timeout_ms / 1000.0;
    wait_call_locked(c, &k, deadline, 1);
    if (k.state != 1) {
        if (err) *err = k.err;
        if (k.err.code == MC_ERR_TIMEOUT)
            seterr(err, MC_ERR_TIMEOUT, "no hello from %s within %d ms (is moecached running?)", c->endpoint,
                   c->opt.connect_timeout_ms);
        return k.err.code;
    }
    /* a disconnect the monitor reports now happened before this hello's connection was made
     * (the reply came through it): it belongs to the daemon before this hello */
    sock_wait_locked(c);
    if (c->mon) check_monitor_locked(c, 1);
    const msgpack_object *rep = &k.rep.data;
    const msgpack_object *where = mget(rep, "redirect");
    if (where) {
        r = follow_redirect_locked(c, where, err);
        msgpack_unpacked_destroy(&k.rep);
        return r;
    }
    uint64_t session = 0;
    if (!muint(mget(rep, "session"), &session) || session == 0) {
        msgpack_unpacked_destroy(&k.rep);
        return seterr(err, MC_ERR_PROTOCOL, "hello reply without a session");
    }
    mc_arena_map *am = NULL;
    r = arena_from_hello(rep, session, c->opt.populate, &am, err);
    if (r != MC_OK) {
        msgpack_unpacked_destroy(&k.rep);
        return r;
    }
    double hb = 5.0;
    mnum(mget(rep, "heartbeat_s"), &hb);
    c->hb_ms = c->opt.heartbeat_ms > 0 ? c->opt.heartbeat_ms : (int)(hb * 1000 / 3);
    if (c->hb_ms < 10) c->hb_ms = 10;
    c->watched = mstreq(mget(rep, "lease_watch"), "process");
    uint64_t mre = 0;
    c->max_request_experts = muint(mget(mget(rep, "limits"), "max_request_experts"), &mre) ? (uint32_t)mre : 0;
    msgpack_unpacked_destroy(&k.rep);
    am->client_next = c->all;
    c->all = am;
    pthread_mutex_lock(&c->pin_mu);
    c->cur = am;
    c->fast = am->lay.pin != NULL;
    pthread_mutex_unlock(&c->pin_mu);
    c->session = session;
    c->last_rx = now_s();
    pthread_cond_broadcast(&c->cv);
    return okerr(err);
}

static int ensure_session_locked(mc_client *c, mc_error *err) {
    while (c->hello_busy)
        pthread_cond_wait(&c->cv, &c->mu);
    if (c->closed) return seterr(err, MC_ERR_CLOSED, "client is closed");
    if (c->session) return MC_OK;
    c->hello_busy = 1;
    int r = hello_locked(c, err);
    c->hello_busy = 0;
    pthread_cond_broadcast(&c->cv);
    return r;
}

/* Send a request built by `fill` and wait for its reply. On MC_OK *rep holds the reply
 * (msgpack_unpacked_destroy it). timeout_ms < 0: the client's default. expect_reply 0:
 * fire and forget (noreply). */
typedef void (*fill_fn)(msgpack_packer *pk, void *arg);

static int do_call(mc_client *c, const char *op, int n_fields, fill_fn fill, void *arg, int timeout_ms,
                   int expect_reply, msgpack_unpacked *rep, uint64_t *session_out, mc_error *err) {
    if (!c) return seterr(err, MC_ERR_INVALID_ARG, "%s: client is NULL", op);
    pthread_mutex_lock(&c->mu);
    int r = ensure_session_locked(c, err);
    if (r != MC_OK) {
        pthread_mutex_unlock(&c->mu);
        return r;
    }
    call k;
    call_init(&k, op, c->next_id++);
    msgpack_sbuffer sb;
    msgpack_packer pk;
    pk_request(&sb, &pk, k.id, op, (uint32_t)n_fields);
    if (fill) fill(&pk, arg);
    if (expect_reply) {
        k.next = c->pending;
        c->pending = &k;
    }
    r = send_locked(c, &sb, op, err);
    msgpack_sbuffer_destroy(&sb);
    if (r != MC_OK || !expect_reply) {
        if (expect_reply) take_pending_locked(c, k.id);
        pthread_mutex_unlock(&c->mu);
        return r == MC_OK ? okerr(err) : r;
    }
    int tmo = timeout_ms >= 0 ? timeout_ms : c->opt.timeout_ms;
    uint64_t sent_session = c->session;
    wait_call_locked(c, &k, tmo < 0 ? -1 : now_s() + tmo / 1000.0, 0);
    uint64_t sess = c->session;
    if (k.state == 2 && k.err.code == MC_ERR_TIMEOUT && strcmp(op, "acquire") == 0 && sess == sent_session &&
        sess != 0)
        send_cancel_locked(c, k.id);
    if (k.state == 2 && k.err.code == MC_ERR_TIMEOUT)   /* which daemon, how long */
        seterr(&k.err, MC_ERR_TIMEOUT, "%s: no reply from %s within %d ms (mc_options.timeout_ms): the daemon is "
               "stalled or overloaded (moecache-ctl stats)", op, c->endpoint ? c->endpoint : "the daemon", tmo);
    pthread_mutex_unlock(&c->mu);
    if (k.state != 1) {
        if (err) *err = k.err;
        return k.err.code;
    }
    if (session_out) *session_out = sess;
    *rep = k.rep;
    return okerr(err);
}

mc_client *mc_connect(const char *endpoint, const char *name, const mc_options *opt, mc_error *err) {
    mc_client *c = calloc(1, sizeof *c);
    if (!c) { seterr(err, MC_ERR_SYSTEM, "out of memory"); return NULL; }
    if (opt) c->opt = *opt; else mc_options_init(&c->opt);
    if (!endpoint) endpoint = MC_DEFAULT_ENDPOINT;
    struct stat st;
    if (strncmp(endpoint, "ipc://", 6) != 0 && strncmp(endpoint, "tcp://", 6) != 0) {
        seterr(err, MC_ERR_INVALID_ARG, "endpoint %s: expected ipc://PATH (the daemon's socket, e.g. %s) or "
               "tcp://HOST:PORT", endpoint, MC_DEFAULT_ENDPOINT);
        free(c);
        return NULL;
    }
    if (strncmp(endpoint, "ipc://", 6) == 0 && stat(endpoint + 6, &st) != 0 && errno == ENOENT) {
        seterr(err, MC_ERR_SYSTEM, "no daemon socket at %s: is moecached running? (systemctl status moecached)",
               endpoint + 6);
        free(c);
        return NULL;
    }
    c->endpoint = strdup(endpoint);
    c->origin = strdup(endpoint);
    c->ipc = strncmp(endpoint, "ipc://", 6) == 0;
    c->model = c->opt.model ? strdup(c->opt.model) : NULL;
    c->opt.model = c->model;
    if (name && *name) snprintf(c->name, sizeof c->name, "%s", name);
    else snprintf(c->name, sizeof c->name, "pid%d", (int)getpid());
    c->next_id = 1;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->pin_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->cv, &ca);
    pthread_cond_init(&c->hb_cv, &ca);
    pthread_condattr_destroy(&ca);
    c->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    c->ctx = zmq_ctx_new();
    c->last_tx = c->last_rx = now_s();
    if (c->wakefd < 0 || !c->ctx || !c->endpoint || !c->origin) {
        seterr(err, MC_ERR_SYSTEM, "eventfd/zmq_ctx_new/strdup: %s", strerror(errno));
        mc_close(c);
        return NULL;
    }
    if (new_socket(c, err) != MC_OK) {
        mc_close(c);
        return NULL;
    }
    pthread_mutex_lock(&c->mu);
    int r = ensure_session_locked(c, err);
    pthread_mutex_unlock(&c->mu);
    if (r != MC_OK) {
        c->session = 0;   /* no bye */
        mc_close(c);
        return NULL;
    }
    if (c->opt.warm_wait_ms != 0) {   /* a fill still running after the wait: go on anyway */
        uint64_t left = 0;
        mc_error we;
        double t0 = now_s();
        int say = !c->opt.quiet;
        if (mc_warm_wait(c, 0, &left, &we) == MC_ERR_TIMEOUT && left > 0) {
            if (say) fprintf(stderr, "moecache: the daemon is filling the model (%llu experts to load): waiting up to %d ms "
                    "(MOECACHE_WARM_WAIT_MS or mc_options.warm_wait_ms; 0: do not wait)\n",
                    (unsigned long long)left, c->opt.warm_wait_ms);
            int wr = mc_warm_wait(c, c->opt.warm_wait_ms, &left, &we);
            if (say && wr == MC_OK)
                fprintf(stderr, "moecache: the daemon's fill ended after %.1f s\n", now_s() - t0);
            else if (say)
                fprintf(stderr, "moecache: %s; going on without it\n", we.message);
        }
    }
    if (c->opt.heartbeat_thread) {
        extern void *mc__heartbeat_main(void *);
        if (pthread_create(&c->hb, NULL, mc__heartbeat_main, c) == 0)
            c->hb_started = 1;
    }
    okerr(err);
    return c;
}

static void tick_locked(mc_client *c) {
    if (c->closed || !c->sock) return;
    double now = now_s(), hb = c->hb_ms / 1000.0;
    /* while a reader is active it reads the replies and watches the monitor; only a ping due
     * (a long acquire wait sends nothing) makes this thread take the socket from it */
    int ping_due = c->session != 0 && c->ping_id == 0 && now - c->last_tx >= hb * 0.9;
    if (c->sock_busy && !ping_due) return;
    sock_wait_locked(c);
    if (c->closed || !c->sock) return;
    read_slice_locked(c, NULL, 0, 0);
    if (c->session == 0) return;
    if (c->ping_id == 0 && now - c->last_tx >= hb * 0.9) {
        msgpack_sbuffer sb;
        msgpack_packer pk;
        uint64_t id = c->next_id++;
        pk_request(&sb, &pk, id, "ping", 0);
        if (send_locked(c, &sb, "ping", NULL) == MC_OK) {
            c->ping_id = id;
            c->ping_t = now;
        }
        msgpack_sbuffer_destroy(&sb);
    } else if (c->ping_id != 0 && !c->ipc && now - c->ping_t > 3 * hb && now - c->last_rx > 3 * hb) {
        /* tcp: no answer for a while, the daemon or the host is gone; start afresh (over ipc a
         * daemon that went away drops the connection, which the monitor sees) */
        void_session_locked(c, "daemon not answering");
        close_socket(c);
        new_socket(c, NULL);
    }
}

int mc_tick(mc_client *c, mc_error *err) {
    if (!c) return seterr(err, MC_ERR_INVALID_ARG, "mc_tick: client is NULL");
    pthread_mutex_lock(&c->mu);
    tick_locked(c);
    int closed = c->closed;
    pthread_mutex_unlock(&c->mu);
    return closed ? seterr(err, MC_ERR_CLOSED, "client is closed") : okerr(err);
}

void *mc__heartbeat_main(void *arg) {
    mc_client *c = arg;
    pthread_mutex_lock(&c->mu);
    while (!c->closed) {
        struct timespec ts;
        abstime(&ts, now_s() + c->hb_ms / 1000.0);
        pthread_cond_timedwait(&c->hb_cv, &c->mu, &ts);
        if (c->closed) break;
        tick_locked(c);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

int mc_heartbeat_ms(const mc_client *c) { return c ? c->hb_ms : 0; }
uint64_t mc_session(const mc_client *c) { return c ? c->session : 0; }
int mc_watched(const mc_client *c) { return c ? c->watched : 0; }
int mc_fast_path(const mc_client *c) { return c ? c->fast : 0; }

void mc_close(mc_client *c) {
    if (!c) return;
    if (c->session && c->sock && !c->closed) {
        msgpack_unpacked rep;
        mc_error e;
        if (do_call(c, "bye", 0, NULL, NULL, 1000, 1, &rep, NULL, &e) == MC_OK)
            msgpack_unpacked_destroy(&rep);
    }
    pthread_mutex_lock(&c->mu);
    c->closed = 1;
    pthread_cond_broadcast(&c->hb_cv);
    pthread_mutex_unlock(&c->mu);
    if (c->hb_started) pthread_join(c->hb, NULL);
    pthread_mutex_lock(&c->mu);
    fail_pending_locked(c, MC_ERR_CLOSED, "client closed");
    while (c->sock_busy) pthread_cond_wait(&c->cv, &c->mu);
    close_socket(c);
    pthread_mutex_lock(&c->pin_mu);
    if (c->cur) {
        mc_arena_unref_map(c->cur);
        c->cur = NULL;
    }
    pthread_mutex_unlock(&c->pin_mu);
    pthread_mutex_unlock(&c->mu);
    for (mc_arena_map *am = c->all, *nx; am; am = nx) {
        nx = am->client_next;
        atomic_store(&am->closed, 1);
        mc_arena_unref(am);
    }
    if (c->ctx) zmq_ctx_term(c->ctx);
    if (c->wakefd >= 0) close(c->wakefd);
    pthread_mutex_destroy(&c->mu);
    pthread_mutex_destroy(&c->pin_mu);
    pthread_cond_destroy(&c->cv);
    pthread_cond_destroy(&c->hb_cv);
    free(c->relq);
    free(c->endpoint);
    free(c->origin);
    free(c->model);
    free(c);
}

/* ------------------------------------------------------------------ calls */

int mc_ping(mc_client *c, double *rtt_us, mc_error *err) {
    double t = now_s();
    msgpack_unpacked rep;
    int r = do_call(c, "ping", 0, NULL, NULL, -1, 1, &rep, NULL, err);
    if (r != MC_OK) return r;
    msgpack_unpacked_destroy(&rep);
    if (rtt_us) *rtt_us = (now_s() - t) * 1e6;
    return MC_OK;
}

int mc_probe(const char *endpoint, int timeout_ms, double *rtt_us, uint64_t *session, mc_error *err) {
    if (!endpoint) endpoint = MC_DEFAULT_ENDPOINT;
    if (strncmp(endpoint, "ipc://", 6) != 0 && strncmp(endpoint, "tcp://", 6) != 0)
        return seterr(err, MC_ERR_INVALID_ARG, "endpoint %s: expected ipc://PATH (the daemon's socket, e.g. %s) or "
                      "tcp://HOST:PORT", endpoint, MC_DEFAULT_ENDPOINT);
    struct stat st;
    if (strncmp(endpoint, "ipc://", 6) == 0 && stat(endpoint + 6, &st) != 0 && errno == ENOENT)
        return seterr(err, MC_ERR_SYSTEM, "no daemon socket at %s: is moecached running? (systemctl status moecached)",
                      endpoint + 6);
    double t = now_s();
    void *ctx = zmq_ctx_new();
    void *s = ctx ? zmq_socket(ctx, ZMQ_DEALER) : NULL;
    int rc = MC_OK;
    if (!s) {
        rc = seterr(err, MC_ERR_SYSTEM, "zmq_ctx_new/zmq_socket: %s", zmq_strerror(zmq_errno()));
        goto out;
    }
    int linger = 0;   /* (100 ms once there is a bye to deliver) */
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_connect(s, endpoint) != 0) {
        rc = seterr(err, MC_ERR_SYSTEM, "connect %s: %s", endpoint, zmq_strerror(zmq_errno()));
        goto out;
    }
    msgpack_sbuffer sb;
    msgpack_packer pk;
    pk_request(&sb, &pk, 1, "ping", 0);
    int sent = zmq_send(s, sb.data, sb.size, ZMQ_DONTWAIT);
    msgpack_sbuffer_destroy(&sb);
    if (sent < 0) {
        rc = seterr(err, MC_ERR_SYSTEM, "send to %s: %s", endpoint, zmq_strerror(zmq_errno()));
        goto out;
    }
    zmq_pollitem_t it = {s, 0, ZMQ_POLLIN, 0};
    int n;
    for (;;) {   /* (a signal: wait out the rest) */
        int left = timeout_ms < 0 ? -1 : (int)(timeout_ms - (now_s() - t) * 1e3);
        n = zmq_poll(&it, 1, timeout_ms < 0 ? -1 : (left > 0 ? left : 0));
        if (n >= 0 || zmq_errno() != EINTR) break;
    }
    if (n <= 0) {
        rc = n == 0 ? seterr(err, MC_ERR_TIMEOUT, "no answer from the daemon at %s within %d ms: is moecached running? "
                             "(systemctl status moecached)", endpoint, timeout_ms)
                    : seterr(err, MC_ERR_SYSTEM, "poll %s: %s", endpoint, zmq_strerror(zmq_errno()));
        goto out;
    }
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, s, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&m);
        rc = seterr(err, MC_ERR_SYSTEM, "recv from %s: %s", endpoint, zmq_strerror(zmq_errno()));
        goto out;
    }
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    if (msgpack_unpack_next(&u, zmq_msg_data(&m), zmq_msg_size(&m), &off) != MSGPACK_UNPACK_SUCCESS ||
        u.data.type != MSGPACK_OBJECT_MAP) {
        rc = seterr(err, MC_ERR_PROTOCOL, "ping %s: the answer is not a msgpack map", endpoint);
    } else {
        const msgpack_object *okv = mget(&u.data, "ok");
        if (session && !muint(mget(&u.data, "session"), session)) *session = 0;
        if (!(okv && okv->type == MSGPACK_OBJECT_BOOLEAN && okv->via.boolean)) {
            const msgpack_object *e = mget(&u.data, "error");
            char code[32] = "";
            mstrcpy(mget(e, "code"), code, sizeof code);
            const msgpack_object *em = mget(e, "message");
            int has_m = em && em->type == MSGPACK_OBJECT_STR;
            rc = seterr(err, mc_code_from_daemon(code), "ping %s: %s: %.*s", endpoint, code,
                        has_m ? (int)em->via.str.size : 0, has_m ? em->via.str.ptr : "");
            if (err) snprintf(err->daemon_code, sizeof err->daemon_code, "%s", code);
        }
    }
    msgpack_unpacked_destroy(&u);
    zmq_msg_close(&m);
    if (rc == MC_OK) {
        if (rtt_us) *rtt_us = (now_s() - t) * 1e6;
        /* a little linger: the bye reaches the daemon, which then forgets this client */
        linger = 100;
        zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
        pk_request(&sb, &pk, 2, "bye", 0);
        zmq_send(s, sb.data, sb.size, ZMQ_DONTWAIT);
        msgpack_sbuffer_destroy(&sb);
    }
out:
    if (s) zmq_close(s);
    if (ctx) zmq_ctx_term(ctx);
    return rc;
}

char *mc_stats_text(mc_client *c, mc_error *err) {
    msgpack_unpacked rep;
    if (do_call(c, "stats", 0, NULL, NULL, -1, 1, &rep, NULL, err) != MC_OK) return NULL;
    const msgpack_object *s = mget(&rep.data, "stats");
    char *out = NULL;
    if (s) {
        size_t cap = 1 << 16;
        for (;;) {
            char *b = malloc(cap);
            if (!b) break;
            int n = msgpack_object_print_buffer(b, cap, *s);
            if (n >= 0 && (size_t)n < cap - 1) { out = b; break; }
            free(b);
            if (cap > (64u << 20)) break;
            cap *= 4;
        }
    }
    msgpack_unpacked_destroy(&rep);
    if (!out) seterr(err, MC_ERR_PROTOCOL, "stats: no 'stats' map in the reply");
    return out;
}

int mc_warm_wait(mc_client *c, int timeout_ms, uint64_t *pending, mc_error *err) {
    double t0 = now_s(), failing = 0;   /* since when the daemon has not answered (0: it has) */
    for (;;) {
        msgpack_unpacked rep;
        int r = do_call(c, "ping", 0, NULL, NULL, -1, 1, &rep, NULL, err);
        if (r == MC_ERR_RESTARTED || r == MC_ERR_SYSTEM || (r == MC_ERR_TIMEOUT && !failing)) {
            /* a daemon restarting mid-fill: the next ping says hello again, and a restarted
             * daemon refilling from its state file is waited for too; a daemon that stays away
             * longer than connect_timeout_ms (or past the wait) ends it with its error */
            double now = now_s();
            if (!failing) failing = now;
            int cto = c->opt.connect_timeout_ms > 0 ? c->opt.connect_timeout_ms : 10000;
            if ((now - failing) * 1000.0 < cto && (timeout_ms < 0 || (now - t0) * 1000.0 < timeout_ms)) {
                struct timespec ts = {0, 50 * 1000000L};
                nanosleep(&ts, NULL);
                continue;
            }
        }
        if (r != MC_OK) return r;
        failing = 0;
        const msgpack_object *p = mget(&rep.data, "warm_pending");
        uint64_t left = p && p->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? p->via.u64 : 0;
        msgpack_unpacked_destroy(&rep);
        if (pending) *pending = left;
        if (left == 0) { okerr(err); return MC_OK; }
        double waited_ms = (now_s() - t0) * 1000.0;
        if (timeout_ms >= 0 && waited_ms >= timeout_ms)
            return seterr(err, MC_ERR_TIMEOUT, "the daemon's warm fill still has %llu experts to load after "
                          "%d ms (mc_options.warm_wait_ms)", (unsigned long long)left, timeout_ms);
        struct timespec ts = {0, 20 * 1000000L};
        nanosleep(&ts, NULL);
    }
}

const mc_arena *mc_arena_get(mc_client *c, mc_error *err) {
    if (!c) { seterr(err, MC_ERR_INVALID_ARG, "client is NULL"); return NULL; }
    pthread_mutex_lock(&c->mu);
    const mc_arena *a = NULL;
    if (ensure_session_locked(c, err) == MC_OK && c->cur)
        a = &c->cur->pub;
    pthread_mutex_unlock(&c->mu);
    return a;
}

/* ------------------------------------------------------------------ leases */

typedef struct req_arg {
    const mc_request *reqs;
    uint32_t n;
    int flags;
    int timeout_ms;
    int noreply;
    const mc_subst *subst;
    const double *const *conf;   /* prefetch: confidence per expert, per request (or NULL) */
} req_arg;

static void fill_subst(msgpack_packer *pk, const req_arg *a) {
    const mc_subst *sb = a->subst;
    uint32_t n = 0;
    for (uint32_t i = 0; i < a->n; i++) n += sb->layers[i].scores != NULL;
    pk_str(pk, "subst");
    msgpack_pack_map(pk, 2 + (sb->cap >= 0));
    pk_str(pk, "r"); msgpack_pack_double(pk, sb->r);
    if (sb->cap >= 0) { pk_str(pk, "cap"); msgpack_pack_int(pk, sb->cap); }
    pk_str(pk, "layers");
    msgpack_pack_array(pk, n);
    for (uint32_t i = 0; i < a->n; i++) {
        const mc_subst_layer *sl = &sb->layers[i];
        if (!sl->scores) continue;
        msgpack_pack_array(pk, 3);
        msgpack_pack_int(pk, a->reqs[i].layer);
        msgpack_pack_array(pk, a->reqs[i].n);
        for (uint32_t j = 0; j < a->reqs[i].n; j++) msgpack_pack_double(pk, sl->scores[j]);
        msgpack_pack_array(pk, sl->n_cands);
        for (uint32_t j = 0; j < sl->n_cands; j++) {
            msgpack_pack_array(pk, 2);
            msgpack_pack_int(pk, sl->cands[j].expert);
            msgpack_pack_double(pk, sl->cands[j].score);
        }
    }
}

static void fill_requests(msgpack_packer *pk, void *p) {
    req_arg *a = p;
    if (a->n == 1) {
        pk_str(pk, "layer"); msgpack_pack_int(pk, a->reqs[0].layer);
        pk_str(pk, "experts");
        msgpack_pack_array(pk, a->reqs[0].n);
        for (uint32_t j = 0; j < a->reqs[0].n; j++) msgpack_pack_int(pk, a->reqs[0].experts[j]);
    } else {
        pk_str(pk, "layers");
        msgpack_pack_array(pk, a->n);
        for (uint32_t i = 0; i < a->n; i++) {
            msgpack_pack_array(pk, 2);
            msgpack_pack_int(pk, a->reqs[i].layer);
            msgpack_pack_array(pk, a->reqs[i].n);
            for (uint32_t j = 0; j < a->reqs[i].n; j++) msgpack_pack_int(pk, a->reqs[i].experts[j]);
        }
    }
    if (a->flags & (MC_ACQ_DECODE | MC_ACQ_PROMPT)) {
        pk_str(pk, "tag");
        pk_str(pk, (a->flags & MC_ACQ_DECODE) ? "decode" : "prompt");
    }
    if (a->timeout_ms >= 0) { pk_str(pk, "timeout_ms"); msgpack_pack_int(pk, a->timeout_ms); }
    if (a->noreply) { pk_str(pk, "noreply"); msgpack_pack_true(pk); }
    if (a->subst) fill_subst(pk, a);
    if (a->conf) {
        pk_str(pk, "conf");
        if (a->n != 1) msgpack_pack_array(pk, a->n);
        for (uint32_t i = 0; i < a->n; i++) {
            msgpack_pack_array(pk, a->reqs[i].n);
            for (uint32_t j = 0; j < a->reqs[i].n; j++) msgpack_pack_double(pk, a->conf[i][j]);
        }
    }
}

static int n_fields(const req_arg *a) {
    return 2 - (a->n != 1) + ((a->flags & (MC_ACQ_DECODE | MC_ACQ_PROMPT)) != 0) + (a->timeout_ms >= 0) +
           (a->noreply != 0) + (a->subst != NULL) + (a->conf != NULL);
}

static int check_requests(mc_client *c, const mc_request *reqs, uint32_t n, uint32_t *total, mc_error *err) {
    if (!c) return seterr(err, MC_ERR_INVALID_ARG, "client is NULL");
    if (!reqs || n == 0) return seterr(err, MC_ERR_INVALID_ARG, "no layers requested");
    uint64_t t = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (reqs[i].n && !reqs[i].experts)
            return seterr(err, MC_ERR_INVALID_ARG, "layer %d: experts is NULL", reqs[i].layer);
        t += reqs[i].n;
    }
    if (t == 0) return seterr(err, MC_ERR_INVALID_ARG, "no experts requested");
    if (c->max_request_experts && t > c->max_request_experts)
        return seterr(err, MC_ERR_INVALID_ARG, "request names %llu experts: the daemon accepts at most %u per "
                      "request (split it)", (unsigned long long)t, c->max_request_experts);
    *total = (uint32_t)t;
    return MC_OK;
}

static mc_lease *lease_new(uint32_t n) {
    mc_lease *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    l->items = calloc(n, sizeof(mc_item));
    l->mi = calloc(n, sizeof(mcshm_item));
    if (!l->items || !l->mi) { free(l->items); free(l->mi); free(l); return NULL; }
    l->n = n;
    return l;
}

static void lease_free(mc_lease *l) {
    free(l->subst);
    free(l->items);
    free(l->mi);
    free(l);
}

int mc__pin_lease(mc_arena_map *am, const mc_request *reqs, uint32_t n, mc_lease **out) {
    uint32_t total = 0;
    for (uint32_t i = 0; i < n; i++) total += reqs[i].n;
    if (!am->lay.pin || total == 0) return MCSHM_MISS;
    if (am->pin_quota) {   /* the daemon ignores pins past its quota: a lease on them could go invalid */
        uint64_t held = atomic_load(&am->fast_items);
        if (held > am->pin_quota || total > am->pin_quota - held) return MCSHM_MISS;
    }
    uint32_t kbuf[256];
    uint32_t *keys = total <= 256 ? kbuf : malloc(total * sizeof(uint32_t));
    if (!keys) return MCSHM_MISS;
    int s = MCSHM_MISS;
    mc_lease *l = NULL;
    uint32_t q = 0;
    for (uint32_t i = 0; i < n; i++) {
        int layer = reqs[i].layer;
        if (layer < 0 || layer > am->max_layer || am->layer_moe[layer] < 0) goto done;   /* the daemon says why */
        for (uint32_t j = 0; j < reqs[i].n; j++) {
            int e = reqs[i].experts[j];
            if (e < 0 || (uint32_t)e >= am->lay.n_experts) goto done;
            keys[q++] = (uint32_t)am->layer_moe[layer] * am->lay.n_experts + (uint32_t)e;
        }
    }
    l = lease_new(total);
    if (!l) goto done;
    s = mcshm_pin(&am->lay, keys, total, l->mi);
    if (s == MCSHM_OK) {
        atomic_fetch_add(&am->fast_items, total);
        atomic_fetch_add(&am->refs, 1);
        atomic_fetch_add(&am->maprefs, 1);
        l->am = am;
        l->session = am->session;
        l->fast = 1;
        q = 0;
        for (uint32_t i = 0; i < n; i++)
            for (uint32_t j = 0; j < reqs[i].n; j++, q++) {
                l->items[q].layer = reqs[i].layer;
                l->items[q].expert = reqs[i].experts[j];
                l->items[q].cls = l->mi[q].cls;
                l->items[q].slot = l->mi[q].slot;
            }
        *out = l;
        l = NULL;
    }
done:
    if (l) lease_free(l);
    if (keys != kbuf) free(keys);
    return s;
}

/* The shared-memory hit path: MC_OK with *out, MC_ERR_RESTARTED, or MC_ERR_D_OTHER meaning
 * "use the socket". */
static int try_fast(mc_client *c, const mc_request *reqs, uint32_t n, mc_lease **out, mc_error *err) {
    int r = MC_ERR_D_OTHER;
    uint64_t sess = 0;
    pthread_mutex_lock(&c->pin_mu);
    mc_arena_map *am = c->cur;
    if (am && am->lay.pin && !atomic_load(&am->voided)) {
        int s = mc__pin_lease(am, reqs, n, out);
        if (s == MCSHM_OK)
            r = MC_OK;
        else if (s == MCSHM_STALE && mcshm_epoch(&am->lay) != am->session) {
            r = MC_ERR_RESTARTED;
            sess = am->session;
        }
    }
    pthread_mutex_unlock(&c->pin_mu);
    if (r == MC_ERR_RESTARTED) {
        pthread_mutex_lock(&c->mu);
        if (c->session == sess) void_session_locked(c, "the daemon restarted (arena epoch changed)");
        pthread_mutex_unlock(&c->mu);
        seterr(err, MC_ERR_RESTARTED, "acquire: the daemon restarted (the arena's epoch is not the hello's session id); "
               "the next call says hello again");
    }
    return r;
}

static int lease_from_reply(mc_client *c, const msgpack_object *rep, uint64_t sess, const mc_request *reqs,
                            uint32_t n, uint32_t total, mc_lease **out, mc_error *err) {
    const msgpack_object *items = mget(rep, "items"), *gens = mget(rep, "gens");
    uint64_t lid = 0;
    if (!muint(mget(rep, "lease"), &lid))
        return seterr(err, MC_ERR_PROTOCOL, "acquire reply: no lease id");
    mc_lease *l = lease_new(total);
    if (!l) return seterr(err, MC_ERR_SYSTEM, "out of memory");
    l->id = lid;
    pthread_mutex_lock(&c->mu);
    mc_arena_map *am = c->cur;
    if (!am || c->session != sess || am->session != sess) {
        pthread_mutex_unlock(&c->mu);
        lease_free(l);
        return seterr(err, MC_ERR_RESTARTED, "acquire: the daemon restarted");
    }
    if (!items || items->type != MSGPACK_OBJECT_ARRAY || items->via.array.size != total || !gens ||
        gens->type != MSGPACK_OBJECT_ARRAY || gens->via.array.size != total) {
        send_release_locked(c, &lid, 1);   /* give back what we cannot use */
        pthread_mutex_unlock(&c->mu);
        lease_free(l);
        return seterr(err, MC_ERR_PROTOCOL, "acquire reply: items/gens missing or not one per requested expert");
    }
    atomic_fetch_add(&am->refs, 1);
    atomic_fetch_add(&am->maprefs, 1);
    pthread_mutex_unlock(&c->mu);
    l->am = am;
    l->c = c;
    l->session = sess;
    uint64_t v;
    muint(mget(rep, "hits"), &v) ? (void)(l->hits = (uint32_t)v) : (void)0;
    muint(mget(rep, "prefetch_hits"), &v) ? (void)(l->prefetch_hits = (uint32_t)v) : (void)0;
    muint(mget(rep, "misses"), &v) ? (void)(l->misses = (uint32_t)v) : (void)0;
    muint(mget(rep, "stall_us"), &v) ? (void)(l->stall_us = v) : (void)0;
    const msgpack_object *sw = mget(rep, "subst");
    if (sw && sw->type == MSGPACK_OBJECT_ARRAY && sw->via.array.size > 0) {
        uint32_t ns = sw->via.array.size;
        l->subst = ns <= total ? calloc(3 * (size_t)ns, sizeof(int32_t)) : NULL;
        for (uint32_t k = 0; l->subst && k < ns; k++) {
            const msgpack_object *t = &sw->via.array.ptr[k];
            int64_t x[3];
            if (t->type != MSGPACK_OBJECT_ARRAY || t->via.array.size != 3 || !mint(&t->via.array.ptr[0], &x[0]) ||
                !mint(&t->via.array.ptr[1], &x[1]) || !mint(&t->via.array.ptr[2], &x[2])) {
                free(l->subst);
                l->subst = NULL;
                break;
            }
            for (int m = 0; m < 3; m++) l->subst[3 * k + m] = (int32_t)x[m];
        }
        if (!l->subst) {
            mc_release(l);
            return seterr(err, MC_ERR_PROTOCOL, "acquire reply: 'subst' is not a list of [layer, missing, "
                          "substitute] (at most one per requested expert)");
        }
        l->n_subst = ns;
    }
    uint32_t q = 0;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t j = 0; j < reqs[i].n; j++, q++) {
            const msgpack_object *it = &items->via.array.ptr[q];
            int64_t ly, ex, cl, sl, want = reqs[i].experts[j];
            uint64_t g;
            for (uint32_t k = 0; k < l->n_subst; k++)   /* a substitute in the missing one's place */
                if (l->subst[3 * k] == reqs[i].layer && l->subst[3 * k + 1] == want) want = l->subst[3 * k + 2];
            if (it->type != MSGPACK_OBJECT_ARRAY || it->via.array.size != 4 || !mint(&it->via.array.ptr[0], &ly) ||
                !mint(&it->via.array.ptr[1], &ex) || !mint(&it->via.array.ptr[2], &cl) ||
                !mint(&it->via.array.ptr[3], &sl) || !muint(&gens->via.array.ptr[q], &g) ||
                ly != reqs[i].layer || ex != want || cl < 0 || (uint64_t)cl >= am->lay.n_classes ||
                sl < 0 || (uint64_t)sl >= am->lay.n_slots[cl]) {
                mc_release(l);
                return seterr(err, MC_ERR_PROTOCOL, "acquire reply: item %u is not (layer %d, expert %d, class, "
                              "slot) inside the arena", q, reqs[i].layer, reqs[i].experts[j]);
            }
            l->items[q] = (mc_item){(int32_t)ly, (int32_t)ex, (uint32_t)cl, (uint32_t)sl};
            l->mi[q] = (mcshm_item){(uint32_t)cl, (uint32_t)sl, g};
        }
    *out = l;
    return okerr(err);
}

int mc_acquire_subst(mc_client *c, const mc_request *reqs, uint32_t n, const mc_subst *subst, int flags,
                     int timeout_ms, mc_lease **out, mc_error *err) {
    uint32_t total;
    if (!out) return seterr(err, MC_ERR_INVALID_ARG, "acquire: out is NULL");
    *out = NULL;
    int r = check_requests(c, reqs, n, &total, err);
    if (r != MC_OK) return r;
    if (subst) {
        if (!(subst->r >= 0.0 && subst->r <= 1.0))
            return seterr(err, MC_ERR_INVALID_ARG, "acquire: subst r = %g, expected 0 <= r <= 1", subst->r);
        if (subst->cap < -1)
            return seterr(err, MC_ERR_INVALID_ARG, "acquire: subst cap = %d, expected >= 0 or -1 (no cap)",
                          subst->cap);
        if (!subst->layers) return seterr(err, MC_ERR_INVALID_ARG, "acquire: subst layers is NULL");
        for (uint32_t i = 0; i < n; i++)
            if (subst->layers[i].scores && subst->layers[i].n_cands && !subst->layers[i].cands)
                return seterr(err, MC_ERR_INVALID_ARG, "acquire: subst layer %u: cands is NULL", i);
    }
    if (!(flags & MC_ACQ_NO_FAST) && c->fast) {
        r = try_fast(c, reqs, n, out, err);
        if (r == MC_OK) return okerr(err);
        if (r == MC_ERR_RESTARTED) return r;
    }
    req_arg a = {reqs, n, flags, timeout_ms, 0, subst, NULL};
    msgpack_unpacked rep;
    uint64_t sess = 0;
    /* the client waits a little longer than the daemon's own timeout, so the daemon's answer wins */
    int wait_ms = timeout_ms >= 0 ? timeout_ms + 1000 : -1;
    r = do_call(c, "acquire", n_fields(&a), fill_requests, &a, wait_ms, 1, &rep, &sess, err);
    if (r != MC_OK) return r;
    r = lease_from_reply(c, &rep.data, sess, reqs, n, total, out, err);
    msgpack_unpacked_destroy(&rep);
    return r;
}

int mc_acquire_many(mc_client *c, const mc_request *reqs, uint32_t n, int flags, int timeout_ms, mc_lease **out,
                    mc_error *err) {
    return mc_acquire_subst(c, reqs, n, NULL, flags, timeout_ms, out, err);
}

uint32_t mc_lease_n_subst(const mc_lease *l) { return l ? l->n_subst : 0; }

int mc_lease_subst(const mc_lease *l, uint32_t i, int *layer, int *missing, int *substitute) {
    if (!l || i >= l->n_subst) return 0;
    if (layer) *layer = l->subst[3 * i];
    if (missing) *missing = l->subst[3 * i + 1];
    if (substitute) *substitute = l->subst[3 * i + 2];
    return 1;
}

int mc_acquire(mc_client *c, int layer, const int *experts, uint32_t n, int flags, int timeout_ms, mc_lease **out,
               mc_error *err) {
    mc_request r = {layer, experts, n};
    return mc_acquire_many(c, &r, 1, flags, timeout_ms, out, err);
}

int mc_prefetch_conf(mc_client *c, const mc_request *reqs, uint32_t n, const double *const *conf,
                     mc_error *err) {
    uint32_t total;
    int r = check_requests(c, reqs, n, &total, err);
    if (r != MC_OK) return r;
    if (conf)
        for (uint32_t i = 0; i < n; i++) {
            if (reqs[i].n && !conf[i])
                return seterr(err, MC_ERR_INVALID_ARG, "prefetch: conf of layer %d is NULL", reqs[i].layer);
            for (uint32_t j = 0; j < reqs[i].n; j++)
                if (!(conf[i][j] >= 0.0 && conf[i][j] <= 1.0))
                    return seterr(err, MC_ERR_INVALID_ARG, "prefetch: conf of layer %d expert %d = %g, "
                                  "expected a number in [0, 1]", reqs[i].layer, reqs[i].experts[j], conf[i][j]);
        }
    req_arg a = {reqs, n, 0, -1, 1, NULL, conf};
    return do_call(c, "prefetch", n_fields(&a), fill_requests, &a, -1, 0, NULL, NULL, err);
}

int mc_prefetch_many(mc_client *c, const mc_request *reqs, uint32_t n, mc_error *err) {
    return mc_prefetch_conf(c, reqs, n, NULL, err);
}

int mc_prefetch(mc_client *c, int layer, const int *experts, uint32_t n, mc_error *err) {
    mc_request r = {layer, experts, n};
    return mc_prefetch_many(c, &r, 1, err);
}

uint32_t mc_lease_n(const mc_lease *l) { return l ? l->n : 0; }
const mc_item *mc_lease_items(const mc_lease *l) { return l ? l->items : NULL; }
uint32_t mc_lease_slot(const mc_lease *l, uint32_t i) { return l && i < l->n ? l->items[i].slot : UINT32_MAX; }
int mc_lease_fast(const mc_lease *l) { return l ? l->fast : 0; }

uint32_t mc_lease_slots(const mc_lease *l, uint32_t *out, uint32_t cap) {
    uint32_t n = l ? l->n : 0;
    for (uint32_t i = 0; i < n && i < cap; i++) out[i] = l->items[i].slot;
    return n;
}

void mc_lease_counts(const mc_lease *l, uint32_t *hits, uint32_t *prefetch_hits, uint32_t *misses,
                     uint64_t *stall_us) {
    if (hits) *hits = l ? (l->fast ? l->n : l->hits) : 0;
    if (prefetch_hits) *prefetch_hits = l ? l->prefetch_hits : 0;
    if (misses) *misses = l ? l->misses : 0;
    if (stall_us) *stall_us = l ? l->stall_us : 0;
}

int mc_lease_valid(const mc_lease *l) {
    if (!l || !l->am || atomic_load_explicit(&l->am->voided, memory_order_acquire))
        return 0;
    return mcshm_valid(&l->am->lay, l->session, l->mi, l->n);
}

/* keys of `layer`'s experts in am (false for a layer or expert out of range) */
static int peek_keys(const mc_arena_map *am, int layer, const int *experts, uint32_t n, uint32_t *keys) {
    if (layer < 0 || layer > am->max_layer || am->layer_moe[layer] < 0) return 0;
    for (uint32_t j = 0; j < n; j++) {
        if (experts[j] < 0 || (uint32_t)experts[j] >= am->lay.n_experts) return 0;
        keys[j] = (uint32_t)am->layer_moe[layer] * am->lay.n_experts + (uint32_t)experts[j];
    }
    return 1;
}

uint32_t mc__peek(mc_arena_map *am, int layer, const int *experts, uint32_t n, mc_peek_item *out) {
    for (uint32_t i = 0; i < n; i++) {
        out[i].session = 0;
        out[i].gen = 0;
        out[i].cls = 0;
        out[i].slot = UINT32_MAX;
    }
    if (!am || !am->has_resmap || atomic_load(&am->voided) || !experts || n == 0) return 0;
    uint32_t kbuf[256];
    uint32_t *keys = n <= 256 ? kbuf : malloc(n * sizeof(uint32_t));
    mcshm_item ibuf[64];
    mcshm_item *mi = n <= 64 ? ibuf : malloc(n * sizeof(mcshm_item));
    uint32_t found = 0;
    if (keys && mi && peek_keys(am, layer, experts, n, keys)) {
        found = mcshm_peek(&am->lay, keys, n, mi);
        for (uint32_t i = 0; found && i < n; i++) {
            if (mi[i].slot == UINT32_MAX) continue;
            out[i].session = am->session;
            out[i].gen = mi[i].gen;
            out[i].cls = mi[i].cls;
            out[i].slot = mi[i].slot;
        }
    }
    if (keys != kbuf) free(keys);
    if (mi != ibuf) free(mi);
    return found;
}

int mc__peek_valid(mc_arena_map *am, const mc_peek_item *it) {
    if (!am || !it || it->slot == UINT32_MAX || it->session == 0 || am->session != it->session || atomic_load(&am->voided))
        return 0;
    mcshm_item m = {it->cls, it->slot, it->gen};
    return mcshm_valid(&am->lay, it->session, &m, 1);
}

int mc__note_hits(mc_arena_map *am, int layer, const int *experts, uint32_t n) {
    uint32_t keys[256];
    if (!am || !am->lay.pin || atomic_load(&am->voided) || !experts || n == 0 || n > 256 || !peek_keys(am, layer, experts, n, keys))
        return 0;
    return mcshm_note_hits(&am->lay, keys, n);
}

uint64_t mc__arena_releases(mc_arena_map *am, uint64_t session) {
    if (!am || atomic_load(&am->voided) || am->session != session) return 0;
    return atomic_load_explicit(&am->lay.ctl[MCSHM_CTL_W_RELEASES], memory_order_acquire);
}

uint64_t mc_arena_releases(mc_client *c, uint64_t session) {
    if (!c) return 0;
    pthread_mutex_lock(&c->pin_mu);
    uint64_t r = mc__arena_releases(c->cur, session);
    pthread_mutex_unlock(&c->pin_mu);
    return r;
}

uint32_t mc_peek(mc_client *c, int layer, const int *experts, uint32_t n, mc_peek_item *out) {
    if (!c || !out) return 0;
    pthread_mutex_lock(&c->pin_mu);
    uint32_t found = mc__peek(c->cur, layer, experts, n, out);
    pthread_mutex_unlock(&c->pin_mu);
    return found;
}

int mc_peek_valid(mc_client *c, const mc_peek_item *it) {
    if (!c) return 0;
    pthread_mutex_lock(&c->pin_mu);
    int ok = mc__peek_valid(c->cur, it);
    pthread_mutex_unlock(&c->pin_mu);
    return ok;
}

int mc_note_hits(mc_client *c, int layer, const int *experts, uint32_t n) {
    if (!c) return 0;
    pthread_mutex_lock(&c->pin_mu);
    int ok = mc__note_hits(c->cur, layer, experts, n);
    pthread_mutex_unlock(&c->pin_mu);
    return ok;
}

const void *mc_lease_part(const mc_lease *l, uint32_t idx, const char *part, uint64_t *bytes) {
    if (bytes) *bytes = 0;
    if (!l || idx >= l->n || !part || !mc_lease_valid(l)) return NULL;
    const mc_class *k = &l->am->classes[l->items[idx].cls];
    for (uint32_t p = 0; p < k->n_parts; p++)
        if (strcmp(k->parts[p].name, part) == 0) {
            if (bytes) *bytes = k->parts[p].part_bytes;
            return (const char *)l->am->base + k->parts[p].part_off + (uint64_t)l->items[idx].slot * k->parts[p].part_bytes;
        }
    return NULL;
}

void mc_release(mc_lease *l) {
    if (!l) return;
    mc_arena_map *am = l->am;
    if (am) {
        if (l->fast) {
            mcshm_unpin(&am->lay, l->mi, l->n);   /* lock-free; harmless on a gone daemon's pin file */
            atomic_fetch_sub(&am->fast_items, l->n);
        } else if (l->c && !atomic_load(&am->closed) && !atomic_load(&am->voided)) {
            mc_client *c = l->c;
            pthread_mutex_lock(&c->mu);
            if (c->session == l->session && c->sock) {
                if (!c->sock_busy) {
                    send_release_locked(c, &l->id, 1);
                } else {
                    if (c->relq_n == c->relq_cap) {
                        uint32_t cap = c->relq_cap ? 2 * c->relq_cap : 64;
                        uint64_t *q = realloc(c->relq, cap * sizeof(uint64_t));
                        if (q) { c->relq = q; c->relq_cap = cap; }
                    }
                    if (c->relq_n < c->relq_cap) c->relq[c->relq_n++] = l->id;
                    wake_reader(c);
                }
            }
            pthread_mutex_unlock(&c->mu);
        }
        mc_arena_unref_map(am);
        mc_arena_unref(am);
    }
    lease_free(l);
}
