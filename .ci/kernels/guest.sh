#!/bin/sh
# The checks of one guest of the kernel matrix, run by /init (busybox sh) inside the VM that
# .ci/kernels/matrix.sh boots. The kernel command line passes:
#   KM_TOPOLOGY   smp2 | numa-hotplug | numa | up2of4 | many (what the host configured;
#                 decides the extra checks: numa-hotplug runs those of up2of4, then numa's)
#   KM_STRESS     seconds of each part of `thiscpu stress` (counter, then pool)
#   KM_BENCH      bench families for `thiscpu bench --quick`, comma-separated
#   KM_TIMEOUT    seconds one check may take before it counts as hung
#   KM_TESTS      the test executables to run, space-separated (default: all)
#   KM_FEATURES   1 in the one guest that runs the optional features' tests (FEATURE_TESTS)
#   KM_REST       (smp2) the registration the rest of the suite runs under: glibc, or none
#   KM_ENFORCE    1 on kernels that enforce the read-only ID fields of an optimized-mode area
#                 (Linux 7.x): a deliberate write to `cpu_id` must kill the process
#   KM_RSEQ_DEBUG 1 when the kernel was booted with rseq_debug=1, which enforces them in the
#                 legacy mode too
#   KM_OFFLINE, KM_ONLINE  (topology many) CPUs taken offline and brought online before the
#                 checks, so that the online CPUs are numbered with gaps
#   KM_HOTPLUG    (topologies with hot-plug) the CPUs toggled during `stress` (default: every
#                 hot-pluggable present CPU)
# Every check prints `=== NAME` and ends with `@@CHECK NAME ok SECONDS` or
# `@@CHECK NAME FAIL rc=N SECONDS`; the last line is `@@END checks=N failed=M`. The host fails
# the guest on any FAIL, on a missing @@END and on a count that does not add up. A test
# executable's check also prints `@@TESTS NAME passed=N`, and fails when N is 0: a program
# whose tests are all compiled out or ignored proves nothing.
#
# Layout of the initramfs: /opt/t/thiscpu (the command), /opt/t/probe (.ci/kernels/probe),
# /opt/t/deps/NAME (the library's test executables), /opt/t/examples/ (what they load).

CPU_SYS=/sys/devices/system/cpu
OWN="GLIBC_TUNABLES=glibc.pthread.rseq=0 THISCPU_EXPECT_REGISTRAR=thiscpu"
GLIBC="THISCPU_EXPECT_REGISTRAR=glibc"

# Hundredths of a second since boot.
now_cs() {
    read -r up _ </proc/uptime
    echo "${up%.*}${up#*.}" | sed 's/^0*//; s/^$/0/'
}

# The CPUs of a kernel CPU list ("0-1,3"), one a line.
expand_list() {
    echo "$1" | tr ',' '\n' | while IFS=- read -r first last; do
        [ -n "$first" ] && seq "$first" "${last:-$first}"
    done
}

cpus_in() { expand_list "$(cat "$CPU_SYS/$1")"; }

# The node of a CPU from its nodeN link (kept while the CPU is offline).
sys_node() {
    for link in "$CPU_SYS/cpu$1"/node*; do
        [ -e "$link" ] && { echo "${link##*node}"; return 0; }
    done
    echo "none"
}

sys_state() {
    for f in possible present online offline; do
        printf '%-8s %s\n' "$f" "$(cat "$CPU_SYS/$f")"
    done
    for node in /sys/devices/system/node/node*; do
        [ -d "$node" ] && printf '%-8s cpus %s\n' "${node##*/}" "$(cat "$node/cpulist")"
    done
}

# --- Checks (each runs as its own process: `sh /guest.sh run NAME ARGS`) ----------------------

# pinned WHO ENV...: on every online CPU, `thiscpu` pinned there prints that CPU, its node
# from /sys, and rseq registered by WHO as the source.
pinned() {
    who=$1
    shift
    bad=0
    for cpu in $(cpus_in online); do
        node=$(sys_node "$cpu")
        line=$(env "$@" taskset -c "$cpu" thiscpu 2>&1)
        case $line in
        "cpu $cpu node $node (from rseq ($who"*) echo "ok   $line" ;;
        *)
            echo "FAIL on cpu $cpu: '$line', expected 'cpu $cpu node $node (from rseq ($who))'"
            bad=1
            ;;
        esac
    done
    return $bad
}

# rseq_mode WHO ENV...: `thiscpu info --json` reports the mode the registration of WHO
# (thiscpu or glibc) must have: thiscpu's own is optimized exactly where the kernel's rseq
# feature size exceeds 32; glibc's is legacy unless its __rseq_size exceeds 32, and then
# `info` must explain how to get the optimized mode.
rseq_mode() {
    who=$1
    shift
    json=$(env "$@" thiscpu info --json) || return 1
    field() { echo "$json" | sed -n "s/.*\"$1\": \"*\([a-z0-9]*\).*/\1/p" | tail -n 1; }
    registrar=$(field registered_by)
    feature=$(field kernel_feature_size)
    mode=$(field mode)
    glibc_size=$(field glibc_rseq_size)
    advice=$(field mode_advice)
    echo "registered by $registrar, feature size $feature, mode $mode, size $(field registered_size)," \
        "optimized size $(field optimized_size), advice: $(echo "$json" | sed -n 's/.*"mode_advice": //p')"
    [ "$registrar" = "$who" ] || { echo "FAIL: expected registration by $who"; return 1; }
    want=legacy
    if [ "$who" = thiscpu ] && [ "$feature" -gt 32 ]; then want=optimized; fi
    if [ "$who" = glibc ] && [ "$glibc_size" -gt 32 ]; then want=optimized; fi
    [ "$mode" = "$want" ] || { echo "FAIL: mode $mode, expected $want"; return 1; }
    if [ "$who" = glibc ] && [ "$want" = legacy ] && [ "$feature" -gt 32 ]; then
        [ "$advice" != null ] || { echo "FAIL: no advice for glibc's legacy area"; return 1; }
    fi
    return 0
}

set_online() {
    if echo "$2" >"$CPU_SYS/cpu$1/online"; then
        return 0
    fi
    echo "could not write $2 to cpu$1/online"
    return 1
}

# stress_while_hotplug ENV...: `thiscpu stress` while every hot-pluggable present CPU (all
# but CPU 0, which x86 cannot take offline) is taken offline and brought back in turn.
stress_while_hotplug() {
    toggled=""
    for cpu in ${KM_HOTPLUG:-$(cpus_in present)}; do
        [ -e "$CPU_SYS/cpu$cpu/online" ] && toggled="$toggled $cpu"
    done
    [ -n "$toggled" ] || { echo "no hot-pluggable CPU"; return 1; }
    env "$@" thiscpu stress --seconds "$KM_STRESS" &
    stress=$!
    changes=0
    refused=0
    while kill -0 "$stress" 2>/dev/null; do
        for cpu in $toggled; do
            state=$(cat "$CPU_SYS/cpu$cpu/online")
            if set_online "$cpu" $((1 - state)); then
                changes=$((changes + 1))
            else
                refused=$((refused + 1))
            fi
            sleep 0.2
        done
    done
    wait "$stress"
    rc=$?
    echo "hot-plug during stress: CPUs$toggled, $changes state changes, $refused refused"
    echo "online afterwards: $(cat "$CPU_SYS/online")"
    [ "$rc" = 0 ] && [ "$changes" -ge 4 ] && [ "$refused" = 0 ]
}

# node_after_online CPU: a process that started while CPU was offline, moved onto CPU after
# it comes back, must get CPU's node from getcpu(), current_node() and node_of_cpu().
node_after_online() {
    cpu=$1
    rm -f /tmp/go
    mkfifo /tmp/go
    probe wait "$cpu" </tmp/go >/tmp/probe.out 2>&1 &
    pid=$!
    exec 3>/tmp/go
    i=0
    until grep -q '^started' /tmp/probe.out 2>/dev/null; do
        i=$((i + 1))
        [ "$i" -lt 300 ] || { echo "the probe did not start"; kill "$pid"; return 1; }
        sleep 0.1
    done
    set_online "$cpu" 1 || return 1
    taskset -p -c "$cpu" "$pid" >/dev/null || { echo "taskset -p failed"; return 1; }
    echo go >&3
    exec 3>&-
    wait "$pid"
    rc=$?
    cat /tmp/probe.out
    return $rc
}

# test_program EXE ENV...: one test executable, which must pass and run at least one test.
test_program() {
    exe=$1
    shift
    # The allocator's storms, short threads and forks (tests/per_cpu_alloc.rs), scaled to an
    # emulated machine as in the arm64 and riscv64 guests: 2,000 threads rather than 100,000,
    # storms of 0.5 s rather than 2.5, 10 forks of a busy process rather than 40.
    env THISCPU_TEST_ALLOC_THREADS=2000 THISCPU_TEST_ALLOC_STORM_MS=500 \
        THISCPU_TEST_ALLOC_FORKS=10 "$@" "$exe" --test-threads=2 -q >/tmp/test.out 2>&1
    rc=$?
    cat /tmp/test.out
    # The last result line is the executable's own; tests that run a copy of the executable
    # in a child print the child's before it.
    passed=$(sed -n 's/^test result: [A-Za-z]*\. \([0-9]*\) passed.*/\1/p' /tmp/test.out |
        tail -n 1)
    passed=${passed:-0}
    echo "@@TESTS ${exe##*/} passed=$passed"
    [ "$rc" = 0 ] || return "$rc"
    [ "$passed" -gt 0 ] || { echo "FAIL: ${exe##*/} ran no tests"; return 1; }
}

# write_cpu_id MODE EXPECT ENV...: `probe write-cpu-id MODE` writes into the kernel's `cpu_id`
# of its own area registered in MODE and migrates; EXPECT is `SEGV` (the kernel must kill it
# with that signal) or `survives` (exit status 0).
write_cpu_id() {
    mode=$1
    expect=$2
    shift 2
    env "$@" probe write-cpu-id "$mode"
    rc=$?
    if [ "$rc" -gt 128 ]; then
        got=$(kill -l $((rc - 128)))
        echo "the probe died by signal $((rc - 128)) (SIG$got); expected: $expect"
    else
        got=exit$rc
        [ "$rc" = 0 ] && got=survives
        echo "the probe exited with status $rc; expected: $expect"
    fi
    [ "$got" = "$expect" ]
}

# make_sparse: takes $KM_OFFLINE offline and brings $KM_ONLINE online, and checks that the
# online CPUs are then exactly what was asked.
make_sparse() {
    for cpu in $KM_OFFLINE; do set_online "$cpu" 0 || return 1; done
    for cpu in $KM_ONLINE; do set_online "$cpu" 1 || return 1; done
    bad=0
    for cpu in $KM_OFFLINE; do
        [ "$(cat "$CPU_SYS/cpu$cpu/online")" = 0 ] || { echo "cpu$cpu still online"; bad=1; }
    done
    for cpu in $KM_ONLINE; do
        [ "$(cat "$CPU_SYS/cpu$cpu/online")" = 1 ] || { echo "cpu$cpu still offline"; bad=1; }
    done
    echo "online: $(cat "$CPU_SYS/online") ($(cpus_in online | wc -l) CPUs)"
    return $bad
}

if [ "$1" = run ]; then
    shift
    "$@"
    exit $?
fi

# --- The sequence ---------------------------------------------------------------------------
checks=0
failed=0

# check NAME COMMAND...: runs COMMAND with a time limit and records the result.
check() {
    name=$1
    shift
    echo "=== $name"
    start=$(now_cs)
    timeout "$KM_TIMEOUT" "$@"
    rc=$?
    took=$(($(now_cs) - start))
    seconds=$((took / 100)).$(printf '%02d' $((took % 100)))
    checks=$((checks + 1))
    if [ "$rc" = 0 ]; then
        echo "@@CHECK $name ok $seconds"
    else
        failed=$((failed + 1))
        echo "@@CHECK $name FAIL rc=$rc $seconds"
    fi
}

# Runs a shell function of this file as its own process (which `timeout` can stop).
FN="sh /guest.sh run"

# The tests whose subject is the registration itself or what it reports: the CPU and node
# identity, the registration and its fallback, the topology, mm_cid, the counter as the
# smallest user of a section, and thiscpu in a library loaded with dlopen (its own area is
# initial-exec TLS there). Each guest runs these under both registrations. The rest of the
# suite runs under one registration per guest, since the topology and the registrar are
# independent:
# - smp2: under glibc's (a legacy-mode area on every kernel: glibc 2.36 registers 32 bytes),
#   or not at all where matrix.sh says KM_REST=none: a kernel without the optimized mode whose
#   numa-hotplug guest runs it;
# - the topology guests: under thiscpu's own (the optimized mode on 7.x, KM_ENFORCE=1).
# So on 7.x the whole suite runs in each mode: the legacy one in smp2, the optimized one in
# numa-hotplug (with rseq_debug, which checks the area at every return to user space); on
# older kernels both areas are legacy-mode areas and differ only in where they lie, which the
# tests above check under each, so the numa-hotplug guest's run is the kernel's one.
REGISTRATION_TESTS="identity registration fallback topology mm_cid counter shared_library"

# The tests of the optional features (metrics backends, serde): they exercise the same per-CPU
# operations as the others, through other crates' interfaces, and nothing in them depends on
# the kernel or the topology, so one guest runs them (the newest kernel's smp2, under glibc's
# registration; KM_FEATURES=1), besides every host step.
FEATURE_TESTS="metrics metrics_layer prometheus_client serde"

# Test executables declared to have nothing to run here, each with why: the host counts them
# as skipped; any other executable that runs no test fails.
SKIPPED_TESTS="model:built-only-with---cfg-thiscpu_model-(the-model-step)
model_decision:built-only-with---cfg-thiscpu_model-(the-model-step)
model_rwlock:built-only-with---cfg-thiscpu_model-(the-model-step)
model_alloc:built-only-with---cfg-thiscpu_model-(the-model-step)
model_heap_lock:built-only-with---cfg-thiscpu_model-(the-model-step)
model_heap:built-only-with---cfg-thiscpu_model-(the-model-step)
model_capacity:built-only-with---cfg-thiscpu_model-(the-model-step)"

# Every test executable but the debugger's: single-stepping through sections under TCG takes
# tens of seconds, so it runs once per kernel (smp2, below) rather than in every guest twice.
library_tests() {
    for exe in /opt/t/deps/*; do
        name=${exe##*/}
        why=$(echo "$SKIPPED_TESTS" | sed -n "s/^$name://p")
        if [ -n "$why" ]; then
            echo "@@SKIPPED test-$name-$1 $why"
            continue
        fi
        if [ -n "$KM_TESTS" ]; then
            case " $KM_TESTS " in *" $name "*) ;; *) continue ;; esac
        else
            [ "$name" = debugger ] && continue
            if [ "${KM_FEATURES:-0}" != 1 ]; then
                case " $FEATURE_TESTS " in *" $name "*) continue ;; esac
            fi
            # The registrar that runs the rest of the suite here (see REGISTRATION_TESTS).
            rest=${KM_REST:-glibc}
            [ "$KM_TOPOLOGY" = smp2 ] || rest=own
            if [ "$rest" != "$1" ]; then
                case " $REGISTRATION_TESTS " in *" $name "*) ;; *) continue ;; esac
            fi
        fi
        check "test-$name-$1" $FN test_program "$exe" $2
    done
}

# After an empty line: the console's first line starts with the firmware's escape sequences.
echo
echo "@@KERNEL $(uname -r)"
echo "topology $KM_TOPOLOGY · stress ${KM_STRESS}s per part · bench $KM_BENCH"
sys_state
if [ "$KM_TOPOLOGY" = many ]; then
    check sparse-online $FN make_sparse
    sys_state
fi

check info-glibc env $GLIBC thiscpu info
check info-own env $OWN thiscpu info
check mode-glibc $FN rseq_mode glibc $GLIBC
check mode-own $FN rseq_mode thiscpu $OWN
check topology probe topology
check pinned-glibc $FN pinned glibc $GLIBC
check pinned-own $FN pinned thiscpu $OWN
library_tests glibc "$GLIBC"
library_tests own "$OWN"

# The kernel's enforcement of the read-only ID fields, shown on a throwaway process: without it
# a passing run on 7.x would not tell whether thiscpu's optimized-mode area is really what the
# kernel treats as one.
if [ "$KM_ENFORCE" = 1 ]; then
    check write-cpu-id-optimized $FN write_cpu_id optimized SEGV $OWN
    if [ "$KM_RSEQ_DEBUG" = 1 ]; then
        check write-cpu-id-legacy-rseq-debug \
            $FN write_cpu_id legacy SEGV $OWN THISCPU_RSEQ_AREA=legacy
    else
        check write-cpu-id-legacy $FN write_cpu_id legacy survives $OWN THISCPU_RSEQ_AREA=legacy
    fi
fi

case $KM_TOPOLOGY in
many)
    before=""
    for cpu in $KM_HOTPLUG; do before="$before $cpu:$(cat "$CPU_SYS/cpu$cpu/online")"; done
    check stress-own-hotplug $FN stress_while_hotplug $OWN
    # Back to the gaps of make_sparse, whatever state the hot-plug loop left.
    for state in $before; do echo "${state#*:}" >"$CPU_SYS/cpu${state%:*}/online"; done
    sys_state
    check topology-after-hotplug probe topology
    check pinned-after-hotplug-glibc $FN pinned glibc $GLIBC
    ;;
up2of4 | numa-hotplug)
    check stress-glibc-hotplug $FN stress_while_hotplug $GLIBC
    check stress-own-hotplug $FN stress_while_hotplug $OWN
    # Every present CPU online (whatever the hot-plug loop left), then what a process
    # started now sees.
    for cpu in $(cpus_in present); do
        [ -e "$CPU_SYS/cpu$cpu/online" ] && echo 1 >"$CPU_SYS/cpu$cpu/online"
    done
    sys_state
    check topology-all-online probe topology
    check pinned-all-online-glibc $FN pinned glibc $GLIBC
    check pinned-all-online-own $FN pinned thiscpu $OWN
    check test-identity-all-online-own $FN test_program /opt/t/deps/identity $OWN
    ;;
*)
    check stress-glibc env $GLIBC thiscpu stress --seconds "$KM_STRESS"
    check stress-own env $OWN thiscpu stress --seconds "$KM_STRESS"
    if [ "$KM_TOPOLOGY" = smp2 ]; then
        check test-debugger-own $FN test_program /opt/t/deps/debugger $OWN
    fi
    ;;
esac

[ "$KM_TOPOLOGY" = many ] || check bench-quick thiscpu bench --quick $(echo "$KM_BENCH" | tr ',' ' ')
# The cost of the kernel's legacy rseq mode against the optimized one (7.x), each case in a
# child process; elsewhere it says why it cannot compare. On smp2 only: the ratio is what
# counts, and the guest with one vCPU per host core disturbs it least.
if [ "$KM_TOPOLOGY" = smp2 ]; then
    check bench-rseq-mode thiscpu bench rseq-mode --rounds 11 --seconds 10
fi

if [ "$KM_TOPOLOGY" = numa ] || [ "$KM_TOPOLOGY" = numa-hotplug ]; then
    # The last CPU of the last node, offline while a process starts.
    last=$(cpus_in online | tail -n 1)
    echo 0 >"$CPU_SYS/cpu$last/online"
    sys_state
    check "topology-cpu$last-offline" probe topology
    check "pinned-cpu$last-offline-glibc" $FN pinned glibc $GLIBC
    check "node-after-online-cpu$last" $FN node_after_online "$last"
    sys_state
fi

echo "@@END checks=$checks failed=$failed"
[ "$failed" = 0 ]
