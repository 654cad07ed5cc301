//! The rseq registration where thiscpu has no port for the target: nobody registers, and the
//! reason says so. Everything that asks the decision then takes its path without rseq.

use crate::registration::{Process, Registrar, Unavailable};
use crate::via::CpuSource;

/// Nobody registers rseq: the target has no port.
pub(crate) fn decide_registrar() -> Process {
    Process {
        registrar: Registrar::None,
        unavailable: Some(Unavailable::NotPorted),
        kernel_feature_size: 0,
        kernel_align: 0,
        registered_size: 0,
        usable_size: 0,
        glibc_rseq_size: None,
        glibc_rseq_offset: None,
        fallback: CpuSource::ThreadIndex,
    }
}

/// Never registers: asked only when thiscpu owns rseq, which it never does here.
pub(crate) fn register_thread(_size: u32) -> bool {
    false
}
