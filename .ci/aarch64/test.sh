#!/usr/bin/env bash
# Builds thiscpu for aarch64-unknown-linux-gnu and runs its tests and the `thiscpu` command on
# real arm64 Linux kernels in qemu-system-aarch64, through .ci/aarch64/runner.sh: Debian's 6.1
# (rseq without node_id/mm_cid) for every step, and the newest kernel of Debian's sid (7.x:
# rseq feature size 33, alignment 64) for the tests under both registrations and the command.
# Run from anywhere; installs what is missing first (.ci/aarch64/setup.sh and
# .ci/kernels/setup.sh, root needed the first time).
#
# Under TCG booting and starting a test executable is what a short test costs most, and the
# whole job must stay a modest part of .ci/run's hour, so every test executable is built once
# and each kernel is booted once for every check that concerns it (as .ci/riscv64/test.sh
# does). Steps, each timed:
#   setup      .ci/aarch64/setup.sh, and sid's arm64 kernel from .ci/kernels/setup.sh
#   build      every test executable of the library, the stress driver and thiscpu-opentelemetry
#              (every feature; not the command's, see guest_packages in .ci/built-tests.sh), the
#              command and the fast-path probe; the unit tests and tests/optimiser.rs built with
#              --release (the miscompiled form of the rseq size clamp went wrong on aarch64
#              only); the static and the inject test executables. The workspace's own crates
#              are compiled through Debian's clippy-driver (same release as the compiler) with
#              -D warnings, so this also lints them for aarch64 without a second pass over the
#              dependencies
#   fast-path  .ci/check_fast_path.py on the aarch64 probe, through aarch64-linux-gnu-objdump
#   lts        one boot of Debian 12's 6.1 (rseq without node_id/mm_cid) that runs, one after
#              the other:
#                glibc    the tests of the library, of the stress driver and of
#                         thiscpu-opentelemetry, glibc registering rseq (the command's own
#                         tests check its parsing, output and reports, which no architecture
#                         changes: they run on the host; `cli` below runs the command here)
#                own      with GLIBC_TUNABLES=glibc.pthread.rseq=0, thiscpu registering its own
#                         area (legacy-mode on 6.1, like glibc's): the registration's tests
#                release  the --release unit tests and tests/optimiser.rs
#                off      the registration's tests with THISCPU_RSEQ=off: that arm64 decides
#                         for the portable path and answers through it (whose every test runs
#                         on x86_64, s390x, armv7 and Windows)
#                static   the core tests and the stresses linked with
#                         -C target-feature=+crt-static, glibc's rseq symbols found through the
#                         link
#                inject   the counter, pool, fence, sharded and registration tests and the
#                         stresses built with --cfg thiscpu_inject (delays inside sections,
#                         registrations the kernel accepts without a CPU), as .ci/run does on
#                         x86_64
#                cli      `thiscpu --help`, `info` (both registrations), `stress` and
#                         `bench --quick getcpu counter rseq-mode` (every family runs with
#                         --quick on the host; the times mean nothing under emulation)
#   doctests   the workspace's doctests on 6.1, through cargo: Debian's rustdoc builds them for
#              aarch64, merged into one executable per crate, and cargo hands each to the
#              runner (one boot each); they show the API's examples at work
#   new        one boot of sid's 7.x (rseq feature size 33, alignment 64) for what depends on
#              the kernel's rseq: every test of the library and of the stress driver under
#              thiscpu's own (optimized-mode) area, the registration's under glibc's, and cli
# The runs of a boot differ only in their environment (each line of the runner's manifest sets
# its own variables). A boot fails when any run in it fails; the runner ends with every run's
# exit code. A step that cannot run says why.
#
# Knobs: THISCPU_AARCH64_TARGET_DIR (default target/aarch64), THISCPU_VM_TIMEOUT (seconds per
# test executable in a VM run, default 300), THISCPU_AARCH64_JOBS (cargo -j, default 2).
set -euo pipefail

# The allocator's storms, short threads and forks (tests/per_cpu_alloc.rs), scaled to an
# emulated machine: 2,000 threads rather than 100,000, storms of 0.5 s rather than 2.5, 10
# forks of a busy process rather than 40 (the runner passes THISCPU_* variables into the
# guests).
export THISCPU_TEST_ALLOC_THREADS=2000 THISCPU_TEST_ALLOC_STORM_MS=500 THISCPU_TEST_ALLOC_FORKS=10

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
source .ci/busy.sh
triple=aarch64-unknown-linux-gnu
t_start=$SECONDS

step() {
    local name=$1 t0=$SECONDS ticks
    ticks=$(cpu_ticks 2>/dev/null || true)
    shift
    echo
    echo "=== aarch64 $name"
    "$@"
    echo "--- aarch64 $name: ok in $((SECONDS - t0)) s, $(cpus_busy "$ticks")"
}

run() {
    printf '+'
    printf ' %q' "$@"
    printf '\n'
    "$@"
}

tools=
new_kernel=
setup() {
    tools=$(bash .ci/aarch64/setup.sh | tail -n 1)
    echo "tools: $tools"
    new_kernel=$(bash .ci/kernels/setup.sh arm64/sid)
    echo "sid kernel: $new_kernel"
}
step setup setup

export THISCPU_AARCH64_TOOLS=$tools
export RUSTC=$tools/bin/rustc
export RUSTDOC=$tools/bin/rustdoc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER=$repo/.ci/aarch64/runner.sh
export CARGO_TARGET_DIR=${THISCPU_AARCH64_TARGET_DIR:-$repo/target/aarch64}
export CARGO_BUILD_JOBS=${THISCPU_AARCH64_JOBS:-2}
unset RUSTC_WRAPPER
# cargo-clippy would run rustup's clippy-driver, whose compiler does not match the aarch64
# standard library; Debian's clippy-driver is the wrapper compiler's twin. As a workspace
# wrapper it compiles the workspace's crates (the same code as rustc) and lints them; it reads
# its arguments from CLIPPY_ARGS, separated by __CLIPPY_HACKERY__, as cargo-clippy passes them.
# It stays set for every step so that no step rebuilds what another built.
if [ -x "$tools/bin/clippy-driver" ]; then
    export RUSTC_WORKSPACE_WRAPPER=$tools/bin/clippy-driver
    export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
else
    unset RUSTC_WORKSPACE_WRAPPER
    echo "(setup found no clippy-driver: building without aarch64 lints)"
fi

echo "rustc:  $("$RUSTC" --version)"
echo "cargo:  $(cargo --version)"
echo "qemu:   $(qemu-system-aarch64 --version | sed -n 1p)"
echo "guests: $(cat "$tools/guest/kernel-package" 2>/dev/null || echo '?')," \
    "$(cat "$new_kernel/package")"

# The C programs of thiscpu/tests/c, which the shared_library test builds itself where a C
# compiler is at hand; the guest has none, so they are cross-compiled here and the runner
# copies THISCPU_TEST_C_DIR into the guest.
export THISCPU_TEST_C_DIR=$CARGO_TARGET_DIR/c-tests
library_packages=(-p thiscpu -p thiscpu-stress)
cli_bin=$CARGO_TARGET_DIR/$triple/debug/thiscpu
# What the build step built: the guests' runs pick their test executables from it (the lists of
# tests are there too).
source .ci/built-tests.sh
tests_listing=$CARGO_TARGET_DIR/guest-tests.json
release_listing=$CARGO_TARGET_DIR/release-tests.json
static_listing=$CARGO_TARGET_DIR/static-tests.json
inject_listing=$CARGO_TARGET_DIR/inject-tests.json
build() {
    mkdir -p "$CARGO_TARGET_DIR"
    run cargo test "${guest_packages[@]}" --all-features --target "$triple" --no-run \
        --message-format=json-render-diagnostics >"$tests_listing"
    run cargo build -p thiscpu-cli --bin thiscpu --target "$triple"
    run cargo build --release -p thiscpu --example fast_path_probe --target "$triple"
    run cargo test --release "${library_packages[@]}" --lib --test optimiser --target "$triple" \
        --no-run --message-format=json-render-diagnostics >"$release_listing"
    # A statically linked program cannot be a cdylib: the core tests only. The static and the
    # inject builds each in a directory of their own, so that the dynamic build stays.
    run env RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR="$CARGO_TARGET_DIR/static" \
        cargo test "${library_packages[@]}" "${static_tests[@]}" --target "$triple" --no-run \
        --message-format=json-render-diagnostics >"$static_listing"
    run env RUSTFLAGS="--cfg thiscpu_inject" CARGO_TARGET_DIR="$CARGO_TARGET_DIR/inject" \
        cargo test "${library_packages[@]}" --test counter --test pool --test fence \
        --test sharded --test registration --test counter_stress --test pool_stress \
        --target "$triple" --no-run --message-format=json-render-diagnostics >"$inject_listing"
    run mkdir -p "$THISCPU_TEST_C_DIR"
    run aarch64-linux-gnu-gcc -O1 -pthread -o "$THISCPU_TEST_C_DIR/unload_host" \
        thiscpu/tests/c/unload_host.c
    run aarch64-linux-gnu-gcc -O1 -shared -fPIC -o "$THISCPU_TEST_C_DIR/libtls_words.so" \
        thiscpu/tests/c/tls_words.c
}
step build build

fast_path() {
    # check_fast_path.py calls `objdump`; for an aarch64 binary that must be the cross one. The
    # shim also drops the `#` that marks aarch64 immediates, which the script would take for
    # the start of an AT&T-syntax comment.
    local shim
    shim=$(mktemp -d)
    cat >"$shim/objdump" <<'SHIM'
#!/bin/sh
aarch64-linux-gnu-objdump "$@" | sed 's/#//g'
SHIM
    chmod +x "$shim/objdump"
    # mrs, the own offset (movz/movk once relaxed), adrp/ldr of the delta, add, ldr of
    # cpu_id: 7 instructions and the sign test (see thiscpu/src/arch/aarch64.rs).
    PATH="$shim:$PATH" run python3 .ci/check_fast_path.py --max-insns 7 \
        --binary "$CARGO_TARGET_DIR/$triple/release/examples/fast_path_probe"
    rm -rf "$shim"
}
step fast-path fast_path

runner=.ci/aarch64/runner.sh
own=(GLIBC_TUNABLES=glibc.pthread.rseq=0 THISCPU_EXPECT_REGISTRAR=thiscpu)

# The command's runs: the families whose answers depend on the kernel's rseq (every family runs
# with --quick in the command's tests on the host, and under emulation the times mean nothing).
add_cli() {
    {
        manifest_line / "$cli_bin" --help
        manifest_line / "$cli_bin" info
        manifest_line / "${own[0]}" "$cli_bin" info
        manifest_line / "$cli_bin" stress --seconds 2
        manifest_line / "$cli_bin" bench --quick getcpu counter rseq-mode
    } >>"$1"
}

# Boots the kernel $1 (the setup's 6.1 when empty) once for the manifest $2, after listing it.
boot() {
    echo "runs:"
    cat "$2"
    if [ -n "$1" ]; then
        THISCPU_VM_KERNEL=$1 run bash "$runner" --batch "$2"
    else
        run bash "$runner" --batch "$2"
    fi
}

lts() {
    local manifest=$CARGO_TARGET_DIR/vm-lts.manifest
    : >"$manifest"
    add_built "$manifest" "$tests_listing" THISCPU_EXPECT_REGISTRAR=glibc -- \
        "${library_tests[@]}" thiscpu-opentelemetry
    add_built "$manifest" "$tests_listing" "${own[@]}" -- "${registration_tests[@]}"
    add_built "$manifest" "$release_listing" THISCPU_EXPECT_REGISTRAR=glibc -- \
        "${library_tests[@]}"
    add_built "$manifest" "$tests_listing" THISCPU_RSEQ=off THISCPU_EXPECT_REGISTRAR=none -- \
        "${registration_tests[@]}"
    add_built "$manifest" "$static_listing" THISCPU_EXPECT_REGISTRAR=glibc -- \
        "${library_tests[@]}"
    add_built "$manifest" "$inject_listing" -- "${library_tests[@]}"
    add_cli "$manifest"
    boot "" "$manifest"
}
step lts lts

# Of the packages the build step built, with the same features (the command has no library,
# and the documentation of the C library's crate has no example to run).
doctests() {
    THISCPU_EXPECT_REGISTRAR=glibc run cargo test "${guest_packages[@]}" --all-features \
        --target "$triple" --doc
}
step doctests doctests

new() {
    local manifest=$CARGO_TARGET_DIR/vm-new.manifest
    : >"$manifest"
    # Every test under thiscpu's own area, an optimized-mode area here; glibc 2.36's, a
    # legacy-mode one, the registration's tests (the sections are the same code whichever area
    # they read, and every test runs under glibc's area on a 7.x kernel in the x86_64 7.x guest).
    add_built "$manifest" "$tests_listing" THISCPU_EXPECT_REGISTRAR=glibc -- \
        "${registration_tests[@]}"
    add_built "$manifest" "$tests_listing" "${own[@]}" -- "${library_tests[@]}"
    add_cli "$manifest"
    boot "$new_kernel/vmlinuz" "$manifest"
}
step new new

echo
echo "=== aarch64: all steps passed in $((SECONDS - t_start)) s"
