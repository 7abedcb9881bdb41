/* The client against tests/fake_daemon.py (which starts this program and checks what it sent):
 * client-side timeout and the late lease, an error code, a reply from another session, the
 * hello after it, and an arena descriptor version the library does not read. */
#define _GNU_SOURCE
#include "moecache.h"
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int g_failures;
#define CHECK(cond, ...) do { if (!(cond)) { g_failures++; fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
    fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); } } while (0)

/* s is whole UTF-8 characters (no sequence cut) */
static int utf8_whole(const char *s) {
    for (const unsigned char *p = (const unsigned char *)s; *p;) {
        int n = *p < 0x80 ? 1 : (*p & 0xE0) == 0xC0 ? 2 : (*p & 0xF0) == 0xE0 ? 3 : (*p & 0xF8) == 0xF0 ? 4 : 0;
        if (!n) return 0;
        for (int i = 1; i < n; i++)
            if ((p[i] & 0xC0) != 0x80) return 0;
        p += n;
    }
    return 1;
}

static const uint64_t S1 = 0x111122223333ull, S2 = 0x444455556666ull;

/* stderr into a temporary file until stderr_back (which puts what was written in buf) */
static int stderr_to_file(void) {
    fflush(stderr);
    int saved = dup(2);
    FILE *t = tmpfile();
    dup2(fileno(t), 2);
    fclose(t);   /* fd 2 keeps the file open */
    return saved;
}

static void stderr_back(int saved, char *buf, size_t n) {
    fflush(stderr);
    off_t end = lseek(2, 0, SEEK_END);
    ssize_t got = pread(2, buf, n - 1, 0);
    buf[got > 0 ? got : 0] = 0;
    (void)end;
    dup2(saved, 2);
    close(saved);
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    mc_options o;
    mc_options_init(&o);
    o.timeout_ms = 400;
    o.heartbeat_thread = 0;
    mc_error e;
    /* a socket path without its scheme: one line saying what an endpoint is */
    CHECK(mc_connect("/tmp/x.sock", "noscheme", &o, &e) == NULL && e.code == MC_ERR_INVALID_ARG &&
          strstr(e.message, "endpoint /tmp/x.sock: expected ipc://PATH"), "endpoint without scheme: %s", e.message);
    mc_client *c = mc_connect(argv[1], "fake", &o, &e);
    if (!c) { fprintf(stderr, "connect: %s\n", e.message); return 1; }
    CHECK(mc_session(c) == S1, "session");
    CHECK(!mc_fast_path(c), "pins null: no fast path");
    const mc_arena *a = mc_arena_get(c, &e);
    CHECK(a && a->n_experts == 4 && a->top_k == 2 && a->classes[0].n_slots == 4 &&
          strcmp(a->classes[0].parts[0].type, "Q8_0") == 0, "arena description");

    int ex12[] = {1, 2}, ex2[] = {2}, ex3[] = {3}, ex0[] = {0};
    mc_lease *l1 = NULL, *l = NULL;
    CHECK(mc_acquire(c, 1, ex12, 2, 0, -1, &l1, &e) == MC_OK, "acquire: %s", e.message);
    CHECK(l1 && mc_lease_valid(l1), "valid lease");
    if (l1) {
        uint64_t n;
        const unsigned char *b = mc_lease_part(l1, 1, "gate", &n);
        CHECK(b && n == 64 && b[0] == 3 && b[63] == 3, "slot 2's bytes");
    }

    int r = mc_acquire(c, 1, ex2, 1, 0, -1, &l, &e);
    CHECK(r == MC_ERR_TIMEOUT && l == NULL, "client-side timeout: %s", mc_code_name(r));
    /* the line names the daemon and the wait */
    CHECK(strstr(e.message, argv[1]) && strstr(e.message, "within 400 ms (mc_options.timeout_ms)"), "timeout line: %s", e.message);
    struct timespec ts = {0, 900 * 1000000L};
    nanosleep(&ts, NULL);   /* the late reply arrives; the next call reads it and releases its lease */
    CHECK(mc_ping(c, NULL, &e) == MC_OK, "ping: %s", e.message);
    CHECK(mc_ping(c, NULL, &e) == MC_OK, "ping: %s", e.message);

    r = mc_acquire(c, 1, ex3, 1, 0, -1, &l, &e);
    CHECK(r == MC_ERR_D_RATE_LIMITED && strcmp(e.daemon_code, "rate_limited") == 0 &&
          strncmp(e.message, "acquire: rate_limited: slow down: model file /dee/modèles/", 59) == 0,
          "error code mapped: %s %s", mc_code_name(r), e.message);
    /* a line longer than message keeps its head and its end (the fix), joined by " ... " */
    {
        const char *fix = "; the fix: wait 1 s";
        size_t n = strlen(e.message);
        CHECK(n < sizeof e.message && n > sizeof e.message - 8 && strstr(e.message, " ... ") && n > strlen(fix) &&
              strcmp(e.message + n - strlen(fix), fix) == 0 && utf8_whole(e.message),
              "a long line's head and fix: %s", e.message);
    }

    r = mc_acquire(c, 0, ex0, 1, 0, -1, &l, &e);
    CHECK(r == MC_ERR_RESTARTED && l == NULL, "a reply from another session: %s", mc_code_name(r));
    CHECK(mc_session(c) == 0, "session voided");
    CHECK(l1 && !mc_lease_valid(l1) && !mc_lease_part(l1, 0, "gate", NULL), "old lease invalid after the restart");
    CHECK(mc_ping(c, NULL, &e) == MC_OK, "ping says hello again: %s", e.message);
    CHECK(mc_session(c) == S2, "new session");
    a = mc_arena_get(c, &e);
    CHECK(a && a->session == S2, "new arena");
    mc_release(l1);   /* of the old session: nothing sent */
    mc_close(c);

    c = mc_connect(argv[1], "v3", &o, &e);
    CHECK(c == NULL && e.code == MC_ERR_UNSUPPORTED && strstr(e.message, "version 3"), "descriptor v3: %s",
          e.message);
    if (c) mc_close(c);

    /* the fast path: the fake offers a pin file and has expert 2 of block 1 resident in slot 3
     * (no call here is meant to time out: room for a loaded machine) */
    o.timeout_ms = 5000;
    c = mc_connect(argv[1], "fastc", &o, &e);
    if (!c) { fprintf(stderr, "connect fastc: %s\n", e.message); return 1; }
    CHECK(mc_fast_path(c), "pins offered: fast path on");
    r = mc_acquire(c, 1, ex2, 1, 0, -1, &l, &e);
    CHECK(r == MC_OK && l && mc_lease_fast(l) && mc_lease_slot(l, 0) == 3, "fast pin: %s", e.message);
    if (l) {
        const unsigned char *b = mc_lease_part(l, 0, "gate", NULL);
        CHECK(b && b[0] == 4 && b[63] == 4, "slot 3's bytes through a fast lease");
        CHECK(mc_lease_valid(l), "fast lease valid");
    }
    CHECK(mc_ping(c, NULL, &e) == MC_OK, "ping 1 (the fake checks the pin count and the ring)");
    mc_release(l);
    int ex23[] = {2, 3};
    l = NULL;
    r = mc_acquire(c, 1, ex23, 2, 0, -1, &l, &e);
    CHECK(r == MC_OK && l && !mc_lease_fast(l), "expert 3 not resident: the whole set over the socket: %s", e.message);
    mc_release(l);
    CHECK(mc_ping(c, NULL, &e) == MC_OK, "ping 2 (the fake checks the pins are gone, then clears the epoch)");
    l = NULL;
    r = mc_acquire(c, 1, ex2, 1, 0, -1, &l, &e);
    CHECK(r == MC_ERR_RESTARTED && !l, "epoch cleared: the fast path says restarted: %s", mc_code_name(r));
    CHECK(mc_session(c) == 0, "session voided by the fast path");
    mc_close(c);

    /* an unwatched client keeps pinging while one of its acquires waits (the fake answers the
     * acquire after 1.5 s and counts the pings meanwhile) */
    o.heartbeat_thread = 1;
    o.heartbeat_ms = 100;
    o.timeout_ms = 5000;
    c = mc_connect(argv[1], "hbwait", &o, &e);
    if (!c) { fprintf(stderr, "connect hbwait: %s\n", e.message); return 1; }
    int ex1[] = {1};
    l = NULL;
    r = mc_acquire(c, 0, ex1, 1, 0, -1, &l, &e);
    CHECK(r == MC_OK && l, "the slow acquire: %s", e.message);
    mc_release(l);
    mc_close(c);

    /* a warm fill runs: mc_connect waits until the daemon's warm_pending is 0 (the fake says 3,
     * 2, 1, 0); with warm_wait_ms = 0 it does not wait (warmslow's fill never ends), and
     * mc_warm_wait gives up after its timeout with what is left */
    o.heartbeat_thread = 0;
    o.timeout_ms = 2000;
    char said[512];
    int saved = stderr_to_file();
    c = mc_connect(argv[1], "warmwait", &o, &e);
    stderr_back(saved, said, sizeof said);
    if (!c) { fprintf(stderr, "connect warmwait: %s\n", e.message); return 1; }
    uint64_t left = 99;
    CHECK(mc_warm_wait(c, 0, &left, &e) == MC_OK && left == 0, "the fill ended before mc_connect returned: %s",
          e.message);
    CHECK(strstr(said, "filling the model") && strstr(said, "fill ended"), "the wait said on stderr: [%s]", said);
    mc_close(c);
    o.quiet = 1;   /* the same wait says nothing */
    saved = stderr_to_file();
    c = mc_connect(argv[1], "warmquiet", &o, &e);
    stderr_back(saved, said, sizeof said);
    if (!c) { fprintf(stderr, "connect warmquiet: %s\n", e.message); return 1; }
    CHECK(mc_warm_wait(c, 0, &left, &e) == MC_OK && left == 0, "the quiet wait ended: %s", e.message);
    CHECK(said[0] == 0, "quiet: nothing on stderr, got [%s]", said);
    mc_close(c);
    o.quiet = 0;
    o.warm_wait_ms = 0;
    c = mc_connect(argv[1], "warmslow", &o, &e);
    if (!c) { fprintf(stderr, "connect warmslow: %s\n", e.message); return 1; }
    r = mc_warm_wait(c, 100, &left, &e);
    CHECK(r == MC_ERR_TIMEOUT && left == 5 && strstr(e.message, "5 experts"), "a fill that does not end: %s %s",
          mc_code_name(r), e.message);
    mc_close(c);

    /* the daemon restarts while mc_connect waits for its fill: the wait goes on against the
     * restarted daemon (a new hello) until its own fill has ended */
    o.warm_wait_ms = 5000;
    c = mc_connect(argv[1], "warmrestart", &o, &e);
    if (!c) { fprintf(stderr, "connect warmrestart: %s\n", e.message); return 1; }
    r = mc_warm_wait(c, 0, &left, &e);
    CHECK(r == MC_OK && left == 0, "the restarted daemon's fill was waited for: %s %s (%llu left)",
          mc_code_name(r), e.message, (unsigned long long)left);
    mc_close(c);
    if (g_failures) return 1;
    printf("test_fake: ok\n");
    return 0;
}
