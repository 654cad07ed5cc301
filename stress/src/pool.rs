//! The pool stress: workers take objects from one [`Pool`] and give them back in the storm,
//! while a thread drains CPU caches; afterwards every object the pool made must be in it
//! exactly once.

use crate::gate::StartGate;
use crate::signal::{HANDLER_INCREMENTS, HandlerGuard, HandlerTarget, RUN};
use crate::storm::{Churn, Disturber, Random, StressConfig, allowed_cpus};
use crate::workers::{call_off, spawn_workers, start_worker, thread_refused};
use core::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiscpu::{Counter, Pool, Pooled};

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

/// A pooled object of the stress: its number, and the flag table it marks while held.
#[derive(Debug)]
struct Tracked {
    id: usize,
}

/// Takes up to `hold` objects, marks each held (a second holder shows as a double hand-out),
/// and gives them back.
fn pool_round(
    pool: &Pool<Tracked>,
    held: &[core::sync::atomic::AtomicU8],
    doubles: &AtomicU64,
    take: usize,
) -> u64 {
    let mut objects = Vec::with_capacity(take);
    for _ in 0..take {
        let object = pool.get();
        if held[object.id].swap(1, Ordering::Relaxed) != 0 {
            doubles.fetch_add(1, Ordering::Relaxed);
        }
        objects.push(object);
    }
    for object in objects {
        if held[object.id].swap(0, Ordering::Relaxed) != 1 {
            doubles.fetch_add(1, Ordering::Relaxed);
        }
        drop(object);
    }
    take as u64
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
    use core::sync::atomic::AtomicU8;
    let _one_at_a_time = RUN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let stress = &config.stress;
    let next_id = Arc::new(AtomicU64::new(0));
    let pool = {
        let next_id = next_id.clone();
        Arc::new(Pool::with_capacity(config.capacity, move || Tracked {
            id: next_id.fetch_add(1, Ordering::Relaxed) as usize,
        }))
    };
    let held: Arc<Vec<AtomicU8>> =
        Arc::new((0..POOL_STRESS_OBJECTS).map(|_| AtomicU8::new(0)).collect());
    let doubles = Arc::new(AtomicU64::new(0));
    let hold = config.hold.max(1);
    let workers = stress.threads.max(1);
    let cpus = allowed_cpus();
    let stop = Arc::new(AtomicBool::new(false));
    // Workers stop by their own clock, but not before the disturber's first round: a run
    // that moved and signalled nobody would test nothing.
    let disturbed = Arc::new(AtomicBool::new(false));
    let gate = Arc::new(StartGate::new(workers));
    let tids: Arc<Vec<AtomicI32>> = Arc::new((0..workers).map(|_| AtomicI32::new(0)).collect());
    let aborts_before = thiscpu::ops::aborts();
    // The handler increments this counter: a restartable sequence of its own, run right after
    // the interrupted pool section was aborted.
    let handled = Arc::new(Counter::new());
    HANDLER_INCREMENTS.store(0, Ordering::Relaxed);
    let guard = if stress.signals {
        Some(HandlerGuard::install(stress.signal)?)
    } else {
        None
    };
    let target = HandlerTarget::publish(&handled);
    if config.drain {
        // Registration may wait for an RCU grace period: do it before the clock starts.
        let _ = thiscpu::fence::register();
    }

    let duration = stress.duration;
    let mut worker_handles = spawn_workers(workers, &gate, |index| {
        let (pool, held, doubles, stop, disturbed, gate, tids) = (
            pool.clone(),
            held.clone(),
            doubles.clone(),
            stop.clone(),
            disturbed.clone(),
            gate.clone(),
            tids.clone(),
        );
        move || {
            let Some(deadline) = start_worker(&tids, index, &gate, duration) else {
                return 0;
            };
            let mut random = Random(0x2545_f491_4f6c_dd1d ^ (index as u64 + 1));
            let mut made = 0u64;
            while !stop.load(Ordering::Relaxed)
                && (Instant::now() < deadline || !disturbed.load(Ordering::Acquire))
            {
                for _ in 0..16 {
                    made += pool_round(&pool, &held, &doubles, 1 + random.next(hold));
                }
            }
            tids[index].store(0, Ordering::Release);
            made
        }
    })?;

    let drainer = config.drain.then(|| {
        let (pool, stop) = (pool.clone(), stop.clone());
        std::thread::Builder::new().spawn(move || {
            let possible = thiscpu::topology::possible_cpus() as u32;
            let mut random = Random(0x9e37_79b9_7f4a_7c15);
            let (mut drains, mut unavailable, mut objects, mut method) = (0u64, 0u64, 0u64, None);
            while !stop.load(Ordering::Relaxed) {
                let cpu = random.next(possible as usize) as u32;
                match pool.drain_cpu(cpu) {
                    Ok(drained) => {
                        drains += 1;
                        objects += drained.objects as u64;
                        method = Some(drained.method);
                    }
                    Err(_) => unavailable += 1,
                }
                std::thread::sleep(Duration::from_micros(50));
            }
            (drains, unavailable, objects, method)
        })
    });
    let drainer = match drainer.transpose() {
        Ok(drainer) => drainer,
        Err(error) => {
            gate.cancel();
            for handle in worker_handles.drain(..) {
                let _ = handle.join();
            }
            return Err(thread_refused("the draining thread", &error));
        }
    };

    if !gate.wait_for_all(|| worker_handles.iter().any(|h| h.is_finished())) {
        stop.store(true, Ordering::Relaxed);
        if let Some(drainer) = drainer {
            let _ = drainer.join();
        }
        return Err(call_off(&gate, worker_handles));
    }
    let began = gate.open();
    let deadline = began + stress.duration;
    let mut disturber = Disturber::new(stress);
    let mut churn = Churn::default();
    let mut refused = None;
    // The first round comes before the first look at the clock: waking a thousand workers can
    // take longer than the run asked for.
    loop {
        disturber.round(&tids, &cpus);
        disturbed.store(true, Ordering::Release);
        if stress.churn {
            let (pool, held, doubles) = (pool.clone(), held.clone(), doubles.clone());
            let spawned = churn.spawn(move || {
                (0..200)
                    .map(|round| pool_round(&pool, &held, &doubles, 1 + round % hold))
                    .sum::<u64>()
            });
            if let Err(error) = spawned {
                refused = Some(error);
                break;
            }
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    stop.store(true, Ordering::Relaxed);
    let mut operations: u64 = worker_handles
        .into_iter()
        .map(|handle| handle.join().expect("pool stress worker panicked"))
        .sum();
    let threads_created = churn.created;
    operations += churn.finish();
    let (drains, drains_unavailable, drained_objects, drain_method) = drainer
        .map(|handle| handle.join().expect("pool drainer panicked"))
        .unwrap_or_default();
    let elapsed = began.elapsed();
    if let Some(error) = refused {
        return Err(error);
    }
    drop(guard);
    drop(target);
    let signals_handled = HANDLER_INCREMENTS.load(Ordering::Relaxed);

    // Every thread has stopped: take every object out through the pool's own paths and check
    // each is there exactly once. `get` runs only while the shared list holds objects, so it
    // never makes one: this thread may migrate between two calls, and a `get` on a CPU whose
    // cache and the shared list were both empty would make a new object while others sat in
    // the cache a refill filled on the previous CPU. Draining every cache refills the shared
    // list. Where draining is unavailable, objects cached on other CPUs stay unreachable from
    // here and count as lost.
    let created = pool.created();
    let mut taken = Vec::new();
    loop {
        if pool.shared_len() == 0 {
            let _ = pool.drain_all();
            if pool.shared_len() == 0 {
                break;
            }
        }
        taken.push(Pooled::into_box(pool.get()));
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
    duplicates += pool.created() - created;
    let double_handouts = doubles.load(Ordering::Relaxed)
        + held
            .iter()
            .filter(|flag| flag.load(Ordering::Relaxed) != 0)
            .count() as u64;
    Ok(PoolStressReport {
        operations,
        created,
        found,
        double_handouts,
        duplicates,
        lost: i128::from(created) - i128::from(found),
        drains,
        drains_unavailable,
        drained_objects,
        drain_method,
        aborts: thiscpu::ops::aborts() - aborts_before,
        migrations: disturber.migrations,
        signals: disturber.signals,
        signals_handled,
        threads_created,
        workers,
        elapsed,
    })
}
