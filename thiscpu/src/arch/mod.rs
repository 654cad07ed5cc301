//! The one place that chooses an architecture. Every architecture file exports the same items:
//! the abort signature, access to this thread's rseq area (through a process-wide offset from
//! the thread pointer), the restartable sequences, and the CPU's own id instructions if any.
//!
//! # Safety
//! The submodules are built from `asm!`; each block states why it holds.

#[cfg(target_arch = "x86_64")]
#[path = "x86_64.rs"]
mod imp;

#[cfg(target_arch = "aarch64")]
#[path = "aarch64.rs"]
mod imp;

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
compile_error!("thiscpu supports x86_64 and aarch64 Linux");

pub(crate) use imp::*;

/// Where the active rseq area is, as `section_offset` loaded it: the offset from the thread
/// pointer (on aarch64, to the area's `cpu_id` field). Only the architecture files can make one,
/// so every value names a live area in whichever thread holds it: the process-wide offset is
/// the same for every thread, and an offset that was active once (thiscpu's own area, before
/// the switch to glibc's) stays valid, since every thread keeps its own area. That is what lets
/// `field_at` be a safe function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SectionOffset(isize);
