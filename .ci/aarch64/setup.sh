#!/usr/bin/env bash
# Installs what building thiscpu for aarch64-unknown-linux-gnu and testing it on a real arm64
# kernel needs, on a Debian 12 x86_64 machine (see docs: aarch64.md in the shared docs):
#
# - system packages (as root): the arm64 foreign architecture, the aarch64 cross gcc/binutils
#   and glibc, cpio, jq (test.sh reads cargo's JSON with it), qemu-system-aarch64;
# - in a project-local tool directory (nothing else is installed system-wide):
#     rust/      Debian's rustc-web with its x86_64 and aarch64 standard libraries, its LLVM
#                and clippy, unpacked with `dpkg -x`;
#     bin/rustc, bin/rustdoc, bin/clippy-driver   wrappers that run them;
#     guest/vmlinuz, guest/busybox   the arm64 kernel and shell the test VM boots.
#
# Idempotent: every step whose output exists is skipped, so a second run takes well under a
# second. The tool directory is $THISCPU_AARCH64_TOOLS, by default target/aarch64-tools in the
# repository. Prints the tool directory's path as its last line.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tools=${THISCPU_AARCH64_TOOLS:-$repo/target/aarch64-tools}
mkdir -p "$tools"
tools=$(cd "$tools" && pwd)

log() { printf 'aarch64 setup: %s\n' "$*" >&2; }

need_root() {
    if [ "$(id -u)" != 0 ]; then
        log "must run as root to $1"
        exit 1
    fi
}

apt_updated=no
apt_update() {
    if [ "$apt_updated" = no ]; then
        log "apt-get update"
        apt-get update -qq
        apt_updated=yes
    fi
}

# Candidate version of a package, or nothing when apt does not know it.
candidate() {
    apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ { if ($2 != "(none)") print $2 }'
}

# --- 1. System packages ------------------------------------------------------------------
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    need_root "add the arm64 architecture"
    log "dpkg --add-architecture arm64"
    dpkg --add-architecture arm64
    apt_update
fi

system_ready() {
    command -v aarch64-linux-gnu-gcc >/dev/null &&
        command -v aarch64-linux-gnu-objdump >/dev/null &&
        command -v qemu-system-aarch64 >/dev/null &&
        command -v cpio >/dev/null &&
        command -v jq >/dev/null &&
        [ -e /usr/aarch64-linux-gnu/lib/libc.so.6 ]
}
if ! system_ready; then
    need_root "install packages"
    apt_update
    log "apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross cpio jq qemu-system-arm"
    # qemu-system-arm from bookworm replaces a newer qemu-utils if one is installed; nothing
    # here needs qemu-utils.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        gcc-aarch64-linux-gnu libc6-dev-arm64-cross cpio jq qemu-system-arm >/dev/null
    system_ready || { log "packages installed but tools still missing"; exit 1; }
fi

# Downloads packages (name or name:arch, optionally =version) into $tools/debs and prints
# the paths of the downloaded files.
download() {
    mkdir -p "$tools/debs"
    # The download runs as root: apt's sandbox user could not write into the tool directory.
    (cd "$tools/debs" && apt-get download -qq -o APT::Sandbox::User=root "$@" >/dev/null)
    local spec name arch deb
    for spec in "$@"; do
        name=${spec%%=*}
        arch=amd64
        case $name in *:*) arch=${name#*:}; name=${name%%:*} ;; esac
        # Debian's file names are NAME_VERSION_ARCH.deb (an epoch's colon written as %3a).
        deb=$(find "$tools/debs" -maxdepth 1 -name "${name}_*_${arch}.deb" -print -quit)
        [ -n "$deb" ] || { log "apt-get download gave no file for $spec"; return 1; }
        printf '%s\n' "$deb"
    done
}

# arm64 package lists must be present for the look-ups below.
ensure_arm64_lists() {
    if [ -z "$(candidate busybox-static:arm64)" ]; then
        need_root "update the package lists"
        apt_update
    fi
}

# --- 2. Rust toolchain with an aarch64 standard library -----------------------------------
rust_ready() {
    [ -x "$tools/bin/rustc" ] && [ -x "$tools/bin/rustdoc" ] &&
        [ -d "$tools/rust/usr/lib/rustlib/aarch64-unknown-linux-gnu/lib" ] &&
        "$tools/bin/rustc" -vV >/dev/null 2>&1
}
if ! rust_ready; then
    ensure_arm64_lists
    rust_version=$(candidate rustc-web)
    [ -n "$rust_version" ] || { log "apt knows no rustc-web"; exit 1; }
    # 1.96.0+dfsg1-1~deb12u2 -> 1.96
    series=$(printf '%s\n' "$rust_version" | sed -E 's/^([0-9]+:)?([0-9]+\.[0-9]+).*/\2/')
    llvm=$(apt-cache depends "libstd-rust-web-$series" |
        awk '/Depends: libllvm[0-9]+$/ { print $2; exit }')
    [ -n "$llvm" ] || { log "cannot tell which libllvm libstd-rust-web-$series needs"; exit 1; }
    log "rustc-web $rust_version ($llvm) into $tools/rust"
    # The amd64 and arm64 standard libraries must be the very same build as the compiler.
    pkgs=(
        "rustc-web=$rust_version"
        "libstd-rust-web-$series=$rust_version"
        "libstd-rust-web-dev=$rust_version"
        "libstd-rust-web-$series:arm64=$rust_version"
        "libstd-rust-web-dev:arm64=$rust_version"
        "$llvm"
    )
    if [ -n "$(candidate rust-web-clippy)" ]; then
        pkgs+=("rust-web-clippy=$rust_version")
    fi
    rm -rf "$tools/rust"
    mkdir -p "$tools/rust"
    debs=$(download "${pkgs[@]}")
    for deb in $debs; do
        dpkg -x "$deb" "$tools/rust"
    done
    # Debian puts libLLVM and the compiler's own libraries in usr/lib/x86_64-linux-gnu.
    libdirs=usr/lib/x86_64-linux-gnu
    for dir in "$tools"/rust/usr/lib/llvm-*/lib; do
        [ -d "$dir" ] && libdirs="$libdirs:${dir#"$tools/rust/"}"
    done
    mkdir -p "$tools/bin"
    # The same directories, as the wrapper spells them: relative to its own location.
    wrapper_libdirs=$(printf '%s' "$libdirs" | sed 's|^|$root/|; s|:|:$root/|g')
    for tool in rustc rustdoc clippy-driver; do
        [ -x "$tools/rust/usr/bin/$tool" ] || continue
        cat >"$tools/bin/$tool" <<EOF
#!/bin/sh
# Runs Debian's $tool $rust_version unpacked beside this script (written by setup.sh).
root=\$(cd "\$(dirname "\$0")/../rust" && pwd)
LD_LIBRARY_PATH="$wrapper_libdirs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
exec "\$root/usr/bin/$tool" "\$@"
EOF
        chmod +x "$tools/bin/$tool"
    done
    rm -rf "$tools/debs"
    rust_ready || { log "the unpacked rustc does not run"; exit 1; }
fi

# --- 3. Guest kernel and shell --------------------------------------------------------------
if [ ! -s "$tools/guest/vmlinuz" ] || [ ! -x "$tools/guest/busybox" ]; then
    ensure_arm64_lists
    kernel_pkg=$(apt-cache depends linux-image-arm64:arm64 |
        awk '/Depends: linux-image-[0-9]/ { sub(/:arm64$/, "", $2); print $2; exit }')
    [ -n "$kernel_pkg" ] || { log "cannot tell which arm64 kernel package is current"; exit 1; }
    log "guest: $kernel_pkg and busybox-static:arm64 into $tools/guest"
    rm -rf "$tools/guest" "$tools/guest.tmp"
    mkdir -p "$tools/guest.tmp/x"
    debs=$(download "$kernel_pkg:arm64" busybox-static:arm64)
    for deb in $debs; do
        case $deb in
        *linux-image*) dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$tools/guest.tmp/x" ./boot ;;
        *busybox*) dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$tools/guest.tmp/x" ./bin/busybox ;;
        esac
    done
    cp "$(ls "$tools/guest.tmp/x/boot/"vmlinuz-*-arm64 | head -n 1)" "$tools/guest.tmp/vmlinuz"
    cp "$tools/guest.tmp/x/bin/busybox" "$tools/guest.tmp/busybox"
    printf '%s\n' "$kernel_pkg" >"$tools/guest.tmp/kernel-package"
    rm -rf "$tools/guest.tmp/x" "$tools/debs"
    mv "$tools/guest.tmp" "$tools/guest"
fi

printf '%s\n' "$tools"
