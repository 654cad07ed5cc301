//! The kernel's rseq ABI as Rust types: the per-thread area, the critical-section descriptor,
//! and the constants user space needs. Layouts follow `include/uapi/linux/rseq.h`; every offset
//! that assembly uses is pinned here against `offset_of!`.

use core::mem::{align_of, offset_of, size_of};

/// `RSEQ_CPU_ID_UNINITIALIZED`: the area is not registered (or was unregistered).
pub const CPU_ID_UNINITIALIZED: i32 = -1;
/// `RSEQ_CPU_ID_REGISTRATION_FAILED`: glibc's marker for "registration failed or disabled".
pub const CPU_ID_REGISTRATION_FAILED: i32 = -2;
/// `RSEQ_FLAG_UNREGISTER`.
pub const FLAG_UNREGISTER: i32 = 1;
/// `AT_RSEQ_FEATURE_SIZE` (Linux 6.3+): `offsetof(struct rseq, end)`.
pub const AT_RSEQ_FEATURE_SIZE: libc::c_ulong = 27;
/// `AT_RSEQ_ALIGN` (Linux 6.3+).
pub const AT_RSEQ_ALIGN: libc::c_ulong = 28;
/// The registration length every kernel since 4.18 accepts.
pub const ORIGINAL_AREA_SIZE: u32 = 32;
/// Bytes of the area the original ABI fills (up to and including `flags`).
pub const ORIGINAL_FEATURE_SIZE: u32 = 20;
/// Bytes reserved for thiscpu's own area in static TLS, and their alignment: room for an
/// optimized-mode registration on kernels whose feature size rounds up to at most this (Linux
/// 7.2: feature size 33, alignment 64). A kernel that asks for more gets a 32-byte (legacy)
/// registration instead.
pub const OWN_AREA_CAPACITY: u32 = 64;

/// `MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ` (Linux 5.10): restart the process's restartable
/// sequences running on the CPUs targeted.
pub const MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ: i32 = 1 << 7;
/// `MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ` (Linux 5.10).
pub const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ: i32 = 1 << 8;
/// `MEMBARRIER_CMD_FLAG_CPU`: target only the CPU in the third argument.
pub const MEMBARRIER_CMD_FLAG_CPU: u32 = 1;

/// `struct rseq`: the per-thread area the kernel keeps up to date.
///
/// Size and alignment: 32 bytes, 32-byte aligned, as the original ABI requires. `node_id` and
/// `mm_cid` are written only by Linux 6.3 and later; see [`crate::Source`] for how thiscpu
/// decides whether they are usable.
#[repr(C, align(32))]
#[derive(Debug)]
pub struct Rseq {
    /// Current CPU, always a valid index (0 when unregistered).
    pub cpu_id_start: u32,
    /// Current CPU, or [`CPU_ID_UNINITIALIZED`] / [`CPU_ID_REGISTRATION_FAILED`].
    pub cpu_id: i32,
    /// Address of the active [`RseqCs`], or 0.
    pub rseq_cs: u64,
    /// Must stay 0 (the restart-inhibit flags are deprecated and fatal since Linux 6.0).
    pub flags: u32,
    /// NUMA node of `cpu_id` (Linux 6.3+).
    pub node_id: u32,
    /// Memory-map concurrency id (Linux 6.3+).
    pub mm_cid: u32,
}

impl Rseq {
    /// An area as the kernel requires it before registration, and as it reads unregistered:
    /// `cpu_id` [`CPU_ID_UNINITIALIZED`], everything else 0.
    pub const UNREGISTERED: Rseq = Rseq {
        cpu_id_start: 0,
        cpu_id: CPU_ID_UNINITIALIZED,
        rseq_cs: 0,
        flags: 0,
        node_id: 0,
        mm_cid: 0,
    };
}

/// `struct rseq_cs`: describes one critical section to the kernel.
#[repr(C, align(32))]
#[derive(Debug)]
pub struct RseqCs {
    /// Must be 0.
    pub version: u32,
    /// Must be 0.
    pub flags: u32,
    /// First instruction of the section.
    pub start_ip: u64,
    /// Length of the section in bytes; the commit instruction ends right at its end.
    pub post_commit_offset: u64,
    /// Where the kernel sends an interrupted section; preceded by the registration signature.
    pub abort_ip: u64,
}

/// Field offsets used inside `asm!`, named once and checked against the struct below.
pub mod offset {
    /// `struct rseq.cpu_id_start`.
    pub const CPU_ID_START: usize = 0;
    /// `struct rseq.cpu_id`.
    pub const CPU_ID: usize = 4;
    /// `struct rseq.rseq_cs`.
    pub const RSEQ_CS: usize = 8;
    /// `struct rseq.node_id`.
    pub const NODE_ID: usize = 20;
    /// `struct rseq.mm_cid`.
    pub const MM_CID: usize = 24;
}

const _: () = {
    assert!(offset_of!(Rseq, cpu_id_start) == offset::CPU_ID_START);
    assert!(offset_of!(Rseq, cpu_id) == offset::CPU_ID);
    assert!(offset_of!(Rseq, rseq_cs) == offset::RSEQ_CS);
    assert!(offset_of!(Rseq, flags) == 16);
    assert!(offset_of!(Rseq, node_id) == offset::NODE_ID);
    assert!(offset_of!(Rseq, mm_cid) == offset::MM_CID);
    assert!(size_of::<Rseq>() == ORIGINAL_AREA_SIZE as usize);
    assert!(align_of::<Rseq>() == 32);
    assert!(offset_of!(RseqCs, version) == 0);
    assert!(offset_of!(RseqCs, flags) == 4);
    assert!(offset_of!(RseqCs, start_ip) == 8);
    assert!(offset_of!(RseqCs, post_commit_offset) == 16);
    assert!(offset_of!(RseqCs, abort_ip) == 24);
    assert!(OWN_AREA_CAPACITY >= ORIGINAL_AREA_SIZE);
    assert!(OWN_AREA_CAPACITY.is_power_of_two());
    assert!(size_of::<RseqCs>() == 32);
    assert!(align_of::<RseqCs>() == 32);
};

/// Bytes of the area that the kernel keeps current, given the size a registrant reported and
/// the kernel's `AT_RSEQ_FEATURE_SIZE`.
///
/// glibc reports 20 or 32 (depending on version) even where the kernel fills `node_id` and
/// `mm_cid` inside the 32 registered bytes; in that case the kernel's feature size, capped at
/// 32, is what is really kept up to date (librseq decides the same way).
///
/// A larger registration (glibc 2.41+ reports the feature size itself; thiscpu's own
/// optimized-mode area is the feature size rounded up to the alignment) is kept current up to
/// the kernel's feature size: the bytes past it are padding.
pub fn usable_size(registered_size: u32, kernel_feature_size: u32) -> u32 {
    if registered_size == ORIGINAL_FEATURE_SIZE || registered_size == ORIGINAL_AREA_SIZE {
        // Written as a clamp on purpose. LLVM 22 (rustc 1.95.0 with LLVM 22.1.2, 1.96.0 with
        // 22.1.8) optimises the equivalent `if k > 20 { k.min(32) } else { 20 }` into
        // `umin(k, 32)`: inside the branch it marks `k` with the range attribute [21, 2^32),
        // then folds the branch away and keeps the attribute, so k <= 20 becomes poison and
        // the function returns k (0 for k = 0) instead of 20. Inside this function x86_64 code
        // happened to come out right, aarch64 code from 1.96 did not; a standalone copy of the
        // branch is miscompiled on both: tests/optimiser.rs reproduces it, and checks this
        // function in an optimised build.
        kernel_feature_size.clamp(ORIGINAL_FEATURE_SIZE, ORIGINAL_AREA_SIZE)
    } else {
        registered_size.min(kernel_feature_size.max(ORIGINAL_FEATURE_SIZE))
    }
}

/// The length thiscpu's own area is registered with, given the kernel's
/// `AT_RSEQ_FEATURE_SIZE` and `AT_RSEQ_ALIGN`: the feature size rounded up to the alignment
/// when the feature size exceeds 32 (the kernel then runs the area in its optimized mode, and
/// requires a length of at least the feature size and an area aligned to `AT_RSEQ_ALIGN`),
/// otherwise 32, the only length kernels before 6.3 accept. Also 32 when the kernel asks for
/// more room or alignment than [`OWN_AREA_CAPACITY`], or publishes an alignment that is not a
/// power of two, or when `legacy` is asked for.
pub fn own_registration_size(kernel_feature_size: u32, kernel_align: u32, legacy: bool) -> u32 {
    if legacy || kernel_feature_size <= ORIGINAL_AREA_SIZE {
        return ORIGINAL_AREA_SIZE;
    }
    if !kernel_align.is_power_of_two() || kernel_align > OWN_AREA_CAPACITY {
        return ORIGINAL_AREA_SIZE;
    }
    match kernel_feature_size.checked_next_multiple_of(kernel_align) {
        Some(size) if size <= OWN_AREA_CAPACITY => size,
        _ => ORIGINAL_AREA_SIZE,
    }
}

/// Whether a field ending at `end` lies inside the usable size.
pub const fn field_usable(usable: u32, field_offset: usize) -> bool {
    usable as usize >= field_offset + 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usable_size_follows_the_kernel_when_glibc_reports_the_original_sizes() {
        assert_eq!(usable_size(20, 28), 28);
        assert_eq!(usable_size(32, 28), 28);
        assert_eq!(usable_size(32, 0), 20);
        assert_eq!(usable_size(20, 0), 20);
        assert_eq!(usable_size(28, 28), 28);
        assert_eq!(usable_size(32, 40), 32);
        assert!(field_usable(28, offset::MM_CID));
        assert!(!field_usable(20, offset::NODE_ID));
        assert!(field_usable(24, offset::NODE_ID));
        // An optimized-mode area: kept current up to the feature size, not its padding.
        assert_eq!(usable_size(64, 33), 33);
        assert_eq!(usable_size(33, 33), 33);
    }

    #[test]
    fn own_registration_is_the_feature_size_rounded_up_to_the_alignment() {
        // Linux 7.2.
        assert_eq!(own_registration_size(33, 64, false), 64);
        assert_eq!(own_registration_size(33, 64, true), 32);
        // Linux 6.3 to 7.1: feature size 28 fits the original 32 bytes.
        assert_eq!(own_registration_size(28, 32, false), 32);
        // Before 6.3 (and qemu-user): no auxv entries.
        assert_eq!(own_registration_size(0, 0, false), 32);
        // A feature size of exactly 32 is still the original length.
        assert_eq!(own_registration_size(32, 32, false), 32);
        // Rounded up to the alignment, whatever it is.
        assert_eq!(own_registration_size(40, 32, false), 64);
        assert_eq!(own_registration_size(48, 16, false), 48);
        // More than the reserved room, or an alignment it cannot meet: legacy, never overflow.
        assert_eq!(own_registration_size(65, 128, false), 32);
        assert_eq!(own_registration_size(65, 64, false), 32);
        assert_eq!(own_registration_size(33, 128, false), 32);
        assert_eq!(own_registration_size(u32::MAX, 64, false), 32);
        // A nonsensical alignment.
        assert_eq!(own_registration_size(33, 0, false), 32);
        assert_eq!(own_registration_size(33, 48, false), 32);
    }
}
