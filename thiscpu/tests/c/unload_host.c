/* A C program that loads a shared library holding thiscpu (the `shared_library` example),
 * uses it from four threads, unloads it with dlclose, then keeps the threads running while
 * they take signals, with another library's initial-exec TLS words loaded after it.
 * Usage: unload_host LIBRARY TLS_LIBRARY. Exit status 0 when the process is intact. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define THREADS 4
#define COUNTS 10000
#define ROUNDS 200

static void (*shared_count)(unsigned long long);
static unsigned (*shared_current_cpu)(void);
static unsigned long long (*shared_total)(void);
static void (*tls_fill)(unsigned);
static int (*tls_mismatches)(unsigned);
static pthread_barrier_t used, unloaded;
static atomic_int signals;

#if defined(__aarch64__) || defined(__riscv)
/* glibc on arm64 and riscv64 gives a library loaded with dlopen static TLS only up to the
 * largest alignment among the TLS blocks present at start-up (16 bytes in a program without
 * aligned thread-locals), and thiscpu's area needs 64: see the known limitations in
 * docs/internals.md. */
__thread __attribute__((aligned(64))) char static_tls_alignment;
#endif

static void on_signal(int sig) {
    (void)sig;
    atomic_fetch_add(&signals, 1);
}

static void *symbol(void *handle, const char *name) {
    void *address = dlsym(handle, name);
    if (!address) {
        fprintf(stderr, "dlsym %s: %s\n", name, dlerror());
        exit(3);
    }
    return address;
}

static void *worker(void *arg) {
    unsigned pattern = 0xa5a50000u + (unsigned)(long)arg * 0x100u;
    for (int i = 0; i < COUNTS; i++)
        shared_count(1);
    (void)shared_current_cpu();
    pthread_barrier_wait(&used);
    /* The main thread unloads the library and loads the TLS library here. */
    pthread_barrier_wait(&unloaded);
    tls_fill(pattern);
    for (int round = 0; round < ROUNDS; round++) {
        usleep(200); /* blocked in a system call, then preempted and migrated */
        sched_yield();
    }
    return (void *)(long)tls_mismatches(pattern);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s LIBRARY TLS_LIBRARY\n", argv[0]);
        return 3;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    void *library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!library) {
        fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
        return 3;
    }
    shared_count = (void (*)(unsigned long long))symbol(library, "shared_count");
    shared_current_cpu = (unsigned (*)(void))symbol(library, "shared_current_cpu");
    shared_total = (unsigned long long (*)(void))symbol(library, "shared_total");

    struct sigaction action = {0};
    action.sa_handler = on_signal;
    action.sa_flags = SA_RESTART;
    sigemptyset(&action.sa_mask);
    sigaction(SIGUSR1, &action, NULL);
    pthread_barrier_init(&used, NULL, THREADS + 1);
    pthread_barrier_init(&unloaded, NULL, THREADS + 1);
    pthread_t threads[THREADS];
    for (long i = 0; i < THREADS; i++)
        pthread_create(&threads[i], NULL, worker, (void *)i);
    pthread_barrier_wait(&used);

    unsigned long long total = shared_total();
    if (total != (unsigned long long)THREADS * COUNTS) {
        fprintf(stderr, "the library counted %llu, not %d\n", total, THREADS * COUNTS);
        return 4;
    }
    if (dlclose(library) != 0) {
        fprintf(stderr, "dlclose: %s\n", dlerror());
        return 3;
    }
    void *still = dlopen(argv[1], RTLD_NOW | RTLD_NOLOAD);
    printf("after dlclose the library is %s\n", still ? "still mapped" : "unmapped");

    void *tls_library = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
    if (!tls_library) {
        fprintf(stderr, "dlopen %s: %s\n", argv[2], dlerror());
        return 3;
    }
    tls_fill = (void (*)(unsigned))symbol(tls_library, "tls_fill");
    tls_mismatches = (int (*)(unsigned))symbol(tls_library, "tls_mismatches");
    pthread_barrier_wait(&unloaded);

    for (int round = 0; round < 20; round++) {
        for (int i = 0; i < THREADS; i++)
            pthread_kill(threads[i], SIGUSR1);
        usleep(1000);
    }
    int mismatches = 0;
    for (int i = 0; i < THREADS; i++) {
        void *result;
        pthread_join(threads[i], &result);
        mismatches += (int)(long)result;
    }
    printf("signals handled: %d, TLS words changed behind the library's back: %d\n",
           atomic_load(&signals), mismatches);
    if (mismatches != 0)
        return 5;
    return still ? 0 : 6;
}
