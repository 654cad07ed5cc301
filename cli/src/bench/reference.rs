//! The C reference loops (`reference.c`): what a C programmer gets from the same rseq area, so
//! that every run states thiscpu's ratio to C on the machine it runs on. Compiled into the
//! command on x86_64 Linux only (`build.rs`); elsewhere each case says why it is left out.
//!
//! Each safe function here checks what the C side needs (the calling thread's area registered,
//! a slot for every CPU) before it calls in.

use super::model::Workload;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Bytes between two CPUs' slots of [`Slots`]: the C side's `1 << SLOT_SHIFT`.
const SLOT_BYTES: usize = 128;
const WORDS_PER_SLOT: usize = SLOT_BYTES / 8;

#[cfg(thiscpu_c_reference)]
mod c {
    unsafe extern "C" {
        pub fn thiscpu_c_cpu_id_loop(ops: u64, offset: isize) -> u64;
        pub fn thiscpu_c_cpu_node_loop(ops: u64, offset: isize) -> u64;
        pub fn thiscpu_c_add_loop(ops: u64, offset: isize, slots: *mut u64, count: u64) -> u64;
        pub fn thiscpu_c_add_loop_reloaded(ops: u64, counter: *const Counter) -> u64;
    }

    /// `struct thiscpu_c_counter`.
    #[repr(C)]
    pub struct Counter {
        pub offset: isize,
        pub slots: *mut u64,
        pub slot_count: u64,
    }
}

/// Why the C reference cannot run here, or `None` if it can: it is built for x86_64 Linux,
/// and reads the rseq area that thiscpu reads, so rseq must be in use.
pub fn unavailable() -> Option<String> {
    if !cfg!(thiscpu_c_reference) {
        return Some("the C reference loops are built for x86_64 Linux only".to_owned());
    }
    let source = thiscpu::source();
    match (source.area_offset, source.unavailable) {
        (Some(_), _) => None,
        (None, Some(why)) => Some(format!("rseq not in use: {why}")),
        (None, None) => Some("rseq not in use".to_owned()),
    }
}

/// The offset of the calling thread's area, registered: thiscpu registers its own areas lazily,
/// so a first call makes sure this thread's is.
#[cfg_attr(not(thiscpu_c_reference), allow(dead_code))]
fn registered_area() -> Option<isize> {
    let _ = thiscpu::current_cpu();
    let source = thiscpu::source();
    let rseq = matches!(
        source.this_thread,
        thiscpu::CpuSource::RseqGlibc | thiscpu::CpuSource::RseqThiscpu
    );
    source.area_offset.filter(|_| rseq)
}

/// `ops` loads of `cpu_id` in C; false if this thread's area is not registered.
pub fn cpu_id_loop(ops: u64) -> bool {
    #[cfg(thiscpu_c_reference)]
    if let Some(offset) = registered_area() {
        // SAFETY: `offset` is the calling thread's registered area's offset from its thread
        // pointer (checked just above); the loop only reads the area.
        return unsafe { c::thiscpu_c_cpu_id_loop(ops, offset) } != u64::MAX;
    }
    let _ = ops;
    false
}

/// `ops` reads of (`cpu_id`, `node_id`) in C, each in a restartable sequence; false if this
/// thread's area is not registered.
pub fn cpu_node_loop(ops: u64) -> bool {
    #[cfg(thiscpu_c_reference)]
    if let Some(offset) = registered_area() {
        // SAFETY: as in `cpu_id_loop`; the section writes only the area's `rseq_cs`, which
        // user space owns, and the kernel clears it when the thread leaves the section.
        return unsafe { c::thiscpu_c_cpu_node_loop(ops, offset) } != u64::MAX;
    }
    let _ = ops;
    false
}

/// One counter slot per possible CPU, [`SLOT_BYTES`] apart, that the C add loop increments.
pub struct Slots {
    words: Box<[AtomicU64]>,
}

impl Slots {
    pub fn new(cpus: usize) -> Slots {
        Slots {
            words: (0..cpus * WORDS_PER_SLOT)
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }

    /// The sum of every CPU's slot. Exact once the loops that add to them have returned.
    pub fn sum(&self) -> u64 {
        self.words
            .iter()
            .step_by(WORDS_PER_SLOT)
            .map(|word| word.load(Ordering::Relaxed))
            .sum()
    }

    /// `ops` increments of the calling thread's CPU's slot, each a restartable sequence in C;
    /// false if this thread's area is not registered or a CPU has no slot (having stopped
    /// there).
    pub fn add_loop(&self, ops: u64) -> bool {
        #[cfg(thiscpu_c_reference)]
        if let Some(offset) = registered_area() {
            let count = (self.words.len() / WORDS_PER_SLOT) as u64;
            // SAFETY: the area is the calling thread's, registered (checked above); the slots
            // are `count` slots of `SLOT_BYTES` each, live for the call. The C side writes a
            // slot only inside a restartable sequence on that slot's CPU, which no other write
            // to it can interleave with, and checks each CPU number against `count`. Its
            // commit is one aligned 8-byte `mov` inside an `asm` block, which on x86_64 (the
            // only target the C side is built for) is a relaxed atomic store: `sum`, which
            // loads the same words atomically, may run on any thread at any time and races
            // with nothing.
            let aborts = unsafe {
                c::thiscpu_c_add_loop(ops, offset, self.words.as_ptr() as *mut u64, count)
            };
            return aborts != u64::MAX;
        }
        let _ = ops;
        false
    }

    /// As [`add_loop`](Slots::add_loop), with the area's offset, the slots' address and their
    /// count read from a C struct before every increment, as a C `counter_inc(&counter)` does
    /// after each section's memory clobber (and as `Counter::inc` does).
    pub fn add_loop_reloaded(&self, ops: u64) -> bool {
        #[cfg(thiscpu_c_reference)]
        if let Some(offset) = registered_area() {
            let counter = c::Counter {
                offset,
                slots: self.words.as_ptr() as *mut u64,
                slot_count: (self.words.len() / WORDS_PER_SLOT) as u64,
            };
            // SAFETY: as in `add_loop`: the struct holds the same three values, and lives for
            // the call.
            let aborts = unsafe { c::thiscpu_c_add_loop_reloaded(ops, &counter) };
            return aborts != u64::MAX;
        }
        let _ = ops;
        false
    }
}

/// A case that runs one of the C loops: the run fails if a loop could not run.
pub struct CLoop {
    run: fn(u64) -> bool,
    failed: AtomicBool,
}

impl CLoop {
    pub fn new(run: fn(u64) -> bool) -> CLoop {
        CLoop {
            run,
            failed: AtomicBool::new(false),
        }
    }
}

impl Workload for CLoop {
    fn run(&self, _worker: usize, ops: u64) {
        if !(self.run)(ops) {
            self.failed.store(true, Ordering::Relaxed);
        }
    }

    fn verify(&self, _ops: u64) -> Result<(), String> {
        if self.failed.load(Ordering::Relaxed) {
            return Err("a C reference loop found its thread's rseq area unregistered".to_owned());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only where the C loops run: built for the target, rseq in use.
    fn runnable() -> bool {
        match unavailable() {
            None => true,
            Some(why) => {
                eprintln!("skipped: {why}");
                false
            }
        }
    }

    #[test]
    fn the_c_add_loop_counts_every_increment_from_every_thread() {
        if !runnable() {
            return;
        }
        let slots = Slots::new(thiscpu::topology::possible_cpus());
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| assert!(slots.add_loop(250_000)));
            }
        });
        assert_eq!(slots.sum(), 1_000_000);
    }

    #[test]
    fn the_reloaded_c_add_loop_counts_every_increment_from_every_thread() {
        if !runnable() {
            return;
        }
        let slots = Slots::new(thiscpu::topology::possible_cpus());
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| assert!(slots.add_loop_reloaded(250_000)));
            }
        });
        assert_eq!(slots.sum(), 1_000_000);
    }

    #[test]
    fn the_c_add_loop_stops_at_a_cpu_without_a_slot() {
        if !runnable() {
            return;
        }
        let none = Slots::new(0);
        assert!(!none.add_loop(10));
        assert!(!none.add_loop_reloaded(10));
        assert_eq!(none.sum(), 0);
    }

    #[test]
    fn the_c_reads_run_on_a_registered_area() {
        if !runnable() {
            return;
        }
        assert!(cpu_id_loop(1000));
        assert!(cpu_node_loop(1000));
    }
}
