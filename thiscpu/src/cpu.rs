//! Which CPU, node and concurrency id this thread runs on: one load from the rseq area on the
//! fast path, and the fallback that the process's decision chose (the CPU's own instruction,
//! the vDSO, the syscall: `via`) when rseq is missing. Reads the decision; never makes it
//! differently from any other caller (`registration::decided`).

use crate::abi::offset;
use crate::arch::{self, areas};
use crate::ops;
use crate::registration::{self, Registrar, RseqMode, Unavailable};
use crate::topology;
use crate::via::{self, CpuNode, CpuSource};

/// What answers thiscpu's questions in this process and thread, and what the kernel offers.
///
/// With the `serde` feature: `Serialize` and `Deserialize`.
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

/// The source that answers where rseq cannot: the decided fallback, or, in a signal handler
/// that interrupted the decision on its own thread, the system call, which needs no decision.
fn fallback_source() -> CpuSource {
    registration::decided().map_or(CpuSource::Syscall, |process| process.fallback)
}

fn fallback_cpu_node() -> CpuNode {
    via::fallback_cpu_node(fallback_source())
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
    if !registration::decided_without_rseq() && registration::ensure_registered() {
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
    if !registration::decided_without_rseq() && registration::ensure_registered() {
        if registration::decided().is_some_and(|process| process.rseq.node_id_usable()) {
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
/// // Pinned where the system can pin (Linux); every CPU is on node 0 where it cannot.
/// let _pinned = thiscpu::topology::pin_to(thiscpu::current_cpu());
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
    let usable = registration::decided().is_some_and(|process| process.rseq.mm_cid_usable());
    if usable && registration::ensure_registered() {
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
    match registration::decided() {
        Some(process) => source_of(process),
        None => source_while_undecided(),
    }
}

fn source_of(process: &registration::Process) -> Source {
    let facts = &process.rseq;
    let this_thread = if registration::ensure_registered() {
        match facts.registrar {
            Registrar::Glibc => CpuSource::RseqGlibc,
            _ => CpuSource::RseqThiscpu,
        }
    } else {
        process.fallback
    };
    Source {
        registrar: facts.registrar,
        unavailable: facts.unavailable,
        this_thread,
        fallback: process.fallback,
        kernel_feature_size: facts.kernel_feature_size,
        kernel_align: facts.kernel_align,
        registered_size: facts.registered_size,
        mode: facts.mode(),
        optimized_size: facts.optimized_size(),
        area_offset: (facts.registrar != Registrar::None).then(|| arch::area_offset().area_start()),
        usable_size: facts.usable_size,
        glibc_rseq_size: facts.glibc_rseq_size,
        glibc_rseq_offset: facts.glibc_rseq_offset,
        node_id: facts.node_id_usable(),
        mm_cid: facts.mm_cid_usable(),
    }
}

/// What a signal handler that interrupted the decision on its own thread is told: every
/// answer from the system call, nothing about rseq, since nothing is decided.
#[cold]
fn source_while_undecided() -> Source {
    Source {
        registrar: Registrar::None,
        unavailable: None,
        this_thread: CpuSource::Syscall,
        fallback: CpuSource::Syscall,
        kernel_feature_size: 0,
        kernel_align: 0,
        registered_size: 0,
        mode: None,
        optimized_size: None,
        area_offset: None,
        usable_size: 0,
        glibc_rseq_size: None,
        glibc_rseq_offset: None,
        node_id: false,
        mm_cid: false,
    }
}
