//! x86_64: the thread pointer is the FS base, rseq fields are addressed as
//! `%fs:(offset + field)`, and the abort signature is glibc's `0x53053053`, emitted as the
//! operand of a `ud1` so that disassemblers stay in step and the bytes trap if ever executed.
//!
//! # Safety
//! Every `asm!` here touches only this thread's rseq area (through the process-wide offset
//! that always names a live, 32-byte area in this thread's static TLS or glibc's thread
//! descriptor) and its own registers, as each block's comment details.

use crate::abi::{Rseq, offset};
use core::arch::{asm, global_asm};
use core::sync::atomic::{AtomicIsize, Ordering};

/// Emits the `struct rseq_cs` for a section at label 3 (in `__rseq_cs`) and lists it in
/// `__rseq_cs_ptr_array` for debuggers. Arguments: the start, post-commit and abort labels.
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
            ".pushsection __rseq_cs_ptr_array, \"aw\"\n",
            ".quad 3b\n",
            ".popsection\n",
        )
    };
}

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

/// Lists an early exit of a section (a label outside it that the section jumps to) in
/// `__rseq_exit_point_array`, as librseq does for debuggers.
#[allow(unused_macros)]
macro_rules! rseq_exit_point {
    ($start:literal, $exit:literal) => {
        concat!(
            ".pushsection __rseq_exit_point_array, \"aw\"\n",
            ".quad ",
            $start,
            "f, ",
            $exit,
            "f\n",
            ".popsection\n",
        )
    };
}

/// `RSEQ_SIG` for x86_64, the same in glibc, librseq and the kernel selftests.
pub(crate) const RSEQ_SIG: u32 = 0x5305_3053;

// thiscpu's own rseq area lives in static TLS (`.tdata`), so its memory is released only
// after the kernel has reported the thread dead: an area registered by a thread that exits is
// never written into freed memory. Its initial image has `cpu_id = -1` (unregistered), so a
// thread reading it before registration always takes the slow path.
//
// `__thiscpu_0_1_rseq_offset` is the offset from the thread pointer to the area in use, the same
// for every thread. It starts at thiscpu's own area, so the fast path is sound before the
// process-wide decision is made; it is switched to glibc's area once, when glibc registered.
global_asm!(
    ".pushsection .tdata,\"awT\",@progbits",
    ".balign 32",
    "__thiscpu_0_1_own_area:",
    ".long 0, -1",
    ".quad 0",
    ".long 0, 0, 0, 0",
    ".popsection",
    ".pushsection .data.__thiscpu_0_1_offsets,\"aw\",@progbits",
    ".balign 8",
    ".globl __thiscpu_0_1_rseq_offset",
    ".hidden __thiscpu_0_1_rseq_offset",
    "__thiscpu_0_1_rseq_offset:",
    ".quad __thiscpu_0_1_own_area@tpoff",
    ".globl __thiscpu_0_1_own_offset",
    ".hidden __thiscpu_0_1_own_offset",
    "__thiscpu_0_1_own_offset:",
    ".quad __thiscpu_0_1_own_area@tpoff",
    ".popsection",
);

unsafe extern "C" {
    static __thiscpu_0_1_rseq_offset: AtomicIsize;
    static __thiscpu_0_1_own_offset: isize;
}

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

/// Offset from the thread pointer to thiscpu's own static-TLS area.
pub(crate) fn own_area_offset() -> isize {
    // SAFETY: a constant written by the linker, never modified.
    unsafe { __thiscpu_0_1_own_offset }
}

/// Offset from the thread pointer to the area the fast path reads.
pub(crate) fn active_offset() -> isize {
    // SAFETY: the symbol is an 8-byte aligned word in `.data`, only accessed atomically.
    unsafe { __thiscpu_0_1_rseq_offset.load(Ordering::Relaxed) }
}

/// Points the fast path at another area, e.g. glibc's. Every thread must have a live,
/// 32-byte area at that offset from its thread pointer.
pub(crate) fn set_active_offset(offset: isize) {
    // SAFETY: as in `active_offset`.
    unsafe { __thiscpu_0_1_rseq_offset.store(offset, Ordering::Relaxed) }
}

/// This thread's area at `offset` from the thread pointer.
pub(crate) fn area_at(offset: isize) -> *mut Rseq {
    thread_pointer().wrapping_add_signed(offset) as *mut Rseq
}

/// `cpu_id` of the active area: the fast path of `current_cpu`. Three instructions: load the
/// offset, load `cpu_id`; the caller tests the sign.
#[inline(always)]
pub(crate) fn rseq_cpu_id() -> i32 {
    let cpu: i32;
    // SAFETY: the offset always names a live area in this thread (see the module's `global_asm!`),
    // and `cpu_id` is a naturally aligned 32-bit field read with a single load.
    unsafe {
        asm!(
            "mov {off}, qword ptr [rip + __thiscpu_0_1_rseq_offset]",
            "mov {cpu:e}, dword ptr fs:[{off} + {cpu_id}]",
            off = out(reg) _,
            cpu = lateout(reg) cpu,
            cpu_id = const offset::CPU_ID,
            options(nostack, readonly, preserves_flags),
        );
    }
    cpu
}

/// A 32-bit field of the active area, read with one load (`node_id`, `mm_cid`).
#[inline(always)]
pub(crate) fn rseq_field<const FIELD: usize>() -> u32 {
    let value: u32;
    // SAFETY: as in `rseq_cpu_id`; FIELD is one of the `abi::offset` constants, inside the
    // 32-byte area.
    unsafe {
        asm!(
            "mov {off}, qword ptr [rip + __thiscpu_0_1_rseq_offset]",
            "mov {v:e}, dword ptr fs:[{off} + {field}]",
            off = out(reg) _,
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
/// negative cpu when the area is not registered.
#[inline]
pub(crate) fn load_cpu_node() -> Option<(i32, u32)> {
    let cpu: i32;
    let node: u32;
    let aborted: u32;
    // SAFETY: the section only loads from this thread's area and stores the descriptor address
    // into its `rseq_cs` field, as the rseq ABI prescribes; the descriptor and the abort
    // handler (preceded by the signature) are emitted alongside, and every instruction between
    // start (label 2) and post-commit (label 4) lies inside the described range.
    unsafe {
        asm!(
            rseq_descriptor!("2", "4", "5"),
            "xor {aborted:e}, {aborted:e}",
            "mov {off}, qword ptr [rip + __thiscpu_0_1_rseq_offset]",
            "lea {cs}, [rip + 3b]",
            "mov qword ptr fs:[{off} + {rseq_cs}], {cs}",
            "2:",
            "mov {cpu:e}, dword ptr fs:[{off} + {cpu_id}]",
            "mov {node:e}, dword ptr fs:[{off} + {node_id}]",
            "4:",
            rseq_abort!("5", "mov {aborted:e}, 1", "jmp 4b"),
            off = out(reg) _,
            cs = out(reg) _,
            cpu = out(reg) cpu,
            node = out(reg) node,
            aborted = out(reg) aborted,
            rseq_cs = const offset::RSEQ_CS,
            cpu_id = const offset::CPU_ID,
            node_id = const offset::NODE_ID,
            options(nostack),
        );
    }
    if aborted == 0 {
        Some((cpu, node))
    } else {
        None
    }
}

const _: () = assert!(
    RSEQ_SIG == 0x5305_3053,
    "rseq_abort! hard-codes the signature"
);

/// Whether the CPU has RDPID (CPUID.(EAX=7,ECX=0):ECX bit 22).
pub(crate) fn has_rdpid() -> bool {
    let leaf7 = core::arch::x86_64::__cpuid_count(7, 0);
    leaf7.ecx & (1 << 22) != 0
}

/// Whether the CPU has RDTSCP (CPUID.80000001H:EDX bit 27).
pub(crate) fn has_rdtscp() -> bool {
    let max = core::arch::x86_64::__cpuid(0x8000_0000).eax;
    max >= 0x8000_0001 && core::arch::x86_64::__cpuid(0x8000_0001).edx & (1 << 27) != 0
}

/// `IA32_TSC_AUX` through RDPID. Linux stores `(node << 12) | cpu` there.
#[inline]
pub(crate) fn rdpid() -> u32 {
    let aux: u64;
    // SAFETY: only called after `has_rdpid()` said the instruction exists; it reads a register.
    unsafe {
        asm!("rdpid {}", out(reg) aux, options(nomem, nostack, preserves_flags));
    }
    aux as u32
}

/// `IA32_TSC_AUX` through RDTSCP (which also reads the time stamp counter).
#[inline]
pub(crate) fn rdtscp() -> u32 {
    let mut aux = 0u32;
    // SAFETY: only called after `has_rdtscp()` said the instruction exists.
    unsafe {
        core::arch::x86_64::__rdtscp(&mut aux);
    }
    aux
}

/// The CPU's own instruction for "which CPU am I on", if it has one: `(cpu, node)` decoded from
/// `IA32_TSC_AUX`.
pub(crate) mod native {
    /// `(cpu, node)`. Only call when `available()`.
    #[inline]
    pub(crate) fn cpu_node() -> (u32, u32) {
        let aux = super::rdpid();
        (aux & 0xfff, aux >> 12)
    }
}
