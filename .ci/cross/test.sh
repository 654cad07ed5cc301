#!/usr/bin/env bash
# Checks thiscpu and thiscpu-opentelemetry for targets other than this machine's, and runs their
# tests as s390x, armv7 and Windows programs, with Debian 13's compiler (.ci/cross/setup.sh).
# Run from anywhere; installs what is missing first (root needed the first time).
#
# Every build goes through Debian's clippy-driver (the compiler's twin) with -D warnings, so
# each also lints the workspace's crates for its target. Steps:
#   setup    .ci/cross/setup.sh
#   check    for aarch64-apple-darwin, x86_64-unknown-freebsd and wasm32-wasip1: `cargo
#            check` of thiscpu with every feature and of thiscpu-opentelemetry, then their
#            docs (rustdoc, warnings as errors). Debian ships no standard library for these:
#            -Zbuild-std checks one from rust-src, once per target (cached like the rest).
#            One macOS: away from Linux the library's code depends on the system, not on the
#            architecture (the architectures' files are Linux's rseq ports), so x86_64 macOS
#            would compile the same code as arm64 macOS
#   build    the tests of thiscpu and thiscpu-opentelemetry for the two targets below
#   s390x    the tests of thiscpu and thiscpu-opentelemetry built for s390x-unknown-linux-gnu
#            (64-bit, big-endian) and each test executable run under qemu-s390x
#   armv7    the same for armv7-unknown-linux-gnueabihf (32-bit) under qemu-arm
#   windows  the same for x86_64-pc-windows-gnu under wine, the standard library built with
#            -Zbuild-std and everything linked with mingw-w64
# qemu-user implements no rseq: glibc registers none and neither can thiscpu, so on s390x and
# armv7 the tests expect no registrar (THISCPU_EXPECT_REGISTRAR=none). They find the target's
# glibc (Debian 12's cross packages) through QEMU_LD_PREFIX, which the processes they start
# inherit. THISCPU_TEST_RUNNER names the emulator, for a test that runs its own executable
# again: without binfmt_misc the kernel cannot execute a foreign program, so such a run must
# start it through the emulator. The doctests are not run here (they are plain Rust, run
# natively by .ci/run).
#
# Each test executable runs from its package's directory, as `cargo test` runs it, under a time
# limit; a failure, a crash or a hang fails the step. Builds are cached in target/cross.
#
# Knobs: THISCPU_CROSS_TOOLS (the tool directory, default target/cross-tools),
# THISCPU_CROSS_TARGET_DIR (default target/cross), THISCPU_CROSS_TIMEOUT (seconds per test
# executable, default 120: each takes a few seconds under emulation, and a hang costs the whole
# limit), THISCPU_CROSS_JOBS (cargo -j, default 2).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
source .ci/busy.sh
t_start=$SECONDS

step() {
    local name=$1 t0=$SECONDS ticks
    ticks=$(cpu_ticks 2>/dev/null || true)
    shift
    echo
    echo "=== cross $name"
    "$@"
    echo "--- cross $name: ok in $((SECONDS - t0)) s, $(cpus_busy "$ticks")"
}

run() {
    printf '+'
    printf ' %q' "$@"
    printf '\n'
    "$@"
}

tools=
setup() {
    tools=$(bash .ci/cross/setup.sh | tail -n 1)
    echo "tools: $tools"
}
step setup setup

export RUSTC=$tools/bin/rustc
export RUSTDOC=$tools/bin/rustdoc
# -Zbuild-std on Debian's stable compiler.
export RUSTC_BOOTSTRAP=1
export CARGO_TARGET_DIR=${THISCPU_CROSS_TARGET_DIR:-$repo/target/cross}
export CARGO_BUILD_JOBS=${THISCPU_CROSS_JOBS:-2}
unset RUSTC_WRAPPER
# As in .ci/riscv64/test.sh: rustup's clippy-driver would not match Debian's standard library.
export RUSTC_WORKSPACE_WRAPPER=$tools/bin/clippy-driver
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
export RUSTDOCFLAGS="-D warnings"
export CARGO_TARGET_S390X_UNKNOWN_LINUX_GNU_LINKER=s390x-linux-gnu-gcc
export CARGO_TARGET_ARMV7_UNKNOWN_LINUX_GNUEABIHF_LINKER=arm-linux-gnueabihf-gcc
export CARGO_TARGET_X86_64_PC_WINDOWS_GNU_LINKER=x86_64-w64-mingw32-gcc
# setup's wine prefix (made once: making one takes longer than the tests), and the DLL that
# Debian 12's wine lacks (see bcryptprimitives.c) on its search path.
export WINEPREFIX=$tools/wine/prefix
export WINEARCH=win64
export WINEDEBUG=-all
export WINEPATH=$tools/wine/dll
timeout=${THISCPU_CROSS_TIMEOUT:-120}
packages=(-p thiscpu -p thiscpu-opentelemetry)

echo "rustc:  $("$RUSTC" --version)"
echo "clippy: $("$RUSTC_WORKSPACE_WRAPPER" --version)"
echo "cargo:  $(cargo --version)"
echo "qemu:   $(qemu-s390x --version | sed -n 1p)"
echo "wine:   $(wine --version)"

# Check, lint and document the targets whose standard library comes from rust-src, all in one
# invocation of each command: one target's standard library is mostly a chain of crates that
# wait for each other (core, alloc, std), so two targets build side by side on two CPUs.
check() {
    local targets=() triple
    for triple in aarch64-apple-darwin x86_64-unknown-freebsd wasm32-wasip1; do
        targets+=(--target "$triple")
    done
    run cargo check -Zbuild-std "${targets[@]}" "${packages[@]}" --all-features
    run cargo doc -Zbuild-std "${targets[@]}" --no-deps "${packages[@]}" --all-features
}
step check check

# run_tests TRIPLE RUNNER... -- CARGO-ARGS...: builds the tests of the two packages for TRIPLE
# and runs every test executable through RUNNER (with --test-threads=2: the machine has 2
# CPUs), from its package's directory.
run_tests() {
    local triple=$1 runner=() args=()
    shift
    while [ "$1" != -- ]; do
        runner+=("$1")
        shift
    done
    shift
    args=("$@")
    run cargo test "${args[@]}" --target "$triple" "${packages[@]}" --no-run
    local listing
    listing=$(mktemp)
    cargo test "${args[@]}" --target "$triple" "${packages[@]}" --no-run \
        --message-format=json-render-diagnostics >"$listing"
    local tests=()
    mapfile -t tests < <(jq -rR 'fromjson? | select(.reason == "compiler-artifact"
        and .profile.test and .executable != null)
        | (.manifest_path | rtrimstr("/Cargo.toml")) + "\t" + .executable' "$listing" |
        awk '!seen[$0]++')
    rm -f "$listing"
    [ ${#tests[@]} -gt 0 ] || { echo "cargo built no test executable for $triple"; return 1; }
    local entry dir exe t0 failed=()
    for entry in "${tests[@]}"; do
        dir=${entry%%$'\t'*}
        exe=${entry#*$'\t'}
        t0=$SECONDS
        if (cd "$dir" && run timeout "$timeout" "${runner[@]}" "$exe" --test-threads=2); then
            echo "(${exe##*/}: $((SECONDS - t0)) s)"
        else
            echo "FAILED: ${exe##*/} (exit $?, $((SECONDS - t0)) s)"
            failed+=("${exe##*/}")
        fi
    done
    if [ ${#failed[@]} -gt 0 ]; then
        echo "${#failed[@]} of ${#tests[@]} test executables failed for $triple: ${failed[*]}"
        return 1
    fi
    echo "${#tests[@]} test executables passed for $triple"
}

linux_tests() {
    local triple=$1 emulator=$2 gnu=$3
    (
        export QEMU_LD_PREFIX=/usr/$gnu THISCPU_TEST_RUNNER=$emulator
        export THISCPU_EXPECT_REGISTRAR=none
        # The allocator's storms, short threads and forks (tests/per_cpu_alloc.rs), scaled to
        # emulation: every thread qemu-user starts, and every fork, is slow.
        export THISCPU_TEST_ALLOC_THREADS=1000 THISCPU_TEST_ALLOC_STORM_MS=500
        export THISCPU_TEST_ALLOC_FORKS=10
        run_tests "$triple" "$emulator" --
    )
}
# The s390x and armv7 test executables in one invocation, two targets side by side on two CPUs
# (a single target's build leaves one idle while its last crates link); their steps then find
# them built.
build_linux_tests() {
    run cargo test --target s390x-unknown-linux-gnu --target armv7-unknown-linux-gnueabihf \
        "${packages[@]}" --no-run
}
step build build_linux_tests
step s390x linux_tests s390x-unknown-linux-gnu qemu-s390x s390x-linux-gnu
step armv7 linux_tests armv7-unknown-linux-gnueabihf qemu-arm arm-linux-gnueabihf

windows_tests() {
    # One wine server for every test executable. Left to itself, wine starts a server with the
    # first program and the server exits a few seconds after the last one; a program started
    # as it exits loses its connection ("wine client error:0: recvmsg: Connection reset by
    # peer"), which failed a test executable that had not run at all, on a loaded host.
    wineserver --persistent
    # The job ends with the server, however it ends, so that nothing of it is left running. A
    # trap rather than `run_tests ... || rc=$?`: under `||` bash ignores `set -e` inside the
    # function, and a failed build would go on to run the executables an earlier build left.
    trap 'wineserver --kill >/dev/null 2>&1 || true; wineserver --wait >/dev/null 2>&1 || true' \
        EXIT
    run_tests x86_64-pc-windows-gnu wine -- -Zbuild-std
}
step windows windows_tests

echo
echo "=== cross: all steps passed in $((SECONDS - t_start)) s"
