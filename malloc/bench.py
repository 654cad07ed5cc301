#!/usr/bin/env python3
"""Real programs on each allocator, loaded with LD_PRELOAD: thiscpu's C library beside glibc's
own allocator and the peers Debian packages (jemalloc, mimalloc, gperftools' tcmalloc).

Usage: python3 malloc/bench.py [--rounds N] [--json FILE]

Each program runs once per allocator per round, the allocators in a new order each round, on
one CPU (the highest this process may use). A run's figures are its CPU time (user + system)
and its peak resident set, from the kernel's accounting of the finished child (wait4). Each
program's output is compared with its output on glibc's allocator: a run that differs fails the
whole measurement. The table gives medians, and each allocator's median over the best peer's
and over glibc's. Build the library first: cargo build --release -p thiscpu-malloc. Missing
peers are left out (apt-get install libjemalloc2 libmimalloc2.0 libtcmalloc-minimal4).
"""

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBDIR = "/usr/lib/x86_64-linux-gnu"
ALLOCATORS = [
    ("glibc", None),
    ("jemalloc", f"{LIBDIR}/libjemalloc.so.2"),
    ("mimalloc", f"{LIBDIR}/libmimalloc.so.2"),
    ("tcmalloc", f"{LIBDIR}/libtcmalloc_minimal.so.4"),
    ("thiscpu", os.path.join(ROOT, "target/release/libthiscpu_malloc.so")),
]
PEERS = ["jemalloc", "mimalloc", "tcmalloc"]



def programs(scratch):
    """(name, what, argv) of each program."""
    lines = os.path.join(scratch, "lines.txt")
    rng = random.Random(1)
    with open(lines, "w") as out:
        for _ in range(300000):
            out.write("".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 60))) + "\n")
    return [
        ("python-json", "python3: 50,000 records to JSON and back",
         ["python3", os.path.join(ROOT, "malloc/tests/json_roundtrip.py"), "50000"]),
        ("sort", "sort: 300,000 random lines", ["sort", lines]),
        ("git-log", "git log --stat of this repository's last 1,000 commits",
         ["git", "-C", ROOT, "log", "--stat", "-n", "1000"]),
        ("gcc", "gcc -O2 compiling malloc/tests/stress.c",
         ["gcc", "-O2", "-S", "-o", "-", os.path.join(ROOT, "malloc/tests/stress.c")]),
    ]


def run_once(argv, preload, cpu):
    """CPU seconds, peak resident bytes and a digest of the output of one run."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = preload
    with tempfile.TemporaryFile() as out:
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.DEVNULL, env=env,
                                 preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        _, status, usage = os.wait4(child.pid, 0)
        if status != 0:
            raise SystemExit(f"{argv[0]} exited with status {status} (LD_PRELOAD={preload})")
        out.seek(0)
        digest = hashlib.sha256(out.read()).hexdigest()
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, digest


def machine():
    cpuinfo = open("/proc/cpuinfo").read()

    def field(name):
        for line in cpuinfo.splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
        return None

    return {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "model_name": field("model name"),
        "cpu_id": " ".join(str(x) for x in [field("vendor_id"), "family", field("cpu family"),
                                             "model", field("model"), "stepping",
                                             field("stepping")]),
        "glibc": platform.libc_ver()[1],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    present = [(name, path) for name, path in ALLOCATORS if path is None or os.path.exists(path)]
    if not any(name == "thiscpu" for name, _ in present):
        raise SystemExit("build the library first: cargo build --release -p thiscpu-malloc")
    cpu = max(os.sched_getaffinity(0))
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, what, argv in programs(scratch):
            expected = run_once(argv, None, cpu)[2]
            samples = {allocator: [] for allocator, _ in present}
            for round_ in range(args.rounds):
                order = present[:]
                random.Random(round_).shuffle(order)
                for allocator, path in order:
                    seconds, peak, digest = run_once(argv, path, cpu)
                    if digest != expected:
                        raise SystemExit(f"{name} on {allocator}: its output differs from glibc's")
                    samples[allocator].append((seconds, peak))
            for allocator, runs in samples.items():
                results.append({
                    "program": name, "what": what, "allocator": allocator,
                    "cpu_seconds": [s for s, _ in runs], "peak_bytes": [p for _, p in runs],
                })
            print(f"{name}: measured", file=sys.stderr)
    report = {
        "command": "python3 malloc/bench.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "pinned_cpu": cpu,
        "rounds": args.rounds,
        "results": results,
    }
    print_table(report)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
            out.write("\n")


def print_table(report):
    rows = {}
    for r in report["results"]:
        rows[(r["program"], r["allocator"])] = (statistics.median(r["cpu_seconds"]) * 1e3,
                                                statistics.median(r["peak_bytes"]) / 2**20,
                                                min(r["cpu_seconds"]) * 1e3,
                                                max(r["cpu_seconds"]) * 1e3)
    programs_seen = list(dict.fromkeys(r["program"] for r in report["results"]))
    print(f"{report['machine']['cpu_id']}, Linux {report['machine']['kernel']}, "
          f"{report['rounds']} rounds, medians")
    print(f"{'program':12} {'allocator':9} {'cpu ms':>8} {'min-max':>15} {'÷ best peer':>11} "
          f"{'÷ glibc':>8} {'peak MiB':>9} {'÷ least peer':>12}")
    for program in programs_seen:
        peers = [rows[(program, p)] for p in PEERS if (program, p) in rows]
        best = min((p[0] for p in peers), default=None)
        least = min((p[1] for p in peers), default=None)
        glibc = rows[(program, "glibc")][0]
        for allocator in [a for a, _ in ALLOCATORS]:
            if (program, allocator) not in rows:
                continue
            ms, mib, low, high = rows[(program, allocator)]
            ratio = f"{ms / best:.2f}x" if best else ""
            peak_ratio = f"{mib / least:.2f}x" if least else ""
            print(f"{program:12} {allocator:9} {ms:8.1f} {low:7.1f}-{high:<7.1f} {ratio:>11} "
                  f"{ms / glibc:7.2f}x {mib:9.1f} {peak_ratio:>12}")


if __name__ == "__main__":
    main()
