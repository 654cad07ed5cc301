//! What the rseq registration can find out, as types: who registered the areas, the kernel's
//! mode for them, why rseq is not used, and the facts a registration gathers.

use crate::abi;

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

/// What the registration found: who registers rseq, why nobody does, and what the kernel and
/// glibc say about the areas. The part of the process-wide decision that the system calls
/// answer; the fallback source is chosen from it later.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RseqFacts {
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
}

impl RseqFacts {
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
