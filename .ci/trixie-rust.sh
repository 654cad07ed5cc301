# Sourced by the set-up scripts that need Debian 13's (trixie's) Rust toolchain on this Debian 12
# machine (.ci/riscv64/setup.sh, .ci/cross/setup.sh): a private apt configuration for trixie and
# the unpacking of its rustc-web, with the standard libraries of other Debian architectures, into
# a project-local tool directory. Nothing is installed system-wide and the system's apt sources
# and lists are never touched.
#
# The caller sets, before sourcing:
#   tools         the tool directory (an absolute path; created by the caller)
#   log_prefix    what the messages start with
#   trixie_archs  the Debian architectures besides amd64 whose packages apt must list
#
# Then:
#   private_apt   writes $tools/apt (sources for trixie, trixie-updates and trixie-security on
#                 this machine's mirrors) and runs `apt-get update` on it, once per run
#   candidate P   the version trixie offers of package P, empty if none
#   download P..  downloads packages (name or name:arch, optionally =version) into $tools/debs
#                 and prints the paths of the files
#   install_trixie_rust ARCH... [-- EXTRA...]
#                 unpacks into $tools/rust trixie's rustc-web with the amd64 standard library
#                 and those of the Debian architectures ARCH, clippy when trixie has it, the
#                 EXTRA packages (of the compiler's own build: rust-web-src, ...), LLVM and the
#                 x86_64 libraries they need from trixie (glibc, libstdc++ and LLVM's
#                 dependencies: the compiler needs a newer glibc than Debian 12's), and writes
#                 $tools/bin/rustc, rustdoc and clippy-driver: wrappers that run them through
#                 trixie's dynamic loader with trixie's libraries (`--library-path`, so the
#                 programs the compiler starts, the linker and build scripts, keep the
#                 machine's own)

suite=trixie
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

log() { printf '%s: %s\n' "$log_prefix" "$*" >&2; }

need_root() {
    if [ "$(id -u)" != 0 ]; then
        log "must run as root to $1"
        exit 1
    fi
}

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
apt_archs=amd64${trixie_archs:+,${trixie_archs// /,}}
apt_options=(
    -o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o Dir::Etc::sourceparts=/nonexistent
    -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
    -o Dir::State::status=/var/lib/dpkg/status
    -o APT::Architecture=amd64 -o "APT::Architectures=$apt_archs"
    -o APT::Sandbox::User=root
)
lists_ready=no
private_apt() {
    [ "$lists_ready" = no ] || return 0
    [ -r "$keyring" ] || { log "$keyring missing (package debian-archive-keyring)"; exit 1; }
    local archive security
    archive=$(system_uris | grep -v -- '-security' | head -n 1)
    security=$(system_uris | grep -- '-security' | head -n 1)
    archive=${archive:-http://deb.debian.org/debian}
    security=${security:-http://deb.debian.org/debian-security}
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
    {
        echo "deb [arch=$apt_archs signed-by=$keyring] $archive $suite main"
        echo "deb [arch=$apt_archs signed-by=$keyring] $archive $suite-updates main"
        echo "deb [arch=$apt_archs signed-by=$keyring] $security $suite-security main"
    } >"$apt_dir/sources.list"
    log "apt-get update ($suite, $apt_archs, private lists)"
    apt-get "${apt_options[@]}" update -qq
    lists_ready=yes
}

candidate() {
    apt-cache "${apt_options[@]}" policy "$1" 2>/dev/null |
        awk '/Candidate:/ { if ($2 != "(none)") print $2 }'
}

download() {
    mkdir -p "$tools/debs"
    (cd "$tools/debs" && apt-get "${apt_options[@]}" download -qq "$@" >/dev/null)
    local spec name arch deb
    for spec in "$@"; do
        name=${spec%%=*}
        arch=amd64
        case $name in *:*) arch=${name#*:}; name=${name%%:*} ;; esac
        # Debian's file names are NAME_VERSION_ARCH.deb (an epoch's colon written as %3a);
        # architecture-independent packages end in _all.deb.
        deb=$(find "$tools/debs" -maxdepth 1 \( -name "${name}_*_${arch}.deb" -o \
            -name "${name}_*_all.deb" \) -print -quit)
        [ -n "$deb" ] || { log "apt-get download gave no file for $spec"; return 1; }
        printf '%s\n' "$deb"
    done
}

install_trixie_rust() {
    local archs=() extras=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do
        archs+=("$1")
        shift
    done
    [ $# -eq 0 ] || { shift; extras=("$@"); }
    private_apt
    local rust_version series llvm arch extra dep
    rust_version=$(candidate rustc-web)
    [ -n "$rust_version" ] || { log "$suite has no rustc-web"; exit 1; }
    # 1.96.0+dfsg1-1~deb13u1+b1 -> 1.96
    series=$(printf '%s\n' "$rust_version" | sed -E 's/^([0-9]+:)?([0-9]+\.[0-9]+).*/\2/')
    llvm=$(apt-cache "${apt_options[@]}" depends "libstd-rust-web-$series" |
        awk '/Depends: libllvm[0-9]+$/ { print $2; exit }')
    [ -n "$llvm" ] || { log "cannot tell which libllvm libstd-rust-web-$series needs"; exit 1; }
    log "rustc-web $rust_version ($llvm) from $suite into $tools/rust"
    # The standard libraries must be the very same build as the compiler.
    local pkgs=(
        "rustc-web=$rust_version"
        "libstd-rust-web-$series=$rust_version"
        "libstd-rust-web-dev=$rust_version"
        "$llvm"
    )
    for arch in ${archs[@]+"${archs[@]}"}; do
        [ "$(candidate "libstd-rust-web-dev:$arch")" = "$rust_version" ] ||
            { log "no $arch standard library of rustc-web $rust_version"; exit 1; }
        pkgs+=("libstd-rust-web-$series:$arch=$rust_version" "libstd-rust-web-dev:$arch=$rust_version")
    done
    if [ -n "$(candidate rust-web-clippy)" ]; then
        pkgs+=("rust-web-clippy=$rust_version")
    fi
    # An architecture-independent package (rust-web-src) has no binary rebuild's "+bN".
    local extra_version
    for extra in ${extras[@]+"${extras[@]}"}; do
        extra_version=$(candidate "$extra")
        [ -n "$extra_version" ] && [ "${extra_version%+b*}" = "${rust_version%+b*}" ] ||
            { log "$suite has no $extra of rustc-web $rust_version"; exit 1; }
        pkgs+=("$extra=$extra_version")
    done
    # What the compiler and LLVM load, in trixie's versions: Debian 12's glibc and libstdc++
    # are older than the ones they were built against.
    pkgs+=(libc6 libgcc-s1 libstdc++6)
    for dep in $(apt-cache "${apt_options[@]}" depends "$llvm" |
        awk '/^  Depends: lib/ { print $2 }' | sort -u); do
        case $dep in libc6 | libgcc-s1 | libstdc++6 | *:*) ;; *) pkgs+=("$dep") ;; esac
    done
    rm -rf "$tools/rust" "$tools/debs"
    mkdir -p "$tools/rust"
    local debs deb
    debs=$(download "${pkgs[@]}")
    for deb in $debs; do
        dpkg -x "$deb" "$tools/rust"
    done
    local loader=usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
    [ -x "$tools/rust/$loader" ] || { log "trixie's libc6 holds no $loader"; exit 1; }
    local libdirs=usr/lib/x86_64-linux-gnu dir
    for dir in "$tools"/rust/usr/lib/llvm-*/lib; do
        [ -d "$dir" ] && libdirs="$libdirs:${dir#"$tools/rust/"}"
    done
    mkdir -p "$tools/bin"
    # The same directories, as the wrapper spells them: relative to its own location.
    local wrapper_libdirs tool
    wrapper_libdirs=$(printf '%s' "$libdirs" | sed 's|^|$root/|; s|:|:$root/|g')
    for tool in rustc rustdoc clippy-driver; do
        [ -x "$tools/rust/usr/bin/$tool" ] || continue
        cat >"$tools/bin/$tool" <<WRAPPER
#!/bin/sh
# Runs Debian $suite's $tool $rust_version unpacked beside this script, with $suite's dynamic
# loader and libraries (written by .ci/trixie-rust.sh).
root=\$(cd "\$(dirname "\$0")/../rust" && pwd)
exec "\$root/$loader" --library-path "$wrapper_libdirs" "\$root/usr/bin/$tool" "\$@"
WRAPPER
        chmod +x "$tools/bin/$tool"
    done
    rm -rf "$tools/debs"
}
