/* A library with initial-exec TLS words, loaded after the thiscpu library was unloaded: it may
 * be given the static TLS that library had, and nothing may write its words but itself. */
#define WORDS 64

static __thread __attribute__((tls_model("initial-exec"))) unsigned words[WORDS];

void tls_fill(unsigned pattern) {
    for (int i = 0; i < WORDS; i++)
        words[i] = pattern + (unsigned)i;
}

int tls_mismatches(unsigned pattern) {
    int mismatches = 0;
    for (int i = 0; i < WORDS; i++)
        mismatches += words[i] != pattern + (unsigned)i;
    return mismatches;
}
