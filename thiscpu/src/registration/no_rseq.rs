//! The rseq registration where thiscpu has no port for the target: nobody registers, and the
//! reason says so. Everything that asks the decision then takes its path without rseq.

use super::facts::{Registrar, RseqFacts, Unavailable};

/// Nobody registers rseq: the target has no port.
pub(super) fn decide_registrar() -> RseqFacts {
    RseqFacts {
        registrar: Registrar::None,
        unavailable: Some(Unavailable::NotPorted),
        kernel_feature_size: 0,
        kernel_align: 0,
        registered_size: 0,
        usable_size: 0,
        glibc_rseq_size: None,
        glibc_rseq_offset: None,
    }
}

/// Never registers: asked only when thiscpu owns rseq, which it never does here.
pub(super) fn register_thread(_size: u32) -> bool {
    false
}
