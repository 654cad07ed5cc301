//! The operating system's services, and the one place that chooses them.
//!
//! Two backends export the same items (the list at the end of this file spells out their
//! types, so a build for any target fails if one strays): `linux.rs` (`futex`, `membarrier`,
//! `getcpu` and the vDSO, `mmap` and `munmap`, `sched_{get,set}affinity`, `/proc`,
//! `pthread_atfork`) and `portable.rs` for every other system (a `Mutex` and `Condvar` per
//! address, no fences, `mmap` on Unix and a zeroed allocation elsewhere, no pinning). The
//! build script decides between them (`thiscpu_linux`). `cpu_number.rs` holds the CPU
//! numbers that other systems' libraries give, each where it exists. The rseq system call is
//! the registration's (`registration/rseq.rs`).
//!
//! Under `--cfg thiscpu_portable` a Linux build takes `portable.rs`, the path of every other
//! system, with glibc's `sched_getcpu` for the CPU number; `portable.rs` is also
//! compiled into the unit tests of a plain Linux build, so that its own tests run there too.

#[cfg(thiscpu_linux)]
#[path = "linux.rs"]
mod system;

#[cfg(not(thiscpu_linux))]
#[path = "portable.rs"]
mod system;

// The portable services are tested on Linux too; only their own tests use them there.
#[cfg(all(test, thiscpu_linux))]
#[allow(dead_code)]
mod portable;

pub(crate) use system::*;

use core::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// The alignment of every range `reserve_zeroed` returns: one page, whether it maps pages or
/// asks an allocator for them.
pub(crate) const RESERVED_ALIGN: usize = 4096;

pub(crate) mod cpu_number;

/// The forks between the first call of [`count_forks`] and this process: each child's
/// `pthread_atfork` handler adds one, so a value recorded in a parent differs from its
/// child's, whatever thread ids the child's kernel hands out.
static FORK_GENERATION: AtomicU32 = AtomicU32::new(0);
/// Whether the handler that counts forks is registered (or being registered).
static COUNTING_FORKS: AtomicBool = AtomicBool::new(false);

extern "C" fn nothing_to_do() {}

extern "C" fn forked() {
    FORK_GENERATION.fetch_add(1, Ordering::Relaxed);
}

/// This process's fork generation (see [`count_forks`]): one relaxed load, no system call.
#[inline]
pub(crate) fn fork_generation() -> u32 {
    FORK_GENERATION.load(Ordering::Relaxed)
}

/// Makes every later `fork` count in [`fork_generation`], in the child (the handler is
/// inherited, so grandchildren count too). Registers once per process; does not wait for a
/// registration under way on another thread (it may allocate, and this may run inside an
/// allocator), so a fork in that instant may go uncounted, as every fork does where
/// registering fails or the system has no `fork`.
pub(crate) fn count_forks() {
    if !COUNTING_FORKS.swap(true, Ordering::Relaxed) {
        at_fork(nothing_to_do, nothing_to_do, forked);
    }
}

// The contract: both backends export these items with these types.
const _: () = {
    use core::sync::atomic::AtomicU32;
    let _: fn() -> Option<(u32, u32)> = getcpu_syscall;
    let _: fn() -> Option<(u32, u32)> = vdso_getcpu;
    let _: fn(&AtomicU32, u32) = wait;
    let _: fn(&AtomicU32, u32, core::time::Duration) = wait_timeout;
    let _: fn(&AtomicU32, i32) = wake;
    let _: fn(i32, u32, i32) -> Result<(), i32> = membarrier;
    let _: fn(usize) -> Option<core::ptr::NonNull<u8>> = reserve_zeroed;
    let _: unsafe fn(core::ptr::NonNull<u8>, usize) = unreserve;
    let _: fn(usize) -> Option<core::ptr::NonNull<u8>> = map_aligned;
    let _: unsafe fn(core::ptr::NonNull<u8>, usize) = return_pages;
    let _: unsafe fn(*mut u8, usize) = back_pages;
    let _: fn(extern "C" fn(), extern "C" fn(), extern "C" fn()) = at_fork;
    let _: fn() -> usize = configured_cpus;
    let _: fn(&core::ffi::CStr) -> bool = path_exists;
    let _: fn(i32, &mut [AffinityWord]) -> std::io::Result<()> = get_affinity;
    let _: fn(i32, &[AffinityWord]) -> std::io::Result<()> = set_affinity;
    let _: fn() -> Option<Vec<i32>> = thread_ids;
    let _: fn() -> Threads = || Threads;
};
