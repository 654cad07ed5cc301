#!/usr/bin/env bash
# The kernel x topology matrix: thiscpu's tests, `thiscpu info`, `stress`, `bench --quick` and
# the topology checks of .ci/kernels/guest.sh on Debian's x86_64 kernels of several series
# (.ci/kernels/setup.sh), each booted in qemu-system-x86_64 in several CPU topologies:
#
#   smp2     2 CPUs, one node; the registration's tests under both registrations and, on 7.x
#            (or a kernel without a numa-hotplug guest), the rest under glibc's, a legacy-mode
#            area on every kernel (the numa-hotplug guest runs the rest under thiscpu's own,
#            the optimized mode on 7.x and a legacy-mode area like glibc's before; see
#            REGISTRATION_TESTS and FEATURE_TESTS in guest.sh)
#   numa-hotplug
#            4 possible CPUs in 2 NUMA nodes (CPUs 0 and 2, 1 and 3), each with 1 GiB; 2 online
#            at boot (-smp 4 and the kernel's maxcpus=2), one in each node; CPUs 1-3 go offline
#            and online while `thiscpu stress` runs, then all come online, and the guest ends
#            with CPU 3 taken offline while a process starts and brought back. On the first and
#            the last kernel of the list only: what it adds (reading the topology, CPUs that
#            come and go) is the same code on every kernel
#   numa, up2of4
#            its two halves, on their own (not in the default list): 4 CPUs in nodes 0-1 and
#            2-3, all online; and 4 possible CPUs in one node, 2 online, with the hot-plug
#   many     64 possible CPUs in 4 NUMA nodes (node = CPU / 4 mod 4), 16 online at boot
#            (maxcpus=16); before the checks some go offline in the middle of the range and
#            some beyond 15 come online, so the online CPUs are numbered with gaps; three go
#            offline and online during `stress`. Only on the last kernel of the list (the
#            newest), with a selection of the tests ($THISCPU_KERNELS_MANY_TESTS), because 17
#            vCPUs on one host thread are slow.
#
#   matrix.sh [--kernels "bookworm sid"] [--topologies "smp2 numa-hotplug many"]
#
# The oldest kernel (6.1: rseq without node_id and mm_cid) and the newest (7.x: the optimized
# mode). Debian 13's 6.12 (trixie; node_id and mm_cid, the legacy mode only) boots in the
# riscv64 job, whose tests run every section of the library's contract on it; the x86_64
# sections are the same code under every kernel, so `--kernels "bookworm trixie sid"` adds
# nothing CI needs.
#
# On Linux 7.x every guest also writes to `cpu_id` of an optimized-mode area on purpose and
# requires the kernel to kill that process with SIGSEGV (and, as the control, a legacy-mode
# area to survive the same write), and the numa-hotplug guest boots with rseq_debug=1 (the kernel's
# checks of the area on every return to user space), where the legacy-mode write must be
# fatal too.
#
# Under TCG (qemu's software CPU, `-cpu max`; one host thread for all of a guest's vCPUs, see
# accel() below; the guests boot two at a time, each on a host CPU of its own, the longest
# first) unless THISCPU_KERNELS_KVM=1 asks for KVM (`-enable-kvm -cpu host`), which only helps where the host has real hardware
# virtualization. Builds the `thiscpu` command (release), the library's and the stress driver's
# test executables (`cargo test -p thiscpu -p thiscpu-stress --all-features --no-run`: the
# optional features' tests too, the same build as the `features` step of .ci/run) and the probe
# (.ci/kernels/probe) with the repository's target directory, and one initramfs for every
# guest. A guest fails on any failed check, a kernel crash, a hang (more than
# $THISCPU_KERNELS_TIMEOUT seconds, default 600), on output that ends before its end marker,
# when a test executable runs no test, and on 7.x when the enforcement checks did not run. Full
# logs go to target/kernels/logs/; the console gets each check's result, the output of failed
# checks and a summary with each guest's time.
#
# Other knobs: THISCPU_KERNELS_STRESS (seconds per part of `stress`, default 3; at least 5
# where CPUs are hot-plugged during it),
# THISCPU_KERNELS_BENCH (families for `bench --quick`, comma-separated, default getcpu,counter),
# THISCPU_KERNELS_MANY_TESTS (the many guest's test executables, space-separated).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
here=.ci/kernels
store=$repo/target/kernels
kernels="bookworm sid"
topologies="smp2 numa-hotplug many"
timeout_s=${THISCPU_KERNELS_TIMEOUT:-600}
stress_s=${THISCPU_KERNELS_STRESS:-3}
bench=${THISCPU_KERNELS_BENCH:-getcpu,counter}
many_tests="identity topology registration counter pool sharded fence mm_cid"
many_tests=${THISCPU_KERNELS_MANY_TESTS:-$many_tests}

while [ $# -gt 0 ]; do
    case $1 in
    --kernels) kernels=$2; shift 2 ;;
    --topologies) topologies=$2; shift 2 ;;
    *) echo "usage: $0 [--kernels \"SUITE...\"] [--topologies \"smp2 numa-hotplug numa up2of4 many\"]" >&2; exit 2 ;;
    esac
done

run() {
    printf '+'
    printf ' %q' "$@"
    printf '\n'
    "$@"
}

t_start=$SECONDS

# --- Kernels ---------------------------------------------------------------------------------
wanted=()
for suite in $kernels; do wanted+=("amd64/$suite"); done
mapfile -t kernel_dirs < <(bash "$here/setup.sh" "${wanted[@]}")
[ ${#kernel_dirs[@]} -eq ${#wanted[@]} ] || { echo "setup.sh did not provide every kernel"; exit 1; }

# --- Executables -------------------------------------------------------------------------------
run cargo build --locked --release -p thiscpu-cli
tests_json=$(mktemp)
trap 'rm -f "$tests_json"' EXIT
run cargo test --locked -p thiscpu -p thiscpu-stress --all-features --no-run \
    --message-format=json >"$tests_json"
run env CARGO_TARGET_DIR="$store/probe" cargo build --locked --release \
    --manifest-path "$here/probe/Cargo.toml"

# --- initramfs (one for all guests) ------------------------------------------------------------
root=$store/initramfs
rm -rf "$root"
mkdir -p "$root"/{bin,proc,sys,dev,tmp,opt/t/deps,opt/t/examples}
cp /bin/busybox "$root/bin/busybox"

# Test executables by target name, and the shared libraries the examples build (the
# shared_library test loads one from ../examples/ next to its own directory).
python3 - "$tests_json" "$root/opt/t" <<'EOF'
import json, shutil, sys
messages, dest = sys.argv[1], sys.argv[2]
count = 0
for line in open(messages):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact":
        continue
    if m["profile"]["test"] and m.get("executable"):
        shutil.copy(m["executable"], f"{dest}/deps/{m['target']['name']}")
        count += 1
    elif "cdylib" in m["target"].get("crate_types", []):
        for path in m["filenames"]:
            if path.endswith(".so"):
                shutil.copy(path, f"{dest}/examples/{path.rsplit('/', 1)[1]}")
if count == 0:
    sys.exit("cargo test --no-run named no test executable")
EOF
cp target/release/thiscpu "$root/opt/t/thiscpu"
cp "$store/probe/release/thiscpu-topology-probe" "$root/opt/t/probe"
cp "$here/guest.sh" "$root/guest.sh"
find "$root/opt/t" -type f -exec objcopy --strip-debug {} \;

# The shared libraries of every executable, at the host's paths (they are the host's glibc),
# plus libgcc_s, which glibc loads with dlopen when a thread unwinds.
{
    find "$root/opt/t" -type f -exec ldd {} \; 2>/dev/null |
        sed -n 's/.*=> \(\/[^ ]*\).*/\1/p; s/^[[:space:]]*\(\/[^ ]*\) (0x.*/\1/p'
    ldconfig -p | sed -n 's/.*libgcc_s.so.1 (libc6,x86-64) => //p' | head -n 1
} | sort -u | while read -r lib; do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
done

cat >"$root/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/opt/t
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
sh /guest.sh
echo "@@GUEST_EXIT=$?"
poweroff -f
EOF
chmod +x "$root/init" "$root/bin/busybox"
(cd "$root" && find . -mindepth 1 | cpio -o -H newc --quiet >"$store/initramfs.cpio")
echo "initramfs: $(du -m "$store/initramfs.cpio" | cut -f1) MiB," \
    "$(ls "$root/opt/t/deps" | wc -l) test executables"

# --- Guests -------------------------------------------------------------------------------------
# accel: sets accel (qemu options). Under TCG every guest runs all its vCPUs on one host thread:
# the kernel patches its own text at run time (static keys, with an int3 first), and with one
# host thread per vCPU another vCPU can still execute its translation of the old bytes. Seen
# twice: in the sid up2of4 guest, "Oops: int3" at a jump-label site in update_sd_lb_stats whose
# bytes were already the patched nop (the kernel's own int3 handler no longer knew the site), a
# panic during `stress` with hot-plug; and in the sid smp2 guest (one thread per vCPU then),
# "Oops: int3" in ktime_get_update_offsets_now, whose bytes were already the patched jump, a
# panic during `bench --quick counter`. Reproduce with `bash .ci/kernels/matrix.sh --kernels sid
# --topologies up2of4` and THISCPU_KERNELS_TCG=multi (the smp2 panic was seen once). Two
# guests run at a time instead, each on a host CPU of its own.
accel() {
    if [ "${THISCPU_KERNELS_KVM:-0}" = 1 ]; then
        accel=(-enable-kvm -cpu host)
        accel_label=kvm
    elif [ "${THISCPU_KERNELS_TCG:-}" = multi ]; then
        accel=(-accel tcg,thread=multi -cpu max)
        accel_label=tcg-multi
    else
        accel=(-accel tcg,thread=single -cpu max)
        accel_label=tcg-single
    fi
}

# topology NAME: sets qemu_topology (qemu options) and kernel_topology (kernel arguments).
topology() {
    kernel_topology=""
    case $1 in
    smp2) qemu_topology=(-smp 2 -m 2G) ;;
    numa-hotplug)
        qemu_topology=(
            -smp 4 -m 2G
            -object memory-backend-ram,id=m0,size=1G -numa node,nodeid=0,cpus=0,cpus=2,memdev=m0
            -object memory-backend-ram,id=m1,size=1G -numa node,nodeid=1,cpus=1,cpus=3,memdev=m1
        )
        kernel_topology="maxcpus=2"
        ;;
    numa | up2of4)
        qemu_topology=(-smp 4,sockets=2,cores=2 -m 2G)
        if [ "$1" = numa ]; then
            qemu_topology+=(
                -object memory-backend-ram,id=m0,size=1G -numa node,nodeid=0,cpus=0-1,memdev=m0
                -object memory-backend-ram,id=m1,size=1G -numa node,nodeid=1,cpus=2-3,memdev=m1
            )
        else
            # -smp 2,maxcpus=N makes possible > online only on 6.1; maxcpus= on the kernel's
            # command line does it on every kernel.
            kernel_topology="maxcpus=2"
        fi
        ;;
    many)
        # All 64 present (qemu 7.2's ACPI tables give 6.12+ no hot-pluggable CPUs beyond the
        # present ones, see kernels.md), 16 online at boot. Node N holds CPUs 4N-4N+3 of each
        # block of 16, so the CPUs online at boot already span the four nodes.
        qemu_topology=(-smp 64 -m 2G)
        for node in 0 1 2 3; do
            cpus=""
            for block in 0 16 32 48; do
                cpus+=",cpus=$((block + 4 * node))-$((block + 4 * node + 3))"
            done
            qemu_topology+=(
                -object "memory-backend-ram,id=m$node,size=512M"
                -numa "node,nodeid=$node$cpus,memdev=m$node"
            )
        done
        kernel_topology="maxcpus=16 KM_OFFLINE=\"5 9 10\" KM_ONLINE=\"21 38 48 63\""
        kernel_topology+=" KM_HOTPLUG=\"7 10 38\" KM_TESTS=\"$many_tests\""
        ;;
    *) echo "unknown topology $1"; return 1 ;;
    esac
}

# Relays a guest's console: every check's result line, and the output of a check that failed.
relay() {
    awk '
        { sub(/\r$/, "") }
        /^=== / { buffer = ""; next }
        /^@@CHECK / {
            if ($3 != "ok") printf "%s", buffer
            printf "    %-40s %s %s s\n", $2, $3 == "ok" ? "ok  " : "FAIL", $NF
            buffer = ""; fflush(); next
        }
        /^@@/ { next }
        { buffer = buffer "      | " $0 "\n" }
        END { if (buffer != "") printf "%s", buffer }
    '
}

mkdir -p "$store/logs"
summary=()
failures=0

# guest_plan DIR TOPO: sets what one guest needs (qemu options, kernel command line, log), or
# returns 1 when this kernel does not run that topology.
guest_plan() {
    dir=$1
    topo=$2
    suite=${dir##*/}
    release=$(cat "$dir/release")
    # Linux 7.x enforces the read-only ID fields of an optimized-mode area.
    enforce=0
    [ "${release%%.*}" -ge 7 ] && enforce=1
    if [ "$topo" = many ] && [ "$dir" != "${kernel_dirs[-1]}" ]; then return 1; fi
    # The topologies but smp2 on the oldest and the newest kernel only (see the header).
    if [ "$topo" != smp2 ] && [ "$dir" != "${kernel_dirs[0]}" ] &&
        [ "$dir" != "${kernel_dirs[-1]}" ]; then return 1; fi
    topology "$topo"
    accel
    stress=$stress_s
    case $topo in up2of4 | numa-hotplug) stress=$((stress_s > 5 ? stress_s : 5)) ;; esac
    guest=$topo
    extra=""
    if [ "$enforce" = 1 ] && { [ "$topo" = numa ] || [ "$topo" = numa-hotplug ]; }; then
        guest=$topo+rseq_debug
        extra="rseq_debug=1 KM_RSEQ_DEBUG=1"
    fi
    log=$store/logs/$suite-$guest.log
    append="console=ttyS0 panic=-1 quiet loglevel=3 rdinit=/init $kernel_topology $extra"
    append+=" KM_TOPOLOGY=$topo KM_STRESS=$stress KM_BENCH=$bench KM_TIMEOUT=$((timeout_s / 2))"
    append+=" KM_ENFORCE=$enforce"
    # The optional features' tests (see FEATURE_TESTS in guest.sh): the newest kernel's smp2.
    if [ "$topo" = smp2 ] && [ "$dir" = "${kernel_dirs[-1]}" ]; then
        append+=" KM_FEATURES=1"
    fi
    # The rest of the suite in smp2 (see REGISTRATION_TESTS in guest.sh): under glibc's area;
    # none on a kernel without the optimized mode whose numa-hotplug guest runs it under
    # thiscpu's own, since both areas are legacy-mode areas there and differ only in where
    # they lie, which the registration's tests check under each.
    if [ "$topo" = smp2 ]; then
        rest=glibc
        if [ "$enforce" != 1 ] && [[ " $topologies " == *" numa-hotplug "* ]] &&
            { [ "$dir" = "${kernel_dirs[0]}" ] || [ "$dir" = "${kernel_dirs[-1]}" ]; }; then
            rest=none
        fi
        append+=" KM_REST=$rest"
    fi
    return 0
}

# guest_boot: boots the guest that guest_plan set up. The console goes to its log, the relayed
# check lines to LOG.relay, qemu's exit status and the seconds it ran to LOG.status. Runs in
# the background as well as in the foreground: it writes only its own files.
guest_boot() {
    local t0=$SECONDS status
    set +e
    timeout --foreground -k 10 "$timeout_s" qemu-system-x86_64 "${accel[@]}" \
        "${qemu_topology[@]}" -nographic -no-reboot -nic none \
        -kernel "$dir/vmlinuz" -initrd "$store/initramfs.cpio" \
        -append "$append" \
        </dev/null 2>&1 | tee "$log" | relay >"$log.relay"
    status=${PIPESTATUS[0]}
    set -e
    echo "$status $((SECONDS - t0))" >"$log.status"
}

# guest_verdict: prints the relayed lines of the guest that guest_plan set up and its
# verdict, from its log alone, and adds it to the summary.
guest_verdict() {
    local status took verdict
    read -r status took <"$log.status"
    echo
    echo "=== kernels: $release ($suite), $guest"
    cat "$log.relay"
    verdict=$(tr -d '\r' <"$log" | awk -v release="$release" -v status="$status" \
        -v enforce="$enforce" '
        /@@KERNEL / { sub(/.*@@KERNEL /, ""); kernel = $1 }
        /^@@CHECK / { checks++; if ($3 != "ok") failed++ }
        /^@@CHECK write-cpu-id-optimized ok / { enforced = 1 }
        /^@@SKIPPED / { skipped++ }
        /^@@TESTS / { programs++; split($3, p, "="); tests += p[2]; if (p[2] + 0 == 0) { empty++; names = names " " $2 } }
        /^@@END / { split($2, c, "="); split($3, f, "="); end_checks = c[2]; end_failed = f[2]; ended = 1 }
        /^@@GUEST_EXIT=/ { exit_code = substr($0, 14) }
        END {
            if (status == 124 || status == 137) { print "FAIL: hung (timeout)"; exit }
            if (kernel != release) { print "FAIL: booted " (kernel == "" ? "nothing" : kernel) " instead of " release; exit }
            if (!ended) { print "FAIL: no end marker after " checks + 0 " checks (crash or panic)"; exit }
            if (end_checks != checks + 0) { print "FAIL: " checks + 0 " check results for " end_checks " checks"; exit }
            if (failed + 0 > 0 || end_failed != 0 || exit_code != "0") { print "FAIL: " failed + 0 " of " checks " checks failed"; exit }
            if (enforce == 1 && !enforced) { print "FAIL: no proof that the kernel enforces the optimized mode"; exit }
            if (empty + 0 > 0) { print "FAIL: " empty " test executables ran no tests:" names; exit }
            print "ok: " checks " checks passed, " programs + 0 " test executables ran " tests + 0 " tests, 0 with no tests, " skipped + 0 " skipped"
        }')
    echo "--- kernels: $release ($suite), $guest: $verdict in $took s (log: ${log#"$repo/"})"
    summary+=("$(printf '%-28s %-16s %4d s  %-14s %s' "$release" "$guest" "$took" \
        "$accel_label" "$verdict")")
    case $verdict in ok*) ;; *) failures=$((failures + 1)) ;; esac
}

# The guests whose vCPUs share one host thread (tcg-single, see accel) use one host CPU each,
# so two of them run at a time, each on its own host CPU, and the next boots as soon as one
# ends (not when both have); the others (KVM, or one host thread per vCPU) boot alone. Guest
# plans are kept as "DIR TOPO" pairs and set up again for the verdict. The smp2 guests first
# (the whole suite, and the debugger's test), newest kernel first, then the others.
single=()
plans=()
for ((k = ${#kernel_dirs[@]} - 1; k >= 0; k--)); do
    for topo in $topologies; do
        if [ "$topo" = smp2 ]; then plans+=("${kernel_dirs[k]} $topo"); fi
    done
done
for dir in "${kernel_dirs[@]}"; do
    for topo in $topologies; do
        if [ "$topo" != smp2 ]; then plans+=("$dir $topo"); fi
    done
done
for plan in "${plans[@]}"; do
    read -r dir topo <<<"$plan"
    guest_plan "$dir" "$topo" || continue
    if [ "$accel_label" = tcg-single ]; then
        single+=("$dir $topo")
        continue
    fi
    echo
    echo "=== kernels: $release ($suite), $guest: booting"
    guest_boot
    guest_verdict
done
at_once=$(($(nproc) >= 2 ? 2 : 1))
running=0
echo
for plan in "${single[@]}"; do
    if [ "$running" -ge "$at_once" ]; then
        wait -n || true
        running=$((running - 1))
    fi
    read -r plan_dir plan_topo <<<"$plan"
    guest_plan "$plan_dir" "$plan_topo"
    echo "=== kernels: $release ($suite), $guest: booting (one host thread)"
    guest_boot &
    running=$((running + 1))
done
wait
# guest_boot's own status is in its log, which the verdict reads.
for plan in "${single[@]}"; do
    read -r plan_dir plan_topo <<<"$plan"
    guest_plan "$plan_dir" "$plan_topo"
    guest_verdict
done

echo
echo "=== kernels: summary ($(nproc) host CPUs)"
printf '%s\n' "${summary[@]}"
echo "total $((SECONDS - t_start)) s, $failures of ${#summary[@]} guests failed"
[ "$failures" = 0 ]
