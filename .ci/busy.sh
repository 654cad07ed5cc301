# Sourced by .ci/run and the guest and cross jobs: how busy the machine's CPUs were during a
# step, so that a step that leaves CPUs idle (a guest on one host thread, a serial link or
# configure script) shows where running two things at once would shorten the run. The figures
# are the whole machine's (/proc/stat), which is the run's alone on a CI machine.

# cpu_ticks: "BUSY TOTAL", the machine's CPU time in clock ticks since boot (idle and iowait are
# the idle part).
cpu_ticks() {
    awk '/^cpu / {
        total = 0
        for (i = 2; i <= NF; i++) total += $i
        printf "%d %d\n", total - $5 - $6, total
    }' /proc/stat
}

# cpus_busy "BUSY TOTAL": how many CPUs were busy on average since cpu_ticks printed its
# argument, as "1.8 of 2 CPUs busy" ("" where /proc/stat is missing).
cpus_busy() {
    local now
    now=$(cpu_ticks 2>/dev/null) || return 0
    [ -n "$1" ] && [ -n "$now" ] || return 0
    awk -v before="$1" -v now="$now" -v cpus="$(nproc)" 'BEGIN {
        split(before, b, " "); split(now, n, " ")
        if (n[2] - b[2] <= 0) exit
        printf "%.1f of %d CPUs busy\n", cpus * (n[1] - b[1]) / (n[2] - b[2]), cpus
    }'
}
