# Sourced by the guest jobs (.ci/aarch64/test.sh, .ci/riscv64/test.sh): picks test executables
# out of one build's listing instead of asking cargo again.
#
# Why: each selection of packages unifies the dependencies' features its own way, so asking
# cargo per selection compiled the library and part of its dependencies once more (76 s of
# riscv64's 6.12 step, on the AMD host). The build step's one `cargo test` of guest_packages
# holds every test executable the guests run.

# built_tests LISTING SELECTOR...: one line "PACKAGE-ROOT<TAB>EXECUTABLE" per test executable
# in LISTING (cargo's JSON messages of a `--no-run` build) that a SELECTOR names: `PACKAGE`
# (all of that package's test executables), `PACKAGE:lib` (its unit tests) or `PACKAGE:TEST`
# (one integration test). Fails when a selector names nothing, so that a renamed test cannot
# drop out of a run unseen.
built_tests() {
    local listing=$1 selectors lines selector
    shift
    selectors=$(printf '%s\n' "$@" | jq -R . | jq -s .)
    lines=$(jq -rR --argjson selectors "$selectors" '
        fromjson? | select(.reason == "compiler-artifact" and .profile.test
            and .executable != null)
        | ((.package_id | capture("#(?<name>[^@]+)@") | .name)
            // (.manifest_path | rtrimstr("/Cargo.toml") | split("/") | last)) as $package
        | (if (.target.kind | index("lib")) then "lib" else .target.name end) as $target
        | select($selectors | index($package) or index($package + ":" + $target))
        | [$package + ":" + $target, (.manifest_path | rtrimstr("/Cargo.toml")), .executable]
        | @tsv' "$listing" | awk '!seen[$0]++') || return 1
    for selector in "$@"; do
        if ! awk -F '\t' -v s="$selector" \
            '$1 == s || index($1, s ":") == 1 { found = 1 } END { exit !found }' <<<"$lines"; then
            echo "built_tests: $selector names no test executable of $listing" >&2
            return 1
        fi
    done
    cut -f 2- <<<"$lines"
}

# The selections every job names alike.
# What the build step compiles tests of: the packages whose tests the guests run, with every
# optional feature. Not the command's tests, which check parsing, output and reports that no
# architecture changes and run on the host (building them and their dependencies took 26 s of
# an aarch64 build of 144 s here); the guests run the command itself, built on its own.
guest_packages=(-p thiscpu -p thiscpu-stress -p thiscpu-opentelemetry)
# The library's and the stress driver's every test executable (the library with every optional
# feature, as guest_packages' build has it).
library_tests=(thiscpu thiscpu-stress)
# The tests of the registration and of what it reports: what differs between glibc's area and
# thiscpu's own, and between rseq and the portable path (a kernel without the optimized mode
# makes thiscpu's own area a legacy-mode one like glibc's, which differs only in where it lies).
registration_tests=(thiscpu:lib thiscpu:identity thiscpu:registration thiscpu:fallback
    thiscpu:topology thiscpu:mm_cid thiscpu:counter thiscpu:shared_library)
# What a statically linked build runs: the tests of how glibc's symbols were found (through the
# link's weak references, not dlsym) and of what rests on them.
static_tests=(--test registration --test identity --test counter --test pool
    --test counter_stress --test pool_stress)

# One line of a guest runner's manifest (.ci/aarch64/runner.sh): its fields separated by tabs.
manifest_line() {
    local IFS=$'\t'
    printf '%s\n' "$*"
}

# add_built MANIFEST LISTING VAR=VALUE... -- SELECTOR...: appends to MANIFEST one run per test
# executable of LISTING that the selectors name, from its package's root as cargo runs it, with
# the variables given.
add_built() {
    local manifest=$1 listing=$2 vars=() lines dir exe
    shift 2
    while [ "$1" != -- ]; do
        vars+=("$1")
        shift
    done
    shift
    lines=$(built_tests "$listing" "$@") || return 1
    while IFS=$'\t' read -r dir exe; do
        manifest_line "$dir" "${vars[@]}" "$exe" >>"$manifest"
    done <<<"$lines"
}
