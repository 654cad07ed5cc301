//! riscv64: the thread pointer is the `tp` register (x4), rseq fields are loaded from it with
//! a base register and a 12-bit displacement, and the abort signature is `0xf1401073`, the
//! encoding of `csrw mhartid, zero`, emitted as a data word right before each abort label: a
//! write to a machine-mode register, which traps in user mode if it is ever executed. (riscv has
//! no trap instruction with an immediate field, so `ebreak` cannot carry a signature.)
//!
//! Reviewed against the kernel's riscv64 rseq support: `arch/riscv/Kconfig` (`select
//! HAVE_RSEQ`), `arch/riscv/kernel/signal.c` (`rseq_signal_deliver` in `handle_signal`, after
//! the system call restart is settled), `kernel/rseq.c` (the descriptor checks, and the
//! signature as the 32-bit word at `abort_ip - 4`, read with `get_user`),
//! `include/uapi/linux/rseq.h` (the layouts), and the selftests' riscv header
//! `tools/testing/selftests/rseq/rseq-riscv.h` with its `rseq-riscv-bits.h` (the signature, an
//! abort handler aligned to 4 behind its `.long` signature, `fence`s for acquire and release),
//! as does librseq's `include/rseq/arch/riscv.h`. The selftests support little-endian riscv
//! only, as this file does.
//!
//! # Where the active area is
//! As on aarch64: the own area's offset from the thread pointer by the initial-exec sequence
//! (`la.tls.ie`: `auipc` of the GOT entry's page and `ld` of the entry; GNU ld fills the entry
//! at link time in an executable and the dynamic loader fills it in a shared object, and it
//! keeps the load either way, since it has no TLS relaxation for riscv), plus a data word that
//! holds the distance from the own area to the active area's `cpu_id` field (`auipc`/`ld`),
//! added. A data word holding the TLS offset itself would need a TPREL data relocation, which
//! does not exist for riscv. Its static value, 4, names the own area's `cpu_id`, whose initial
//! image is -1, so every read before the process-wide decision takes the slow path; it is
//! switched once to glibc's area when glibc registered.
//!
//! The fast path of `current_cpu` is therefore the own offset (2 instructions), the delta word
//! (2), `add`, `add` of `tp` (riscv has no register-plus-register addressing) and the `lw` of
//! `cpu_id`, then a `sext.w` that LLVM adds (it cannot know that the 32-bit output of an
//! `asm!` is sign-extended already, as `lw` leaves it): 8 instructions and the sign test, where
//! the kernel's `raw_smp_processor_id` needs 1 (a load from `tp`, which holds the task in the
//! kernel). The 6 extra ones buy an area that works in a shared object and follows glibc's
//! registration.
//!
//! # The CPU's own id instruction
//! There is none: `mhartid` is the hardware thread's id, not Linux's CPU number, and only
//! machine mode reads it; `time` and `cycle` carry no CPU id. Both native reads of the contract
//! are `None`, so the fallback for a thread without rseq is the vDSO's `getcpu` (which enters
//! the kernel on riscv) or the system call.
//!
//! # Memory ordering (RVWMO)
//! - The store that arms a section and the loads of `cpu_id`/`mm_cid` are plain, as on the
//!   other architectures: only the kernel touches them, for this thread, when it interrupts it.
//! - `load_add_store` and `load_cbeq_load_store` commit with a plain `sd`: the word belongs to
//!   one CPU, is written only by sections running there, and publishes nothing else.
//! - `load_cbne_store` commits with `fence rw, w` then `sd` (a store-release in RVWMO's
//!   mapping), because `list_push` publishes a node through it. The fence lies inside the
//!   section, before the commit, so an abort after it is still harmless.
//! - The pool's guarded stacks load `stopped` with `ld` then `fence r, rw` (a load-acquire) and
//!   commit a push with `fence rw, w` then `sd`; the comment above `stack_push` says why.
//! - None of these is an atomic read-modify-write: no `amo*`, no `lr`/`sc`.
//!
//! # Reach of the branches
//! The abort handlers sit in `__rseq_failure`, which the linker may place further away than a
//! `j` reaches (±1 MiB), so they leave with `tail` (`auipc`/`jr` through t1, ±2 GiB, relaxed to
//! a `j` by the linker where that reaches): every block with a handler declares t1 (x6)
//! clobbered (`rseq_asm!` does it for the per-CPU operations). The conditional branches of a
//! section go only to Rust labels of the same (inlined) function, which lie within the ±4 KiB
//! that a `b*` reaches: they are the function's own short returns.
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
/// signature word, followed by the given instructions. Out of line, so the committing path
/// runs no jump over it. Aligned to 4 explicitly: the kernel reads the signature as an aligned
/// word, and with compressed instructions a pushed section need not start on 4.
macro_rules! rseq_abort {
    ($label:literal, $($insn:literal),*) => {
        concat!(
            ".pushsection __rseq_failure, \"ax\"\n",
            ".balign 4\n",
            ".long 0xf1401073\n",
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
            "lla {scratch}, {delays}\n",
            "lwu {scratch}, 4*",
            $n,
            "({scratch})\n",
            "78:\n",
            "beqz {scratch}, 79f\n",
            "addi {scratch}, {scratch}, -1\n",
            "j 78b\n",
            "79:\n",
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
/// t1 (x6) clobbered (see `rseq_abort!`), and with `--cfg thiscpu_inject` adds the scratch
/// register and the delay table that `inject!` uses.
#[cfg(thiscpu_inject)]
macro_rules! rseq_asm {
    ($($template:expr),+ ; $($operands:tt)*) => {
        asm!(
            $($template),+,
            scratch = out(reg) _,
            delays = sym super::inject::DELAYS,
            out("x6") _,
            $($operands)*
        )
    };
}
#[cfg(not(thiscpu_inject))]
macro_rules! rseq_asm {
    ($($template:expr),+ ; $($operands:tt)*) => {
        asm!($($template),+, out("x6") _, $($operands)*)
    };
}

/// The opening of every section's frame: the active area's `cpu_id` address into `base`, the
/// address of the descriptor at label 3 into the area's `rseq_cs` (which arms the section),
/// then the start label 2. Uses the operands `base` and `cs` (scratch registers), `off` (the
/// `AreaOffset`) and `rseq_cs` (the field's offset from `cpu_id`).
macro_rules! rseq_arm {
    () => {
        concat!(
            "add {base}, tp, {off}\n",
            "lla {cs}, 3b\n",
            "sd {cs}, {rseq_cs}({base})\n",
            "2:\n",
        )
    };
}

/// `rseq_arm!`, then the section's first step: the comparison of the area's `FIELD` with the
/// index the caller read before the section, through the scratch register operand named
/// `$scratch`, branching to the Rust `abort` label if they differ (the thread migrated since;
/// list that label as an exit point). `subw` compares the low 32 bits only: the upper half of
/// the register holding the `u32` index is not defined. Also uses the operands `field` (the
/// offset of `FIELD` from `cpu_id`), `index` and `abort`.
macro_rules! rseq_arm_and_check {
    ($scratch:literal) => {
        concat!(
            rseq_arm!(),
            "lw {",
            $scratch,
            "}, {field}({base})\n",
            "subw {",
            $scratch,
            "}, {",
            $scratch,
            "}, {index}\n",
            "bnez {",
            $scratch,
            "}, {abort}\n",
        )
    };
}

/// An `AreaOffset` leads to the area's `cpu_id` field, as on aarch64 (so that the delta table's
/// static value names a field that reads -1).
pub(crate) const AREA_OFFSET_FIELD: usize = offset::CPU_ID;

/// `RSEQ_SIG` for riscv64, the same in glibc, librseq and the kernel selftests: the word of
/// `csrw mhartid, zero`, which `rseq_abort!` emits with `.long` before each abort label (the
/// kernel supports little-endian riscv only, where data and instruction words agree).
pub(crate) const RSEQ_SIG: u32 = 0xf140_1073;

// thiscpu's own rseq area lives in static TLS (`.tdata`), so its memory is released only
// after the kernel has reported the thread dead. Its initial image has `cpu_id = -1`
// (unregistered), so a thread reading it before registration always takes the slow path. It is
// `OWN_AREA_CAPACITY` bytes, aligned to as much, so that it can be registered in the kernel's
// optimized mode too (`abi::own_registration_size`). The symbols are global and hidden (never
// exported from a shared object) because the `asm!` blocks that compute their offsets may be
// placed in any codegen unit.
//
// The blank area follows it: 32 bytes with `cpu_id = -1` that no thread ever registers, so a
// fast path pointed at it always takes its slow path (see `arch::areas`).
//
// `__thiscpu_0_1_cpu_id_delta` is a table of `areas::COUNT` distances from the own area to the
// `cpu_id` field of the area each kind of read uses, the same for every thread. The active
// area's starts at 4, the own area's `cpu_id`; the node area's at the blank area's `cpu_id`.
// `__thiscpu_0_1_hot_words` follows the table, in the same line (see `arch::hot`). The names
// carry the crate version so that two versions in one binary never share them.
global_asm!(
    ".pushsection .tdata,\"awT\",@progbits",
    ".balign {capacity}",
    ".globl __thiscpu_0_1_own_area",
    ".hidden __thiscpu_0_1_own_area",
    ".type __thiscpu_0_1_own_area, @tls_object",
    ".size __thiscpu_0_1_own_area, {capacity}",
    "__thiscpu_0_1_own_area:",
    ".long 0, -1",
    ".quad 0",
    ".long 0, 0, 0, 0",
    ".zero {capacity} - 32",
    ".balign 32",
    ".globl __thiscpu_0_1_blank_area",
    ".hidden __thiscpu_0_1_blank_area",
    ".type __thiscpu_0_1_blank_area, @tls_object",
    ".size __thiscpu_0_1_blank_area, 32",
    "__thiscpu_0_1_blank_area:",
    ".long 0, -1",
    ".quad 0",
    ".long 0, 0, 0, 0",
    ".popsection",
    ".pushsection .data.__thiscpu_0_1_offsets,\"aw\",@progbits",
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

/// The thread pointer, `tp`.
#[inline]
pub(crate) fn thread_pointer() -> usize {
    let tp: usize;
    // SAFETY: copying `tp` has no side effect; on Linux it holds the calling thread's thread
    // pointer (the riscv psABI reserves it for that), which glibc sets before any user code.
    unsafe {
        asm!("mv {}, tp", out(reg) tp, options(nomem, nostack, preserves_flags));
    }
    tp
}

/// The offset from the thread pointer to `$symbol`, a TLS symbol of this module: the
/// initial-exec TLS sequence (one GOT load, filled at link time in executables).
macro_rules! tls_offset {
    ($symbol:literal) => {{
        let offset: isize;
        // SAFETY: the initial-exec access to a TLS symbol of this module: it reads the
        // symbol's thread-pointer offset from the GOT; no other memory is touched.
        unsafe {
            asm!(
                concat!("la.tls.ie {o}, ", $symbol),
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
/// section use the same area: the offset from the thread pointer to its `cpu_id` field.
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
            "la.tls.ie {o}, __thiscpu_0_1_own_area",
            "ld {d}, __thiscpu_0_1_cpu_id_delta + {at}",
            "add {o}, {o}, {d}",
            o = out(reg) offset,
            d = out(reg) _,
            at = const 8 * AREA,
            options(readonly, nostack, preserves_flags),
        );
    }
    AreaOffset(offset)
}

/// The hot word `WORD` (one of the `arch::hot` indexes): a PC-relative page and one load.
#[inline(always)]
pub(crate) fn hot_word<const WORD: usize>() -> u32 {
    const { assert!(WORD < hot::WORDS) };
    let value: u32;
    // SAFETY: the table is `hot::WORDS` aligned 32-bit words in `.data` (the `global_asm!`
    // above), written only atomically (`arch::set_hot_word`); WORD is in range (checked at
    // compile time), so this is one aligned, hence single-copy atomic, load inside it.
    unsafe {
        asm!(
            "lw {v}, __thiscpu_0_1_hot_words + {at}",
            v = out(reg) value,
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
    // SAFETY: an `AreaOffset` always names the `cpu_id` field of a live area in the calling
    // thread (see its definition in `arch`); FIELD is one of the `abi::offset` constants, an
    // aligned 32-bit field inside the 32-byte area: one naturally aligned 32-bit load.
    unsafe {
        asm!(
            "add {a}, tp, {off}",
            "lw {v}, {field}({a})",
            off = in(reg) offset.0,
            a = out(reg) _,
            v = lateout(reg) value,
            field = const FIELD as isize - offset::CPU_ID as isize,
            options(readonly, nostack, preserves_flags),
        );
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
/// marks the cpu with `i32::MIN`, which no area holds, so that one sign test of the cpu
/// rejects both an abort and an unregistered area.
#[inline]
pub(crate) fn load_cpu_node(offset: AreaOffset) -> Option<(i32, u32)> {
    let cpu: i32;
    let node: u32;
    // SAFETY: the section only loads from this thread's area and stores the descriptor address
    // into its `rseq_cs` field, as the rseq ABI prescribes; the descriptor and the abort
    // handler (preceded by the signature) are emitted alongside, and every instruction between
    // start (label 2) and post-commit (label 4) lies inside the described range. The handler
    // writes only `cpu` (and t1, declared) and jumps back to label 4.
    unsafe {
        asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_arm!(),
            "lw {cpu}, 0({base})",
            "lw {node}, {node_id}({base})",
            "4:",
            rseq_abort!(
                "5",
                "li {cpu}, {aborted}",
                "6:",
                "auipc t1, %pcrel_hi(4b)",
                "jalr zero, %pcrel_lo(6b)(t1)"
            ),
            off = in(reg) offset.0,
            base = out(reg) _,
            cs = out(reg) _,
            cpu = out(reg) cpu,
            node = out(reg) node,
            aborted = const i32::MIN,
            rseq_cs = const offset::RSEQ_CS - offset::CPU_ID,
            node_id = const offset::NODE_ID - offset::CPU_ID,
            out("x6") _,
            options(nostack, preserves_flags),
        );
    }
    (cpu != i32::MIN).then_some((cpu, node))
}

/// riscv has no instruction that tells user space the Linux CPU number: `mhartid` is the
/// hardware thread's id, readable in machine mode only.
pub(crate) const NATIVE_CPU_READ: Option<NativeCpuRead> = None;

/// None either: the `time` and `cycle` counters carry no CPU id.
pub(crate) const NATIVE_CPU_READ_WITH_CLOCK: Option<NativeCpuRead> = None;

// Every section below has the same frame: the descriptor (label 3, `rseq_descriptor!`), the
// arming store of its address into `rseq_cs` (the `cpu_id` field's address plus 4), the start
// (label 2), the comparison of the area's `FIELD` with the index the caller read before the
// section (any migration since then branches to the Rust `abort` label, listed as an exit
// point; these three are `rseq_arm_and_check!`), the operation, the single committing store,
// the post-commit label 4, and the abort handler at label 5 in `__rseq_failure`, preceded by
// the signature. The abort handler only jumps to the Rust `abort` label: no register the
// section wrote is needed there.

/// `*v += count`: load, add, and commit with one `sd`. See `ops::load_add_store`.
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
    // and add are safe to abandon; only the final `sd` changes memory.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{abort}"),
            rseq_arm_and_check!("cur"),
            inject!(1),
            "ld {cur}, 0({v})",
            "add {cur}, {cur}, {count}",
            "sd {cur}, 0({v})",
            "4:",
            rseq_abort!("5", "tail {abort}");
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

/// If `*v == expect`, `*v = newv`, committed with a store-release (`fence rw, w`, then `sd`:
/// `list_push` publishes nodes through it, see the module's memory ordering). See
/// `ops::load_cbne_store`.
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
            "ld {cur}, 0({v})",
            "bne {cur}, {expect}, {mismatch}",
            inject!(1),
            "fence rw, w",
            "sd {newv}, 0({v})",
            "4:",
            rseq_abort!("5", "tail {abort}");
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
/// *head = *(h + NEXT)`, committed with one `sd`. See `ops::load_cbeq_load_store`.
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
    // `ld` takes a signed 12-bit displacement; the assembler refuses any other with a message
    // that names neither NEXT nor this function.
    const {
        assert!(
            NEXT < 2048,
            "load_cbeq_load_store: on riscv64, NEXT (the byte offset of a node's `next` field) \
             must be below 2048"
        )
    };
    // SAFETY: the caller's contract; the section follows the frame described above; the store
    // to `out` before the commit is harmless if the section aborts (the caller only reads `out`
    // after a commit). The load of `next` depends on the loaded head's address, so it is
    // ordered after it without a fence (RVWMO keeps address dependencies).
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{abort}"),
            rseq_exit_point!("2", "{empty}"),
            rseq_arm_and_check!("node"),
            "ld {node}, 0({head})",
            "beqz {node}, {empty}",
            "sd {node}, 0({out})",
            inject!(1),
            "ld {node}, {next}({node})",
            inject!(2),
            "sd {node}, 0({head})",
            "4:",
            rseq_abort!("5", "tail {abort}");
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
// - `stopped` is loaded with `ld` and `fence r, rw` (load-acquire): a drainer stores
//   `count = 0` and then clears `stopped` with a store-release; a section that sees the flag
//   clear must not have read `count` or a slot before it, and a control dependency (the
//   `bnez`) orders no loads under RVWMO.
// - The push commits `count` after `fence rw, w` (store-release): the slot store and the
//   object's contents must be visible to a drainer on another CPU before the count that covers
//   them. The membarrier IPI's full barrier orders them too; the release keeps the section
//   correct on its own, as librseq's RELEASE variants do.
// - The pop commits with a plain `sd`: only this CPU reads the count back, and a drainer is
//   ordered after it by the membarrier IPI's full barrier.

/// The addresses of a stack head's `count` and `stopped` words.
#[inline(always)]
fn stack_words(head: *const StackHead) -> (*const u64, *const u64) {
    (
        head.wrapping_byte_add(StackHead::COUNT).cast(),
        head.wrapping_byte_add(StackHead::STOPPED).cast(),
    )
}

/// Guarded push: `if head.stopped != 0 leave(Stopped); n = head.count; if n >= capacity
/// leave(Refused); slots[n] = item; commit head.count = n + 1` (as a store-release).
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
            "ld {n}, 0({stopped_at})",
            "fence r, rw",
            "bnez {n}, {stopped}",
            inject!(3),
            "ld {n}, 0({count_at})",
            "bgeu {n}, {capacity}, {refused}",
            "slli {slot}, {n}, 3",
            "add {slot}, {slot}, {slots}",
            "sd {item}, 0({slot})",
            inject!(1),
            "addi {n}, {n}, 1",
            "fence rw, w",
            "sd {n}, 0({count_at})",
            "4:",
            rseq_abort!("5", "tail {abort}");
            off = in(reg) offset.0,
            index = in(reg) index,
            count_at = in(reg) count,
            stopped_at = in(reg) stopped,
            slots = in(reg) slots,
            capacity = in(reg) capacity,
            item = in(reg) item,
            base = out(reg) _,
            n = out(reg) _,
            slot = out(reg) _,
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
/// As on aarch64, the item goes through a local in memory and the exits are Rust labels: an
/// `asm!` that jumps to Rust labels cannot have outputs (`asm_goto_with_outputs` is unstable).
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
            "ld {n}, 0({stopped_at})",
            "fence r, rw",
            "bnez {n}, {stopped}",
            inject!(3),
            "ld {n}, 0({count_at})",
            "beqz {n}, {refused}",
            "addi {n}, {n}, -1",
            "slli {item}, {n}, 3",
            "add {item}, {item}, {slots}",
            "ld {item}, 0({item})",
            "sd {item}, 0({out})",
            inject!(2),
            "sd {n}, 0({count_at})",
            "4:",
            rseq_abort!("5", "tail {abort}");
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
// check (a load-acquire) and single committing store of the count (a push's after `fence rw,
// w`), and between them a loop that copies the words. An abort leaves the stack as it was and
// the caller reads nothing the section wrote; `k` goes back through a local, stored before the
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
            "ld {n}, 0({stopped_at})",
            "fence r, rw",
            "bnez {n}, {stopped}",
            inject!(3),
            "ld {n}, 0({count_at})",
            "beqz {n}, {refused}",
            "bgeu {n}, {k}, 9f",
            "mv {k}, {n}",
            "9:",
            "sub {n}, {n}, {k}",
            "sd {k}, 0({taken_at})",
            "slli {word}, {n}, 3",
            "add {from}, {from}, {word}",
            "8:",
            "addi {k}, {k}, -1",
            "slli {at}, {k}, 3",
            "add {word}, {from}, {at}",
            "ld {word}, 0({word})",
            "add {at}, {out}, {at}",
            "sd {word}, 0({at})",
            "bnez {k}, 8b",
            inject!(2),
            "sd {n}, 0({count_at})",
            "4:",
            rseq_abort!("5", "tail {abort}");
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
            at = out(reg) _,
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
/// head.count = n + k` (as a store-release). Returns the outcome and `k`, which is meaningful
/// only when committed (0 when `len` is 0): the caller keeps `items[..len - k]`.
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
    // the committed count, so an aborted push leaves nothing visible, and the fence before the
    // commit orders them (and the objects' contents) before the count; `k` is at least 1 when
    // the loop starts (n < capacity, len != 0), so it ends at 0.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{abort}"),
            rseq_exit_point!("2", "{stopped}"),
            rseq_exit_point!("2", "{refused}"),
            rseq_arm_and_check!("n"),
            "ld {n}, 0({stopped_at})",
            "fence r, rw",
            "bnez {n}, {stopped}",
            inject!(3),
            "ld {n}, 0({count_at})",
            "bgeu {n}, {k}, {refused}",
            "sub {k}, {k}, {n}",
            "bgeu {len}, {k}, 9f",
            "mv {k}, {len}",
            "9:",
            "sd {k}, 0({pushed_at})",
            "slli {word}, {n}, 3",
            "add {to}, {to}, {word}",
            "slli {word}, {k}, 3",
            "sub {from}, {from}, {word}",
            "add {n}, {n}, {k}",
            "8:",
            "addi {k}, {k}, -1",
            "slli {at}, {k}, 3",
            "add {word}, {from}, {at}",
            "ld {word}, 0({word})",
            "add {at}, {to}, {at}",
            "sd {word}, 0({at})",
            "bnez {k}, 8b",
            inject!(1),
            "fence rw, w",
            "sd {n}, 0({count_at})",
            "4:",
            rseq_abort!("5", "tail {abort}");
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
            at = out(reg) _,
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
// the unsigned comparison with `cpus` sends out like a CPU without a stack. The ordering is the
// guarded stacks' above. As in `stack_pop`, the popped item goes through a local and the exits
// are Rust labels: the abort handler leaves with `tail`, which takes a symbol, not a numbered
// label that would let it come back to the end of the section with a register output.

/// Guarded pop from the stack of the CPU the section runs on (see `ops::stack_pop_here`): the
/// item, or 0 if the section left or aborted.
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
    let mut item = 0usize;
    let out: *mut usize = &mut item;
    // SAFETY: the caller's contract; the section arms itself before it reads `cpu_id`, writes
    // nothing but the count (its commit), the area's `rseq_cs` and the local `item` (harmless
    // if it aborts: the exits return 0), and indexes only stacks of CPUs below `cpus`; its
    // early exits are listed as exit points.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{none}"),
            rseq_arm!(),
            "lwu {cpu}, 0({base})",
            "bgeu {cpu}, {cpus}, {none}",
            "sll {cpu}, {cpu}, {shift}",
            "add {base}, {head}, {cpu}",
            "ld {n}, {stopped_at}({base})",
            "fence r, rw",
            "bnez {n}, {none}",
            inject!(3),
            "ld {n}, {count_at}({base})",
            "beqz {n}, {none}",
            "addi {n}, {n}, -1",
            "add {cpu}, {slots}, {cpu}",
            "slli {slot}, {n}, 3",
            "add {slot}, {slot}, {cpu}",
            "ld {slot}, 0({slot})",
            "sd {slot}, 0({out})",
            inject!(2),
            "sd {n}, {count_at}({base})",
            "4:",
            rseq_abort!("5", "tail {none}");
            off = in(reg) offset.0,
            cpus = in(reg) cpus,
            shift = in(reg) u64::from(shift),
            head = in(reg) head,
            slots = in(reg) slots,
            out = in(reg) out,
            base = out(reg) _,
            cpu = out(reg) _,
            n = out(reg) _,
            slot = out(reg) _,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS - offset::CPU_ID,
            stopped_at = const StackHead::STOPPED,
            count_at = const StackHead::COUNT,
            none = label { return 0; },
            options(nostack),
        );
    }
    item
}

/// Guarded push onto the stack of the CPU the section runs on (see `ops::stack_push_here`),
/// committed as a store-release.
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
            "lwu {cpu}, 0({base})",
            "bgeu {cpu}, {cpus}, {outside}",
            "sll {cpu}, {cpu}, {shift}",
            "add {base}, {head}, {cpu}",
            "ld {n}, {stopped_at}({base})",
            "fence r, rw",
            "bnez {n}, {stopped}",
            inject!(3),
            "ld {n}, {count_at}({base})",
            "bgeu {n}, {capacity}, {refused}",
            "add {cpu}, {slots}, {cpu}",
            "slli {slot}, {n}, 3",
            "add {slot}, {slot}, {cpu}",
            "sd {item}, 0({slot})",
            inject!(1),
            "addi {n}, {n}, 1",
            "fence rw, w",
            "sd {n}, {count_at}({base})",
            "4:",
            rseq_abort!("5", "tail {outside}");
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
            slot = out(reg) _,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS - offset::CPU_ID,
            stopped_at = const StackHead::STOPPED,
            count_at = const StackHead::COUNT,
            stopped = label { return StackOutcome::Stopped; },
            refused = label { return StackOutcome::Refused; },
            outside = label { return StackOutcome::Aborted; },
            options(nostack),
        );
    }
    StackOutcome::Committed
}

/// Whether `offset` can be an initial-exec TLS offset (checked by the contract's tests): with
/// Variant I TLS and the thread pointer at the end of the thread control block, the static TLS
/// blocks start at the thread pointer and lie above it.
#[cfg(test)]
pub(crate) fn is_static_tls_offset(offset: isize) -> bool {
    offset >= 0
}
