#!/usr/bin/env bash
# Installs what building thiscpu for riscv64gc-unknown-linux-gnu and testing it on real riscv64
# kernels needs, on a Debian 12 x86_64 machine. riscv64 is a Debian architecture from Debian 13
# (trixie) on, so the Rust pieces come from trixie:
#
# - system packages from this machine's own suite (as root): the riscv64 cross gcc/binutils and
#   glibc, cpio, jq (test.sh reads cargo's JSON with it), qemu-system-riscv64 with its OpenSBI
#   firmware;
# - in a project-local tool directory (nothing else is installed system-wide):
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
suite=trixie
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

log() { printf 'riscv64 setup: %s\n' "$*" >&2; }

need_root() {
    if [ "$(id -u)" != 0 ]; then
        log "must run as root to $1"
        exit 1
    fi
}

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
[ -r "$keyring" ] || { log "$keyring missing (package debian-archive-keyring)"; exit 1; }

# --- 2. The private apt configuration for trixie -------------------------------------------
# The mirrors this machine already uses (as .ci/kernels/setup.sh finds them); Debian's own
# when it has none.
system_uris() {
    {
        cat /etc/apt/sources.list.d/*.sources 2>/dev/null |
            sed -n 's/^URIs:[[:space:]]*//p' | tr ' ' '\n'
        cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
            sed -n 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]\+\).*/\2/p'
    } | grep -E '^https?://' || true
}
apt_dir=$tools/apt
apt_options=(
    -o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o Dir::Etc::sourceparts=/nonexistent
    -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
    -o Dir::State::status=/var/lib/dpkg/status
    -o APT::Architecture=amd64 -o APT::Architectures=amd64,riscv64
    -o APT::Sandbox::User=root
)
lists_ready=no
private_apt() {
    [ "$lists_ready" = no ] || return 0
    local archive security
    archive=$(system_uris | grep -v -- '-security' | head -n 1)
    security=$(system_uris | grep -- '-security' | head -n 1)
    archive=${archive:-http://deb.debian.org/debian}
    security=${security:-http://deb.debian.org/debian-security}
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
    {
        echo "deb [arch=amd64,riscv64 signed-by=$keyring] $archive $suite main"
        echo "deb [arch=amd64,riscv64 signed-by=$keyring] $archive $suite-updates main"
        echo "deb [arch=amd64,riscv64 signed-by=$keyring] $security $suite-security main"
    } >"$apt_dir/sources.list"
    log "apt-get update ($suite, amd64 and riscv64, private lists)"
    apt-get "${apt_options[@]}" update -qq
    lists_ready=yes
}

candidate() {
    apt-cache "${apt_options[@]}" policy "$1" 2>/dev/null |
        awk '/Candidate:/ { if ($2 != "(none)") print $2 }'
}

# Downloads packages (name or name:arch, optionally =version) into $tools/debs and prints
# the paths of the downloaded files.
download() {
    mkdir -p "$tools/debs"
    (cd "$tools/debs" && apt-get "${apt_options[@]}" download -qq "$@" >/dev/null)
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

# --- 3. Rust toolchain with a riscv64 standard library -----------------------------------
rust_ready() {
    [ -x "$tools/bin/rustc" ] && [ -x "$tools/bin/rustdoc" ] &&
        [ -d "$tools/rust/usr/lib/rustlib/riscv64gc-unknown-linux-gnu/lib" ] &&
        "$tools/bin/rustc" -vV >/dev/null 2>&1
}
if ! rust_ready; then
    private_apt
    rust_version=$(candidate rustc-web)
    [ -n "$rust_version" ] || { log "$suite has no rustc-web"; exit 1; }
    # 1.96.0+dfsg1-1~deb13u1+b1 -> 1.96
    series=$(printf '%s\n' "$rust_version" | sed -E 's/^([0-9]+:)?([0-9]+\.[0-9]+).*/\2/')
    llvm=$(apt-cache "${apt_options[@]}" depends "libstd-rust-web-$series" |
        awk '/Depends: libllvm[0-9]+$/ { print $2; exit }')
    [ -n "$llvm" ] || { log "cannot tell which libllvm libstd-rust-web-$series needs"; exit 1; }
    [ "$(candidate "libstd-rust-web-dev:riscv64")" = "$rust_version" ] ||
        { log "no riscv64 standard library of rustc-web $rust_version"; exit 1; }
    log "rustc-web $rust_version ($llvm) from $suite into $tools/rust"
    # The amd64 and riscv64 standard libraries must be the very same build as the compiler.
    pkgs=(
        "rustc-web=$rust_version"
        "libstd-rust-web-$series=$rust_version"
        "libstd-rust-web-dev=$rust_version"
        "libstd-rust-web-$series:riscv64=$rust_version"
        "libstd-rust-web-dev:riscv64=$rust_version"
        "$llvm"
    )
    if [ -n "$(candidate rust-web-clippy)" ]; then
        pkgs+=("rust-web-clippy=$rust_version")
    fi
    # What the compiler and LLVM load, in trixie's versions: Debian 12's glibc and libstdc++
    # are older than the ones they were built against.
    pkgs+=(libc6 libgcc-s1 libstdc++6)
    for dep in $(apt-cache "${apt_options[@]}" depends "$llvm" |
        awk '/^  Depends: lib/ { print $2 }' | sort -u); do
        case $dep in libc6 | libgcc-s1 | libstdc++6 | *:*) ;; *) pkgs+=("$dep") ;; esac
    done
    rm -rf "$tools/rust" "$tools/debs"
    mkdir -p "$tools/rust"
    debs=$(download "${pkgs[@]}")
    for deb in $debs; do
        dpkg -x "$deb" "$tools/rust"
    done
    loader=usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
    [ -x "$tools/rust/$loader" ] || { log "trixie's libc6 holds no $loader"; exit 1; }
    libdirs=usr/lib/x86_64-linux-gnu
    for dir in "$tools"/rust/usr/lib/llvm-*/lib; do
        [ -d "$dir" ] && libdirs="$libdirs:${dir#"$tools/rust/"}"
    done
    mkdir -p "$tools/bin"
    # The same directories, as the wrapper spells them: relative to its own location.
    wrapper_libdirs=$(printf '%s' "$libdirs" | sed 's|^|$root/|; s|:|:$root/|g')
    for tool in rustc rustdoc clippy-driver; do
        [ -x "$tools/rust/usr/bin/$tool" ] || continue
        cat >"$tools/bin/$tool" <<WRAPPER
#!/bin/sh
# Runs Debian $suite's $tool $rust_version unpacked beside this script, with $suite's dynamic
# loader and libraries (written by setup.sh).
root=\$(cd "\$(dirname "\$0")/../rust" && pwd)
exec "\$root/$loader" --library-path "$wrapper_libdirs" "\$root/usr/bin/$tool" "\$@"
WRAPPER
        chmod +x "$tools/bin/$tool"
    done
    rm -rf "$tools/debs"
    rust_ready || { log "the unpacked rustc does not run"; exit 1; }
fi

# --- 4. Guest shell ----------------------------------------------------------------------
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

# --- 5. Guest libraries -------------------------------------------------------------------
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
