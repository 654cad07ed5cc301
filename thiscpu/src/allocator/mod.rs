//! `PerCpuAlloc`: a per-CPU cache of small objects in front of a heap of its own, and of any
//! global allocator for the rest, in the manner of tcmalloc's per-CPU caches, for
//! `#[global_allocator]` in one line.
//!
//! ```
//! #[global_allocator]
//! static ALLOCATOR: thiscpu::PerCpuAlloc = thiscpu::PerCpuAlloc::new();
//!
//! let words: Vec<String> = (0..1000).map(|i| i.to_string()).collect();
//! assert_eq!(words[999], "999");
//! ```
//!
//! # How it works
//! Requests of at most [`MAX_CACHED_SIZE`] bytes aligned to at most 16 are rounded up to a
//! size class ([`size_classes`]). Each possible CPU has a bounded stack of free objects per
//! class; `alloc` pops the current CPU's stack and `dealloc` pushes onto it, each in one
//! restartable sequence that commits with one store: no lock, no atomic read-modify-write, no
//! line shared with another CPU. Rust's `dealloc` is told the layout, so the class of a freed
//! object is known without a header or a page map.
//!
//! An empty stack is a *miss*, a full one a *spill*. Between the CPUs' caches sits a
//! *transfer list* per class: a spill hands the freed object over to it, with half the
//! stack's objects (up to 64) as one batch, and a miss takes a batch from it, keeping one
//! object and pushing the rest onto its CPU's stack. So objects freed on one CPU serve
//! allocations on another, a batch at a time: a producer thread and a consumer thread on two
//! CPUs move their objects through the list rather than through the inner allocator. The list
//! is guarded by a try-lock; a call that finds it taken, or a list that is full, gives the
//! batch back to the heap behind the caches (a spill) or takes one from it (a miss).
//!
//! The heap ([`with_own_heap`](PerCpuAlloc::with_own_heap), on for [`PerCpuAlloc::new`]) is
//! one per process: spans of 64 KiB, each holding objects of one class at a stride of the
//! class size rounded up to 16, cut from 4 MiB chunks aligned to their size; a record per span
//! in the chunk's first page, found by masking an object's address, and a bit per chunk that
//! says whether the heap owns an address. Each class has a lock and a list of its spans with
//! room; a span whose objects all came back becomes free for any class, and past 64 MiB of free
//! spans its pages go back to the system at once. Without the heap (or while the system
//! refuses it a chunk), the inner allocator makes the classes' objects, with the class's size
//! and an alignment of 16. Either way any path may give an object back where it came from:
//! larger or more aligned requests go to the inner allocator, and a process without rseq, a CPU
//! whose cache is being released, and a thread that a debugger single-steps (after
//! [`crate::ops::ABORT_LIMIT`] aborts in a row) bypass the caches.
//!
//! # Bounds
//! Each CPU caches at most [`with_cache_bytes`](PerCpuAlloc::with_cache_bytes) bytes
//! ([`DEFAULT_CACHE_BYTES`] by default), split evenly over the classes, and each class's
//! transfer list holds at most one CPU's share of the class: the allocator holds at most one
//! CPU's worth more than its CPUs' caches. The caches take one
//! region of address space per possible CPU (32 KiB at the default), mapped fresh from the
//! system on first use (not from the inner allocator, which holds only the cached objects; the
//! range goes back to the system when the allocator is dropped), of which only the pages of
//! CPUs and classes in use become resident. [`release`](PerCpuAlloc::release) gives every
//! CPU's cache back, [`release_idle`](PerCpuAlloc::release_idle) those of CPUs that did not
//! use theirs since the last call, without running anything there (a stop flag and a
//! membarrier fence of the CPU, as [`crate::Pool::drain_cpu`]); `release` also empties the
//! transfer lists, and `release_idle` those no batch went in or out of since its previous call;
//! both then give the pages of the heap's free spans back to the system. The heap maps chunks as
//! it needs them and never unmaps them: its address space is its peak.
//!
//! # Odd states
//! - Before the process has decided how rseq is registered, and inside that decision (which
//!   may allocate), calls pass through to the inner allocator; so do calls from a thread
//!   whose thread-locals are gone, or that the kernel does not give an rseq area.
//! - Without rseq (kernels before 4.18, valgrind, qemu-user, a seccomp filter,
//!   `THISCPU_RSEQ=off`, other systems) it is the inner allocator plus a size-class rounding.
//! - After `fork`, the child inherits the caches as they were: each stack's count is exact at
//!   every instant, whatever the other threads were doing. A release that was under way in
//!   another thread left its CPU's cache stopped; the child's first call that finds it so takes
//!   the release over and resumes the cache. The release lock records the fork generation it
//!   was taken in (a `pthread_atfork` handler counts forks in the child), so the child tells the
//!   parent's release from a live one with one load, whichever thread ids its kernel hands out.
//!   A call that passes through during a live release makes no system call, save one in 1,024
//!   per CPU that asks whether the releaser still exists (a thread that died holding it).
//!   The heap's locks are taken before a fork and released after it in both processes, so the
//!   child never finds one held by a thread it does not have.
//! - A thread preempted while it holds a class's heap lock makes the misses and spills of that
//!   class on other CPUs wait for it (a brief spin, then a sleep on the lock's word); hits and
//!   frees into a cache never wait.
//!
//! # When not to use it
//! Programs whose allocations are mostly larger than [`MAX_CACHED_SIZE`]. Programs checked by
//! AddressSanitizer or a heap profiler hooked into `malloc`: the heap's objects never reach
//! the inner allocator ([`with_inner`](PerCpuAlloc::with_inner) keeps them there). Objects
//! made on one CPU and freed on another move between the caches through the transfer lists, a
//! batch at a time, but each batch still costs a lock and a walk of its chain: the caches help
//! most when objects are freed near where they were made.
//!
//! # Safety
//! The `GlobalAlloc` implementation hands out and takes back raw memory; the caches' sections
//! are in `caches`. Each block states why it holds.

mod caches;
mod capacity;
mod classes;
mod export;
mod fork_stamp;
mod heap;
mod heap_lock;
mod process_heap;
mod transfer;

/// What `capacity` is written with: `core`'s atomics; its model check supplies loom's.
mod capacity_words {
    pub(super) use core::sync::atomic::{AtomicU64, Ordering};
}

/// What `heap` is written with: `core`'s atomics, and constructors evaluated in constants (the
/// process's heap is a static); its model check supplies loom's atomics, built at run time.
mod heap_words {
    pub(super) use core::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

    /// Whether a fresh chunk's zeroed memory already reads as its spans' records: true for
    /// `core`'s atomics, whose zero is a value.
    pub(super) const RECORDS_START_ZEROED: bool = true;

    /// Declares the function it is given `const`.
    macro_rules! constructor {
        ($(#[$attribute:meta])* $visibility:vis fn $($rest:tt)*) => {
            $(#[$attribute])* $visibility const fn $($rest)*
        };
    }

    /// An array of `$length` values of type `$element`, each a fresh `$value`.
    macro_rules! array_of {
        ($element:ty, $length:expr, $value:expr) => {{
            // A constant repeated gives each element its own atomics.
            #[allow(clippy::declare_interior_mutable_const)]
            const ELEMENT: $element = $value;
            [ELEMENT; $length]
        }};
    }

    pub(super) use {array_of, constructor};
}

/// What `heap_lock` is written with: `core`'s atomics (the heap is a static, built in a
/// constant) and the system's futex, in every build; its model check supplies loom's.
mod lock_word {
    pub(super) use crate::os::{wait, wake};
    pub(super) use core::sync::atomic::{AtomicU32, Ordering};
}

pub use classes::{MAX_CACHED_SIZE, size_classes};
#[cfg(feature = "prometheus-client")]
#[cfg_attr(docsrs, doc(cfg(feature = "prometheus-client")))]
pub use export::AllocCollector;
pub use heap::{idle_return, set_idle_return};

use crate::fence::FenceUnavailable;
use crate::ops::{self, ByCpu, StackOutcome};
use crate::registration::{self, Registrar};
use crate::topology;
use caches::{Caches, Tally};
use classes::class_layout;
use core::alloc::{GlobalAlloc, Layout};
use core::sync::atomic::{AtomicPtr, AtomicU8, Ordering};
use heap::Heap;
use std::alloc::System;
use transfer::Batch;

/// The most bytes each CPU caches unless [`PerCpuAlloc::with_cache_bytes`] says otherwise.
pub const DEFAULT_CACHE_BYTES: usize = 1 << 20;

/// The caches are not made yet.
const UNSTARTED: u8 = 0;
/// A thread is making them (or the process is deciding about rseq on it).
const STARTING: u8 = 1;
/// They are made and published.
const STARTED: u8 = 2;
/// The process has no rseq, or the system refused the caches' address space: pass everything
/// on.
const PASSING: u8 = 3;

/// A per-CPU cache of small objects in front of the global allocator `A` (the system's
/// `malloc` by default): see the [module documentation](self) for how it works, its bounds and
/// when not to use it.
///
/// ```
/// use std::alloc::{GlobalAlloc, Layout};
/// let allocator = thiscpu::PerCpuAlloc::new().with_cache_bytes(64 << 10);
/// let layout = Layout::from_size_align(64, 8).unwrap();
/// // SAFETY: a non-zero layout; the object is freed with the layout it was made with.
/// unsafe {
///     let object = allocator.alloc(layout);
///     assert!(!object.is_null());
///     object.write_bytes(7, 64);
///     allocator.dealloc(object, layout);
/// }
/// let stats = allocator.stats();
/// // Each CPU's cache, and one CPU's worth in the transfer lists between them.
/// assert!(stats.cached_bytes() <= (stats.per_cpu.len() as u64 + 1) * (64 << 10));
/// ```
pub struct PerCpuAlloc<A: GlobalAlloc = System> {
    inner: A,
    /// Whether small objects come from the process's own heap (`heap`) rather than `inner`.
    own_heap: bool,
    cache_bytes: usize,
    count_hits: bool,
    caches: AtomicPtr<Caches>,
    /// `caches` for the allocation fast path, which only counts no hits: null while hits are
    /// counted, so that the fast path tests one word.
    uncounted: AtomicPtr<Caches>,
    state: AtomicU8,
}

impl PerCpuAlloc<System> {
    /// Per-CPU caches in front of the system allocator, caching up to [`DEFAULT_CACHE_BYTES`]
    /// per CPU. Nothing is allocated until the first allocation.
    pub const fn new() -> Self {
        PerCpuAlloc::with_inner(System).with_own_heap(true)
    }
}

impl Default for PerCpuAlloc<System> {
    fn default() -> Self {
        PerCpuAlloc::new()
    }
}

impl<A: GlobalAlloc> PerCpuAlloc<A> {
    /// Per-CPU caches in front of `inner`.
    ///
    /// ```
    /// static ALLOCATOR: thiscpu::PerCpuAlloc<std::alloc::System> =
    ///     thiscpu::PerCpuAlloc::with_inner(std::alloc::System);
    /// ```
    pub const fn with_inner(inner: A) -> Self {
        PerCpuAlloc {
            inner,
            own_heap: false,
            cache_bytes: DEFAULT_CACHE_BYTES,
            count_hits: false,
            caches: AtomicPtr::new(core::ptr::null_mut()),
            uncounted: AtomicPtr::new(core::ptr::null_mut()),
            state: AtomicU8::new(UNSTARTED),
        }
    }

    /// Caches up to `per_cpu` bytes on each CPU (0 caches nothing: every call goes to the
    /// inner allocator), and as much again in the transfer lists between the CPUs. Each size
    /// class starts with `per_cpu / 73` bytes per CPU and grows, up to `per_cpu / 8`, from the
    /// share of the classes the program uses least; small settings leave the largest classes
    /// uncached. See [`AllocStats::capacity_bytes`] and [`AllocStats::bound_bytes`] for what a
    /// CPU holds.
    ///
    /// ```
    /// static ALLOCATOR: thiscpu::PerCpuAlloc =
    ///     thiscpu::PerCpuAlloc::new().with_cache_bytes(256 << 10);
    /// ```
    pub const fn with_cache_bytes(mut self, per_cpu: usize) -> Self {
        self.cache_bytes = per_cpu;
        self
    }

    /// Whether the objects of the size classes come from the allocator's own heap (spans of
    /// one class each, shared by every `PerCpuAlloc` of the process that uses it) rather than
    /// from the inner allocator, which then serves only larger or more aligned requests. On by
    /// default for [`PerCpuAlloc::new`], off for [`PerCpuAlloc::with_inner`]. Without rseq
    /// (where the caches never start) everything goes to the inner allocator either way.
    ///
    /// ```
    /// static ALLOCATOR: thiscpu::PerCpuAlloc<std::alloc::System> =
    ///     thiscpu::PerCpuAlloc::with_inner(std::alloc::System).with_own_heap(true);
    /// ```
    pub const fn with_own_heap(mut self, on: bool) -> Self {
        self.own_heap = on;
        self
    }

    /// Counts the allocations served from each CPU's cache ([`CpuAllocStats::hits`]), at the
    /// cost of one more restartable sequence per allocation; without it, hits are `None`.
    ///
    /// ```
    /// let allocator = thiscpu::PerCpuAlloc::new().counting_hits();
    /// assert!(allocator.stats().hits().is_some());
    /// ```
    pub const fn counting_hits(mut self) -> Self {
        self.count_hits = true;
        self
    }

    /// The allocator behind the caches.
    pub fn inner(&self) -> &A {
        &self.inner
    }

    /// Where objects of the size classes come from and go back to, beyond the caches.
    #[inline(always)]
    fn backing(&self) -> Backing<'_, A> {
        Backing {
            inner: &self.inner,
            heap: if self.own_heap {
                process_heap::started()
            } else {
                None
            },
        }
    }

    /// The caches if they are made, without making them.
    #[inline(always)]
    fn started(&self) -> Option<&Caches> {
        let caches = self.caches.load(Ordering::Acquire);
        // SAFETY: a non-null pointer was published (release) after the caches were made, and
        // they live until `self` is dropped.
        (!caches.is_null()).then(|| unsafe { &*caches })
    }

    /// The caches, making them on first use; `None` while they cannot be used.
    fn caches(&self) -> Option<&Caches> {
        self.started().or_else(|| self.start())
    }

    /// Makes the caches, once. Every call that finds another one making them (or the process
    /// deciding about rseq on this very thread, which may allocate) passes through instead of
    /// waiting, so nothing here can wait for itself.
    #[cold]
    #[inline(never)]
    fn start(&self) -> Option<&Caches> {
        // A plain load first: in a process without rseq every call comes here, and a
        // compare-and-swap that fails is still a locked instruction (8.7 against 5.1 ns a call,
        // in a loop of 100,000 allocations and then frees of 24 bytes, with caching off).
        if self.state.load(Ordering::Relaxed) != UNSTARTED {
            return None;
        }
        self.state
            .compare_exchange(UNSTARTED, STARTING, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        let uses_rseq = match registration::decided() {
            // This thread is making the decision: try again after it.
            None => {
                self.state.store(UNSTARTED, Ordering::Release);
                return None;
            }
            Some(process) => process.rseq.registrar != Registrar::None,
        };
        if uses_rseq && self.own_heap {
            // A heap the system refuses leaves the inner allocator serving every class.
            process_heap::start();
        }
        let made = uses_rseq
            .then(|| Caches::allocate(topology::possible_cpus(), self.cache_bytes))
            .flatten();
        let Some(caches) = made else {
            self.state.store(PASSING, Ordering::Release);
            return None;
        };
        self.caches.store(caches.cast_mut(), Ordering::Release);
        if !self.count_hits {
            self.uncounted.store(caches.cast_mut(), Ordering::Release);
        }
        self.state.store(STARTED, Ordering::Release);
        self.started()
    }

    /// An object of `class` for the calling thread: the fast path's one try, then the slow
    /// path.
    #[inline(always)]
    fn take(&self, class: usize) -> *mut u8 {
        let caches = self.uncounted.load(Ordering::Acquire);
        if !caches.is_null() {
            // SAFETY: as in `started`.
            let caches = unsafe { &*caches };
            if let Some(object) = caches.pop_here(class) {
                return object;
            }
        }
        self.take_slow(class)
    }

    /// The cache of `at`'s CPU had no object of `class`: counts the miss there, and takes a
    /// batch that another CPU handed over, or else asks the inner allocator.
    #[cold]
    #[inline(never)]
    fn miss(&self, caches: &Caches, at: ops::Position<ByCpu>, class: usize) -> *mut u8 {
        caches.count(at, Tally::Misses);
        caches.ask_for_room(class);
        let backing = self.backing();
        // One batch for both ways, empty again when the transfer list had none.
        let mut batch = Batch::new();
        if let Some(object) = caches.take_over_batch(class, &mut batch, &backing) {
            return object;
        }
        if let Some(heap) = backing.heap {
            heap.take(class, &mut batch, caches.batch_length(class));
            if let Some(object) = batch.pop() {
                caches.keep(class, &mut batch, &backing);
                return object;
            }
        }
        // SAFETY: a class layout is never zero-sized.
        unsafe { self.inner.alloc(class_layout(class)) }
    }

    #[cold]
    #[inline(never)]
    fn take_slow(&self, class: usize) -> *mut u8 {
        if let Some(caches) = self.caches() {
            let mut aborts = ops::AbortRun::new();
            while let Some(at) = ops::position() {
                let cpu = at.index() as usize;
                if cpu >= caches.cpus {
                    break;
                }
                // SAFETY: `at` was just read on this thread; its index is below the CPUs.
                match unsafe { caches.pop_at(at, class) } {
                    (StackOutcome::Committed, object) => {
                        if self.count_hits {
                            caches.count(at, Tally::Hits);
                        }
                        return object as *mut u8;
                    }
                    (StackOutcome::Refused, _) => return self.miss(caches, at, class),
                    (StackOutcome::Stopped, _) => {
                        if caches.unwatch(cpu, class) {
                            continue;
                        }
                        caches.pass_through(cpu);
                        break;
                    }
                    (StackOutcome::Aborted, _) => {
                        ops::note_abort();
                        if aborts.gives_up() {
                            break;
                        }
                    }
                }
            }
        }
        // SAFETY: a class layout is never zero-sized.
        unsafe { self.backing().alloc(class_layout(class)) }
    }

    /// Gives `object`, of `class`, back: the fast path's one try, then the slow path.
    ///
    /// # Safety
    /// `object` is an object of `class` from the backing (the own heap's, or the inner
    /// allocator's allocation of the class's layout), owned by the caller, who gives it up.
    #[inline(always)]
    unsafe fn give(&self, object: *mut u8, class: usize) {
        if let Some(caches) = self.started() {
            // SAFETY: the object is the caller's to give.
            match unsafe { caches.push_here(class, object) } {
                StackOutcome::Committed => return,
                // SAFETY: the push did not commit: the object is still the caller's.
                StackOutcome::Refused => return unsafe { self.spill_here(caches, object, class) },
                _ => {}
            }
        }
        // SAFETY: forwarded contract (the push did not commit: the object is still ours).
        unsafe { self.give_slow(object, class) }
    }

    /// The cache of `at`'s CPU was full: counts the spill there, and hands `object` with a
    /// batch of the cache's objects to the class's transfer list, for another CPU's misses, or
    /// else gives them to the inner allocator.
    ///
    /// # Safety
    /// As for [`PerCpuAlloc::give`].
    #[cold]
    #[inline(never)]
    unsafe fn spill(
        &self,
        caches: &Caches,
        at: ops::Position<ByCpu>,
        object: *mut u8,
        class: usize,
    ) {
        caches.count(at, Tally::Spills);
        caches.ask_for_room(class);
        // SAFETY: the object is an object of the class from the backing, which the caller
        // gives up.
        let refused = unsafe { caches.hand_over(class, object) };
        // SAFETY: objects of the class (the given one, or ones a committed pop took out of a
        // cache), that no list took.
        unsafe { self.backing().give_batch(class, refused) }
    }

    /// The cache of the CPU the push ran on was full: `spill` there, if the thread is still on
    /// a CPU with a cache (the tally goes to the CPU it is on now, and the objects to the
    /// class's transfer list, which every CPU shares), or else the slow path.
    ///
    /// # Safety
    /// As for [`PerCpuAlloc::give`].
    #[cold]
    #[inline(never)]
    unsafe fn spill_here(&self, caches: &Caches, object: *mut u8, class: usize) {
        let at = ops::position_as_is::<ByCpu>();
        if (at.index() as usize) < caches.cpus {
            // SAFETY: forwarded contract; `at` was just read on this thread, below the CPUs.
            unsafe { self.spill(caches, at, object, class) }
        } else {
            // SAFETY: forwarded contract.
            unsafe { self.give_slow(object, class) }
        }
    }

    /// # Safety
    /// As for [`PerCpuAlloc::give`].
    #[cold]
    #[inline(never)]
    unsafe fn give_slow(&self, object: *mut u8, class: usize) {
        if let Some(caches) = self.caches() {
            let mut aborts = ops::AbortRun::new();
            while let Some(at) = ops::position() {
                let cpu = at.index() as usize;
                if cpu >= caches.cpus {
                    break;
                }
                // SAFETY: as in `give`.
                match unsafe { caches.push_at(at, class, object) } {
                    StackOutcome::Committed => return,
                    StackOutcome::Refused => {
                        // SAFETY: as in `give`.
                        return unsafe { self.spill(caches, at, object, class) };
                    }
                    StackOutcome::Stopped => {
                        if caches.unwatch(cpu, class) {
                            continue;
                        }
                        caches.pass_through(cpu);
                        break;
                    }
                    StackOutcome::Aborted => {
                        ops::note_abort();
                        if aborts.gives_up() {
                            break;
                        }
                    }
                }
            }
        }
        // SAFETY: the object is an object of the class, and no cache took it.
        unsafe { self.backing().dealloc(object, class_layout(class)) }
    }

    /// Whether the object at `ptr` is among the objects the caches hold for `layout` now: in
    /// a CPU's cache or a transfer list. A checking mode asks before it frees: an object freed
    /// twice is still cached after its first free, unless an allocation took it back since.
    ///
    /// Read without stopping anything, each word atomically: exact while no other thread
    /// allocates or frees objects of `layout`'s size class, a moment stale otherwise. It visits
    /// every CPU's cache of the class, so it costs up to a few thousand loads.
    ///
    /// ```
    /// use std::alloc::{GlobalAlloc, Layout};
    /// let allocator = thiscpu::PerCpuAlloc::new();
    /// let layout = Layout::new::<[u64; 4]>();
    /// // SAFETY: a non-zero layout; the object is freed once.
    /// let object = unsafe { allocator.alloc(layout) };
    /// assert!(!allocator.caches_object(object, layout));
    /// // SAFETY: made above with `layout`, freed once.
    /// unsafe { allocator.dealloc(object, layout) };
    /// // Cached now, where the caches serve this process.
    /// assert_eq!(allocator.caches_object(object, layout), allocator.stats().caching);
    /// ```
    pub fn caches_object(&self, ptr: *const u8, layout: Layout) -> bool {
        match (self.started(), classes::class_of(layout)) {
            (Some(caches), Some(class)) => caches.holds(class, ptr as usize),
            _ => false,
        }
    }

    /// What the caches hold and did, read now (the counts of other CPUs may change while they
    /// are read).
    ///
    /// ```
    /// let allocator = thiscpu::PerCpuAlloc::new();
    /// let stats = allocator.stats();
    /// assert_eq!(stats.cached_bytes(), 0);
    /// ```
    pub fn stats(&self) -> AllocStats {
        let Some(caches) = self.started() else {
            return AllocStats {
                per_cpu: Vec::new(),
                caching: false,
                capacity_bytes: 0,
                bound_bytes: 0,
                capacity_growths: 0,
                counting_hits: self.count_hits,
                transfer_objects: 0,
                transfer_bytes: 0,
                batches_handed_over: 0,
                batches_taken: 0,
                heap: HeapStats::default(),
            };
        };
        let per_cpu = (0..caches.cpus)
            .map(|cpu| {
                let counters = caches.counters(cpu);
                let (cached_objects, cached_bytes) = caches.cached(cpu);
                CpuAllocStats {
                    cpu: cpu as u32,
                    hits: self.count_hits.then(|| caches.tally(cpu, Tally::Hits)),
                    misses: caches.tally(cpu, Tally::Misses),
                    spills: caches.tally(cpu, Tally::Spills),
                    passed_through: counters.passed.load(Ordering::Relaxed),
                    cached_objects,
                    cached_bytes,
                }
            })
            .collect();
        let transfer = caches.transferring();
        AllocStats {
            per_cpu,
            caching: true,
            capacity_bytes: caches.capacity_bytes(),
            bound_bytes: caches.bound_bytes(),
            capacity_growths: caches.growths(),
            counting_hits: self.count_hits,
            transfer_objects: transfer.objects,
            transfer_bytes: transfer.bytes,
            batches_handed_over: transfer.given,
            batches_taken: transfer.taken,
            heap: self.heap_stats(),
        }
    }

    /// The own heap's figures: zero unless this allocator uses it and it started.
    fn heap_stats(&self) -> HeapStats {
        let Some(heap) = self.backing().heap else {
            return HeapStats::default();
        };
        let figures = heap.figures();
        HeapStats {
            mapped_bytes: figures.mapped,
            in_use_bytes: figures.in_use,
            free_resident_bytes: figures.free_resident,
            returned_bytes: figures.returned,
            returned_total_bytes: figures.returned_total,
        }
    }

    /// The usable size of the object at `ptr` if it is an object of the own heap
    /// ([`with_own_heap`](PerCpuAlloc::with_own_heap)): its size class's size. `None` for
    /// every other address, which is how a size-less `free` (C's) tells the heap's objects
    /// from the inner allocator's. Reads the ownership map and the span's record, nothing at
    /// `ptr`; an object the heap has taken back may still answer with its size.
    ///
    /// ```
    /// use std::alloc::{GlobalAlloc, Layout};
    /// let allocator = thiscpu::PerCpuAlloc::new();
    /// let layout = Layout::new::<[u64; 4]>();
    /// // SAFETY: a non-zero layout; the object is freed once, with it.
    /// unsafe {
    ///     let object = allocator.alloc(layout);
    ///     if let Some(size) = allocator.heap_object_size(object) {
    ///         assert!(size >= 32);
    ///     }
    ///     allocator.dealloc(object, layout);
    /// }
    /// assert_eq!(allocator.heap_object_size(&layout as *const Layout as *const u8), None);
    /// ```
    pub fn heap_object_size(&self, ptr: *const u8) -> Option<usize> {
        self.backing().heap?.object_size(ptr as usize)
    }

    /// Whether `ptr` points into the own heap where no object is in use: an object its span
    /// took back (freed, and not allocated again since), room the span never handed out, or a
    /// span that holds no objects. A checking mode asks before it frees: an object freed twice
    /// whose first free went back to its span (past the caches and the transfer lists, which
    /// [`caches_object`](PerCpuAlloc::caches_object) looks in) is found here. False for an
    /// address outside the heap, and for an object in use or cached.
    ///
    /// It takes the lock of the span's size class and reads the object's bit in the span's free
    /// bitmap, and nothing at `ptr` itself: for checking modes, not for the fast path. Exact
    /// while no other thread allocates or frees that class; a moment stale otherwise. (So the
    /// example runs as a program of its own: beside other examples in one process, another
    /// one's allocation can take the object back between the release and the question, as it
    /// did in an arm64 guest.)
    ///
    /// ```standalone_crate
    /// use std::alloc::{GlobalAlloc, Layout};
    /// let allocator = thiscpu::PerCpuAlloc::new();
    /// let layout = Layout::new::<[u64; 4]>();
    /// // SAFETY: a non-zero layout; the object is freed once, with it.
    /// unsafe {
    ///     let object = allocator.alloc(layout);
    ///     assert!(!allocator.heap_object_is_free(object));
    ///     allocator.dealloc(object, layout);
    ///     // Back in a cache, or in its span if a release took it there.
    ///     let _ = allocator.release();
    ///     if allocator.heap_object_size(object).is_some() {
    ///         assert!(allocator.heap_object_is_free(object));
    ///     }
    /// }
    /// ```
    pub fn heap_object_is_free(&self, ptr: *const u8) -> bool {
        self.backing()
            .heap
            .is_some_and(|heap| heap.holds_no_object_at(ptr as usize))
    }

    /// Gives CPU `cpu`'s cached objects back to the inner allocator while threads there go on
    /// allocating; returns the bytes given back.
    ///
    /// ```
    /// let allocator = thiscpu::PerCpuAlloc::new();
    /// match allocator.release_cpu(0) {
    ///     Ok(bytes) => assert_eq!(bytes, 0, "nothing was cached yet"),
    ///     Err(why) => println!("{why}"),
    /// }
    /// ```
    pub fn release_cpu(&self, cpu: u32) -> Result<usize, ReleaseError> {
        let Some(caches) = self.started() else {
            return Ok(0);
        };
        if cpu as usize >= caches.cpus {
            return Err(ReleaseError::NoSuchCpu(cpu));
        }
        let Some(lock) = caches.lock_releases() else {
            return Err(ReleaseError::InProgress);
        };
        match caches.release_fenced(cpu as usize, &self.backing(), &lock) {
            Ok(bytes) => Ok(bytes as usize),
            Err(refused) => caches
                .release_by_visiting(cpu as usize, &self.backing(), &lock)
                .map(|bytes| bytes as usize)
                .ok_or(ReleaseError::Unavailable {
                    cpu,
                    fence: refused,
                    released: 0,
                }),
        }
    }

    /// Gives every CPU's cached objects, and those in the transfer lists between CPUs, back to
    /// the inner allocator; returns the bytes given back. A CPU that cannot be reached does not
    /// stop the others: the error names the first one, and says how much the others gave back.
    ///
    /// ```
    /// let allocator = thiscpu::PerCpuAlloc::new();
    /// let _ = allocator.release();
    /// assert_eq!(allocator.stats().cached_bytes(), 0);
    /// ```
    pub fn release(&self) -> Result<usize, ReleaseError> {
        self.release_where(|_, _| true, |_| true)
    }

    /// Gives back the caches of the CPUs that did not use them since the previous call (no CPU,
    /// the first time): the caches of CPUs the program stopped using, found without running
    /// anything on them. Call it periodically from any thread; returns the bytes given back.
    ///
    /// A CPU is idle when its cache neither missed, spilled, nor changed its contents since the
    /// previous call, and no allocation or free reached it at all: each call marks the caches
    /// it keeps, and the first call on the CPU to use a marked size class clears that class's
    /// mark, on the slow path, before it goes on from the cache as usual. So a CPU whose
    /// threads allocate and free without pause keeps its cache, at the cost of one slow-path
    /// trip per size class it uses per call; a CPU left alone is released at the next call
    /// (or the one after, if another release ran on it in between). A transfer list between
    /// CPUs is given back when no batch went in or out of it since the previous call.
    ///
    /// ```
    /// let allocator = thiscpu::PerCpuAlloc::new();
    /// let _ = allocator.release_idle();
    /// ```
    pub fn release_idle(&self) -> Result<usize, ReleaseError> {
        let Some(caches) = self.started() else {
            return Ok(0);
        };
        self.release_where(
            |cpu, bytes| {
                let untouched = caches.watched(cpu);
                let now = caches.activity(cpu);
                let before = caches.swap_seen(cpu, now);
                let idle = bytes > 0 && untouched && now == before;
                // Only CPUs that hold objects: their heads' page is resident already, where marking
                // another CPU would make its page resident for nothing to release.
                if !idle && bytes > 0 {
                    caches.watch(cpu);
                }
                idle
            },
            |transfer| transfer.idle_since_last_look(),
        )
    }

    /// Releases the caches of the CPUs for which `chosen(cpu, cached_bytes)` holds, and the
    /// transfer lists for which `chosen_list` does.
    fn release_where(
        &self,
        mut chosen: impl FnMut(usize, u64) -> bool,
        chosen_list: impl FnMut(&transfer::Transfer) -> bool,
    ) -> Result<usize, ReleaseError> {
        let Some(caches) = self.started() else {
            return Ok(0);
        };
        // SAFETY: every object in a transfer list is an object of its class from the backing
        // (only cached objects are handed over).
        let mut released = unsafe { caches.empty_transfers(&self.backing(), chosen_list) } as usize;
        let mut first_failure = None;
        for cpu in 0..caches.cpus {
            let (_, bytes) = caches.cached(cpu);
            if !chosen(cpu, bytes) || bytes == 0 {
                continue;
            }
            match self.release_cpu(cpu as u32) {
                Ok(bytes) => released += bytes,
                Err(why) => {
                    first_failure.get_or_insert(why);
                }
            }
        }
        // The spans the release emptied, and any others free, give their pages back.
        if let Some(heap) = self.backing().heap {
            heap.return_free_spans();
        }
        match first_failure {
            None => Ok(released),
            Some(ReleaseError::Unavailable { cpu, fence, .. }) => Err(ReleaseError::Unavailable {
                cpu,
                fence,
                released,
            }),
            Some(other) => Err(other),
        }
    }
}

impl<A: GlobalAlloc> Drop for PerCpuAlloc<A> {
    fn drop(&mut self) {
        let caches = *self.caches.get_mut();
        if !caches.is_null() {
            // SAFETY: made by `Caches::allocate` with this inner allocator; `&mut self` means no
            // call is in progress, so no section runs on the caches, and nothing refers to them
            // after this.
            unsafe { Caches::free(caches, &self.backing()) };
        }
    }
}

/// The objects of the size classes beyond the caches: the own heap's where it serves them, the
/// inner allocator's otherwise, and for every object the heap does not own (made before it
/// started, or while the system refused it a chunk). Only class layouts come here.
struct Backing<'a, A> {
    inner: &'a A,
    heap: Option<&'static Heap>,
}

impl<A: GlobalAlloc> Backing<'_, A> {
    /// Gives every object of `batch` back: the heap's to the heap, in one go, the rest to the
    /// inner allocator.
    ///
    /// # Safety
    /// Every object of `batch` is an object of `class` (the heap's, or the inner allocator's
    /// allocation of the class's layout) that the caller gives up.
    unsafe fn give_batch(&self, class: usize, mut batch: Batch) {
        if let Some(heap) = self.heap {
            // SAFETY: the objects the heap owns are objects it handed out for `class` (the
            // caller's contract), given up.
            unsafe { heap.give(class, &mut batch) };
        }
        while let Some(object) = batch.pop() {
            // SAFETY: an object of the class that the heap does not own: the inner allocator
            // made it with the class's layout (the caller's contract).
            unsafe { self.inner.dealloc(object, class_layout(class)) };
        }
    }
}

// SAFETY: a class layout is served from the heap where it has an object and by the inner
// allocator otherwise; `dealloc` sends an object the heap owns back to it (whose objects are
// all of class layouts, found again by `class_of`) and any other to the inner allocator, which
// made it with the same layout. Every other layout goes to the inner allocator as it is.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Backing<'_, A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if let Some(heap) = self.heap
            && let Some(class) = classes::class_of(layout)
            && class_layout(class) == layout
        {
            let mut batch = Batch::new();
            heap.take(class, &mut batch, 1);
            if let Some(object) = batch.pop() {
                return object;
            }
        }
        // SAFETY: the caller's layout, not zero-sized (the trait's contract).
        unsafe { self.inner.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if let Some(heap) = self.heap
            && heap.owns(ptr as usize)
            && let Some(class) = classes::class_of(layout)
        {
            let mut batch = Batch::new();
            batch.push(ptr);
            // SAFETY: the heap owns the object, so it handed it out for the class of its
            // layout; the caller gives it up.
            unsafe { heap.give(class, &mut batch) };
            return;
        }
        // SAFETY: an object the heap does not own was made by the inner allocator with this
        // layout (the trait's contract, through `alloc` above).
        unsafe { self.inner.dealloc(ptr, layout) }
    }
}

/// The layout a request that no class serves is passed to the inner allocator with: its own,
/// with an alignment of at most 16 raised to 16, the alignment of every cached object. So every
/// object of a request aligned to at most 16, cached size or not, is an allocation of the inner
/// allocator aligned to 16, and `realloc` can hand any of them to the inner allocator's own
/// `realloc` (which keeps the alignment) whichever sizes it moves between.
#[inline(always)]
fn inner_layout(layout: Layout) -> Layout {
    if layout.align() > classes::CACHED_ALIGN {
        return layout;
    }
    // A size within 15 bytes of `isize::MAX` keeps its own layout: no allocator can serve it,
    // and the same layout in gives the same layout out, so `dealloc` would agree with `alloc`.
    Layout::from_size_align(layout.size(), classes::CACHED_ALIGN).unwrap_or(layout)
}

// SAFETY: small requests are served by objects of a class at least as large, aligned to 16,
// each of which the inner allocator made with its class's layout and which is in exactly one
// place at a time (a cache, the caller, or back with the inner allocator: a stack's count is
// committed by one store, so an object is popped once); every other request goes to the inner
// allocator with `inner_layout` of its layout, and every object leaving a cache with its
// class's layout, the layouts they were made with.
unsafe impl<A: GlobalAlloc> GlobalAlloc for PerCpuAlloc<A> {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match classes::class_of(layout) {
            Some(class) => self.take(class),
            // SAFETY: the caller's layout, as the inner allocator gets it.
            None => unsafe { self.inner.alloc(inner_layout(layout)) },
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        match classes::class_of(layout) {
            // SAFETY: `ptr` was returned for `layout` by this allocator, so by `take` for the
            // same class; the caller gives it up.
            Some(class) => unsafe { self.give(ptr, class) },
            // SAFETY: a layout no class serves was passed to the inner allocator as
            // `inner_layout` makes it.
            None => unsafe { self.inner.dealloc(ptr, inner_layout(layout)) },
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match classes::class_of(layout) {
            Some(class) => {
                let object = self.take(class);
                if !object.is_null() {
                    // SAFETY: the object holds at least `layout.size()` bytes.
                    unsafe { object.write_bytes(0, layout.size()) };
                }
                object
            }
            // SAFETY: the caller's layout, as the inner allocator gets it.
            None => unsafe { self.inner.alloc_zeroed(inner_layout(layout)) },
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees that `new_size`, rounded up to `layout.align()`, does
        // not overflow `isize`, and the alignment is `layout`'s.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        let (old, new) = (classes::class_of(layout), classes::class_of(new_layout));
        // The object already holds its class's size.
        if old.is_some() && old == new {
            return ptr;
        }
        // An object of the heap moves by hand: the inner allocator's `realloc` does not know it.
        if old.is_some()
            && self
                .backing()
                .heap
                .is_some_and(|heap| heap.owns(ptr as usize))
        {
            // SAFETY: the new layout is valid (above) and not zero-sized where the old was not
            // (a class's object has a size); the old object, made with `layout`, is given up
            // once its bytes are copied, and only if the new one was made.
            unsafe {
                let moved = self.alloc(new_layout);
                if !moved.is_null() {
                    core::ptr::copy_nonoverlapping(ptr, moved, layout.size().min(new_size));
                    self.dealloc(ptr, layout);
                }
                return moved;
            }
        }
        // How the inner allocator holds the object now, and the size it must hold next.
        let held = old.map_or(inner_layout(layout), class_layout);
        let to_size = new.map_or(new_size, |class| classes::CLASS_SIZES[class]);
        if let Some(new) = new
            && let Some(moved) = self.take_cached(new)
        {
            // SAFETY: both objects hold at least the smaller size and are distinct live
            // allocations; the old one, made with `layout`, is given up.
            unsafe {
                core::ptr::copy_nonoverlapping(ptr, moved, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            return moved;
        }
        // SAFETY: `ptr` is not the heap's (a class's object that is went above), so it is an
        // allocation of `held` by the inner allocator (a class's layout for a cached size,
        // `inner_layout` otherwise, both aligned alike); what it returns is
        // one of `to_size` with the same alignment: the class's layout when the new size is
        // cached, `inner_layout` of the new layout when not. Null leaves `ptr` as it was.
        unsafe { self.inner.realloc(ptr, held, to_size) }
    }
}

impl<A: GlobalAlloc> PerCpuAlloc<A> {
    /// One try at an object of `class` from this CPU's cache, for `realloc`, which has the
    /// inner allocator's `realloc` to fall back on: `None` if the cache is empty (a miss,
    /// counted), being released, or not reachable from this thread now.
    fn take_cached(&self, class: usize) -> Option<*mut u8> {
        let caches = self.started()?;
        let at = ops::position_as_is::<ByCpu>();
        if (at.index() as usize) >= caches.cpus {
            return None;
        }
        // SAFETY: `at` was just read on this thread; its index is below the CPUs.
        match unsafe { caches.pop_at(at, class) } {
            (StackOutcome::Committed, object) => {
                if self.count_hits {
                    caches.count(at, Tally::Hits);
                }
                Some(object as *mut u8)
            }
            (StackOutcome::Refused, _) => {
                caches.count(at, Tally::Misses);
                caches.ask_for_room(class);
                None
            }
            // A watch mark is cleared, so that `release_idle` sees the CPU in use; this once the
            // inner allocator's `realloc` serves the call.
            (StackOutcome::Stopped, _) => {
                caches.unwatch(at.index() as usize, class);
                None
            }
            _ => None,
        }
    }
}

impl<A: GlobalAlloc> core::fmt::Debug for PerCpuAlloc<A> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let state = match self.state.load(Ordering::Relaxed) {
            UNSTARTED => "unstarted",
            STARTING => "starting",
            STARTED => "caching",
            _ => "passing through",
        };
        f.debug_struct("PerCpuAlloc")
            .field("cache_bytes", &self.cache_bytes)
            .field("counting_hits", &self.count_hits)
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

/// What a [`PerCpuAlloc`]'s caches hold and did ([`PerCpuAlloc::stats`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AllocStats {
    /// Each possible CPU's figures, by CPU number; empty while the caches are not in use.
    pub per_cpu: Vec<CpuAllocStats>,
    /// Whether the caches are in use (false before the first allocation, and for good in a
    /// process without rseq).
    pub caching: bool,
    /// The bytes of one CPU's capacities now: how many objects each size class may cache on a
    /// CPU, times their size, added up. At most what [`PerCpuAlloc::with_cache_bytes`] allows
    /// (each class starts with an equal share of it, and capacity moves to the classes that
    /// keep missing or spilling from those that ask least); a CPU's cache settles within it.
    /// 0 while `caching` is false: before the first allocation, and for good where the process
    /// has no rseq (every request then goes to the inner allocator, so nothing can be cached).
    pub capacity_bytes: u64,
    /// The most bytes one CPU's cache can hold at any moment: each class's most objects (an
    /// eighth of the budget, at most 2,048 objects), times their size. A class whose capacity
    /// was lent to another keeps the objects it held above its new capacity until it is next
    /// asked for them (or a release takes them), so a CPU may briefly hold more than
    /// `capacity_bytes`, never more than this. 0 while `caching` is false.
    pub bound_bytes: u64,
    /// Growths of a size class's capacity since the start: how often capacity moved to the
    /// classes the program uses.
    pub capacity_growths: u64,
    /// Whether hits are counted ([`PerCpuAlloc::counting_hits`]).
    pub counting_hits: bool,
    /// Objects in the transfer lists between CPUs now: batches that CPUs whose caches were
    /// full handed over, waiting for CPUs whose caches are empty.
    pub transfer_objects: u64,
    /// Their bytes (objects times their class's size).
    pub transfer_bytes: u64,
    /// Batches handed over to the transfer lists since the start.
    pub batches_handed_over: u64,
    /// Batches taken from them since the start.
    pub batches_taken: u64,
    /// The own heap's figures ([`PerCpuAlloc::with_own_heap`]), shared by every allocator of
    /// the process that uses it; zero where it is not in use.
    pub heap: HeapStats,
}

/// The own heap's figures, in [`AllocStats::heap`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeapStats {
    /// Address space mapped for spans (it is never unmapped; its pages are given back).
    pub mapped_bytes: u64,
    /// Bytes of spans that hold objects of a size class (in use, cached, or free in the span).
    pub in_use_bytes: u64,
    /// Bytes of free spans whose pages are kept for reuse.
    pub free_resident_bytes: u64,
    /// Bytes of free spans whose pages went back to the system.
    pub returned_bytes: u64,
    /// Bytes of pages given back to the system since the start.
    pub returned_total_bytes: u64,
}

impl AllocStats {
    /// Allocations served from a cache, `None` unless [`PerCpuAlloc::counting_hits`].
    pub fn hits(&self) -> Option<u64> {
        self.counting_hits
            .then(|| self.per_cpu.iter().filter_map(|cpu| cpu.hits).sum())
    }

    /// Allocations that found their CPU's cache empty.
    pub fn misses(&self) -> u64 {
        self.per_cpu.iter().map(|cpu| cpu.misses).sum()
    }

    /// Frees that found their CPU's cache full.
    pub fn spills(&self) -> u64 {
        self.per_cpu.iter().map(|cpu| cpu.spills).sum()
    }

    /// Bytes held for reuse: in every CPU's cache and in the transfer lists between them.
    pub fn cached_bytes(&self) -> u64 {
        self.per_cpu.iter().map(|cpu| cpu.cached_bytes).sum::<u64>() + self.transfer_bytes
    }
}

/// One CPU's part of [`AllocStats`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CpuAllocStats {
    /// The CPU.
    pub cpu: u32,
    /// Allocations served from this CPU's cache, `None` unless hits are counted.
    pub hits: Option<u64>,
    /// Allocations that found it empty and went to the inner allocator.
    pub misses: u64,
    /// Frees that found it full and went to the inner allocator.
    pub spills: u64,
    /// Calls that found it being released and went to the inner allocator.
    pub passed_through: u64,
    /// Objects in it now.
    pub cached_objects: u64,
    /// Bytes in it now (objects times their class's size).
    pub cached_bytes: u64,
}

/// Why a release did not reach a CPU's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReleaseError {
    /// The CPU is beyond the caches (not a possible CPU).
    NoSuchCpu(u32),
    /// membarrier is refused here, and this thread could not run on the CPU either (not among
    /// its allowed CPUs, offline, or no rseq); its cache is as it was.
    Unavailable {
        /// The CPU not reached (the first, for a release of several).
        cpu: u32,
        /// Why the fence was refused.
        fence: FenceUnavailable,
        /// Bytes that the other CPUs of the same call gave back.
        released: usize,
    },
    /// This thread is in the middle of a release already (a signal handler interrupted it).
    InProgress,
}

impl core::fmt::Display for ReleaseError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            ReleaseError::NoSuchCpu(cpu) => write!(f, "CPU {cpu} is not a possible CPU"),
            ReleaseError::Unavailable {
                cpu,
                fence,
                released,
            } => write!(
                f,
                "the cache of CPU {cpu} could not be released ({fence}, and this thread cannot \
                 run there); {released} bytes released from other CPUs"
            ),
            ReleaseError::InProgress => {
                write!(
                    f,
                    "this thread is releasing caches already (a signal handler?)"
                )
            }
        }
    }
}

impl std::error::Error for ReleaseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReleaseError::Unavailable { fence, .. } => Some(fence),
            ReleaseError::NoSuchCpu(_) | ReleaseError::InProgress => None,
        }
    }
}

#[cfg(all(test, not(thiscpu_model)))]
mod tests {
    use super::*;
    use core::sync::atomic::{AtomicI64, AtomicU64};

    /// The system allocator, counting the allocations it holds and every call it gets.
    #[derive(Default)]
    struct Counting {
        live: AtomicI64,
        calls: AtomicU64,
    }

    // SAFETY: forwards every call to the system allocator unchanged.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            self.live.fetch_add(1, Ordering::Relaxed);
            self.calls.fetch_add(1, Ordering::Relaxed);
            // SAFETY: forwarded.
            unsafe { System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            self.live.fetch_add(1, Ordering::Relaxed);
            self.calls.fetch_add(1, Ordering::Relaxed);
            // SAFETY: forwarded.
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            self.live.fetch_sub(1, Ordering::Relaxed);
            self.calls.fetch_add(1, Ordering::Relaxed);
            // SAFETY: forwarded.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    /// A thread id above every `pid_max` Linux allows (2^22): no thread has it.
    const VANISHED: i32 = i32::MAX;

    fn counting(per_cpu: usize) -> PerCpuAlloc<Counting> {
        PerCpuAlloc::with_inner(Counting::default()).with_cache_bytes(per_cpu)
    }

    /// Allocates and frees `rounds` objects of each size in `sizes`, `batch` at a time.
    fn churn<A: GlobalAlloc>(
        allocator: &PerCpuAlloc<A>,
        sizes: &[usize],
        batch: usize,
        rounds: usize,
    ) {
        let mut held = Vec::with_capacity(batch);
        for _ in 0..rounds {
            for &size in sizes {
                let layout = Layout::from_size_align(size, 8).unwrap();
                for _ in 0..batch {
                    // SAFETY: a non-zero layout.
                    let object = unsafe { allocator.alloc(layout) };
                    assert!(!object.is_null());
                    // SAFETY: the object holds `size` bytes.
                    unsafe { object.write_bytes(0xa5, size) };
                    held.push(object);
                }
                for object in held.drain(..) {
                    // SAFETY: made with `layout` just above.
                    unsafe { allocator.dealloc(object, layout) };
                }
            }
        }
    }

    /// Misses of a program that holds 100 objects of 1 KiB at a time, round after round, on one
    /// CPU: its class starts with 14 slots (1 MiB over 73 classes), so that each round misses
    /// 86 times, and grows as it misses and spills (to at most 128 slots), so that its later
    /// rounds find the objects of the round before in the cache.
    #[test]
    fn a_class_in_heavy_use_grows_and_misses_less() {
        let Ok(cpu) = crate::topology::pin_to(0) else {
            return;
        };
        let allocator = counting(DEFAULT_CACHE_BYTES);
        let layout = Layout::from_size_align(1024, 8).unwrap();
        let mut misses = Vec::new();
        let mut held = Vec::with_capacity(100);
        for _ in 0..20 {
            let before = allocator.stats().misses();
            for _ in 0..100 {
                // SAFETY: a non-zero layout.
                let object = unsafe { allocator.alloc(layout) };
                assert!(!object.is_null());
                held.push(object);
            }
            misses.push(allocator.stats().misses() - before);
            for object in held.drain(..) {
                // SAFETY: allocated above with `layout`, freed once.
                unsafe { allocator.dealloc(object, layout) };
            }
        }
        drop(cpu);
        let stats = allocator.stats();
        if !stats.caching {
            return;
        }
        eprintln!("misses by round: {misses:?}; {stats:?}");
        assert!(stats.capacity_growths > 0, "{stats:?}");
        assert!(
            stats.capacity_bytes <= DEFAULT_CACHE_BYTES as u64,
            "{stats:?}"
        );
        assert!(
            misses[19] * 2 < misses[0],
            "the last round missed {} times, the first {}",
            misses[19],
            misses[0]
        );
    }

    #[test]
    fn no_cpu_caches_more_than_its_bound() {
        for per_cpu in [0, 1000, 64 << 10, DEFAULT_CACHE_BYTES, 16 << 20] {
            let allocator = counting(per_cpu);
            churn(&allocator, &[16, 100, 1000, 4096], 3000, 2);
            let stats = allocator.stats();
            assert!(
                stats.capacity_bytes <= per_cpu as u64,
                "{per_cpu}: {stats:?}"
            );
            assert!(stats.bound_bytes <= per_cpu as u64 * 10, "{stats:?}");
            for cpu in &stats.per_cpu {
                assert!(cpu.cached_bytes <= stats.bound_bytes, "{per_cpu}: {cpu:?}");
            }
        }
    }

    #[test]
    fn objects_come_back_from_the_cache_and_are_counted() {
        let allocator = counting(DEFAULT_CACHE_BYTES);
        churn(&allocator, &[64], 100, 50);
        let stats = allocator.stats();
        if !stats.caching {
            return;
        }
        // Each round frees 100 objects and takes them again: only the first round (and a
        // round after a move to another CPU) can miss.
        assert!(stats.misses() < 100 * 10, "{stats:?}");
        assert_eq!(stats.spills(), 0, "{stats:?}");
        let cached = stats
            .per_cpu
            .iter()
            .map(|cpu| cpu.cached_objects)
            .sum::<u64>();
        assert_eq!(
            allocator.inner().live.load(Ordering::Relaxed),
            cached as i64,
            "the inner allocator holds exactly the cached objects"
        );
    }

    #[test]
    fn a_full_cache_spills_to_the_inner_allocator() {
        // A budget whose eighth is one 4,104-byte object: the class's most.
        let allocator = counting(4104 * 8);
        churn(&allocator, &[4096], 10, 3);
        let stats = allocator.stats();
        if !stats.caching {
            return;
        }
        assert!(
            stats.spills() >= 9,
            "at most one 4,104-byte object cached per CPU: {stats:?}"
        );
        assert!(stats.cached_bytes() <= 4104 * (stats.per_cpu.len() as u64 + 1));
    }

    /// A producer pinned to one CPU allocates objects that a consumer pinned to another
    /// frees: the consumer's full cache hands batches over, and the producer's misses take
    /// them; `release_idle` gives the lists back once no batch moves, and nothing is lost. How
    /// many calls still reach the inner allocator depends on how often each thread finds the
    /// other holding a list's lock, which a loaded machine decides (hundreds to a few thousand
    /// of the 25,600 objects on a quiet machine, 11,968 once while other tests ran beside it):
    /// printed, and held only below one call per object (`objects_freed_on_one_cpu_come_back_on_another`
    /// counts exactly).
    #[test]
    fn objects_freed_on_one_cpu_serve_allocations_on_another() {
        let allowed = crate::topology::allowed_cpus().unwrap_or_default();
        let allocator = counting(DEFAULT_CACHE_BYTES);
        let layout = Layout::from_size_align(64, 8).unwrap();
        // SAFETY: a non-zero layout; freed at once.
        unsafe { allocator.dealloc(allocator.alloc(layout), layout) };
        let (Some(&producer_cpu), Some(&consumer_cpu), true) =
            (allowed.first(), allowed.get(1), allocator.stats().caching)
        else {
            println!("skipped: needs two CPUs and rseq");
            return;
        };
        const ROUNDS: usize = 400;
        const PER_ROUND: usize = 64;
        let calls_before = allocator.inner().calls.load(Ordering::Relaxed);
        let (send, receive) = std::sync::mpsc::sync_channel::<Vec<usize>>(4);
        std::thread::scope(|scope| {
            let allocator = &allocator;
            scope.spawn(move || {
                let _pinned = crate::topology::pin_to(producer_cpu).unwrap();
                for _ in 0..ROUNDS {
                    // SAFETY: a non-zero layout.
                    let made = (0..PER_ROUND).map(|_| unsafe { allocator.alloc(layout) } as usize);
                    send.send(made.collect()).unwrap();
                }
            });
            scope.spawn(move || {
                let _pinned = crate::topology::pin_to(consumer_cpu).unwrap();
                for objects in receive {
                    for object in objects {
                        assert_ne!(object, 0);
                        // SAFETY: made by the producer with `layout`, freed once.
                        unsafe { allocator.dealloc(object as *mut u8, layout) };
                    }
                }
            });
        });
        let objects = (ROUNDS * PER_ROUND) as u64;
        let calls = allocator.inner().calls.load(Ordering::Relaxed) - calls_before;
        let stats = allocator.stats();
        eprintln!(
            "{calls} calls of the inner allocator for {objects} objects; {} batches handed over, \
             {} taken",
            stats.batches_handed_over, stats.batches_taken
        );
        assert!(
            stats.batches_taken > 0 && calls < objects,
            "{calls} calls of the inner allocator for {objects} objects: {stats:?}"
        );
        // The first look sees batches moved since the start, the second none since the first.
        let _ = allocator.release_idle();
        let _ = allocator.release_idle();
        let stats = allocator.stats();
        assert_eq!(stats.transfer_objects, 0, "{stats:?}");
        let _ = allocator.release();
        assert_eq!(allocator.inner().live.load(Ordering::Relaxed), 0);
    }

    /// One thread frees on CPU B what it allocated on CPU A, then allocates on A again: B's
    /// full cache handed batches to the transfer list, and A's misses take them, so the second
    /// round gets objects freed in the first instead of asking the inner allocator. One thread,
    /// so no lock is ever contended and the count is exact.
    #[test]
    fn objects_freed_on_one_cpu_come_back_on_another() {
        let allowed = crate::topology::allowed_cpus().unwrap_or_default();
        let allocator = counting(DEFAULT_CACHE_BYTES);
        let layout = Layout::from_size_align(64, 8).unwrap();
        let (Some(&a), Some(&b)) = (allowed.first(), allowed.get(1)) else {
            println!("skipped: needs two CPUs");
            return;
        };
        // More than the class's most slots (1,820 of 72 bytes), however far it grew.
        const OBJECTS: usize = 4000;
        let allocate = |cpu: u32| -> Vec<usize> {
            let _pinned = crate::topology::pin_to(cpu).unwrap();
            // SAFETY: a non-zero layout; every object is freed below, with it.
            (0..OBJECTS)
                .map(|_| unsafe { allocator.alloc(layout) } as usize)
                .collect()
        };
        let free = |cpu: u32, objects: Vec<usize>| {
            let _pinned = crate::topology::pin_to(cpu).unwrap();
            for object in objects {
                // SAFETY: allocated above with `layout`, freed once.
                unsafe { allocator.dealloc(object as *mut u8, layout) };
            }
        };
        let first = allocate(a);
        if !allocator.stats().caching {
            println!("skipped: no rseq here");
            free(a, first);
            return;
        }
        let freed: std::collections::BTreeSet<usize> = first.iter().copied().collect();
        free(b, first);
        let handed = allocator.stats().transfer_objects;
        // Every freed object the caches hold, in B's cache or the list, is found there, and
        // no other.
        let stats = allocator.stats();
        let cached: u64 = stats.per_cpu.iter().map(|cpu| cpu.cached_objects).sum();
        let found = freed
            .iter()
            .filter(|&&object| allocator.caches_object(object as *const u8, layout))
            .count() as u64;
        assert_eq!(found, cached + handed, "{stats:?}");
        let calls = allocator.inner().calls.load(Ordering::Relaxed);
        let second = allocate(a);
        let fresh = allocator.inner().calls.load(Ordering::Relaxed) - calls;
        let reused = second
            .iter()
            .filter(|object| freed.contains(object))
            .count() as u64;
        let stats = allocator.stats();
        // B's cache keeps its capacity's worth less the batches it handed over; every object
        // in the list comes back to A, the rest from the inner allocator.
        assert!(handed > 0, "{stats:?}");
        assert_eq!(
            stats.transfer_objects, 0,
            "A took the whole list: {stats:?}"
        );
        // (The inner allocator may hand back some of the addresses B's spills gave it.)
        assert!(reused >= handed, "{reused} of {handed}: {stats:?}");
        assert_eq!(fresh, OBJECTS as u64 - handed, "{stats:?}");
        free(a, second);
        let _ = allocator.release();
        assert_eq!(allocator.inner().live.load(Ordering::Relaxed), 0);
    }

    /// Allocates and frees 4,000 objects of `layout` on the calling thread (pinned by the
    /// caller), more than its CPU's cache can hold however far the class grew: the cache spills
    /// batches to the class's transfer list.
    /// The caches and the objects the list holds then (some), or `None` without caches.
    fn spill_to_the_list(
        allocator: &PerCpuAlloc<Counting>,
        layout: Layout,
    ) -> Option<(&Caches, u64)> {
        // SAFETY: a non-zero layout; each object freed once, with it.
        let objects: Vec<usize> = (0..4000)
            .map(|_| unsafe { allocator.alloc(layout) } as usize)
            .collect();
        for object in objects {
            // SAFETY: as above.
            unsafe { allocator.dealloc(object as *mut u8, layout) };
        }
        let caches = allocator.started()?;
        let held = allocator.stats().transfer_objects;
        assert!(held > 0, "{:?}", allocator.stats());
        Some((caches, held))
    }

    /// A list's lock left by a holder of an older fork generation (the parent's thread, in the
    /// child of a `fork` made while it held the lock) is taken over: the next release empties
    /// the list. One left in this generation is a live holder's, and is waited for, not taken.
    #[test]
    fn a_list_lock_left_before_a_fork_is_taken_over() {
        let allocator = counting(DEFAULT_CACHE_BYTES);
        let layout = Layout::from_size_align(64, 8).unwrap();
        let class = classes::class_of(layout).unwrap();
        let _pinned = crate::topology::pin_to(crate::current_cpu());
        let Some((caches, held)) = spill_to_the_list(&allocator, layout) else {
            println!("skipped: no rseq here");
            return;
        };
        let now = crate::os::fork_generation();
        caches.transfer_list(class).abandon(now);
        let _ = allocator.release();
        assert_eq!(
            allocator.stats().transfer_objects,
            held,
            "a live holder's list"
        );
        caches.transfer_list(class).abandon(now.wrapping_sub(1));
        let _ = allocator.release();
        assert_eq!(
            allocator.stats().transfer_objects,
            0,
            "taken over and emptied"
        );
        assert_eq!(allocator.inner().live.load(Ordering::Relaxed), 0);
    }

    /// A release that finds a transfer list's lock taken, and never given back (its holder is
    /// the thread that a signal handler calling `release` interrupted), gives up on that list
    /// after a while instead of waiting for ever; the next release empties it.
    #[test]
    fn a_release_does_not_wait_for_ever_on_a_list_lock() {
        let allocator = counting(DEFAULT_CACHE_BYTES);
        let layout = Layout::from_size_align(64, 8).unwrap();
        let class = classes::class_of(layout).unwrap();
        let _pinned = crate::topology::pin_to(crate::current_cpu());
        let Some((caches, held)) = spill_to_the_list(&allocator, layout) else {
            println!("skipped: no rseq here");
            return;
        };
        let lock = caches.transfer_list(class).hold();
        let _ = allocator.release();
        assert_eq!(
            allocator.stats().transfer_objects,
            held,
            "the locked list is left"
        );
        drop(lock);
        let _ = allocator.release();
        assert_eq!(allocator.stats().transfer_objects, 0);
        assert_eq!(allocator.inner().live.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn release_gives_back_everything_cached() {
        let _heap = heap_to_myself();
        for own_heap in [false, true] {
            let allocator = counting(DEFAULT_CACHE_BYTES).with_own_heap(own_heap);
            release_gives_back_everything(allocator);
        }
    }

    fn release_gives_back_everything(allocator: PerCpuAlloc<Counting>) {
        churn(&allocator, &[16, 48, 200, 2000], 300, 3);
        let before = allocator.stats();
        match allocator.release() {
            Ok(bytes) => {
                assert_eq!(bytes as u64, before.cached_bytes());
                assert_eq!(allocator.stats().cached_bytes(), 0);
                let live = allocator.inner().live.load(Ordering::Relaxed);
                assert_eq!(live, 0, "the inner allocator holds no object any more");
            }
            Err(why) => println!("release refused here: {why}"),
        }
    }

    #[test]
    fn dropping_the_allocator_gives_every_object_back() {
        // A static, so that the test can read it after the allocator in front of it is gone.
        static INNER: Counting = Counting {
            live: AtomicI64::new(0),
            calls: AtomicU64::new(0),
        };
        let inner = &INNER;
        {
            let allocator = PerCpuAlloc::with_inner(ByRef(inner));
            churn(&allocator, &[16, 48, 200, 2000, 4096], 300, 3);
            let stats = allocator.stats();
            let cached = stats
                .per_cpu
                .iter()
                .map(|cpu| cpu.cached_objects)
                .sum::<u64>()
                + stats.transfer_objects;
            assert_eq!(
                inner.live.load(Ordering::Relaxed),
                cached as i64,
                "the inner allocator holds exactly the cached objects"
            );
        }
        assert_eq!(inner.live.load(Ordering::Relaxed), 0);
    }

    /// A counting allocator shared with the test, which reads it after the front is dropped.
    struct ByRef(&'static Counting);

    // SAFETY: forwards every call.
    unsafe impl GlobalAlloc for ByRef {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            // SAFETY: forwarded.
            unsafe { self.0.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            // SAFETY: forwarded.
            unsafe { self.0.alloc_zeroed(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: forwarded.
            unsafe { self.0.dealloc(ptr, layout) }
        }
    }

    #[test]
    fn no_cache_bytes_means_every_call_goes_to_the_inner_allocator() {
        let allocator = counting(0);
        churn(&allocator, &[64], 10, 10);
        assert!(!allocator.stats().caching);
        assert_eq!(allocator.inner().calls.load(Ordering::Relaxed), 200);
        assert_eq!(allocator.inner().live.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn realloc_keeps_the_bytes_and_moves_only_between_classes() {
        // The second time with the own heap, whose objects the inner allocator's `realloc`
        // does not know.
        for own_heap in [false, true] {
            let allocator = counting(DEFAULT_CACHE_BYTES).with_own_heap(own_heap);
            let layout = Layout::from_size_align(20, 8).unwrap();
            // SAFETY: non-zero layouts; each object is freed with the layout it has.
            unsafe {
                let object = allocator.alloc(layout);
                for i in 0..20 {
                    object.add(i).write(i as u8);
                }
                let same = allocator.realloc(object, layout, 24);
                assert_eq!(same, object, "20 and 24 bytes share the 24-byte class");
                let grown = allocator.realloc(same, Layout::from_size_align(24, 8).unwrap(), 5000);
                for i in 0..20 {
                    assert_eq!(grown.add(i).read(), i as u8);
                }
                let shrunk =
                    allocator.realloc(grown, Layout::from_size_align(5000, 8).unwrap(), 10);
                for i in 0..10 {
                    assert_eq!(shrunk.add(i).read(), i as u8);
                }
                let moved = allocator.realloc(shrunk, Layout::from_size_align(10, 8).unwrap(), 500);
                for i in 0..10 {
                    assert_eq!(moved.add(i).read(), i as u8);
                }
                allocator.dealloc(moved, Layout::from_size_align(500, 8).unwrap());
            }
        }
    }

    #[test]
    fn zeroed_objects_are_zero_even_when_they_come_from_the_cache() {
        let allocator = PerCpuAlloc::new();
        let layout = Layout::from_size_align(256, 16).unwrap();
        for _ in 0..100 {
            // SAFETY: a non-zero layout; freed with it.
            unsafe {
                let object = allocator.alloc_zeroed(layout);
                assert!((0..256).all(|i| object.add(i).read() == 0));
                object.write_bytes(0xff, 256);
                allocator.dealloc(object, layout);
            }
        }
    }

    #[test]
    fn large_and_overaligned_requests_keep_their_layout() {
        let allocator = PerCpuAlloc::new();
        for layout in [
            Layout::from_size_align(64, 64).unwrap(),
            Layout::from_size_align(10_000, 8).unwrap(),
            Layout::from_size_align(4096, 4096).unwrap(),
        ] {
            // SAFETY: non-zero layouts; freed with them.
            unsafe {
                let object = allocator.alloc(layout);
                assert_eq!(object as usize % layout.align(), 0);
                allocator.dealloc(object, layout);
            }
        }
        assert_eq!(allocator.stats().cached_bytes(), 0);
    }

    #[test]
    fn hits_are_counted_exactly_when_asked_for() {
        let allocator = PerCpuAlloc::with_inner(Counting::default()).counting_hits();
        churn(&allocator, &[64], 10, 100);
        let stats = allocator.stats();
        if !stats.caching {
            assert_eq!(stats.hits(), Some(0));
            return;
        }
        assert_eq!(stats.hits().unwrap() + stats.misses(), 1000, "{stats:?}");
        assert_eq!(PerCpuAlloc::new().stats().hits(), None);
    }

    #[test]
    fn a_cpu_beyond_the_caches_is_an_error() {
        let allocator = PerCpuAlloc::new();
        churn(&allocator, &[64], 1, 1);
        if allocator.stats().caching {
            assert_eq!(
                allocator.release_cpu(u32::MAX),
                Err(ReleaseError::NoSuchCpu(u32::MAX))
            );
        }
    }

    #[test]
    fn release_idle_takes_only_caches_that_did_not_change() {
        let allocator = counting(DEFAULT_CACHE_BYTES);
        churn(&allocator, &[64], 10, 1);
        if !allocator.stats().caching {
            return;
        }
        assert_eq!(
            allocator.release_idle(),
            Ok(0),
            "the first look only notes each CPU"
        );
        let cached = allocator.stats().cached_bytes();
        assert_eq!(
            allocator.release_idle().map(|bytes| bytes as u64),
            Ok(cached)
        );
        assert_eq!(allocator.stats().cached_bytes(), 0);
    }

    #[test]
    fn a_release_left_by_a_vanished_thread_is_taken_over() {
        use crate::decided_once::Claimants;
        let allocator = std::sync::Arc::new(counting(DEFAULT_CACHE_BYTES));
        churn(&allocator, &[64], 10, 1);
        let Some(caches) = allocator.started() else {
            return;
        };
        // A thread that does not exist here, as a releaser in the parent of a `fork` is to the
        // child. Not the id of a thread that exited: the kernel may give it to the next thread
        // this process makes (it did, in a 2-CPU guest running the tests in parallel).
        let gone = VANISHED;
        assert!(crate::os::Threads.is_gone(gone));
        caches.abandon_release(gone, crate::os::fork_generation(), 0);
        let (done, finished) = std::sync::mpsc::channel();
        let releaser = allocator.clone();
        std::thread::spawn(move || done.send(releaser.release()).unwrap());
        let released = finished
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("a release waited for a thread that no longer exists");
        assert!(released.is_ok(), "{released:?}");
        assert!(
            !caches.stopped_anywhere(),
            "the vanished releaser's flags are still set"
        );
        assert_eq!(allocator.stats().cached_bytes(), 0);
    }

    /// A live thread of this process, and its id: the holder a release lock names when the
    /// kernel gave a child the id of the parent's releaser. Ends when the sender is dropped.
    fn live_thread() -> (
        i32,
        std::sync::mpsc::Sender<()>,
        std::thread::JoinHandle<()>,
    ) {
        use crate::decided_once::Claimants;
        let (id, id_is) = std::sync::mpsc::channel();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            id.send(crate::os::Threads.me()).unwrap();
            let _ = stopped.recv();
        });
        (id_is.recv().unwrap(), stop, thread)
    }

    /// A release taken in the parent of a `fork` (an older fork generation), whose holder's id
    /// is a live thread here: the child's next call resumes the caches, and its own release
    /// takes the lock over rather than waiting for that thread for ever.
    #[test]
    fn a_release_taken_before_a_fork_is_taken_over_though_its_holder_id_is_live() {
        use crate::decided_once::Claimants;
        let allocator = std::sync::Arc::new(counting(DEFAULT_CACHE_BYTES));
        churn(&allocator, &[64], 10, 1);
        let Some(caches) = allocator.started() else {
            return;
        };
        let (reused, stop, thread) = live_thread();
        assert!(!crate::os::Threads.is_gone(reused));
        let parents = crate::os::fork_generation().wrapping_sub(1);
        for cpu in 0..caches.cpus {
            caches.abandon_release(reused, parents, cpu);
        }
        churn(&allocator, &[64], 1, 1);
        assert!(
            !caches.stopped_anywhere(),
            "a call left the caches stopped by a release of the parent"
        );
        caches.abandon_release(reused, parents, 0);
        let (done, finished) = std::sync::mpsc::channel();
        let releaser = allocator.clone();
        std::thread::spawn(move || done.send(releaser.release()).unwrap());
        let released = finished
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("a release waited for the parent's releaser");
        assert!(released.is_ok(), "{released:?}");
        assert!(!caches.stopped_anywhere());
        drop(stop);
        thread.join().unwrap();
    }

    /// How many pairs `pass_throughs_during_a_live_release_check_the_holder_rarely` makes.
    const PAIRS_DURING_A_RELEASE: usize = 10_000;

    /// A live thread holds the release lock with every CPU stopped, as a releaser in the
    /// middle of its work: each allocation and free passes through, and the holder's liveness
    /// (a system call) is asked at most once per 1,024 pass-throughs of a CPU.
    #[test]
    fn pass_throughs_during_a_live_release_check_the_holder_rarely() {
        let allocator = counting(DEFAULT_CACHE_BYTES);
        churn(&allocator, &[64], 10, 1);
        let Some(caches) = allocator.started() else {
            return;
        };
        let (holder_id, stop, holder) = live_thread();
        for cpu in 0..caches.cpus {
            caches.abandon_release(holder_id, crate::os::fork_generation(), cpu);
        }
        let passed = |allocator: &PerCpuAlloc<Counting>| {
            allocator
                .stats()
                .per_cpu
                .iter()
                .map(|cpu| cpu.passed_through)
                .sum::<u64>()
        };
        let (passed_before, checks_before) = (passed(&allocator), caches.liveness_checks());
        let started = std::time::Instant::now();
        churn(&allocator, &[64], 1, PAIRS_DURING_A_RELEASE);
        let elapsed = started.elapsed();
        let pass_throughs = passed(&allocator) - passed_before;
        let checks = caches.liveness_checks() - checks_before;
        eprintln!(
            "{PAIRS_DURING_A_RELEASE} pairs during a live release: {:.1} ns a pair, \
             {pass_throughs} pass-throughs, {checks} liveness checks",
            elapsed.as_nanos() as f64 / PAIRS_DURING_A_RELEASE as f64
        );
        assert_eq!(pass_throughs, 2 * PAIRS_DURING_A_RELEASE as u64);
        assert!(
            checks <= pass_throughs / 1024 + caches.cpus as u64,
            "{checks} liveness checks for {pass_throughs} pass-throughs"
        );
        assert!(caches.stopped_anywhere(), "a live release was taken over");
        caches.end_abandoned_release();
        drop(stop);
        holder.join().unwrap();
    }

    /// The region is address space until used: one allocation and its free, on one CPU, make
    /// resident only the header's first two pages (its fields, 4,776 bytes that every call
    /// reads, and the transfer lists after them) and that CPU's pages of the class's head, of
    /// its counters and tallies and of the class's slots, not the 2 MiB each CPU's region
    /// spans at this budget. Pinned: a thread that moved between the two (as one did in a
    /// guest under TCG, 7 pages) touches a second CPU's.
    #[cfg(target_os = "linux")]
    #[test]
    fn one_allocation_makes_few_pages_of_the_region_resident() {
        let allocator = PerCpuAlloc::new().with_cache_bytes(64 << 20);
        let layout = Layout::from_size_align(24, 8).unwrap();
        let _pinned = crate::topology::pin_to(crate::current_cpu());
        // SAFETY: a non-zero layout; freed with it.
        unsafe {
            let object = allocator.alloc(layout);
            assert!(!object.is_null());
            allocator.dealloc(object, layout);
        }
        // Not `stats()`: it reads every CPU's heads, which maps their pages.
        let Some(caches) = allocator.started() else {
            return;
        };
        let (start, length) = caches.region();
        // SAFETY: `sysconf` has no precondition.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap();
        let first = start as usize & !(page - 1);
        let pages = (start as usize + length - first).div_ceil(page);
        let mut resident = vec![0u8; pages];
        // SAFETY: `first` is page-aligned and the `pages` pages from it hold the live region;
        // mincore writes one byte per page into a buffer of that many.
        let ret = unsafe {
            libc::mincore(
                first as *mut libc::c_void,
                pages * page,
                resident.as_mut_ptr(),
            )
        };
        assert_eq!(ret, 0, "mincore: {}", std::io::Error::last_os_error());
        let resident = resident.iter().filter(|&&page| page & 1 != 0).count();
        eprintln!("{resident} of {pages} pages of the region resident");
        assert!(
            resident <= 2 + 3,
            "{resident} of the region's {pages} pages are resident after one allocation"
        );
    }

    #[test]
    fn a_cache_left_stopped_by_a_vanished_releaser_resumes_at_its_next_call() {
        use crate::decided_once::Claimants;
        let allocator = counting(DEFAULT_CACHE_BYTES);
        churn(&allocator, &[64], 10, 1);
        let Some(caches) = allocator.started() else {
            return;
        };
        let gone = VANISHED;
        assert!(crate::os::Threads.is_gone(gone));
        for cpu in 0..caches.cpus {
            caches.abandon_release(gone, crate::os::fork_generation(), cpu);
        }
        churn(&allocator, &[64], 1, 1);
        assert!(
            !caches.stopped_anywhere(),
            "the caches stay stopped for good"
        );
        let before = allocator.stats().cached_bytes();
        churn(&allocator, &[64], 10, 1);
        assert!(
            allocator.stats().cached_bytes() > 0 || before > 0,
            "the caches are not used again"
        );
    }

    /// Held by the tests that fill and empty many of the heap's spans, which the whole process
    /// shares: one of them running beside another would reuse the other's freed spans, and
    /// neither would see its own figures.
    static HEAP_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn heap_to_myself() -> std::sync::MutexGuard<'static, ()> {
        HEAP_TESTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Allocates `count` objects of each size on each of `threads` threads, checks that they
    /// are distinct, aligned and the heap's (where it serves this process), and frees them.
    fn heap_round(allocator: &PerCpuAlloc, sizes: &[usize], count: usize, threads: usize) {
        let ranges = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for thread in 0..threads {
                let ranges = &ranges;
                scope.spawn(move || {
                    let mut mine = Vec::new();
                    for &size in sizes {
                        let layout = Layout::from_size_align(size, 8).unwrap();
                        for n in 0..count {
                            // SAFETY: a non-zero layout.
                            let object = unsafe { allocator.alloc(layout) };
                            assert!(!object.is_null());
                            assert_eq!(object as usize % 16, 0, "{size} bytes, unaligned");
                            // SAFETY: the object holds `size` bytes.
                            unsafe { object.write_bytes((thread * 7 + n) as u8, size) };
                            mine.push((object as usize, size, layout));
                        }
                    }
                    ranges.lock().unwrap().extend(mine);
                });
            }
        });
        let mut ranges = ranges.into_inner().unwrap();
        ranges.sort_unstable_by_key(|&(object, _, _)| object);
        for pair in ranges.windows(2) {
            assert!(pair[0].0 + pair[0].1 <= pair[1].0, "overlapping objects");
        }
        let owned = ranges
            .iter()
            .filter(
                |&&(object, size, _)| match allocator.heap_object_size(object as *const u8) {
                    Some(usable) => {
                        assert!(usable >= size, "{usable} usable bytes for {size}");
                        assert_eq!(allocator.heap_object_size((object + 8) as *const u8), None);
                        true
                    }
                    None => false,
                },
            )
            .count();
        if allocator.stats().caching {
            assert!(
                owned * 10 >= ranges.len() * 9,
                "{owned} of {} from the heap",
                ranges.len()
            );
        }
        for (object, _, layout) in ranges {
            // SAFETY: made with `layout` above, freed once.
            unsafe { allocator.dealloc(object as *mut u8, layout) };
        }
    }

    #[test]
    fn heap_objects_are_distinct_aligned_and_sized() {
        let _heap = heap_to_myself();
        let allocator = PerCpuAlloc::new();
        for _ in 0..3 {
            heap_round(&allocator, &[1, 24, 100, 1000, 4104], 3000, 4);
        }
        if allocator.stats().caching {
            assert!(allocator.stats().heap.in_use_bytes > 0);
        }
        let on_the_stack = 0u64;
        assert_eq!(
            allocator.heap_object_size(&on_the_stack as *const u64 as *const u8),
            None
        );
        // From the system's allocator itself: a `Box` would come from the heap in a build whose
        // global allocator is a `PerCpuAlloc`.
        let layout = Layout::new::<u64>();
        // SAFETY: a non-zero layout; freed with it below.
        let foreign = unsafe { System.alloc(layout) };
        assert_eq!(allocator.heap_object_size(foreign), None);
        // SAFETY: made just above with this layout.
        unsafe { System.dealloc(foreign, layout) };
    }

    /// Of a class this process's other threads rarely use (3,592 bytes), since an allocation
    /// of another allocator of the process may take the freed object back from its span
    /// meanwhile; not where the global allocator shares the heap and serves every test thread.
    #[test]
    #[cfg_attr(thiscpu_global_alloc, ignore = "the global allocator shares the heap")]
    fn an_object_its_span_took_back_is_free_and_its_neighbours_are_not() {
        let _heap = heap_to_myself();
        let allocator = PerCpuAlloc::new();
        let layout = Layout::from_size_align(3500, 8).unwrap();
        // SAFETY: a non-zero layout; each object is freed once below, with it.
        let objects: Vec<*mut u8> = (0..64)
            .map(|_| unsafe { allocator.alloc(layout) })
            .collect();
        if !allocator.stats().caching || allocator.heap_object_size(objects[32]).is_none() {
            return;
        }
        assert!(
            objects
                .iter()
                .all(|&object| !allocator.heap_object_is_free(object))
        );
        // SAFETY: made above, freed once.
        unsafe { allocator.dealloc(objects[32], layout) };
        // Cached: not the span's yet.
        assert!(!allocator.heap_object_is_free(objects[32]));
        assert!(allocator.release().is_ok());
        assert!(allocator.heap_object_is_free(objects[32]));
        assert!(!allocator.heap_object_is_free(objects[31]));
        // Off the stride, and outside the heap.
        assert!(allocator.heap_object_is_free(objects[31].wrapping_add(8)));
        let on_the_stack = 0u64;
        assert!(!allocator.heap_object_is_free(&on_the_stack as *const u64 as *const u8));
        for (n, &object) in objects.iter().enumerate() {
            if n != 32 {
                // SAFETY: made above, freed once.
                unsafe { allocator.dealloc(object, layout) };
            }
        }
    }

    #[test]
    fn empty_spans_give_their_pages_back_at_a_release() {
        let _heap = heap_to_myself();
        let allocator = PerCpuAlloc::new();
        heap_round(&allocator, &[256], 40_000, 2);
        if !allocator.stats().caching {
            return;
        }
        assert!(allocator.release().is_ok());
        let heap = allocator.stats().heap;
        // The free spans kept resident (up to 64 MiB) went back; other tests of this process
        // may have freed a span or two since.
        assert!(heap.free_resident_bytes < 1 << 20, "{heap:?}");
        assert!(heap.returned_total_bytes >= 8 << 20, "{heap:?}");
    }
}
