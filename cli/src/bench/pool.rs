//! `pool`: one object taken from a shared pool and given back (a get+put pair), by
//! `thiscpu::Pool` (a restartable push and pop on the current CPU's cache) and by shared pools
//! a Rust program might use instead: `Mutex<Vec<Box<T>>>`, crossbeam's bounded `ArrayQueue`
//! and unbounded `SegQueue`.
//!
//! Each worker writes into the object it holds, so the object's line really moves with it.
//! After every round each pool must hold exactly the objects it ever made: a lost or doubled
//! object fails the run.

use super::model::{Case, Family, Measured, Unit, Workload, median_of as median};
use crate::report::table::{competitors_table, render};
use crossbeam_queue::{ArrayQueue, SegQueue};
use std::hint::black_box;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use thiscpu::Pool;

/// The pooled object: one cache line.
type Object = [u64; 8];

const CASES: &[&str] = &[
    "mutex-vec",
    "crossbeam-arrayqueue",
    "crossbeam-segqueue",
    "thiscpu-pool",
];

/// The family.
pub static FAMILY: Family = Family {
    name: "pool",
    about: "get+put of one pooled object, by 1 thread and by one thread per CPU \
            (ns per pair, per thread)",
    case_names: CASES,
    default_threads: &[1, 2],
    baseline: Some("mutex-vec"),
    cases,
    report,
};

/// Writes into the object held, as a user would.
#[inline(always)]
fn touch(object: &mut Object, i: u64) {
    object[(i % 8) as usize] = i;
    black_box(object);
}

/// A shared pool: get, put, and how many objects it holds and made.
trait SharedPool: Send + Sync + 'static {
    fn pairs(&self, ops: u64);
    fn held(&self) -> u64;
    fn made(&self) -> u64;
}

/// Boxed like the other pools' objects: a pool hands out objects that stay where they are.
#[allow(clippy::vec_box)]
struct MutexVec {
    list: Mutex<Vec<Box<Object>>>,
    made: AtomicU64,
}

impl SharedPool for MutexVec {
    fn pairs(&self, ops: u64) {
        for i in 0..ops {
            let taken = self.list.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let mut object = taken.unwrap_or_else(|| {
                self.made.fetch_add(1, Relaxed);
                Box::new([0; 8])
            });
            touch(&mut object, i);
            self.list
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(object);
        }
    }
    fn held(&self) -> u64 {
        self.list.lock().unwrap_or_else(|e| e.into_inner()).len() as u64
    }
    fn made(&self) -> u64 {
        self.made.load(Relaxed)
    }
}

/// A crossbeam queue used as a pool.
trait Queue: Send + Sync + 'static {
    fn pop(&self) -> Option<Box<Object>>;
    /// Gives the object back if the queue is full.
    fn push(&self, object: Box<Object>) -> Result<(), Box<Object>>;
    fn len(&self) -> usize;
}

impl Queue for ArrayQueue<Box<Object>> {
    fn pop(&self) -> Option<Box<Object>> {
        ArrayQueue::pop(self)
    }
    fn push(&self, object: Box<Object>) -> Result<(), Box<Object>> {
        ArrayQueue::push(self, object)
    }
    fn len(&self) -> usize {
        ArrayQueue::len(self)
    }
}

impl Queue for SegQueue<Box<Object>> {
    fn pop(&self) -> Option<Box<Object>> {
        SegQueue::pop(self)
    }
    fn push(&self, object: Box<Object>) -> Result<(), Box<Object>> {
        SegQueue::push(self, object);
        Ok(())
    }
    fn len(&self) -> usize {
        SegQueue::len(self)
    }
}

struct QueuePool<Q> {
    queue: Q,
    made: AtomicU64,
}

impl<Q: Queue> SharedPool for QueuePool<Q> {
    fn pairs(&self, ops: u64) {
        for i in 0..ops {
            let mut object = self.queue.pop().unwrap_or_else(|| {
                self.made.fetch_add(1, Relaxed);
                Box::new([0; 8])
            });
            touch(&mut object, i);
            // Each worker holds one object at a time, so a bounded queue of 1024 never fills;
            // if it did, the object would be dropped and the check after the round would
            // report it missing.
            drop(self.queue.push(object));
        }
    }
    fn held(&self) -> u64 {
        self.queue.len() as u64
    }
    fn made(&self) -> u64 {
        self.made.load(Relaxed)
    }
}

struct Thiscpu(Pool<Object>);

impl SharedPool for Thiscpu {
    fn pairs(&self, ops: u64) {
        let pool = black_box(&self.0);
        for i in 0..ops {
            let mut object = pool.get();
            touch(&mut object, i);
        }
    }
    fn held(&self) -> u64 {
        (self.0.cached() + self.0.shared_len()) as u64
    }
    fn made(&self) -> u64 {
        self.0.created()
    }
}

/// A pool as a workload; after each round it must hold every object it made.
struct PoolWorkload<P>(P);

impl<P: SharedPool> Workload for PoolWorkload<P> {
    fn run(&self, _worker: usize, ops: u64) {
        self.0.pairs(ops);
    }

    fn verify(&self, _ops: u64) -> Result<(), String> {
        let (held, made) = (self.0.held(), self.0.made());
        if held == made {
            Ok(())
        } else {
            Err(format!("the pool holds {held} objects but made {made}"))
        }
    }
}

fn cases() -> Vec<Case> {
    let ns = Unit::NsPerOp;
    let source = thiscpu::source();
    let how = if source.registrar == thiscpu::Registrar::None {
        "thiscpu Pool::get + drop; no rseq here: locked per-CPU lists"
    } else {
        "thiscpu Pool::get + drop: restartable pop and push"
    };
    vec![
        Case::new(
            "mutex-vec",
            "Mutex<Vec<Box<T>>>: lock, pop; lock, push",
            ns,
            PoolWorkload(MutexVec {
                list: Mutex::new(Vec::new()),
                made: AtomicU64::new(0),
            }),
        ),
        Case::new(
            "crossbeam-arrayqueue",
            "crossbeam ArrayQueue<Box<T>> (1024): pop, push",
            ns,
            PoolWorkload(QueuePool {
                queue: ArrayQueue::new(1024),
                made: AtomicU64::new(0),
            }),
        ),
        Case::new(
            "crossbeam-segqueue",
            "crossbeam SegQueue<Box<T>>: pop, push",
            ns,
            PoolWorkload(QueuePool {
                queue: SegQueue::new(),
                made: AtomicU64::new(0),
            }),
        ),
        Case::new(
            "thiscpu-pool",
            how,
            ns,
            PoolWorkload(Thiscpu(Pool::new(|| [0; 8]))),
        ),
    ]
}


/// Every competitor's cost relative to thiscpu's, per thread count.
fn report(results: &[Measured]) -> String {
    let mut threads: Vec<usize> = results.iter().map(|m| m.threads).collect();
    threads.sort_unstable();
    threads.dedup();
    if threads.is_empty() {
        return String::new();
    }
    let table = competitors_table(
        CASES,
        &threads,
        "ns",
        "÷ thiscpu",
        |case, n| median(results, case, n),
        |case| (case != "thiscpu-pool").then_some("thiscpu-pool"),
    );
    let mut out = String::from("\nget+put pairs (medians over rounds, ÷ thiscpu: times thiscpu-pool's):\n");
    out.push_str(&render(&table));
    out.trim_end().to_owned()
}
