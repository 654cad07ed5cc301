//! Cross-CPU fences for restartable sequences: `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ)`.
//!
//! Linux only: on other systems, which have no restartable sequences either, every function
//! here returns its error ([`FenceUnavailable`] with `ENOSYS`, [`VisitRefused`] since no thread
//! can be moved), and the types that use fences keep their atomic modes.
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
//! # Fences by visiting
//! A process whose sections already run when `membarrier` starts being refused (a sandbox
//! installing a seccomp filter for every thread after start-up) cannot fall back to
//! compare-and-swap: the sections keep writing with plain stores. [`visit_cpu`] fences a CPU
//! without `membarrier`, by running the calling thread there for a moment; [`visit_all`] visits
//! every CPU, and [`take_over_by_visiting`] is [`take_over`] built on them. They cost two
//! migrations per CPU, and fail only where the thread may not change its own affinity.
//!
//! # References
//! membarrier(2); Linux `kernel/sched/membarrier.c`; `tools/testing/selftests/rseq/param_test.c`.
//!
//! # Safety
//! The module makes the `membarrier`, `gettid` and `tgkill` (signal 0) system calls, which
//! take no pointer, and `getcpu`, which writes one integer; it reads environment variables with
//! `getenv`; each block states why it holds.

use crate::decided_once::{self, DecidedOnce};
use crate::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use crate::sync::cell::UnsafeCell;
use core::mem::MaybeUninit;
use std::ffi::CStr;

/// `MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ` (Linux 5.10).
pub const CMD_PRIVATE_EXPEDITED_RSEQ: i32 = crate::abi::MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ;
/// `MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ` (Linux 5.10).
pub const CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ: i32 =
    crate::abi::MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ;
/// `MEMBARRIER_CMD_FLAG_CPU`: target only the CPU in the third argument.
pub const CMD_FLAG_CPU: u32 = crate::abi::MEMBARRIER_CMD_FLAG_CPU;

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

/// `membarrier` on Linux; `ENOSYS` elsewhere.
#[cfg(not(thiscpu_model))]
fn membarrier(cmd: i32, flags: u32, cpu: i32) -> Result<(), FenceUnavailable> {
    crate::os::membarrier(cmd, flags, cpu).map_err(FenceUnavailable::refused)
}

/// The model machine's fences, under the model checker.
#[cfg(thiscpu_model)]
fn membarrier(cmd: i32, flags: u32, cpu: i32) -> Result<(), FenceUnavailable> {
    crate::arch::model::membarrier(cmd, flags, cpu).map_err(FenceUnavailable::refused)
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

/// The process's registration, made once by the first caller (see `DecidedOnce`, which also
/// covers a `fork` in the middle of it).
static REGISTRATION: DecidedOnce<Result<(), FenceUnavailable>> = DecidedOnce::new(
    AtomicI32::new(decided_once::UNDECIDED),
    UnsafeCell::new(MaybeUninit::uninit()),
);

fn registration_attempt() -> Result<(), FenceUnavailable> {
    if turned_off() {
        return Err(FenceUnavailable::refused(libc::EPERM));
    }
    membarrier(CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ, 0, 0)
}

/// Registers the process for rseq fences (once; later calls return the first result).
///
/// Safe to call from a signal handler, including one that interrupted this very call on its
/// own thread: that call cannot finish while the handler runs, so the handler does not wait
/// for it but registers again itself (the kernel accepts the same registration any number of
/// times) and returns the kernel's answer. Calls on other threads wait for the first one, which
/// takes at most one system call (an RCU grace period, in a process with several threads).
///
/// ```
/// // Either way, asking again gives the same answer.
/// assert_eq!(thiscpu::fence::register(), thiscpu::fence::register());
/// ```
pub fn register() -> Result<(), FenceUnavailable> {
    let decided = REGISTRATION.get_or_decide(&crate::os::Threads, || {
        inject::signal_in_registration();
        registration_attempt()
    });
    // `None`: a signal handler that interrupted the registration on its own thread.
    decided.copied().unwrap_or_else(registration_attempt)
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

/// Why a visiting fence ([`visit_cpu`], [`visit_all`]) could not be made: the CPU it had to run
/// on, and the errno of `sched_setaffinity` (or `EAGAIN` when the thread was moved elsewhere
/// again before it could see itself on that CPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VisitRefused {
    cpu: u32,
    errno: i32,
}

impl VisitRefused {
    /// The CPU the calling thread could not run on.
    pub fn cpu(self) -> u32 {
        self.cpu
    }

    /// `sched_setaffinity`'s errno (`EPERM` under a seccomp filter, say), or `EAGAIN` when
    /// the thread's affinity kept being changed from elsewhere.
    pub fn errno(self) -> i32 {
        self.errno
    }
}

impl core::fmt::Display for VisitRefused {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        if self.errno == libc::EAGAIN {
            write!(
                f,
                "could not run on CPU {}: the thread's affinity kept changing",
                self.cpu
            )
        } else {
            write!(
                f,
                "could not run on CPU {}: {}",
                self.cpu,
                std::io::Error::from_raw_os_error(self.errno)
            )
        }
    }
}

impl std::error::Error for VisitRefused {}

/// The CPU the calling thread runs on, from the `getcpu` system call (never from rseq, which a
/// thread without it lacks, nor from a vDSO whose answer nothing here can check).
#[cfg(not(thiscpu_model))]
fn kernel_cpu() -> Option<u32> {
    crate::os::getcpu_syscall().map(|(cpu, _)| cpu)
}

/// How many times a visit re-pins a thread that something else moved away meanwhile.
#[cfg(not(thiscpu_model))]
const VISIT_TRIES: u32 = 8;

/// Fences CPU `cpu` without `membarrier`, by running the calling thread there: when this returns
/// `Ok`, no restartable sequence of this process that started on `cpu` before the call can
/// commit any more, and sections starting there afterwards see the caller's earlier stores.
/// The thread's affinity is restored before it returns. It costs two `sched_setaffinity` calls
/// and two migrations: the fallback where `membarrier` is refused.
///
/// Why it is a fence: once the caller runs on `cpu`, every other thread that was inside a
/// section there has left the CPU, so that section either ended before, or was preempted and
/// aborts when its thread resumes (the kernel restarts a section whose thread was preempted or
/// migrated). The caller's trip there goes through the scheduler's run-queue locks of `cpu`,
/// whose full barriers order the caller's earlier stores before anything that CPU runs next.
/// The caller trusts the trip only once the kernel's `getcpu` shows it on `cpu`: another thread
/// (or `taskset`) may change its affinity between the pin and the check, and then it pins again,
/// up to a few times.
///
/// A CPU the kernel will not run the calling thread on (`EINVAL`: offline, or outside this
/// thread's cpuset) needs no visit only if no thread of the process may run there either: the
/// call reads every thread's affinity mask (`/proc/self/task`) and returns `Ok` when none
/// holds `cpu` (a thread that ran there before went through a migration, which aborts its
/// section), and the `EINVAL` error otherwise, since threads may have cpusets of their own
/// (threaded cgroup v2 cpusets, cgroup v1 `tasks`). A thread moved onto `cpu` while the call
/// reads the masks is not seen; its move is a migration, a full barrier, but one that may come
/// after the caller's next loads. Any other refusal (a seccomp filter refusing
/// `sched_setaffinity`, say) is an error.
/// If another thread changes the caller's affinity during the call, the restore may undo that
/// change.
///
/// ```
/// match thiscpu::topology::allowed_cpus() {
///     Ok(allowed) => thiscpu::fence::visit_cpu(allowed[0]).unwrap(),
///     // Off Linux no thread can be moved, so none can visit.
///     Err(_) => assert!(thiscpu::fence::visit_cpu(0).is_err()),
/// }
/// ```
pub fn visit_cpu(cpu: u32) -> Result<(), VisitRefused> {
    #[cfg(thiscpu_model)]
    {
        crate::arch::model::visit(cpu);
        Ok(())
    }
    #[cfg(not(thiscpu_model))]
    visit_by_affinity(cpu)
}

/// The visit: pins the thread to `cpu` until the kernel shows it there.
#[cfg(not(thiscpu_model))]
fn visit_by_affinity(cpu: u32) -> Result<(), VisitRefused> {
    for _ in 0..VISIT_TRIES {
        // Restores the previous affinity when dropped.
        let _visiting = match crate::topology::pin_to_beyond_mask(cpu) {
            Ok(pinned) => pinned,
            Err(error) => {
                let errno = error.raw_os_error().unwrap_or(libc::EINVAL);
                if errno == libc::EINVAL && !crate::topology::some_thread_may_run_on(cpu) {
                    return Ok(());
                }
                return Err(VisitRefused { cpu, errno });
            }
        };
        if kernel_cpu() == Some(cpu) {
            return Ok(());
        }
    }
    Err(VisitRefused {
        cpu,
        errno: libc::EAGAIN,
    })
}

/// [`visit_cpu`] for every CPU a thread of this process may run on (the possible CPUs, and any
/// the calling thread is allowed beyond them): the visiting counterpart of [`fence_all`], for
/// data indexed by `mm_cid`. Costs two migrations per CPU.
///
/// ```
/// // Visits need pinning, which Linux alone offers.
/// let can_pin = thiscpu::topology::allowed_cpus().is_ok();
/// assert_eq!(thiscpu::fence::visit_all().is_ok(), can_pin);
/// ```
pub fn visit_all() -> Result<(), VisitRefused> {
    let possible = crate::topology::possible_cpus() as u32;
    let beyond = crate::topology::allowed_cpus()
        .unwrap_or_default()
        .into_iter()
        .filter(|&cpu| cpu >= possible);
    for cpu in (0..possible).chain(beyond) {
        visit_cpu(cpu)?;
    }
    Ok(())
}

/// [`take_over`] with a visiting fence ([`visit_cpu`], or [`visit_all`] for `cpu` `None`)
/// instead of `membarrier`: for a process where `membarrier` was refused after sections began
/// to run, when a compare-and-swap alone would race them. The same contract and steps; with
/// `Err`, `flag` is back to `running` (unless a section wrote it meanwhile).
///
/// ```
/// use core::sync::atomic::AtomicU64;
/// let flag = AtomicU64::new(0);
/// // Visits need pinning, which Linux alone offers; a refusal leaves `flag` as it was.
/// if let Ok(taken) = thiscpu::fence::take_over_by_visiting(Some(0), &flag, 0, 1) {
///     assert_eq!(flag.load(core::sync::atomic::Ordering::Relaxed), 1);
///     drop(taken);
/// }
/// assert_eq!(flag.load(core::sync::atomic::Ordering::Relaxed), 0);
/// ```
pub fn take_over_by_visiting(
    cpu: Option<u32>,
    flag: &AtomicU64,
    running: u64,
    stopped: u64,
) -> Result<Option<TakenOver<'_>>, VisitRefused> {
    debug_assert_ne!(running, stopped);
    if flag
        .compare_exchange(running, stopped, Ordering::SeqCst, Ordering::Relaxed)
        .is_err()
    {
        return Ok(None);
    }
    let visited = match cpu {
        Some(cpu) => visit_cpu(cpu),
        None => visit_all(),
    };
    if let Err(refused) = visited {
        let _ = flag.compare_exchange(stopped, running, Ordering::Release, Ordering::Relaxed);
        return Err(refused);
    }
    // As in `take_over`: a section that read `running` before the swap and committed since owns
    // the data; every other one reads `stopped` from now on.
    if flag.load(Ordering::Acquire) != stopped {
        return Ok(None);
    }
    Ok(Some(TakenOver { flag, running }))
}

/// Fault injection for tests, built only with `--cfg thiscpu_inject`.
mod inject {
    /// Raises the signal in `THISCPU_INJECT_SIGNAL_IN_FENCE_REGISTRATION` on the registering
    /// thread, in the middle of [`super::register`], so that a test can re-enter it from the
    /// handler.
    #[cfg(thiscpu_inject)]
    pub(super) fn signal_in_registration() {
        // SAFETY: `getenv` with a NUL-terminated name; a non-null result is a NUL-terminated
        // string, read at once.
        let signal = unsafe {
            let value = libc::getenv(c"THISCPU_INJECT_SIGNAL_IN_FENCE_REGISTRATION".as_ptr());
            if value.is_null() {
                return;
            }
            std::ffi::CStr::from_ptr(value)
                .to_str()
                .ok()
                .and_then(|v| v.parse::<i32>().ok())
        };
        if let Some(signal) = signal {
            // SAFETY: raises a signal whose handler the test installed.
            unsafe { libc::raise(signal) };
        }
    }

    #[cfg(not(thiscpu_inject))]
    #[inline(always)]
    pub(super) fn signal_in_registration() {}
}

// The tests pin threads: affinity is Linux's (`thiscpu_linux`, set by the build script).
#[cfg(all(test, thiscpu_linux))]
mod tests {
    use super::*;
    use crate::topology;

    #[test]
    fn a_visit_leaves_the_thread_where_it_was_allowed_to_run() {
        let allowed = topology::allowed_cpus().unwrap();
        let (first, last) = (allowed[0], *allowed.last().unwrap());
        std::thread::spawn(move || {
            let _pinned = topology::pin_to(first).unwrap();
            // Beyond the thread's own mask, as a shard's CPU may be.
            visit_cpu(last).unwrap();
            assert_eq!(topology::allowed_cpus().unwrap(), [first]);
            visit_all().unwrap();
            assert_eq!(topology::allowed_cpus().unwrap(), [first]);
            // No such CPU: nothing runs there, nothing to fence.
            visit_cpu(100_000).unwrap();
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_take_over_by_visiting_yields_to_a_holder_and_gives_back_on_drop() {
        let flag = AtomicU64::new(7);
        assert!(
            take_over_by_visiting(Some(0), &flag, 0, 1)
                .unwrap()
                .is_none()
        );
        assert_eq!(flag.load(Ordering::Relaxed), 7, "a held flag was changed");
        flag.store(0, Ordering::Relaxed);
        let taken = take_over_by_visiting(None, &flag, 0, 1)
            .unwrap()
            .expect("free");
        assert_eq!(flag.load(Ordering::Relaxed), 1);
        drop(taken);
        assert_eq!(flag.load(Ordering::Relaxed), 0);
    }
}
