/* The C library under load from C threads: a burst whose memory a release must give back,
 * every exported call, objects handed between threads and freed on other CPUs, forks while
 * other threads allocate, and an address-space limit that must make allocations fail with
 * ENOMEM, never abort.
 *
 * Built twice by the malloc job of .ci/run: once run with LD_PRELOAD, once linked with the
 * static library. Every object carries a pattern made from its address and size, checked
 * before it is freed, so an object handed out twice or written after its free is found.
 * Prints one line per part and exits 0 only if every check held.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../include/thiscpu_malloc.h"

/* Weak, so that the program starts without the library and says it was not given one. */
#pragma weak thiscpu_malloc_caching
#pragma weak thiscpu_malloc_slow_calls
#pragma weak thiscpu_malloc_release
#pragma weak thiscpu_malloc_set_idle_return_ms
void free_sized(void *, size_t) __attribute__((weak));

#define THREADS 4
#define SLOTS 512
#define HANDOFF 64

static int failures;
static pthread_mutex_t failures_lock = PTHREAD_MUTEX_INITIALIZER;

static void fail(const char *what, size_t value) {
    pthread_mutex_lock(&failures_lock);
    if (failures++ < 20) fprintf(stderr, "stress: %s (%zu)\n", what, value);
    pthread_mutex_unlock(&failures_lock);
}

static uint64_t next(uint64_t *state) {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

/* The byte at offset i of an object at p of size n. */
static unsigned char pattern(const void *p, size_t n, size_t i) {
    uintptr_t a = (uintptr_t)p;
    return (unsigned char)((a >> 4) ^ (a >> 12) ^ n ^ (i * 31));
}

static void fill(unsigned char *p, size_t n) {
    /* The first and last 16 bytes, and one in every 64: enough to catch a shared object. */
    for (size_t i = 0; i < n; i++)
        if (i < 16 || i + 16 >= n || i % 64 == 0) p[i] = pattern(p, n, i);
}

static void check(const unsigned char *p, size_t n, const char *what) {
    for (size_t i = 0; i < n; i++)
        if ((i < 16 || i + 16 >= n || i % 64 == 0) && p[i] != pattern(p, n, i)) {
            fail(what, n);
            return;
        }
}

struct object { unsigned char *p; size_t n; };

/* Objects one thread hands to the next, which checks and frees them. */
static struct {
    pthread_mutex_t lock;
    struct object items[HANDOFF];
    int count;
} handoff[THREADS];

static size_t random_size(uint64_t *state) {
    uint64_t r = next(state);
    switch (r % 8) {
    case 0: return r >> 40 & 7;                 /* 0 to 7 bytes */
    case 1: return 4000 + (r >> 20) % 300;      /* around the largest class */
    case 2: return (r >> 20) % 70000;           /* up to past glibc's mmap threshold */
    default: return 8 + (r >> 20) % 1024;       /* the 16-byte classes */
    }
}

static unsigned char *make(uint64_t *state, size_t n) {
    unsigned char *p;
    void *aligned = NULL;
    size_t align = (size_t)16 << (next(state) % 8);
    switch (next(state) % 10) {
    case 0:
        p = calloc(1, n);
        for (size_t i = 0; p && i < n; i++)
            if (p[i]) { fail("calloc gave a non-zero byte", i); break; }
        break;
    case 1:
        if (posix_memalign(&aligned, align, n) != 0) aligned = NULL;
        p = aligned;
        if (p && (uintptr_t)p % align) fail("posix_memalign misaligned", align);
        break;
    case 2:
        p = aligned_alloc(align, n);
        if (p && (uintptr_t)p % align) fail("aligned_alloc misaligned", align);
        break;
    case 3:
        p = memalign(align, n);
        if (p && (uintptr_t)p % align) fail("memalign misaligned", align);
        break;
    default:
        p = malloc(n);
        if (p && (uintptr_t)p % 16) fail("malloc misaligned", (uintptr_t)p);
        break;
    }
    if (!p) { fail("allocation failed", n); return NULL; }
    if (malloc_usable_size(p) < n) fail("usable size below the request", n);
    fill(p, n);
    return p;
}

static void release(struct object o, uint64_t *state) {
    check(o.p, o.n, "an object changed before its free");
    if (free_sized && next(state) % 4 == 0) free_sized(o.p, o.n);
    else free(o.p);
}

static void *worker(void *arg) {
    int self = (int)(intptr_t)arg;
    uint64_t state = 0x9e3779b97f4a7c15ULL * (uint64_t)(self + 1);
    struct object held[SLOTS] = {{0}};
    for (int round = 0; round < 100000; round++) {
        int at = (int)(next(&state) % SLOTS);
        struct object *o = &held[at];
        uint64_t what = next(&state) % 16;
        if (o->p && what == 0) {
            /* realloc keeps the bytes it keeps. */
            size_t n = random_size(&state) + 1;
            check(o->p, o->n, "an object changed before its realloc");
            size_t kept = o->n < n ? o->n : n;
            unsigned char before[32];
            size_t head = kept < 16 ? kept : 16;
            memcpy(before, o->p, head);
            unsigned char *q = realloc(o->p, n);
            if (!q) { fail("realloc failed", n); continue; }
            if (memcmp(before, q, head)) fail("realloc lost bytes", n);
            o->p = q;
            o->n = n;
            fill(q, n);
        } else if (o->p && what == 1) {
            /* Handed to the next thread, which frees it on its own CPU. */
            int to = (self + 1) % THREADS;
            pthread_mutex_lock(&handoff[to].lock);
            if (handoff[to].count < HANDOFF) {
                handoff[to].items[handoff[to].count++] = *o;
                o->p = NULL;
            }
            pthread_mutex_unlock(&handoff[to].lock);
        } else if (o->p) {
            release(*o, &state);
            o->p = NULL;
        } else {
            o->n = random_size(&state);
            o->p = make(&state, o->n);
        }
        if (round % 64 == 0) {
            pthread_mutex_lock(&handoff[self].lock);
            while (handoff[self].count > 0) release(handoff[self].items[--handoff[self].count], &state);
            pthread_mutex_unlock(&handoff[self].lock);
        }
    }
    for (int i = 0; i < SLOTS; i++)
        if (held[i].p) release(held[i], &state);
    return NULL;
}

/* Children forked while the workers run allocate, free and exit. */
static void fork_while_busy(int forks) {
    for (int i = 0; i < forks; i++) {
        usleep(2000);
        pid_t child = fork();
        if (child == 0) {
            uint64_t state = 7 + (uint64_t)i;
            for (int k = 0; k < 20000; k++) {
                size_t n = random_size(&state);
                unsigned char *p = make(&state, n);
                if (p) { check(p, n, "child object"); free(p); }
            }
            _exit(failures ? 1 : 0);
        }
        int status = 0;
        if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status) ||
            WEXITSTATUS(status) != 0)
            fail("a forked child failed", (size_t)status);
    }
}

static void edges(void) {
    volatile size_t half = SIZE_MAX / 2; /* not a constant, so that the compiler does not warn */
    errno = 0;
    if (calloc(half, 4) != NULL || errno != ENOMEM) fail("calloc overflow", errno);
    errno = 0;
    if (malloc(half * 2 - 7) != NULL || errno != ENOMEM) fail("malloc of SIZE_MAX", errno);
    void *p = malloc(10);
    void *volatile kept = p; /* a failed reallocarray leaves it live, which gcc cannot know */
    errno = 0;
    if (reallocarray(p, half, 4) != NULL || errno != ENOMEM) fail("reallocarray overflow", errno);
    void *out = p;
    if (posix_memalign(&out, 24, 8) != EINVAL || out != p) fail("posix_memalign of 24", 0);
    if (posix_memalign(&out, 4, 8) != EINVAL) fail("posix_memalign of 4", 0);
    errno = 0;
    if (aligned_alloc(48, 8) != NULL || errno != EINVAL) fail("aligned_alloc of 48", errno);
    void *m = memalign(48, 100);
    if (!m || (uintptr_t)m % 64) fail("memalign of 48 rounds to 64", (uintptr_t)m);
    free(m);
    void *v = valloc(10), *pv = pvalloc(5000);
    long page = sysconf(_SC_PAGESIZE);
    if (!v || (uintptr_t)v % page) fail("valloc", (uintptr_t)v);
    if (!pv || (uintptr_t)pv % page || malloc_usable_size(pv) < 2 * (size_t)page) fail("pvalloc", (uintptr_t)pv);
    free(v);
    free(pv);
    if (malloc_usable_size(NULL) != 0) fail("usable size of null", 0);
    free(NULL);
    void *z = malloc(0);
    if (!z) fail("malloc(0) gave null", 0);
    if (realloc(z, 0) != NULL) fail("realloc(p, 0) did not free", 0);
    void *r = realloc(NULL, 100);
    if (!r) fail("realloc(NULL, n)", 0);
    free(r);
    free(kept);
}

/* Resident bytes of this process now. */
static long resident(void) {
    long pages = 0, size = 0;
    FILE *statm = fopen("/proc/self/statm", "r");
    if (!statm || fscanf(statm, "%ld %ld", &size, &pages) != 2) fail("cannot read /proc/self/statm", 0);
    if (statm) fclose(statm);
    return pages * sysconf(_SC_PAGESIZE);
}

/* A burst of 400,000 objects freed in another order than it was made, then a release: at
 * least 90 % of the memory it added goes back to the system. Before any thread starts. */
static void burst(void) {
    enum { OBJECTS = 400000 };
    void **held = malloc(OBJECTS * sizeof *held);
    if (!held) { fail("burst: no array", 0); return; }
    long before = resident();
    uint64_t state = 11;
    for (int i = 0; i < OBJECTS; i++) {
        size_t n = 16 + next(&state) % 1000;
        held[i] = malloc(n);
        if (!held[i]) { fail("burst: allocation failed", n); return; }
        memset(held[i], 1, n);
    }
    long peak = resident();
    for (int i = 0; i < OBJECTS; i++) free(held[(size_t)i * 7 % OBJECTS]);
    thiscpu_malloc_release();
    long after = resident();
    printf("burst: %ld KiB before, %ld at the peak, %ld after the release\n", before >> 10,
           peak >> 10, after >> 10);
    if (peak - after < (peak - before) / 10 * 9) fail("burst: memory not given back (KiB)", (size_t)(after >> 10));
    free(held);
}

/* Under an address-space limit, allocations fail with ENOMEM and the process goes on. */
static void out_of_memory(void) {
    pid_t child = fork();
    if (child == 0) {
        struct rlimit limit = {256 << 20, 256 << 20};
        if (setrlimit(RLIMIT_AS, &limit) != 0) _exit(3);
        void *held[100000];
        int n = 0, refused = 0;
        for (; n < 100000; n++) {
            errno = 0;
            held[n] = malloc(n % 2 ? 1 << 20 : 3000);
            if (!held[n]) {
                if (errno != ENOMEM) _exit(4);
                refused = 1;
                break;
            }
            memset(held[n], 1, 64);
        }
        if (!refused) _exit(5);
        for (int i = 0; i < n; i++) free(held[i]);
        /* Memory given back serves again. */
        void *again = malloc(1 << 20);
        if (!again) _exit(6);
        free(again);
        _exit(0);
    }
    int status = 0;
    waitpid(child, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) fail("out of memory: child status", (size_t)status);
}

int main(int argc, char **argv) {
    int forks = argc > 1 ? atoi(argv[1]) : 10;
    if (!thiscpu_malloc_caching) {
        fprintf(stderr, "stress: the library's calls are not linked in: its malloc is not in use\n");
        return 2;
    }
    edges();
    printf("edges: %d failures\n", failures);
    burst();
    for (int i = 0; i < THREADS; i++) pthread_mutex_init(&handoff[i].lock, NULL);
    pthread_t threads[THREADS];
    for (int i = 0; i < THREADS; i++) pthread_create(&threads[i], NULL, worker, (void *)(intptr_t)i);
    fork_while_busy(forks);
    for (int i = 0; i < THREADS; i++) pthread_join(threads[i], NULL);
    for (int i = 0; i < THREADS; i++)
        while (handoff[i].count > 0) {
            struct object o = handoff[i].items[--handoff[i].count];
            check(o.p, o.n, "handed object");
            free(o.p);
        }
    printf("threads: %d threads, %d forks, %d failures\n", THREADS, forks, failures);
    out_of_memory();
    printf("out of memory: %d failures\n", failures);
    int caching = thiscpu_malloc_caching();
    uint64_t slow = thiscpu_malloc_slow_calls();
    size_t released = thiscpu_malloc_release();
    printf("caching %d, slow calls %llu, released %zu bytes\n", caching, (unsigned long long)slow, released);
    int64_t idle = thiscpu_malloc_set_idle_return_ms(-1);
    int64_t off = thiscpu_malloc_set_idle_return_ms(idle);
    if (idle != 1000 || off != -1) fail("the idle return setting (ms)", (size_t)idle);
    if (caching && slow == 0) fail("the caches served nothing", 0);
    return failures ? 1 : 0;
}
