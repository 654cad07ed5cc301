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
