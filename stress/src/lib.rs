//! Exactness under stress, for thiscpu's `Counter`, `Pool` and `PerCpuAlloc`: many threads update one of them
//! while another thread migrates them between CPUs at random, a signal storm runs handlers that
//! update the same data inside the interrupted sections' restartable sequences, and short-lived
//! threads come and go. Every operation is also counted privately, so the result can be checked
//! to the unit.
//!
//! `thiscpu stress` runs [`run_counter`], [`run_pool`] and [`run_alloc`]; this crate's tests run them in every
//! CI environment. The driver uses thiscpu's public API only; it lives outside the library so
//! that the library holds the library. [`StartGate`], which releases its workers together, is
//! shared with `thiscpu bench`.
//!
//! Only one run (of either stress) at a time in a process: the signal handler is process-wide
//! and reaches the run's counter through a static; a second run waits for the first.
//!
//! Linux only (signals, `sched_setaffinity` on other threads, `gettid`), like the command that
//! runs it: elsewhere the crate is empty.
#![cfg(target_os = "linux")]

mod alloc;
mod counter;
mod gate;
mod pool;
mod signal;
mod storm;
mod workers;

pub use alloc::{AllocStressConfig, AllocStressReport, run_alloc};
pub use counter::{StressReport, run_counter};
pub use gate::StartGate;
pub use pool::{PoolStressConfig, PoolStressReport, run_pool};
pub use storm::StressConfig;
