/* thiscpu's per-CPU allocator as a C library (libthiscpu_malloc.so, libthiscpu_malloc.a).
 *
 * Loaded with LD_PRELOAD, or linked statically, the library's malloc, free, calloc, realloc,
 * reallocarray, posix_memalign, aligned_alloc, memalign, valloc, pvalloc, malloc_usable_size,
 * free_sized and free_aligned_sized take the place of glibc's, with their standard declarations
 * (<stdlib.h>, <malloc.h>). These are its own calls, for a program that wants to know or steer
 * its caches. Declare them weak to run on glibc's allocator as well.
 *
 * With THISCPU_MALLOC_CHECK=1 in the environment, free and realloc first check that the pointer
 * can be an allocation's and that the caches do not hold it already (a double free), and abort
 * the process with a message on standard error if not.
 */
#ifndef THISCPU_MALLOC_H
#define THISCPU_MALLOC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1 if the per-CPU caches serve this process (after its first allocation), 0 if every call
 * goes to glibc's allocator (no rseq: an old kernel, valgrind, a seccomp filter). */
int thiscpu_malloc_caching(void);

/* Gives every CPU's cached objects back to glibc's allocator, and glibc's free pages back to
 * the system (malloc_trim(0)); returns the bytes of objects given back. */
size_t thiscpu_malloc_release(void);

/* Gives back the caches of the CPUs that did not use them since the previous call; returns
 * the bytes given back. Call it now and then, from any thread. */
size_t thiscpu_malloc_release_idle(void);

/* Sets how many milliseconds a free span of the heap keeps its pages before the heap's next
 * change gives them back to the system (1000 until changed); a negative value turns that off,
 * leaving it to thiscpu_malloc_release(). Returns the previous setting (-1 for off). */
int64_t thiscpu_malloc_set_idle_return_ms(int64_t ms);

/* Misses and spills of every CPU's cache so far: the calls that reached glibc's allocator or
 * another CPU's objects. */
uint64_t thiscpu_malloc_slow_calls(void);

#ifdef __cplusplus
}
#endif

#endif
