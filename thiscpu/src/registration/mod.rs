//! Who owns rseq in this process, decided once: glibc (when it registered every thread),
//! thiscpu (its own per-thread area, registered lazily on first use in each thread), or nobody
//! (rseq missing, refused, turned off with `THISCPU_RSEQ=off`, or not ported to the target);
//! and which of the kernel's two modes the registration gets.
//!
//! The room holds the decision (here), the types it is told in (`facts.rs`), the system calls
//! behind it (`rseq.rs` on Linux with an architecture port, `no_rseq.rs` everywhere else, as the
//! build script's `thiscpu_rseq` chooses) and the fault injection its tests use
//! (`inject.rs`). Only the decision asks the others; none of them asks it.
//!
//! # Safety
//! Here, only the constructor that makes the decision before `main` (placed in
//! `.init_array`); the system calls and the injection's C calls state their own.

use crate::abi;
use crate::arch::{self, areas, hot};
use crate::decided_once::{self, DecidedOnce};
use crate::sync::atomic::AtomicI32;
use crate::sync::cell::UnsafeCell;
use crate::topology;
use crate::via::{self, CpuSource};
use core::mem::MaybeUninit;

mod facts;
#[cfg_attr(not(thiscpu_rseq), allow(dead_code))]
mod inject;

#[cfg(thiscpu_rseq)]
mod rseq;

#[cfg(not(thiscpu_rseq))]
#[path = "no_rseq.rs"]
mod rseq;

pub(crate) use facts::RseqFacts;
pub use facts::{Registrar, RseqMode, Unavailable};

/// Runs the decision before `main`, so that no first call pays for it, and no first call
/// happens inside a signal handler.
#[cfg(thiscpu_rseq)]
#[used]
// SAFETY: the loader calls each `.init_array` entry as an `extern "C" fn()` once, before
// `main`; this is one, and it unwinds nowhere (a panic in an `extern "C"` function aborts).
#[unsafe(link_section = ".init_array")]
static DECIDE_AT_STARTUP: extern "C" fn() = decide_at_startup;

#[cfg(thiscpu_rseq)]
extern "C" fn decide_at_startup() {
    if inject::defer_decision() {
        return;
    }
    let _ = decided();
}

/// The process-wide decision: what the registration found, and what answers where rseq
/// cannot.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Process {
    pub rseq: RseqFacts,
    pub fallback: CpuSource,
}

/// The decision, published whole once made (see `DecidedOnce`).
static PROCESS: DecidedOnce<Process> = DecidedOnce::new(
    AtomicI32::new(decided_once::UNDECIDED),
    UnsafeCell::new(MaybeUninit::uninit()),
);

/// Whether the process decided that the areas' `mm_cid` is kept current: a copy of
/// `RseqFacts::mm_cid_usable` that inline fast paths test with one load (a hot word). False
/// until the decision, which sends the first calls to the slow path, where the decision is
/// made; never changes once true. A false answer only ever means "ask the slow path".
#[inline(always)]
pub(crate) fn mm_cid_usable() -> bool {
    arch::hot_word::<{ hot::MM_CID_USABLE }>() != 0
}

/// The process-wide decision, made on first call (normally by a constructor before `main`).
/// `None` only in a signal handler that interrupted the decision on the thread making it:
/// such a caller must act without the decision, in a way that is right whatever it turns
/// out to be (an atomic update of a word no section writes, an object that never uses
/// sections, a system call).
///
/// Safe against that reentry (the handler does not wait for its own thread), against
/// concurrent first calls (other threads wait for the decision, which makes a handful of
/// system calls and never waits for them), against a decision that unwinds, and against a
/// `fork` in the middle of it (see `DecidedOnce`).
#[inline]
pub(crate) fn decided() -> Option<&'static Process> {
    #[cfg(thiscpu_model)]
    return Some(&MODEL_PROCESS);
    #[cfg(not(thiscpu_model))]
    PROCESS.get_or_decide(&crate::os::Threads, decide)
}

/// The process as the model checker's machine shows it: thiscpu registers every thread.
#[cfg(thiscpu_model)]
static MODEL_PROCESS: Process = Process {
    rseq: RseqFacts {
        registrar: Registrar::Thiscpu,
        unavailable: None,
        kernel_feature_size: 0,
        kernel_align: 0,
        registered_size: 32,
        usable_size: 20,
        glibc_rseq_size: None,
        glibc_rseq_offset: None,
    },
    fallback: CpuSource::Syscall,
};

/// Whether the process decided that nobody uses rseq: the callers' slow paths then skip the
/// registration check. False while undecided.
#[inline]
pub(crate) fn decided_without_rseq() -> bool {
    PROCESS
        .get()
        .is_some_and(|process| process.rseq.registrar == Registrar::None)
}

/// The whole process-wide decision: rseq's owner and usable fields, the fallback source, the
/// topology tables. Calls nothing that asks for the decision.
///
/// Everything is worked out before anything that inline fast paths read is written, so that a
/// decision that unwinds half-way leaves those caches as they were, and the next decision
/// starts from the same state (a thread it already registered included, see
/// `register_own_area`).
fn decide() -> Process {
    let facts = rseq::decide_registrar();
    inject::signal_in_decision();
    inject::panic_in_decision();
    inject::delay_in_decision();
    // Read now, so that nothing asks `/sys` or allocates for them later.
    topology::prepare();
    let process = Process {
        rseq: facts,
        fallback: via::choose_fallback(),
    };
    copy_to_fast_paths(&process);
    process
}

/// Writes the copies of the decision that inline fast paths read. Each only ever goes from
/// "take the slow path" to its final value, once; a reader that still sees the old value takes
/// the slow path, where it asks the published decision.
fn copy_to_fast_paths(process: &Process) {
    let facts = &process.rseq;
    arch::set_hot_word::<{ hot::MM_CID_USABLE }>(facts.mm_cid_usable().into());
    let registered_area = match (facts.registrar, facts.glibc_rseq_offset) {
        (Registrar::Glibc, Some(offset)) => offset,
        _ => arch::own_area_offset(),
    };
    // Until now `getcpu`'s fast path read the blank area, which sent it to the slow path.
    if facts.node_id_usable() {
        arch::set_area_offset::<{ areas::NODE }>(registered_area);
    }
    if facts.registrar == Registrar::Glibc {
        arch::set_area_offset::<{ areas::ACTIVE }>(registered_area);
    }
}

/// Registers thiscpu's own area for the calling thread when thiscpu owns rseq in this process.
/// Returns whether the calling thread's active area is registered afterwards.
///
/// Async-signal-safe once the process-wide decision is made: it touches only this thread's
/// area and a thread-local flag, and makes one syscall.
#[cold]
pub(crate) fn ensure_registered() -> bool {
    let Some(process) = decided() else {
        return false;
    };
    if arch::field_at::<{ abi::offset::CPU_ID }>(arch::area_offset()) >= 0 {
        return true;
    }
    let facts = &process.rseq;
    facts.registrar == Registrar::Thiscpu && rseq::register_thread(facts.registered_size)
}

#[cfg(all(test, thiscpu_rseq))]
mod tests {
    use super::*;

    /// Registering thiscpu's own area again on a thread where it is registered (the thread of a
    /// decision that unwound, or a child forked during the decision) keeps the registration and
    /// writes nothing into the area. Only where thiscpu registers its own areas.
    #[test]
    fn registering_a_registered_own_area_again_keeps_it() {
        let Some(process) = decided().filter(|p| p.rseq.registrar == Registrar::Thiscpu) else {
            eprintln!("skipped: thiscpu does not register its own areas in this process");
            return;
        };
        let size = process.rseq.registered_size;
        std::thread::spawn(move || {
            assert!(ensure_registered());
            let own = arch::area_at(arch::own_area_offset());
            // SAFETY: this thread's own area; `cpu_id` is read as the kernel writes it.
            let cpu_id = || unsafe { core::ptr::addr_of!((*own).cpu_id).read_volatile() };
            assert!(cpu_id() >= 0);
            assert_eq!(rseq::register_own_area(size), Ok(size));
            assert!(cpu_id() >= 0, "the registered area was rewritten");
            // The kernel still has this very area: the same registration is "busy".
            // SAFETY: the area is registered with `size` bytes; asking again changes nothing.
            let again = unsafe { rseq::own_area_syscall(own, size, 0) };
            assert_eq!(again, -1);
            assert_eq!(
                std::io::Error::last_os_error().raw_os_error(),
                Some(libc::EBUSY)
            );
        })
        .join()
        .unwrap();
    }
}
