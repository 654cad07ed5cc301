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
