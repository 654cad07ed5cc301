//! The raw restartable operations on per-CPU data: each runs as one restartable sequence on the
//! calling thread's current CPU (or concurrency id) and either commits with a single store,
//! leaves early because a comparison failed, or is aborted by the kernel (preemption,
//! migration, signal, membarrier). No `lock`-prefixed instruction is involved.
//!
//! Each operation is named after its steps, as librseq names them:
//! - `load_add_store`: load `*v`, add, store (the store commits).
//! - `load_cbne_store`: load `*v`, compare-and-branch if not equal to `expect` (leave:
//!   [`Outcome::Mismatch`]), store `newv`.
//! - `load_cbeq_load_store`: load the list head, compare-and-branch if equal to null (leave:
//!   `Mismatch`), load the head's `next`, store it into the head: a pop.
//! - `list_push`: store the head into the node's `next` outside the section, then
//!   `load_cbne_store` the head from that value to the node.
//!
//! A [`Position`] is read before the operation: the CPU (or `mm_cid`) this thread is on and the
//! area it was read from. The section compares it again at its start, so an operation can only
//! commit on the CPU whose data the caller addressed.
//!
//! # Safety
//! The operations are `unsafe fn`s whose `# Safety` sections state the contract; the safe
//! types (`Counter`, the pool) uphold it by construction.

use crate::abi::offset;
use crate::arch::{self, StackHead, StackOutcome};
use crate::registration;
use core::marker::PhantomData;
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

pub use crate::arch::Outcome;

/// Sections indexed by CPU compare the area's `cpu_id`.
pub const BY_CPU: usize = offset::CPU_ID;
/// Sections indexed by memory-map concurrency id compare the area's `mm_cid`.
pub const BY_MM_CID: usize = offset::MM_CID;

/// Where the calling thread is, read from its rseq area just before an operation: the CPU (or
/// `mm_cid`, by `FIELD`) and the area the section must check it against.
///
/// A position names the calling thread's own area, so it is neither `Send` nor `Sync`:
///
/// ```compile_fail
/// fn send<T: Send>(_: T) {}
/// send(thiscpu::ops::position());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position<const FIELD: usize = BY_CPU> {
    offset: arch::AreaOffset,
    index: u32,
    this_thread_only: PhantomData<*const ()>,
}

impl<const FIELD: usize> Position<FIELD> {
    #[inline(always)]
    fn new(offset: arch::AreaOffset, index: u32) -> Self {
        Position {
            offset,
            index,
            this_thread_only: PhantomData,
        }
    }

    /// The CPU (or concurrency id) to address data for.
    #[inline]
    pub fn index(self) -> u32 {
        self.index
    }

    /// Whether the area was registered when read (its `cpu_id` not negative).
    #[inline(always)]
    fn registered(self) -> bool {
        (self.index as i32) >= 0
    }
}

/// The calling thread's CPU, for an operation to follow, or `None` if this thread has no
/// registered rseq area (rseq unavailable or turned off: use a fallback).
///
/// ```
/// if let Some(position) = thiscpu::ops::position() {
///     assert!((position.index() as usize) < thiscpu::topology::possible_cpus());
/// }
/// ```
#[inline]
pub fn position() -> Option<Position<BY_CPU>> {
    let at = position_as_is::<BY_CPU>();
    if at.registered() {
        return Some(at);
    }
    position_slow()
}

#[cold]
#[inline(never)]
fn position_slow() -> Option<Position<BY_CPU>> {
    if registration::NO_RSEQ.load(core::sync::atomic::Ordering::Relaxed)
        || !registration::ensure_registered()
    {
        return None;
    }
    let at = position_as_is::<BY_CPU>();
    at.registered().then_some(at)
}

/// The position by `FIELD` as the calling thread's area shows it now, for the fast paths of
/// the safe types, which check the index themselves: nothing is registered, and an
/// unregistered area (`cpu_id` -1 or -2) shows as an index of at least 2^31, beyond every
/// table, so that one unsigned comparison rejects it together with indexes beyond the rows.
/// Run an operation at it only after such a comparison.
#[inline(always)]
pub(crate) fn position_as_is<const FIELD: usize>() -> Position<FIELD> {
    let offset = arch::area_offset();
    let cpu = arch::field_at::<BY_CPU>(offset);
    let index = if FIELD == BY_CPU || cpu < 0 {
        cpu
    } else {
        arch::field_at::<FIELD>(offset)
    };
    Position::new(offset, index as u32)
}

/// The calling thread's position by `FIELD`, registering it if needed: [`position`], or
/// [`mm_cid_position`], read from one load of the area offset.
#[inline]
pub(crate) fn position_by<const FIELD: usize>() -> Option<Position<FIELD>> {
    let cpu = position()?;
    if FIELD == BY_CPU {
        return Some(Position::new(cpu.offset, cpu.index));
    }
    if !crate::cpu::mm_cid_usable() {
        return None;
    }
    let index = arch::field_at::<FIELD>(cpu.offset);
    Some(Position::new(cpu.offset, index as u32))
}

/// The calling thread's `mm_cid`, for an operation indexed by concurrency id, or `None` where
/// the kernel does not provide it (before Linux 6.3) or the thread has no registered area.
///
/// ```
/// if let Some(position) = thiscpu::ops::mm_cid_position() {
///     assert!((position.index() as usize) < thiscpu::topology::possible_cpus());
/// }
/// ```
#[inline]
pub fn mm_cid_position() -> Option<Position<BY_MM_CID>> {
    position_by::<BY_MM_CID>()
}

/// Adds `count` to `*v` on the position's CPU: load, add, store, with the store committing.
///
/// # Safety
/// - `at` was read by the calling thread (the type keeps a position in the thread that read it).
/// - `v` is valid for reads and writes of a `u64` (8-byte aligned) for the whole call.
/// - `v` is the word for `at.index()`: every write to it is made by an operation whose position
///   has the same index and field (so that only one CPU ever runs a committing section on it),
///   or happens after a fence that guarantees no such operation is in flight. Other threads may
///   read it concurrently with atomic loads.
///
/// ```
/// use core::sync::atomic::{AtomicU64, Ordering};
/// use thiscpu::ops::{self, Outcome};
///
/// let slots: Vec<AtomicU64> = (0..thiscpu::topology::possible_cpus()).map(|_| AtomicU64::new(0)).collect();
/// loop {
///     let Some(at) = ops::position() else { break };
///     let slot = &slots[at.index() as usize];
///     // SAFETY: `slot` belongs to `at.index()` and is written only by sections on that CPU.
///     match unsafe { ops::load_add_store(at, slot.as_ptr(), 1) } {
///         Outcome::Committed(()) => break,
///         _ => continue,
///     }
/// }
/// ```
#[inline]
pub unsafe fn load_add_store<const FIELD: usize>(
    at: Position<FIELD>,
    v: *mut u64,
    count: u64,
) -> Outcome {
    // SAFETY: forwarded contract.
    unsafe { arch::load_add_store::<FIELD>(at.offset, at.index, v, count) }
}

/// Stores `newv` into `*v` if `*v` still holds `expect`, on the position's CPU.
///
/// # Safety
/// As for [`load_add_store`], except that other threads may also write `*v` atomically at any
/// time `*v` differs from `expect` (no section can commit then): a lock word, whose holder
/// releases it from any CPU, is such a word ([`crate::Sharded`]).
#[inline]
pub unsafe fn load_cbne_store<const FIELD: usize>(
    at: Position<FIELD>,
    v: *mut u64,
    expect: u64,
    newv: u64,
) -> Outcome {
    // SAFETY: forwarded contract.
    unsafe { arch::load_cbne_store::<FIELD>(at.offset, at.index, v, expect, newv) }
}

/// Pops the first node of the position's singly linked list at `head`, whose nodes keep their
/// `next` pointer at byte offset `NEXT`. `Mismatch` means the list was empty.
///
/// No ABA problem: nothing else can change this CPU's head between the load and the commit
/// without aborting the section.
///
/// # Safety
/// As for [`load_add_store`], for the pointer at `head`; moreover every non-null pointer stored
/// at `head` (and in the `next` field of every node reachable from it) points to a live node
/// whose `next` field at byte offset `NEXT` is readable until it is popped.
#[inline]
pub unsafe fn load_cbeq_load_store<T, const FIELD: usize, const NEXT: usize>(
    at: Position<FIELD>,
    head: *mut *mut T,
) -> Outcome<*mut T> {
    let mut node = 0usize;
    // SAFETY: forwarded contract; `node` is a local the section may write.
    let outcome = unsafe {
        arch::load_cbeq_load_store::<FIELD, NEXT>(at.offset, at.index, head.cast(), &mut node)
    };
    match outcome {
        Outcome::Committed(()) => Outcome::Committed(node as *mut T),
        Outcome::Mismatch => Outcome::Mismatch,
        Outcome::Aborted => Outcome::Aborted,
    }
}

/// Pushes `node` onto the position's list at `head`: writes the current head into the node's
/// `next` field (at `next`), then commits `*head = node` if the head did not change meanwhile.
/// `Mismatch` means the head changed (another thread pushed or popped on this CPU): retry.
///
/// # Safety
/// As for [`load_cbeq_load_store`]; moreover `node` is exclusively owned by the caller until
/// the push commits, and `next` is its `next` field.
#[inline]
pub unsafe fn list_push<T, const FIELD: usize>(
    at: Position<FIELD>,
    head: *mut *mut T,
    node: *mut T,
    next: *mut *mut T,
) -> Outcome {
    // SAFETY: `head` is valid and aligned (contract); other CPUs may write it only under a
    // fence, so an atomic load never races a plain store.
    let current = unsafe { AtomicUsize::from_ptr(head.cast()) }.load(Ordering::Relaxed);
    // SAFETY: the caller owns `node`, so nobody else reads or writes its `next` field yet.
    unsafe { next.write(current as *mut T) };
    // SAFETY: forwarded contract; the head is a pointer-sized word, 8 bytes on 64-bit targets.
    unsafe { load_cbne_store(at, head.cast(), current as u64, node as u64) }
}

/// Guarded push onto the position's stack: `if head.stopped != 0 leave(Stopped); n =
/// head.count; if n >= capacity leave(Refused); slots[n] = item; commit head.count = n + 1`.
/// The pool's per-CPU caches; `arch` documents the ordering of each step.
///
/// # Safety
/// `head` and `slots` (valid for `capacity` pointer-sized words) are the stack of
/// `at.index()`, whose `count` and slots only operations positioned on that index write, or a
/// drainer after a fence of that CPU while `stopped` is set.
#[inline(always)]
pub(crate) unsafe fn stack_push<const FIELD: usize>(
    at: Position<FIELD>,
    head: *const StackHead,
    slots: *mut usize,
    capacity: u64,
    item: usize,
) -> StackOutcome {
    // SAFETY: forwarded contract; a position was read by the thread that holds it.
    unsafe { arch::stack_push::<FIELD>(at.offset, at.index, head, slots, capacity, item) }
}

/// Guarded pop from the position's stack: `if head.stopped != 0 leave(Stopped); n =
/// head.count; if n == 0 leave(Refused); *out = slots[n - 1]; commit head.count = n - 1`.
///
/// # Safety
/// As for [`stack_push`]; `out` is valid for a pointer-sized write (read only after a commit).
#[inline(always)]
pub(crate) unsafe fn stack_pop<const FIELD: usize>(
    at: Position<FIELD>,
    head: *const StackHead,
    slots: *const usize,
    out: *mut usize,
) -> StackOutcome {
    // SAFETY: forwarded contract.
    unsafe { arch::stack_pop::<FIELD>(at.offset, at.index, head, slots, out) }
}

static ABORTS: AtomicU64 = AtomicU64::new(0);
static ABORT_FALLBACKS: AtomicU64 = AtomicU64::new(0);

/// Records one aborted operation of thiscpu's safe types (called on the abort path only).
#[cold]
#[inline(never)]
pub(crate) fn note_abort() {
    ABORTS.fetch_add(1, Ordering::Relaxed);
}

/// Consecutive aborts after which one call of thiscpu's safe types stops retrying its
/// restartable sequence and takes its fallback path (an atomic update, a lock, a system call).
///
/// Aborts come from preemption, migration and signals, and a retry normally commits. Only a
/// thread that is interrupted at every instruction aborts every time: one single-stepped by a
/// debugger, where unbounded retries would never let it leave the section.
pub const ABORT_LIMIT: u32 = 32;

/// The run of consecutive aborts of one call; lives only on the slow path.
pub(crate) struct AbortRun(u32);

impl AbortRun {
    pub(crate) const fn new() -> AbortRun {
        AbortRun(0)
    }

    /// Records a failed try; `true` once the run reaches [`ABORT_LIMIT`], when the caller must
    /// take its fallback path (counted in [`abort_fallbacks`]).
    #[cold]
    #[inline(never)]
    pub(crate) fn gives_up(&mut self) -> bool {
        self.0 += 1;
        if self.0 < ABORT_LIMIT {
            return false;
        }
        ABORT_FALLBACKS.fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// Number of aborted restartable operations that thiscpu's safe types ([`crate::Counter`] and
/// others) retried in this process so far. A diagnostic: aborts are normal and cost one retry.
///
/// ```
/// let before = thiscpu::ops::aborts();
/// assert!(thiscpu::ops::aborts() >= before);
/// ```
pub fn aborts() -> u64 {
    ABORTS.load(Ordering::Relaxed)
}

/// Number of calls of thiscpu's safe types (and of [`crate::getcpu`]) that met
/// [`ABORT_LIMIT`] consecutive aborts and took their fallback path instead, in this process
/// so far. Non-zero means a thread was interrupted at every instruction: single-stepped by a
/// debugger, for example.
///
/// ```
/// let before = thiscpu::ops::abort_fallbacks();
/// assert!(thiscpu::ops::abort_fallbacks() >= before);
/// ```
pub fn abort_fallbacks() -> u64 {
    ABORT_FALLBACKS.load(Ordering::Relaxed)
}

/// Fault injection, built only with `RUSTFLAGS="--cfg thiscpu_inject"`: delay loops at
/// numbered points inside every restartable sequence, so tests can drive the abort path.
#[cfg(thiscpu_inject)]
pub mod inject {
    pub use crate::arch::inject::{DELAYS, POINTS};
    use core::sync::atomic::Ordering;

    /// Sets the delay at `point` (spins of a decrement loop; 0 for none).
    pub fn set_delay(point: usize, spins: u32) {
        DELAYS[point].store(spins, Ordering::Relaxed);
    }
}
