/* expect.h -- where each expert part lies in the model file, for checking arena bytes.
 *
 * Reads the text table written by clients/c/tests/dump_expect.py:
 *     file <i> <path>
 *     x <layer> <expert> <part> <file index> <offset> <bytes>
 * and compares a buffer with the model file's bytes at that place. Header-only (examples and
 * tests share it). */
#ifndef MC_EXPECT_H
#define MC_EXPECT_H
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct ex_entry { int layer, expert; char part[16]; int file; uint64_t off, bytes; } ex_entry;
typedef struct ex_table { int fds[16]; int n_files; ex_entry *e; size_t n, cap; unsigned char *buf; size_t buf_cap; } ex_table;

static ex_table *ex_load(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) { fprintf(stderr, "%s: %s\n", path, strerror(errno)); return NULL; }
    ex_table *t = calloc(1, sizeof *t);
    char line[4200];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "file ", 5) == 0) {
            int i; char p[4096];
            if (sscanf(line, "file %d %4095s", &i, p) == 2 && i >= 0 && i < 16) {
                t->fds[i] = open(p, O_RDONLY | O_CLOEXEC);
                if (t->fds[i] < 0) { fprintf(stderr, "%s: %s\n", p, strerror(errno)); exit(2); }
                if (i + 1 > t->n_files) t->n_files = i + 1;
            }
        } else if (line[0] == 'x') {
            ex_entry e;
            unsigned long long o, b;
            if (sscanf(line, "x %d %d %15s %d %llu %llu", &e.layer, &e.expert, e.part, &e.file, &o, &b) == 6) {
                e.off = o; e.bytes = b;
                if (t->n == t->cap) { t->cap = t->cap ? 2 * t->cap : 256; t->e = realloc(t->e, t->cap * sizeof *t->e); }
                t->e[t->n++] = e;
            }
        }
    }
    fclose(f);
    return t;
}

static const ex_entry *ex_find(const ex_table *t, int layer, int expert, const char *part) {
    for (size_t i = 0; i < t->n; i++)
        if (t->e[i].layer == layer && t->e[i].expert == expert && strcmp(t->e[i].part, part) == 0)
            return &t->e[i];
    return NULL;
}

/* 1 when `got[0..bytes)` equals the model file's bytes of (layer, expert, part). */
static int ex_check(ex_table *t, int layer, int expert, const char *part, const void *got, uint64_t bytes) {
    const ex_entry *e = ex_find(t, layer, expert, part);
    if (!e || e->bytes != bytes) return 0;
    if (t->buf_cap < bytes) { free(t->buf); t->buf = malloc(bytes); t->buf_cap = bytes; }
    uint64_t done = 0;
    while (done < bytes) {
        ssize_t r = pread(t->fds[e->file], t->buf + done, bytes - done, (off_t)(e->off + done));
        if (r <= 0) return 0;
        done += (uint64_t)r;
    }
    return memcmp(t->buf, got, bytes) == 0;
}

static void ex_free(ex_table *t) {
    for (int i = 0; i < t->n_files; i++) close(t->fds[i]);
    free(t->e); free(t->buf); free(t);
}
#endif
