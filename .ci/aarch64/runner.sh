#!/usr/bin/env bash
# Cargo runner for aarch64-unknown-linux-gnu, and for riscv64gc-unknown-linux-gnu with
# THISCPU_VM_ARCH=riscv64: runs binaries on a real arm64 (riscv64) Linux kernel in
# qemu-system-aarch64 (qemu-system-riscv64) under TCG, so that rseq is the kernel's and not
# qemu-user's (which answers the rseq syscall with ENOSYS).
#
#   CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER=/path/to/.ci/aarch64/runner.sh
#   runner.sh BINARY [ARGS...]     one binary, from the current directory
#   runner.sh --batch MANIFEST     several binaries, one after the other, in one boot
#
# A manifest has one line per binary: the directory it runs from, optionally variables for
# that run alone (NAME=VALUE fields), the binary and its arguments, separated by tabs. Booting
# is what a run costs most under TCG, so a batch boots once for all of them.
#
# Builds an initramfs holding busybox, the binaries, and the target's glibc libraries they need;
# its /init mounts proc/sys/dev/tmp, runs each binary with its arguments and the RUST_*,
# GLIBC_TUNABLES, THISCPU_* and cargo's CARGO_* variables of this environment, prints a marker
# line with each exit code and powers off. The guest's output is relayed (without the
# markers). A single binary's exit code is the runner's; a batch names each binary before its
# output, ends with a summary of the exit codes and exits with the first code that is not 0.
# A missing marker (kernel panic, crash, hang) is a failure, and so is a run longer than
# $THISCPU_VM_TIMEOUT seconds per binary (default 300).
#
# So that tests find what cargo promised them, the guest mirrors some host paths: the directory
# a binary runs from (cargo runs tests from the package's root) when it holds a Cargo.toml,
# copied without its target/ and run from there; the binaries themselves; the workspace's
# executables that a binary names by absolute path (CARGO_BIN_EXE_*), and the shared
# libraries built as examples that it names by file name (in <profile>/examples/), at the same
# paths; the files of $THISCPU_TEST_C_DIR (programs the tests run, built beforehand), at the
# same paths; and an empty, writable CARGO_TARGET_TMPDIR. Otherwise a binary runs from /.
#
# Other knobs: THISCPU_VM_SMP (default 2), THISCPU_VM_MEM (MiB, default 1024 and twice the
# initramfs),
# THISCPU_AARCH64_TOOLS (where setup.sh put the kernel and busybox), THISCPU_VM_KERNEL (another
# arm64 kernel image to boot instead of setup.sh's), THISCPU_AARCH64_SYSROOT
# (where the shared libraries come from, default /usr/aarch64-linux-gnu; its lib/ may also
# hold a program's own shared objects). For riscv64: THISCPU_RISCV64_TOOLS (where
# .ci/riscv64/setup.sh put busybox), THISCPU_VM_KERNEL (required: the riscv64 kernels come
# from .ci/kernels/setup.sh), THISCPU_RISCV64_SYSROOT (default /usr/riscv64-linux-gnu).
set -euo pipefail

usage() {
    echo "usage: $0 BINARY [ARGS...] | $0 --batch MANIFEST" >&2
    exit 2
}
[ $# -ge 1 ] || usage

# The runs, one line each: directory, binary, arguments, separated by tabs.
runs=()
batch=no
if [ "$1" = --batch ]; then
    [ $# -eq 2 ] || usage
    batch=yes
    mapfile -t runs < <(grep -v '^[[:space:]]*$' "$2")
    if [ ${#runs[@]} -eq 0 ]; then
        echo "runner: $2 names no binary" >&2
        exit 2
    fi
else
    run_line=$PWD
    for arg in "$@"; do
        run_line+=$'\t'$arg
    done
    runs=("$run_line")
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# What differs between the targets: the cross binutils' prefix, the tool directory and the
# sysroot, the dynamic loader, and how qemu boots the kernel and which console it prints on.
case ${THISCPU_VM_ARCH:-aarch64} in
aarch64)
    cross=aarch64-linux-gnu
    tools=${THISCPU_AARCH64_TOOLS:-$repo/target/aarch64-tools}
    sysroot=${THISCPU_AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}
    loader=/lib/ld-linux-aarch64.so.1
    qemu=(qemu-system-aarch64 -M virt -cpu max,pauth-impdef=on)
    console=ttyAMA0
    ;;
riscv64)
    cross=riscv64-linux-gnu
    tools=${THISCPU_RISCV64_TOOLS:-$repo/target/riscv64-tools}
    sysroot=${THISCPU_RISCV64_SYSROOT:-/usr/riscv64-linux-gnu}
    loader=/lib/ld-linux-riscv64-lp64d.so.1
    # OpenSBI (qemu-system-data's) starts the kernel image in supervisor mode.
    qemu=(qemu-system-riscv64 -M virt -cpu rv64 -bios default)
    console=ttyS0
    ;;
*)
    echo "runner: THISCPU_VM_ARCH must be aarch64 or riscv64" >&2
    exit 2
    ;;
esac
kernel=${THISCPU_VM_KERNEL:-$tools/guest/vmlinuz}
busybox=$tools/guest/busybox
timeout_s=$((${THISCPU_VM_TIMEOUT:-300} * ${#runs[@]}))
marker=THISCPU_GUEST_EXIT

for f in "$kernel" "$busybox"; do
    [ -e "$f" ] || { echo "runner: $f missing; run .ci/${THISCPU_VM_ARCH:-aarch64}/setup.sh" >&2; exit 2; }
done

started_s=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/thiscpu-vm.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/root
mkdir -p "$root"/{bin,lib,proc,sys,dev,tmp}
cp "$busybox" "$root/bin/busybox"

# Shared libraries: the DT_NEEDED entries of every executable copied in, followed
# recursively, plus libgcc_s (glibc loads it with dlopen for unwinding), all from the cross
# sysroot into /lib, where the program interpreter (e.g. /lib/ld-linux-aarch64.so.1) also lands.
needed() {
    "$cross-readelf" -d "$1" 2>/dev/null |
        sed -n 's/.*(NEEDED).*Shared library: \[\(.*\)\]/\1/p'
}
add_libs() {
    local interp lib queue more
    interp=$("$cross-readelf" -l "$1" 2>/dev/null |
        sed -n 's/.*Requesting program interpreter: \(.*\)\]/\1/p')
    queue=("$(basename "${interp:-$loader}")" libgcc_s.so.1)
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

# Copies a host file into the guest at the same path, with its libraries.
add_file() {
    [ ! -e "$root$1" ] || return 0
    mkdir -p "$root$(dirname "$1")"
    cp "$1" "$root$1"
    # Debug information is most of a test executable's size, and nothing in the guest reads it
    # (backtraces keep the symbol table): without it a batch's initramfs stays a fraction of the
    # guest's memory, which the kernel must unpack it into. Files that are not ELF stay as
    # they are.
    if [ "$(head -c 4 "$root$1" | od -An -tx1 | tr -d ' ')" = 7f454c46 ]; then
        "$cross-objcopy" --strip-debug "$root$1"
    fi
    add_libs "$1"
}

# Puts a binary into the guest at its host path, so that what it finds next to itself
# (through /proc/self/exe) is where cargo put it, with the host paths it expects (see the
# header). Prints that path.
add_program() {
    local program bin_dir profile_dir exe lib
    if [ ! -f "$1" ]; then
        echo "runner: $1 not found" >&2
        exit 2
    fi
    program=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
    add_file "$program"
    chmod +x "$root$program"
    # A test binary lives in <target-dir>/<triple>/<profile>/deps/; the workspace's
    # executables in <profile>/, and CARGO_TARGET_TMPDIR is <target-dir>/tmp.
    bin_dir=$(dirname "$program")
    if [ "$(basename "$bin_dir")" = deps ]; then
        profile_dir=$(dirname "$bin_dir")
        for exe in "$profile_dir"/*; do
            [ -f "$exe" ] && [ -x "$exe" ] || continue
            if grep -qF "$exe" "$program"; then
                add_file "$exe"
            fi
        done
        # Shared libraries built as examples, which a test loads with dlopen by file name.
        for lib in "$profile_dir"/examples/lib*.so; do
            [ -f "$lib" ] && grep -qF "$(basename "$lib")" "$program" || continue
            add_file "$lib"
        done
        mkdir -p "$root$(dirname "$(dirname "$profile_dir")")/tmp"
    fi
    printf '%s\n' "$program"
}

# Mirrors the directory a binary runs from when it is a package's root; prints where the
# binary runs in the guest.
add_workdir() {
    if [ -f "$1/Cargo.toml" ] && [ "$1" != / ]; then
        if [ ! -d "$root$1" ]; then
            mkdir -p "$root$1"
            tar -C "$1" --exclude=./target --exclude=./.git -cf - . | tar -C "$root$1" -xf -
        fi
        printf '%s\n' "$1"
    else
        printf '/\n'
    fi
}

if [ -n "${THISCPU_TEST_C_DIR:-}" ] && [ -d "$THISCPU_TEST_C_DIR" ]; then
    c_dir=$(cd "$THISCPU_TEST_C_DIR" && pwd)
    for f in "$c_dir"/*; do
        [ -f "$f" ] || continue
        add_file "$f"
    done
fi
guest_tmpdir=${CARGO_TARGET_TMPDIR:-}
[ -z "$guest_tmpdir" ] || mkdir -p "$root$guest_tmpdir"

# The variables the programs see, by name: the test harness's, glibc's tunables, thiscpu's
# (less the runner's own), and those cargo sets for tests.
pass_through='RUST_|GLIBC_TUNABLES$|THISCPU_'
pass_through+='|CARGO_(MANIFEST_|PKG_|CRATE_|BIN_|TARGET_TMPDIR)'

# Single-quotes a word for the guest's shell.
quote() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }

# What each run is called in a batch's output and summary: the program and its arguments.
names=()
{
    echo '#!/bin/busybox sh'
    echo '/bin/busybox --install -s /bin'
    echo 'export PATH=/bin'
    echo 'mount -t proc proc /proc'
    echo 'mount -t sysfs sysfs /sys'
    echo 'mount -t devtmpfs devtmpfs /dev'
    # Loopback up with 127.0.0.1: the OpenTelemetry example's test serves and
    # scrapes /metrics over TCP on it.
    echo 'ifconfig lo 127.0.0.1 up'
    # Not over mirrored host paths under /tmp (the initramfs is writable anyway).
    echo '[ -n "$(ls -A /tmp)" ] || mount -t tmpfs tmpfs /tmp'
    # Seconds since the guest's kernel started, for the time of each run and of the boot.
    echo 'uptime_s() { cut -d. -f1 /proc/uptime; }'
    echo "echo $marker-BOOTED=\$(uptime_s)"
    while IFS= read -r name; do
        printf 'export %s=%s\n' "$name" "$(quote "${!name}")"
    done < <(compgen -e | grep -E "^($pass_through)" | grep -v '^THISCPU_VM_' || true)
    index=0
    for run_line in "${runs[@]}"; do
        IFS=$'\t' read -r -a fields <<<"$run_line"
        if [ ${#fields[@]} -lt 2 ]; then
            echo "runner: no binary in: $run_line" >&2
            exit 2
        fi
        index=$((index + 1))
        dir=$(add_workdir "${fields[0]}")
        # The run's own variables, up to the binary.
        first=1
        assignments=()
        while [ "$first" -lt $((${#fields[@]} - 1)) ] &&
            [[ ${fields[$first]} =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do
            assignments+=("${fields[$first]}")
            first=$((first + 1))
        done
        program=$(add_program "${fields[$first]}")
        name=
        for assignment in "${assignments[@]}"; do
            name+="$assignment "
        done
        name+=$program
        for arg in "${fields[@]:$((first + 1))}"; do
            name+=" $arg"
        done
        names+=("$name")
        if [ "$batch" = yes ]; then
            printf 'echo %s\n' "$(quote "runner: [$index/${#runs[@]}] $name (in $dir)")"
        fi
        printf 'cd %s\n' "$(quote "$dir")"
        for assignment in "${assignments[@]}"; do
            printf '%s=%s ' "${assignment%%=*}" "$(quote "${assignment#*=}")"
        done
        quote "$program"
        for arg in "${fields[@]:$((first + 1))}"; do
            printf ' %s' "$(quote "$arg")"
        done
        printf ' </dev/null\n'
        echo 'code=$?'
        echo "echo; echo $marker=\$code \$(uptime_s)"
    done
    echo 'poweroff -f'
} >"$root/init"
chmod +x "$root/init" "$root/bin/busybox"

(cd "$root" && find . -mindepth 1 | cpio -o -H newc --quiet >"$work/initrd.cpio")
packed_s=$((SECONDS - started_s))
# The guest holds the initramfs twice while unpacking it (a batch's test executables weigh
# over a hundred MiB even without their debug information), and the tests need room besides.
initrd_mib=$(($(stat -c %s "$work/initrd.cpio") / 1048576 + 1))
mem_mib=${THISCPU_VM_MEM:-$((1024 + 2 * initrd_mib))}

# The console is a serial port: lines end in CR LF there. Output is relayed as it comes; the
# marker lines (each after an empty line, in case the output did not end its last line) are
# eaten and their codes kept, and so is the kernel's power-off message.
relay() {
    local line pending=no
    while IFS= read -r line || [ -n "$line" ]; do
        line=${line%$'\r'}
        if [ "$pending" = yes ]; then
            pending=no
            case $line in
            "$marker="*) ;;
            *) printf '\n' ;;
            esac
        fi
        case $line in
        "$marker="*) printf '%s\n' "${line#"$marker="}" >>"$work/codes" ;;
        "$marker-BOOTED="*) printf '%s\n' "${line#"$marker-BOOTED="}" >"$work/booted" ;;
        *"] reboot: Power down") ;;
        "") pending=yes ;;
        *) printf '%s\n' "$line" ;;
        esac
    done
    [ "$pending" = no ] || printf '\n'
}
set +e
timeout --foreground -k 10 "$timeout_s" \
    "${qemu[@]}" \
    -smp "${THISCPU_VM_SMP:-2}" -m "$mem_mib" \
    -nographic -no-reboot -nic none \
    -kernel "$kernel" -initrd "$work/initrd.cpio" \
    -append "console=$console panic=-1 quiet loglevel=1 rdinit=/init" \
    </dev/null 2>"$work/qemu-stderr" | relay
status=${PIPESTATUS[0]}
set -e

# Each marker holds the exit code and the guest's uptime when the run ended: the runs' times
# follow from the uptime at the end of the boot.
codes=()
ends=()
[ ! -f "$work/codes" ] || while read -r code end; do
    codes+=("$code")
    ends+=("${end:-0}")
done <"$work/codes"
booted=$(cat "$work/booted" 2>/dev/null || echo 0)
result=0
if [ "$batch" = yes ]; then
    echo "runner: exit codes and seconds (initramfs of $(du -m "$work/initrd.cpio" | cut -f1)" \
        "MiB packed in $packed_s s, kernel booted in $booted s, qemu ran $((SECONDS - started_s - packed_s)) s):"
    previous=$booted
    for i in "${!names[@]}"; do
        took=-
        if [ -n "${ends[$i]:-}" ]; then
            took=$((ends[i] - previous))
            previous=${ends[$i]}
        fi
        printf 'runner:   %-4s %4s s  %s\n' "${codes[$i]:-none}" "$took" "${names[$i]}"
    done
fi
for code in "${codes[@]}"; do
    if [ "$code" != 0 ]; then
        result=$code
        break
    fi
done
if [ ${#codes[@]} -lt ${#runs[@]} ]; then
    cat "$work/qemu-stderr" >&2
    echo "runner: while running ${names[${#codes[@]}]}:" >&2
    if [ "$status" = 124 ] || [ "$status" = 137 ]; then
        echo "runner: the VM did not finish within ${timeout_s}s" >&2
    else
        echo "runner: the guest printed no exit code (qemu exit status $status): crash or panic" >&2
    fi
    [ "$result" != 0 ] || result=101
fi
if [ "$batch" = yes ] && [ "$result" != 0 ]; then
    echo "runner: a binary of the batch failed" >&2
fi
exit "$result"
