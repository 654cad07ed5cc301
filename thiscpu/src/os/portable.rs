//! The services on systems other than Linux, from the standard library where it has them.
//!
//! - Sleeping on a word: a `Mutex` and `Condvar` per bucket of addresses, in place of `futex`.
//! - No fences (`membarrier` is Linux's), so the types that need them keep their atomic modes.
//! - Zeroed address space, for the dense arena and the allocator's caches: `mmap` on Unix
//!   (anonymous private pages are backed on first write there too), a zeroed heap allocation
//!   elsewhere.
//! - No pinning and no affinity masks: `topology::pin_to` and `allowed_cpus` return an error
//!   of kind `Unsupported`.
//! - Thread ids for `DecidedOnce` are numbers given in the order threads ask.
//!
//! # Safety
//! `mmap`, `munmap` and `pthread_atfork` on Unix, `alloc_zeroed` and `dealloc` elsewhere; each
//! block states why it holds.

use crate::decided_once::Claimants;
use core::ffi::CStr;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::io;
use std::sync::{Condvar, Mutex, PoisonError};

/// No `getcpu` system call outside Linux.
pub(crate) fn getcpu_syscall() -> Option<(u32, u32)> {
    None
}

/// No vDSO outside Linux.
pub(crate) fn vdso_getcpu() -> Option<(u32, u32)> {
    None
}

/// Where the sleepers on a word wait: its address picks one of these, so that unrelated
/// words rarely share one (a shared bucket only costs spurious wake-ups).
struct Bucket {
    lock: Mutex<()>,
    woken: Condvar,
}

const BUCKETS: usize = 64;

static SLEEPERS: [Bucket; BUCKETS] = [const {
    Bucket {
        lock: Mutex::new(()),
        woken: Condvar::new(),
    }
}; BUCKETS];

fn bucket(word: &AtomicU32) -> &'static Bucket {
    // The words are 4-byte aligned: drop the bits that are always zero.
    &SLEEPERS[(word.as_ptr() as usize >> 2) % BUCKETS]
}

/// Sleeps while `word` holds `expected`; spurious returns happen, as with `futex`.
///
/// No wake-up is lost: a waker changes the word and then calls `wake`, which takes the
/// bucket's lock before it notifies. The sleeper compares the word while holding that lock
/// and releases it only inside `Condvar::wait`, atomically with starting to wait. So either
/// the comparison sees the new value (and it does not sleep), or it saw the old one before
/// the waker took the lock, and then it is already waiting when the notification comes.
pub(crate) fn wait(word: &AtomicU32, expected: u32) {
    let bucket = bucket(word);
    let guard = bucket.lock.lock().unwrap_or_else(PoisonError::into_inner);
    if word.load(Ordering::SeqCst) == expected {
        // A wake-up for another word of the bucket returns early: a spurious return.
        drop(
            bucket
                .woken
                .wait(guard)
                .unwrap_or_else(PoisonError::into_inner),
        );
    }
}

/// As [`wait`], for at most about `timeout`; the same argument keeps wake-ups from being lost.
pub(crate) fn wait_timeout(word: &AtomicU32, expected: u32, timeout: core::time::Duration) {
    let bucket = bucket(word);
    let guard = bucket.lock.lock().unwrap_or_else(PoisonError::into_inner);
    if word.load(Ordering::SeqCst) == expected {
        drop(
            bucket
                .woken
                .wait_timeout(guard, timeout)
                .unwrap_or_else(PoisonError::into_inner),
        );
    }
}

/// Wakes the threads sleeping on `word`: all sleepers of its bucket, since the bucket does not
/// tell words apart (each one that was not meant checks its word and sleeps again).
pub(crate) fn wake(word: &AtomicU32, _count: i32) {
    let bucket = bucket(word);
    drop(bucket.lock.lock().unwrap_or_else(PoisonError::into_inner));
    bucket.woken.notify_all();
}

/// No `membarrier` outside Linux: `ENOSYS`.
pub(crate) fn membarrier(_cmd: i32, _flags: u32, _cpu: i32) -> Result<(), i32> {
    Err(libc::ENOSYS)
}

/// `length` bytes of zeroed memory for the dense arena, aligned to a page
/// (`RESERVED_ALIGN`). On Unix an anonymous mapping, whose pages are backed on
/// first write; elsewhere a zeroed allocation from the global allocator (on Windows,
/// `HeapAlloc`, which takes large blocks from `VirtualAlloc`: zero pages backed on first
/// touch, though committed). [`unreserve`] gives it back (the arena never does: it keeps its
/// ranges for the process's life).
pub(crate) fn reserve_zeroed(length: usize) -> Option<NonNull<u8>> {
    #[cfg(unix)]
    {
        // SAFETY: an anonymous private mapping at an address of the system's choice; its
        // pages read as zero until written.
        let address = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                length,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANON,
                -1,
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return None;
        }
        NonNull::new(address.cast())
    }
    #[cfg(not(unix))]
    {
        let layout = std::alloc::Layout::from_size_align(length, super::RESERVED_ALIGN).ok()?;
        if layout.size() == 0 {
            return None;
        }
        // SAFETY: the layout's size is not zero (checked above).
        NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })
    }
}

/// Gives back a range that [`reserve_zeroed`] returned: unmaps it on Unix, frees it to the
/// global allocator elsewhere.
///
/// # Safety
/// `start` and `length` are a range from [`reserve_zeroed`] and its length, given back once;
/// nothing reads or writes the range after this call.
pub(crate) unsafe fn unreserve(start: NonNull<u8>, length: usize) {
    #[cfg(unix)]
    {
        // SAFETY: the range is a whole mapping made by `reserve_zeroed` (the caller's
        // contract), which nothing uses any more.
        unsafe {
            libc::munmap(start.as_ptr().cast(), length);
        }
    }
    #[cfg(not(unix))]
    {
        // `reserve_zeroed` made this layout from the same length without failing.
        let layout = std::alloc::Layout::from_size_align(length, super::RESERVED_ALIGN)
            .expect("the layout of a reserved range");
        // SAFETY: allocated by the global allocator with this very layout (the caller's
        // contract: a range of `reserve_zeroed` with its length), freed once, unused after.
        unsafe { std::alloc::dealloc(start.as_ptr(), layout) };
    }
}

/// Aligned chunks for the allocator's own heap, which runs only where restartable sequences
/// do (Linux): none here, so the heap never starts and the inner allocator serves everything.
pub(crate) fn map_aligned(_length: usize) -> Option<NonNull<u8>> {
    None
}

/// A clock for the own heap's ages, which never runs here ([`map_aligned`] maps nothing).
pub(crate) fn coarse_millis() -> u32 {
    0
}

/// Nothing to give back: [`map_aligned`] maps nothing here.
///
/// # Safety
/// None needed; the signature matches the Linux backend's.
pub(crate) unsafe fn return_pages(_start: NonNull<u8>, _length: usize) {}

/// Nothing to back: [`map_aligned`] maps nothing here.
///
/// # Safety
/// None needed; the signature matches the Linux backend's.
pub(crate) unsafe fn back_pages(_start: *mut u8, _length: usize) {}

/// Registers `before` to run before every `fork`, `parent` after it in the parent and `child`
/// after it in the child, where the system forks (Unix); elsewhere there is no `fork` to guard
/// against.
pub(crate) fn at_fork(before: extern "C" fn(), parent: extern "C" fn(), child: extern "C" fn()) {
    #[cfg(unix)]
    {
        // SAFETY: the handlers are functions of this library that take a lock and release it,
        // or count a fork. A failure (ENOMEM) leaves no handler.
        unsafe { libc::pthread_atfork(Some(before), Some(parent), Some(child)) };
    }
    #[cfg(not(unix))]
    {
        let _ = (before, parent, child);
    }
}

/// The CPUs the system has: the largest of what the standard library reports for this
/// process (`available_parallelism`) and, where the system says, the processors it has
/// configured, so that every CPU number the system gives is below it.
pub(crate) fn configured_cpus() -> usize {
    let available = std::thread::available_parallelism().map_or(1, usize::from);
    let configured = {
        #[cfg(all(unix, not(target_os = "wasi")))]
        {
            // SAFETY: `sysconf` has no precondition.
            usize::try_from(unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) }).unwrap_or(0)
        }
        #[cfg(windows)]
        {
            use windows_sys::Win32::System::Threading::{
                ALL_PROCESSOR_GROUPS, GetActiveProcessorCount,
            };
            // SAFETY: no precondition.
            unsafe { GetActiveProcessorCount(ALL_PROCESSOR_GROUPS) as usize }
        }
        #[cfg(not(any(all(unix, not(target_os = "wasi")), windows)))]
        {
            0
        }
    };
    available.max(configured).max(1)
}

/// Whether `path` exists. Only `/sys` paths are asked, which exist on Linux alone.
pub(crate) fn path_exists(path: &CStr) -> bool {
    path.to_str()
        .is_ok_and(|path| std::path::Path::new(path).exists())
}

/// A word of an affinity mask, as on Linux: masks are never read or written here.
pub(crate) type AffinityWord = u64;

fn no_affinity() -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        "CPU affinity is only supported on Linux",
    )
}

/// Affinity masks are not offered outside Linux.
pub(crate) fn get_affinity(_tid: i32, _words: &mut [AffinityWord]) -> io::Result<()> {
    Err(no_affinity())
}

/// Affinity masks are not offered outside Linux.
pub(crate) fn set_affinity(_tid: i32, _words: &[AffinityWord]) -> io::Result<()> {
    Err(no_affinity())
}

/// The process's threads cannot be listed: callers assume any thread may run anywhere.
pub(crate) fn thread_ids() -> Option<Vec<i32>> {
    None
}

/// The next thread number (from 1); the first number given in this process (numbers given
/// before a `fork` belong to threads that exist only in the parent); the process that last
/// asked, to notice a `fork`.
static NEXT_THREAD: AtomicI32 = AtomicI32::new(1);
static FIRST_OF_PROCESS: AtomicI32 = AtomicI32::new(1);
static LAST_PROCESS: AtomicU32 = AtomicU32::new(0);

thread_local! {
    /// The calling thread's number and the process it was given in (0: not given yet).
    static NUMBER: core::cell::Cell<(i32, u32)> = const { core::cell::Cell::new((0, 0)) };
}

/// The process id, where processes can `fork`; elsewhere the one process never changes.
fn process_id() -> u32 {
    #[cfg(unix)]
    {
        // SAFETY: no precondition.
        (unsafe { libc::getpid() }) as u32
    }
    #[cfg(not(unix))]
    {
        std::process::id()
    }
}

/// Thread numbers for `DecidedOnce`, given in the order threads ask. A claimant can vanish
/// only with a `fork` (its thread stays in the parent; a decision that unwinds hands its claim
/// back), so a claimant is gone exactly when it was numbered in another process. Every call
/// compares the process id with the one last seen: the first thread of a child to ask marks
/// every number given so far as the parent's, and takes a new one.
pub(crate) struct Threads;

impl Claimants for Threads {
    fn me(&self) -> i32 {
        // Sequentially consistent, so that the boundary is read before any child thread that
        // sees the child's id (after the swap) takes a number: every parent's number is below
        // it, and no child's is.
        let pid = process_id();
        let boundary = NEXT_THREAD.load(Ordering::SeqCst);
        let seen = LAST_PROCESS.swap(pid, Ordering::SeqCst);
        if seen != 0 && seen != pid {
            FIRST_OF_PROCESS.fetch_max(boundary, Ordering::SeqCst);
        }
        let number = NUMBER.try_with(|cell| {
            let (number, of) = cell.get();
            if number > 0 && of == pid {
                return number;
            }
            let number = NEXT_THREAD.fetch_add(1, Ordering::SeqCst);
            cell.set((number, pid));
            number
        });
        // A thread being torn down: a number no other thread holds.
        number.unwrap_or_else(|_| NEXT_THREAD.fetch_add(1, Ordering::SeqCst))
    }

    fn is_gone(&self, id: i32) -> bool {
        // Asking `me` first notices a `fork` that nobody in this process noticed yet.
        let _ = self.me();
        id < FIRST_OF_PROCESS.load(Ordering::SeqCst)
    }

    fn pause(&self) {
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    /// A sleeper is woken by a change it has not seen yet, however the two race.
    #[test]
    fn no_wake_up_is_lost() {
        for _ in 0..200 {
            let word = Arc::new(AtomicU32::new(0));
            let done = Arc::new(AtomicBool::new(false));
            let sleeper = {
                let (word, done) = (word.clone(), done.clone());
                std::thread::spawn(move || {
                    while word.load(Ordering::SeqCst) == 0 {
                        wait(&word, 0);
                    }
                    done.store(true, Ordering::SeqCst);
                })
            };
            word.store(1, Ordering::SeqCst);
            wake(&word, 1);
            sleeper.join().unwrap();
            assert!(done.load(Ordering::SeqCst));
        }
    }

    #[test]
    fn a_changed_word_does_not_sleep() {
        let word = AtomicU32::new(5);
        wait(&word, 4);
    }

    #[test]
    fn the_arena_memory_reads_zero() {
        let length = 3 * 64 * 1024;
        let range = reserve_zeroed(length).unwrap();
        assert_eq!(range.as_ptr() as usize % crate::os::RESERVED_ALIGN, 0);
        // SAFETY: `length` bytes were just reserved, readable and writable.
        let bytes = unsafe { core::slice::from_raw_parts_mut(range.as_ptr(), length) };
        assert!(bytes.iter().all(|&byte| byte == 0));
        bytes[length - 1] = 1;
        // SAFETY: reserved above with this length; `bytes` is not used after this.
        unsafe { unreserve(range, length) };
    }

    #[test]
    fn threads_have_distinct_numbers_and_none_is_gone() {
        let mine = Threads.me();
        assert_eq!(Threads.me(), mine);
        let theirs = std::thread::spawn(|| Threads.me()).join().unwrap();
        assert_ne!(theirs, mine);
        assert!(!Threads.is_gone(mine) && !Threads.is_gone(theirs));
    }

    #[test]
    fn there_are_no_fences_and_no_pinning() {
        assert_eq!(membarrier(0, 0, 0), Err(libc::ENOSYS));
        let mut words = [0; 1];
        assert_eq!(
            get_affinity(0, &mut words).unwrap_err().kind(),
            io::ErrorKind::Unsupported
        );
        assert!(configured_cpus() >= 1);
    }
}
