//! Every other way to ask "which CPU am I on", for comparison and for environments without
//! rseq: the system call, the vDSO, glibc's `sched_getcpu`, the CPU's own instructions,
//! macOS's `pthread_cpu_number_np`, Windows's `GetCurrentProcessorNumberEx`, and a per-thread
//! index where the system tells nothing. Each function exists on every target and answers
//! `None` where its system lacks it; each answers independently of which one the process chose
//! as its fallback (`Process::fallback`, chosen once by the registration, which is the only
//! caller of `choose_fallback`).
//!
//! | system | fallback, in order of preference |
//! |---|---|
//! | Linux x86_64, aarch64, riscv64 (rseq first) | `rdpid`, vDSO, system call |
//! | Linux, other architectures | `sched_getcpu`, vDSO, system call |
//! | macOS 11+, iOS 14.2+ | `pthread_cpu_number_np` |
//! | Windows | `GetCurrentProcessorNumberEx` |
//! | FreeBSD 13.1+ | `sched_getcpu` |
//! | others (wasm, ...) | the thread's index |

use crate::arch;
use crate::os;
use core::sync::atomic::{AtomicU8, Ordering};

/// A CPU and the NUMA node it belongs to, read together.
///
/// With the `serde` feature: `Serialize` and `Deserialize`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct CpuNode {
    /// CPU id, below [`crate::topology::possible_cpus`].
    pub cpu: u32,
    /// NUMA node of `cpu`.
    pub node: u32,
}

/// The mechanism that answers "which CPU am I on".
///
/// With the `serde` feature: `Serialize` and `Deserialize`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum CpuSource {
    /// One load from the rseq area that glibc registered.
    RseqGlibc,
    /// One load from the rseq area that thiscpu registered.
    RseqThiscpu,
    /// The `rdpid` instruction (x86_64), which reads the CPU and node Linux keeps in
    /// `IA32_TSC_AUX`.
    Rdpid,
    /// `getcpu` in the vDSO.
    Vdso,
    /// The `getcpu` system call.
    Syscall,
    /// `sched_getcpu` of the C library: glibc's on Linux without an rseq port (which reads
    /// glibc's rseq area, 2.35+), FreeBSD's (13.1+).
    SchedGetcpu,
    /// `pthread_cpu_number_np` (macOS 11+, iOS 14.2+).
    PthreadCpuNumber,
    /// `GetCurrentProcessorNumberEx` (Windows), processor groups made one flat index.
    ProcessorNumber,
    /// No CPU number from the system: each thread keeps an index of its own, given in the
    /// order threads first ask, folded into the possible CPUs. Threads still spread over the
    /// per-CPU slots; the slot says nothing about the CPU.
    ThreadIndex,
}

impl CpuSource {
    /// The name used in reports and JSON.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            CpuSource::RseqGlibc => "rseq (glibc)",
            CpuSource::RseqThiscpu => "rseq (thiscpu)",
            CpuSource::Rdpid => "rdpid",
            CpuSource::Vdso => "vdso",
            CpuSource::Syscall => "syscall",
            CpuSource::SchedGetcpu => "sched_getcpu",
            CpuSource::PthreadCpuNumber => "pthread_cpu_number_np",
            CpuSource::ProcessorNumber => "GetCurrentProcessorNumberEx",
            CpuSource::ThreadIndex => "thread index",
        }
    }
}

/// Its [`name`](CpuSource::name).
///
/// ```
/// assert_eq!(thiscpu::CpuSource::RseqGlibc.to_string(), "rseq (glibc)");
/// println!("cpu via {}", thiscpu::source().this_thread);
/// ```
impl core::fmt::Display for CpuSource {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

/// The `getcpu` system call (about a hundred nanoseconds on a VM), or `None` if it failed
/// (refused by a seccomp filter).
///
/// ```
/// if let Some(here) = thiscpu::via::syscall() {
///     assert!((here.cpu as usize) < thiscpu::topology::possible_cpus());
/// }
/// ```
#[inline(never)]
pub fn syscall() -> Option<CpuNode> {
    os::getcpu_syscall().map(|(cpu, node)| CpuNode { cpu, node })
}

/// `getcpu` in the vDSO, or `None` where the vDSO has none (aarch64, valgrind).
///
/// ```
/// if let Some(here) = thiscpu::via::vdso() {
///     assert!((here.cpu as usize) < thiscpu::topology::possible_cpus());
/// }
/// ```
#[inline]
pub fn vdso() -> Option<CpuNode> {
    os::vdso_getcpu().map(|(cpu, node)| CpuNode { cpu, node })
}

/// The C library's `sched_getcpu`: glibc's on Linux (which itself reads rseq when glibc
/// registered it), FreeBSD's (13.1+). `None` if it failed, or on other systems.
///
/// ```
/// if let Some(cpu) = thiscpu::via::sched_getcpu() {
///     assert!((cpu as usize) < thiscpu::topology::possible_cpus());
/// }
/// ```
#[inline]
pub fn sched_getcpu() -> Option<u32> {
    os::cpu_number::sched_getcpu()
}

/// `pthread_cpu_number_np` on macOS 11+ and iOS 14.2+ (a read of a value the kernel keeps for
/// the thread, no system call). `None` on other systems and older releases.
///
/// ```
/// if let Some(cpu) = thiscpu::via::pthread_cpu_number() {
///     assert!((cpu as usize) < thiscpu::topology::possible_cpus());
/// }
/// ```
#[inline]
pub fn pthread_cpu_number() -> Option<u32> {
    os::cpu_number::pthread_cpu_number()
}

/// `GetCurrentProcessorNumberEx` on Windows, as one flat index over the processor groups
/// (the processors of the groups before the thread's, plus its number in its group). `None` on
/// other systems.
///
/// ```
/// if let Some(cpu) = thiscpu::via::processor_number() {
///     assert!((cpu as usize) < thiscpu::topology::possible_cpus());
/// }
/// ```
#[inline]
pub fn processor_number() -> Option<u32> {
    os::cpu_number::processor_number()
}

/// The calling thread's index, folded into the possible CPUs: threads are numbered in the
/// order they first ask, and keep their number. What answers where the system tells no CPU;
/// every system has it.
///
/// ```
/// let index = thiscpu::via::thread_index();
/// assert_eq!(thiscpu::via::thread_index(), index);
/// assert!((index as usize) < thiscpu::topology::possible_cpus());
/// ```
#[inline]
pub fn thread_index() -> u32 {
    fold(os::cpu_number::thread_index())
}

/// A CPU number in range of the per-CPU structures: a system's number can exceed the count the
/// standard library reports (CPUs outside the process's share), and any slot is a valid one
/// for an atomic update.
#[inline]
fn fold(cpu: u32) -> u32 {
    let possible = crate::topology::possible_cpus() as u32;
    if cpu < possible { cpu } else { cpu % possible }
}

/// A CPU number from a system without nodes (or whose nodes `/sys` does not tell), with its
/// node from the topology (0 where there is none).
fn on_its_node(cpu: u32) -> CpuNode {
    let cpu = fold(cpu);
    let node = crate::topology::node_of_cpu(cpu).unwrap_or(0);
    CpuNode { cpu, node }
}

const UNKNOWN: u8 = 0;
const YES: u8 = 1;
const NO: u8 = 2;

fn cached(flag: &AtomicU8, probe: impl FnOnce() -> bool) -> bool {
    match flag.load(Ordering::Relaxed) {
        YES => true,
        NO => false,
        _ => {
            let has = probe();
            flag.store(if has { YES } else { NO }, Ordering::Relaxed);
            has
        }
    }
}

/// Whether the instruction's answer agrees with the kernel's: the kernel sets
/// `IA32_TSC_AUX` to `(node << 12) | cpu`, but a hypervisor or emulator may not.
fn agrees_with_syscall(read: fn() -> (u32, u32)) -> bool {
    (0..3).any(|_| {
        let Some(kernel) = syscall() else {
            return false;
        };
        read() == (kernel.cpu, kernel.node)
    })
}

/// A native read, where the architecture has it, the CPU has it, and it agrees with the
/// kernel (each checked once per process, cached in `has`).
#[inline]
fn native(read: Option<arch::NativeCpuRead>, has: &AtomicU8) -> Option<CpuNode> {
    let read = read?;
    cached(has, || (read.present)() && agrees_with_syscall(read.read)).then(|| {
        let (cpu, node) = (read.read)();
        CpuNode { cpu, node }
    })
}

/// The `rdpid` instruction, where the CPU has it and it agrees with the kernel.
///
/// ```
/// if let Some(here) = thiscpu::via::rdpid() {
///     assert!((here.cpu as usize) < thiscpu::topology::possible_cpus());
/// }
/// ```
#[inline]
pub fn rdpid() -> Option<CpuNode> {
    static HAS: AtomicU8 = AtomicU8::new(UNKNOWN);
    native(arch::NATIVE_CPU_READ, &HAS)
}

/// The `rdtscp` instruction's `IA32_TSC_AUX`, where the CPU has it and it agrees with the
/// kernel.
///
/// ```
/// if let Some(here) = thiscpu::via::rdtscp() {
///     assert!((here.cpu as usize) < thiscpu::topology::possible_cpus());
/// }
/// ```
#[inline]
pub fn rdtscp() -> Option<CpuNode> {
    static HAS: AtomicU8 = AtomicU8::new(UNKNOWN);
    native(arch::NATIVE_CPU_READ_WITH_CLOCK, &HAS)
}

/// The order in which the sources answer "which CPU" without rseq, the first that works chosen
/// once. With a port, rseq answers first and these are for threads without it: the CPU's own
/// instruction where it agrees with the kernel, then the vDSO. Linux without a port: glibc's
/// `sched_getcpu`, which reads the area glibc registered (2.35+) or calls the vDSO itself.
/// Elsewhere each system's own (only one of the three exists on any system), then the
/// thread's index.
const CPU_SOURCES: &[CpuSource] = if cfg!(thiscpu_rseq) {
    &[CpuSource::Rdpid, CpuSource::Vdso, CpuSource::Syscall]
} else if cfg!(thiscpu_linux) {
    &[CpuSource::SchedGetcpu, CpuSource::Vdso, CpuSource::Syscall]
} else {
    &[
        CpuSource::SchedGetcpu,
        CpuSource::PthreadCpuNumber,
        CpuSource::ProcessorNumber,
        CpuSource::ThreadIndex,
    ]
};

/// The best source that answers without rseq on this machine: the first of [`CPU_SOURCES`]
/// that answers, or its last. Probes each once.
pub(crate) fn choose_fallback() -> CpuSource {
    let (last, others) = CPU_SOURCES
        .split_last()
        .expect("every system lists a source");
    others
        .iter()
        .copied()
        .find(|&source| answer(source).is_some())
        .unwrap_or(*last)
}

/// What `source` answers now, `None` where it failed or does not exist here.
#[inline]
fn answer(source: CpuSource) -> Option<CpuNode> {
    match source {
        CpuSource::Rdpid => rdpid(),
        CpuSource::Vdso => vdso(),
        CpuSource::Syscall => syscall(),
        CpuSource::SchedGetcpu => sched_getcpu().map(on_its_node),
        CpuSource::PthreadCpuNumber => pthread_cpu_number().map(on_its_node),
        CpuSource::ProcessorNumber => processor_number().map(on_its_node),
        CpuSource::ThreadIndex => Some(on_its_node(thread_index())),
        CpuSource::RseqGlibc | CpuSource::RseqThiscpu => None,
    }
}

/// The answer of `source` (a fallback that `choose_fallback` chose), or CPU 0 on node 0 where
/// even the system call is refused (a seccomp filter): a valid index, so per-CPU data stays
/// correct, only no longer spread.
#[inline]
pub(crate) fn fallback_cpu_node(source: CpuSource) -> CpuNode {
    let answer = match source {
        CpuSource::Rdpid => arch::NATIVE_CPU_READ.map(|native| {
            let (cpu, node) = (native.read)();
            CpuNode { cpu, node }
        }),
        CpuSource::Syscall => None,
        other => answer(other),
    };
    answer
        .or_else(syscall)
        .unwrap_or(CpuNode { cpu: 0, node: 0 })
}
