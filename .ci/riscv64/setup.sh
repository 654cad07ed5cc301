#!/usr/bin/env bash
# Installs what building thiscpu for riscv64gc-unknown-linux-gnu and testing it on real riscv64
# kernels needs, on a Debian 12 x86_64 machine. riscv64 is a Debian architecture from Debian 13
# (trixie) on, so the Rust pieces come from trixie:
#
# - system packages from this machine's own suite (as root): the riscv64 cross gcc/binutils and
#   glibc, cpio, jq (test.sh reads cargo's JSON with it), qemu-system-riscv64 with its OpenSBI
#   firmware;
# - in a project-local tool directory (nothing else is installed system-wide), the first three
#   through .ci/trixie-rust.sh (shared with .ci/cross/setup.sh):
#     apt/       a private apt configuration for trixie (amd64 and riscv64); the system's apt
#                sources and lists are never touched;
#     rust/      trixie's rustc-web with its x86_64 and riscv64 standard libraries (one and the
#                same Debian build), its LLVM and clippy, and the x86_64 libraries they need
#                from trixie (glibc, libstdc++ and LLVM's dependencies: the compiler needs a
#                newer glibc than Debian 12's), unpacked with `dpkg -x`;
#     bin/rustc, bin/rustdoc, bin/clippy-driver   wrappers that run them through trixie's
#                dynamic loader with trixie's libraries (`--library-path`, so the programs the
#                compiler starts, the linker and build scripts, keep the machine's own);
#     guest/busybox   the riscv64 shell the test VMs boot (the kernels come from
#                .ci/kernels/setup.sh);
#     sysroot/lib   trixie's riscv64 glibc (2.41) and libgcc_s, the shared libraries the
#                programs run with in the guests (the runner's THISCPU_RISCV64_SYSROOT): they
#                link against Debian 12's cross glibc (2.36), whose riscv64 build does not
#                register rseq; 2.41's does, so the tests meet glibc's registration too.
#
# Idempotent: every step whose output exists is skipped, so a second run takes well under a
# second. The tool directory is $THISCPU_RISCV64_TOOLS, by default target/riscv64-tools in the
# repository. Prints the tool directory's path as its last line.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tools=${THISCPU_RISCV64_TOOLS:-$repo/target/riscv64-tools}
mkdir -p "$tools"
tools=$(cd "$tools" && pwd)
log_prefix="riscv64 setup"
trixie_archs=riscv64
# shellcheck source=../trixie-rust.sh
. "$repo/.ci/trixie-rust.sh"

# --- 1. System packages ------------------------------------------------------------------
system_ready() {
    command -v riscv64-linux-gnu-gcc >/dev/null &&
        command -v riscv64-linux-gnu-objdump >/dev/null &&
        command -v qemu-system-riscv64 >/dev/null &&
        [ -e /usr/share/qemu/opensbi-riscv64-generic-fw_dynamic.bin ] &&
        command -v cpio >/dev/null &&
        command -v jq >/dev/null &&
        [ -e /usr/riscv64-linux-gnu/lib/libc.so.6 ] &&
        [ -e /usr/riscv64-linux-gnu/lib/libc.a ]
}
if ! system_ready; then
    need_root "install packages"
    log "apt-get install gcc-riscv64-linux-gnu libc6-dev-riscv64-cross cpio jq qemu-system-misc"
    apt-get update -qq
    # qemu-system-misc from bookworm replaces a newer qemu-utils if one is installed; nothing
    # here needs qemu-utils. qemu-system-data holds the OpenSBI firmware.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        gcc-riscv64-linux-gnu libc6-dev-riscv64-cross cpio jq qemu-system-misc \
        qemu-system-data >/dev/null
    system_ready || { log "packages installed but tools still missing"; exit 1; }
fi

# --- 2. Rust toolchain with a riscv64 standard library -----------------------------------
rust_ready() {
    [ -x "$tools/bin/rustc" ] && [ -x "$tools/bin/rustdoc" ] &&
        [ -d "$tools/rust/usr/lib/rustlib/riscv64gc-unknown-linux-gnu/lib" ] &&
        "$tools/bin/rustc" -vV >/dev/null 2>&1
}
if ! rust_ready; then
    install_trixie_rust riscv64
    rust_ready || { log "the unpacked rustc does not run"; exit 1; }
fi

# --- 3. Guest shell ----------------------------------------------------------------------
if [ ! -x "$tools/guest/busybox" ]; then
    private_apt
    log "guest: busybox-static:riscv64 from $suite into $tools/guest"
    rm -rf "$tools/guest" "$tools/guest.tmp"
    mkdir -p "$tools/guest.tmp/x"
    deb=$(download busybox-static:riscv64)
    dpkg -x "$deb" "$tools/guest.tmp/x"
    # /bin/busybox or, in later packages, /usr/bin/busybox.
    busybox=$(find "$tools/guest.tmp/x" -path '*bin/busybox' -type f | head -n 1)
    [ -n "$busybox" ] || { log "busybox-static:riscv64 holds no busybox"; exit 1; }
    cp "$busybox" "$tools/guest.tmp/busybox"
    rm -rf "$tools/guest.tmp/x" "$tools/debs"
    mv "$tools/guest.tmp" "$tools/guest"
fi

# --- 4. Guest libraries -------------------------------------------------------------------
if [ ! -e "$tools/sysroot/lib/libc.so.6" ]; then
    private_apt
    log "guest libraries: libc6:riscv64 and libgcc-s1:riscv64 from $suite into $tools/sysroot"
    rm -rf "$tools/sysroot" "$tools/sysroot.tmp"
    mkdir -p "$tools/sysroot.tmp/x" "$tools/sysroot.tmp/lib"
    for deb in $(download libc6:riscv64 libgcc-s1:riscv64); do
        dpkg -x "$deb" "$tools/sysroot.tmp/x"
    done
    # One flat directory, as the runner looks libraries up by file name (the dynamic loader
    # among them). The gconv modules stay out: nothing the tests run converts charsets.
    # The loader is both in lib/ and usr/lib/: the first copy of a name is kept.
    find "$tools/sysroot.tmp/x" \( -type f -o -type l \) -name '*.so*' ! -path '*/gconv/*' |
        while read -r lib; do
            [ -e "$tools/sysroot.tmp/lib/${lib##*/}" ] || cp -L "$lib" "$tools/sysroot.tmp/lib/"
        done
    rm -rf "$tools/sysroot.tmp/x" "$tools/debs"
    [ -e "$tools/sysroot.tmp/lib/ld-linux-riscv64-lp64d.so.1" ] ||
        { log "libc6:riscv64 holds no ld-linux-riscv64-lp64d.so.1"; exit 1; }
    mv "$tools/sysroot.tmp" "$tools/sysroot"
fi

printf '%s\n' "$tools"
