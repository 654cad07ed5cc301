/* The C library's checking mode (THISCPU_MALLOC_CHECK=1): each scenario named on the command
 * line makes one mistake, which the mode must report on standard error before it aborts the
 * process; "clean" makes none and must exit 0. .ci/malloc.sh runs each one and checks both.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../include/thiscpu_malloc.h"

/* Weak: the program is run with the library preloaded. */
#pragma weak thiscpu_malloc_caching
#pragma weak thiscpu_malloc_release

/* Zeroes before 16-byte aligned storage: no chunk's size word. */
static _Alignas(16) unsigned char not_a_chunk[64];

int main(int argc, char **argv) {
    const char *scenario = argc > 1 ? argv[1] : "";
    /* The caches start with the first allocation; free a few objects so that there is
     * something cached. */
    void *warm[8];
    for (int i = 0; i < 8; i++) warm[i] = malloc(40);
    for (int i = 0; i < 8; i++) free(warm[i]);
    if (strcmp(scenario, "double") == 0) {
        char *p = malloc(40);
        char *volatile again = p; /* volatile: gcc would refuse the mistake at compile time */
        free(p);
        free(again);
    } else if (strcmp(scenario, "released") == 0) {
        /* The first free's object goes back past the caches to its heap span (the release
         * empties the caches), where the second must still be found; the objects made with it
         * keep its span in its class, so the object is on the span's free list. */
        void *kept[64];
        for (int i = 0; i < 64; i++) kept[i] = malloc(40);
        char *p = kept[32];
        char *volatile again = p;
        free(p);
        thiscpu_malloc_release();
        free(again);
        for (int i = 0; i < 64; i++)
            if (i != 32) free(kept[i]);
    } else if (strcmp(scenario, "unaligned") == 0) {
        char *volatile inside = (char *)malloc(100) + 4;
        free(inside);
    } else if (strcmp(scenario, "foreign") == 0) {
        void *volatile foreign = not_a_chunk + 32;
        free(foreign);
    } else if (strcmp(scenario, "clean") == 0) {
        for (int round = 0; round < 10000; round++) {
            char *p = malloc((size_t)(round % 2000) + 1);
            p = realloc(p, (size_t)(round % 500) + 1);
            free(p);
        }
        printf("clean: caching %d\n", thiscpu_malloc_caching());
        return 0;
    } else {
        fprintf(stderr, "usage: checking double|released|unaligned|foreign|clean\n");
        return 2;
    }
    printf("%s: not caught\n", scenario);
    return 1;
}
