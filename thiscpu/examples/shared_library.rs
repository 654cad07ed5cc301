//! thiscpu inside a shared library, as in a plugin or a Python extension module: this example
//! builds as a `cdylib` (`libshared_library.so`) exporting C functions, and
//! `tests/shared_library.rs` loads it with `dlopen` and checks its answers. The library holds
//! its own copy of thiscpu; where glibc registered rseq, both copies read glibc's area.
//!
//! ```text
//! cargo build -p thiscpu --example shared_library
//! python3 -c 'import ctypes; print(ctypes.CDLL("target/debug/examples/libshared_library.so").shared_current_cpu())'
//! ```

use std::sync::OnceLock;
use thiscpu::{Counter, Registrar};

/// `thiscpu::current_cpu()`.
#[unsafe(no_mangle)]
pub extern "C" fn shared_current_cpu() -> u32 {
    thiscpu::current_cpu()
}

/// Who registered the rseq area that this copy of thiscpu reads: 0 nobody (the fallback
/// answers), 1 glibc, 2 thiscpu.
#[unsafe(no_mangle)]
pub extern "C" fn shared_registrar() -> u32 {
    match thiscpu::source().registrar {
        Registrar::None => 0,
        Registrar::Glibc => 1,
        Registrar::Thiscpu => 2,
    }
}

fn requests() -> &'static Counter {
    static REQUESTS: OnceLock<Counter> = OnceLock::new();
    REQUESTS.get_or_init(Counter::new)
}

/// Adds `n` to the library's per-CPU counter.
#[unsafe(no_mangle)]
pub extern "C" fn shared_count(n: u64) {
    requests().add(n);
}

/// The library's per-CPU counter's total.
#[unsafe(no_mangle)]
pub extern "C" fn shared_total() -> u64 {
    requests().sum()
}
