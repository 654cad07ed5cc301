#!/usr/bin/env bash
# Installs what checking thiscpu for other targets, and running its tests as other targets'
# programs, needs on a Debian 12 x86_64 machine (.ci/cross/test.sh uses it):
#
# - system packages from this machine's own suite (as root): the s390x and armhf cross gcc
#   with their glibc, qemu-user (qemu-s390x, qemu-arm), the mingw-w64 gcc for
#   x86_64-pc-windows-gnu, wine (64-bit only: wine64, without the 32-bit half) and jq
#   (test.sh reads cargo's JSON with it);
# - in a project-local tool directory (nothing else is installed system-wide), through
#   .ci/trixie-rust.sh:
#     apt/       a private apt configuration for Debian 13 (trixie), amd64, s390x and armhf;
#     rust/      trixie's rustc-web with its x86_64, s390x and armv7 standard libraries (Debian
#                builds them as the multiarch libstd-rust-web-dev), its clippy, and its
#                rust-web-src, the standard library's sources that `-Zbuild-std` compiles for
#                the targets Debian ships no standard library for (Windows, macOS, FreeBSD,
#                wasm32-wasip1); with LLVM and the x86_64 libraries the compiler needs;
#                Of rust-web-src only library/ is kept: the compiler's own sources (360 MB)
#                are not what -Zbuild-std builds;
#     bin/rustc, bin/rustdoc, bin/clippy-driver   wrappers that run them (see trixie-rust.sh);
#     wine/dll/bcryptprimitives.dll   the one Windows DLL that Rust programs need and that
#                Debian 12's wine (8.0) lacks, built from bcryptprimitives.c with mingw-w64;
#     wine/prefix  the wine prefix the Windows tests run in (64-bit only), made once here so
#                that no test run pays for its creation.
#   Cargo is the machine's own: it reads the standard library's sources, and their crates.io
#   dependencies are fetched like the workspace's.
#
# Idempotent: every step whose output exists is skipped, so a second run takes about a second.
# The tool directory is $THISCPU_CROSS_TOOLS, by default target/cross-tools in the repository.
# Prints the tool directory's path as its last line.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tools=${THISCPU_CROSS_TOOLS:-$repo/target/cross-tools}
mkdir -p "$tools"
tools=$(cd "$tools" && pwd)
log_prefix="cross setup"
trixie_archs="s390x armhf"
# shellcheck source=../trixie-rust.sh
. "$repo/.ci/trixie-rust.sh"

# --- 1. System packages ------------------------------------------------------------------
system_ready() {
    command -v s390x-linux-gnu-gcc >/dev/null &&
        command -v arm-linux-gnueabihf-gcc >/dev/null &&
        [ -e /usr/s390x-linux-gnu/lib/libc.so.6 ] &&
        [ -e /usr/arm-linux-gnueabihf/lib/libc.so.6 ] &&
        command -v qemu-s390x >/dev/null &&
        command -v qemu-arm >/dev/null &&
        command -v x86_64-w64-mingw32-gcc >/dev/null &&
        command -v wine >/dev/null &&
        command -v jq >/dev/null
}
if ! system_ready; then
    need_root "install packages"
    log "apt-get install gcc-s390x-linux-gnu gcc-arm-linux-gnueabihf qemu-user" \
        "gcc-mingw-w64-x86-64 wine wine64 jq"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        gcc-s390x-linux-gnu libc6-dev-s390x-cross gcc-arm-linux-gnueabihf \
        libc6-dev-armhf-cross qemu-user gcc-mingw-w64-x86-64 wine wine64 jq >/dev/null
    system_ready || { log "packages installed but tools still missing"; exit 1; }
fi

# --- 2. Rust toolchain with the s390x and armv7 standard libraries and rust-src -------------
rust_ready() {
    [ -x "$tools/bin/rustc" ] && [ -x "$tools/bin/rustdoc" ] &&
        [ -d "$tools/rust/usr/lib/rustlib/s390x-unknown-linux-gnu/lib" ] &&
        [ -d "$tools/rust/usr/lib/rustlib/armv7-unknown-linux-gnueabihf/lib" ] &&
        [ -e "$tools/rust/usr/lib/rustlib/src/rust/library/Cargo.lock" ] &&
        "$tools/bin/rustc" -vV >/dev/null 2>&1
}
if ! rust_ready; then
    install_trixie_rust s390x armhf -- rust-web-src
    rm -rf "$tools/rust/usr/lib/rustlib/src/rust/src" "$tools/rust/usr/lib/rustlib/src/rust/compiler"
    rust_ready || { log "the unpacked toolchain is incomplete or does not run"; exit 1; }
fi

# --- 3. Wine: the missing DLL and a prefix ------------------------------------------------
dll=$tools/wine/dll/bcryptprimitives.dll
if [ ! -e "$dll" ] || [ "$repo/.ci/cross/bcryptprimitives.c" -nt "$dll" ]; then
    log "wine: $dll"
    mkdir -p "${dll%/*}"
    x86_64-w64-mingw32-gcc -O2 -shared -s -o "$dll.tmp" "$repo/.ci/cross/bcryptprimitives.c" \
        "$repo/.ci/cross/bcryptprimitives.def" -ladvapi32
    mv "$dll.tmp" "$dll"
fi
if [ ! -e "$tools/wine/prefix/system.reg" ]; then
    log "wine: prefix $tools/wine/prefix"
    rm -rf "$tools/wine/prefix"
    WINEPREFIX=$tools/wine/prefix WINEARCH=win64 WINEDEBUG=-all wine wineboot --init 2>/dev/null
    # wineboot returns before the wine server has written the registry.
    WINEPREFIX=$tools/wine/prefix wineserver --wait
    [ -e "$tools/wine/prefix/system.reg" ] || { log "wineboot made no prefix"; exit 1; }
fi

printf '%s\n' "$tools"
