//! thiscpu: which CPU (and NUMA node) am I running on, in about a nanosecond, and per-CPU data
//! that many threads update without atomic instructions.
//!
//! Linux keeps, for every thread that registers one, a small *restartable sequences* (rseq)
//! area whose `cpu_id` field the kernel rewrites whenever the thread comes back to user space
//! on a CPU. Reading the current CPU is then a single load, as the kernel does for itself on
//! arm64 (`thread_info->cpu`). A *restartable sequence* is a short run of instructions that the
//! kernel promises to abort (jump to a handler) if the thread is preempted, migrated or
//! signalled in the middle: per-CPU data can be updated with plain loads and stores, no `lock`
//! prefix, and no other thread can interleave on that CPU.
//!
//! # Where the answer comes from
//! 1. glibc 2.35+ registers an rseq area for every thread; thiscpu reads that one.
//! 2. When glibc did not (`GLIBC_TUNABLES=glibc.pthread.rseq=0`, older glibc, other libcs),
//!    thiscpu registers an area of its own in each thread, on first use, in static TLS.
//! 3. Without rseq (old kernels, valgrind, qemu-user, seccomp, or `THISCPU_RSEQ=off`), the
//!    fallback chosen once per process answers: `rdpid` where the CPU has it, then the vDSO's
//!    `getcpu`, then the system call. [`source()`] says which.
//!
//! ```
//! let here = thiscpu::getcpu();
//! println!("cpu {} on node {} (via {})", here.cpu, here.node, thiscpu::source().this_thread.name());
//! ```

#![deny(unsafe_code)]

#[allow(unsafe_code)]
pub mod abi;
#[allow(unsafe_code)]
mod arch;
#[allow(unsafe_code)]
mod counter;
#[allow(unsafe_code)]
mod cpu;
#[allow(unsafe_code)]
pub mod dense;
#[allow(unsafe_code)]
pub mod ops;
mod percpu;
#[allow(unsafe_code)]
mod registration;
#[allow(unsafe_code)]
pub mod stress;
#[allow(unsafe_code)]
pub mod topology;

pub use counter::{ByCpu, ByMmCid, Counter, Spread};
pub use cpu::{CpuNode, CpuSource, Source, current_cpu, current_node, getcpu, mm_cid, source, via};
pub use percpu::{CachePadded, PerCpu};
pub use registration::{Registrar, Unavailable};
