#!/usr/bin/env bash
# Builds thiscpu for aarch64-unknown-linux-gnu and runs its tests and the `thiscpu` command on
# real arm64 Linux kernels in qemu-system-aarch64, through .ci/aarch64/runner.sh: Debian's 6.1
# (rseq without node_id/mm_cid) for every step, and the newest kernel of Debian's sid (7.x:
# rseq feature size 33, alignment 64) for the tests under both registrations and the command.
# Run from anywhere; installs what is missing first (.ci/aarch64/setup.sh and
# .ci/kernels/setup.sh, root needed the first time).
#
# Steps, each timed:
#   setup        .ci/aarch64/setup.sh, and sid's arm64 kernel from .ci/kernels/setup.sh
#   build        every test executable of the workspace, the command, and the fast-path probe;
#                the workspace's own crates are compiled through Debian's clippy-driver (same
#                release as the compiler) with -D warnings, so this also lints them for
#                aarch64 without a second pass over the dependencies
#   test-glibc   the tests of the library, of the stress driver (thiscpu-stress) and of
#                thiscpu-opentelemetry in the VM, glibc registering rseq, and their doctests
#                (the command's own tests check its parsing, output and reports, which no
#                architecture changes: they run on the host, and the `cli` steps below run the
#                command itself here)
#   test-own     with GLIBC_TUNABLES=glibc.pthread.rseq=0, thiscpu registering its own area: a
#                legacy-mode area on 6.1 like glibc's, so the tests of the registration and
#                of what it reports (on sid's kernel, every test of the library and of the
#                stress driver)
#   test-release the unit tests of both and tests/optimiser.rs, built with --release
#   test-off     the registration's tests with THISCPU_RSEQ=off: the fallback without rseq
#   test-static  the core tests and the stresses linked with -C target-feature=+crt-static
#   inject       the counter, pool, fence, sharded and registration tests and the stresses
#                built with --cfg thiscpu_inject (delays inside sections, registrations the
#                kernel accepts without a CPU), as .ci/run does on x86_64
#   cli          `thiscpu --help`, `info`, `stress` and `bench --quick getcpu counter rseq-mode`
#                (every family runs with --quick on the host, in the command's tests and in
#                .ci/bench-smoke.sh; what the other families measure is the library's, whose
#                tests run here)
#   fast-path    .ci/check_fast_path.py on the aarch64 probe, through aarch64-linux-gnu-objdump
#   sid-test-glibc, sid-test-own, sid-cli
#                on sid's kernel: the tests of the library and of the stress driver under
#                thiscpu's own (optimized-mode) area, the registration's under glibc's, and cli
#                (the command's tests only on 6.1); the builds are the same,
#                and the steps that do not depend on the kernel's rseq (test-off, static,
#                inject's delays, fast-path) run on 6.1 only, to stay within the time budget
#
# A test step boots one guest for all of its test executables (vm_test below: booting is
# most of what a short test costs under TCG, and there are about 25 executables), each run
# from its package's root with the step's environment; the step fails when any of them
# fails. Doctests run too, through cargo: Debian's rustdoc (same release as the compiler)
# builds them for aarch64, merged into one executable, and cargo hands it to the runner, one
# more boot, once (test-glibc on 6.1): they show the API's examples at work, and the host runs
# them under every registration. A step that cannot run says why.
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
triple=aarch64-unknown-linux-gnu
t_start=$SECONDS

step() {
    local name=$1 t0=$SECONDS
    shift
    echo
    echo "=== aarch64 $name"
    "$@"
    echo "--- aarch64 $name: ok in $((SECONDS - t0)) s"
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
# What the build step built: the library's runs pick their test executables from it.
source .ci/built-tests.sh
workspace_listing=$CARGO_TARGET_DIR/workspace-tests.json
build() {
    # The command's tests need the command: this builds it too.
    mkdir -p "$CARGO_TARGET_DIR"
    run cargo test --workspace --target "$triple" --no-run \
        --message-format=json-render-diagnostics >"$workspace_listing"
    run cargo build --release -p thiscpu --example fast_path_probe --target "$triple"
    run mkdir -p "$THISCPU_TEST_C_DIR"
    run aarch64-linux-gnu-gcc -O1 -pthread -o "$THISCPU_TEST_C_DIR/unload_host" \
        thiscpu/tests/c/unload_host.c
    run aarch64-linux-gnu-gcc -O1 -shared -fPIC -o "$THISCPU_TEST_C_DIR/libtls_words.so" \
        thiscpu/tests/c/tls_words.c
}
step build build

# `cargo test ARGS` for the guest: builds the test executables that command would run, lists
# them with their packages' roots from cargo's JSON messages, and runs them all in one boot
# (runner.sh --batch; booting is most of what a short test costs under TCG), each from its
# package's root as cargo does. The step fails when any of them fails; the runner ends with
# every executable's exit code. The manifest stays in the target directory, so that the last
# batch can be run again by hand.
runner=.ci/aarch64/runner.sh
vm_test() {
    local listing=$CARGO_TARGET_DIR/vm-test.json manifest=$CARGO_TARGET_DIR/vm-test.manifest
    mkdir -p "$CARGO_TARGET_DIR"
    run cargo test "$@" --target "$triple" --no-run --message-format=json-render-diagnostics \
        >"$listing"
    # run's echo of the command is the one line that is not JSON.
    jq -rR 'fromjson? | select(.reason == "compiler-artifact" and .profile.test
        and .executable != null)
        | (.manifest_path | rtrimstr("/Cargo.toml")) + "\t" + .executable' "$listing" |
        awk '!seen[$0]++' >"$manifest"
    rm -f "$listing"
    cat "$manifest"
    run bash "$runner" --batch "$manifest"
}

# vm_built SELECTOR...: as vm_test, for the build step's test executables that the selectors
# name (see .ci/built-tests.sh), which no other selection of packages compiles again.
vm_built() {
    local manifest=$CARGO_TARGET_DIR/vm-test.manifest
    built_tests "$workspace_listing" "$@" >"$manifest" || return 1
    cat "$manifest"
    run bash "$runner" --batch "$manifest"
}

# The doctests: rustdoc builds them and hands them to the runner through cargo, merged into one
# executable per crate (edition 2024), so this is one more boot. Of the whole workspace, whose
# libraries the build step built with these features (the command has no doctests).
vm_doctests() {
    run cargo test --workspace --target "$triple" --doc
}

# The command's own tests (cli/tests) took 194 s of a 314 s test-glibc here (a quick bench of
# every family, and `stress` with 1,024 threads, under TCG) and check nothing an architecture
# changes: they run on the host. thiscpu-opentelemetry's run once, with glibc's registration
# on 6.1, and the doctests once; the other runs test the library, as .ci/run's test-own does,
# and the `cli` steps run the command on both kernels.
library_packages=(-p thiscpu -p thiscpu-stress)
# The runs of the library's tests take every optional feature (the metrics backends' and
# serde's tests), which is also the library as the build step built it for the command: no
# step builds the library again.
library_tests=(thiscpu thiscpu-stress)
test_glibc() (
    export THISCPU_EXPECT_REGISTRAR=glibc
    vm_built "${library_tests[@]}" thiscpu-opentelemetry
    vm_doctests
)
step test-glibc test_glibc

# thiscpu's own registration. On 6.1 it is a legacy-mode area like glibc's, which differs only in
# where it lies: the tests of the registration and of what it reports run under it (the rest of
# the suite ran under glibc's above). On sid's kernel it is an optimized-mode area and every
# test runs under it; glibc 2.36's area, a legacy-mode one, runs the registration's tests there
# (the sections are the same code whichever area they read, and every test runs under glibc's
# area on a 7.x kernel in the x86_64 7.x guest).
registration_tests=(thiscpu:lib thiscpu:identity thiscpu:registration thiscpu:fallback
    thiscpu:topology thiscpu:mm_cid thiscpu:counter thiscpu:shared_library)
sid_test_glibc() (
    export THISCPU_EXPECT_REGISTRAR=glibc
    vm_built "${registration_tests[@]}"
)
test_own() (
    export GLIBC_TUNABLES=glibc.pthread.rseq=0 THISCPU_EXPECT_REGISTRAR=thiscpu
    vm_built "${registration_tests[@]}"
)
step test-own test_own
sid_test_own() (
    export GLIBC_TUNABLES=glibc.pthread.rseq=0 THISCPU_EXPECT_REGISTRAR=thiscpu
    vm_built "${library_tests[@]}"
)

# The library's unit tests and the optimiser's test, optimised, as .ci/run does on x86_64: the
# miscompiled form of the rseq size clamp (tests/optimiser.rs) went wrong on aarch64 only.
test_release() (
    export THISCPU_EXPECT_REGISTRAR=glibc
    vm_test --release "${library_packages[@]}" --lib --test optimiser
)
step test-release test_release

# Without rseq the library answers through the getcpu system call (arm64 has neither a vDSO
# getcpu nor an instruction for it), counters add atomically and pools lock: its portable path,
# the same code on every architecture, whose every test runs on x86_64 (.ci/run's test-off)
# and as s390x, armv7 and Windows programs (.ci/cross). Here, the registration's tests: that
# arm64 decides for that path and answers through it as they do.
test_off() (
    export THISCPU_RSEQ=off THISCPU_EXPECT_REGISTRAR=none
    vm_built "${registration_tests[@]}"
)
step test-off test_off

# Linked statically, glibc's rseq symbols come from the link (weak references), not dlsym: the
# registration, identity, counter and pool tests and the stresses, expecting glibc's area. A
# directory of its own keeps the dynamic build.
test_static() (
    export RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR="$CARGO_TARGET_DIR/static"
    export THISCPU_EXPECT_REGISTRAR=glibc
    vm_test "${library_packages[@]}" --test registration --test identity --test counter \
        --test pool --test counter_stress --test pool_stress
)
step test-static test_static

# Same layout as .ci/run: an instrumented build in a directory of its own.
inject() (
    export RUSTFLAGS="--cfg thiscpu_inject" CARGO_TARGET_DIR="$CARGO_TARGET_DIR/inject"
    vm_test "${library_packages[@]}" --test counter --test pool --test fence --test sharded \
        --test registration --test counter_stress --test pool_stress
)
step inject inject

cli_bin=$CARGO_TARGET_DIR/$triple/debug/thiscpu
# The families whose answers depend on the kernel's rseq; every family runs with --quick in the
# command's tests (test-glibc), and under emulation the times mean nothing.
bench_families=(getcpu counter rseq-mode)
# One line of a runner manifest: its arguments separated by tabs.
manifest_line() {
    local IFS=$'\t'
    printf '%s\n' "$*"
}
# The runs with the step's environment in one boot; the one that sets glibc's tunables in a
# boot of its own.
cli() {
    local manifest=$CARGO_TARGET_DIR/vm-cli.manifest
    {
        manifest_line / "$cli_bin" --help
        manifest_line / "$cli_bin" info
        manifest_line / "$cli_bin" stress --seconds 2
        manifest_line / "$cli_bin" bench --quick "${bench_families[@]}"
    } >"$manifest"
    cat "$manifest"
    run bash "$runner" --batch "$manifest"
    (export GLIBC_TUNABLES=glibc.pthread.rseq=0 && run bash "$runner" "$cli_bin" info)
}
step cli cli

fast_path() {
    # check_fast_path.py calls `objdump`; for an aarch64 binary that must be the cross one. The
    # shim also drops the `#` that marks aarch64 immediates, which the script would take for
    # the start of an AT&T-syntax comment.
    local shim
    shim=$(mktemp -d)
    cat >"$shim/objdump" <<'EOF'
#!/bin/sh
aarch64-linux-gnu-objdump "$@" | sed 's/#//g'
EOF
    chmod +x "$shim/objdump"
    # mrs, the own offset (movz/movk once relaxed), adrp/ldr of the delta, add, ldr of
    # cpu_id: 7 instructions and the sign test (see thiscpu/src/arch/aarch64.rs).
    PATH="$shim:$PATH" run python3 .ci/check_fast_path.py --max-insns 7 \
        --binary "$CARGO_TARGET_DIR/$triple/release/examples/fast_path_probe"
    rm -rf "$shim"
}
step fast-path fast_path

# The same executables on sid's kernel.
export THISCPU_VM_KERNEL=$new_kernel/vmlinuz
step sid-test-glibc sid_test_glibc
step sid-test-own sid_test_own
step sid-cli cli

echo
echo "=== aarch64: all steps passed in $((SECONDS - t_start)) s"
