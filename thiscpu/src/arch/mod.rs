//! The architecture contract, and the one place that chooses an architecture.
//!
//! This module owns every type that crosses the seam (the area offset, the outcomes of the
//! sections, the pool's stack head, the fault-injection table) and the assembler pieces that
//! are the same on every architecture (the section descriptor and the exit-point list). Each
//! architecture file builds on these and on `crate::abi` only, and exports the same items: the
//! abort signature, access to this thread's rseq area (through a process-wide offset from the
//! thread pointer), the restartable sequences, and the CPU's own id instructions if any. The
//! list at the end of this file spells out their signatures, so a build for any architecture
//! fails if its file strays from the contract.
//!
//! The active area is read in two ways: `area_offset` loads where it is, for a section and the
//! reads that position it (`field_at`), and `active_field` reads one field alone, in the
//! fewest steps (the fast path of `current_cpu`). `getcpu` reads through an area of its own
//! (`area_offset_of`, see `areas`). `own_area_offset`, `blank_area_offset` and
//! `set_area_offset` are for the registration, which chooses the areas. What is the same on
//! both architectures (the area's address from an offset, an `AreaOffset`'s area start) is
//! written here, from `thread_pointer` and `AREA_OFFSET_FIELD`. The fast paths' process-wide
//! flags and bounds (`hot`) are read by `hot_word`, next to the area deltas.
//!
//! `portable.rs` keeps the contract where there is no port (other systems, Linux on other
//! architectures, `--cfg thiscpu_portable`): its areas are never registered, so every read of
//! `cpu_id` says so and every section reports an abort, and callers take the paths they take
//! without rseq (`THISCPU_RSEQ=off`).
//!
//! # Safety
//! The submodules are built from `asm!`; each block states why it holds.

/// Emits the `struct rseq_cs` for a section at label 3 (in `__rseq_cs`) and lists it in
/// `__rseq_cs_ptr_array` for debuggers. Arguments: the start, post-commit and abort labels.
/// The descriptor is made of `.long` and `.quad` data, the same on every 64-bit architecture.
///
/// The debuggers' tables are arrays of 8-byte words, so each entry is aligned to 8: the
/// section takes the alignment of its first entry, and nothing else in it may shift one. No
/// code refers to them, so they carry the retain flag (`R`, `SHF_GNU_RETAIN`), or the linker's
/// `--gc-sections` (rustc passes it) would drop them from every program.
#[cfg(thiscpu_rseq)]
macro_rules! rseq_descriptor {
    ($start:literal, $post_commit:literal, $abort:literal) => {
        concat!(
            ".pushsection __rseq_cs, \"aw\"\n",
            ".balign 32\n",
            "3:\n",
            ".long 0, 0\n",
            ".quad ",
            $start,
            "f, ",
            $post_commit,
            "f - ",
            $start,
            "f, ",
            $abort,
            "f\n",
            ".popsection\n",
            ".pushsection __rseq_cs_ptr_array, \"awR\"\n",
            ".balign 8\n",
            ".quad 3b\n",
            ".popsection\n",
        )
    };
}

/// Lists an early exit of a section (from its start label to a label outside it) in
/// `__rseq_exit_point_array`, as librseq does for debuggers. Place it before the start label.
#[cfg(thiscpu_rseq)]
macro_rules! rseq_exit_point {
    ($start:literal, $exit:literal) => {
        concat!(
            ".pushsection __rseq_exit_point_array, \"awR\"\n",
            ".balign 8\n",
            ".quad ",
            $start,
            "f, ",
            $exit,
            "\n",
            ".popsection\n",
        )
    };
}

// The choice: `thiscpu_rseq` (set by the build script, the one place that decides it) means
// Linux on an architecture with a restartable-sequence port; everything else takes the portable
// file, which registers no area, so every caller takes its path without rseq.
#[cfg(all(thiscpu_rseq, target_arch = "x86_64"))]
#[path = "x86_64.rs"]
#[cfg_attr(thiscpu_model, allow(dead_code))]
mod imp;

#[cfg(all(thiscpu_rseq, target_arch = "aarch64"))]
#[path = "aarch64.rs"]
#[cfg_attr(thiscpu_model, allow(dead_code))]
mod imp;

#[cfg(all(thiscpu_rseq, target_arch = "riscv64"))]
#[path = "riscv64.rs"]
#[cfg_attr(thiscpu_model, allow(dead_code))]
mod imp;

#[cfg(not(thiscpu_rseq))]
#[path = "portable.rs"]
mod imp;

pub(crate) use imp::*;

// Under the model checker, the sections and the CPU a thread reads come from the model
// machine; these names shadow the architecture file's.
#[cfg(thiscpu_model)]
pub mod model;
#[cfg(thiscpu_model)]
pub(crate) use model::{
    active_field, field_at, load_add_store, load_cbeq_load_store, load_cbne_store, stack_pop,
    stack_pop_batch, stack_pop_here, stack_push, stack_push_batch, stack_push_here,
};

use crate::abi::Rseq;
use crate::sync::atomic::AtomicU64;
#[cfg_attr(any(thiscpu_model, not(thiscpu_rseq)), allow(unused_imports))]
use core::mem::{offset_of, size_of};
use core::sync::atomic::{AtomicU32, Ordering};

/// The process-wide words that inline fast paths test on every call, as indexes into one table
/// of `u32`s. Each architecture file places the table right after its area delta, so the words
/// and the delta share a cache line, and reads a word with one PC-relative load (`hot_word`).
/// A Rust static of this crate, inlined into another crate, would be reached through the GOT:
/// rustc emits a `GOTPCREL` relocation that the linker does not relax, one more dependent load
/// per call (`pub static X: AtomicU32` and `#[inline] pub fn get() -> u32 { X.load(Relaxed) }`
/// in one crate, `get()` called from another: `mov X@GOTPCREL(%rip), %rax; mov (%rax), %eax`
/// with rustc 1.95).
pub(crate) mod hot {
    /// `dense`'s number of per-CPU rows (0 until its first slot).
    pub(crate) const ROWS: usize = 0;
    /// Non-zero once the process decided that the areas' `mm_cid` is kept current.
    pub(crate) const MM_CID_USABLE: usize = 1;
    /// The table's length.
    pub(crate) const WORDS: usize = 2;
}

/// The kinds of reads that each find their area through a delta of their own, as indexes into
/// the architecture file's table of deltas. `getcpu`'s answer is only right once the process
/// knows that `node_id` is kept current, so it reads through an area that is the blank one
/// (never registered, `cpu_id` always -1) until then, or for good: its check of `cpu_id`,
/// which it makes anyway, then sends it to the slow path, and it needs no flag of its own.
/// `mm_cid` keeps its flag (`hot::MM_CID_USABLE`): besides gating `mm_cid()`, it chooses a
/// by-`mm_cid` counter's spread, and a blank area could only say "slow path", not "count by
/// CPU instead".
pub(crate) mod areas {
    /// The active area: thiscpu's own until the process decided, then the registered one.
    pub(crate) const ACTIVE: usize = 0;
    /// The area that `getcpu` reads `cpu_id` and `node_id` from: the active area once the
    /// process decided that its `node_id` is kept current, else the blank area.
    pub(crate) const NODE: usize = 1;
    /// The table's length.
    pub(crate) const COUNT: usize = 2;
}

unsafe extern "C" {
    /// Defined in the architecture file's `global_asm!`, zero at start.
    static __thiscpu_0_1_hot_words: [AtomicU32; hot::WORDS];
}

/// Sets the hot word `WORD` (one of the `hot` indexes) for every thread of the process.
pub(crate) fn set_hot_word<const WORD: usize>(value: u32) {
    // SAFETY: the table is `hot::WORDS` aligned words in `.data`, defined by the architecture
    // file, and accessed only atomically (here, or by `hot_word`'s single aligned load).
    unsafe { __thiscpu_0_1_hot_words[WORD].store(value, Ordering::Relaxed) }
}

/// Where an rseq area is, as `area_offset` or `area_offset_of` loaded it: the offset from the
/// thread pointer to the area's field at `AREA_OFFSET_FIELD` (its start on x86_64, its
/// `cpu_id` on aarch64 and riscv64). Only the architecture files can make one, and only from
/// the delta table, whose entries name thiscpu's own area, glibc's, or the blank one: every
/// value names a live area in whichever thread holds it. The offsets are the same for every thread, and an
/// offset that was in the table once (thiscpu's own area before the switch to glibc's, the
/// blank area before `node_id` was known current) stays valid, since every thread keeps its
/// static TLS until it is gone. That is what lets `field_at` be a safe function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AreaOffset(isize);

impl AreaOffset {
    /// The offset from the thread pointer to the area's start.
    pub(crate) fn area_start(self) -> isize {
        self.0 - AREA_OFFSET_FIELD as isize
    }
}

/// The calling thread's area at `offset` from the thread pointer (to the area's start).
pub(crate) fn area_at(offset: isize) -> *mut Rseq {
    thread_pointer().wrapping_add_signed(offset) as *mut Rseq
}

/// How a restartable operation ended.
#[must_use = "an aborted operation did nothing and must be retried"]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome<T = ()> {
    /// The committing store happened.
    Committed(T),
    /// A comparison failed (the value was not the expected one, or the list was empty):
    /// nothing was stored.
    Mismatch,
    /// The kernel aborted the section (preemption, migration, signal, membarrier), or the
    /// thread was no longer on the position's CPU: nothing was stored. Read a new position and
    /// retry.
    Aborted,
}

/// The head of one CPU's guarded stack (the pool's per-CPU caches): what `stack_push` and
/// `stack_pop` address by the offsets below.
#[repr(C)]
#[derive(Debug, Default)]
pub(crate) struct StackHead {
    /// Objects in the stack. Written by committing sections on this CPU (plain stores), or by a
    /// drainer while `stopped` is set and the CPU has been fenced.
    pub(crate) count: AtomicU64,
    /// Non-zero while a drainer owns the stack. Written only by drainers, atomically, and (the
    /// allocator's caches) by a watcher's mark and the slow path that clears it, both by
    /// compare-exchange from and to 0, never over a drainer's value; sections only read it.
    pub(crate) stopped: AtomicU64,
}

// Without a port no section addresses the fields.
#[cfg_attr(not(thiscpu_rseq), allow(dead_code))]
impl StackHead {
    /// Byte offset of `count`, used inside `asm!`.
    pub(crate) const COUNT: usize = 0;
    /// Byte offset of `stopped`, used inside `asm!`.
    pub(crate) const STOPPED: usize = 8;
}

// The model's atomics are larger, and its sections address the fields by name; the portable
// file has no sections to address them.
#[cfg(all(thiscpu_rseq, not(thiscpu_model)))]
const _: () = {
    assert!(offset_of!(StackHead, count) == StackHead::COUNT);
    assert!(offset_of!(StackHead, stopped) == StackHead::STOPPED);
    assert!(size_of::<AtomicU64>() == 8 && size_of::<usize>() == 8);
};

/// How a guarded stack section ended. The discriminants are the codes a section may report
/// in a register (x86_64's `stack_pop`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
#[cfg_attr(not(thiscpu_rseq), allow(dead_code))]
pub(crate) enum StackOutcome {
    /// The count was stored.
    Committed = 0,
    /// The stack was full (push) or empty (pop): nothing stored.
    Refused = 1,
    /// A drainer owns the stack: nothing stored.
    Stopped = 2,
    /// The kernel aborted the section, or the thread was not on the CPU any more.
    Aborted = 3,
}

/// An instruction that tells user space which CPU it runs on without entering the kernel.
/// Each architecture exports two, `None` where it has no such instruction: `NATIVE_CPU_READ`,
/// the plain read, and `NATIVE_CPU_READ_WITH_CLOCK`, one that also reads the time-stamp
/// counter (for CPUs that lack the plain read).
#[derive(Clone, Copy)]
pub(crate) struct NativeCpuRead {
    /// Whether this CPU has the instruction: an identification query, worth caching.
    pub(crate) present: fn() -> bool,
    /// `(cpu, node)` as the instruction reports them. Call only where `present()` said yes
    /// (elsewhere the instruction traps).
    pub(crate) read: fn() -> (u32, u32),
}

/// The delay table that the sections' injection points read, built only with
/// `RUSTFLAGS="--cfg thiscpu_inject"` (`crate::ops::inject` sets it).
#[cfg(thiscpu_inject)]
pub mod inject {
    use core::sync::atomic::AtomicU32;

    /// Number of injection points.
    pub const POINTS: usize = 4;

    /// Spin counts per point, read by the sections' delay loops.
    pub static DELAYS: [AtomicU32; POINTS] = [const { AtomicU32::new(0) }; POINTS];
}

// The contract: every architecture file exports these items with these types. Generic
// sections are checked at one instantiation; the const parameters are offsets, not types.
const _: () = {
    use crate::abi::offset::{CPU_ID, MM_CID};
    const NEXT: usize = 0;
    let _: u32 = RSEQ_SIG;
    let _: fn() -> usize = thread_pointer;
    let _: fn() -> isize = own_area_offset;
    let _: fn() -> isize = blank_area_offset;
    let _: fn(isize) = set_area_offset::<{ areas::NODE }>;
    let _: usize = AREA_OFFSET_FIELD;
    let _: fn() -> AreaOffset = area_offset;
    let _: fn() -> AreaOffset = area_offset_of::<{ areas::NODE }>;
    let _: fn(AreaOffset) -> i32 = field_at::<CPU_ID>;
    let _: fn() -> i32 = active_field::<MM_CID>;
    let _: fn() -> u32 = hot_word::<{ hot::ROWS }>;
    let _: fn(AreaOffset) -> Option<(i32, u32)> = load_cpu_node;
    let _: Option<NativeCpuRead> = NATIVE_CPU_READ;
    let _: Option<NativeCpuRead> = NATIVE_CPU_READ_WITH_CLOCK;
    let _: unsafe fn(AreaOffset, u32, *mut u64, u64) -> Outcome = load_add_store::<CPU_ID>;
    let _: unsafe fn(AreaOffset, u32, *mut u64, u64, u64) -> Outcome = load_cbne_store::<CPU_ID>;
    let _: unsafe fn(AreaOffset, u32, *mut usize, *mut usize) -> Outcome =
        load_cbeq_load_store::<CPU_ID, NEXT>;
    let _: unsafe fn(AreaOffset, u32, *const StackHead, *mut usize, u64, usize) -> StackOutcome =
        stack_push::<CPU_ID>;
    let _: unsafe fn(AreaOffset, u32, *const StackHead, *const usize) -> (StackOutcome, usize) =
        stack_pop::<CPU_ID>;
    type PopBatch =
        unsafe fn(AreaOffset, u32, *const StackHead, *const usize, *mut usize, usize) -> Moved;
    type PushBatch =
        unsafe fn(AreaOffset, u32, *const StackHead, *mut usize, u64, *const usize, usize) -> Moved;
    type Moved = (StackOutcome, usize);
    let _: PopBatch = stack_pop_batch::<CPU_ID>;
    let _: PushBatch = stack_push_batch::<CPU_ID>;
    let _: unsafe fn(
        AreaOffset,
        u64,
        u32,
        *const StackHead,
        *mut usize,
        u64,
        usize,
    ) -> StackOutcome = stack_push_here;
    let _: unsafe fn(AreaOffset, u64, u32, *const StackHead, *const usize) -> usize =
        stack_pop_here;
};

// What the tests check is the assembly's (offsets in static TLS, sections the kernel aborts).
#[cfg(all(test, thiscpu_rseq, not(thiscpu_model)))]
mod contract_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::offset::CPU_ID;

    #[test]
    fn the_node_area_is_the_active_one_once_node_id_is_usable_else_the_blank_one() {
        let process = crate::registration::decided().expect("decided before the tests");
        let node_area = area_offset_of::<{ areas::NODE }>().area_start();
        if process.rseq.node_id_usable() {
            assert_eq!(node_area, area_offset().area_start());
        } else {
            // Never written: this checks the table's initial value too.
            assert_eq!(node_area, blank_area_offset());
        }
        fn blank_after_getcpu() {
            let _ = crate::cpu::getcpu();
            let blank = AreaOffset(blank_area_offset() + AREA_OFFSET_FIELD as isize);
            assert_eq!(field_at::<CPU_ID>(blank), -1);
        }
        blank_after_getcpu();
        std::thread::spawn(blank_after_getcpu).join().unwrap();
    }
}
