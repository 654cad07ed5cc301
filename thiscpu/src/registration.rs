//! Who owns rseq in this process, decided once: glibc (when it registered every thread),
//! thiscpu (its own per-thread area, registered lazily on first use in each thread), or nobody
//! (rseq missing, refused, turned off with `THISCPU_RSEQ=off`, or not ported to the target);
//! and which of the kernel's two modes the registration gets. The system calls behind the
//! decision are `os::rseq`'s.
//!
//! # Safety
//! Only the fault injection (`--cfg thiscpu_inject`) calls the C library here; each block
//! states why it holds.

use crate::abi;
use crate::arch::{self, areas, hot};
use crate::decided_once::{self, DecidedOnce};
use crate::os;
use crate::sync::atomic::AtomicI32;
use crate::sync::cell::UnsafeCell;
use crate::topology;
use crate::via::{self, CpuSource};
use core::mem::MaybeUninit;

/// Who registered the rseq areas that thiscpu reads.
///
/// With the `serde` feature: `Serialize` and `Deserialize`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum Registrar {
    /// glibc 2.35+ registered every thread; thiscpu uses glibc's areas.
    Glibc,
    /// thiscpu registers an area of its own in each thread on first use.
    Thiscpu,
    /// Nobody: every answer comes from a fallback source.
    None,
}

impl Registrar {
    /// The name used in reports and JSON: `"glibc"`, `"thiscpu"` or `"none"`.
    pub fn name(self) -> &'static str {
        match self {
            Registrar::Glibc => "glibc",
            Registrar::Thiscpu => "thiscpu",
            Registrar::None => "none",
        }
    }
}

/// Its [`name`](Registrar::name).
///
/// ```
/// assert_eq!(thiscpu::Registrar::Glibc.to_string(), "glibc");
/// println!("rseq registered by {}", thiscpu::source().registrar);
/// ```
impl core::fmt::Display for Registrar {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

/// How the kernel treats a registration, chosen by its length (Linux 7.1 and later, and the
/// stable kernels that took the change).
///
/// A registration of the original 32 bytes runs in *legacy* mode: after every context switch
/// and before every signal the kernel rewrites the CPU, node and concurrency id fields and
/// evaluates `rseq_cs`, even when nothing changed. A registration longer than 32 bytes and at
/// least `AT_RSEQ_FEATURE_SIZE` runs in *optimized* mode ("rseq ABI v2"): the id fields are
/// written only when they change, `rseq_cs` only when user space was interrupted, and a
/// write by user space to an id field kills the process. Kernels older than the split, and
/// architectures whose entry code is not the kernel's generic one, treat every length the
/// legacy way; the kernel offers no way to ask, so the mode is the one the registration asks
/// for.
///
/// ```
/// if let Some(mode) = thiscpu::source().mode {
///     println!("rseq in {} mode", mode.name());
/// }
/// ```
///
/// With the `serde` feature: `Serialize` and `Deserialize`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum RseqMode {
    /// The original behaviour: a 32-byte registration.
    Legacy,
    /// Updates only on change, read-only id fields enforced: a registration of more than 32
    /// bytes and at least the kernel's feature size.
    Optimized,
}

impl RseqMode {
    /// The mode a registration of `registered_size` bytes gets from a kernel whose
    /// `AT_RSEQ_FEATURE_SIZE` is `kernel_feature_size`.
    #[must_use]
    pub fn of_registration(registered_size: u32, kernel_feature_size: u32) -> RseqMode {
        if registered_size > abi::ORIGINAL_AREA_SIZE && registered_size >= kernel_feature_size {
            RseqMode::Optimized
        } else {
            RseqMode::Legacy
        }
    }

    /// The name used in reports and JSON: `"legacy"` or `"optimized"`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            RseqMode::Legacy => "legacy",
            RseqMode::Optimized => "optimized",
        }
    }
}

/// Its [`name`](RseqMode::name).
///
/// ```
/// assert_eq!(thiscpu::RseqMode::Optimized.to_string(), "optimized");
/// ```
impl core::fmt::Display for RseqMode {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why rseq is not used, when it is not.
///
/// ```
/// if let Some(why) = thiscpu::source().unavailable {
///     println!("rseq unavailable: {why}");
/// }
/// // A refusal (here EPERM, from a seccomp filter) reads like other error messages.
/// assert_eq!(
///     thiscpu::Unavailable::Refused(1).to_string(),
///     "the rseq system call was refused: Operation not permitted"
/// );
/// ```
///
/// With the `serde` feature: `Serialize` and `Deserialize`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum Unavailable {
    /// `THISCPU_RSEQ=off` was set.
    TurnedOff,
    /// The kernel has no rseq syscall (before 4.18, `CONFIG_RSEQ=n`, valgrind, qemu-user).
    NoSyscall,
    /// The syscall was refused (a seccomp filter) with this errno.
    Refused(i32),
    /// Threads already have an rseq area that thiscpu cannot find: registered by another
    /// library, or by a libc that does not publish `__rseq_offset`.
    RegisteredElsewhere,
    /// The kernel accepted a registration but did not fill in the CPU; thiscpu withdrew it.
    NoCpuId,
    /// thiscpu has no restartable sequences for this target: every system but Linux, Linux on
    /// architectures other than x86_64, aarch64 and riscv64, and builds with
    /// `--cfg thiscpu_portable`. Per-CPU updates are atomic there.
    NotPorted,
}

impl core::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Unavailable::TurnedOff => f.write_str("turned off with THISCPU_RSEQ=off"),
            Unavailable::NoSyscall => f.write_str("the kernel has no rseq system call"),
            Unavailable::Refused(errno) => {
                // strerror's words, without std's " (os error N)" after them.
                let text = std::io::Error::from_raw_os_error(*errno).to_string();
                let words = text
                    .find(" (os error")
                    .map_or(&text[..], |cut| &text[..cut]);
                write!(f, "the rseq system call was refused: {words}")
            }
            Unavailable::RegisteredElsewhere => f.write_str(
                "threads already have an rseq area thiscpu cannot find \
                 (static glibc or another library)",
            ),
            Unavailable::NoCpuId => {
                f.write_str("the kernel accepted the rseq registration but reported no CPU")
            }
            Unavailable::NotPorted => {
                f.write_str("thiscpu has no restartable sequences for this target")
            }
        }
    }
}

impl std::error::Error for Unavailable {}

/// The process-wide facts, gathered once.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Process {
    pub registrar: Registrar,
    pub unavailable: Option<Unavailable>,
    /// `AT_RSEQ_FEATURE_SIZE`, 0 on kernels before 6.3.
    pub kernel_feature_size: u32,
    /// `AT_RSEQ_ALIGN`, 0 on kernels before 6.3.
    pub kernel_align: u32,
    /// The length the registrar's areas are registered with (0 without rseq).
    pub registered_size: u32,
    /// Bytes of the area the kernel keeps current for the registrar.
    pub usable_size: u32,
    /// glibc's `__rseq_size`, if the symbol exists.
    pub glibc_rseq_size: Option<u32>,
    /// glibc's `__rseq_offset`, if the symbol exists.
    pub glibc_rseq_offset: Option<isize>,
    /// What answers where rseq cannot.
    pub fallback: CpuSource,
}

impl Process {
    /// The mode of the registrar's areas, `None` without rseq.
    pub fn mode(&self) -> Option<RseqMode> {
        (self.registrar != Registrar::None)
            .then(|| RseqMode::of_registration(self.registered_size, self.kernel_feature_size))
    }

    /// The length of an optimized-mode registration of thiscpu's own area on this kernel, if
    /// the kernel offers that mode and the area has room for it.
    pub fn optimized_size(&self) -> Option<u32> {
        let size = abi::own_registration_size(self.kernel_feature_size, self.kernel_align, false);
        (size > abi::ORIGINAL_AREA_SIZE).then_some(size)
    }

    pub fn node_id_usable(&self) -> bool {
        self.registrar != Registrar::None
            && abi::field_usable(self.usable_size, abi::offset::NODE_ID)
    }

    pub fn mm_cid_usable(&self) -> bool {
        self.registrar != Registrar::None
            && abi::field_usable(self.usable_size, abi::offset::MM_CID)
    }
}

/// The decision, published whole once made (see `DecidedOnce`).
static PROCESS: DecidedOnce<Process> = DecidedOnce::new(
    AtomicI32::new(decided_once::UNDECIDED),
    UnsafeCell::new(MaybeUninit::uninit()),
);

/// Whether the process decided that the areas' `mm_cid` is kept current: a copy of
/// `Process::mm_cid_usable` that inline fast paths test with one load (a hot word). False
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
    registrar: Registrar::Thiscpu,
    unavailable: None,
    kernel_feature_size: 0,
    kernel_align: 0,
    registered_size: 32,
    usable_size: 20,
    glibc_rseq_size: None,
    glibc_rseq_offset: None,
    fallback: CpuSource::Syscall,
};

/// Whether the process decided that nobody uses rseq: the callers' slow paths then skip the
/// registration check. False while undecided.
#[inline]
pub(crate) fn decided_without_rseq() -> bool {
    PROCESS
        .get()
        .is_some_and(|process| process.registrar == Registrar::None)
}

/// The whole process-wide decision: rseq's owner and usable fields, the fallback source, the
/// topology tables. Calls nothing that asks for the decision.
///
/// Everything is worked out before anything that inline fast paths read is written, so that a
/// decision that unwinds half-way leaves those caches as they were, and the next decision
/// starts from the same state (a thread it already registered included, see
/// `register_own_area`).
fn decide() -> Process {
    let process = os::rseq::decide_registrar();
    inject::signal_in_decision();
    inject::panic_in_decision();
    inject::delay_in_decision();
    // Read now, so that nothing asks `/sys` or allocates for them later.
    topology::prepare();
    let process = Process {
        fallback: via::choose_fallback(),
        ..process
    };
    copy_to_fast_paths(&process);
    process
}

/// Writes the copies of the decision that inline fast paths read. Each only ever goes from
/// "take the slow path" to its final value, once; a reader that still sees the old value takes
/// the slow path, where it asks the published decision.
fn copy_to_fast_paths(process: &Process) {
    arch::set_hot_word::<{ hot::MM_CID_USABLE }>(process.mm_cid_usable().into());
    let registered_area = match (process.registrar, process.glibc_rseq_offset) {
        (Registrar::Glibc, Some(offset)) => offset,
        _ => arch::own_area_offset(),
    };
    // Until now `getcpu`'s fast path read the blank area, which sent it to the slow path.
    if process.node_id_usable() {
        arch::set_area_offset::<{ areas::NODE }>(registered_area);
    }
    if process.registrar == Registrar::Glibc {
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
    process.registrar == Registrar::Thiscpu && os::rseq::register_thread(process.registered_size)
}

/// Fault injection for tests, built only with `--cfg thiscpu_inject`. `no_cpu_id` and
/// `defer_decision` act on the rseq registration, which targets without a port never make.
#[cfg_attr(not(thiscpu_rseq), allow(dead_code))]
pub(crate) mod inject {
    /// Whether to act as if the kernel left `cpu_id` negative after accepting a registration:
    /// `THISCPU_INJECT_NO_CPU_ID` is set in the environment.
    #[cfg(thiscpu_inject)]
    pub(crate) fn no_cpu_id() -> bool {
        // SAFETY: `getenv` with a NUL-terminated name; only the result's nullness is used.
        !unsafe { libc::getenv(c"THISCPU_INJECT_NO_CPU_ID".as_ptr()) }.is_null()
    }

    #[cfg(not(thiscpu_inject))]
    #[inline(always)]
    pub(crate) fn no_cpu_id() -> bool {
        false
    }

    /// The signal number in `THISCPU_INJECT_SIGNAL_IN_DECISION`, if set.
    #[cfg(thiscpu_inject)]
    fn signal() -> Option<i32> {
        // SAFETY: `getenv` with a NUL-terminated name; a non-null result is a NUL-terminated
        // string, read at once.
        let value = unsafe { libc::getenv(c"THISCPU_INJECT_SIGNAL_IN_DECISION".as_ptr()) };
        if value.is_null() {
            return None;
        }
        // SAFETY: as above.
        let value = unsafe { std::ffi::CStr::from_ptr(value) };
        value.to_str().ok()?.parse().ok()
    }

    /// With `THISCPU_INJECT_SIGNAL_IN_DECISION` set, the decision waits for its first use, so
    /// that a test can install its signal handler first; with `THISCPU_INJECT_DEFER_DECISION`
    /// set it waits too, so that a test can make a first call before anything is decided.
    #[cfg(thiscpu_inject)]
    pub(crate) fn defer_decision() -> bool {
        // SAFETY: `getenv` with a NUL-terminated name; only the result's nullness is used.
        let deferred =
            !unsafe { libc::getenv(c"THISCPU_INJECT_DEFER_DECISION".as_ptr()) }.is_null();
        // SAFETY: as above.
        let panics =
            !unsafe { libc::getenv(c"THISCPU_INJECT_PANIC_IN_DECISION".as_ptr()) }.is_null();
        deferred || panics || signal().is_some()
    }

    #[cfg(not(thiscpu_inject))]
    #[inline(always)]
    pub(crate) fn defer_decision() -> bool {
        false
    }

    /// Raises the signal in `THISCPU_INJECT_SIGNAL_IN_DECISION` on the deciding thread, in the
    /// middle of the decision.
    #[cfg(thiscpu_inject)]
    pub(crate) fn signal_in_decision() {
        if let Some(signal) = signal() {
            // SAFETY: raises a signal whose handler the test installed.
            unsafe { libc::raise(signal) };
        }
    }

    #[cfg(not(thiscpu_inject))]
    #[inline(always)]
    pub(crate) fn signal_in_decision() {}

    /// With `THISCPU_INJECT_PANIC_IN_DECISION` set, the decision waits for its first use, and
    /// the first decision panics halfway (after registering its thread), once.
    #[cfg(thiscpu_inject)]
    pub(crate) fn panic_in_decision() {
        use core::sync::atomic::{AtomicBool, Ordering};
        static PANICKED: AtomicBool = AtomicBool::new(false);
        // SAFETY: `getenv` with a NUL-terminated name; only the result's nullness is used.
        let asked =
            !unsafe { libc::getenv(c"THISCPU_INJECT_PANIC_IN_DECISION".as_ptr()) }.is_null();
        if asked && !PANICKED.swap(true, Ordering::Relaxed) {
            panic!("a decision that fails halfway (THISCPU_INJECT_PANIC_IN_DECISION)");
        }
    }

    #[cfg(not(thiscpu_inject))]
    #[inline(always)]
    pub(crate) fn panic_in_decision() {}

    /// With `THISCPU_INJECT_DELAY_IN_DECISION` set to a number of milliseconds, the decision
    /// sleeps that long halfway, so that other threads race it for that long.
    #[cfg(thiscpu_inject)]
    pub(crate) fn delay_in_decision() {
        // SAFETY: `getenv` with a NUL-terminated name; a non-null result is a NUL-terminated
        // string, read at once.
        let value = unsafe { libc::getenv(c"THISCPU_INJECT_DELAY_IN_DECISION".as_ptr()) };
        if value.is_null() {
            return;
        }
        // SAFETY: as above.
        let value = unsafe { std::ffi::CStr::from_ptr(value) };
        if let Some(ms) = value.to_str().ok().and_then(|text| text.parse().ok()) {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
    }

    #[cfg(not(thiscpu_inject))]
    #[inline(always)]
    pub(crate) fn delay_in_decision() {}
}
