//! Model checks of `PerCpuAlloc`'s caches, over their interleavings, with loom: threads that
//! pop and push a CPU's cache (allocate and free) while another thread releases that cache
//! to the inner allocator, or, the cache marked by a first look of `release_idle`, clear the
//! marks while a release or a second look runs; and a spill on one CPU and a miss on another
//! that meet in a transfer list, alone and while every cache and list is released.
//!
//! The real allocator runs on the model machine of `thiscpu::model` (see `tests/model.rs`):
//! each section can be preempted, migrated away from or fenced, and so aborted, at every step
//! before its commit, and loom runs the other threads between any two steps. The inner
//! allocator keeps a ledger of every live allocation, and each object is marked held while a
//! thread holds it: an object handed out to two holders at once, freed twice, or lost (still
//! held by the inner allocator once every object was freed and the allocator dropped) fails
//! the check.
//!
//! Built only with the model's configuration:
//! `RUSTFLAGS="--cfg thiscpu_model" CARGO_TARGET_DIR=target/model cargo test -p thiscpu
//! --release --test model_alloc -- --nocapture`. `LOOM_MAX_PREEMPTIONS` bounds the search
//! (default here: 3); each test prints how many interleavings loom explored.

#![cfg(thiscpu_model)]

use loom::sync::Arc;
use loom::thread;
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use thiscpu::allocator::{self, PerCpuAlloc};
use thiscpu::model;

/// The inner allocator's ledger and the objects held by the model's threads. Plain std
/// mutexes: each is held for one step and never across a loom operation.
#[derive(Debug, Default)]
struct Ledger {
    live: Mutex<BTreeMap<usize, Layout>>,
    held: Mutex<BTreeSet<usize>>,
    errors: Mutex<Vec<String>>,
}

impl Ledger {
    fn error(&self, what: String) {
        self.errors.lock().unwrap().push(what);
    }
}

/// The system's allocator, with the ledger of what it handed out. A bad free is recorded, not
/// passed on, and never unwinds.
#[derive(Debug, Default)]
struct CountingInner(std::sync::Arc<Ledger>);

// SAFETY: every allocation comes from `System` and is freed there with its own layout.
unsafe impl GlobalAlloc for CountingInner {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, passed on.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            self.0.live.lock().unwrap().insert(ptr as usize, layout);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, passed on.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            self.0.live.lock().unwrap().insert(ptr as usize, layout);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let made = self.0.live.lock().unwrap().remove(&(ptr as usize));
        if made == Some(layout) {
            // SAFETY: allocated here by `System` with `layout`, and live until now.
            unsafe { System.dealloc(ptr, layout) };
        } else {
            self.0.error(format!(
                "{ptr:?} freed as {layout:?}, the inner allocator had {made:?}"
            ));
        }
    }
}

type Heap = PerCpuAlloc<CountingInner>;

/// The cached layout the tests allocate.
const LAYOUT: Layout = match Layout::from_size_align(48, 8) {
    Ok(layout) => layout,
    Err(_) => panic!(),
};

/// Allocates one object and marks it held: fails if another holder holds it.
fn take(heap: &Heap, ledger: &Ledger) -> usize {
    // SAFETY: a non-zero layout.
    let ptr = unsafe { heap.alloc(LAYOUT) } as usize;
    assert_ne!(ptr, 0, "allocation failed");
    if !ledger.held.lock().unwrap().insert(ptr) {
        ledger.error(format!("{ptr:#x} handed out while another holder held it"));
    }
    ptr
}

/// Unmarks and frees an object that `take` returned.
fn give(heap: &Heap, ledger: &Ledger, ptr: usize) {
    ledger.held.lock().unwrap().remove(&ptr);
    // SAFETY: allocated by `heap` with `LAYOUT` (by `take`), freed once.
    unsafe { heap.dealloc(ptr as *mut u8, LAYOUT) };
}

/// Each CPU's cap: two objects of the tests' class in that class's share (the cap is split
/// evenly over the classes), few slots in all, so that an execution makes few model atomics.
fn cache_bytes() -> usize {
    let classes = allocator::size_classes();
    let class = classes.iter().find(|&&size| size >= LAYOUT.size()).unwrap();
    classes.len() * class * 2
}

/// A heap over a fresh ledger, with two objects made and freed on CPU 0, so that its cache
/// holds them (full: a third free spills).
fn warm_heap() -> (Arc<Heap>, std::sync::Arc<Ledger>) {
    let inner = CountingInner::default();
    let ledger = inner.0.clone();
    let heap = Arc::new(PerCpuAlloc::with_inner(inner).with_cache_bytes(cache_bytes()));
    model::run_on(0);
    let (a, b) = (take(&heap, &ledger), take(&heap, &ledger));
    give(&heap, &ledger, a);
    give(&heap, &ledger, b);
    // The two objects the caches hold (their range is not the inner allocator's).
    let live = ledger.live.lock().unwrap().len();
    assert_eq!(live, 2, "{:?}", ledger.live.lock().unwrap());
    (heap, ledger)
}

/// After every thread joined and every object was freed: the allocator, dropped, gives back
/// every object it caches, so the inner allocator must hold nothing, and must have refused no
/// free.
fn census(heap: Arc<Heap>, ledger: &Ledger) {
    drop(heap);
    let live = ledger.live.lock().unwrap().clone();
    let errors = ledger.errors.lock().unwrap().clone();
    assert!(
        errors.is_empty() && live.is_empty(),
        "errors: {errors:?}; the inner allocator still holds {} allocations: {live:?}",
        live.len()
    );
}

/// Runs `body` under loom in every interleaving within the preemption bound (3, unless
/// `LOOM_MAX_PREEMPTIONS` sets another), as `model::explore` does, with room for the branches
/// of an execution that stops, fences and empties every class of two CPUs' caches (more than
/// loom's default 1,000), then prints how many interleavings it explored.
fn explore(name: &str, body: impl Fn() + Send + Sync + 'static) {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound.get_or_insert(3);
    builder.max_branches = builder.max_branches.max(20_000);
    let started = std::time::Instant::now();
    builder.check(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        body();
    });
    eprintln!(
        "{name}: {} interleavings explored in {:.1?} (preemption bound {:?})",
        runs.load(std::sync::atomic::Ordering::Relaxed),
        started.elapsed(),
        builder.preemption_bound
    );
}

/// Two threads on CPU 0 allocate and free while a thread on CPU 1 releases CPU 0's cache: no
/// object handed out twice, none lost, none freed twice.
#[test]
fn a_release_racing_two_threads_of_the_cpu_loses_and_duplicates_nothing() {
    explore(
        "a release while two threads of CPU 0 allocate and free",
        || {
            let (heap, ledger) = warm_heap();
            let users: Vec<_> = (0..2)
                .map(|_| {
                    let (heap, ledger) = (heap.clone(), ledger.clone());
                    thread::spawn(move || {
                        model::run_on(0);
                        let ptr = take(&heap, &ledger);
                        give(&heap, &ledger, ptr);
                    })
                })
                .collect();
            let releaser = {
                let heap = heap.clone();
                thread::spawn(move || {
                    model::run_on(1);
                    heap.release_cpu(0).expect("the model fences");
                })
            };
            for user in users {
                user.join().unwrap();
            }
            releaser.join().unwrap();
            census(heap, &ledger);
        },
    );
}

/// A thread on CPU 0 empties the cache, misses, and frees until the cache spills past its cap,
/// while a thread on CPU 1 releases that cache: nothing lost or duplicated.
#[test]
fn a_release_racing_a_refill_and_a_spill_loses_and_duplicates_nothing() {
    explore("a release while CPU 0 misses and spills", || {
        let (heap, ledger) = warm_heap();
        race_a_release_of_cpu_0(heap, ledger, |heap, ledger| {
            let objects = [take(heap, ledger), take(heap, ledger), take(heap, ledger)];
            for ptr in objects {
                give(heap, ledger, ptr);
            }
        });
    });
}

/// Runs `user` on a thread of CPU 0 while a thread on CPU 1 releases CPU 0's cache, then takes
/// the census.
fn race_a_release_of_cpu_0(
    heap: Arc<Heap>,
    ledger: std::sync::Arc<Ledger>,
    user: impl FnOnce(&Heap, &Ledger) + Send + 'static,
) {
    let user = {
        let (heap, ledger) = (heap.clone(), ledger.clone());
        thread::spawn(move || {
            model::run_on(0);
            user(&heap, &ledger);
        })
    };
    let releaser = {
        let heap = heap.clone();
        thread::spawn(move || {
            model::run_on(1);
            heap.release_cpu(0).expect("the model fences");
        })
    };
    user.join().unwrap();
    releaser.join().unwrap();
    census(heap, &ledger);
}

/// A heap as `warm_heap` makes it, whose CPU 0 `release_idle` has looked at once: that look
/// keeps the cache (there is no earlier look to compare with) and marks every class watched.
fn watched_heap() -> (Arc<Heap>, std::sync::Arc<Ledger>) {
    let (heap, ledger) = warm_heap();
    model::run_on(1);
    assert_eq!(
        heap.release_idle(),
        Ok(0),
        "the first look releases nothing"
    );
    (heap, ledger)
}

/// A thread on CPU 0 allocates and frees, finding the watch marks and clearing them, while a
/// thread on CPU 1 releases CPU 0's cache: a cleared mark never lifts the releaser's stop
/// (the thread passes through while the release runs), and nothing is lost or duplicated.
#[test]
fn a_release_racing_a_thread_that_clears_watch_marks_loses_and_duplicates_nothing() {
    explore("a release while CPU 0 clears watch marks", || {
        let (heap, ledger) = watched_heap();
        race_a_release_of_cpu_0(heap, ledger, |heap, ledger| {
            let ptr = take(heap, ledger);
            give(heap, ledger, ptr);
        });
    });
}

/// A thread on CPU 0 allocates and frees while `release_idle` looks at CPU 0 a second time
/// from CPU 1: the look releases the cache only if the thread had not touched it since the
/// mark, and either way nothing is lost or duplicated.
#[test]
fn a_second_look_racing_a_thread_of_the_cpu_loses_and_duplicates_nothing() {
    explore(
        "release_idle's second look while CPU 0 allocates and frees",
        || {
            let (heap, ledger) = watched_heap();
            let used = Arc::new(loom::sync::atomic::AtomicBool::new(false));
            let user = {
                let (heap, ledger, used) = (heap.clone(), ledger.clone(), used.clone());
                thread::spawn(move || {
                    model::run_on(0);
                    let ptr = take(&heap, &ledger);
                    used.store(true, loom::sync::atomic::Ordering::SeqCst);
                    give(&heap, &ledger, ptr);
                })
            };
            let watcher = {
                let (heap, used) = (heap.clone(), used.clone());
                thread::spawn(move || {
                    model::run_on(1);
                    let touched = used.load(loom::sync::atomic::Ordering::SeqCst);
                    let released = heap.release_idle().expect("the model fences");
                    // The user's take ended before the look began: it cleared its class's mark (or
                    // missed), so the look saw CPU 0 in use.
                    assert!(
                        !touched || released == 0,
                        "the second look released {released} bytes of a CPU used since the first"
                    );
                })
            };
            user.join().unwrap();
            watcher.join().unwrap();
            census(heap, &ledger);
        },
    );
}

/// A heap as `warm_heap` makes it, and a third object, held: CPU 0's cache is full again, so
/// that freeing the object there spills it to the transfer list.
fn heap_with_a_spill_to_come() -> (Arc<Heap>, std::sync::Arc<Ledger>, usize) {
    let (heap, ledger) = warm_heap();
    model::run_on(0);
    let objects = [
        take(&heap, &ledger),
        take(&heap, &ledger),
        take(&heap, &ledger),
    ];
    give(&heap, &ledger, objects[0]);
    give(&heap, &ledger, objects[1]);
    (heap, ledger, objects[2])
}

/// A thread on CPU 0 frees into a full cache, handing the object to the transfer list, while a
/// thread on CPU 1, whose cache is empty, allocates (taking the list's batch, or asking the
/// inner allocator) and frees; `with_release`, a third thread releases every cache and list
/// meanwhile. Nothing lost, handed out twice or freed twice.
fn a_spill_meets_a_miss(with_release: bool) {
    let (heap, ledger, extra) = heap_with_a_spill_to_come();
    let spiller = {
        let (heap, ledger) = (heap.clone(), ledger.clone());
        thread::spawn(move || {
            model::run_on(0);
            give(&heap, &ledger, extra);
        })
    };
    let taker = {
        let (heap, ledger) = (heap.clone(), ledger.clone());
        thread::spawn(move || {
            model::run_on(1);
            let ptr = take(&heap, &ledger);
            give(&heap, &ledger, ptr);
        })
    };
    let releaser = with_release.then(|| {
        let heap = heap.clone();
        thread::spawn(move || {
            model::run_on(1);
            heap.release().expect("the model fences");
        })
    });
    spiller.join().unwrap();
    taker.join().unwrap();
    if let Some(releaser) = releaser {
        releaser.join().unwrap();
    }
    census(heap, &ledger);
}

#[test]
fn a_spill_and_a_miss_on_two_cpus_meet_in_the_transfer_list_without_loss() {
    explore(
        "a spill on CPU 0 and a miss on CPU 1 through the transfer list",
        || a_spill_meets_a_miss(false),
    );
}

#[test]
fn a_release_of_every_cache_and_list_racing_a_spill_and_a_miss_loses_nothing() {
    explore(
        "a release while a spill and a miss meet in the transfer list",
        || a_spill_meets_a_miss(true),
    );
}

/// A heap whose caches hold six objects of the tests' class on each CPU, so that a spill or a
/// miss moves a batch of three (half the capacity), two of them in one section; CPU 0's cache
/// full, and a seventh object held, whose free spills.
fn heap_with_batches_to_come() -> (Arc<Heap>, std::sync::Arc<Ledger>, usize) {
    const HELD: usize = 6;
    let inner = CountingInner::default();
    let ledger = inner.0.clone();
    let heap = Arc::new(PerCpuAlloc::with_inner(inner).with_cache_bytes(cache_bytes() * HELD / 2));
    model::run_on(0);
    let objects: Vec<usize> = (0..=HELD).map(|_| take(&heap, &ledger)).collect();
    for &ptr in &objects[..HELD] {
        give(&heap, &ledger, ptr);
    }
    (heap, ledger, objects[HELD])
}

/// A thread on CPU 0 frees into its full cache (the spill pops two objects in one section and
/// hands three to the transfer list), takes five (the fifth misses and takes the list's batch
/// back, pushing two in one section) and frees them, while a thread on CPU 1 releases CPU 0's
/// cache: nothing lost or duplicated.
#[test]
fn a_release_racing_batches_moved_in_one_section_loses_and_duplicates_nothing() {
    explore(
        "a release while CPU 0 spills and refills in batches",
        || {
            let (heap, ledger, extra) = heap_with_batches_to_come();
            race_a_release_of_cpu_0(heap, ledger, move |heap, ledger| {
                give(heap, ledger, extra);
                let objects: Vec<usize> = (0..5).map(|_| take(heap, ledger)).collect();
                for ptr in objects {
                    give(heap, ledger, ptr);
                }
            });
        },
    );
}
