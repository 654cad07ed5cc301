//! Dense per-CPU memory: a stride allocator, as the kernel's percpu allocator and librseq's
//! mempool lay per-CPU data out.
//!
//! Address space is reserved in *ranges*. A range holds one *row* of [`STRIDE`] bytes per
//! possible CPU, plus one spare row, back to back: row `r` starts at `base + r * STRIDE`. A slot
//! is an offset inside a row, the same offset in every row, so the copy of slot `s` for CPU `c`
//! lives at `s + c * STRIDE`. One CPU's slots sit side by side (a `u64` counter costs 8 bytes per
//! CPU), yet two CPUs never share a cache line, since their rows are `STRIDE` apart. Rows are
//! reserved, not committed: the pages of a CPU that never touches its slots stay unbacked.
//!
//! The spare row (index `possible_cpus()`) holds, per slot, whatever the slot's owner keeps
//! outside the per-CPU rows; `Counter` keeps there the word that threads without rseq add to.
//!
//! # Safety
//! Maps memory with `mmap` and hands out raw addresses inside it; each block states why it holds.

use crate::arch::{self, hot};
use crate::topology;
use core::cell::UnsafeCell;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Bytes between the rows of two consecutive CPUs. 64 KiB: a range holds 8192 `u64` slots per
/// CPU; the address space a range reserves (64 KiB per possible CPU) is never backed for CPUs
/// that do not run the program, and at most one partly used range exists at a time.
pub const STRIDE: usize = 64 * 1024;

/// log2 of [`STRIDE`], so that a row's address is a shift and an add.
pub(crate) const STRIDE_SHIFT: u32 = STRIDE.trailing_zeros();
const _: () = assert!(1 << STRIDE_SHIFT == STRIDE);

/// Largest alignment a slot may ask for: one page keeps every row aligned alike.
pub const MAX_ALIGN: usize = 4096;
// Every row starts at a multiple of `STRIDE` from a range that the system aligns this much.
const _: () = assert!(MAX_ALIGN <= crate::os::RESERVED_ALIGN && STRIDE.is_multiple_of(MAX_ALIGN));

/// Rows for CPUs (the number of possible CPUs). Set once, before the first slot is handed out,
/// and never changed; 0 until then, so an index check against it is always conservative. A CPU
/// index below it addresses an existing row. Kept in a hot word, which a counter's fast path
/// reads with one load.
#[inline(always)]
pub(crate) fn cpu_rows() -> u32 {
    arch::hot_word::<{ hot::ROWS }>()
}

struct Range {
    base: NonNull<u8>,
    used: usize,
}

// SAFETY: a range is an address range; which thread holds its record does not matter.
unsafe impl Send for Range {}

struct Arena {
    ranges: Vec<Range>,
    /// Freed slots by (size, align), reused first.
    free: HashMap<(usize, usize), Vec<NonNull<u8>>>,
    rows: usize,
}

// SAFETY: as for `Range`.
unsafe impl Send for Arena {}

/// The arena behind a lock that `fork` handlers take and give back: a `std` mutex that another
/// thread holds when the process forks stays locked for ever in the child, whose next
/// `Counter::new` or `RwLock::new` would then hang. The handlers are those of
/// `pthread_atfork`: before the fork the forking thread takes the lock (so the arena is whole
/// in the child), and after it both processes release it. The lock is held only to hand out
/// or take back a slot (an `mmap` at most), so waiters spin, then yield, then sleep.
struct ArenaLock {
    held: AtomicBool,
    arena: UnsafeCell<Option<Arena>>,
}

// SAFETY: the arena is reached only through `ArenaGuard`, which the `held` flag makes
// exclusive; `Arena` is `Send`.
unsafe impl Sync for ArenaLock {}

impl ArenaLock {
    fn lock(&self) -> ArenaGuard<'_> {
        let mut round = 0u32;
        while self
            .held
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            match round {
                0..64 => core::hint::spin_loop(),
                64..128 => std::thread::yield_now(),
                _ => std::thread::sleep(std::time::Duration::from_micros(50)),
            }
            round = round.saturating_add(1);
        }
        ArenaGuard { lock: self }
    }

    /// Releases the lock that a guard forgotten by [`before_fork`] still holds.
    fn unlock(&self) {
        self.held.store(false, Ordering::Release);
    }
}

struct ArenaGuard<'a> {
    lock: &'a ArenaLock,
}

impl core::ops::Deref for ArenaGuard<'_> {
    type Target = Option<Arena>;
    fn deref(&self) -> &Option<Arena> {
        // SAFETY: the guard holds the lock.
        unsafe { &*self.lock.arena.get() }
    }
}

impl core::ops::DerefMut for ArenaGuard<'_> {
    fn deref_mut(&mut self) -> &mut Option<Arena> {
        // SAFETY: the guard holds the lock, and `&mut self` makes this borrow the only one.
        unsafe { &mut *self.lock.arena.get() }
    }
}

impl Drop for ArenaGuard<'_> {
    fn drop(&mut self) {
        self.lock.unlock();
    }
}

static ARENA: ArenaLock = ArenaLock {
    held: AtomicBool::new(false),
    arena: UnsafeCell::new(None),
};

/// Registers the `fork` handlers, once, before the arena is first used.
static FORK_HANDLERS: Once = Once::new();

extern "C" fn before_fork() {
    core::mem::forget(ARENA.lock());
}

extern "C" fn after_fork() {
    ARENA.unlock();
}

fn register_fork_handlers() {
    FORK_HANDLERS.call_once(|| {
        // The handlers take the arena's lock and release it. Where registering fails (ENOMEM),
        // a child forked while another thread holds the lock hangs on it.
        crate::os::at_fork(before_fork, after_fork, after_fork);
    });
}
static SLOTS_IN_USE: AtomicUsize = AtomicUsize::new(0);
static BYTES_IN_USE: AtomicUsize = AtomicUsize::new(0);

/// What the dense allocator holds right now.
///
/// With the `serde` feature: `Serialize` and `Deserialize`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct DenseStats {
    /// Ranges reserved so far.
    pub ranges: usize,
    /// Address space reserved, all rows of all ranges, in bytes.
    pub reserved_bytes: usize,
    /// Slots handed out and not freed.
    pub slots: usize,
    /// Bytes those slots use in one row.
    pub bytes_per_row: usize,
    /// Rows per range: possible CPUs plus the spare row.
    pub rows: usize,
}

/// The allocator's current holdings.
///
/// ```
/// let counter = thiscpu::Counter::new();
/// let stats = thiscpu::dense::stats();
/// assert!(stats.slots >= 1 && stats.reserved_bytes >= stats.rows * thiscpu::dense::STRIDE);
/// drop(counter);
/// ```
pub fn stats() -> DenseStats {
    let arena = ARENA.lock();
    let (ranges, rows) = arena
        .as_ref()
        .map_or((0, 0), |arena| (arena.ranges.len(), arena.rows));
    DenseStats {
        ranges,
        reserved_bytes: ranges * rows * STRIDE,
        slots: SLOTS_IN_USE.load(Ordering::Relaxed),
        bytes_per_row: BYTES_IN_USE.load(Ordering::Relaxed),
        rows,
    }
}

fn reserve_range(rows: usize) -> NonNull<u8> {
    let length = rows * STRIDE;
    crate::os::reserve_zeroed(length).unwrap_or_else(|| {
        std::alloc::handle_alloc_error(
            std::alloc::Layout::from_size_align(length, MAX_ALIGN).expect("range layout"),
        )
    })
}

/// A slot: `size` bytes at the same offset in every row, zero in every row when handed out.
/// Freed with [`free`].
///
/// Panics if `size` is 0 or above [`STRIDE`], or `align` is not a power of two up to
/// [`MAX_ALIGN`].
pub(crate) fn alloc(size: usize, align: usize) -> NonNull<u8> {
    assert!(size > 0 && size <= STRIDE, "slot size {size} out of range");
    assert!(
        align.is_power_of_two() && align <= MAX_ALIGN,
        "slot alignment {align} not supported"
    );
    let size = size.next_multiple_of(align);
    register_fork_handlers();
    let mut guard = ARENA.lock();
    let arena = guard.get_or_insert_with(|| {
        let cpus = topology::possible_cpus();
        arch::set_hot_word::<{ hot::ROWS }>(cpus as u32);
        Arena {
            ranges: Vec::new(),
            free: HashMap::new(),
            rows: cpus + 1,
        }
    });
    SLOTS_IN_USE.fetch_add(1, Ordering::Relaxed);
    BYTES_IN_USE.fetch_add(size, Ordering::Relaxed);
    if let Some(slot) = arena.free.get_mut(&(size, align)).and_then(Vec::pop) {
        return slot;
    }
    let fits = |range: &Range| range.used.next_multiple_of(align) + size <= STRIDE;
    if !arena.ranges.last().is_some_and(fits) {
        let base = reserve_range(arena.rows);
        arena.ranges.push(Range { base, used: 0 });
    }
    let range = arena.ranges.last_mut().expect("a range was just ensured");
    let offset = range.used.next_multiple_of(align);
    range.used = offset + size;
    // SAFETY: `offset + size <= STRIDE`, inside row 0 of the range.
    unsafe { range.base.add(offset) }
}

/// Address of row `row`'s copy of `slot`.
///
/// # Safety
/// `slot` came from [`alloc`] and `row <= cpu_rows()` (the spare row is `cpu_rows()`).
#[inline(always)]
pub(crate) unsafe fn row(slot: NonNull<u8>, row: u32) -> *mut u8 {
    // SAFETY: the range holds `cpu_rows() + 1` rows of STRIDE bytes.
    unsafe { slot.as_ptr().add((row as usize) << STRIDE_SHIFT) }
}

/// Returns a slot for reuse, after zeroing it in every row where it is not already zero (rows
/// never written stay untouched, so freeing does not back pages of CPUs that never ran).
///
/// # Safety
/// `slot` came from [`alloc`] with the same `size` and `align`, is not freed twice, and nothing
/// reads or writes any of its rows during or after this call (in particular, no restartable
/// sequence addressed at it can still commit).
pub(crate) unsafe fn free(slot: NonNull<u8>, size: usize, align: usize) {
    let size = size.next_multiple_of(align);
    for r in 0..=cpu_rows() {
        // SAFETY: the caller owns every row of the slot now.
        let bytes = unsafe { core::slice::from_raw_parts_mut(row(slot, r), size) };
        if bytes.iter().any(|&byte| byte != 0) {
            bytes.fill(0);
        }
    }
    let mut guard = ARENA.lock();
    let arena = guard
        .as_mut()
        .expect("a slot was allocated, so the arena exists");
    arena.free.entry((size, align)).or_default().push(slot);
    SLOTS_IN_USE.fetch_sub(1, Ordering::Relaxed);
    BYTES_IN_USE.fetch_sub(size, Ordering::Relaxed);
}

// The test forks, which is Unix's.
#[cfg(all(test, unix))]
mod tests {
    use super::{ARENA, alloc, free};
    use std::sync::Barrier;
    use std::time::{Duration, Instant};

    #[test]
    fn a_fork_while_another_thread_holds_the_arena_leaves_the_child_able_to_allocate() {
        // SAFETY: freed once, with the size and alignment it was allocated with; unused.
        unsafe { free(alloc(8, 8), 8, 8) };
        let held = Barrier::new(2);
        let status = std::thread::scope(|s| {
            s.spawn(|| {
                let _holding = ARENA.lock();
                held.wait();
                std::thread::sleep(Duration::from_millis(100));
            });
            held.wait();
            // SAFETY: the child only allocates and frees a slot (glibc's allocator is usable
            // after fork) and leaves with `_exit`.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
            if pid == 0 {
                let slot = alloc(8, 8);
                // SAFETY: as above.
                unsafe { free(slot, 8, 8) };
                // SAFETY: ends the child without running the parent's exit handlers.
                unsafe { libc::_exit(0) };
            }
            let began = Instant::now();
            loop {
                let mut status = 0;
                // SAFETY: polls the child just forked, writing its status into a local.
                let waited = unsafe { libc::waitpid(pid, &raw mut status, libc::WNOHANG) };
                if waited == pid {
                    break Some(status);
                }
                if began.elapsed() > Duration::from_secs(5) {
                    // SAFETY: kills and reaps the child this test made.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                        libc::waitpid(pid, core::ptr::null_mut(), 0);
                    }
                    break None;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        let status = status.expect("the child hung on the arena's lock");
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    }
}
