//! aarch64: the thread pointer is `TPIDR_EL0`, rseq fields are loaded from it with a register
//! offset, and the abort signature is `0xd428bc00`, the encoding of `brk #0x45e0`, emitted with
//! `.inst` right before each abort label so that it traps if it is ever executed.
//!
//! # Where the active area is
//! As on x86_64, from two words that do not depend on each other, added, and one load. The own
//! area's offset from the thread pointer comes from the initial-exec sequence
//! `adrp :gottprel:` / `ldr :gottprel_lo12:`, which the linker turns into `movz`/`movk` of a
//! constant in an executable and keeps as a load of a GOT entry (filled by the dynamic loader)
//! in a shared object. A data word holding that offset itself would need an
//! `R_AARCH64_TLS_TPREL64` relocation, which GNU ld refuses ("dangerous relocation:
//! unsupported relocation") and LLVM's assembler can only write with `.reloc`. The data word
//! holds what changes at run time instead: the distance from the own area to the active area's
//! `cpu_id` field (not to its start, so that reading `cpu_id` takes one register-offset load).
//! Its static value, 4, names the own area's `cpu_id`, whose initial image is -1, so every read
//! before the process-wide decision takes the slow path, with no constructor involved; it is
//! switched once to glibc's area when glibc registered.
//!
//! The fast path of `current_cpu` is therefore `mrs` of the thread pointer, the own offset (2
//! instructions), `adrp`/`ldr` of the delta word, `add`, and the `ldr` of `cpu_id`: 7
//! instructions and the sign test, where the kernel's own `raw_smp_processor_id` needs 2
//! (thread pointer, one load). The 5 extra ones buy an area that works in a shared object and
//! follows glibc's registration.
//!
//! # The CPU's own id instruction
//! There is none: `MPIDR_EL1` is the hardware's affinity, not Linux's CPU number, and user
//! space cannot read it without a trap. Both native reads of the contract are `None`, so the
//! fallback for a thread without rseq is the vDSO or the system call.
//!
//! # Memory ordering
//! - The store that arms a section (the descriptor's address into `rseq_cs`) and the loads of
//!   `cpu_id`/`mm_cid` are plain: only the kernel reads or writes them, for this thread, when it
//!   interrupts this thread, and a thread sees its own accesses in program order.
//! - `load_add_store` and `load_cbeq_load_store` commit with a plain `str`: the word they write
//!   belongs to one CPU, is written only by sections running there, and publishes no other
//!   data (other threads read counters with relaxed loads of the single-copy-atomic word; a
//!   popped node was published by its push).
//! - `load_cbne_store` commits with `stlr` (store-release), because `list_push` publishes a node
//!   through it: the node's `next` field and contents were written before with plain stores,
//!   and a thread on another CPU that reaches the node from the head (after a fence, or with an
//!   acquire or address-dependent load) must see them. On one CPU nothing extra is needed.
//! - The pool's guarded stacks load their `stopped` flag with `ldar` and commit a push with
//!   `stlr`; the comment above `stack_push` says why.
//!
//! # Safety
//! Every `asm!` here touches only this thread's rseq area (at the thread pointer plus the
//! process-wide offset, which always names a live 32-byte area in this thread's static TLS or
//! glibc's thread descriptor), memory the caller vouches for, and its own registers, as each
//! block's comment details.

use super::{AreaOffset, NativeCpuRead, Outcome, StackHead, StackOutcome, areas, hot};
use crate::abi::offset;
use core::arch::{asm, global_asm};
use core::sync::atomic::{AtomicIsize, Ordering};

/// Emits an abort handler at `$label` in the `__rseq_failure` section, preceded by the
/// signature as an instruction word (instructions are little-endian even on big-endian
/// aarch64), followed by the given instructions. Out of line, so the committing path runs no
/// branch over it. Aligned to 4 explicitly: some assemblers give a pushed section alignment 1,
/// and an abort address off an instruction boundary would fault on the first abort.
///
/// The handlers end in an unconditional `b` back into the function; if the linker ever places
/// `__rseq_failure` out of `b`'s ±128 MiB range it inserts a veneer, which may use x16 and
/// x17, so every block with a handler declares those two clobbered (`rseq_asm!` does it for
/// the per-CPU operations).
macro_rules! rseq_abort {
    ($label:literal, $($insn:literal),*) => {
        concat!(
            ".pushsection __rseq_failure, \"ax\"\n",
            ".balign 4\n",
            ".inst 0xd428bc00\n",
            $label, ":\n",
            $($insn, "\n",)*
            ".popsection\n",
        )
    };
}

/// A delay loop at numbered point `$n` inside a section, built only with
/// `--cfg thiscpu_inject`: it spins for the count in `inject::DELAYS[$n]`, widening the window in
/// which preemption, migration or a signal aborts the section. Empty otherwise.
#[cfg(thiscpu_inject)]
macro_rules! inject {
    ($n:literal) => {
        concat!(
            "adrp {scratch}, {delays}\n",
            "add {scratch}, {scratch}, :lo12:{delays}\n",
            "ldr {scratch:w}, [{scratch}, #(4 * ",
            $n,
            ")]\n",
            "78:\n",
            "subs {scratch:w}, {scratch:w}, #1\n",
            "b.hs 78b\n",
        )
    };
}
#[cfg(not(thiscpu_inject))]
macro_rules! inject {
    ($n:literal) => {
        ""
    };
}

/// `asm!` for a restartable sequence: template pieces, then operands, then options. It declares
/// x16 and x17 clobbered (see `rseq_abort!`), and with `--cfg thiscpu_inject` adds the scratch
/// register and the delay table that `inject!` uses.
#[cfg(thiscpu_inject)]
macro_rules! rseq_asm {
    ($($template:expr),+ ; $($operands:tt)*) => {
        asm!(
            $($template),+,
            scratch = out(reg) _,
            delays = sym super::inject::DELAYS,
            out("x16") _,
            out("x17") _,
            $($operands)*
        )
    };
}
#[cfg(not(thiscpu_inject))]
macro_rules! rseq_asm {
    ($($template:expr),+ ; $($operands:tt)*) => {
        asm!($($template),+, out("x16") _, out("x17") _, $($operands)*)
    };
}

/// The opening of every section's frame: the active area's `cpu_id` address into `base`, the
/// address of the descriptor at label 3 into the area's `rseq_cs` (which arms the section),
/// then the start label 2. Uses the operands `base` and `cs` (scratch registers), `off` (the
/// `AreaOffset`) and `rseq_cs` (the field's offset from `cpu_id`).
macro_rules! rseq_arm {
    () => {
        concat!(
            "mrs {base}, tpidr_el0\n",
            "add {base}, {base}, {off}\n",
            "adrp {cs}, 3b\n",
            "add {cs}, {cs}, :lo12:3b\n",
            "stur {cs}, [{base}, #{rseq_cs}]\n",
            "2:\n",
        )
    };
}

/// `rseq_arm!`, then the section's first step: the comparison of the area's `FIELD` with the
/// index the caller read before the section, through the scratch register operand named
/// `$scratch`, branching to the Rust `abort` label if they differ (the thread migrated since;
/// list that label as an exit point). Also uses the operands `field` (the offset of `FIELD`
/// from `cpu_id`), `index` and `abort`.
macro_rules! rseq_arm_and_check {
    ($scratch:literal) => {
        concat!(
            rseq_arm!(),
            "ldur {",
            $scratch,
            ":w}, [{base}, #{field}]\n",
            "cmp {",
            $scratch,
            ":w}, {index:w}\n",
            "b.ne {abort}\n",
        )
    };
}

/// An `AreaOffset` leads to the area's `cpu_id` field, so that reading `cpu_id` takes one
/// register-offset load.
pub(crate) const AREA_OFFSET_FIELD: usize = offset::CPU_ID;

/// `RSEQ_SIG` for aarch64, the same in glibc, librseq and the kernel selftests: the data value
/// of the `brk #0x45e0` instruction word placed before each abort label, as the kernel reads it
/// (a data load, hence byte-swapped on big-endian aarch64, where instructions stay
/// little-endian). `rseq_abort!` emits that word as `.inst 0xd428bc00`.
pub(crate) const RSEQ_SIG: u32 = u32::from_le(0xd428_bc00);

// thiscpu's own rseq area lives in static TLS (`.tdata`), so its memory is released only
// after the kernel has reported the thread dead: an area registered by a thread that exits is
// never written into freed memory. Its initial image has `cpu_id = -1` (unregistered), so a
// thread reading it before registration always takes the slow path. It is `OWN_AREA_CAPACITY`
// bytes, aligned to as much, so that it can be registered in the kernel's optimized mode too
// (`abi::own_registration_size`). The symbol is global
// (hidden, so never exported from a shared object) because the `asm!` blocks that compute its
// offset may be placed in any codegen unit.
//
// The blank area follows it: 32 bytes with `cpu_id = -1` that no thread ever registers, so a
// fast path pointed at it always takes its slow path (see `arch::areas`).
//
// `__thiscpu_0_1_cpu_id_delta` is a table of `areas::COUNT` distances from the own area to the
// `cpu_id` field of the area each kind of read uses, the same for every thread (areas sit at
// one offset from every thread pointer). The active area's starts at 4, the own area's
// `cpu_id`, and is switched once to glibc's area when glibc registered; the node area's starts
// at the blank area's `cpu_id`. `__thiscpu_0_1_hot_words` follows the table, in the same line
// (see `arch::hot`). The names carry the crate version so that two versions in one binary
// never share them.
global_asm!(
    ".pushsection .tdata,\"awT\",%progbits",
    ".balign {capacity}",
    ".globl __thiscpu_0_1_own_area",
    ".hidden __thiscpu_0_1_own_area",
    ".type __thiscpu_0_1_own_area, %tls_object",
    ".size __thiscpu_0_1_own_area, {capacity}",
    "__thiscpu_0_1_own_area:",
    ".long 0, -1",
    ".quad 0",
    ".long 0, 0, 0, 0",
    ".zero {capacity} - 32",
    ".balign 32",
    ".globl __thiscpu_0_1_blank_area",
    ".hidden __thiscpu_0_1_blank_area",
    ".type __thiscpu_0_1_blank_area, %tls_object",
    ".size __thiscpu_0_1_blank_area, 32",
    "__thiscpu_0_1_blank_area:",
    ".long 0, -1",
    ".quad 0",
    ".long 0, 0, 0, 0",
    ".popsection",
    ".pushsection .data.__thiscpu_0_1_offsets,\"aw\",%progbits",
    ".balign 32",
    ".globl __thiscpu_0_1_cpu_id_delta",
    ".hidden __thiscpu_0_1_cpu_id_delta",
    "__thiscpu_0_1_cpu_id_delta:",
    ".quad {cpu_id}",
    ".quad __thiscpu_0_1_blank_area - __thiscpu_0_1_own_area + {cpu_id}",
    ".globl __thiscpu_0_1_hot_words",
    ".hidden __thiscpu_0_1_hot_words",
    "__thiscpu_0_1_hot_words:",
    ".zero {hot_bytes}",
    ".popsection",
    cpu_id = const offset::CPU_ID,
    capacity = const crate::abi::OWN_AREA_CAPACITY,
    hot_bytes = const 4 * hot::WORDS,
);

unsafe extern "C" {
    static __thiscpu_0_1_cpu_id_delta: [AtomicIsize; areas::COUNT];
}

const _: () = assert!(
    areas::ACTIVE == 0 && areas::NODE == 1 && areas::COUNT == 2,
    "the `global_asm!` above lays the delta table out in this order"
);

/// The thread pointer, `TPIDR_EL0`.
#[inline]
pub(crate) fn thread_pointer() -> usize {
    let tp: usize;
    // SAFETY: reading TPIDR_EL0 has no side effect; on Linux it holds the thread pointer of the
    // calling thread (the aarch64 TLS ABI), which glibc sets before any user code runs.
    unsafe {
        asm!("mrs {}, tpidr_el0", out(reg) tp, options(nomem, nostack, preserves_flags));
    }
    tp
}

/// The offset from the thread pointer to `$symbol`, a TLS symbol of this module: the
/// initial-exec TLS sequence (a link-time constant in executables, one GOT load in shared
/// objects).
macro_rules! tls_offset {
    ($symbol:literal) => {{
        let offset: isize;
        // SAFETY: the initial-exec access to a TLS symbol of this module: it reads the
        // symbol's thread-pointer offset from the GOT (or, once the linker relaxed it, builds
        // the constant); no other memory is touched.
        unsafe {
            asm!(
                concat!("adrp {o}, :gottprel:", $symbol),
                concat!("ldr {o}, [{o}, :gottprel_lo12:", $symbol, "]"),
                o = out(reg) offset,
                options(pure, readonly, nostack, preserves_flags),
            );
        }
        offset
    }};
}

/// Offset from the thread pointer to thiscpu's own static-TLS area.
#[inline]
pub(crate) fn own_area_offset() -> isize {
    tls_offset!("__thiscpu_0_1_own_area")
}

/// Offset from the thread pointer to the blank area (see the module's `global_asm!`).
#[inline]
pub(crate) fn blank_area_offset() -> isize {
    tls_offset!("__thiscpu_0_1_blank_area")
}

/// Points the reads of kind `AREA` (one of the `arch::areas` indexes) at another area, e.g.
/// glibc's. Every thread must have a live, 32-byte area at that offset from its thread pointer.
pub(crate) fn set_area_offset<const AREA: usize>(offset: isize) {
    let delta = offset - own_area_offset() + AREA_OFFSET_FIELD as isize;
    // SAFETY: the table is `areas::COUNT` 8-byte aligned words in `.data`, only accessed
    // atomically; AREA indexes it (checked).
    unsafe { __thiscpu_0_1_cpu_id_delta[AREA].store(delta, Ordering::Relaxed) }
}

/// The active area's position, loaded once before a section so that the CPU read and the
/// section use the same area: the offset from the thread pointer to its `cpu_id` field (not
/// to its start, so that reading `cpu_id` takes one register-offset load).
#[inline(always)]
pub(crate) fn area_offset() -> AreaOffset {
    area_offset_of::<{ areas::ACTIVE }>()
}

/// The offset from the thread pointer to the `cpu_id` field of the area that reads of kind
/// `AREA` (one of the `arch::areas` indexes) use.
#[inline(always)]
pub(crate) fn area_offset_of<const AREA: usize>() -> AreaOffset {
    const { assert!(AREA < areas::COUNT) };
    let offset: isize;
    // SAFETY: the own area's offset (see `own_area_offset`) plus a relaxed load of an aligned
    // word of the delta table in `.data`, which only `set_area_offset` writes, atomically, and
    // AREA indexes (checked at compile time). In one `asm!` because a Rust load of the extern
    // static goes through the GOT (one more instruction on the fast path).
    unsafe {
        asm!(
            "adrp {o}, :gottprel:__thiscpu_0_1_own_area",
            "ldr {o}, [{o}, :gottprel_lo12:__thiscpu_0_1_own_area]",
            "adrp {d}, __thiscpu_0_1_cpu_id_delta + {at}",
            "ldr {d}, [{d}, :lo12:__thiscpu_0_1_cpu_id_delta + {at}]",
            "add {o}, {o}, {d}",
            o = out(reg) offset,
            d = out(reg) _,
            at = const 8 * AREA,
            options(readonly, nostack, preserves_flags),
        );
    }
    AreaOffset(offset)
}

/// The hot word `WORD` (one of the `arch::hot` indexes): a page address and one load.
#[inline(always)]
pub(crate) fn hot_word<const WORD: usize>() -> u32 {
    const { assert!(WORD < hot::WORDS) };
    let value: u32;
    // SAFETY: the table is `hot::WORDS` aligned 32-bit words in `.data` (the `global_asm!`
    // above), written only atomically (`arch::set_hot_word`); WORD is in range (checked at
    // compile time), so this is one aligned, hence single-copy atomic, load inside it.
    unsafe {
        asm!(
            "adrp {a}, __thiscpu_0_1_hot_words + {at}",
            "ldr {v:w}, [{a}, :lo12:__thiscpu_0_1_hot_words + {at}]",
            a = out(reg) _,
            v = lateout(reg) value,
            at = const 4 * WORD,
            options(nostack, readonly, preserves_flags),
        );
    }
    value
}

/// The 32-bit field `FIELD` (`cpu_id`, `node_id` or `mm_cid`) of the area whose `cpu_id` is at
/// `offset` (from `area_offset`).
#[inline(always)]
pub(crate) fn field_at<const FIELD: usize>(offset: AreaOffset) -> i32 {
    let value: i32;
    if FIELD == offset::CPU_ID {
        // SAFETY: a `AreaOffset` always names the `cpu_id` field of a live area in the
        // calling thread (see its definition in `arch`); one naturally aligned 32-bit load.
        unsafe {
            asm!(
                "mrs {tp}, tpidr_el0",
                "ldr {v:w}, [{tp}, {off}]",
                off = in(reg) offset.0,
                tp = out(reg) _,
                v = lateout(reg) value,
                options(readonly, nostack, preserves_flags),
            );
        }
    } else {
        // SAFETY: as above; FIELD is one of the `abi::offset` constants, an aligned 32-bit
        // field inside the 32-byte area.
        unsafe {
            asm!(
                "mrs {tp}, tpidr_el0",
                "add {tp}, {tp}, {off}",
                "ldur {v:w}, [{tp}, #{field}]",
                off = in(reg) offset.0,
                tp = out(reg) _,
                v = lateout(reg) value,
                field = const FIELD as isize - offset::CPU_ID as isize,
                options(readonly, nostack, preserves_flags),
            );
        }
    }
    value
}

/// The 32-bit field `FIELD` of the active area, read alone: `field_at(area_offset())`, which is
/// already the shortest form here (the `add` of the two words is needed either way).
#[inline(always)]
pub(crate) fn active_field<const FIELD: usize>() -> i32 {
    field_at::<FIELD>(area_offset())
}

/// Reads `cpu_id` and `node_id` inside one restartable sequence, so both come from the same
/// scheduling interval: any preemption, migration or signal between the two loads sends the
/// thread to the abort label, and the pair is discarded. Returns `None` when aborted, and a
/// negative cpu when the area is not registered (the blank area never is). The abort handler
/// marks the cpu with `i32::MIN`, which no area holds, rather than setting a flag of its own:
/// then one sign test of the cpu rejects both an abort and an unregistered area.
#[inline]
pub(crate) fn load_cpu_node(offset: AreaOffset) -> Option<(i32, u32)> {
    let cpu: i32;
    let node: u32;
    // SAFETY: the section only loads from this thread's area and stores the descriptor address
    // into its `rseq_cs` field, as the rseq ABI prescribes; the descriptor and the abort
    // handler (preceded by the signature) are emitted alongside, and every instruction between
    // start (label 2) and post-commit (label 4) lies inside the described range. The handler
    // writes only `cpu` and branches back to label 4.
    unsafe {
        asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_arm!(),
            "ldr {cpu:w}, [{base}]",
            "ldur {node:w}, [{base}, #{node_id}]",
            "4:",
            rseq_abort!("5", "mov {cpu:w}, #{aborted}", "b 4b"),
            off = in(reg) offset.0,
            base = out(reg) _,
            cs = out(reg) _,
            cpu = out(reg) cpu,
            node = out(reg) node,
            aborted = const i32::MIN,
            rseq_cs = const offset::RSEQ_CS - offset::CPU_ID,
            node_id = const offset::NODE_ID - offset::CPU_ID,
            out("x16") _,
            out("x17") _,
            options(nostack, preserves_flags),
        );
    }
    (cpu != i32::MIN).then_some((cpu, node))
}

/// aarch64 has no instruction that tells user space the Linux CPU number: `MPIDR_EL1` is the
/// hardware's affinity, not Linux's numbering, and reading it from user space traps to the
/// kernel anyway.
pub(crate) const NATIVE_CPU_READ: Option<NativeCpuRead> = None;

/// None either: aarch64's counter register (`CNTVCT_EL0`) carries no CPU id.
pub(crate) const NATIVE_CPU_READ_WITH_CLOCK: Option<NativeCpuRead> = None;

// Every section below has the same frame: the descriptor (label 3, `rseq_descriptor!`), the
// arming store of its address into `rseq_cs` (the `cpu_id` field's address plus 4), the start
// (label 2), the comparison of the area's `FIELD` with the index the caller read before the
// section (any migration since then branches to the Rust `abort` label, listed as an exit
// point; these three are `rseq_arm_and_check!`), the
// operation, the single committing store, the post-commit label 4, and the abort handler at
// label 5 in `__rseq_failure`, preceded by the signature. The abort handler only branches to
// the Rust `abort` label: no register the section wrote is needed there. Conditional branches
// leave only to labels of the same function (their range is ±1 MiB, with no veneers).

/// `*v += count`: load, add, and commit with one `str`. See `ops::load_add_store`.
///
/// # Safety
/// `offset` and `index` were read from this thread's area (`offset` by `area_offset`,
/// `index` from `FIELD`), and `v` is valid for reads and writes of a `u64` that only sections
/// indexed by `index` write.
#[inline(always)]
pub(crate) unsafe fn load_add_store<const FIELD: usize>(
    offset: AreaOffset,
    index: u32,
    v: *mut u64,
    count: u64,
) -> Outcome<()> {
    // SAFETY: the caller's contract; the section follows the frame described above. The load
    // and add are safe to abandon; only the final `str` changes memory.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{abort}"),
            rseq_arm_and_check!("cur"),
            inject!(1),
            "ldr {cur}, [{v}]",
            "add {cur}, {cur}, {count}",
            "str {cur}, [{v}]",
            "4:",
            rseq_abort!("5", "b {abort}");
            off = in(reg) offset.0,
            index = in(reg) index,
            v = in(reg) v,
            count = in(reg) count,
            base = out(reg) _,
            cs = out(reg) _,
            cur = out(reg) _,
            rseq_cs = const offset::RSEQ_CS - offset::CPU_ID,
            field = const FIELD as isize - offset::CPU_ID as isize,
            abort = label { return Outcome::Aborted; },
            options(nostack),
        );
    }
    Outcome::Committed(())
}

/// If `*v == expect`, `*v = newv`, committed with a store-release (`stlr`: `list_push`
/// publishes nodes through it, see the module's memory ordering). See `ops::load_cbne_store`.
///
/// # Safety
/// As for `load_add_store`.
#[inline(always)]
pub(crate) unsafe fn load_cbne_store<const FIELD: usize>(
    offset: AreaOffset,
    index: u32,
    v: *mut u64,
    expect: u64,
    newv: u64,
) -> Outcome<()> {
    // SAFETY: the caller's contract; the section follows the frame described above, and its
    // early exits (labels `mismatch` and `abort`) are listed as exit points.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{abort}"),
            rseq_exit_point!("2", "{mismatch}"),
            rseq_arm_and_check!("cur"),
            "ldr {cur}, [{v}]",
            "cmp {cur}, {expect}",
            "b.ne {mismatch}",
            inject!(1),
            "stlr {newv}, [{v}]",
            "4:",
            rseq_abort!("5", "b {abort}");
            off = in(reg) offset.0,
            index = in(reg) index,
            v = in(reg) v,
            expect = in(reg) expect,
            newv = in(reg) newv,
            base = out(reg) _,
            cs = out(reg) _,
            cur = out(reg) _,
            rseq_cs = const offset::RSEQ_CS - offset::CPU_ID,
            field = const FIELD as isize - offset::CPU_ID as isize,
            mismatch = label { return Outcome::Mismatch; },
            abort = label { return Outcome::Aborted; },
            options(nostack),
        );
    }
    Outcome::Committed(())
}

/// Pops the head of a singly linked list: `h = *head; if h == 0 leave; *out = h;
/// *head = *(h + NEXT)`, committed with one `str`. See `ops::load_cbeq_load_store`.
///
/// # Safety
/// As for `load_add_store`, for the word at `head`; every non-null value stored there points to
/// a node whose word at byte offset `NEXT` is readable; `out` is valid for a pointer write.
#[inline(always)]
pub(crate) unsafe fn load_cbeq_load_store<const FIELD: usize, const NEXT: usize>(
    offset: AreaOffset,
    index: u32,
    head: *mut usize,
    out: *mut usize,
) -> Outcome<()> {
    // `ldr Xt, [Xn, #imm]` reaches 0..=32760 in steps of 8; the assembler takes an offset below
    // 256 that is not a multiple of 8 as `ldur`, and refuses any other with a message that
    // names neither NEXT nor this function.
    const {
        assert!(
            NEXT < 256 || (NEXT.is_multiple_of(8) && NEXT <= 32760),
            "load_cbeq_load_store: on aarch64, NEXT (the byte offset of a node's `next` field) \
             must be below 256, or a multiple of 8 no greater than 32760"
        )
    };
    // SAFETY: the caller's contract; the section follows the frame described above; the store
    // to `out` before the commit is harmless if the section aborts (the caller only reads `out`
    // after a commit). The load of `next` depends on the loaded head's address, so it is
    // ordered after it without a barrier.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{abort}"),
            rseq_exit_point!("2", "{empty}"),
            rseq_arm_and_check!("node"),
            "ldr {node}, [{head}]",
            "cbz {node}, {empty}",
            "str {node}, [{out}]",
            inject!(1),
            "ldr {node}, [{node}, #{next}]",
            inject!(2),
            "str {node}, [{head}]",
            "4:",
            rseq_abort!("5", "b {abort}");
            off = in(reg) offset.0,
            index = in(reg) index,
            head = in(reg) head,
            out = in(reg) out,
            base = out(reg) _,
            node = out(reg) _,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS - offset::CPU_ID,
            field = const FIELD as isize - offset::CPU_ID as isize,
            next = const NEXT,
            empty = label { return Outcome::Mismatch; },
            abort = label { return Outcome::Aborted; },
            options(nostack),
        );
    }
    Outcome::Committed(())
}

// Guarded array stacks (the pool's per-CPU caches, `crate::pool`). Each CPU's stack is a
// `StackHead` (a `count` word and a `stopped` word on one cache line) and an array of
// `capacity` object pointers. Both sections follow the frame above, and then, first thing after
// the CPU check, load `stopped` and leave through the `stopped` exit if it is not zero: a
// drainer on another CPU sets it, fences this CPU with membarrier (which aborts every section
// already past this check), and only then reads and resets the stack. The count is the single
// committed word; the slot written by a push lies beyond the committed count until the commit,
// so an abort leaves only an invisible stale slot.
//
// Memory ordering:
// - `stopped` is loaded with `ldar` (load-acquire): a drainer stores `count = 0` and then
//   clears `stopped` with a store-release; a section that sees the flag clear must not have
//   read `count` or a slot before it, and a control dependency (the `cbnz`) orders no loads.
// - The push commits `count` with `stlr` (store-release): the slot store and the object's
//   contents must be visible to a drainer on another CPU before the count that covers them.
//   The membarrier IPI's full barrier orders them too; the release keeps the section correct
//   on its own, as librseq's RELEASE variants do.
// - The pop commits with a plain `str`: only this CPU reads the count back, and a drainer is
//   ordered after it by the membarrier IPI's full barrier.
// `ldar`/`stlr` take a bare base register, so the callers' field addresses are computed
// before the section.

/// The addresses of a stack head's `count` and `stopped` words.
#[inline(always)]
fn stack_words(head: *const StackHead) -> (*const u64, *const u64) {
    (
        head.wrapping_byte_add(StackHead::COUNT).cast(),
        head.wrapping_byte_add(StackHead::STOPPED).cast(),
    )
}

/// Guarded push: `if head.stopped != 0 leave(Stopped); n = head.count; if n >= capacity
/// leave(Refused); slots[n] = item; commit head.count = n + 1` (with `stlr`).
///
/// # Safety
/// `offset` and `index` were read from this thread's area (`index` from `FIELD`); `head` and
/// `slots` (valid for `capacity` pointer-sized words) are CPU `index`'s stack, whose `count`
/// and slots only sections indexed by `index` write, or a drainer after a fence of that CPU
/// while `stopped` is set.
#[inline(always)]
pub(crate) unsafe fn stack_push<const FIELD: usize>(
    offset: AreaOffset,
    index: u32,
    head: *const StackHead,
    slots: *mut usize,
    capacity: u64,
    item: usize,
) -> StackOutcome {
    let (count, stopped) = stack_words(head);
    // SAFETY: the caller's contract; the section follows the frame described above; its three
    // early exits are listed as exit points; the slot store lands beyond the committed count
    // (n < capacity is checked first), so an aborted push leaves nothing visible.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{abort}"),
            rseq_exit_point!("2", "{stopped}"),
            rseq_exit_point!("2", "{refused}"),
            rseq_arm_and_check!("n"),
            "ldar {n}, [{stopped_at}]",
            "cbnz {n}, {stopped}",
            inject!(3),
            "ldr {n}, [{count_at}]",
            "cmp {n}, {capacity}",
            "b.hs {refused}",
            "str {item}, [{slots}, {n}, lsl #3]",
            inject!(1),
            "add {n}, {n}, #1",
            "stlr {n}, [{count_at}]",
            "4:",
            rseq_abort!("5", "b {abort}");
            off = in(reg) offset.0,
            index = in(reg) index,
            count_at = in(reg) count,
            stopped_at = in(reg) stopped,
            slots = in(reg) slots,
            capacity = in(reg) capacity,
            item = in(reg) item,
            base = out(reg) _,
            n = out(reg) _,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS - offset::CPU_ID,
            field = const FIELD as isize - offset::CPU_ID as isize,
            stopped = label { return StackOutcome::Stopped; },
            refused = label { return StackOutcome::Refused; },
            abort = label { return StackOutcome::Aborted; },
            options(nostack),
        );
    }
    StackOutcome::Committed
}

/// Guarded pop: `if head.stopped != 0 leave(Stopped); n = head.count; if n == 0
/// leave(Refused); item = slots[n - 1]; commit head.count = n - 1`. Returns the outcome and
/// `item`, which is meaningful only when committed.
///
/// Unlike x86_64, the item goes through a local in memory and the exits are Rust labels: an
/// `asm!` that jumps to Rust labels cannot have outputs (`asm_goto_with_outputs` is unstable),
/// and exits that set a code instead would need stubs outside the section within reach of its
/// conditional branches (±1 MiB, so not in `__rseq_failure`, which the linker may place
/// further away in a large binary), hence a branch over them on the path that commits.
///
/// # Safety
/// As for `stack_push`.
#[inline(always)]
pub(crate) unsafe fn stack_pop<const FIELD: usize>(
    offset: AreaOffset,
    index: u32,
    head: *const StackHead,
    slots: *const usize,
) -> (StackOutcome, usize) {
    let (count, stopped) = stack_words(head);
    let mut item = 0usize;
    let out: *mut usize = &mut item;
    // SAFETY: the caller's contract; the section follows the frame described above; its three
    // early exits are listed as exit points; the store to `out` (a local) before the commit is
    // harmless if the section aborts.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{abort}"),
            rseq_exit_point!("2", "{stopped}"),
            rseq_exit_point!("2", "{refused}"),
            rseq_arm_and_check!("n"),
            "ldar {n}, [{stopped_at}]",
            "cbnz {n}, {stopped}",
            inject!(3),
            "ldr {n}, [{count_at}]",
            "cbz {n}, {refused}",
            "sub {n}, {n}, #1",
            "ldr {item}, [{slots}, {n}, lsl #3]",
            "str {item}, [{out}]",
            inject!(2),
            "str {n}, [{count_at}]",
            "4:",
            rseq_abort!("5", "b {abort}");
            off = in(reg) offset.0,
            index = in(reg) index,
            count_at = in(reg) count,
            stopped_at = in(reg) stopped,
            slots = in(reg) slots,
            out = in(reg) out,
            base = out(reg) _,
            n = out(reg) _,
            item = out(reg) _,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS - offset::CPU_ID,
            field = const FIELD as isize - offset::CPU_ID as isize,
            stopped = label { return (StackOutcome::Stopped, 0); },
            refused = label { return (StackOutcome::Refused, 0); },
            abort = label { return (StackOutcome::Aborted, 0); },
            options(nostack),
        );
    }
    (StackOutcome::Committed, item)
}

// Batches: the allocator's slow paths move up to a batch of objects between a CPU's stack and
// a buffer of the caller's in one section, as on x86_64: the guarded stacks' frame, `stopped`
// check (with `ldar`) and single committing store of the count (a push's with `stlr`), and
// between them a loop that copies the words. An abort leaves the stack as it was and the
// caller reads nothing the section wrote; `k` goes back through a local, stored before the
// commit.

/// Guarded batch pop: `if head.stopped != 0 leave(Stopped); n = head.count; if n == 0
/// leave(Refused); k = min(n, max); out[..k] = slots[n - k..n]; commit head.count = n - k`.
/// Returns the outcome and `k`, which is meaningful only when committed (0 when `max` is 0).
///
/// # Safety
/// As for `stack_push`; `out` is valid for `max` writes and only the calling thread uses it.
#[inline]
pub(crate) unsafe fn stack_pop_batch<const FIELD: usize>(
    offset: AreaOffset,
    index: u32,
    head: *const StackHead,
    slots: *const usize,
    out: *mut usize,
    max: usize,
) -> (StackOutcome, usize) {
    if max == 0 {
        return (StackOutcome::Committed, 0);
    }
    let (count, stopped) = stack_words(head);
    let mut taken = 0usize;
    let taken_at: *mut usize = &mut taken;
    // SAFETY: the caller's contract; the section follows the frame described above and writes
    // nothing shared but the count (its commit) and the area's `rseq_cs`; the copy reads slots
    // below the count and writes the caller's `out` and `taken`, which an abort leaves unread;
    // `k` is at least 1 when the loop starts (n != 0, max != 0), so it ends at 0.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{abort}"),
            rseq_exit_point!("2", "{stopped}"),
            rseq_exit_point!("2", "{refused}"),
            rseq_arm_and_check!("n"),
            "ldar {n}, [{stopped_at}]",
            "cbnz {n}, {stopped}",
            inject!(3),
            "ldr {n}, [{count_at}]",
            "cbz {n}, {refused}",
            "cmp {n}, {k}",
            "csel {k}, {n}, {k}, lo",
            "sub {n}, {n}, {k}",
            "str {k}, [{taken_at}]",
            "add {from}, {from}, {n}, lsl #3",
            "8:",
            "sub {k}, {k}, #1",
            "ldr {word}, [{from}, {k}, lsl #3]",
            "str {word}, [{out}, {k}, lsl #3]",
            "cbnz {k}, 8b",
            inject!(2),
            "str {n}, [{count_at}]",
            "4:",
            rseq_abort!("5", "b {abort}");
            off = in(reg) offset.0,
            index = in(reg) index,
            count_at = in(reg) count,
            stopped_at = in(reg) stopped,
            from = inout(reg) slots => _,
            out = in(reg) out,
            taken_at = in(reg) taken_at,
            k = inout(reg) max => _,
            base = out(reg) _,
            n = out(reg) _,
            word = out(reg) _,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS - offset::CPU_ID,
            field = const FIELD as isize - offset::CPU_ID as isize,
            stopped = label { return (StackOutcome::Stopped, 0); },
            refused = label { return (StackOutcome::Refused, 0); },
            abort = label { return (StackOutcome::Aborted, 0); },
            options(nostack),
        );
    }
    (StackOutcome::Committed, taken)
}

/// Guarded batch push: `if head.stopped != 0 leave(Stopped); n = head.count; if n >= capacity
/// leave(Refused); k = min(capacity - n, len); slots[n..n + k] = items[len - k..len]; commit
/// head.count = n + k` (with `stlr`). Returns the outcome and `k`, which is meaningful only
/// when committed (0 when `len` is 0): the caller keeps `items[..len - k]`.
///
/// # Safety
/// As for `stack_push`; `items` is valid for `len` reads.
#[inline]
pub(crate) unsafe fn stack_push_batch<const FIELD: usize>(
    offset: AreaOffset,
    index: u32,
    head: *const StackHead,
    slots: *mut usize,
    capacity: u64,
    items: *const usize,
    len: usize,
) -> (StackOutcome, usize) {
    if len == 0 {
        return (StackOutcome::Committed, 0);
    }
    let (count, stopped) = stack_words(head);
    let mut pushed = 0usize;
    let pushed_at: *mut usize = &mut pushed;
    // SAFETY: the caller's contract; the section follows the frame described above; the
    // words land in slots from the count up to below the capacity (k <= capacity - n), beyond
    // the committed count, so an aborted push leaves nothing visible, and the `stlr` commit
    // orders them (and the objects' contents) before the count; `k` is at least 1 when the
    // loop starts (n < capacity, len != 0), so it ends at 0.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{abort}"),
            rseq_exit_point!("2", "{stopped}"),
            rseq_exit_point!("2", "{refused}"),
            rseq_arm_and_check!("n"),
            "ldar {n}, [{stopped_at}]",
            "cbnz {n}, {stopped}",
            inject!(3),
            "ldr {n}, [{count_at}]",
            "cmp {n}, {k}",
            "b.hs {refused}",
            "sub {k}, {k}, {n}",
            "cmp {k}, {len}",
            "csel {k}, {len}, {k}, hi",
            "str {k}, [{pushed_at}]",
            "add {to}, {to}, {n}, lsl #3",
            "sub {from}, {from}, {k}, lsl #3",
            "add {n}, {n}, {k}",
            "8:",
            "sub {k}, {k}, #1",
            "ldr {word}, [{from}, {k}, lsl #3]",
            "str {word}, [{to}, {k}, lsl #3]",
            "cbnz {k}, 8b",
            inject!(1),
            "stlr {n}, [{count_at}]",
            "4:",
            rseq_abort!("5", "b {abort}");
            off = in(reg) offset.0,
            index = in(reg) index,
            count_at = in(reg) count,
            stopped_at = in(reg) stopped,
            to = inout(reg) slots => _,
            from = inout(reg) items.wrapping_add(len) => _,
            len = in(reg) len,
            k = inout(reg) capacity => _,
            pushed_at = in(reg) pushed_at,
            base = out(reg) _,
            n = out(reg) _,
            word = out(reg) _,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS - offset::CPU_ID,
            field = const FIELD as isize - offset::CPU_ID as isize,
            stopped = label { return (StackOutcome::Stopped, 0); },
            refused = label { return (StackOutcome::Refused, 0); },
            abort = label { return (StackOutcome::Aborted, 0); },
            options(nostack),
        );
    }
    (StackOutcome::Committed, pushed)
}

// The allocator's stacks, indexed inside the section: as on x86_64, the section reads
// `cpu_id` itself after arming and finds that CPU's stack `cpu << shift` bytes after CPU 0's,
// so nothing is read before it or checked in it. An unregistered area reads -1 (or -2), which
// the unsigned comparison with `cpus` sends out like a CPU without a stack. `stopped` is loaded
// with `ldar` and a push commits with `stlr`, as above; both take a bare base register, so the
// count is the head's first word.
const _: () = assert!(StackHead::COUNT == 0);

/// Guarded pop from the stack of the CPU the section runs on (see `ops::stack_pop_here`): the
/// item, or 0 if the section left or aborted. The item comes back in a register: the early
/// exits go to the end label with the register still 0, and the abort handler clears it.
///
/// # Safety
/// `offset` names the calling thread's area; for every CPU `c < cpus`, `head + (c << shift)`
/// and `slots + (c << shift)` (bytes) are CPU `c`'s stack, whose count and slots only
/// sections running on `c` write, or a drainer after a fence of `c` while `stopped` is set.
#[inline(always)]
pub(crate) unsafe fn stack_pop_here(
    offset: AreaOffset,
    cpus: u64,
    shift: u32,
    head: *const StackHead,
    slots: *const usize,
) -> usize {
    let item: usize;
    // SAFETY: the caller's contract; the section arms itself before it reads `cpu_id`, writes
    // nothing but the count (its commit) and the area's `rseq_cs`, and indexes only stacks of
    // CPUs below `cpus`; its early exits go to its end (listed as an exit point) and its abort
    // handler only clears the item and branches there too.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "4f"),
            "mov {item}, xzr",
            rseq_arm!(),
            "ldr {cpu:w}, [{base}]",
            "cmp {cpu}, {cpus}",
            "b.hs 4f",
            "lsl {cpu}, {cpu}, {shift}",
            "add {base}, {head}, {cpu}",
            "add {n}, {base}, #{stopped_at}",
            "ldar {n}, [{n}]",
            "cbnz {n}, 4f",
            inject!(3),
            "ldr {n}, [{base}]",
            "cbz {n}, 4f",
            "sub {n}, {n}, #1",
            "add {cpu}, {slots}, {cpu}",
            "ldr {item}, [{cpu}, {n}, lsl #3]",
            inject!(2),
            "str {n}, [{base}]",
            "4:",
            rseq_abort!("5", "mov {item}, xzr", "b 4b");
            off = in(reg) offset.0,
            cpus = in(reg) cpus,
            shift = in(reg) u64::from(shift),
            head = in(reg) head,
            slots = in(reg) slots,
            base = out(reg) _,
            cpu = out(reg) _,
            n = out(reg) _,
            item = out(reg) item,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS - offset::CPU_ID,
            stopped_at = const StackHead::STOPPED,
            options(nostack),
        );
    }
    item
}

/// Guarded push onto the stack of the CPU the section runs on (see `ops::stack_push_here`),
/// committed with `stlr`.
///
/// # Safety
/// As for [`stack_pop_here`], with every CPU's slots valid for `capacity` words.
#[inline(always)]
pub(crate) unsafe fn stack_push_here(
    offset: AreaOffset,
    cpus: u64,
    shift: u32,
    head: *const StackHead,
    slots: *mut usize,
    capacity: u64,
    item: usize,
) -> StackOutcome {
    // SAFETY: the caller's contract; the section arms itself before it reads `cpu_id` and
    // indexes only stacks of CPUs below `cpus`; its three early exits are listed as exit
    // points; the slot store lands beyond the committed count (n < capacity is checked
    // first), so an aborted push leaves nothing visible.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{outside}"),
            rseq_exit_point!("2", "{stopped}"),
            rseq_exit_point!("2", "{refused}"),
            rseq_arm!(),
            "ldr {cpu:w}, [{base}]",
            "cmp {cpu}, {cpus}",
            "b.hs {outside}",
            "lsl {cpu}, {cpu}, {shift}",
            "add {base}, {head}, {cpu}",
            "add {n}, {base}, #{stopped_at}",
            "ldar {n}, [{n}]",
            "cbnz {n}, {stopped}",
            inject!(3),
            "ldr {n}, [{base}]",
            "cmp {n}, {capacity}",
            "b.hs {refused}",
            "add {cpu}, {slots}, {cpu}",
            "str {item}, [{cpu}, {n}, lsl #3]",
            inject!(1),
            "add {n}, {n}, #1",
            "stlr {n}, [{base}]",
            "4:",
            rseq_abort!("5", "b {outside}");
            off = in(reg) offset.0,
            cpus = in(reg) cpus,
            shift = in(reg) u64::from(shift),
            head = in(reg) head,
            slots = in(reg) slots,
            capacity = in(reg) capacity,
            item = in(reg) item,
            base = out(reg) _,
            cpu = out(reg) _,
            n = out(reg) _,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS - offset::CPU_ID,
            stopped_at = const StackHead::STOPPED,
            stopped = label { return StackOutcome::Stopped; },
            refused = label { return StackOutcome::Refused; },
            outside = label { return StackOutcome::Aborted; },
            options(nostack),
        );
    }
    StackOutcome::Committed
}

/// Whether `offset` can be an initial-exec TLS offset (checked by the contract's tests): with
/// Variant I TLS the static TLS blocks lie above the 16-byte thread control block.
#[cfg(test)]
pub(crate) fn is_static_tls_offset(offset: isize) -> bool {
    offset >= 16
}
