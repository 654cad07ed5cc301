//! Linux's services: system calls, the vDSO, `/proc`.
//!
//! # Safety
//! Each system call is given valid pointers with their lengths, or none; each block states why
//! it holds.

use crate::decided_once::Claimants;
use core::ffi::CStr;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::io;

/// The `getcpu` system call: `(cpu, node)`, or `None` if it was refused (a seccomp filter).
pub(crate) fn getcpu_syscall() -> Option<(u32, u32)> {
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
    (ret == 0).then_some((cpu, node))
}

static VDSO_GETCPU: AtomicUsize = AtomicUsize::new(0);

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

/// `getcpu` in the vDSO: `(cpu, node)`, or `None` where the vDSO has none (aarch64, valgrind).
#[inline]
pub(crate) fn vdso_getcpu() -> Option<(u32, u32)> {
    let getcpu = vdso_getcpu_fn()?;
    let mut cpu = 0u32;
    let mut node = 0u32;
    // SAFETY: the vDSO function writes two `unsigned int`s through valid pointers and
    // accepts a null cache.
    let ret = unsafe { getcpu(&mut cpu, &mut node, core::ptr::null_mut()) };
    (ret == 0).then_some((cpu, node))
}

/// Sleeps while `word` holds `expected` (`FUTEX_WAIT`); spurious returns happen.
pub(crate) fn wait(word: &AtomicU32, expected: u32) {
    futex_wait(word, expected, None);
}

/// As [`wait`], for at most about `timeout` (`FUTEX_WAIT` with a relative time).
pub(crate) fn wait_timeout(word: &AtomicU32, expected: u32, timeout: core::time::Duration) {
    // A timeout past what `time_t` holds sleeps as long as it can. `c_long` is `i32` on 32-bit
    // targets, where the nanoseconds' conversion is fallible in type only (under 10^9).
    #[allow(clippy::unnecessary_fallible_conversions)]
    let timeout = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::try_from(timeout.subsec_nanos()).unwrap_or(0),
    };
    futex_wait(word, expected, Some(&timeout));
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<&libc::timespec>) {
    let timeout: *const libc::timespec = timeout.map_or(core::ptr::null(), |t| t);
    // SAFETY: FUTEX_WAIT reads the aligned `u32` at `word`, a live atomic, and compares it,
    // and reads the timespec, null or borrowed for the call; the other arguments are unused.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            timeout,
        );
    }
}

/// Wakes up to `count` threads sleeping on `word` (`FUTEX_WAKE`).
pub(crate) fn wake(word: &AtomicU32, count: i32) {
    // SAFETY: FUTEX_WAKE only uses the address as a key; it reads no memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            count,
        );
    }
}

/// The `membarrier` system call; the errno when it fails.
pub(crate) fn membarrier(cmd: i32, flags: u32, cpu: i32) -> Result<(), i32> {
    // SAFETY: membarrier takes three integers and touches no user memory.
    let ret = unsafe { libc::syscall(libc::SYS_membarrier, cmd, flags, cpu) };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::ENOSYS))
    }
}

/// `length` bytes of zeroed address space, reserved and not committed (`MAP_NORESERVE`):
/// pages are backed on first write. `None` if the kernel refused. [`unreserve`] gives it back.
pub(crate) fn reserve_zeroed(length: usize) -> Option<NonNull<u8>> {
    // SAFETY: an anonymous private mapping at an address of the kernel's choice; MAP_NORESERVE
    // commits nothing, pages are backed on first write (and read as zero before).
    let address = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            length,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if address == libc::MAP_FAILED {
        return None;
    }
    // With transparent huge pages set to "always", one CPU's first write could back a 2 MiB
    // page spanning the rows of 32 CPUs; rows must be backed page by page, by their own CPU.
    // SAFETY: advice on the mapping just made; failure (no THP support) changes nothing.
    unsafe {
        libc::madvise(address, length, libc::MADV_NOHUGEPAGE);
    }
    NonNull::new(address.cast())
}

/// Gives back a range that [`reserve_zeroed`] returned: its pages and its address space.
///
/// # Safety
/// `start` and `length` are a range from [`reserve_zeroed`] and its length, given back once;
/// nothing reads or writes the range after this call.
pub(crate) unsafe fn unreserve(start: NonNull<u8>, length: usize) {
    // SAFETY: the range is a whole mapping made by `reserve_zeroed` (the caller's contract),
    // which nothing uses any more, so unmapping it pulls no memory from under anyone. munmap
    // fails only for a range that is not page-aligned or has no length, neither of which
    // `reserve_zeroed` returns.
    unsafe {
        libc::munmap(start.as_ptr().cast(), length);
    }
}

/// `length` bytes of zeroed memory aligned to `length` (a power of two, a multiple of the page
/// size), mapped readable and writable and backed page by page on first write; `None` if the
/// kernel refused (out of address space, or `RLIMIT_AS`). Never given back.
pub(crate) fn map_aligned(length: usize) -> Option<NonNull<u8>> {
    let span = length.checked_mul(2)?;
    // SAFETY: an anonymous private mapping at an address of the kernel's choice, twice the
    // length, so that an aligned range of `length` lies inside it.
    let address = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if address == libc::MAP_FAILED {
        return None;
    }
    let start = address as usize;
    let aligned = (start + length - 1) & !(length - 1);
    // SAFETY: the parts before and after the aligned range are page-aligned pieces of the
    // mapping just made (`start` and `length` are page multiples), which nothing refers to.
    unsafe {
        if aligned > start {
            libc::munmap(address, aligned - start);
        }
        let end = aligned + length;
        if start + span > end {
            libc::munmap(end as *mut libc::c_void, start + span - end);
        }
    }
    // Huge pages would make a chunk's first touch back 2 MiB at once; the heap's resident
    // size should follow the spans in use.
    // SAFETY: advice on the range just mapped; failure (no THP support) changes nothing.
    unsafe {
        libc::madvise(aligned as *mut libc::c_void, length, libc::MADV_NOHUGEPAGE);
    }
    NonNull::new(aligned as *mut u8)
}

/// Gives the pages of a range back to the system, keeping the range mapped: they read as
/// zero at the next touch, which backs them again.
///
/// # Safety
/// The range is page-aligned, inside a mapping of [`map_aligned`], and holds nothing anyone
/// will read before writing it again.
pub(crate) unsafe fn return_pages(start: NonNull<u8>, length: usize) {
    // SAFETY: the caller's contract: the pages' contents are not needed any more.
    unsafe {
        libc::madvise(start.as_ptr().cast(), length, libc::MADV_DONTNEED);
    }
}

/// Backs the pages of a range now, as first writes would one fault at a time; does nothing
/// where the kernel cannot (before Linux 5.14, `MADV_POPULATE_WRITE`) or has no memory left
/// for them, in which case the first writes fault as before.
///
/// # Safety
/// The range is page-aligned and inside a mapping of [`map_aligned`].
pub(crate) unsafe fn back_pages(start: *mut u8, length: usize) {
    // SAFETY: the caller's contract: a range of a private anonymous read-write mapping, whose
    // contents backing does not change (a page already backed is left as it is, one not yet
    // backed reads as zero either way).
    unsafe {
        libc::madvise(start.cast(), length, libc::MADV_POPULATE_WRITE);
    }
}

/// Milliseconds of the system's coarse monotonic clock (a vDSO read, without a system call,
/// at the resolution of the scheduler's tick), wrapping every 49 days: for ages compared with
/// `wrapping_sub`.
pub(crate) fn coarse_millis() -> u32 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes the clock's value into `now`, a valid timespec; the coarse monotonic
    // clock exists on every kernel thiscpu runs on (2.6.32 and later), and should it fail,
    // `now` stays zero, which ages nothing.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut now) };
    (now.tv_sec as u64)
        .wrapping_mul(1000)
        .wrapping_add(now.tv_nsec as u64 / 1_000_000) as u32
}

/// Registers `before` to run before every `fork`, `parent` after it in the parent and `child`
/// after it in the child.
pub(crate) fn at_fork(before: extern "C" fn(), parent: extern "C" fn(), child: extern "C" fn()) {
    // SAFETY: the handlers are functions of this library. In a library loaded with `dlopen`,
    // glibc unregisters them when it is unloaded (`pthread_atfork` records the caller's
    // object). A failure (ENOMEM) leaves no handler.
    unsafe { libc::pthread_atfork(Some(before), Some(parent), Some(child)) };
}

/// `sysconf(_SC_NPROCESSORS_CONF)`, at least 1.
pub(crate) fn configured_cpus() -> usize {
    // SAFETY: `sysconf` has no precondition.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
    usize::try_from(n).unwrap_or(1).max(1)
}

/// Whether `path` exists, asked with `access`, which is async-signal-safe and allocates
/// nothing: topology lookups may run in signal handlers.
pub(crate) fn path_exists(path: &CStr) -> bool {
    // SAFETY: `path` is a NUL-terminated string that lives across the call; `access` only
    // reads it.
    unsafe { libc::access(path.as_ptr(), libc::F_OK) == 0 }
}

/// A word of the kernel's affinity masks (`unsigned long`).
pub(crate) type AffinityWord = libc::c_ulong;

/// The affinity mask of thread `tid` (0: the calling thread), into `words`.
pub(crate) fn get_affinity(tid: i32, words: &mut [AffinityWord]) -> io::Result<()> {
    // SAFETY: the kernel writes at most `size_of_val(words)` bytes, the length of the buffer
    // it is given, which lives across the call.
    let written = unsafe {
        libc::syscall(
            libc::SYS_sched_getaffinity,
            tid,
            size_of_val(words),
            words.as_mut_ptr(),
        )
    };
    if written >= 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Makes `words` the affinity mask of thread `tid` (0: the calling thread).
pub(crate) fn set_affinity(tid: i32, words: &[AffinityWord]) -> io::Result<()> {
    // SAFETY: the kernel reads `size_of_val(words)` bytes, the length of the buffer, and keeps
    // no reference to it.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_sched_setaffinity,
            tid,
            size_of_val(words),
            words.as_ptr(),
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The ids of the process's threads (`/proc/self/task`), or `None` if they cannot all be read.
pub(crate) fn thread_ids() -> Option<Vec<i32>> {
    std::fs::read_dir("/proc/self/task")
        .ok()?
        .map(|task| task.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// The kernel's thread ids, for `DecidedOnce`.
pub(crate) struct Threads;

impl Claimants for Threads {
    fn me(&self) -> i32 {
        // SAFETY: `gettid` has no precondition.
        unsafe { libc::syscall(libc::SYS_gettid) as i32 }
    }

    fn is_gone(&self, id: i32) -> bool {
        // SAFETY: signal 0 only checks that the thread exists in this thread group; nothing
        // is delivered.
        let ret = unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), id, 0) };
        ret != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    }

    fn pause(&self) {
        std::thread::yield_now();
    }
}
