/* The library against a real moecached: spawned by this test (python -m moecached.daemon),
 * every byte of every leased expert compared with the model file.
 *
 * Environment (set by tests/run_daemon_tests.py): MC_PYTHON, MC_MODEL, MC_EXPECT (see
 * dump_expect.py), MC_DIR (a scratch directory for sockets and logs). */
#define _GNU_SOURCE
#include "moecache.h"
#include "../examples/expect.h"
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int g_failures;
#define CHECK(cond, ...) do { if (!(cond)) { g_failures++; fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
    fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); } } while (0)
#define REQUIRE(cond, ...) do { if (!(cond)) { fprintf(stderr, "FATAL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
    fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); stop_all(); exit(1); } } while (0)

static const char *PY, *MODEL, *DIR_;
static ex_table *EX;
static pthread_mutex_t ex_mu = PTHREAD_MUTEX_INITIALIZER;
static char SOCK[512], ENDPOINT[600];
static pid_t daemon_pid;

static void stop_daemon(int sig) {
    if (daemon_pid > 0) {
        kill(daemon_pid, sig);
        int st;
        waitpid(daemon_pid, &st, 0);
        daemon_pid = 0;
    }
}
static void stop_all(void) { stop_daemon(SIGTERM); }

static double clock_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Start a daemon on SOCK; returns once the socket file exists (clients then wait in hello). */
static void start_daemon(const char *slots, const char *heartbeat) {
    char log[600];
    snprintf(log, sizeof log, "%s/daemon.log", DIR_);
    fflush(stdout);
    fflush(stderr);
    pid_t p = fork();
    REQUIRE(p >= 0, "fork: %s", strerror(errno));
    if (p == 0) {
        FILE *f = freopen(log, "a", stdout);
        (void)f;
        dup2(1, 2);
        execlp(PY, PY, "-P", "-m", "moecached.daemon", "--model", MODEL, "--endpoint", ENDPOINT,
               "--no-lock-memory", "--slots", slots, "--heartbeat", heartbeat,
               "--prefetch-min-confidence", "0.5", (char *)NULL);
        _exit(127);
    }
    daemon_pid = p;
    for (int i = 0; i < 600; i++) {
        struct stat st;
        int status;
        if (waitpid(p, &status, WNOHANG) == p) {
            daemon_pid = 0;
            REQUIRE(0, "daemon exited at start (see %s)", log);
        }
        if (stat(SOCK, &st) == 0) return;
        sleep_ms(50);
    }
    REQUIRE(0, "daemon socket %s did not appear (see %s)", SOCK, log);
}

static mc_client *connect_client(const char *name, int send_pid, int hb_thread) {
    mc_options o;
    mc_options_init(&o);
    o.connect_timeout_ms = 30000;
    o.send_pid = send_pid;
    o.heartbeat_thread = hb_thread;
    mc_error e;
    mc_client *c = mc_connect(ENDPOINT, name, &o, &e);
    REQUIRE(c, "connect: %s", e.message);
    return c;
}

/* Every part of every item equals the model file's bytes. Returns the number of wrong parts. */
static int verify_lease(mc_client *c, const mc_lease *l) {
    const mc_arena *a = mc_arena_get(c, NULL);
    int bad = 0;
    const mc_item *it = mc_lease_items(l);
    for (uint32_t i = 0; i < mc_lease_n(l); i++) {
        const mc_class *k = &a->classes[it[i].cls];
        for (uint32_t p = 0; p < k->n_parts; p++) {
            uint64_t nb;
            const void *b = mc_lease_part(l, i, k->parts[p].name, &nb);
            pthread_mutex_lock(&ex_mu);
            int ok = b && ex_check(EX, it[i].layer, it[i].expert, k->parts[p].name, b, nb);
            pthread_mutex_unlock(&ex_mu);
            if (!ok) {
                fprintf(stderr, "wrong bytes: layer %d expert %d part %s slot %u\n", it[i].layer, it[i].expert,
                        k->parts[p].name, it[i].slot);
                bad++;
            }
        }
    }
    if (!mc_lease_valid(l)) bad++;
    return bad;
}

/* Rss (KiB) of the mapping that starts at base, from /proc/self/smaps: the pages whose page
 * table entries this process holds; -1 when no mapping starts there. */
static long mapped_kib(const void *base) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return -1;
    char line[512], head[32];
    snprintf(head, sizeof head, "%lx-", (unsigned long)(uintptr_t)base);
    long kib = -1;
    int in = 0;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, head, strlen(head)) == 0) in = 1;
        else if (in && sscanf(line, "Rss: %ld kB", &kib) == 1) break;
    }
    fclose(f);
    return in ? kib : -1;
}

/* The bytes of the experts the arena holds now (peeked), the control block's included. */
static uint64_t resident_bytes(mc_client *c, const mc_arena *a) {
    uint64_t b = 0, ctl = a->size;
    for (uint32_t m = 0; m < a->n_expert_layers; m++) {
        const mc_class *k = &a->classes[mc_layer_class(a, a->expert_layers[m])];
        for (int e = 0; e < (int)a->n_experts; e++) {
            mc_peek_item it;
            if (mc_peek(c, a->expert_layers[m], &e, 1, &it) == 1 && it.slot != UINT32_MAX)
                b += k->slot_bytes;
        }
        for (uint32_t p = 0; p < k->n_parts; p++)
            ctl = k->parts[p].part_off < ctl ? k->parts[p].part_off : ctl;
    }
    return b + ctl;
}

/* The page tables of what the arena holds filled at connect (populate, the default), or not. */
static void test_populate(void) {
    mc_client *c[2];
    long kib[2];
    uint64_t size = 0, held = 0;
    for (int j = 0; j < 2; j++) {   /* the lazy one first: what the arena holds before the populated connect */
        const int i = 1 - j;
        mc_options o;
        mc_options_init(&o);
        o.connect_timeout_ms = 30000;
        CHECK(o.populate == 1, "populate is on by default");
        o.populate = i == 0;
        mc_error e;
        c[i] = mc_connect(ENDPOINT, i ? "c-lazy" : "c-populated", &o, &e);
        REQUIRE(c[i], "connect: %s", e.message);
        const mc_arena *a = mc_arena_get(c[i], &e);
        REQUIRE(a, "arena: %s", e.message);
        size = a->size;
        kib[i] = mapped_kib(a->base);
        if (i == 1)   /* (reads landing later only add experts the populated connect may fill) */
            held = resident_bytes(c[i], a);
    }
    CHECK(held > (uint64_t)size / 4, "the earlier tests left experts in the arena (%llu of %llu bytes)",
          (unsigned long long)held, (unsigned long long)size);
    CHECK(kib[0] * 1024 >= (long)held * 9 / 10, "populated: %ld KiB mapped, %llu bytes held", kib[0], (unsigned long long)held);
    CHECK(kib[1] >= 0 && kib[1] * 1024 < (long)size / 2, "not populated: %ld KiB of %llu mapped", kib[1],
          (unsigned long long)size);
    mc_close(c[0]);
    mc_close(c[1]);
}

static void test_basic(mc_client *c) {
    mc_error e;
    const mc_arena *a = mc_arena_get(c, &e);
    REQUIRE(a, "arena: %s", e.message);
    CHECK(a->n_experts == 8 && a->n_expert_layers == 4 && a->expert_layers[0] == 0, "model shape");
    CHECK(a->n_classes == 1 && a->classes[0].n_parts == 3 && strcmp(a->classes[0].parts[0].name, "gate") == 0 &&
          strcmp(a->classes[0].parts[0].type, "Q4_K") == 0, "class parts");
    CHECK(mc_layer_class(a, 2) == 0 && mc_layer_class(a, 7) == -1, "layer class map");
    CHECK(a->session == mc_session(c) && a->session != 0, "session");
    CHECK(mc_watched(c) == 1, "a local client with pid/pid_start is watched");
    /* the model file: the daemon's, as indexed, against the one an engine would load */
    mc_file_id mine, other;
    REQUIRE(mc_file_id_of(MODEL, &mine, &e) == MC_OK, "file id: %s", e.message);
    CHECK(a->n_model_files == 1 && a->model_files[0].size == mine.size && a->model_files[0].ino == mine.ino &&
          a->model_files[0].path && strstr(a->model_files[0].path, ".gguf"), "model_files of the hello");
    CHECK(mc_check_model_file(a, 0, &mine, MODEL, &e) == MC_OK, "the same file: %s", e.message);
    other = mine;
    other.mtime_ns += 1;   /* another file of the same size (a fine-tune of the same shape) */
    CHECK(mc_check_model_file(a, 0, &other, "/x/other.gguf", &e) == MC_ERR_OTHER_MODEL &&
          strstr(e.message, "/x/other.gguf") && strstr(e.message, a->model_files[0].path) &&
          strstr(e.message, "the same file, rewritten on disk"), "another mtime is another file: %s", e.message);
    other.ino += 1;
    CHECK(mc_check_model_file(a, 0, &other, NULL, &e) == MC_ERR_OTHER_MODEL && !strstr(e.message, "the same file, rewritten on disk"),
          "another file: %s", e.message);
    {   /* a long path: both files still named (the engine's by its end), each with its own size and times, and the fix */
        char longp[700] = "/x";
        while (strlen(longp) < 600)
            strcat(longp, "/modèles");
        strcat(longp, "/mine.gguf");
        CHECK(mc_check_model_file(a, 0, &other, longp, &e) == MC_ERR_OTHER_MODEL && strstr(e.message, a->model_files[0].path) &&
              strstr(e.message, "this engine loaded ...") && strstr(e.message, "/modèles/mine.gguf (") &&
              strstr(e.message, "(cp -p)") && strlen(e.message) < sizeof e.message, "a long path: %s", e.message);
    }
    CHECK(mc_check_model_file(a, 1, &mine, MODEL, &e) == MC_ERR_OTHER_MODEL, "no second file: %s", e.message);
    CHECK(strcmp(mc_code_name(MC_ERR_OTHER_MODEL), "MC_ERR_OTHER_MODEL") == 0, "code name");
    double rtt;
    CHECK(mc_ping(c, &rtt, &e) == MC_OK && rtt > 0, "ping: %s", e.message);

    int ex[] = {3, 0, 5};
    mc_lease *l;
    int r = mc_acquire(c, 1, ex, 3, MC_ACQ_DECODE, -1, &l, &e);
    REQUIRE(r == MC_OK, "acquire: %s", e.message);
    uint32_t hits, ph, misses;
    uint64_t stall;
    mc_lease_counts(l, &hits, &ph, &misses, &stall);
    CHECK(misses == 3 && hits == 0 && !mc_lease_fast(l), "first acquire misses (hits %u misses %u)", hits, misses);
    const mc_item *it = mc_lease_items(l);
    CHECK(it[0].expert == 3 && it[1].expert == 0 && it[2].expert == 5 && it[0].layer == 1, "request order");
    CHECK(verify_lease(c, l) == 0, "bytes of the first lease");
    mc_release(l);
    r = mc_acquire(c, 1, ex, 3, 0, -1, &l, &e);
    REQUIRE(r == MC_OK, "acquire again: %s", e.message);
    mc_lease_counts(l, &hits, &ph, &misses, &stall);
    CHECK(misses == 0 && (hits == 3), "second acquire hits (hits %u misses %u fast %d)", hits, misses, mc_lease_fast(l));
    CHECK(verify_lease(c, l) == 0, "bytes of the second lease");
    mc_release(l);

    int ex0[] = {1, 2}, ex3[] = {7, 6, 4};
    mc_request rq[2] = {{0, ex0, 2}, {3, ex3, 3}};
    r = mc_acquire_many(c, rq, 2, MC_ACQ_PROMPT, 20000, &l, &e);
    REQUIRE(r == MC_OK, "acquire_many: %s", e.message);
    CHECK(mc_lease_n(l) == 5 && mc_lease_items(l)[2].layer == 3 && mc_lease_items(l)[2].expert == 7, "many items");
    CHECK(verify_lease(c, l) == 0, "bytes of a two-layer lease");
    mc_release(l);

    int pf[] = {6, 7};
    CHECK(mc_prefetch(c, 2, pf, 2, &e) == MC_OK, "prefetch: %s", e.message);
    r = mc_acquire(c, 2, pf, 2, 0, -1, &l, &e);
    REQUIRE(r == MC_OK, "acquire after prefetch: %s", e.message);
    mc_lease_counts(l, &hits, &ph, &misses, &stall);
    CHECK(hits + ph + misses == 2, "counts add up (hits %u prefetch_hits %u misses %u)", hits, ph, misses);
    CHECK(verify_lease(c, l) == 0, "bytes after prefetch");
    mc_release(l);

    char *s = mc_stats_text(c, &e);
    CHECK(s && strstr(s, "hits"), "stats: %s", s ? "no hits counter" : e.message);
    free(s);
}

static void test_errors(mc_client *c) {
    mc_error e;
    mc_lease *l = NULL;
    int bad[] = {8};
    CHECK(mc_acquire(c, 1, bad, 1, 0, -1, &l, &e) == MC_ERR_D_OUT_OF_RANGE && !l, "expert 8: %s", e.message);
    CHECK(strcmp(e.daemon_code, "out_of_range") == 0 && strlen(e.message) > 10, "code string and message");
    int one[] = {0};
    CHECK(mc_acquire(c, 77, one, 1, 0, -1, &l, &e) == MC_ERR_D_OUT_OF_RANGE, "layer 77: %s", e.message);
    int dup[] = {2, 2};
    CHECK(mc_acquire(c, 1, dup, 2, 0, -1, &l, &e) == MC_ERR_D_BAD_TYPE, "repeated expert: %s", e.message);
    CHECK(mc_acquire(c, 1, NULL, 0, 0, -1, &l, &e) == MC_ERR_INVALID_ARG, "no experts: %s", e.message);
    CHECK(mc_prefetch(c, 1, bad, 1, &e) == MC_OK, "a bad noreply prefetch is only sent");
    double rtt;
    CHECK(mc_ping(c, &rtt, &e) == MC_OK, "the client still works after an error reply to a noreply request");
    CHECK(mc_code_from_daemon("rate_limited") == MC_ERR_D_RATE_LIMITED &&
          mc_code_from_daemon("model_changed") == MC_ERR_D_MODEL_CHANGED &&
          mc_code_from_daemon("whatever") == MC_ERR_D_OTHER, "code map");
}

static _Atomic int thread_bad, thread_ok;

static void *worker(void *arg) {
    mc_client *c = arg;
    unsigned s = (unsigned)(uintptr_t)pthread_self();
    for (int i = 0; i < 60; i++) {
        int n = 1 + rand_r(&s) % 4, ex[4];
        for (int j = 0; j < n; j++) {
        again:
            ex[j] = rand_r(&s) % 8;
            for (int q = 0; q < j; q++) if (ex[q] == ex[j]) goto again;
        }
        mc_lease *l;
        mc_error e;
        int layer = rand_r(&s) % 4;
        if (mc_acquire(c, layer, ex, (uint32_t)n, 0, -1, &l, &e) != MC_OK) {
            fprintf(stderr, "thread acquire: %s\n", e.message);
            thread_bad++;
            continue;
        }
        if (verify_lease(c, l)) thread_bad++; else thread_ok++;
        mc_release(l);
    }
    return NULL;
}

static void test_threads(mc_client *c) {
    pthread_t t[4];
    for (int i = 0; i < 4; i++) pthread_create(&t[i], NULL, worker, c);
    for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
    CHECK(thread_bad == 0 && thread_ok == 240, "threads: %d ok, %d bad", (int)thread_ok, (int)thread_bad);
}

static void test_fast(mc_client *c) {
    if (!mc_fast_path(c)) {
        printf("test_daemon: the daemon offers no pin file (hello 'pins' is null): fast path not tested here\n");
        return;
    }
    int ex[] = {4, 1};
    mc_lease *l;
    mc_error e;
    REQUIRE(mc_acquire(c, 2, ex, 2, 0, -1, &l, &e) == MC_OK, "acquire: %s", e.message);
    mc_release(l);
    REQUIRE(mc_acquire(c, 2, ex, 2, 0, -1, &l, &e) == MC_OK, "acquire: %s", e.message);
    CHECK(mc_lease_fast(l), "a resident set is pinned without a message");
    CHECK(verify_lease(c, l) == 0, "fast-path bytes");
    mc_release(l);
    REQUIRE(mc_acquire(c, 2, ex, 2, MC_ACQ_NO_FAST, -1, &l, &e) == MC_OK, "acquire: %s", e.message);
    CHECK(!mc_lease_fast(l), "MC_ACQ_NO_FAST takes the socket");
    mc_release(l);
}

/* leases_held in the daemon's stats (text form: "leases_held"=>N) */
static long leases_held(mc_client *c) {
    char *s = mc_stats_text(c, NULL);
    long v = -1;
    char *p = s ? strstr(s, "\"leases_held\"=>") : NULL;
    if (p) v = strtol(p + strlen("\"leases_held\"=>"), NULL, 10);
    free(s);
    return v;
}

/* An unwatched client (no pid) keeps its lease through silence only with its heartbeat. The
 * daemon runs with --heartbeat 1. */
static void test_heartbeat(mc_client *watcher) {
    int ex[] = {0};
    mc_error e;
    for (int hb = 1; hb >= 0; hb--) {
        mc_client *c = connect_client(hb ? "unwatched-hb" : "unwatched-silent", 0, hb);
        CHECK(!mc_watched(c), "no pid: not watched");
        mc_lease *l;
        REQUIRE(mc_acquire(c, 0, ex, 1, 0, -1, &l, &e) == MC_OK, "acquire: %s", e.message);
        CHECK(leases_held(watcher) == 1, "one lease held");
        sleep_ms(2500);   /* > heartbeat_s (1 s) of silence from the engine */
        long held = leases_held(watcher);
        if (hb) CHECK(held == 1, "with the heartbeat thread the lease is kept (held %ld)", held);
        else CHECK(held == 0, "without heartbeat or mc_tick the daemon drops the silent client (held %ld)", held);
        mc_release(l);
        mc_close(c);
    }
}

static void test_restart(mc_client *c) {
    int ex[] = {2, 3};
    mc_lease *l;
    mc_error e;
    REQUIRE(mc_acquire(c, 3, ex, 2, 0, -1, &l, &e) == MC_OK, "acquire: %s", e.message);
    uint64_t s1 = mc_session(c);
    CHECK(mc_lease_valid(l), "valid before the stop");
    stop_daemon(SIGTERM);
    CHECK(!mc_lease_valid(l), "a clean stop clears the epoch: the lease reads invalid");
    CHECK(mc_lease_part(l, 0, "gate", NULL) == NULL, "no views after the stop");
    start_daemon("24", "1");
    mc_lease *l2 = NULL;
    int r = mc_acquire(c, 3, ex, 2, 0, -1, &l2, &e);
    if (r == MC_ERR_RESTARTED) {   /* the call that noticed the restart fails; the next says hello */
        r = mc_acquire(c, 3, ex, 2, 0, -1, &l2, &e);
    }
    REQUIRE(r == MC_OK, "acquire after the restart: %s (%s)", e.message, mc_code_name(r));
    CHECK(mc_session(c) != s1 && mc_session(c) != 0, "new session after the restart");
    CHECK(verify_lease(c, l2) == 0, "bytes from the new arena");
    CHECK(mc_arena_get(c, NULL)->session == mc_session(c), "the arena is the new one");
    mc_release(l);   /* of the old daemon: nothing to send */
    CHECK(mc_lease_valid(l2), "the new lease is untouched by releasing the old one");
    mc_release(l2);

    /* a crash (SIGKILL) leaves the epoch in the old arena: the dropped connection tells */
    REQUIRE(mc_acquire(c, 3, ex, 2, 0, -1, &l, &e) == MC_OK, "acquire: %s", e.message);
    stop_daemon(SIGKILL);
    int noticed = 0;
    for (int i = 0; i < 200 && !noticed; i++) {   /* the heartbeat thread watches the connection */
        noticed = !mc_lease_valid(l);
        if (!noticed) sleep_ms(50);
    }
    CHECK(noticed, "a lease of a killed daemon reads invalid once the connection dropped");
    mc_release(l);
    start_daemon("24", "1");
    r = mc_acquire(c, 3, ex, 2, 0, -1, &l, &e);
    if (r == MC_ERR_RESTARTED) r = mc_acquire(c, 3, ex, 2, 0, -1, &l, &e);
    REQUIRE(r == MC_OK, "acquire after the crash: %s", e.message);
    CHECK(verify_lease(c, l) == 0, "bytes after the crash and restart");
    mc_release(l);
}

/* Substitution decided at the daemon: a missing expert replaced by a resident candidate that
 * scores >= r x its score; the item names the candidate and holds its bytes. Runs on the
 * fresh daemon test_restart started (layer 0 holds nothing yet). */
/* The daemon runs with prefetch_min_confidence 0.5: of a prefetch with conf, only the experts
 * at or above it are read (the acquire after it finds them brought in), in both request forms. */
static void test_prefetch_conf(mc_client *c) {
    mc_error e;
    mc_lease *l;
    uint32_t hits, ph, misses;
    uint64_t stall;
    int a[] = {0, 1}, b[] = {2, 3};
    double ca[] = {0.9, 0.2}, cb[] = {0.1, 0.6};
    const double *conf[] = {ca, cb};
    mc_request rq[2] = {{1, a, 2}, {2, b, 2}};
    CHECK(mc_prefetch_conf(c, rq, 2, conf, &e) == MC_OK, "prefetch_conf: %s", e.message);
    REQUIRE(mc_acquire_many(c, rq, 2, MC_ACQ_NO_FAST, 20000, &l, &e) == MC_OK, "acquire: %s", e.message);
    mc_lease_counts(l, &hits, &ph, &misses, &stall);
    CHECK(ph == 2 && misses == 2, "two prefetched, two below 0.5 (prefetch_hits %u misses %u)", ph, misses);
    CHECK(verify_lease(c, l) == 0, "bytes after a prefetch with conf");
    mc_release(l);
    int one[] = {4, 5};
    double c1[] = {0.5, 0.49};
    const double *conf1[] = {c1};
    CHECK(mc_prefetch_conf(c, &(mc_request){3, one, 2}, 1, conf1, &e) == MC_OK, "prefetch_conf: %s", e.message);
    REQUIRE(mc_acquire(c, 3, one, 2, MC_ACQ_NO_FAST, 20000, &l, &e) == MC_OK, "acquire: %s", e.message);
    mc_lease_counts(l, &hits, &ph, &misses, &stall);
    CHECK(ph == 1 && misses == 1, "one layer: 0.5 read, 0.49 not (prefetch_hits %u misses %u)", ph, misses);
    mc_release(l);
    double bad[] = {0.5, 1.5};
    const double *confb[] = {bad};
    CHECK(mc_prefetch_conf(c, &(mc_request){3, one, 2}, 1, confb, &e) == MC_ERR_INVALID_ARG &&
          strstr(e.message, "1.5"), "conf 1.5 refused: %s", e.message);
    double nan_[] = {0.5, 0.0 / 0.0};
    const double *confn[] = {nan_};
    CHECK(mc_prefetch_conf(c, &(mc_request){3, one, 2}, 1, confn, &e) == MC_ERR_INVALID_ARG, "conf NaN refused");
}

static void test_subst(mc_client *c) {
    mc_error e;
    mc_lease *l;
    int three[] = {3};
    REQUIRE(mc_acquire(c, 0, three, 1, 0, -1, &l, &e) == MC_OK, "acquire 3: %s", e.message);
    mc_release(l);                                       /* expert 3 of layer 0 is resident now */
    int five[] = {5};
    double score[] = {1.0};
    mc_cand cands[] = {{6, 0.8}, {3, 0.6}};              /* 6 is not resident: 3 is the one */
    mc_subst_layer sl = {score, cands, 2};
    mc_subst sb = {0.5, 1, &sl};
    mc_request rq = {0, five, 1};
    REQUIRE(mc_acquire_subst(c, &rq, 1, &sb, 0, -1, &l, &e) == MC_OK, "acquire with subst: %s", e.message);
    int ly = -1, miss = -1, sub = -1;
    CHECK(mc_lease_n_subst(l) == 1 && mc_lease_subst(l, 0, &ly, &miss, &sub) && ly == 0 && miss == 5 && sub == 3,
          "one substitution 5 -> 3 (n %u: %d %d %d)", mc_lease_n_subst(l), ly, miss, sub);
    CHECK(!mc_lease_subst(l, 1, &ly, &miss, &sub), "no second substitution");
    CHECK(mc_lease_items(l)[0].expert == 3 && mc_lease_n(l) == 1, "the item names the substitute");
    uint32_t hits, ph, misses;
    uint64_t stall;
    mc_lease_counts(l, &hits, &ph, &misses, &stall);
    CHECK(hits == 0 && ph == 0 && misses == 0, "a substitution is neither a hit nor a miss (%u %u %u)", hits, ph,
          misses);
    CHECK(verify_lease(c, l) == 0, "the substitute's own bytes");
    mc_release(l);
    sb.r = 0.7;                                          /* 0.6 < 0.7 x 1.0: no candidate qualifies */
    REQUIRE(mc_acquire_subst(c, &rq, 1, &sb, 0, -1, &l, &e) == MC_OK, "acquire, r 0.7: %s", e.message);
    mc_lease_counts(l, &hits, &ph, &misses, &stall);
    CHECK(mc_lease_n_subst(l) == 0 && mc_lease_items(l)[0].expert == 5 && misses == 1, "read when none qualifies");
    CHECK(verify_lease(c, l) == 0, "bytes of the expert read");
    mc_release(l);
    REQUIRE(mc_acquire_subst(c, &rq, 1, &sb, 0, -1, &l, &e) == MC_OK, "acquire resident: %s", e.message);
    CHECK(mc_lease_n_subst(l) == 0 && mc_lease_items(l)[0].expert == 5 && (mc_lease_fast(l) || mc_fast_path(c) == 0),
          "all resident: the fast path, nothing substituted");
    mc_release(l);
    mc_cand dup[] = {{5, 0.9}};                          /* a requested expert is no candidate */
    mc_subst_layer bad = {score, dup, 1};
    mc_subst sbad = {0.5, -1, &bad};
    int seven[] = {7};
    mc_request rq7 = {0, seven, 1};
    dup[0].expert = 7;
    CHECK(mc_acquire_subst(c, &rq7, 1, &sbad, 0, -1, &l, &e) == MC_ERR_D_BAD_TYPE && strstr(e.message, "candidate 7"),
          "a requested expert as candidate is refused: %d %s", e.code, e.message);
    sbad.r = 2.0;
    CHECK(mc_acquire_subst(c, &rq7, 1, &sbad, 0, -1, &l, &e) == MC_ERR_INVALID_ARG, "r out of range refused locally");
}

/* The daemon's clients now: its stats' "clients" list, one "watched" each (the clients that
 * left are listed after it, in "departed_clients"). */
static int count_clients(mc_client *c) {
    mc_error err;
    char *st = mc_stats_text(c, &err);
    REQUIRE(st, "stats: %s", err.message);
    const char *b = strstr(st, "\"clients\"=>");
    REQUIRE(b, "no clients in the stats: %.200s", st);
    const char *e = strstr(b, "\"departed_clients\"");
    int n = 0;
    for (const char *p = b; (p = strstr(p, "\"watched\"")) && (!e || p < e); p++) n++;
    free(st);
    return n;
}

/* mc_probe: a daemon that answers, a missing socket file, a socket file nothing listens on; the
 * probe leaves no client behind (it says bye). */
static void test_probe(mc_client *c) {
    mc_error err;
    double rtt = -1;
    uint64_t session = 0;
    CHECK(mc_probe(ENDPOINT, 2000, &rtt, &session, &err) == MC_OK && rtt > 0, "probe: %s", err.message);
    CHECK(session != 0 && session == mc_session(c), "probe's session %llu, the client's %llu",
          (unsigned long long)session, (unsigned long long)mc_session(c));
    int n_before = count_clients(c);
    for (int i = 0; i < 5; i++) CHECK(mc_probe(ENDPOINT, 2000, NULL, NULL, &err) == MC_OK, "probe %d: %s", i, err.message);
    sleep_ms(300);
    CHECK(count_clients(c) == n_before, "clients after five probes: %d (before: %d)", count_clients(c), n_before);
    char ep[700];
    snprintf(ep, sizeof ep, "ipc://%s/none.sock", DIR_);
    CHECK(mc_probe(ep, 500, NULL, NULL, &err) == MC_ERR_SYSTEM && strstr(err.message, "no daemon socket at"), "%s", err.message);
    char path[700];
    snprintf(path, sizeof path, "%s/stale.sock", DIR_);
    FILE *f = fopen(path, "w");   /* a socket file no daemon listens on */
    REQUIRE(f, "fopen %s", path);
    fclose(f);
    snprintf(ep, sizeof ep, "ipc://%s", path);
    double t0 = clock_ms();
    CHECK(mc_probe(ep, 300, NULL, NULL, &err) == MC_ERR_TIMEOUT && strstr(err.message, "no answer"), "%s", err.message);
    CHECK(clock_ms() - t0 < 3000, "the probe of a dead socket took %.0f ms", clock_ms() - t0);
    unlink(path);
    CHECK(mc_probe("http://x", 100, NULL, NULL, &err) == MC_ERR_INVALID_ARG, "%s", err.message);
}

int main(void) {
    PY = getenv("MC_PYTHON");
    MODEL = getenv("MC_MODEL");
    DIR_ = getenv("MC_DIR");
    const char *exp = getenv("MC_EXPECT");
    if (!PY || !MODEL || !DIR_ || !exp) {
        fprintf(stderr, "test_daemon: set MC_PYTHON, MC_MODEL, MC_EXPECT and MC_DIR (run tests/run_daemon_tests.py)\n");
        return 2;
    }
    EX = ex_load(exp);
    REQUIRE(EX && EX->n > 0, "expect table %s", exp);
    snprintf(SOCK, sizeof SOCK, "%s/d.sock", DIR_);
    snprintf(ENDPOINT, sizeof ENDPOINT, "ipc://%s", SOCK);
    atexit(stop_all);
    start_daemon("24", "1");
    mc_client *c = connect_client("c-test", 1, 1);
    test_basic(c);
    test_probe(c);
    test_populate();
    test_errors(c);
    test_threads(c);
    test_fast(c);
    test_heartbeat(c);
    test_restart(c);
    test_subst(c);
    test_prefetch_conf(c);
    mc_close(c);
    stop_daemon(SIGTERM);
    ex_free(EX);
    if (g_failures) {
        fprintf(stderr, "test_daemon: %d failure(s)\n", g_failures);
        return 1;
    }
    printf("test_daemon: ok\n");
    return 0;
}
