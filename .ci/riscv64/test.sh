#!/usr/bin/env bash
# Builds thiscpu for riscv64gc-unknown-linux-gnu and runs its tests and the `thiscpu` command on
# real riscv64 Linux kernels in qemu-system-riscv64 (TCG), through the arm64 job's runner
# (.ci/aarch64/runner.sh with THISCPU_VM_ARCH=riscv64): Debian 13's long-term kernel (6.12)
# and the newest kernel of Debian's sid (7.x: rseq feature size 33, alignment 64). Run from
# anywhere; installs what is missing first (.ci/riscv64/setup.sh and .ci/kernels/setup.sh,
# root needed the first time).
#
# Under TCG booting and starting a test executable is what a short test costs most, and the
# whole job must stay a modest part of .ci/run's hour, so every test executable is built once
# and each kernel is booted once, for every check that concerns it:
#   setup    .ci/riscv64/setup.sh, and trixie's and sid's riscv64 kernels
#   build    every test executable of the library, the stress driver and
#            thiscpu-opentelemetry (every feature; not the command's, see guest_packages in
#            .ci/built-tests.sh), the command, the fast-path probe and the static test
#            executables; the workspace's own crates are compiled through
#            Debian's clippy-driver (the compiler's twin) with -D warnings, so this also lints
#            them for riscv64
#   fast-path  .ci/check_fast_path.py on the riscv64 probe, through riscv64-linux-gnu-objdump
#   lts      one boot of 6.12 that runs, one after the other:
#              glibc    the tests of the library, the stress driver and thiscpu-opentelemetry,
#                       glibc registering rseq (the command's own tests check its parsing,
#                       output and reports, which no architecture changes: they run on the
#                       host; `cli` below runs the command here)
#              own      with GLIBC_TUNABLES=glibc.pthread.rseq=0, thiscpu registering its own
#                       area (legacy-mode, like glibc's): the tests of the registration and of
#                       what it reports
#              off      the same with THISCPU_RSEQ=off: that the library decides for its
#                       portable path here (whose every test runs on x86_64, s390x, armv7
#                       and Windows)
#              static   the registration, identity, counter and pool tests and the stresses,
#                       linked with -C target-feature=+crt-static; they carry Debian 12's
#                       glibc 2.36, whose riscv64 build does not register rseq, so they
#                       expect thiscpu's own registration, having found glibc's rseq
#                       symbols through the link
#              cli      `thiscpu --help`, `info` (both registrations), `stress`, and
#                       `bench --quick getcpu counter` (every family runs with --quick on the
#                       host; the times mean nothing under emulation)
#   new      one boot of sid's 7.x for what depends on the kernel's rseq: every test of the
#            library under thiscpu's own (optimized-mode) area, the registration's tests under
#            glibc's, `info` with both and `stress`
# The programs link against Debian 12's cross glibc (2.36) and run in the guests with trixie's
# (2.41, from setup.sh), which registers rseq on riscv64: 2.36's riscv64 build does not.
# The runs of a boot differ only in their environment (each line of the runner's manifest
# sets its own variables). A boot fails when any run in it fails; the runner ends with every
# run's exit code. Not run here, to stay within the time budget: the doctests (plain Rust,
# run on x86_64 and aarch64), the --release tests and the inject build (x86_64 and aarch64 run
# them; the sections they exercise are the ones the tests above run).
#
# Knobs: THISCPU_RISCV64_TARGET_DIR (default target/riscv64), THISCPU_VM_TIMEOUT (seconds per
# run in a VM, default 300), THISCPU_RISCV64_JOBS (cargo -j, default 2).
set -euo pipefail

# The allocator's storms, short threads and forks (tests/per_cpu_alloc.rs), scaled to an
# emulated machine: 2,000 threads rather than 100,000, storms of 0.5 s rather than 2.5, 10
# forks of a busy process rather than 40 (the runner passes THISCPU_* variables into the
# guests).
export THISCPU_TEST_ALLOC_THREADS=2000 THISCPU_TEST_ALLOC_STORM_MS=500 THISCPU_TEST_ALLOC_FORKS=10

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
source .ci/busy.sh
triple=riscv64gc-unknown-linux-gnu
t_start=$SECONDS

step() {
    local name=$1 t0=$SECONDS ticks
    ticks=$(cpu_ticks 2>/dev/null || true)
    shift
    echo
    echo "=== riscv64 $name"
    "$@"
    echo "--- riscv64 $name: ok in $((SECONDS - t0)) s, $(cpus_busy "$ticks")"
}

run() {
    printf '+'
    printf ' %q' "$@"
    printf '\n'
    "$@"
}

tools=
lts_kernel=
new_kernel=
setup() {
    tools=$(bash .ci/riscv64/setup.sh | tail -n 1)
    echo "tools: $tools"
    local kernels
    kernels=$(bash .ci/kernels/setup.sh riscv64/trixie riscv64/sid)
    lts_kernel=$(sed -n 1p <<<"$kernels")
    new_kernel=$(sed -n 2p <<<"$kernels")
    echo "kernels: $lts_kernel $new_kernel"
}
step setup setup

export THISCPU_VM_ARCH=riscv64
export THISCPU_RISCV64_TOOLS=$tools
export THISCPU_RISCV64_SYSROOT=$tools/sysroot
export RUSTC=$tools/bin/rustc
export RUSTDOC=$tools/bin/rustdoc
export CARGO_TARGET_RISCV64GC_UNKNOWN_LINUX_GNU_LINKER=riscv64-linux-gnu-gcc
export CARGO_TARGET_DIR=${THISCPU_RISCV64_TARGET_DIR:-$repo/target/riscv64}
export CARGO_BUILD_JOBS=${THISCPU_RISCV64_JOBS:-2}
unset RUSTC_WRAPPER
# As in .ci/aarch64/test.sh: Debian's clippy-driver compiles the workspace's crates and lints
# them (rustup's would not match the riscv64 standard library).
if [ -x "$tools/bin/clippy-driver" ]; then
    export RUSTC_WORKSPACE_WRAPPER=$tools/bin/clippy-driver
    export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
else
    unset RUSTC_WORKSPACE_WRAPPER
    echo "(setup found no clippy-driver: building without riscv64 lints)"
fi
runner=$repo/.ci/aarch64/runner.sh

echo "rustc:  $("$RUSTC" --version)"
echo "cargo:  $(cargo --version)"
echo "qemu:   $(qemu-system-riscv64 --version | sed -n 1p)"
echo "guests: $(cat "$lts_kernel/package"), $(cat "$new_kernel/package")"

# The C programs of thiscpu/tests/c, which the shared_library test runs: the guest has no C
# compiler, so they are cross-compiled here and the runner copies THISCPU_TEST_C_DIR in.
export THISCPU_TEST_C_DIR=$CARGO_TARGET_DIR/c-tests
library_packages=(-p thiscpu -p thiscpu-stress)
static_selectors=(thiscpu:registration thiscpu:identity thiscpu:counter thiscpu:pool
    thiscpu-stress:counter_stress thiscpu-stress:pool_stress)
static_env=(RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR="$CARGO_TARGET_DIR/static")

cli_bin=$CARGO_TARGET_DIR/$triple/debug/thiscpu
# What the build step built: the guests' runs pick their test executables from it.
source "$repo/.ci/built-tests.sh"
tests_listing=$CARGO_TARGET_DIR/guest-tests.json
static_listing=$CARGO_TARGET_DIR/static-tests.json
build() {
    # This also builds the command, which the command's own tests run: no `cargo build --bins`
    # (whose different feature set would build the dependencies a second time).
    mkdir -p "$CARGO_TARGET_DIR"
    run cargo test "${guest_packages[@]}" --all-features --target "$triple" --no-run \
        --message-format=json-render-diagnostics >"$tests_listing"
    run cargo build -p thiscpu-cli --bin thiscpu --target "$triple"
    run cargo build --release -p thiscpu --example fast_path_probe --target "$triple"
    # A statically linked program cannot be a cdylib: the core tests only, in a directory of
    # their own so that the dynamic build stays.
    run env "${static_env[@]}" cargo test "${library_packages[@]}" "${static_tests[@]}" \
        --target "$triple" --no-run --message-format=json-render-diagnostics >"$static_listing"
    run mkdir -p "$THISCPU_TEST_C_DIR"
    run riscv64-linux-gnu-gcc -O1 -pthread -o "$THISCPU_TEST_C_DIR/unload_host" \
        thiscpu/tests/c/unload_host.c
    run riscv64-linux-gnu-gcc -O1 -shared -fPIC -o "$THISCPU_TEST_C_DIR/libtls_words.so" \
        thiscpu/tests/c/tls_words.c
}
step build build

fast_path() {
    # check_fast_path.py calls `objdump`; for a riscv64 binary that must be the cross one.
    local shim
    shim=$(mktemp -d)
    printf '#!/bin/sh\nexec riscv64-linux-gnu-objdump "$@"\n' >"$shim/objdump"
    chmod +x "$shim/objdump"
    # The own offset (auipc/ld of its GOT entry), auipc/ld of the delta, add, add of tp, lw of
    # cpu_id, and the sext.w that LLVM adds after it: 8 instructions and the sign test (see
    # thiscpu/src/arch/riscv64.rs).
    PATH="$shim:$PATH" run python3 .ci/check_fast_path.py --max-insns 8 \
        --binary "$CARGO_TARGET_DIR/$triple/release/examples/fast_path_probe"
    rm -rf "$shim"
}
step fast-path fast_path

own=(GLIBC_TUNABLES=glibc.pthread.rseq=0 THISCPU_EXPECT_REGISTRAR=thiscpu)

# Boots $1 once for the manifest $2 (written by the caller), after listing it.
boot() {
    echo "runs:"
    cat "$2"
    THISCPU_VM_KERNEL=$1/vmlinuz run bash "$runner" --batch "$2"
}

lts() {
    local manifest=$CARGO_TARGET_DIR/vm-lts.manifest
    : >"$manifest"
    add_built "$manifest" "$tests_listing" THISCPU_EXPECT_REGISTRAR=glibc -- \
        "${library_tests[@]}" thiscpu-opentelemetry
    # thiscpu's own area is a legacy-mode area on 6.12, like glibc's: the tests of the
    # registration and of what it reports (on 7.x, in `new`, every test).
    add_built "$manifest" "$tests_listing" "${own[@]}" -- "${registration_tests[@]}"
    # Without rseq the library takes its portable path, whose code is the same on every
    # architecture and whose every test runs on x86_64 (test-off) and as s390x, armv7 and
    # Windows programs: here, that riscv64 decides for it and answers through it as they do.
    add_built "$manifest" "$tests_listing" THISCPU_RSEQ=off THISCPU_EXPECT_REGISTRAR=none -- \
        "${registration_tests[@]}"
    add_built "$manifest" "$static_listing" THISCPU_EXPECT_REGISTRAR=thiscpu -- \
        "${static_selectors[@]}"
    {
        manifest_line / "$cli_bin" --help
        manifest_line / "$cli_bin" info
        manifest_line / "${own[0]}" "$cli_bin" info
        manifest_line / "$cli_bin" stress --seconds 2
        # Two families: every family runs with --quick on the host (the command's tests and
        # .ci/bench-smoke.sh), and what the others measure is the library's, tested above.
        manifest_line / "$cli_bin" bench --quick getcpu counter
    } >>"$manifest"
    boot "$lts_kernel" "$manifest"
}
step lts lts

new() {
    local manifest=$CARGO_TARGET_DIR/vm-new.manifest
    : >"$manifest"
    # Every test under thiscpu's own area, which is an optimized-mode area here; glibc's, the
    # registration's tests (every test under glibc's area on 7.x runs in the x86_64 7.x guest).
    add_built "$manifest" "$tests_listing" THISCPU_EXPECT_REGISTRAR=glibc -- \
        "${registration_tests[@]}"
    add_built "$manifest" "$tests_listing" "${own[@]}" -- "${library_tests[@]}"
    {
        manifest_line / "$cli_bin" info
        manifest_line / "${own[0]}" "$cli_bin" info
        manifest_line / "$cli_bin" stress --seconds 2
    } >>"$manifest"
    boot "$new_kernel" "$manifest"
}
step new new

echo
echo "=== riscv64: all steps passed in $((SECONDS - t_start)) s"
