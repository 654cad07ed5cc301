//! The allocator stress: workers allocate, fill, grow, shrink, trade and free objects of random
//! sizes and alignments through one [`PerCpuAlloc`] in the storm, while a thread releases CPU
//! caches; every object carries a pattern of its own over all its bytes, checked before it is
//! freed, and afterwards the inner allocator must hold nothing.

use crate::storm::{Random, Shift, StressConfig, Tally, Workload, run_storm};
use core::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thiscpu::PerCpuAlloc;

/// What [`run_alloc`] runs: the [`StressConfig`] storm (migration, signals, churn) around a
/// [`PerCpuAlloc`], plus a thread that releases CPU caches while the workers use them.
#[derive(Clone, Debug)]
pub struct AllocStressConfig {
    /// Duration, workers, migration, signals, churn, as for the counter.
    pub stress: StressConfig,
    /// Release random CPUs' caches (and idle ones) from another thread throughout the run.
    pub release: bool,
    /// Bytes cached per CPU (small, so that misses and spills happen often).
    pub cache_bytes: usize,
    /// Most objects a worker holds at once.
    pub hold: usize,
    /// Largest object size (beyond [`thiscpu::allocator::MAX_CACHED_SIZE`], so that `realloc`
    /// moves objects in and out of the caches).
    pub max_size: usize,
}

impl Default for AllocStressConfig {
    fn default() -> Self {
        AllocStressConfig {
            stress: StressConfig::default(),
            release: true,
            cache_bytes: 32 << 10,
            hold: 24,
            max_size: 6000,
        }
    }
}

/// What happened in [`run_alloc`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllocStressReport {
    /// Objects allocated (and freed: every one is freed by the end).
    pub operations: u64,
    /// `realloc` calls.
    pub reallocs: u64,
    /// Objects freed by a thread other than the one that allocated them.
    pub traded: u64,
    /// Objects whose pattern was not intact when checked (must be 0): an object handed out
    /// twice, written after it was freed, or moved without its bytes.
    pub corrupted: u64,
    /// Allocations the inner allocator still held after every object was freed and every cache
    /// released (must be 0; negative: freed twice).
    pub lost: i64,
    /// Bytes still cached after the final release (must be 0).
    pub cached_after_release: u64,
    /// Misses and spills of the caches during the run.
    pub misses: u64,
    /// See `misses`.
    pub spills: u64,
    /// Releases of one CPU's cache that succeeded, and the bytes they gave back.
    pub releases: u64,
    /// See `releases`.
    pub released_bytes: u64,
    /// Releases refused (no fence and no way to run on the CPU).
    pub releases_unavailable: u64,
    /// Aborted restartable sequences retried during the run.
    pub aborts: u64,
    /// Affinity changes made to workers.
    pub migrations: u64,
    /// Signals sent to workers.
    pub signals: u64,
    /// Signal handlers that ran.
    pub signals_handled: u64,
    /// Short-lived threads created.
    pub threads_created: u64,
    /// Long-lived worker threads.
    pub workers: usize,
    /// Whether the caches were in use (false in a process without rseq: then this checks the
    /// pass-through path).
    pub caching: bool,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl AllocStressReport {
    /// Whether every object kept its bytes and every allocation came back exactly once.
    pub fn exact(&self) -> bool {
        self.corrupted == 0 && self.lost == 0 && self.cached_after_release == 0
    }
}

/// The system allocator, counting the allocations it holds.
#[derive(Debug, Default)]
struct Tracking {
    live: AtomicI64,
}

// SAFETY: forwards every call to the system allocator unchanged, counting.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded.
        let object = unsafe { System.alloc(layout) };
        if !object.is_null() {
            self.live.fetch_add(1, Ordering::Relaxed);
        }
        object
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded.
        let object = unsafe { System.alloc_zeroed(layout) };
        if !object.is_null() {
            self.live.fetch_add(1, Ordering::Relaxed);
        }
        object
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        self.live.fetch_sub(1, Ordering::Relaxed);
        // SAFETY: forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
    // `realloc` stays the default (alloc, copy, dealloc), so that the count stays right.
}

type Allocator = PerCpuAlloc<Tracking>;

/// One live object of the stress: where, its layout, and the stamp its pattern is made from.
struct Object {
    address: usize,
    layout: Layout,
    stamp: u64,
}

/// The byte at `offset` of an object stamped `stamp`.
fn pattern(stamp: u64, offset: usize) -> u8 {
    let mixed = (stamp ^ (offset as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (mixed >> 56) as u8
}

impl Object {
    /// Allocates an object of `layout` and fills it with `stamp`'s pattern; `None` if refused.
    fn new(allocator: &Allocator, layout: Layout, stamp: u64) -> Option<Object> {
        // SAFETY: `layout` is non-zero (sizes start at 1).
        let address = unsafe { allocator.alloc(layout) };
        if address.is_null() {
            return None;
        }
        let mut object = Object {
            address: address as usize,
            layout,
            stamp,
        };
        object.fill();
        Some(object)
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: a live allocation of `layout.size()` bytes that this `Object` alone owns.
        unsafe { core::slice::from_raw_parts(self.address as *const u8, self.layout.size()) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, borrowed mutably through `self`.
        unsafe { core::slice::from_raw_parts_mut(self.address as *mut u8, self.layout.size()) }
    }

    fn fill(&mut self) {
        let stamp = self.stamp;
        for (offset, byte) in self.bytes_mut().iter_mut().enumerate() {
            *byte = pattern(stamp, offset);
        }
    }

    /// Whether the first `len` bytes still hold the pattern.
    fn intact(&self, len: usize) -> bool {
        self.address.is_multiple_of(self.layout.align())
            && self.bytes()[..len]
                .iter()
                .enumerate()
                .all(|(offset, &byte)| byte == pattern(self.stamp, offset))
    }

    /// Grows or shrinks the object to `size` bytes; whether the bytes kept survived.
    fn realloc(&mut self, allocator: &Allocator, size: usize, stamp: u64) -> bool {
        let kept = self.layout.size().min(size);
        // SAFETY: the object was made by `allocator` with `layout`; `size` is non-zero and
        // far below `isize::MAX`.
        let moved = unsafe { allocator.realloc(self.address as *mut u8, self.layout, size) };
        if moved.is_null() {
            return true;
        }
        self.address = moved as usize;
        self.layout = Layout::from_size_align(size, self.layout.align()).expect("valid layout");
        let intact = self.intact(kept);
        self.stamp = stamp;
        self.fill();
        intact
    }

    /// Checks the pattern and frees the object; whether the pattern was intact.
    fn free(mut self, allocator: &Allocator) -> bool {
        let intact = self.intact(self.layout.size());
        // Scribble before freeing: a second holder of the same bytes then sees its pattern
        // broken even if it was written before this one's.
        self.bytes_mut().fill(0xdb);
        // SAFETY: made by `allocator` with `layout`, and given up here.
        unsafe { allocator.dealloc(self.address as *mut u8, self.layout) };
        intact
    }
}

/// What one thread did.
#[derive(Default)]
struct Allocations {
    operations: u64,
    reallocs: u64,
    traded: u64,
    corrupted: u64,
}

impl Tally for Allocations {
    fn add(&mut self, other: Allocations) {
        self.operations += other.operations;
        self.reallocs += other.reallocs;
        self.traded += other.traded;
        self.corrupted += other.corrupted;
    }
}

/// What the releasing thread did.
#[derive(Default)]
struct Releases {
    releases: u64,
    bytes: u64,
    unavailable: u64,
}

/// The allocator stress's workload: objects made, resized, traded and freed, and the state
/// every thread of the run shares for it.
struct Shared {
    allocator: Allocator,
    /// Objects left by one thread for another to free.
    exchange: Mutex<Vec<Object>>,
    max_size: usize,
    hold: usize,
    stamps: AtomicU64,
    release: bool,
}

impl Shared {
    fn layout(&self, random: &mut Random) -> Layout {
        // Mostly small objects, as programs make them; some beyond the caches.
        let size = match random.next(8) {
            0 => 1 + random.next(self.max_size),
            1..=3 => 1 + random.next(512),
            _ => 1 + random.next(128),
        };
        let align = 1 << random.next(6);
        Layout::from_size_align(size, align).expect("valid layout")
    }

    /// One round: hold up to `hold` objects, resize some, trade some, free the rest.
    fn round(&self, random: &mut Random) -> Allocations {
        let mut tally = Allocations::default();
        let stamp = || self.stamps.fetch_add(1, Ordering::Relaxed);
        let mut held: Vec<Object> = Vec::with_capacity(self.hold);
        for _ in 0..1 + random.next(self.hold) {
            if let Some(object) = Object::new(&self.allocator, self.layout(random), stamp()) {
                held.push(object);
                tally.operations += 1;
            }
        }
        for object in held.iter_mut() {
            if random.next(4) != 0 {
                continue;
            }
            let size = 1 + random.next(self.max_size);
            if !object.realloc(&self.allocator, size, stamp()) {
                tally.corrupted += 1;
            }
            tally.reallocs += 1;
        }
        // Trade: leave some objects for others and free some of theirs.
        {
            let mut exchange = self.exchange.lock().unwrap_or_else(|p| p.into_inner());
            let theirs = exchange.len().min(random.next(4));
            let keep = exchange.len() - theirs;
            let mut taken: Vec<Object> = exchange.split_off(keep);
            for _ in 0..random.next(3).min(held.len()) {
                exchange.extend(held.pop());
            }
            drop(exchange);
            tally.traded += taken.len() as u64;
            held.append(&mut taken);
        }
        for object in held {
            if !object.free(&self.allocator) {
                tally.corrupted += 1;
            }
        }
        tally
    }

    /// Frees what was left for trade once every thread has stopped; how many were corrupted.
    fn free_leftovers(&self) -> u64 {
        let left: Vec<Object> =
            core::mem::take(&mut *self.exchange.lock().unwrap_or_else(|p| p.into_inner()));
        left.into_iter()
            .map(|object| u64::from(!object.free(&self.allocator)))
            .sum()
    }
}

impl Workload for Shared {
    type Tally = Allocations;
    type Background = Releases;

    fn work(&self, index: usize, shift: &Shift) -> Allocations {
        let mut tally = Allocations::default();
        let mut random = Random(0x2545_f491_4f6c_dd1d ^ (index as u64 + 1));
        while shift.goes_on() {
            for _ in 0..8 {
                tally.add(self.round(&mut random));
            }
        }
        tally
    }

    fn churn(&self, _earlier: u64) -> Allocations {
        let mut random = Random(self.stamps.fetch_add(1, Ordering::Relaxed) | 1);
        let mut tally = Allocations::default();
        for _ in 0..50 {
            tally.add(self.round(&mut random));
        }
        tally
    }

    fn background(&self) -> Option<&'static str> {
        self.release.then_some("the releasing thread")
    }

    /// Releases random CPUs' caches, and idle ones, while the workers use them.
    fn run_background(&self, stop: &AtomicBool) -> Releases {
        let possible = thiscpu::topology::possible_cpus();
        let mut random = Random(0x9e37_79b9_7f4a_7c15);
        let mut releases = Releases::default();
        while !stop.load(Ordering::Relaxed) {
            let outcome = if random.next(4) == 0 {
                self.allocator.release_idle()
            } else {
                self.allocator.release_cpu(random.next(possible) as u32)
            };
            match outcome {
                Ok(released) => {
                    releases.releases += 1;
                    releases.bytes += released as u64;
                }
                Err(_) => releases.unavailable += 1,
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        releases
    }
}

/// Runs the allocator stress: workers allocate, resize, trade and free objects while being
/// migrated and signalled, short-lived threads do the same and exit, and a releaser gives CPU
/// caches back. Afterwards every object must have kept its bytes, and once every cache is
/// released the inner allocator must hold nothing. Only one run (of any
/// stress) at a time in a process.
///
/// ```
/// use std::time::Duration;
/// let config = thiscpu_stress::AllocStressConfig {
///     stress: thiscpu_stress::StressConfig {
///         duration: Duration::from_millis(100),
///         threads: 4,
///         ..Default::default()
///     },
///     ..Default::default()
/// };
/// let report = thiscpu_stress::run_alloc(&config).unwrap();
/// assert!(report.exact(), "{report:?}");
/// ```
pub fn run_alloc(config: &AllocStressConfig) -> std::io::Result<AllocStressReport> {
    let workload = Arc::new(Shared {
        allocator: PerCpuAlloc::with_inner(Tracking::default())
            .with_cache_bytes(config.cache_bytes),
        exchange: Mutex::new(Vec::new()),
        max_size: config.max_size.max(1),
        hold: config.hold.max(1),
        stamps: AtomicU64::new(1),
        release: config.release,
    });
    let storm = run_storm(&config.stress, &workload)?;
    let tally = &storm.tally;
    let corrupted = tally.corrupted + workload.free_leftovers();
    let allocator = &workload.allocator;
    let during = allocator.stats();
    // A cache that cannot be released keeps its objects: they count as cached below, and the
    // run as inexact, as the pool stress counts an unreachable cache's objects as lost.
    let _ = allocator.release();
    let after = allocator.stats();
    let live = allocator.inner().live.load(Ordering::Relaxed);
    let still_cached: u64 = after.per_cpu.iter().map(|cpu| cpu.cached_objects).sum();
    let releases = &storm.background;
    Ok(AllocStressReport {
        operations: tally.operations,
        reallocs: tally.reallocs,
        traded: tally.traded,
        corrupted,
        lost: live - still_cached as i64,
        cached_after_release: after.cached_bytes(),
        misses: during.misses(),
        spills: during.spills(),
        releases: releases.releases,
        released_bytes: releases.bytes,
        releases_unavailable: releases.unavailable,
        aborts: storm.aborts(),
        migrations: storm.migrations,
        signals: storm.signals,
        signals_handled: storm.signals_handled,
        threads_created: storm.threads_created,
        workers: storm.workers,
        caching: after.caching,
        elapsed: storm.elapsed,
    })
}
