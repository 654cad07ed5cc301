//! Every other way to ask "which CPU am I on", for comparison and for environments without
//! rseq: the system call, the vDSO, glibc's `sched_getcpu`, and the CPU's own instructions.
//! Each function answers independently of which one the process chose as its fallback
//! (`Process::fallback`, chosen once by the registration, which is the only caller of
//! `choose_fallback`).
//!
//! # Safety
//! This module calls the vDSO's `getcpu` through a pointer that `dlsym` returned for that
//! symbol; each block states why it holds.

use crate::arch;
use core::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

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

static VDSO_GETCPU: AtomicUsize = AtomicUsize::new(0);

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

/// The best source that answers without rseq on this machine: the CPU's own instruction where
/// it agrees with the kernel, then the vDSO, then the system call. Probes each once.
pub(crate) fn choose_fallback() -> CpuSource {
    if rdpid().is_some() {
        CpuSource::Rdpid
    } else if vdso().is_some() {
        CpuSource::Vdso
    } else {
        CpuSource::Syscall
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
        CpuSource::Vdso => vdso(),
        _ => None,
    };
    answer
        .or_else(syscall)
        .unwrap_or(CpuNode { cpu: 0, node: 0 })
}
