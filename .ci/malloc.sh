#!/usr/bin/env bash
# The C library (malloc/, libthiscpu_malloc.so and .a) under C programs and real programs:
#   stress   malloc/tests/stress.c: a burst of 400,000 objects freed and released, which must
#            give back 90 % of the memory it added; 4 C threads (every exported call, objects
#            freed by another thread, forks while they run); an address-space limit that must
#            end in ENOMEM. Run with LD_PRELOAD and linked with the static library
#   checking THISCPU_MALLOC_CHECK=1: the stress again, which must pass, and a double free (of
#            an object still cached, and of one a release gave back to its heap span), an
#            unaligned free and a free of static storage (malloc/tests/checking.c), each of
#            which must be reported before the process aborts
#   programs python3 (a JSON round trip), sort (300,000 lines), git (the log of this
#            repository) and gcc (compiling the stress program) with LD_PRELOAD, each one's
#            output compared byte for byte with its output on glibc's allocator; the dynamic
#            linker's record of its bindings shows that each program's malloc and free were
#            the library's, and python asks the library itself whether its caches served it
#
# Runs from the repository root; stops at the first failure.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

run() {
    printf '+'
    printf ' %q' "$@"
    printf '\n'
    "$@"
}

run cargo build --release -p thiscpu-malloc
lib=$PWD/target/release/libthiscpu_malloc.so
archive=$PWD/target/release/libthiscpu_malloc.a
work=target/malloc
rm -rf "$work"
mkdir -p "$work"

# --- stress ----------------------------------------------------------------------------------
run gcc -O2 -Wall -Wextra -Werror -pthread malloc/tests/stress.c -o "$work/stress-preload"
run gcc -O2 -Wall -Wextra -Werror -pthread malloc/tests/stress.c "$archive" -ldl -lm \
    -o "$work/stress-static"
run env LD_PRELOAD="$lib" timeout 300 "$work/stress-preload" 10
run timeout 300 "$work/stress-static" 10

# --- the checking mode -----------------------------------------------------------------------
# The stress again with THISCPU_MALLOC_CHECK=1, which must find nothing in a correct program;
# then each mistake of malloc/tests/checking.c, which it must report before it aborts.
run env THISCPU_MALLOC_CHECK=1 LD_PRELOAD="$lib" timeout 300 "$work/stress-preload" 2
run gcc -O2 -Wall -Wextra -Werror malloc/tests/checking.c -o "$work/checking"
run env THISCPU_MALLOC_CHECK=1 LD_PRELOAD="$lib" "$work/checking" clean
for mistake in double released unaligned foreign; do
    status=0
    THISCPU_MALLOC_CHECK=1 LD_PRELOAD="$lib" "$work/checking" "$mistake" \
        >/dev/null 2>"$work/checking.$mistake" || status=$?
    said=$(grep '^thiscpu_malloc: ' "$work/checking.$mistake" || true)
    echo "checking: $mistake: exit status $status: $said"
    if [ "$status" != 134 ] || [ -z "$said" ]; then
        echo "checking: the mistake '$mistake' was not reported and aborted"
        exit 1
    fi
done

# --- real programs ---------------------------------------------------------------------------
# interposed NAME COMMAND...: runs COMMAND on glibc's allocator and with the library preloaded,
# and fails unless both wrote the same bytes and the preloaded run bound malloc and free to
# the library.
interposed() {
    local name=$1
    shift
    echo "program: $name: $*"
    "$@" >"$work/$name.glibc"
    LD_DEBUG=bindings LD_DEBUG_OUTPUT="$work/$name.bindings" LD_PRELOAD="$lib" \
        "$@" >"$work/$name.thiscpu"
    if ! cmp -s "$work/$name.glibc" "$work/$name.thiscpu"; then
        echo "$name: the output with the library differs from glibc's:"
        diff "$work/$name.glibc" "$work/$name.thiscpu" | head -n 20
        return 1
    fi
    local symbol
    for symbol in malloc free; do
        if ! grep -q "to $lib .*normal symbol \`$symbol'" "$work/$name.bindings".*; then
            echo "$name: $symbol was not bound to the library"
            return 1
        fi
    done
    echo "$name: same $(wc -c <"$work/$name.glibc") bytes; malloc and free bound to the library"
}

# The JSON round trip's output must be the same; the library's own answer, on standard error,
# must say that its caches served it (this host has rseq).
echo "program: python3 malloc/tests/json_roundtrip.py"
python3 malloc/tests/json_roundtrip.py >"$work/python.glibc"
LD_PRELOAD="$lib" python3 malloc/tests/json_roundtrip.py >"$work/python.thiscpu" \
    2>"$work/python.answer"
run cmp "$work/python.glibc" "$work/python.thiscpu"
answer=$(cat "$work/python.answer")
echo "python with the library: $answer"
[ "$answer" = "caching 1 served True" ] || { echo "python: the library's caches did not serve it"; exit 1; }

run python3 -c '
import random
random.seed(1)
with open("target/malloc/lines.txt", "w") as out:
    for _ in range(300000):
        out.write("".join(random.choice("abcdefghij") for _ in range(random.randint(1, 60))) + "\n")
'
interposed sort sort "$work/lines.txt"
interposed git git log --stat -n 500
interposed gcc gcc -O2 -S -o - malloc/tests/stress.c
echo "malloc: the stress and the real programs passed"
