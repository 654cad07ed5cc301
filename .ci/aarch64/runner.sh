#!/usr/bin/env bash
# Cargo runner for aarch64-unknown-linux-gnu: runs one binary on a real arm64 Linux kernel in
# qemu-system-aarch64 (TCG), so that rseq is the kernel's and not qemu-user's (which answers
# the rseq syscall with ENOSYS).
#
#   CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER=/path/to/.ci/aarch64/runner.sh
#   runner.sh BINARY [ARGS...]
#
# Builds an initramfs holding busybox, the binary, and the aarch64 glibc libraries it needs;
# its /init mounts proc/sys/dev/tmp, runs the binary with the arguments and the RUST_*,
# GLIBC_TUNABLES, THISCPU_* and cargo's CARGO_* variables of this environment, prints a marker
# line with the exit code and powers off. The guest's output is relayed (without the marker)
# and the runner exits with the guest's exit code. No marker (kernel panic, crash, hang) is a
# failure, and so is a run longer than $THISCPU_VM_TIMEOUT seconds (default 300).
#
# So that tests find what cargo promised them, the guest mirrors some host paths: the current
# directory (cargo runs tests from the package's root) when it holds a Cargo.toml, copied
# without its target/ and run from there; the program itself; the workspace's executables that the binary names
# by absolute path (CARGO_BIN_EXE_*), and the shared libraries built as examples that it names
# by file name (in <profile>/examples/), at the same paths; the files of $THISCPU_TEST_C_DIR
# (programs the tests run, built beforehand), at the same paths; and an empty, writable
# CARGO_TARGET_TMPDIR. Otherwise the program runs from /.
#
# Other knobs: THISCPU_VM_SMP (default 2), THISCPU_VM_MEM (MiB, default 1024),
# THISCPU_AARCH64_TOOLS (where setup.sh put the kernel and busybox), THISCPU_VM_KERNEL (another
# arm64 kernel image to boot instead of setup.sh's), THISCPU_AARCH64_SYSROOT
# (where the shared libraries come from, default /usr/aarch64-linux-gnu; its lib/ may also
# hold a program's own shared objects).
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 BINARY [ARGS...]" >&2
    exit 2
fi
binary=$1
shift

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tools=${THISCPU_AARCH64_TOOLS:-$repo/target/aarch64-tools}
kernel=${THISCPU_VM_KERNEL:-$tools/guest/vmlinuz}
busybox=$tools/guest/busybox
sysroot=${THISCPU_AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}
timeout_s=${THISCPU_VM_TIMEOUT:-300}
marker=THISCPU_GUEST_EXIT

for f in "$kernel" "$busybox"; do
    [ -e "$f" ] || { echo "runner: $f missing; run .ci/aarch64/setup.sh" >&2; exit 2; }
done

work=$(mktemp -d "${TMPDIR:-/tmp}/thiscpu-vm.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/root
mkdir -p "$root"/{bin,lib,proc,sys,dev,tmp}
cp "$busybox" "$root/bin/busybox"
# The program runs from its host path, so that what it finds next to itself (through
# /proc/self/exe) is where cargo put it.
program=$(cd "$(dirname "$binary")" && pwd)/$(basename "$binary")
mkdir -p "$root$(dirname "$program")"
cp "$binary" "$root$program"

# Shared libraries: the DT_NEEDED entries of every executable copied in, followed
# recursively, plus libgcc_s (glibc loads it with dlopen for unwinding), all from the cross
# sysroot into /lib, where the program interpreter /lib/ld-linux-aarch64.so.1 also lands.
needed() {
    aarch64-linux-gnu-readelf -d "$1" 2>/dev/null |
        sed -n 's/.*(NEEDED).*Shared library: \[\(.*\)\]/\1/p'
}
add_libs() {
    local interp lib queue more
    interp=$(aarch64-linux-gnu-readelf -l "$1" 2>/dev/null |
        sed -n 's/.*Requesting program interpreter: \(.*\)\]/\1/p')
    queue=("$(basename "${interp:-/lib/ld-linux-aarch64.so.1}")" libgcc_s.so.1)
    mapfile -t more < <(needed "$1")
    queue+=("${more[@]}")
    while [ ${#queue[@]} -gt 0 ]; do
        lib=${queue[0]}
        queue=("${queue[@]:1}")
        [ -n "$lib" ] && [ ! -e "$root/lib/$lib" ] || continue
        if [ ! -e "$sysroot/lib/$lib" ]; then
            echo "runner: $lib not found in $sysroot/lib" >&2
            exit 2
        fi
        cp -L "$sysroot/lib/$lib" "$root/lib/$lib"
        mapfile -t more < <(needed "$root/lib/$lib")
        queue+=("${more[@]}")
    done
}
add_libs "$binary"

# Host paths mirrored in the guest (see the header).
workdir=/
if [ -f "$PWD/Cargo.toml" ] && [ "$PWD" != / ]; then
    workdir=$PWD
    mkdir -p "$root$workdir"
    tar -C "$workdir" --exclude=./target --exclude=./.git -cf - . | tar -C "$root$workdir" -xf -
fi
# A test binary lives in <target-dir>/<triple>/<profile>/deps/; the workspace's executables in
# <profile>/, and CARGO_TARGET_TMPDIR is <target-dir>/tmp.
bin_dir=$(cd "$(dirname "$binary")" && pwd)
if [ "$(basename "$bin_dir")" = deps ]; then
    profile_dir=$(dirname "$bin_dir")
    for exe in "$profile_dir"/*; do
        [ -f "$exe" ] && [ -x "$exe" ] || continue
        if grep -qF "$exe" "$binary"; then
            mkdir -p "$root$profile_dir"
            cp "$exe" "$root$exe"
            add_libs "$exe"
        fi
    done
    # Shared libraries built as examples, which a test loads with dlopen by file name.
    for lib in "$profile_dir"/examples/lib*.so; do
        [ -f "$lib" ] && grep -qF "$(basename "$lib")" "$binary" || continue
        mkdir -p "$root$profile_dir/examples"
        cp "$lib" "$root$lib"
        add_libs "$lib"
    done
    mkdir -p "$root$(dirname "$(dirname "$profile_dir")")/tmp"
fi
if [ -n "${THISCPU_TEST_C_DIR:-}" ] && [ -d "$THISCPU_TEST_C_DIR" ]; then
    c_dir=$(cd "$THISCPU_TEST_C_DIR" && pwd)
    mkdir -p "$root$c_dir"
    for f in "$c_dir"/*; do
        [ -f "$f" ] || continue
        cp "$f" "$root$f"
        add_libs "$f"
    done
fi
guest_tmpdir=${CARGO_TARGET_TMPDIR:-}
[ -z "$guest_tmpdir" ] || mkdir -p "$root$guest_tmpdir"

# The variables the program sees, by name: the test harness's, glibc's tunables, thiscpu's
# (less the runner's own), and those cargo sets for tests.
pass_through='RUST_|GLIBC_TUNABLES$|THISCPU_'
pass_through+='|CARGO_(MANIFEST_|PKG_|CRATE_|BIN_|TARGET_TMPDIR)'

# Single-quotes a word for the guest's shell.
quote() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }

{
    echo '#!/bin/busybox sh'
    echo '/bin/busybox --install -s /bin'
    echo 'export PATH=/bin'
    echo 'mount -t proc proc /proc'
    echo 'mount -t sysfs sysfs /sys'
    echo 'mount -t devtmpfs devtmpfs /dev'
    # Not over mirrored host paths under /tmp (the initramfs is writable anyway).
    echo '[ -n "$(ls -A /tmp)" ] || mount -t tmpfs tmpfs /tmp'
    printf 'cd %s\n' "$(quote "$workdir")"
    while IFS= read -r name; do
        printf 'export %s=%s\n' "$name" "$(quote "${!name}")"
    done < <(compgen -e | grep -E "^($pass_through)" | grep -v '^THISCPU_VM_' || true)
    quote "$program"
    for arg in "$@"; do
        printf ' %s' "$(quote "$arg")"
    done
    printf ' </dev/null\n'
    echo 'code=$?'
    echo "echo $marker=\$code"
    echo 'poweroff -f'
} >"$root/init"
chmod +x "$root/init" "$root/bin/busybox" "$root$program"

(cd "$root" && find . -mindepth 1 | cpio -o -H newc --quiet >"$work/initrd.cpio")

# The console is a serial port: lines end in CR LF there. Output is relayed as it comes;
# the marker line is eaten and its code kept, and so is the kernel's power-off message.
relay() {
    local line
    while IFS= read -r line || [ -n "$line" ]; do
        line=${line%$'\r'}
        case $line in
        "$marker="*) printf '%s\n' "${line#"$marker="}" >"$work/code" ;;
        *"] reboot: Power down") ;;
        *) printf '%s\n' "$line" ;;
        esac
    done
}
set +e
timeout --foreground -k 10 "$timeout_s" \
    qemu-system-aarch64 -M virt -cpu max,pauth-impdef=on \
    -smp "${THISCPU_VM_SMP:-2}" -m "${THISCPU_VM_MEM:-1024}" \
    -nographic -no-reboot -nic none \
    -kernel "$kernel" -initrd "$work/initrd.cpio" \
    -append "console=ttyAMA0 panic=-1 quiet loglevel=1 rdinit=/init" \
    </dev/null 2>"$work/qemu-stderr" | relay
status=${PIPESTATUS[0]}
set -e

code=$(cat "$work/code" 2>/dev/null || true)
if [ -n "$code" ]; then
    exit "$code"
fi
cat "$work/qemu-stderr" >&2
if [ "$status" = 124 ] || [ "$status" = 137 ]; then
    echo "runner: the VM did not finish within ${timeout_s}s" >&2
else
    echo "runner: the guest printed no exit code (qemu exit status $status): crash or panic" >&2
fi
exit 101
