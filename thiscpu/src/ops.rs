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
//! A [`Position`] is read before the operation: the CPU (or `mm_cid`, by its [`Spread`]) this
//! thread is on and the area it was read from. The section compares it again at its start, so
//! an operation can only commit on the CPU whose data the caller addressed.
//!
//! # Safety
//! The operations are `unsafe fn`s whose `# Safety` sections state the contract; the safe
//! types (`Counter`, the pool) uphold it by construction.

use crate::abi::offset;
use crate::arch;
use crate::registration;
use core::marker::PhantomData;
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Where the active rseq area is, for callers that keep it across operations (`position_in`).
pub(crate) use crate::arch::AreaOffset;
pub use crate::arch::Outcome;
/// The guarded stack's head and the outcome of its sections, for the pool's caches.
pub(crate) use crate::arch::{StackHead, StackOutcome};

mod sealed {
    pub trait Sealed {}
}

/// What per-CPU data is spread by, and so what a [`Position`] holds and its operations compare:
/// the CPU ([`ByCpu`], the default) or the memory-map concurrency id ([`ByMmCid`]). A
/// [`crate::Counter`]'s increments and a [`crate::Sharded`]'s shards are spread the same way.
///
/// Code written over `Position<S>` serves both:
///
/// ```
/// use core::sync::atomic::{AtomicU64, Ordering};
/// use thiscpu::ops::{self, Outcome, Position, Spread};
///
/// /// Adds one to the slot of `at`'s index in `slots`, which only sections spread by `S` write.
/// fn bump<S: Spread>(slots: &[AtomicU64], at: Position<S>) -> bool {
///     let Some(slot) = slots.get(at.index() as usize) else { return false };
///     // SAFETY: `slot` belongs to `at.index()` and is written only by sections at positions
///     // of the same spread and index.
///     let outcome = unsafe { ops::load_add_store(at, slot.as_ptr(), 1) };
///     outcome == Outcome::Committed(())
/// }
///
/// let cpus = thiscpu::topology::possible_cpus();
/// let by_cpu: Vec<AtomicU64> = (0..cpus).map(|_| AtomicU64::new(0)).collect();
/// let by_cid: Vec<AtomicU64> = (0..cpus).map(|_| AtomicU64::new(0)).collect();
/// while let Some(at) = ops::position() {
///     if bump(&by_cpu, at) {
///         break;
///     }
/// }
/// while let Some(at) = ops::mm_cid_position() {
///     if bump(&by_cid, at) {
///         break;
///     }
/// }
/// let total = |slots: &[AtomicU64]| slots.iter().map(|s| s.load(Ordering::Relaxed)).sum::<u64>();
/// assert_eq!(total(&by_cpu), u64::from(ops::position().is_some()));
/// assert_eq!(total(&by_cid), u64::from(ops::mm_cid_position().is_some()));
/// ```
pub trait Spread: sealed::Sealed + Send + Sync + 'static {
    /// The offset of the rseq area's field that positions hold and sections compare.
    #[doc(hidden)]
    const FIELD: usize;
}

/// Spread by CPU: one word (or shard) per CPU that ran the program; sections compare the rseq
/// area's `cpu_id`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByCpu;

/// Spread by `mm_cid` (Linux 6.3+): ids are dense, below the number of threads the process runs
/// at once, so memory follows threads, not CPUs; sections compare the rseq area's `mm_cid`.
/// Where the kernel has no `mm_cid`, [`mm_cid_position`] is `None`, and a
/// [`crate::Counter`] or [`crate::Sharded`] spread by it spreads by CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByMmCid;

impl sealed::Sealed for ByCpu {}
impl sealed::Sealed for ByMmCid {}
impl Spread for ByCpu {
    const FIELD: usize = offset::CPU_ID;
}
impl Spread for ByMmCid {
    const FIELD: usize = offset::MM_CID;
}

/// `arch::$section::<FIELD, ...>($args)` with FIELD the field that spread `$S` compares. The
/// `arch` sections take the field as a constant, which a generic `S` cannot name on stable
/// Rust; `Spread` is sealed, so FIELD is one of two, and the test is on constants and folds
/// away.
macro_rules! section_by {
    ($S:ty, $section:ident, [$($more:tt)*], $($arg:expr),* $(,)?) => {{
        const {
            assert!(<$S as Spread>::FIELD == offset::CPU_ID || <$S as Spread>::FIELD == offset::MM_CID)
        };
        if <$S as Spread>::FIELD == offset::MM_CID {
            arch::$section::<{ offset::MM_CID } $(, $more)*>($($arg),*)
        } else {
            arch::$section::<{ offset::CPU_ID } $(, $more)*>($($arg),*)
        }
    }};
}

/// Where the calling thread is, read from its rseq area just before an operation: the CPU (or
/// `mm_cid`, by the spread `S`) and the area the section must check it against.
///
/// A position names the calling thread's own area, so it is neither `Send` nor `Sync`:
///
/// ```compile_fail
/// fn send<T: Send>(_: T) {}
/// send(thiscpu::ops::position());
/// ```
pub struct Position<S: Spread = ByCpu> {
    offset: arch::AreaOffset,
    index: u32,
    this_thread_only: PhantomData<(S, *const ())>,
}

// By hand, since derives would ask the same of `S`, a marker.
impl<S: Spread> Clone for Position<S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S: Spread> Copy for Position<S> {}
impl<S: Spread> PartialEq for Position<S> {
    fn eq(&self, other: &Self) -> bool {
        (self.offset, self.index) == (other.offset, other.index)
    }
}
impl<S: Spread> Eq for Position<S> {}
impl<S: Spread> core::fmt::Debug for Position<S> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Position")
            .field("spread", &core::any::type_name::<S>())
            .field("offset", &self.offset)
            .field("index", &self.index)
            .finish()
    }
}

impl<S: Spread> Position<S> {
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
pub fn position() -> Option<Position<ByCpu>> {
    let at = position_as_is::<ByCpu>();
    if at.registered() {
        return Some(at);
    }
    position_slow()
}

#[cold]
#[inline(never)]
fn position_slow() -> Option<Position<ByCpu>> {
    if registration::decided_without_rseq() || !registration::ensure_registered() {
        return None;
    }
    let at = position_as_is::<ByCpu>();
    at.registered().then_some(at)
}

/// The position by `S` as the calling thread's area shows it now, for the fast paths of
/// the safe types, which check the index themselves: nothing is registered, and an
/// unregistered area (`cpu_id` -1 or -2) shows as an index of at least 2^31, beyond every
/// table, so that one unsigned comparison rejects it together with indexes beyond the rows.
/// Run an operation at it only after such a comparison.
#[inline(always)]
pub(crate) fn position_as_is<S: Spread>() -> Position<S> {
    position_in::<S>(arch::area_offset())
}

/// The active area's offset from the thread pointer, the same in every thread. It changes at
/// most once, when the process decides to use glibc's area (`registration`); an offset read
/// before that names thiscpu's own area, which then stays unregistered, so positions read in
/// it only ever show an unregistered area.
#[inline(always)]
pub(crate) fn area_offset() -> AreaOffset {
    arch::area_offset()
}

/// [`position_as_is`] read in the area at `area`, an [`area_offset`] read earlier (possibly by
/// another thread: the offset is the same in all of them). Callers that keep the offset in a
/// register across many operations save a load and an add on each.
#[inline(always)]
pub(crate) fn position_in<S: Spread>(area: AreaOffset) -> Position<S> {
    let cpu = arch::field_at::<{ offset::CPU_ID }>(area);
    let index = if S::FIELD == offset::CPU_ID || cpu < 0 {
        cpu
    } else {
        arch::field_at::<{ offset::MM_CID }>(area)
    };
    Position::new(area, index as u32)
}

/// The calling thread's position by `S`, registering it if needed: [`position`], or
/// [`mm_cid_position`], read from one load of the area offset.
#[inline]
pub(crate) fn position_by<S: Spread>() -> Option<Position<S>> {
    let cpu = position()?;
    if S::FIELD == offset::CPU_ID {
        return Some(Position::new(cpu.offset, cpu.index));
    }
    // A position means the process decided (only the decision registers a thread).
    if !registration::mm_cid_usable()
        && !registration::decided().is_some_and(|p| p.rseq.mm_cid_usable())
    {
        return None;
    }
    let index = arch::field_at::<{ offset::MM_CID }>(cpu.offset);
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
pub fn mm_cid_position() -> Option<Position<ByMmCid>> {
    position_by::<ByMmCid>()
}

/// Adds `count` to `*v` on the position's CPU: load, add, store, with the store committing.
///
/// # Safety
/// - `at` was read by the calling thread (the type keeps a position in the thread that read it).
/// - `v` is valid for reads and writes of a `u64` (8-byte aligned) for the whole call.
/// - `v` is the word for `at.index()`: every write to it is made by an operation whose position
///   has the same index and spread (so that only one CPU ever runs a committing section on it),
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
pub unsafe fn load_add_store<S: Spread>(at: Position<S>, v: *mut u64, count: u64) -> Outcome {
    // SAFETY: forwarded contract.
    unsafe { section_by!(S, load_add_store, [], at.offset, at.index, v, count) }
}

/// Stores `newv` into `*v` if `*v` still holds `expect`, on the position's CPU.
///
/// # Safety
/// As for [`load_add_store`], except that other threads may also write `*v` atomically at any
/// time `*v` differs from `expect` (no section can commit then): a lock word, whose holder
/// releases it from any CPU, is such a word ([`crate::Sharded`]).
#[inline]
pub unsafe fn load_cbne_store<S: Spread>(
    at: Position<S>,
    v: *mut u64,
    expect: u64,
    newv: u64,
) -> Outcome {
    // SAFETY: forwarded contract.
    unsafe { section_by!(S, load_cbne_store, [], at.offset, at.index, v, expect, newv) }
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
pub unsafe fn load_cbeq_load_store<T, S: Spread, const NEXT: usize>(
    at: Position<S>,
    head: *mut *mut T,
) -> Outcome<*mut T> {
    let mut node = 0usize;
    // SAFETY: forwarded contract; `node` is a local the section may write.
    let outcome = unsafe {
        section_by!(
            S,
            load_cbeq_load_store,
            [NEXT],
            at.offset,
            at.index,
            head.cast(),
            &mut node
        )
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
pub unsafe fn list_push<T, S: Spread>(
    at: Position<S>,
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
pub(crate) unsafe fn stack_push<S: Spread>(
    at: Position<S>,
    head: *const StackHead,
    slots: *mut usize,
    capacity: u64,
    item: usize,
) -> StackOutcome {
    // SAFETY: forwarded contract; a position was read by the thread that holds it.
    unsafe {
        section_by!(
            S,
            stack_push,
            [],
            at.offset,
            at.index,
            head,
            slots,
            capacity,
            item
        )
    }
}

/// Guarded pop from the position's stack: `if head.stopped != 0 leave(Stopped); n =
/// head.count; if n == 0 leave(Refused); item = slots[n - 1]; commit head.count = n - 1`.
/// Returns the outcome and `item`, which is meaningful only when committed.
///
/// # Safety
/// As for [`stack_push`].
#[inline(always)]
pub(crate) unsafe fn stack_pop<S: Spread>(
    at: Position<S>,
    head: *const StackHead,
    slots: *const usize,
) -> (StackOutcome, usize) {
    // SAFETY: forwarded contract.
    unsafe { section_by!(S, stack_pop, [], at.offset, at.index, head, slots) }
}

/// Guarded batch pop from the position's stack, in one section: `if head.stopped != 0
/// leave(Stopped); n = head.count; if n == 0 leave(Refused); k = min(n, max); out[..k] =
/// slots[n - k..n]; commit head.count = n - k`. Returns the outcome and `k`, meaningful only
/// when committed (0 when `max` is 0).
///
/// # Safety
/// As for [`stack_push`]; `out` is valid for `max` writes and only the calling thread uses it.
#[inline]
pub(crate) unsafe fn stack_pop_batch<S: Spread>(
    at: Position<S>,
    head: *const StackHead,
    slots: *const usize,
    out: *mut usize,
    max: usize,
) -> (StackOutcome, usize) {
    // SAFETY: forwarded contract.
    unsafe {
        section_by!(
            S,
            stack_pop_batch,
            [],
            at.offset,
            at.index,
            head,
            slots,
            out,
            max
        )
    }
}

/// Guarded batch push onto the position's stack, in one section: `if head.stopped != 0
/// leave(Stopped); n = head.count; if n >= capacity leave(Refused); k = min(capacity - n,
/// len); slots[n..n + k] = items[len - k..len]; commit head.count = n + k`. Returns the
/// outcome and `k`, meaningful only when committed (0 when `len` is 0): the stack owns the
/// last `k` items from then on, the caller the rest.
///
/// # Safety
/// As for [`stack_push`]; `items` is valid for `len` reads.
#[inline]
pub(crate) unsafe fn stack_push_batch<S: Spread>(
    at: Position<S>,
    head: *const StackHead,
    slots: *mut usize,
    capacity: u64,
    items: *const usize,
    len: usize,
) -> (StackOutcome, usize) {
    // SAFETY: forwarded contract.
    unsafe {
        section_by!(
            S,
            stack_push_batch,
            [],
            at.offset,
            at.index,
            head,
            slots,
            capacity,
            items,
            len
        )
    }
}

/// Guarded pop from the stack of the CPU the calling thread runs on, which the section reads
/// itself after arming (no position is read before it, and none is checked): CPU `c`'s stack
/// is at `head` and `slots` plus `c << shift` bytes, for every `c < cpus`. Returns the item,
/// or 0 if the section did not commit: the thread has no registered area or runs on a CPU
/// from `cpus` up, the stack is stopped or empty, or the kernel aborted the section.
///
/// # Safety
/// For every CPU `c < cpus`, `head + (c << shift)` and `slots + (c << shift)` are CPU `c`'s
/// stack, whose count and slots only sections running on `c` write, or a drainer after a
/// fence of `c` while `stopped` is set; no stacked item is 0.
#[inline(always)]
pub(crate) unsafe fn stack_pop_here(
    cpus: u64,
    shift: u32,
    head: *const StackHead,
    slots: *const usize,
) -> usize {
    // SAFETY: forwarded contract; the area offset names the calling thread's area.
    unsafe { arch::stack_pop_here(arch::area_offset(), cpus, shift, head, slots) }
}

/// Guarded push onto the stack of the CPU the calling thread runs on, found as in
/// [`stack_pop_here`]. `Aborted` also when the thread has no registered area or runs on a CPU
/// from `cpus` up.
///
/// # Safety
/// As for [`stack_pop_here`], every CPU's slots valid for `capacity` words.
#[inline(always)]
pub(crate) unsafe fn stack_push_here(
    cpus: u64,
    shift: u32,
    head: *const StackHead,
    slots: *mut usize,
    capacity: u64,
    item: usize,
) -> StackOutcome {
    // SAFETY: forwarded contract; the area offset names the calling thread's area.
    unsafe {
        arch::stack_push_here(
            arch::area_offset(),
            cpus,
            shift,
            head,
            slots,
            capacity,
            item,
        )
    }
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
