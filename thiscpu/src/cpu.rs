//! Which CPU, node and concurrency id this thread runs on: one load from the rseq area on the
//! fast path, and a fallback chain chosen once per process (the CPU's own instruction, the
//! vDSO, the syscall) when rseq is missing.
//!
//! # Safety
//! This module calls the vDSO's `getcpu` through a pointer that `dlsym` returned for that
//! symbol; each block states why it holds.

use crate::abi::offset;
use crate::arch::{self, areas};
use crate::ops;
use crate::registration::{self, Registrar, RseqMode, Unavailable};
use crate::topology;
use core::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

/// A CPU and the NUMA node it belongs to, read together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct CpuNode {
    /// CPU id, below [`topology::possible_cpus`].
    pub cpu: u32,
    /// NUMA node of `cpu`.
    pub node: u32,
}

/// The mechanism that answers "which CPU am I on".
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
        }
    }
}

/// What answers thiscpu's questions in this process and thread, and what the kernel offers.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct Source {
    /// Who registered the rseq areas thiscpu reads.
    pub registrar: Registrar,
    /// Why rseq is not used, if it is not.
    pub unavailable: Option<Unavailable>,
    /// What answers `current_cpu()` in the calling thread now.
    pub this_thread: CpuSource,
    /// What answers where rseq cannot: chosen once per process.
    pub fallback: CpuSource,
    /// The kernel's `AT_RSEQ_FEATURE_SIZE` (0 before Linux 6.3).
    pub kernel_feature_size: u32,
    /// The kernel's `AT_RSEQ_ALIGN` (0 before Linux 6.3).
    pub kernel_align: u32,
    /// The length the areas thiscpu reads are registered with: thiscpu's own registration's
    /// (32, or the feature size rounded up to the alignment where that exceeds 32), or
    /// glibc's (32, or its `__rseq_size` where that exceeds 32). 0 without rseq.
    pub registered_size: u32,
    /// The kernel's mode for those registrations, `None` without rseq.
    pub mode: Option<RseqMode>,
    /// The length of an optimized-mode registration of thiscpu's own area on this kernel, when
    /// the kernel offers that mode (feature size above 32) and the area has room for it;
    /// thiscpu registers it whenever it registers its own areas (see `THISCPU_RSEQ_AREA` in
    /// the crate documentation).
    pub optimized_size: Option<u32>,
    /// The offset from the thread pointer of the calling thread's area that thiscpu reads,
    /// the same in every thread. `None` without rseq.
    pub area_offset: Option<isize>,
    /// Bytes of the area that the kernel keeps current for this registration.
    pub usable_size: u32,
    /// glibc's `__rseq_size`, where glibc exports it.
    pub glibc_rseq_size: Option<u32>,
    /// glibc's `__rseq_offset`, where glibc exports it.
    pub glibc_rseq_offset: Option<isize>,
    /// Whether `node_id` in the area is kept current (Linux 6.3+).
    pub node_id: bool,
    /// Whether `mm_cid` in the area is kept current (Linux 6.3+).
    pub mm_cid: bool,
}

/// Whether `mm_cid` is kept current in this process's areas.
#[inline]
pub(crate) fn mm_cid_usable() -> bool {
    registration::mm_cid_usable()
        || registration::decided().is_some_and(|process| process.mm_cid_usable())
}

const UNDECIDED: u8 = 0;
static FALLBACK: AtomicU8 = AtomicU8::new(UNDECIDED);
static VDSO_GETCPU: AtomicUsize = AtomicUsize::new(0);

fn encode(source: CpuSource) -> u8 {
    match source {
        CpuSource::RseqGlibc | CpuSource::RseqThiscpu | CpuSource::Syscall => 1,
        CpuSource::Rdpid => 2,
        CpuSource::Vdso => 3,
    }
}

fn decode(code: u8) -> CpuSource {
    match code {
        2 => CpuSource::Rdpid,
        3 => CpuSource::Vdso,
        _ => CpuSource::Syscall,
    }
}

/// The fallback source, once the process-wide decision (which also reads the topology tables,
/// so that nothing later allocates) is made. In a signal handler that interrupted the decision
/// on its own thread: the system call, which needs no decision.
pub(crate) fn decide_fallback() -> CpuSource {
    let code = FALLBACK.load(Ordering::Acquire);
    if code != UNDECIDED {
        return decode(code);
    }
    match registration::decided() {
        Some(_) => decode(FALLBACK.load(Ordering::Acquire)),
        None => CpuSource::Syscall,
    }
}

/// Chooses the fallback source and reads the topology tables; part of the process-wide
/// decision (`registration::decided`), which runs it once.
pub(crate) fn choose_fallback() {
    topology::prepare();
    let source = if via::rdpid().is_some() {
        CpuSource::Rdpid
    } else if via::vdso().is_some() {
        CpuSource::Vdso
    } else {
        CpuSource::Syscall
    };
    FALLBACK.store(encode(source), Ordering::Release);
}

#[inline]
fn fallback_cpu_node() -> CpuNode {
    match decide_fallback() {
        CpuSource::Rdpid => arch_native_cpu_node(),
        CpuSource::Vdso => via::vdso().unwrap_or_else(syscall_or_first_cpu),
        _ => syscall_or_first_cpu(),
    }
}

/// The system call's answer, or CPU 0 on node 0 where even that is refused (a seccomp
/// filter): a valid index, so per-CPU data stays correct, only no longer spread.
fn syscall_or_first_cpu() -> CpuNode {
    via::syscall().unwrap_or(CpuNode { cpu: 0, node: 0 })
}

/// The plain native read; the fallback selects it only where `via::rdpid` answered, so the
/// system call stands in for an architecture without one only in principle.
#[inline]
fn arch_native_cpu_node() -> CpuNode {
    match arch::NATIVE_CPU_READ {
        Some(native) => {
            let (cpu, node) = (native.read)();
            CpuNode { cpu, node }
        }
        None => syscall_or_first_cpu(),
    }
}

/// The CPU the calling thread runs on now.
///
/// With rseq registered this is one load from the thread's rseq area, inlined into the
/// caller; otherwise the fallback chosen once per process answers. The value can be stale as
/// soon as it is returned (the thread may migrate): use it as a hint for spreading load, and
/// use thiscpu's restartable operations when a decision must hold until a store.
///
/// ```
/// let cpu = thiscpu::current_cpu();
/// assert!((cpu as usize) < thiscpu::topology::possible_cpus());
/// ```
#[inline]
#[must_use]
pub fn current_cpu() -> u32 {
    let cpu = rseq_cpu_id();
    if cpu >= 0 {
        cpu as u32
    } else {
        current_cpu_slow()
    }
}

/// `cpu_id` of the calling thread's active area: negative while it is not registered.
#[inline(always)]
fn rseq_cpu_id() -> i32 {
    arch::active_field::<{ offset::CPU_ID }>()
}

#[cold]
#[inline(never)]
fn current_cpu_slow() -> u32 {
    // Once the process is known to have no rseq, go straight to the fallback.
    if !registration::NO_RSEQ.load(Ordering::Relaxed) && registration::ensure_registered() {
        let cpu = rseq_cpu_id();
        if cpu >= 0 {
            return cpu as u32;
        }
    }
    fallback_cpu_node().cpu
}

/// The CPU and NUMA node the calling thread runs on, read consistently: both from the same
/// scheduling interval.
///
/// With rseq and a kernel that fills `node_id` (Linux 6.3+), both fields are loaded inside a
/// restartable sequence that the kernel aborts on preemption, migration or signal, so the
/// pair can never mix two CPUs. Where the kernel lacks `node_id`, the node is looked up from
/// the CPU in the `/sys` topology; without rseq the fallback returns both from one call.
///
/// ```
/// let here = thiscpu::getcpu();
/// assert_eq!(thiscpu::topology::node_of_cpu(here.cpu), Some(here.node));
/// ```
#[inline]
#[must_use]
pub fn getcpu() -> CpuNode {
    // The node area is the blank one, whose `cpu_id` is negative, until the process decided
    // that `node_id` is kept current: one sign test covers both checks.
    if let Some((cpu, node)) = arch::load_cpu_node(arch::area_offset_of::<{ areas::NODE }>())
        && cpu >= 0
    {
        return CpuNode {
            cpu: cpu as u32,
            node,
        };
    }
    getcpu_slow()
}

#[cold]
#[inline(never)]
fn getcpu_slow() -> CpuNode {
    if !registration::NO_RSEQ.load(Ordering::Relaxed) && registration::ensure_registered() {
        if registration::process().node_id_usable() {
            // Aborts are rare: a section two loads long is only interrupted by events that
            // happen between them, unless the thread is interrupted at every instruction
            // (single-stepped), which the bound on consecutive aborts is for.
            let mut aborts = ops::AbortRun::new();
            loop {
                match arch::load_cpu_node(arch::area_offset()) {
                    Some((cpu, node)) if cpu >= 0 => {
                        return CpuNode {
                            cpu: cpu as u32,
                            node,
                        };
                    }
                    Some(_) => break,
                    None if aborts.gives_up() => break,
                    None => continue,
                }
            }
        } else {
            let cpu = rseq_cpu_id();
            if let Some(node) = u32::try_from(cpu).ok().and_then(topology::node_of_cpu) {
                return CpuNode {
                    cpu: cpu as u32,
                    node,
                };
            }
        }
    }
    fallback_cpu_node()
}

/// The NUMA node the calling thread runs on now. Two reads agree only while the thread stays
/// on one node; [`getcpu`] gives a CPU and its node from one moment.
///
/// ```
/// let _pinned = thiscpu::topology::pin_to(thiscpu::current_cpu()).unwrap();
/// assert_eq!(thiscpu::current_node(), thiscpu::getcpu().node);
/// ```
#[inline]
#[must_use]
pub fn current_node() -> u32 {
    // As in `getcpu`: the node area's `cpu_id` is negative until `node_id` is known usable.
    let area = arch::area_offset_of::<{ areas::NODE }>();
    if arch::field_at::<{ offset::CPU_ID }>(area) >= 0 {
        return arch::field_at::<{ offset::NODE_ID }>(area) as u32;
    }
    getcpu_slow().node
}

/// The calling thread's memory-map concurrency id (`mm_cid`, Linux 6.3+): an id unique among
/// the threads of this process running at the same moment, below the number of possible CPUs
/// and, once settled, below `min(threads, CPUs the process may use)`. Arrays indexed by it need
/// as many slots as the process has concurrent threads, not as the machine has CPUs.
///
/// `None` where the kernel does not provide it (before Linux 6.3) or rseq is not in use.
///
/// ```
/// if let Some(cid) = thiscpu::mm_cid() {
///     assert!((cid as usize) < thiscpu::topology::possible_cpus());
/// }
/// ```
#[inline]
#[must_use]
pub fn mm_cid() -> Option<u32> {
    // Two fields from one load of the area's offset: fewer steps than two `active_field`s.
    if registration::mm_cid_usable() {
        let area = arch::area_offset();
        if arch::field_at::<{ offset::CPU_ID }>(area) >= 0 {
            return Some(arch::field_at::<{ offset::MM_CID }>(area) as u32);
        }
    }
    mm_cid_slow()
}

#[cold]
#[inline(never)]
fn mm_cid_slow() -> Option<u32> {
    decide_fallback();
    if registration::mm_cid_usable() && registration::ensure_registered() {
        return Some(arch::active_field::<{ offset::MM_CID }>() as u32);
    }
    None
}

/// Reports what answers thiscpu's questions in this process and in the calling thread.
///
/// ```
/// let source = thiscpu::source();
/// println!("rseq registered by {}, answering: {}", source.registrar.name(), source.this_thread.name());
/// ```
#[must_use]
pub fn source() -> Source {
    let fallback = decide_fallback();
    let process = registration::process();
    let this_thread = if registration::ensure_registered() {
        match process.registrar {
            Registrar::Glibc => CpuSource::RseqGlibc,
            _ => CpuSource::RseqThiscpu,
        }
    } else {
        fallback
    };
    Source {
        registrar: process.registrar,
        unavailable: process.unavailable,
        this_thread,
        fallback,
        kernel_feature_size: process.kernel_feature_size,
        kernel_align: process.kernel_align,
        registered_size: process.registered_size,
        mode: process.mode(),
        optimized_size: process.optimized_size(),
        area_offset: (process.registrar != Registrar::None)
            .then(|| arch::area_offset().area_start()),
        usable_size: process.usable_size,
        glibc_rseq_size: process.glibc_rseq_size,
        glibc_rseq_offset: process.glibc_rseq_offset,
        node_id: process.node_id_usable(),
        mm_cid: process.mm_cid_usable(),
    }
}

/// Every other way to ask "which CPU am I on", for comparison and for environments without
/// rseq. Each function answers independently of the fallback choice.
pub mod via {
    use super::*;

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
        let mut cpu = 0u32;
        let mut node = 0u32;
        // SAFETY: getcpu writes two `unsigned int`s through valid pointers; the third
        // argument (the unused cache) may be null.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_getcpu,
                &mut cpu,
                &mut node,
                core::ptr::null_mut::<u8>(),
            )
        };
        (ret == 0).then_some(CpuNode { cpu, node })
    }

    type VdsoGetcpu = unsafe extern "C" fn(*mut u32, *mut u32, *mut libc::c_void) -> libc::c_long;

    fn vdso_getcpu_fn() -> Option<VdsoGetcpu> {
        const MISSING: usize = 1;
        let mut address = VDSO_GETCPU.load(Ordering::Relaxed);
        if address == 0 {
            address = lookup_vdso_getcpu().unwrap_or(MISSING);
            VDSO_GETCPU.store(address, Ordering::Relaxed);
        }
        if address == MISSING {
            return None;
        }
        // SAFETY: `address` came from `dlsym` for `__vdso_getcpu`, whose C type is
        // `long (unsigned *cpu, unsigned *node, void *cache)`.
        Some(unsafe { core::mem::transmute::<usize, VdsoGetcpu>(address) })
    }

    fn lookup_vdso_getcpu() -> Option<usize> {
        // SAFETY: glibc lists the vDSO among the loaded objects; RTLD_NOLOAD only looks it up.
        let handle = unsafe {
            libc::dlopen(
                c"linux-vdso.so.1".as_ptr(),
                libc::RTLD_LAZY | libc::RTLD_NOLOAD,
            )
        };
        if handle.is_null() {
            return None;
        }
        let mut symbol = core::ptr::null_mut();
        for name in [c"__vdso_getcpu", c"__kernel_getcpu"] {
            // SAFETY: `handle` is a valid handle from dlopen; `name` is NUL-terminated.
            symbol = unsafe { libc::dlsym(handle, name.as_ptr()) };
            if !symbol.is_null() {
                break;
            }
        }
        (!symbol.is_null()).then_some(symbol as usize)
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
        let getcpu = vdso_getcpu_fn()?;
        let mut cpu = 0u32;
        let mut node = 0u32;
        // SAFETY: the vDSO function writes two `unsigned int`s through valid pointers and
        // accepts a null cache.
        let ret = unsafe { getcpu(&mut cpu, &mut node, core::ptr::null_mut()) };
        (ret == 0).then_some(CpuNode { cpu, node })
    }

    /// glibc's `sched_getcpu` (which itself reads rseq when glibc registered it), or `None`
    /// if it failed.
    #[inline]
    pub fn sched_getcpu() -> Option<u32> {
        // SAFETY: no precondition.
        u32::try_from(unsafe { libc::sched_getcpu() }).ok()
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
}
