#!/usr/bin/env bash
# Gets the guest kernels of the kernel matrix (.ci/kernels/matrix.sh): Debian's kernel images
# of other suites, downloaded and unpacked, never installed.
#
#   setup.sh [ARCH/SUITE ...]      default: amd64/bookworm amd64/trixie amd64/sid
#
# For each ARCH/SUITE, the current kernel package is the one the suite's meta package depends
# on (linux-image-cloud-amd64 for amd64, linux-image-arm64 for arm64, linux-image-riscv64 for
# riscv64; sid's package names change every few weeks, so nothing here names a version). The suite's package lists are read
# through a private apt configuration under target/kernels/apt/ (the system's apt sources and
# lists are never touched); they are refreshed when older than $THISCPU_KERNELS_MAX_AGE days
# (default 7; 0 refreshes every run), and a cached kernel is kept if the refresh fails.
# Each kernel lands in target/kernels/ARCH/SUITE/ as vmlinuz (riscv64's packages hold an
# uncompressed /boot/vmlinux-*: that image, under the same name), with `package` (the .deb it
# came from) and `release` (its uname -r). Prints those directories, one a line, and nothing else
# on stdout.
#
# For amd64 it also installs what is missing among qemu-system-x86, busybox-static and cpio
# (root needed then). Idempotent: with everything in place a run takes about a second.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
store=${THISCPU_KERNELS_DIR:-$repo/target/kernels}
max_age_days=${THISCPU_KERNELS_MAX_AGE:-7}
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

log() { printf 'kernels setup: %s\n' "$*" >&2; }

if [ $# -eq 0 ]; then
    set -- amd64/bookworm amd64/trixie amd64/sid
fi

# --- Host packages ---------------------------------------------------------------------------
need_x86=no
for wanted in "$@"; do
    case $wanted in amd64/*) need_x86=yes ;; esac
done
if [ "$need_x86" = yes ]; then
    missing=()
    command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
    [ -x /bin/busybox ] && /bin/busybox --list 2>/dev/null | grep -qx poweroff ||
        missing+=(busybox-static)
    command -v cpio >/dev/null || missing+=(cpio)
    if [ ${#missing[@]} -gt 0 ]; then
        [ "$(id -u)" = 0 ] || { log "must run as root to install ${missing[*]}"; exit 1; }
        log "apt-get install ${missing[*]}"
        apt-get update -qq
        # bookworm's qemu-system-common replaces a newer qemu-utils where one is installed;
        # nothing here needs qemu-utils.
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null
    fi
fi
command -v dpkg-deb >/dev/null || { log "dpkg-deb missing: this needs a Debian system"; exit 1; }
[ -r "$keyring" ] || { log "$keyring missing (package debian-archive-keyring)"; exit 1; }

# --- The archive -----------------------------------------------------------------------------
# The mirrors this machine already uses, from its deb822 or one-line sources; Debian's own
# when it has none.
system_uris() {
    {
        cat /etc/apt/sources.list.d/*.sources 2>/dev/null |
            sed -n 's/^URIs:[[:space:]]*//p' | tr ' ' '\n'
        cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
            sed -n 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]\+\).*/\2/p'
    } | grep -E '^https?://' || true
}
archive_uri=$(system_uris | grep -v -- '-security' | head -n 1)
security_uri=$(system_uris | grep -- '-security' | head -n 1)
archive_uri=${archive_uri:-http://deb.debian.org/debian}
security_uri=${security_uri:-http://deb.debian.org/debian-security}

# apt options that point every apt state and cache at $1, for architecture $2.
apt_options() {
    local dir=$1 arch=$2
    printf '%s\n' \
        -o "Dir::Etc::sourcelist=$dir/sources.list" -o Dir::Etc::sourceparts=/nonexistent \
        -o "Dir::State::Lists=$dir/lists" -o "Dir::Cache=$dir/cache" \
        -o Dir::State::status=/var/lib/dpkg/status \
        -o "APT::Architecture=$arch" -o "APT::Architectures=$arch" \
        -o APT::Sandbox::User=root
}

# Writes the private configuration of suite $2 for architecture $1 into $3 and refreshes its
# lists when they are missing or old (then sets refreshed=yes). Fails only when there are no
# lists at all.
refreshed=no
private_apt() {
    local arch=$1 suite=$2 dir=$3
    mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
    {
        echo "deb [arch=$arch signed-by=$keyring] $archive_uri $suite main"
        case $suite in
        sid | unstable | experimental) ;;
        *) echo "deb [arch=$arch signed-by=$keyring] $security_uri $suite-security main" ;;
        esac
    } >"$dir/sources.list.new"
    local stale=no
    if ! cmp -s "$dir/sources.list.new" "$dir/sources.list" 2>/dev/null; then
        mv "$dir/sources.list.new" "$dir/sources.list"
        stale=yes
    else
        rm -f "$dir/sources.list.new"
    fi
    if [ ! -e "$dir/updated" ] ||
        [ -n "$(find "$dir/updated" -mmin "+$((max_age_days * 24 * 60))" 2>/dev/null)" ]; then
        stale=yes
    fi
    [ "$stale" = yes ] || return 0
    local options
    mapfile -t options < <(apt_options "$dir" "$arch")
    log "apt-get update ($arch, $suite)"
    if apt-get "${options[@]}" update -qq >"$dir/update.log" 2>&1; then
        touch "$dir/updated"
        refreshed=yes
    elif [ -n "$(ls "$dir/lists" 2>/dev/null | grep -v partial)" ]; then
        log "apt-get update failed ($dir/update.log); using the lists from before"
    else
        log "apt-get update failed:"
        cat "$dir/update.log" >&2
        return 1
    fi
}

# The meta package that always depends on the suite's current kernel, per architecture.
meta_package() {
    case $1 in
    amd64) echo linux-image-cloud-amd64 ;;
    arm64) echo linux-image-arm64 ;;
    riscv64) echo linux-image-riscv64 ;;
    *) log "no kernel meta package known for $1"; return 1 ;;
    esac
}

# --- One kernel ------------------------------------------------------------------------------
fetch() {
    local arch=${1%%/*} suite=${1#*/}
    local dir=$store/apt/$suite-$arch out=$store/$arch/$suite
    refreshed=no
    private_apt "$arch" "$suite" "$dir"
    # Lists unchanged since the kernel was unpacked: it is still the current one.
    if [ "$refreshed" = no ] && [ -s "$out/vmlinuz" ] && [ -s "$out/package" ] &&
        [ "$out/package" -nt "$dir/updated" ]; then
        printf '%s\n' "$out"
        return 0
    fi
    local options
    mapfile -t options < <(apt_options "$dir" "$arch")
    local meta image abi
    meta=$(meta_package "$arch")
    image=$(apt-cache "${options[@]}" depends "$meta" 2>/dev/null |
        awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
    [ -n "$image" ] || { log "$suite has no $meta for $arch"; return 1; }
    image=${image%:"$arch"}
    abi=${image#linux-image-}
    # The image without a Secure Boot signature (direct -kernel boot checks none): since 6.16
    # Debian ships it as linux-binary-unsigned-ABI, before as linux-image-ABI-unsigned; where
    # nothing is signed (riscv64) it is linux-binary-ABI since 6.16, and the image package
    # itself before.
    local package="" candidate
    for candidate in "linux-binary-unsigned-$abi" "linux-image-$abi-unsigned" \
        "linux-binary-$abi" "$image"; do
        # A name that other packages only mention has no record, and `show` still succeeds.
        # (grep reads all of it: with -q, apt-cache could die of SIGPIPE and fail the pipe.)
        if apt-cache "${options[@]}" show "$candidate" 2>/dev/null | grep '^Package:' >/dev/null
        then
            package=$candidate
            break
        fi
    done
    [ -n "$package" ] || { log "no package holds the $abi image"; return 1; }

    if [ -s "$out/vmlinuz" ] && [ "$(cat "$out/package" 2>/dev/null)" = "$package" ]; then
        touch "$out/package"
        printf '%s\n' "$out"
        return 0
    fi
    log "$arch/$suite: $package"
    rm -rf "$out.tmp"
    mkdir -p "$out.tmp/deb" "$out.tmp/x"
    (cd "$out.tmp/deb" && apt-get "${options[@]}" download -qq "$package" >/dev/null)
    dpkg-deb --fsys-tarfile "$out.tmp/deb/"*.deb | tar -x -C "$out.tmp/x"
    local vmlinuz
    vmlinuz=$(find "$out.tmp/x" -type f \( -path '*/boot/vmlinuz*' -o -path '*/modules/*/vmlinuz*' \
        -o -path '*/boot/vmlinux-*' \) |
        sort | head -n 1)
    [ -n "$vmlinuz" ] || { log "$package holds no kernel image"; return 1; }
    cp "$vmlinuz" "$out.tmp/vmlinuz"
    printf '%s\n' "$package" >"$out.tmp/package"
    printf '%s\n' "$abi" >"$out.tmp/release"
    rm -rf "$out.tmp/deb" "$out.tmp/x" "$out"
    mv "$out.tmp" "$out"
    printf '%s\n' "$out"
}

for wanted in "$@"; do
    case $wanted in
    */*) fetch "$wanted" ;;
    *) log "expected ARCH/SUITE, got '$wanted'"; exit 2 ;;
    esac
done
