//! The allocators called directly, each through its own type (monomorphised, no dynamic
//! dispatch): `alloc` + `dealloc` pairs on every worker, and objects allocated on one CPU and
//! freed on another.

use super::switch::Kind;
use crate::bench::model::{RunInfo, Workload};
use crate::bench::runner::cpus_for;
use std::alloc::{GlobalAlloc, Layout};
use std::cell::UnsafeCell;
use std::hint::black_box;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// `alloc` then `dealloc` of one `layout`, with a word written into the object between them.
///
/// A whole aligned word, at the start: a narrower store that a later wider load of the
/// allocator's free-list link at the same place overlaps would stall store forwarding, a cost
/// of the benchmark rather than of the allocator (a byte written there cost mimalloc and
/// jemalloc 20 ns per pair here).
pub struct Pairs<A: 'static> {
    alloc: &'static A,
    layout: Layout,
}

impl<A: GlobalAlloc + Sync + 'static> Pairs<A> {
    pub fn new(alloc: &'static A, size: usize) -> Pairs<A> {
        Pairs {
            alloc,
            layout: object_layout(size),
        }
    }
}

/// The layout of a `size`-byte object, aligned to 8 like most Rust objects (`Box<u64>`, a
/// `Vec` of pointers); larger alignments take slower aligned paths in some allocators.
pub fn object_layout(size: usize) -> Layout {
    Layout::from_size_align(size.max(1), 8).unwrap_or(Layout::new::<u64>())
}

/// One allocation and free on the calling thread (the runner's main thread), then on a thread
/// of its own that ends, before any worker starts. Without them, the first case of mimalloc
/// and, once that was set up on the main thread, of jemalloc measured 25 ns per pair instead
/// of 2 to 3 here, in every round and whatever the object's size: the worker threads that an
/// allocator meets first are not the ones it should be judged on.
fn set_up<A: GlobalAlloc + Sync>(alloc: &'static A) {
    let once = move || {
        let layout = object_layout(64);
        // SAFETY: the layout's size is not zero.
        let object = unsafe { alloc.alloc(layout) };
        if !object.is_null() {
            // SAFETY: `object` came from `alloc` with `layout`.
            unsafe { alloc.dealloc(object, layout) };
        }
    };
    once();
    let _ = std::thread::spawn(once).join();
}

impl<A: GlobalAlloc + Sync + 'static> Workload for Pairs<A> {
    fn start(&self, _run: &RunInfo) {
        set_up(self.alloc);
    }

    fn run(&self, _worker: usize, ops: u64) {
        let alloc = black_box(self.alloc);
        let layout = black_box(self.layout);
        for op in 0..ops {
            // SAFETY: the layout's size is not zero.
            let object = unsafe { alloc.alloc(layout) };
            if object.is_null() {
                std::alloc::handle_alloc_error(layout);
            }
            // SAFETY: `object` is a new allocation of at least 8 bytes, aligned to 8.
            unsafe { object.cast::<u64>().write(op) };
            // SAFETY: `object` came from `alloc` with `layout` and is freed once.
            unsafe { alloc.dealloc(black_box(object), layout) };
        }
    }
}

/// Objects handed from the producer to the consumer at a time.
const BATCH: usize = 256;
/// Batches in flight at most.
const SLOTS: usize = 8;

/// One batch of objects in flight: written by the producer while `full` is false, read by the
/// consumer while it is true.
struct Slot {
    full: AtomicBool,
    len: UnsafeCell<usize>,
    objects: UnsafeCell<[*mut u8; BATCH]>,
}

/// The batches between one producer and one consumer, used in order.
struct Ring {
    slots: [Slot; SLOTS],
    /// Set when the consumer is to free what is left and stop.
    stop: AtomicBool,
}

// SAFETY: a slot's cells are touched by one thread at a time: the producer while `full` is
// false, the consumer while it is true; each hands the slot over with a release store of `full`
// that the other reads with acquire. The pointers are allocations either thread may free.
unsafe impl Sync for Ring {}
// SAFETY: as above; the pointers are plain allocations, not tied to a thread.
unsafe impl Send for Ring {}

impl Ring {
    fn new() -> Ring {
        Ring {
            slots: std::array::from_fn(|_| Slot {
                full: AtomicBool::new(false),
                len: UnsafeCell::new(0),
                objects: UnsafeCell::new([std::ptr::null_mut(); BATCH]),
            }),
            stop: AtomicBool::new(false),
        }
    }
}

/// Waits a moment: a spin, and now and then the CPU given up.
#[inline]
fn pause(spins: &mut u32) {
    *spins += 1;
    if (*spins).is_multiple_of(64) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// The consumer thread of one measurement.
struct Consumer {
    ring: Arc<Ring>,
    thread: std::thread::JoinHandle<u64>,
}

/// A producer (the runner's one worker) allocates `size`-byte objects and hands them in
/// batches of [`BATCH`] to a consumer thread pinned to another CPU, which frees them. The
/// producer waits when [`SLOTS`] batches are in flight, so its CPU time per object is the
/// pace of the pair: its allocations or the consumer's frees, whichever is slower.
pub struct Remote<A: 'static> {
    alloc: &'static A,
    layout: Layout,
    consumer_cpu: u32,
    consumer: Mutex<Option<Consumer>>,
    /// The producer's next slot.
    head: AtomicUsize,
    made: AtomicU64,
}

impl<A: GlobalAlloc + Sync + 'static> Remote<A> {
    pub fn new(alloc: &'static A, size: usize, consumer_cpu: u32) -> Remote<A> {
        Remote {
            alloc,
            layout: object_layout(size),
            consumer_cpu,
            consumer: Mutex::new(None),
            head: AtomicUsize::new(0),
            made: AtomicU64::new(0),
        }
    }

    /// Stops the consumer once it has freed every batch handed to it; the objects it freed.
    fn stop_consumer(&self) -> Result<u64, String> {
        let consumer = self
            .consumer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let Some(consumer) = consumer else {
            return Ok(0);
        };
        consumer.ring.stop.store(true, Ordering::Release);
        consumer
            .thread
            .join()
            .map_err(|_| "the consumer thread panicked".to_owned())
    }
}

/// The CPU the consumer of a remote case runs on: the second the runner pins workers to, when
/// there is one.
pub fn consumer_cpu() -> Option<u32> {
    cpus_for(2).get(1).copied()
}

impl<A: GlobalAlloc + Sync + 'static> Workload for Remote<A> {
    fn start(&self, _run: &RunInfo) {
        set_up(self.alloc);
    }

    fn fixed_threads(&self) -> Option<usize> {
        Some(1)
    }

    fn end_calibration(&self) {
        // It frees what it holds; its errors are the rounds' to report.
        let _ = self.stop_consumer();
    }

    fn prepare(&self, _threads: usize) {
        // A consumer left from the previous round frees what it holds first.
        let _ = self.stop_consumer();
        self.made.store(0, Ordering::Relaxed);
        self.head.store(0, Ordering::Relaxed);
        let ring = Arc::new(Ring::new());
        let (theirs, alloc, layout, cpu) = (Arc::clone(&ring), self.alloc, self.layout, self.consumer_cpu);
        let thread = std::thread::spawn(move || {
            let _pinned = thiscpu::topology::pin_to(cpu);
            let mut freed = 0u64;
            let mut tail = 0usize;
            let mut spins = 0u32;
            loop {
                let slot = &theirs.slots[tail % SLOTS];
                if slot.full.load(Ordering::Acquire) {
                    // SAFETY: `full` is true, so the producer has handed this slot over.
                    let len = unsafe { *slot.len.get() };
                    // SAFETY: as above.
                    let objects = unsafe { &*slot.objects.get() };
                    for &object in &objects[..len] {
                        // SAFETY: the producer made `object` with `layout` on `alloc`, and
                        // handed it over once.
                        unsafe { alloc.dealloc(object, layout) };
                    }
                    freed += len as u64;
                    slot.full.store(false, Ordering::Release);
                    tail += 1;
                    continue;
                }
                // The producer fills slots in order and has stopped before `stop` is set: an
                // empty slot after it means everything was freed.
                if theirs.stop.load(Ordering::Acquire) && !slot.full.load(Ordering::Acquire) {
                    return freed;
                }
                pause(&mut spins);
            }
        });
        *self.consumer.lock().unwrap_or_else(|p| p.into_inner()) = Some(Consumer { ring, thread });
    }

    fn run(&self, _worker: usize, ops: u64) {
        let Some(ring) = self
            .consumer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|consumer| Arc::clone(&consumer.ring))
        else {
            return;
        };
        let (alloc, layout) = (black_box(self.alloc), black_box(self.layout));
        let mut head = self.head.load(Ordering::Relaxed);
        let mut left = ops;
        let mut spins = 0u32;
        while left > 0 {
            let len = left.min(BATCH as u64) as usize;
            let slot = &ring.slots[head % SLOTS];
            while slot.full.load(Ordering::Acquire) {
                pause(&mut spins);
            }
            // SAFETY: `full` is false, so the consumer has handed this slot back.
            let objects = unsafe { &mut *slot.objects.get() };
            for (at, object) in objects[..len].iter_mut().enumerate() {
                // SAFETY: the layout's size is not zero.
                let made = unsafe { alloc.alloc(layout) };
                if made.is_null() {
                    std::alloc::handle_alloc_error(layout);
                }
                // SAFETY: `made` is a new allocation of at least 8 bytes, aligned to 8.
                unsafe { made.cast::<u64>().write(at as u64) };
                *object = made;
            }
            // SAFETY: as above.
            unsafe { *slot.len.get() = len };
            slot.full.store(true, Ordering::Release);
            head += 1;
            left -= len as u64;
        }
        self.head.store(head, Ordering::Relaxed);
        self.made.fetch_add(ops, Ordering::Relaxed);
    }

    fn verify(&self, ops: u64) -> Result<(), String> {
        let freed = self.stop_consumer()?;
        let made = self.made.load(Ordering::Relaxed);
        if made == ops && freed == made {
            Ok(())
        } else {
            Err(format!(
                "{ops} operations made {made} objects and the consumer freed {freed}"
            ))
        }
    }
}

/// A pair workload for `kind`, through that allocator's own type.
pub fn pairs(kind: Kind, size: usize) -> Box<dyn Workload> {
    use super::switch::{GLIBC, JEMALLOC, MIMALLOC, TCMALLOC, THISCPU};
    match kind {
        Kind::Glibc => Box::new(Pairs::new(&GLIBC, size)),
        Kind::Mimalloc => Box::new(Pairs::new(&MIMALLOC, size)),
        Kind::Jemalloc => Box::new(Pairs::new(&JEMALLOC, size)),
        Kind::Tcmalloc => Box::new(Pairs::new(&TCMALLOC, size)),
        Kind::Thiscpu => Box::new(Pairs::new(&THISCPU, size)),
    }
}

/// A remote-free workload for `kind`, through that allocator's own type.
pub fn remote(kind: Kind, size: usize, consumer_cpu: u32) -> Box<dyn Workload> {
    use super::switch::{GLIBC, JEMALLOC, MIMALLOC, TCMALLOC, THISCPU};
    match kind {
        Kind::Glibc => Box::new(Remote::new(&GLIBC, size, consumer_cpu)),
        Kind::Mimalloc => Box::new(Remote::new(&MIMALLOC, size, consumer_cpu)),
        Kind::Jemalloc => Box::new(Remote::new(&JEMALLOC, size, consumer_cpu)),
        Kind::Tcmalloc => Box::new(Remote::new(&TCMALLOC, size, consumer_cpu)),
        Kind::Thiscpu => Box::new(Remote::new(&THISCPU, size, consumer_cpu)),
    }
}
