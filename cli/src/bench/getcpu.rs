//! `getcpu`: how long it takes to ask "which CPU am I on", by every way Linux offers.
//!
//! Each case is a loop of calls whose every result is kept in a register (`Kept`), never
//! stored, so that the loop holds the probe and nothing else. (A build whose `current_cpu`
//! loop measured twice the empty loop's time turned out to owe it to the loop straddling a
//! 64-byte boundary, not to the store: `.cargo/config.toml` aligns the loops.) The probe is
//! inlined into the loop, as a caller of the library would have it, except in
//! `current_cpu-noinline`, which calls an `#[inline(never)]` function the way the arm64
//! `thread_info->cpu` patch (seed 000) timed its `get_cpu_id()`.

use super::model::{Case, Family, Loop, Measured, Stats, Unit};
use super::reference::{self, CLoop};
use crate::machine::cpu_has_flag;
use crate::report::table::{self, Targets, fmt_ns, fmt_num, fmt_ratio};
use thiscpu::{CpuNode, CpuSource};

/// The family.
pub static FAMILY: Family = Family {
    name: "getcpu",
    about: "latency of one \"which CPU am I on\" call, by every source (ns/op)",
    case_names: &[
        "syscall",
        "vdso-getcpu",
        "glibc-sched_getcpu",
        "rdtscp",
        "rdpid",
        "current_cpu",
        "current_cpu-noinline",
        "getcpu",
        "mm_cid",
        "c-cpu_id",
        "c-cpu-node",
        "empty-loop",
    ],
    default_threads: &[1],
    baseline: Some("current_cpu"),
    cases,
    report,
};

/// Calls `probe` `ops` times, each result kept in registers.
#[inline(always)]
fn repeat<T: Kept>(ops: u64, probe: impl Fn() -> T) {
    for _ in 0..ops {
        probe().keep();
    }
}

/// An answer the compiler must compute and hold in a register, without storing it anywhere.
trait Kept {
    fn keep(self);
}

impl Kept for u32 {
    #[inline(always)]
    fn keep(self) {
        keep_word(self.into());
    }
}

impl Kept for CpuNode {
    #[inline(always)]
    fn keep(self) {
        keep_word(self.cpu.into());
        keep_word(self.node.into());
    }
}

impl<T: Kept> Kept for Option<T> {
    #[inline(always)]
    fn keep(self) {
        match self {
            Some(answer) => answer.keep(),
            None => keep_word(u64::MAX),
        }
    }
}

/// Makes `word` an input of an empty `asm!` block: the compiler must have it in a register
/// there, and knows nothing else of the block, so it can neither skip computing the word nor
/// fold loop iterations together; no instruction is emitted for it.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64", target_arch = "riscv64"))]
#[inline(always)]
fn keep_word(word: u64) {
    // SAFETY: an empty template that only names its input: it reads and writes nothing, keeps
    // the stack and the flags as they are.
    unsafe {
        core::arch::asm!("/* {0} */", in(reg) word, options(nomem, nostack, preserves_flags));
    }
}

/// Elsewhere the answer goes through `black_box`, which may store it.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64", target_arch = "riscv64")))]
#[inline(always)]
fn keep_word(word: u64) {
    std::hint::black_box(word);
}

/// The seed's `get_cpu_id()`: a function call that returns the current CPU.
#[inline(never)]
fn get_cpu_id() -> u32 {
    thiscpu::current_cpu()
}

fn syscall(ops: u64) {
    repeat(ops, thiscpu::via::syscall)
}

fn vdso_getcpu(ops: u64) {
    repeat(ops, thiscpu::via::vdso)
}

fn glibc_sched_getcpu(ops: u64) {
    repeat(ops, thiscpu::via::sched_getcpu)
}

fn rdtscp(ops: u64) {
    repeat(ops, thiscpu::via::rdtscp)
}

fn rdpid(ops: u64) {
    repeat(ops, thiscpu::via::rdpid)
}

fn current_cpu(ops: u64) {
    repeat(ops, thiscpu::current_cpu)
}

fn current_cpu_noinline(ops: u64) {
    repeat(ops, get_cpu_id)
}

fn getcpu(ops: u64) {
    repeat(ops, thiscpu::getcpu)
}

fn mm_cid(ops: u64) {
    repeat(ops, thiscpu::mm_cid)
}

/// The loop alone: the same shape, a constant kept in a register instead of a call's answer.
fn empty_loop(ops: u64) {
    repeat(ops, || 0u32)
}

/// Why an x86 instruction is not usable here.
fn instruction_missing(name: &str, flag: &str) -> String {
    if !cfg!(target_arch = "x86_64") {
        format!("{name} is an x86_64 instruction")
    } else if !cpu_has_flag(flag) {
        format!("CPU lacks {}", name.to_uppercase())
    } else {
        format!(
            "the CPU lists {} but it is unusable here (its answer disagrees with the kernel's \
             CPU number, or an emulator hides it)",
            name.to_uppercase()
        )
    }
}

fn cases() -> Vec<Case> {
    let ns = Unit::NsPerOp;
    let source = thiscpu::source();
    let rseq = matches!(
        source.this_thread,
        CpuSource::RseqGlibc | CpuSource::RseqThiscpu
    );
    let answered_by = if rseq {
        source.this_thread.name().to_owned()
    } else {
        format!("fallback {}", source.this_thread.name())
    };
    let mut cases = vec![Case::new(
        "syscall",
        "getcpu(2) system call",
        ns,
        Loop(syscall),
    )];
    cases.push(match thiscpu::via::vdso() {
        Some(_) => Case::new("vdso-getcpu", "vDSO getcpu", ns, Loop(vdso_getcpu)),
        None => Case::skipped("vdso-getcpu", ns, "the vDSO has no getcpu"),
    });
    cases.push(match thiscpu::via::sched_getcpu() {
        Some(_) => Case::new(
            "glibc-sched_getcpu",
            "libc sched_getcpu()",
            ns,
            Loop(glibc_sched_getcpu),
        ),
        None => Case::skipped("glibc-sched_getcpu", ns, "sched_getcpu() fails here"),
    });
    cases.push(match thiscpu::via::rdtscp() {
        Some(_) => Case::new("rdtscp", "RDTSCP, IA32_TSC_AUX", ns, Loop(rdtscp)),
        None => Case::skipped("rdtscp", ns, instruction_missing("rdtscp", "rdtscp")),
    });
    cases.push(match thiscpu::via::rdpid() {
        Some(_) => Case::new("rdpid", "RDPID, IA32_TSC_AUX", ns, Loop(rdpid)),
        None => Case::skipped("rdpid", ns, instruction_missing("rdpid", "rdpid")),
    });
    cases.push(Case::new(
        "current_cpu",
        format!("thiscpu, inlined: {answered_by}"),
        ns,
        Loop(current_cpu),
    ));
    cases.push(Case::new(
        "current_cpu-noinline",
        "the above in an #[inline(never)] fn",
        ns,
        Loop(current_cpu_noinline),
    ));
    let getcpu_how = if source.node_id {
        "thiscpu cpu+node, rseq section".to_owned()
    } else if rseq {
        "thiscpu cpu+node, node from /sys".to_owned()
    } else {
        format!("thiscpu cpu+node: {answered_by}")
    };
    cases.push(Case::new("getcpu", getcpu_how, ns, Loop(getcpu)));
    cases.push(if source.mm_cid {
        Case::new("mm_cid", "thiscpu concurrency id", ns, Loop(mm_cid))
    } else if let Some(why) = source.unavailable {
        Case::skipped(
            "mm_cid",
            ns,
            format!("rseq not in use: {why}"),
        )
    } else {
        Case::skipped(
            "mm_cid",
            ns,
            "the kernel does not provide mm_cid (Linux 6.3+)",
        )
    });
    cases.extend(c_reference_cases());
    cases.push(Case::new("empty-loop", "loop + a constant kept in a register", ns, Loop(empty_loop)));
    cases
}

/// The C floor of `current_cpu` and `getcpu`: the same reads of the same area, in C.
fn c_reference_cases() -> Vec<Case> {
    let ns = Unit::NsPerOp;
    if let Some(why) = reference::unavailable() {
        return vec![
            Case::skipped("c-cpu_id", ns, why.clone()),
            Case::skipped("c-cpu-node", ns, why),
        ];
    }
    let pair = if thiscpu::source().node_id {
        Case::new(
            "c-cpu-node",
            "C: cpu_id and node_id in one rseq section",
            ns,
            CLoop::new(reference::cpu_node_loop),
        )
    } else {
        Case::skipped("c-cpu-node", ns, "the kernel does not keep node_id (Linux 6.3+)")
    };
    vec![
        Case::new(
            "c-cpu_id",
            "C: one load of the area's cpu_id",
            ns,
            CLoop::new(reference::cpu_id_loop),
        ),
        pair,
    ]
}

/// thiscpu's reads against the same reads in C, in this run: the floor a Rust library over the
/// same area can reach.
fn c_reference_targets(results: &[Measured]) -> Targets {
    let mut targets = Targets::new("targets (ratios of medians to the C reference)");
    for (ours, c, what) in [
        ("current_cpu", "c-cpu_id", "current_cpu() vs a C load of cpu_id"),
        ("getcpu", "c-cpu-node", "getcpu() vs a C rseq section reading cpu_id and node_id"),
    ] {
        if let (Some(ours), Some(c)) = (median(results, ours), median(results, c)) {
            targets.check(
                format!("{what}: {} ({} vs {})", fmt_ratio(ours / c), fmt_ns(ours), fmt_ns(c)),
                "≤ 1.15×",
                ours <= 1.15 * c,
            );
        }
    }
    targets
}

/// Statistics of `case` at the smallest thread count measured.
fn stats(results: &[Measured], case: &str) -> Option<Stats> {
    let threads = results.iter().map(|m| m.threads).min()?;
    results
        .iter()
        .find(|m| m.case == case && m.threads == threads)
        .map(Measured::stats)
}

/// Median ns/op of `case` at the smallest thread count measured.
fn median(results: &[Measured], case: &str) -> Option<f64> {
    stats(results, case).map(|s| s.median)
}

/// The seed-shaped tables and the ratios, from the single-thread (or fewest-thread) results.
fn report(results: &[Measured]) -> String {
    let mut out = String::new();
    let noinline = median(results, "current_cpu-noinline");
    if let Some(after) = noinline {
        let befores: Vec<(&str, f64)> = [
            ("syscall", "syscall"),
            ("vDSO getcpu", "vdso-getcpu"),
            ("glibc sched_getcpu", "glibc-sched_getcpu"),
        ]
        .into_iter()
        .filter_map(|(label, case)| Some((label, median(results, case)?)))
        .collect();
        if !befores.is_empty() {
            out.push_str(
                "\n1e9 calls of a noinline get_cpu_id(), as seed 000 timed them \
                 (time = median ns/op × 1e9)\n",
            );
            out.push_str(&table::seed_calls_table(
                &befores,
                ("thiscpu current_cpu (noinline)", after),
            ));
            out.push('\n');
        }
    }

    if let Some(after) = median(results, "getcpu") {
        let vdso = median(results, "vdso-getcpu");
        let syscall = median(results, "syscall");
        out.push_str("\ngetcpu() latency, as seed 003 reported it (cpu and node together)\n");
        out.push_str(&table::seed_latency_table(vdso, syscall, after));
        out.push('\n');
    }

    let ratio = |ours: &str, theirs: &str| -> Option<String> {
        let (a, b) = (median(results, ours)?, median(results, theirs)?);
        Some(format!(
            "  {ours:<12} vs {theirs:<19} {:>8}   ({} vs {})",
            fmt_ratio(b / a),
            fmt_ns(a),
            fmt_ns(b)
        ))
    };
    let lines: Vec<String> = [
        ratio("current_cpu", "glibc-sched_getcpu"),
        ratio("current_cpu", "vdso-getcpu"),
        ratio("current_cpu", "syscall"),
        ratio("getcpu", "vdso-getcpu"),
        ratio("getcpu", "syscall"),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !lines.is_empty() {
        out.push_str("\nspeed-up, ratio of medians (× faster):\n");
        out.push_str(&lines.join("\n"));
        out.push('\n');
    }
    let targets = c_reference_targets(results);
    if !targets.is_empty() {
        out.push_str(&targets.joined());
        out.push('\n');
    }
    if let (Some(inline), Some(empty)) = (stats(results, "current_cpu"), stats(results, "empty-loop"))
        && inline.median <= empty.max
    {
        out.push_str(&format!(
            "\nnote: current_cpu inlined ({}) is within the empty loop's range ({} – {}): its \
             load overlaps the loop's own work, so a loop cannot tell it apart; the \
             noinline case adds a call and a return.\n",
            fmt_ns(inline.median),
            fmt_num(empty.min),
            fmt_ns(empty.max)
        ));
    }
    out.trim_end().to_owned()
}
