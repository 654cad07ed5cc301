//! The pool stress: workers take objects from one [`Pool`] and give them back in the storm,
//! while a thread drains CPU caches; afterwards every object the pool made must be in it
//! exactly once.

use crate::storm::{Random, Shift, StressConfig, Workload, run_storm};
use core::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use thiscpu::{Pool, Pooled};

/// What [`run_pool`] runs: the [`StressConfig`] storm (migration, signals, churn) around a
/// [`Pool`], plus a thread that drains CPU caches while the workers use them.
#[derive(Clone, Debug)]
pub struct PoolStressConfig {
    /// Duration, workers, migration, signals, churn, as for the counter.
    pub stress: StressConfig,
    /// Drain random CPUs' caches from another thread throughout the run.
    pub drain: bool,
    /// Objects cached per CPU (small, so that spills and refills happen often).
    pub capacity: usize,
    /// Most objects a worker holds at once (it takes 1 to `hold`, then gives them back).
    pub hold: usize,
}

impl Default for PoolStressConfig {
    fn default() -> Self {
        PoolStressConfig {
            stress: StressConfig::default(),
            drain: true,
            capacity: 8,
            hold: 4,
        }
    }
}

/// What happened in [`run_pool`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolStressReport {
    /// Objects taken from the pool and given back (each counts once).
    pub operations: u64,
    /// Objects the pool made.
    pub created: u64,
    /// Distinct objects found in the pool after the run.
    pub found: u64,
    /// Objects handed out while another holder still had them (must be 0).
    pub double_handouts: u64,
    /// Objects found more than once after the run (must be 0).
    pub duplicates: u64,
    /// `created - found`: objects lost (must be 0).
    pub lost: i128,
    /// Drains that succeeded.
    pub drains: u64,
    /// Drains that reported the fence and its fallback unavailable.
    pub drains_unavailable: u64,
    /// Objects moved by drains.
    pub drained_objects: u64,
    /// The method of the last successful drain, if any.
    pub drain_method: Option<thiscpu::pool::DrainMethod>,
    /// Aborted restartable sequences retried during the run.
    pub aborts: u64,
    /// Affinity changes made to workers.
    pub migrations: u64,
    /// Signals sent to workers.
    pub signals: u64,
    /// Signal handlers that ran (each increments a counter inside a restartable sequence).
    pub signals_handled: u64,
    /// Short-lived threads created.
    pub threads_created: u64,
    /// Long-lived worker threads.
    pub workers: usize,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl PoolStressReport {
    /// Whether every object was accounted for exactly once and never held twice.
    pub fn exact(&self) -> bool {
        self.lost == 0 && self.double_handouts == 0 && self.duplicates == 0
    }
}

/// The most objects a pool stress may make: their in-use flags are preallocated.
const POOL_STRESS_OBJECTS: usize = 1 << 20;

/// A pooled object of the stress: its number, an index into the in-use flags.
#[derive(Debug)]
struct Tracked {
    id: usize,
}

/// The pool stress's workload: objects taken and given back, each marked in use while held.
struct Handouts {
    pool: Pool<Tracked>,
    /// One in-use flag per object the pool may make.
    held: Vec<AtomicU8>,
    /// Objects handed out while another holder still had them.
    doubles: AtomicU64,
    hold: usize,
    drain: bool,
}

/// What the draining thread did.
#[derive(Default)]
struct Drains {
    drains: u64,
    unavailable: u64,
    objects: u64,
    method: Option<thiscpu::pool::DrainMethod>,
}

impl Handouts {
    /// Takes `take` objects, marks each held (a second holder shows as a double hand-out),
    /// and gives them back.
    fn round(&self, take: usize) -> u64 {
        let mut objects = Vec::with_capacity(take);
        for _ in 0..take {
            let object = self.pool.get();
            if self.held[object.id].swap(1, Ordering::Relaxed) != 0 {
                self.doubles.fetch_add(1, Ordering::Relaxed);
            }
            objects.push(object);
        }
        for object in objects {
            if self.held[object.id].swap(0, Ordering::Relaxed) != 1 {
                self.doubles.fetch_add(1, Ordering::Relaxed);
            }
            drop(object);
        }
        take as u64
    }

    /// Takes every object out through the pool's own paths once every thread has stopped:
    /// the objects the pool made, the distinct ones found, and those found more than once.
    ///
    /// `get` runs only while the shared list holds objects, so it never makes one: this thread
    /// may migrate between two calls, and a `get` on a CPU whose cache and the shared list were
    /// both empty would make a new object while others sat in the cache a refill filled on the
    /// previous CPU. Draining every cache refills the shared list. Where draining is
    /// unavailable, objects cached on other CPUs stay unreachable from here and count as lost.
    fn count_objects(&self) -> (u64, u64, u64) {
        let created = self.pool.created();
        let mut taken = Vec::new();
        loop {
            if self.pool.shared_len() == 0 {
                let _ = self.pool.drain_all();
                if self.pool.shared_len() == 0 {
                    break;
                }
            }
            taken.push(Pooled::into_box(self.pool.get()));
        }
        let mut seen = vec![false; created as usize];
        let mut found = 0u64;
        let mut duplicates = 0u64;
        for object in &taken {
            match seen.get_mut(object.id) {
                Some(seen) if !*seen => {
                    *seen = true;
                    found += 1;
                }
                _ => duplicates += 1,
            }
        }
        duplicates += self.pool.created() - created;
        (created, found, duplicates)
    }

    /// Double hand-outs seen during the run, and objects still marked held after it.
    fn double_handouts(&self) -> u64 {
        self.doubles.load(Ordering::Relaxed)
            + self
                .held
                .iter()
                .filter(|flag| flag.load(Ordering::Relaxed) != 0)
                .count() as u64
    }
}

impl Workload for Handouts {
    type Tally = u64;
    type Background = Drains;

    fn work(&self, index: usize, shift: &Shift) -> u64 {
        let mut random = Random(0x2545_f491_4f6c_dd1d ^ (index as u64 + 1));
        let mut made = 0u64;
        while shift.goes_on() {
            for _ in 0..16 {
                made += self.round(1 + random.next(self.hold));
            }
        }
        made
    }

    fn churn(&self, _earlier: u64) -> u64 {
        (0..200)
            .map(|round| self.round(1 + round % self.hold))
            .sum()
    }

    fn background(&self) -> Option<&'static str> {
        self.drain.then_some("the draining thread")
    }

    /// Drains random CPUs' caches to the shared list while the workers use them.
    fn run_background(&self, stop: &AtomicBool) -> Drains {
        let possible = thiscpu::topology::possible_cpus() as u32;
        let mut random = Random(0x9e37_79b9_7f4a_7c15);
        let mut drains = Drains::default();
        while !stop.load(Ordering::Relaxed) {
            let cpu = random.next(possible as usize) as u32;
            match self.pool.drain_cpu(cpu) {
                Ok(drained) => {
                    drains.drains += 1;
                    drains.objects += drained.objects as u64;
                    drains.method = Some(drained.method);
                }
                Err(_) => drains.unavailable += 1,
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        drains
    }
}

/// Runs the pool stress and counts every object in and out: workers take and return objects
/// while being migrated and signalled, short-lived threads do the same and exit, and a
/// drainer moves CPU caches to the shared list. Afterwards every object the pool made must be
/// in it exactly once. Only one run (of either stress) at a time in a process.
///
/// ```
/// use std::time::Duration;
/// let config = thiscpu_stress::PoolStressConfig {
///     stress: thiscpu_stress::StressConfig {
///         duration: Duration::from_millis(100),
///         threads: 4,
///         ..Default::default()
///     },
///     ..Default::default()
/// };
/// let report = thiscpu_stress::run_pool(&config).unwrap();
/// assert!(report.exact(), "{report:?}");
/// ```
pub fn run_pool(config: &PoolStressConfig) -> std::io::Result<PoolStressReport> {
    let next_id = AtomicU64::new(0);
    let workload = Arc::new(Handouts {
        pool: Pool::with_capacity(config.capacity, move || Tracked {
            id: next_id.fetch_add(1, Ordering::Relaxed) as usize,
        }),
        held: (0..POOL_STRESS_OBJECTS).map(|_| AtomicU8::new(0)).collect(),
        doubles: AtomicU64::new(0),
        hold: config.hold.max(1),
        drain: config.drain,
    });
    let storm = run_storm(&config.stress, &workload)?;
    let (created, found, duplicates) = workload.count_objects();
    let drains = &storm.background;
    Ok(PoolStressReport {
        operations: storm.tally,
        created,
        found,
        double_handouts: workload.double_handouts(),
        duplicates,
        lost: i128::from(created) - i128::from(found),
        drains: drains.drains,
        drains_unavailable: drains.unavailable,
        drained_objects: drains.objects,
        drain_method: drains.method,
        aborts: storm.aborts(),
        migrations: storm.migrations,
        signals: storm.signals,
        signals_handled: storm.signals_handled,
        threads_created: storm.threads_created,
        workers: storm.workers,
        elapsed: storm.elapsed,
    })
}
