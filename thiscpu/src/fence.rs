//! Cross-CPU fences for restartable sequences: `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ)`.
//!
//! A fence of CPU `c` returns only once no restartable sequence of this process that started
//! on `c` before the call can still commit: the kernel interrupts `c` if it runs one of this
//! process's threads (the interrupt aborts a section in progress), and a thread preempted
//! inside a section aborts when it resumes. Sections that start on `c` afterwards see every
//! store the caller made before the call. This is how another thread takes over per-CPU data
//! that restartable sequences write with plain stores: set a flag the sections check, fence
//! the CPU, then the data is the caller's until it clears the flag ([`crate::Pool`]'s drain
//! does exactly this).
//!
//! The process registers its intent once (`MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ`), on
//! the first fence or on [`register`]. Registering can take a while in a process that already
//! has several threads (the kernel may wait for an RCU grace period), so a program that fences
//! may call [`register`] early.
//!
//! Needs Linux 5.10 or later. Where the kernel lacks it (`ENOSYS`, `EINVAL`), or a seccomp filter
//! refuses it (`EPERM` and others), every call returns [`FenceUnavailable`] and callers use
//! their fallback. `THISCPU_MEMBARRIER=off` in the environment (read once) makes fences
//! unavailable on purpose, to test those fallbacks.
//!
//! # References
//! membarrier(2); Linux `kernel/sched/membarrier.c`; `tools/testing/selftests/rseq/param_test.c`.
//!
//! # Safety
//! The module makes the `membarrier` system call, which takes no pointer, and reads one
//! environment variable with `getenv`; each block states why it holds.

use core::sync::atomic::{AtomicU64, Ordering};
use std::ffi::CStr;
use std::sync::OnceLock;

/// `MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ` (Linux 5.10).
pub const CMD_PRIVATE_EXPEDITED_RSEQ: i32 = 1 << 7;
/// `MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ` (Linux 5.10).
pub const CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ: i32 = 1 << 8;
/// `MEMBARRIER_CMD_FLAG_CPU`: target only the CPU in the third argument.
pub const CMD_FLAG_CPU: u32 = 1;

/// Why cross-CPU fences cannot be used in this process: the errno of the refused call.
///
/// ```
/// match thiscpu::fence::register() {
///     Ok(()) => println!("fences available"),
///     Err(why) => println!("no fences: errno {}", why.errno()),
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FenceUnavailable {
    errno: i32,
}

impl FenceUnavailable {
    pub(crate) fn refused(errno: i32) -> Self {
        FenceUnavailable { errno }
    }

    /// The errno the kernel returned (`ENOSYS`, `EINVAL` on kernels before 5.10, `EPERM` or
    /// another under seccomp), or `EPERM` when `THISCPU_MEMBARRIER=off` turned fences off.
    pub fn errno(self) -> i32 {
        self.errno
    }
}

impl core::fmt::Display for FenceUnavailable {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "membarrier(PRIVATE_EXPEDITED_RSEQ) unavailable: {}",
            std::io::Error::from_raw_os_error(self.errno)
        )
    }
}

impl std::error::Error for FenceUnavailable {}

fn membarrier(cmd: i32, flags: u32, cpu: i32) -> Result<(), FenceUnavailable> {
    // SAFETY: membarrier takes three integers and touches no user memory.
    let ret = unsafe { libc::syscall(libc::SYS_membarrier, cmd, flags, cpu) };
    if ret == 0 {
        Ok(())
    } else {
        Err(FenceUnavailable {
            errno: std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::ENOSYS),
        })
    }
}

fn turned_off() -> bool {
    // SAFETY: `getenv` with a NUL-terminated name; the result is read at once.
    let value = unsafe { libc::getenv(c"THISCPU_MEMBARRIER".as_ptr()) };
    if value.is_null() {
        return false;
    }
    // SAFETY: a non-null `getenv` result is a NUL-terminated string.
    let value = unsafe { CStr::from_ptr(value) }.to_bytes();
    matches!(value, b"off" | b"0" | b"false" | b"no")
}

/// Registers the process for rseq fences (once; later calls return the first result).
///
/// ```
/// // Either way, asking again gives the same answer.
/// assert_eq!(thiscpu::fence::register(), thiscpu::fence::register());
/// ```
pub fn register() -> Result<(), FenceUnavailable> {
    static REGISTERED: OnceLock<Result<(), FenceUnavailable>> = OnceLock::new();
    *REGISTERED.get_or_init(|| {
        if turned_off() {
            return Err(FenceUnavailable::refused(libc::EPERM));
        }
        membarrier(CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ, 0, 0)
    })
}

/// Whether fences work in this process (registers on first call).
///
/// ```
/// let _ = thiscpu::fence::available();
/// ```
pub fn available() -> bool {
    register().is_ok()
}

/// Fences CPU `cpu`: when this returns `Ok`, no restartable sequence of this process that
/// started on `cpu` before the call can commit any more, and sections starting there afterwards
/// see the caller's earlier stores. An offline or nonexistent CPU needs no fence (nothing of
/// this process runs there) and returns `Ok`.
///
/// ```
/// if thiscpu::fence::available() {
///     thiscpu::fence::fence_cpu(0).unwrap();
/// }
/// ```
pub fn fence_cpu(cpu: u32) -> Result<(), FenceUnavailable> {
    register()?;
    let cpu = i32::try_from(cpu).map_err(|_| FenceUnavailable {
        errno: libc::EINVAL,
    })?;
    membarrier(CMD_PRIVATE_EXPEDITED_RSEQ, CMD_FLAG_CPU, cpu)
}

/// Fences every CPU that runs a thread of this process (for data indexed by `mm_cid`, which
/// has no fixed CPU).
///
/// ```
/// if thiscpu::fence::available() {
///     thiscpu::fence::fence_all().unwrap();
/// }
/// ```
pub fn fence_all() -> Result<(), FenceUnavailable> {
    register()?;
    membarrier(CMD_PRIVATE_EXPEDITED_RSEQ, 0, 0)
}

/// Per-CPU data that the calling thread took over with [`take_over`]: until this is dropped, no
/// restartable sequence can commit on it. Dropping it gives the data back to the sections by
/// storing the flag's running value with release ordering, so a section that then finds the
/// flag cleared also sees every store made under this guard.
#[derive(Debug)]
pub struct TakenOver<'a> {
    flag: &'a AtomicU64,
    running: u64,
}

impl Drop for TakenOver<'_> {
    fn drop(&mut self) {
        self.flag.store(self.running, Ordering::Release);
    }
}

/// Takes per-CPU data over from the restartable sequences of `cpu` (or, for `cpu` `None`, of
/// every CPU, for data indexed by `mm_cid`): the protocol [`crate::Pool::drain_cpu`] and
/// [`crate::Sharded`]'s readers share.
///
/// `flag` is a word that every section writing the data compares before it commits, and
/// leaves the data alone unless it reads `running`: the pool's `stopped` flag, or a shard's
/// lock word (whose sections commit by writing it). The call
/// 1. swaps `flag` from `running` to `stopped` (`Ok(None)` if it did not hold `running`);
/// 2. fences the CPU (every CPU for `None`): a section that read `running` before the swap is
///    aborted or has committed by then, and every later one reads `stopped` and leaves;
/// 3. checks that `flag` still holds `stopped`. A section that read `running` before the swap
///    may have committed a store to `flag` after it, and then owns the data: the call returns
///    `Ok(None)` and leaves `flag` as that section wrote it.
///
/// With `Ok(Some(guard))` the data is the caller's until the guard is dropped; the fence also
/// made the sections' plain stores visible to the caller. With `Err`, `flag` is back to
/// `running` (unless a section wrote it meanwhile) and nothing was taken.
///
/// `running` and `stopped` must differ; nothing but the sections, the takers and whoever owns the
/// data through them may write `flag`; and calls on one flag must not overlap (callers
/// serialize them with a lock): step 3 cannot tell its own `stopped` from another taker's.
///
/// ```
/// use core::sync::atomic::AtomicU64;
/// let flag = AtomicU64::new(0);
/// if let Ok(Some(taken)) = thiscpu::fence::take_over(Some(0), &flag, 0, 1) {
///     assert_eq!(flag.load(core::sync::atomic::Ordering::Relaxed), 1);
///     drop(taken);
///     assert_eq!(flag.load(core::sync::atomic::Ordering::Relaxed), 0);
/// }
/// ```
pub fn take_over(
    cpu: Option<u32>,
    flag: &AtomicU64,
    running: u64,
    stopped: u64,
) -> Result<Option<TakenOver<'_>>, FenceUnavailable> {
    debug_assert_ne!(running, stopped);
    register()?;
    if flag
        .compare_exchange(running, stopped, Ordering::SeqCst, Ordering::Relaxed)
        .is_err()
    {
        return Ok(None);
    }
    let fenced = match cpu {
        Some(cpu) => fence_cpu(cpu),
        None => fence_all(),
    };
    if let Err(refused) = fenced {
        let _ = flag.compare_exchange(stopped, running, Ordering::Release, Ordering::Relaxed);
        return Err(refused);
    }
    // Acquire: what a section's committed stores published, and what the last holder released.
    if flag.load(Ordering::Acquire) != stopped {
        return Ok(None);
    }
    Ok(Some(TakenOver { flag, running }))
}
