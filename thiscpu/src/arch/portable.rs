//! The architecture contract without restartable sequences: every system but Linux, Linux on
//! an architecture without a port (s390x, ppc64le, armv7, loongarch64, ...), and any build with
//! `--cfg thiscpu_portable`.
//!
//! No area is ever registered. Each thread has one area of its own, the blank image
//! (`cpu_id = -1`), that nothing writes; the "thread pointer" is its address, so every
//! `AreaOffset` is 0 and names it. Every read of `cpu_id` is therefore negative, which sends
//! each fast path to its slow path, and the process decision says that nobody registered rseq
//! (`Registrar::None`), so the slow paths take the answers and the atomic updates they take
//! with `THISCPU_RSEQ=off`. The sections are never reached from there (each caller checks
//! `cpu_id` first); should one be, it reports an abort and stores nothing, which is what the
//! kernel's abort would have done.
//!
//! # Safety
//! The area is read through its address, a live thread-local of the calling thread; each block
//! states why it holds.

use super::{AreaOffset, NativeCpuRead, Outcome, StackHead, StackOutcome, hot};
use crate::abi::{self, Rseq};
use core::sync::atomic::AtomicU32;

/// An `AreaOffset` leads to the area's start.
pub(crate) const AREA_OFFSET_FIELD: usize = 0;

/// x86_64's `RSEQ_SIG`: nothing registers an area here, so the value is never handed to a
/// kernel; it only keeps the contract's shape.
pub(crate) const RSEQ_SIG: u32 = 0x5305_3053;

/// The process-wide words `arch::set_hot_word` writes, under the name the assembly files give
/// theirs. Nothing reads them on the fast paths here: they only ever say "take the slow path".
#[unsafe(no_mangle)]
static __thiscpu_0_1_hot_words: [AtomicU32; hot::WORDS] = [const { AtomicU32::new(0) }; hot::WORDS];

thread_local! {
    /// The calling thread's only area: the unregistered image, never written.
    static BLANK: Rseq = const { Rseq::UNREGISTERED };
}

/// The address of the calling thread's blank area, which stands for the thread pointer: the
/// one address that every offset of the contract is taken from.
#[inline]
pub(crate) fn thread_pointer() -> usize {
    // A thread that is being torn down (a destructor of another thread-local asking for the
    // CPU) no longer has its area; a static blank image answers the same there.
    static LAST_WORDS: Rseq = Rseq::UNREGISTERED;
    BLANK
        .try_with(|area| core::ptr::from_ref(area) as usize)
        .unwrap_or(core::ptr::from_ref(&LAST_WORDS) as usize)
}

/// The own area and the blank one are the same here, at offset 0.
#[inline]
pub(crate) fn own_area_offset() -> isize {
    0
}

/// See `own_area_offset`.
#[inline]
pub(crate) fn blank_area_offset() -> isize {
    0
}

/// Only ever asked for once an area is registered, which never happens here; the one area
/// stays where every read looks.
pub(crate) fn set_area_offset<const AREA: usize>(offset: isize) {
    debug_assert_eq!(offset, 0, "no other area exists without rseq");
}

/// The hot word `WORD` (one of the `arch::hot` indexes).
#[inline(always)]
pub(crate) fn hot_word<const WORD: usize>() -> u32 {
    const { assert!(WORD < hot::WORDS) };
    __thiscpu_0_1_hot_words[WORD].load(core::sync::atomic::Ordering::Relaxed)
}

/// The offset of every kind of read: the blank area.
#[inline(always)]
pub(crate) fn area_offset() -> AreaOffset {
    AreaOffset(0)
}

/// See `area_offset`.
#[inline(always)]
pub(crate) fn area_offset_of<const AREA: usize>() -> AreaOffset {
    const { assert!(AREA < super::areas::COUNT) };
    AreaOffset(0)
}

/// The 32-bit field `FIELD` of the area at `offset`.
#[inline(always)]
pub(crate) fn field_at<const FIELD: usize>(offset: AreaOffset) -> i32 {
    const { assert!(FIELD.is_multiple_of(4) && FIELD + 4 <= abi::ORIGINAL_AREA_SIZE as usize) };
    let area = super::area_at(offset.area_start());
    // SAFETY: an `AreaOffset` here is always 0, and `area_at(0)` is the calling thread's blank
    // area (or the static image), live and never written; FIELD is an aligned 32-bit field
    // inside its 32 bytes (checked above).
    unsafe { area.cast::<u8>().add(FIELD).cast::<i32>().read() }
}

/// The field `FIELD` of the active area (the blank one).
#[inline(always)]
pub(crate) fn active_field<const FIELD: usize>() -> i32 {
    field_at::<FIELD>(area_offset())
}

/// `cpu_id` and `node_id` of the area: an unregistered area's negative `cpu_id`.
#[inline]
pub(crate) fn load_cpu_node(area: AreaOffset) -> Option<(i32, u32)> {
    Some((
        field_at::<{ abi::offset::CPU_ID }>(area),
        field_at::<{ abi::offset::NODE_ID }>(area) as u32,
    ))
}

/// No instruction answers "which CPU" here.
pub(crate) const NATIVE_CPU_READ: Option<NativeCpuRead> = None;
/// See `NATIVE_CPU_READ`.
pub(crate) const NATIVE_CPU_READ_WITH_CLOCK: Option<NativeCpuRead> = None;

/// Reports an abort: no area is registered, so no section can run.
///
/// # Safety
/// None needed: nothing is read or written. `unsafe` for the contract's shape.
#[inline(always)]
pub(crate) unsafe fn load_add_store<const FIELD: usize>(
    _offset: AreaOffset,
    _index: u32,
    _v: *mut u64,
    _count: u64,
) -> Outcome {
    Outcome::Aborted
}

/// Reports an abort: see `load_add_store`.
///
/// # Safety
/// None needed: nothing is read or written.
#[inline(always)]
pub(crate) unsafe fn load_cbne_store<const FIELD: usize>(
    _offset: AreaOffset,
    _index: u32,
    _v: *mut u64,
    _expect: u64,
    _new: u64,
) -> Outcome {
    Outcome::Aborted
}

/// Reports an abort: see `load_add_store`.
///
/// # Safety
/// None needed: nothing is read or written.
#[inline(always)]
pub(crate) unsafe fn load_cbeq_load_store<const FIELD: usize, const NEXT: usize>(
    _offset: AreaOffset,
    _index: u32,
    _head: *mut usize,
    _popped: *mut usize,
) -> Outcome {
    Outcome::Aborted
}

/// Reports an abort: see `load_add_store`.
///
/// # Safety
/// None needed: nothing is read or written.
#[inline(always)]
pub(crate) unsafe fn stack_push<const FIELD: usize>(
    _offset: AreaOffset,
    _index: u32,
    _head: *const StackHead,
    _slots: *mut usize,
    _capacity: u64,
    _object: usize,
) -> StackOutcome {
    StackOutcome::Aborted
}

/// Reports an abort: see `load_add_store`.
///
/// # Safety
/// None needed: nothing is read or written.
#[inline(always)]
pub(crate) unsafe fn stack_pop<const FIELD: usize>(
    _offset: AreaOffset,
    _index: u32,
    _head: *const StackHead,
    _slots: *const usize,
) -> (StackOutcome, usize) {
    (StackOutcome::Aborted, 0)
}

/// Reports an abort: see `load_add_store`.
///
/// # Safety
/// None needed: nothing is read or written.
#[inline(always)]
pub(crate) unsafe fn stack_pop_batch<const FIELD: usize>(
    _offset: AreaOffset,
    _index: u32,
    _head: *const StackHead,
    _slots: *const usize,
    _out: *mut usize,
    _max: usize,
) -> (StackOutcome, usize) {
    (StackOutcome::Aborted, 0)
}

/// Reports an abort: see `load_add_store`.
///
/// # Safety
/// None needed: nothing is read or written.
#[inline(always)]
pub(crate) unsafe fn stack_push_batch<const FIELD: usize>(
    _offset: AreaOffset,
    _index: u32,
    _head: *const StackHead,
    _slots: *mut usize,
    _capacity: u64,
    _items: *const usize,
    _len: usize,
) -> (StackOutcome, usize) {
    (StackOutcome::Aborted, 0)
}

/// Reports a pop that did not commit: see `load_add_store`.
///
/// # Safety
/// None needed: nothing is read or written.
#[inline(always)]
pub(crate) unsafe fn stack_pop_here(
    _offset: AreaOffset,
    _cpus: u64,
    _shift: u32,
    _head: *const StackHead,
    _slots: *const usize,
) -> usize {
    0
}

/// Reports an abort: see `load_add_store`.
///
/// # Safety
/// None needed: nothing is read or written.
#[inline(always)]
pub(crate) unsafe fn stack_push_here(
    _offset: AreaOffset,
    _cpus: u64,
    _shift: u32,
    _head: *const StackHead,
    _slots: *mut usize,
    _capacity: u64,
    _item: usize,
) -> StackOutcome {
    StackOutcome::Aborted
}
