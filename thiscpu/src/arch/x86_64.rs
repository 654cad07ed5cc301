//! x86_64: the thread pointer is the FS base, rseq fields are addressed as
//! `%fs:(offset + field)`, and the abort signature is glibc's `0x53053053`, emitted as the
//! operand of a `ud1` so that disassemblers stay in step and the bytes trap if ever executed.
//!
//! # Where the active area is
//! The own area's offset from the thread pointer comes from the initial-exec TLS access
//! `mov own_area@gottpoff(%rip), %reg`: the linker turns it into `mov $constant, %reg` in an
//! executable, and keeps it as a load of a GOT entry (filled by the dynamic loader) in a shared
//! object. A data word holding the offset itself (`.quad own_area@tpoff`) would save that
//! instruction, but the linker refuses its relocation (`R_X86_64_TPOFF64`) in a shared object,
//! so a library that used it could never be part of a `cdylib`. The data word holds what
//! changes at run time instead: the distance from the own area to the active area (0 until the
//! process switches to glibc's area). The fast path of `current_cpu` (`active_field`) is the two
//! loads, which do not depend on each other, and the load of `cpu_id` at their sum
//! (`%fs:4(%rcx,%rax)`): one load deep, as before, plus one instruction.
//!
//! # Safety
//! Every `asm!` here touches only this thread's rseq area (through the process-wide offset
//! that always names a live, 32-byte area in this thread's static TLS or glibc's thread
//! descriptor) and its own registers, as each block's comment details.

use super::{AreaOffset, NativeCpuRead, Outcome, StackHead, StackOutcome, areas, hot};
use crate::abi::offset;
use core::arch::{asm, global_asm};
use core::sync::atomic::{AtomicIsize, Ordering};

/// Emits an abort handler at `$label` in the `__rseq_failure` section, preceded by the
/// signature (as the last four bytes of a `ud1`), followed by the given instructions.
macro_rules! rseq_abort {
    ($label:literal, $($insn:literal),*) => {
        concat!(
            ".pushsection __rseq_failure, \"ax\"\n",
            ".byte 0x0f, 0xb9, 0x3d\n",
            ".long 0x53053053\n",
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
            "mov {scratch:e}, dword ptr [rip + {delays} + 4 * ",
            $n,
            "]\n",
            "78:\n",
            "sub {scratch:e}, 1\n",
            "jae 78b\n",
        )
    };
}
#[cfg(not(thiscpu_inject))]
macro_rules! inject {
    ($n:literal) => {
        ""
    };
}

/// `asm!` for a restartable sequence: template pieces, then operands, then options. With
/// `--cfg thiscpu_inject` it adds the scratch register and the delay table that `inject!` uses.
#[cfg(thiscpu_inject)]
macro_rules! rseq_asm {
    ($($template:expr),+ ; $($operands:tt)*) => {
        asm!(
            $($template),+,
            scratch = out(reg) _,
            delays = sym super::inject::DELAYS,
            $($operands)*
        )
    };
}
#[cfg(not(thiscpu_inject))]
macro_rules! rseq_asm {
    ($($template:expr),+ ; $($operands:tt)*) => {
        asm!($($template),+, $($operands)*)
    };
}

/// The opening of every section's frame: the address of the descriptor at label 3 into the
/// area's `rseq_cs`, which arms the section, then the start label 2. Uses the operands `cs` (a
/// scratch register), `off` (the `AreaOffset`) and `rseq_cs` (the field's offset).
macro_rules! rseq_arm {
    () => {
        concat!(
            "lea {cs}, [rip + 3b]\n",
            "mov qword ptr fs:[{off} + {rseq_cs}], {cs}\n",
            "2:\n",
        )
    };
}

/// `rseq_arm!`, then the section's first step: the comparison of the area's `FIELD` with the
/// index the caller read before the section, leaving through the abort handler at label 5 if
/// they differ (the thread migrated since). Also uses the operands `field` (the offset of
/// `FIELD`) and `index`.
macro_rules! rseq_arm_and_check {
    () => {
        concat!(
            rseq_arm!(),
            "cmp dword ptr fs:[{off} + {field}], {index:e}\n",
            "jne 5f\n",
        )
    };
}

/// An `AreaOffset` leads to the area's start.
pub(crate) const AREA_OFFSET_FIELD: usize = 0;

/// `RSEQ_SIG` for x86_64, the same in glibc, librseq and the kernel selftests.
pub(crate) const RSEQ_SIG: u32 = 0x5305_3053;

// thiscpu's own rseq area lives in static TLS (`.tdata`), so its memory is released only
// after the kernel has reported the thread dead: an area registered by a thread that exits is
// never written into freed memory. Its initial image has `cpu_id = -1` (unregistered), so a
// thread reading it before registration always takes the slow path. It is `OWN_AREA_CAPACITY`
// bytes, aligned to as much, so that it can be registered in the kernel's optimized mode too
// (`abi::own_registration_size`).
//
// The symbol is global (hidden, so never exported from a shared object) because the `asm!`
// blocks that address it may be placed in any codegen unit.
//
// The blank area follows it: 32 bytes with `cpu_id = -1` that no thread ever registers, so a
// fast path pointed at it always takes its slow path (see `arch::areas`).
//
// `__thiscpu_0_1_area_delta` is a table of `areas::COUNT` distances from the own area to the
// area each kind of read uses, the same for every thread (areas sit at one offset from every
// thread pointer). The active area's starts at 0, so the fast paths are sound before the
// process-wide decision is made; it is switched to glibc's area once, when glibc registered.
// The node area's starts at the blank area. `__thiscpu_0_1_hot_words` follows the table, in the
// same line (see `arch::hot`). The names carry the crate version so that two versions in one
// binary never share them.
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
    ".globl __thiscpu_0_1_area_delta",
    ".hidden __thiscpu_0_1_area_delta",
    "__thiscpu_0_1_area_delta:",
    ".quad 0",
    ".quad __thiscpu_0_1_blank_area - __thiscpu_0_1_own_area",
    ".globl __thiscpu_0_1_hot_words",
    ".hidden __thiscpu_0_1_hot_words",
    "__thiscpu_0_1_hot_words:",
    ".zero {hot_bytes}",
    ".popsection",
    capacity = const crate::abi::OWN_AREA_CAPACITY,
    hot_bytes = const 4 * hot::WORDS,
);

unsafe extern "C" {
    static __thiscpu_0_1_area_delta: [AtomicIsize; areas::COUNT];
}

const _: () = assert!(
    areas::ACTIVE == 0 && areas::NODE == 1 && areas::COUNT == 2,
    "the `global_asm!` above lays the delta table out in this order"
);

/// The thread pointer (FS base). The word at `%fs:0` holds the thread pointer itself.
#[inline]
pub(crate) fn thread_pointer() -> usize {
    let tp: usize;
    // SAFETY: on x86_64 Linux every thread's FS base points at its thread control block, whose
    // first word is the thread pointer (the x86_64 TLS ABI); reading it has no side effect.
    unsafe {
        asm!("mov {}, qword ptr fs:[0]", out(reg) tp, options(nostack, readonly, preserves_flags));
    }
    tp
}

/// The offset from the thread pointer to `$symbol`, a TLS symbol of this module: the
/// initial-exec access (a link-time constant in executables, one GOT load in shared objects).
macro_rules! tls_offset {
    ($symbol:literal) => {{
        let offset: isize;
        // SAFETY: the initial-exec access to a TLS symbol of this module: it reads the
        // symbol's thread-pointer offset from the GOT (or, once the linker relaxed it, moves the
        // constant); no other memory is touched.
        unsafe {
            asm!(
                concat!("mov {o}, qword ptr [rip + ", $symbol, "@GOTTPOFF]"),
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
    let delta = offset - own_area_offset();
    // SAFETY: the table is `areas::COUNT` 8-byte aligned words in `.data`, only accessed
    // atomically; AREA indexes it (checked).
    unsafe { __thiscpu_0_1_area_delta[AREA].store(delta, Ordering::Relaxed) }
}

/// The hot word `WORD` (one of the `arch::hot` indexes): one RIP-relative load.
#[inline(always)]
pub(crate) fn hot_word<const WORD: usize>() -> u32 {
    const { assert!(WORD < hot::WORDS) };
    let value: u32;
    // SAFETY: the table is `hot::WORDS` aligned 32-bit words in `.data` (the `global_asm!`
    // above), written only atomically (`arch::set_hot_word`); WORD is in range (checked at
    // compile time), so this is one aligned, hence atomic, load inside it.
    unsafe {
        asm!(
            "mov {v:e}, dword ptr [rip + __thiscpu_0_1_hot_words + {at}]",
            v = out(reg) value,
            at = const 4 * WORD,
            options(nostack, readonly, preserves_flags),
        );
    }
    value
}

/// The 32-bit field `FIELD` (`cpu_id`, `node_id`, `mm_cid`) of the active area, read alone: the
/// own area's offset and the delta, loaded independently, and one load of the field at their
/// sum, which the processor adds while it forms the address. `field_at(area_offset())` reads
/// the same field with an `add` before the load, which costs a step on the way to the value.
#[inline(always)]
pub(crate) fn active_field<const FIELD: usize>() -> i32 {
    let value: i32;
    // SAFETY: the own area's offset (see `own_area_offset`) plus the active delta, a relaxed load
    // of an aligned word in `.data` that only `set_area_offset` writes, always name a live area in
    // this thread (see the module's `global_asm!`); FIELD is one of the `abi::offset` constants,
    // a naturally aligned 32-bit field inside the 32-byte area, read with a single load.
    unsafe {
        asm!(
            "mov {own}, qword ptr [rip + __thiscpu_0_1_own_area@GOTTPOFF]",
            "mov {delta}, qword ptr [rip + __thiscpu_0_1_area_delta]",
            "mov {v:e}, dword ptr fs:[{own} + {delta} + {field}]",
            own = out(reg) _,
            delta = out(reg) _,
            v = lateout(reg) value,
            field = const FIELD,
            options(nostack, readonly, preserves_flags),
        );
    }
    value
}

/// Reads `cpu_id` and `node_id` inside one restartable sequence, so both come from the same
/// scheduling interval: any preemption, migration or signal between the two loads sends the
/// thread to the abort label, and the pair is discarded. Returns `None` when aborted, and a
/// negative cpu when the area is not registered (the blank area never is). The abort handler
/// marks the cpu with `i32::MIN`, which no area holds, rather than setting a flag of its own:
/// then one sign test of the cpu rejects both an abort and an unregistered area.
#[inline]
pub(crate) fn load_cpu_node(area: AreaOffset) -> Option<(i32, u32)> {
    let cpu: i32;
    let node: u32;
    // SAFETY: the section only loads from this thread's area and stores the descriptor address
    // into its `rseq_cs` field, as the rseq ABI prescribes; the descriptor and the abort
    // handler (preceded by the signature) are emitted alongside, and every instruction between
    // start (label 2) and post-commit (label 4) lies inside the described range.
    unsafe {
        asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_arm!(),
            "mov {cpu:e}, dword ptr fs:[{off} + {cpu_id}]",
            "mov {node:e}, dword ptr fs:[{off} + {node_id}]",
            "4:",
            rseq_abort!("5", "mov {cpu:e}, {aborted}", "jmp 4b"),
            off = in(reg) area.0,
            cs = out(reg) _,
            cpu = out(reg) cpu,
            node = out(reg) node,
            aborted = const i32::MIN,
            rseq_cs = const offset::RSEQ_CS,
            cpu_id = const offset::CPU_ID,
            node_id = const offset::NODE_ID,
            options(nostack),
        );
    }
    (cpu != i32::MIN).then_some((cpu, node))
}

const _: () = assert!(
    RSEQ_SIG == 0x5305_3053,
    "rseq_abort! hard-codes the signature"
);

/// CPUID leaf `leaf`, sub-leaf `sub`.
#[allow(unused_unsafe)]
fn cpuid(leaf: u32, sub: u32) -> core::arch::x86_64::CpuidResult {
    // SAFETY: CPUID exists on every x86_64 CPU and only reads identification registers (the
    // intrinsic is safe since Rust 1.94; the block keeps older compilers building).
    unsafe { core::arch::x86_64::__cpuid_count(leaf, sub) }
}

/// Whether the CPU has RDPID (CPUID.(EAX=7,ECX=0):ECX bit 22).
fn has_rdpid() -> bool {
    cpuid(7, 0).ecx & (1 << 22) != 0
}

/// Whether the CPU has RDTSCP (CPUID.80000001H:EDX bit 27).
fn has_rdtscp() -> bool {
    cpuid(0x8000_0000, 0).eax >= 0x8000_0001 && cpuid(0x8000_0001, 0).edx & (1 << 27) != 0
}

/// `(cpu, node)` from `IA32_TSC_AUX`, where Linux stores `(node << 12) | cpu`.
#[inline]
fn cpu_node_of_tsc_aux(aux: u32) -> (u32, u32) {
    (aux & 0xfff, aux >> 12)
}

/// `IA32_TSC_AUX` through RDPID.
#[inline]
fn rdpid() -> (u32, u32) {
    let aux: u64;
    // SAFETY: only called where `has_rdpid()` said the instruction exists (the contract of
    // `NativeCpuRead::read`); it reads a register.
    unsafe {
        asm!("rdpid {}", out(reg) aux, options(nomem, nostack, preserves_flags));
    }
    cpu_node_of_tsc_aux(aux as u32)
}

/// `IA32_TSC_AUX` through RDTSCP (which also reads the time-stamp counter).
#[inline]
fn rdtscp() -> (u32, u32) {
    let mut aux = 0u32;
    // SAFETY: only called where `has_rdtscp()` said the instruction exists.
    unsafe {
        core::arch::x86_64::__rdtscp(&mut aux);
    }
    cpu_node_of_tsc_aux(aux)
}

/// RDPID: `IA32_TSC_AUX` alone.
pub(crate) const NATIVE_CPU_READ: Option<NativeCpuRead> = Some(NativeCpuRead {
    present: has_rdpid,
    read: rdpid,
});

/// RDTSCP: `IA32_TSC_AUX` with the time-stamp counter, on CPUs older than RDPID.
pub(crate) const NATIVE_CPU_READ_WITH_CLOCK: Option<NativeCpuRead> = Some(NativeCpuRead {
    present: has_rdtscp,
    read: rdtscp,
});

/// The active area's offset from the thread pointer (to its start: `AREA_OFFSET_FIELD` is 0),
/// loaded once before a section so that the CPU read and the section use the same area.
#[inline(always)]
pub(crate) fn area_offset() -> AreaOffset {
    area_offset_of::<{ areas::ACTIVE }>()
}

/// The offset from the thread pointer to the area that reads of kind `AREA` (one of the
/// `arch::areas` indexes) use.
#[inline(always)]
pub(crate) fn area_offset_of<const AREA: usize>() -> AreaOffset {
    const { assert!(AREA < areas::COUNT) };
    let offset: isize;
    // SAFETY: the own area's offset (see `own_area_offset`) plus a relaxed load of an aligned
    // word of the delta table in `.data`, which only `set_area_offset` writes, atomically, and
    // AREA indexes (checked at compile time). In one `asm!` because a Rust load of the extern
    // static goes through the GOT (one more instruction per section).
    unsafe {
        asm!(
            "mov {}, qword ptr [rip + __thiscpu_0_1_own_area@GOTTPOFF]",
            "add {0}, qword ptr [rip + __thiscpu_0_1_area_delta + {at}]",
            out(reg) offset,
            at = const 8 * AREA,
            options(nostack, readonly),
        );
    }
    AreaOffset(offset)
}

/// The 32-bit field `FIELD` (`cpu_id` or `mm_cid`) of the area at `offset`.
#[inline(always)]
pub(crate) fn field_at<const FIELD: usize>(offset: AreaOffset) -> i32 {
    let value: i32;
    // SAFETY: a `AreaOffset` always names a live area in the calling thread (see its
    // definition in `arch`); FIELD is an aligned 32-bit field inside it.
    unsafe {
        asm!(
            "mov {v:e}, dword ptr fs:[{off} + {field}]",
            off = in(reg) offset.0,
            v = lateout(reg) value,
            field = const FIELD,
            options(nostack, readonly, preserves_flags),
        );
    }
    value
}

// Every section below has the same frame: the descriptor (label 3, `rseq_descriptor!`), the
// arming store of its address into `rseq_cs`, the start (label 2), the comparison of the area's
// `FIELD` with the index the caller read before the section (any migration since then aborts;
// these three are `rseq_arm_and_check!`), the operation,
// the single committing instruction, the post-commit label 4, and the abort handler at label 5
// in `__rseq_failure`, preceded by the signature. The abort handler only jumps to the Rust
// label block: no register the section wrote is needed there. `load_add_store` alone makes
// its load between the start and the comparison (its comment says why).

/// `*v += count`: a load, an add in a register, and the committing store. See
/// `ops::load_add_store`.
///
/// One `add` to memory would commit just as well, but it was slower: on an Intel Xeon
/// (family 6 model 207) a loop of `Counter::inc` took 2.9 ns per increment with it and 2.0 ns
/// with the split form, in alternating runs of the same program; the C reference's section
/// splits it the same way.
///
/// The load comes first in the section, before the CPU check: the value is only used after
/// the check, and a load made on the wrong CPU is discarded with the abort. On the same Xeon
/// the order decides whether a loop of increments runs at store-forwarding speed: in a C loop
/// of this section with the check first (the C reference's order), one `nop` anywhere before
/// the load took it from 0.7 to 1.9 ns per increment, while with the load first a `nop`
/// anywhere cost 0.06-0.12 ns. In the CLI's bench, `Counter::inc` went from 1.63 to 1.28 ns and
/// `Counter::adder().inc()` from 1.47 to 0.69 ns (medians of 4 alternating runs).
///
/// # Safety
/// `offset` and `index` were read from this thread's area (`index` from `FIELD`), and `v` is
/// valid for reads and writes of a `u64` that only sections indexed by `index` write.
#[inline(always)]
pub(crate) unsafe fn load_add_store<const FIELD: usize>(
    offset: AreaOffset,
    index: u32,
    v: *mut u64,
    count: u64,
) -> Outcome<()> {
    // SAFETY: the caller's contract; the section follows the frame described above.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_arm!(),
            "mov {sum}, qword ptr [{v}]",
            "cmp dword ptr fs:[{off} + {field}], {index:e}",
            "jne 5f",
            inject!(1),
            "add {sum}, {count}",
            "mov qword ptr [{v}], {sum}",
            "4:",
            rseq_abort!("5", "jmp {abort}");
            off = in(reg) offset.0,
            index = in(reg) index,
            v = in(reg) v,
            count = in(reg) count,
            sum = out(reg) _,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS,
            field = const FIELD,
            abort = label { return Outcome::Aborted; },
            options(nostack),
        );
    }
    Outcome::Committed(())
}

/// If `*v == expect`, `*v = newv`. See `ops::load_cbne_store`.
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
    // early exit (label `mismatch`) is listed as an exit point.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{mismatch}"),
            rseq_arm_and_check!(),
            "cmp qword ptr [{v}], {expect}",
            "jne {mismatch}",
            inject!(1),
            "mov qword ptr [{v}], {newv}",
            "4:",
            rseq_abort!("5", "jmp {abort}");
            off = in(reg) offset.0,
            index = in(reg) index,
            v = in(reg) v,
            expect = in(reg) expect,
            newv = in(reg) newv,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS,
            field = const FIELD,
            mismatch = label { return Outcome::Mismatch; },
            abort = label { return Outcome::Aborted; },
            options(nostack),
        );
    }
    Outcome::Committed(())
}

/// Pops the head of a singly linked list: `h = *head; if h == 0 leave; *out = h;
/// *head = *(h + NEXT)`. See `ops::load_cbeq_load_store`.
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
    // A displacement is a signed 32-bit field; the assembler refuses a larger one with a
    // message that names neither NEXT nor this function.
    const {
        assert!(
            NEXT <= i32::MAX as usize,
            "load_cbeq_load_store: on x86_64, NEXT (the byte offset of a node's `next` field) \
             must be at most i32::MAX"
        )
    };
    // SAFETY: the caller's contract; the section follows the frame described above; the store
    // to `out` before the commit is harmless if the section aborts (the caller only reads `out`
    // after a commit).
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{empty}"),
            rseq_arm_and_check!(),
            "mov {node}, qword ptr [{head}]",
            "test {node}, {node}",
            "jz {empty}",
            "mov qword ptr [{out}], {node}",
            inject!(1),
            "mov {node}, qword ptr [{node} + {next}]",
            inject!(2),
            "mov qword ptr [{head}], {node}",
            "4:",
            rseq_abort!("5", "jmp {abort}");
            off = in(reg) offset.0,
            index = in(reg) index,
            head = in(reg) head,
            out = in(reg) out,
            node = out(reg) _,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS,
            field = const FIELD,
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
// `capacity` object pointers. Both sections below follow the frame above, and then, first
// thing after the CPU check, load `stopped` and leave through the `stopped` exit if it is not
// zero: a drainer on another CPU sets it, fences this CPU with membarrier (which aborts every
// section already past this check), and only then reads and resets the stack. The count is the
// single committed word; the slot written by a push lies beyond the committed count until the
// commit, so an abort leaves only an invisible stale slot.
//
// Memory ordering, for the aarch64 port: on x86_64 loads are not reordered with other loads
// and stores are released in order, so plain `mov`s suffice. On aarch64:
// - the load of `stopped` must be a load-acquire (`ldar`): a drainer writes `count = 0` and
//   then clears `stopped` with a store-release, and a section that sees the flag clear must
//   not have read `count` or a slot before it (a control dependency does not order loads);
// - the push's committing store of `count` must be a store-release (`stlr`): the slot store
//   and the pushed object's contents must be visible to a drainer on another CPU before the
//   count that covers them (the membarrier IPI also orders them; the release keeps the section
//   correct on its own, as librseq's RELEASE variants do);
// - the pop's commit needs no release: only this CPU reads the count back, and a drainer is
//   ordered after it by the membarrier IPI's full barrier.

/// Guarded push: `if head.stopped != 0 leave(Stopped); n = head.count; if n >= capacity
/// leave(Refused); slots[n] = item; commit head.count = n + 1`.
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
    // SAFETY: the caller's contract; the section follows the frame described above; its two
    // early exits are listed as exit points; the slot store lands beyond the committed count
    // (n < capacity is checked first), so an aborted push leaves nothing visible.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{stopped}"),
            rseq_exit_point!("2", "{refused}"),
            rseq_arm_and_check!(),
            "cmp qword ptr [{head} + {stopped_at}], 0",
            "jne {stopped}",
            inject!(3),
            "mov {n}, qword ptr [{head} + {count_at}]",
            "cmp {n}, {capacity}",
            "jae {refused}",
            "mov qword ptr [{slots} + 8 * {n}], {item}",
            inject!(1),
            "add {n}, 1",
            "mov qword ptr [{head} + {count_at}], {n}",
            "4:",
            rseq_abort!("5", "jmp {abort}");
            off = in(reg) offset.0,
            index = in(reg) index,
            head = in(reg) head,
            slots = in(reg) slots,
            capacity = in(reg) capacity,
            item = in(reg) item,
            n = out(reg) _,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS,
            field = const FIELD,
            stopped_at = const StackHead::STOPPED,
            count_at = const StackHead::COUNT,
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
/// The item comes back in a register, so the outcome does too, as a number that the exits set
/// (`outcome_from_code`): an `asm!` that jumps to Rust labels cannot have outputs (the
/// `asm_goto_with_outputs` feature is unstable), and returning through memory would put a
/// store and a reload between the pop and the caller's use of the object. The exits can sit in
/// `__rseq_failure` because `jne`/`jz` reach ±2 GiB (aarch64's conditional branches do not).
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
    let code: u32;
    let item: usize;
    // SAFETY: the caller's contract; the section follows the frame described above, and
    // writes nothing but the count (its commit) and the area's `rseq_cs`; its two early exits
    // (labels 6 and 7, outside the section with the abort handler) are listed as exit points,
    // and they and the handler only set the code and go back to label 4.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "6f"),
            rseq_exit_point!("2", "7f"),
            "xor {code:e}, {code:e}",
            rseq_arm_and_check!(),
            "cmp qword ptr [{head} + {stopped_at}], 0",
            "jne 6f",
            inject!(3),
            "mov {n}, qword ptr [{head} + {count_at}]",
            "test {n}, {n}",
            "jz 7f",
            "sub {n}, 1",
            "mov {item}, qword ptr [{slots} + 8 * {n}]",
            inject!(2),
            "mov qword ptr [{head} + {count_at}], {n}",
            "4:",
            rseq_abort!("5", "mov {code:e}, {aborted}", "jmp 4b"),
            ".pushsection __rseq_failure, \"ax\"",
            "6:",
            "mov {code:e}, {stopped}",
            "jmp 4b",
            "7:",
            "mov {code:e}, {refused}",
            "jmp 4b",
            ".popsection";
            off = in(reg) offset.0,
            index = in(reg) index,
            head = in(reg) head,
            slots = in(reg) slots,
            n = out(reg) _,
            item = out(reg) item,
            code = out(reg) code,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS,
            field = const FIELD,
            stopped_at = const StackHead::STOPPED,
            count_at = const StackHead::COUNT,
            stopped = const StackOutcome::Stopped as u32,
            refused = const StackOutcome::Refused as u32,
            aborted = const StackOutcome::Aborted as u32,
            options(nostack),
        );
    }
    (outcome_from_code(code), item)
}

// Batches: the allocator's slow paths move up to a batch of objects between a CPU's stack and
// a buffer of the caller's in one section, rather than one section per object. The frame,
// the `stopped` check and the single committing store of the count are the guarded stacks'
// above; between the check and the commit a loop copies the words. A pop copies the top `k`
// slots out to the caller's buffer, a push copies the last `k` words of the caller's buffer
// into the slots beyond the count: either way an abort leaves the stack as it was (a pushed
// word lies beyond the committed count until the commit) and the caller reads nothing the
// section wrote. `k` goes back through a local, stored before the commit, since an `asm!`
// that jumps to Rust labels cannot have outputs.

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
    let mut taken = 0usize;
    let taken_at: *mut usize = &mut taken;
    // SAFETY: the caller's contract; the section follows the frame described above and writes
    // nothing shared but the count (its commit) and the area's `rseq_cs`; the copy reads slots
    // below the count and writes the caller's `out` and `taken`, which an abort leaves unread;
    // `k` is at least 1 when the loop starts (n != 0, max != 0), so it ends at 0.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{stopped}"),
            rseq_exit_point!("2", "{refused}"),
            rseq_arm_and_check!(),
            "cmp qword ptr [{head} + {stopped_at}], 0",
            "jne {stopped}",
            inject!(3),
            "mov {n}, qword ptr [{head} + {count_at}]",
            "test {n}, {n}",
            "jz {refused}",
            "cmp {n}, {k}",
            "cmovb {k}, {n}",
            "sub {n}, {k}",
            "mov qword ptr [{taken_at}], {k}",
            "lea {from}, [{from} + 8 * {n}]",
            "8:",
            "sub {k}, 1",
            "mov {word}, qword ptr [{from} + 8 * {k}]",
            "mov qword ptr [{out} + 8 * {k}], {word}",
            "jnz 8b",
            inject!(2),
            "mov qword ptr [{head} + {count_at}], {n}",
            "4:",
            rseq_abort!("5", "jmp {abort}");
            off = in(reg) offset.0,
            index = in(reg) index,
            head = in(reg) head,
            from = inout(reg) slots => _,
            out = in(reg) out,
            taken_at = in(reg) taken_at,
            k = inout(reg) max => _,
            n = out(reg) _,
            word = out(reg) _,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS,
            field = const FIELD,
            stopped_at = const StackHead::STOPPED,
            count_at = const StackHead::COUNT,
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
/// head.count = n + k`. Returns the outcome and `k`, which is meaningful only when committed
/// (0 when `len` is 0): the caller keeps `items[..len - k]`.
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
    let mut pushed = 0usize;
    let pushed_at: *mut usize = &mut pushed;
    // SAFETY: the caller's contract; the section follows the frame described above; the
    // words land in slots from the count up to below the capacity (k <= capacity - n), beyond
    // the committed count, so an aborted push leaves nothing visible; `k` is at least 1 when
    // the loop starts (n < capacity, len != 0), so it ends at 0.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "{stopped}"),
            rseq_exit_point!("2", "{refused}"),
            rseq_arm_and_check!(),
            "cmp qword ptr [{head} + {stopped_at}], 0",
            "jne {stopped}",
            inject!(3),
            "mov {n}, qword ptr [{head} + {count_at}]",
            "cmp {n}, {k}",
            "jae {refused}",
            "sub {k}, {n}",
            "cmp {k}, {len}",
            "cmova {k}, {len}",
            "mov qword ptr [{pushed_at}], {k}",
            "lea {to}, [{to} + 8 * {n}]",
            "lea {word}, [8 * {k}]",
            "sub {from}, {word}",
            "add {n}, {k}",
            "8:",
            "sub {k}, 1",
            "mov {word}, qword ptr [{from} + 8 * {k}]",
            "mov qword ptr [{to} + 8 * {k}], {word}",
            "jnz 8b",
            inject!(1),
            "mov qword ptr [{head} + {count_at}], {n}",
            "4:",
            rseq_abort!("5", "jmp {abort}");
            off = in(reg) offset.0,
            index = in(reg) index,
            head = in(reg) head,
            to = inout(reg) slots => _,
            from = inout(reg) items.wrapping_add(len) => _,
            len = in(reg) len,
            k = inout(reg) capacity => _,
            pushed_at = in(reg) pushed_at,
            n = out(reg) _,
            word = out(reg) _,
            cs = out(reg) _,
            rseq_cs = const offset::RSEQ_CS,
            field = const FIELD,
            stopped_at = const StackHead::STOPPED,
            count_at = const StackHead::COUNT,
            stopped = label { return (StackOutcome::Stopped, 0); },
            refused = label { return (StackOutcome::Refused, 0); },
            abort = label { return (StackOutcome::Aborted, 0); },
            options(nostack),
        );
    }
    (StackOutcome::Committed, pushed)
}

// The allocator's stacks, indexed inside the section. The sections above check a CPU that
// the caller read before them; these read `cpu_id` themselves, after arming, and find that
// CPU's stack from it: every CPU's stack for one class lies at the same place in its region,
// and the regions follow one another at `1 << shift` bytes. A CPU read inside an armed section
// is the CPU the section runs on until it ends or aborts, so nothing is checked and nothing is
// read twice. An area that is not registered reads `cpu_id` as -1 (or -2), which the unsigned
// comparison with `cpus` sends out of the section like a CPU without a region. The register
// that arms the section holds the CPU after it (`rseq_arm!` with one register fewer: the
// allocator's fast path, where these run, is short of registers).
//
// The head's address goes into one register (`add head, cpu`) before the count is loaded and
// stored through it. Addressed as `[head + cpu]` instead, one instruction fewer, a loop of
// 300 million 64-byte pairs (`cli/examples/alloc_pairs.rs`, `taskset -c 1 alloc_pairs thiscpu
// 300000000`) took 1.37 s rather than 1.11 s on the Intel Xeon VM of `results/alloc.json`, in
// three alternated runs of each; jemalloc's loop took 1.13 to 1.20 s. The count a section
// stores is the one the next section loads, so every pair waits on that store reaching the
// load; why the address's form changes how long it waits is not established here. The
// slots' `[slots + 8 * n]` made no difference (1.12 s with its address in a register too).

/// Guarded pop from the stack of the CPU the section runs on: `cpu = area.cpu_id; if cpu >=
/// cpus leave; head += cpu << shift; slots += cpu << shift; if head.stopped != 0 leave; n =
/// head.count; if n == 0 leave; item = slots[n - 1]; commit head.count = n - 1`. Returns the
/// item, or 0 if the section left or aborted (no object is 0).
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
    // CPUs below `cpus`; its early exit (label 6, with the abort handler outside the section)
    // is listed as an exit point, and both only clear the item and go back to label 4.
    unsafe {
        rseq_asm!(
            rseq_descriptor!("2", "4", "5"),
            rseq_exit_point!("2", "6f"),
            "lea {cpu}, [rip + 3b]",
            "mov qword ptr fs:[{off} + {rseq_cs}], {cpu}",
            "2:",
            "mov {cpu:e}, dword ptr fs:[{off} + {cpu_id}]",
            "cmp {cpu}, {cpus}",
            "jae 6f",
            "shl {cpu}, cl",
            "add {head}, {cpu}",
            "cmp qword ptr [{head} + {stopped_at}], 0",
            "jne 6f",
            inject!(3),
            "mov {n}, qword ptr [{head} + {count_at}]",
            "test {n}, {n}",
            "jz 6f",
            "sub {n}, 1",
            "lea {item}, [{slots} + {cpu}]",
            "mov {item}, qword ptr [{item} + 8 * {n}]",
            inject!(2),
            "mov qword ptr [{head} + {count_at}], {n}",
            "4:",
            rseq_abort!("5", "xor {item:e}, {item:e}", "jmp 4b"),
            ".pushsection __rseq_failure, \"ax\"",
            "6:",
            "xor {item:e}, {item:e}",
            "jmp 4b",
            ".popsection";
            off = in(reg) offset.0,
            cpus = in(reg) cpus,
            in("ecx") shift,
            head = inout(reg) head => _,
            slots = in(reg) slots,
            cpu = out(reg) _,
            n = out(reg) _,
            item = out(reg) item,
            rseq_cs = const offset::RSEQ_CS,
            cpu_id = const offset::CPU_ID,
            stopped_at = const StackHead::STOPPED,
            count_at = const StackHead::COUNT,
            options(nostack),
        );
    }
    item
}

/// Guarded push onto the stack of the CPU the section runs on: `cpu = area.cpu_id; if cpu >=
/// cpus leave(Aborted); head += cpu << shift; slots += cpu << shift; if head.stopped != 0
/// leave(Stopped); n = head.count; if n >= capacity leave(Refused); slots[n] = item; commit
/// head.count = n + 1`.
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
            "lea {cpu}, [rip + 3b]",
            "mov qword ptr fs:[{off} + {rseq_cs}], {cpu}",
            "2:",
            "mov {cpu:e}, dword ptr fs:[{off} + {cpu_id}]",
            "cmp {cpu}, {cpus}",
            "jae {outside}",
            "shl {cpu}, cl",
            "add {head}, {cpu}",
            "cmp qword ptr [{head} + {stopped_at}], 0",
            "jne {stopped}",
            inject!(3),
            "mov {n}, qword ptr [{head} + {count_at}]",
            "cmp {n}, {capacity}",
            "jae {refused}",
            "add {slots}, {cpu}",
            "mov qword ptr [{slots} + 8 * {n}], {item}",
            inject!(1),
            "add {n}, 1",
            "mov qword ptr [{head} + {count_at}], {n}",
            "4:",
            rseq_abort!("5", "jmp {outside}");
            off = in(reg) offset.0,
            cpus = in(reg) cpus,
            in("ecx") shift,
            head = inout(reg) head => _,
            slots = inout(reg) slots => _,
            capacity = in(reg) capacity,
            item = in(reg) item,
            cpu = out(reg) _,
            n = out(reg) _,
            rseq_cs = const offset::RSEQ_CS,
            cpu_id = const offset::CPU_ID,
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

/// The outcome whose discriminant a section left in its code register.
#[inline(always)]
fn outcome_from_code(code: u32) -> StackOutcome {
    match code {
        0 => StackOutcome::Committed,
        1 => StackOutcome::Refused,
        2 => StackOutcome::Stopped,
        _ => StackOutcome::Aborted,
    }
}

/// Whether `offset` can be an initial-exec TLS offset (checked by the contract's tests): with
/// Variant II TLS the static TLS blocks lie below the thread pointer.
#[cfg(test)]
pub(crate) fn is_static_tls_offset(offset: isize) -> bool {
    offset < 0
}
