//! Model check of the own heap's span state changes (`src/allocator/heap.rs`, compiled here
//! with loom's atomics and its lock's model, over memory mapped for each interleaving): a
//! span emptied by one thread's batch leaving its class for the free spans while another
//! thread's batch of another class takes a span, or a batch of the same class takes objects
//! from it; free spans given back to the system, by a release and by the idle return, while a
//! thread takes one for a class; and a thread that holds an object asks the heap about it, as a
//! size-less free (without a lock) and the checking mode do, while other threads give objects
//! of its span back and take from it.
//!
//! In every interleaving, once the threads are done, every span's record agrees with the
//! lists and counts that describe it (`Heap::audit`: no object lost, made up or free twice, no
//! span both free and in a class, every span with room listed), every object handed out is
//! held by one holder only and still holds what its holder wrote (a span given back to the
//! system while in use reads as zeros here, as after `madvise`), and the heap counts as live
//! exactly the objects held.
//!
//! Run with `RUSTFLAGS="--cfg thiscpu_model" cargo test -p thiscpu --release --test
//! model_heap -- --nocapture`.
#![cfg(thiscpu_model)]

/// What `heap` is written with: loom's atomics, whose constructors run in the model, so a
/// fresh chunk's records are written rather than read as zeros.
mod heap_words {
    pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

    pub(crate) const RECORDS_START_ZEROED: bool = false;

    macro_rules! constructor {
        ($(#[$attribute:meta])* $visibility:vis fn $($rest:tt)*) => {
            $(#[$attribute])* $visibility fn $($rest)*
        };
    }

    macro_rules! array_of {
        ($element:ty, $length:expr, $value:expr) => {
            core::array::from_fn::<$element, $length, _>(|_| $value)
        };
    }

    pub(crate) use {array_of, constructor};
}

#[path = "common/heap_lock_word.rs"]
mod lock_word;

/// The batches the heap fills and empties: the allocator's own holds its objects in the same
/// way, in an array of addresses.
mod transfer {
    #[derive(Debug)]
    pub(crate) struct Batch(Vec<*mut u8>);

    const MAX_BATCH: usize = 32;

    impl Batch {
        pub(crate) fn new() -> Batch {
            Batch(Vec::with_capacity(MAX_BATCH))
        }

        pub(crate) fn len(&self) -> usize {
            self.0.len()
        }

        pub(crate) fn room(&self) -> usize {
            MAX_BATCH - self.0.len()
        }

        pub(crate) fn push(&mut self, object: *mut u8) {
            assert!(self.room() > 0, "a push into a full batch");
            self.0.push(object);
        }

        pub(crate) fn pop(&mut self) -> Option<*mut u8> {
            self.0.pop()
        }

        pub(crate) fn retain(&mut self, mut keep: impl FnMut(*mut u8) -> bool) {
            self.0.retain(|&object| keep(object));
        }
    }
}

/// The system as the heap sees it: mappings of this process, unmapped after each interleaving;
/// pages given back read as zeros, as after `madvise(MADV_DONTNEED)`; and a clock the test sets.
mod os {
    use core::cell::{Cell, RefCell};
    use core::ptr::NonNull;

    // Per test: loom runs a model's threads on the test's own thread, and the tests run at once.
    std::thread_local! {
        /// Every mapping made since the last `unmap_all`: its start and length.
        static MAPPINGS: RefCell<Vec<(usize, usize)>> = const { RefCell::new(Vec::new()) };
        static CLOCK_MS: Cell<u32> = const { Cell::new(0) };
    }

    fn map(length: usize) -> Option<NonNull<u8>> {
        // SAFETY: an anonymous private mapping at an address of the kernel's choice, read as
        // zeros until written.
        let address = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                length,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return None;
        }
        MAPPINGS.with_borrow_mut(|mappings| mappings.push((address as usize, length)));
        NonNull::new(address.cast())
    }

    pub(crate) fn reserve_zeroed(length: usize) -> Option<NonNull<u8>> {
        map(length)
    }

    /// `length` bytes aligned to `length`, inside a mapping of twice that.
    pub(crate) fn map_aligned(length: usize) -> Option<NonNull<u8>> {
        let start = map(length * 2)?.as_ptr() as usize;
        NonNull::new(start.next_multiple_of(length) as *mut u8)
    }

    /// # Safety
    /// Only for a mapping `unmap_all` still covers.
    pub(crate) unsafe fn unreserve(_start: NonNull<u8>, _length: usize) {}

    /// # Safety
    /// `start..start + length` is mapped and holds nothing anyone reads again.
    pub(crate) unsafe fn return_pages(start: NonNull<u8>, length: usize) {
        // SAFETY: the caller's contract.
        unsafe { start.as_ptr().write_bytes(0, length) };
    }

    /// Backing changes nothing a reader of the memory sees.
    ///
    /// # Safety
    /// None needed here; the signature matches the system's.
    pub(crate) unsafe fn back_pages(_start: *mut u8, _length: usize) {}

    pub(crate) fn coarse_millis() -> u32 {
        CLOCK_MS.get()
    }

    pub(crate) fn set_clock(ms: u32) {
        CLOCK_MS.set(ms);
    }

    /// Unmaps every mapping: once the heap of an interleaving is dropped.
    pub(crate) fn unmap_all() {
        for (start, length) in MAPPINGS.take() {
            // SAFETY: a mapping of `map`, which nothing uses once its heap is gone.
            unsafe { libc::munmap(start as *mut libc::c_void, length) };
        }
    }
}

#[path = "../src/allocator/classes.rs"]
#[allow(dead_code)]
mod classes;
#[path = "../src/allocator/heap.rs"]
#[allow(dead_code)]
mod heap;
#[path = "../src/allocator/heap_lock.rs"]
#[allow(dead_code)]
mod heap_lock;

use classes::CLASS_SIZES;
use heap::Heap;
use loom::sync::Arc;
use std::sync::atomic::Ordering;
use transfer::Batch;

/// Size classes of the scenarios: three of different strides.
const SMALL: usize = 0;
const MIDDLE: usize = 5;
const LARGE: usize = 40;

/// An object handed out, with the mark its holder wrote in its second word (the first is the
/// free list's link while it is free).
#[derive(Clone, Copy, Debug)]
struct Held {
    address: usize,
    class: usize,
    mark: usize,
}

fn take(heap: &Heap, class: usize, count: usize, mark: usize) -> Vec<Held> {
    let mut batch = Batch::new();
    heap.take(class, &mut batch, count);
    assert_eq!(
        batch.len(),
        count,
        "the heap handed out fewer objects than asked"
    );
    let mut held = Vec::new();
    while let Some(object) = batch.pop() {
        // SAFETY: an object of at least 16 bytes just handed out to this holder alone.
        unsafe { object.cast::<usize>().add(1).write(mark) };
        held.push(Held {
            address: object as usize,
            class,
            mark,
        });
    }
    held
}

fn give(heap: &Heap, objects: &[Held]) {
    let mut batch = Batch::new();
    for object in objects {
        check_mark(object);
        batch.push(object.address as *mut u8);
    }
    // SAFETY: every object was taken from this heap for its class, and its holder gives it up.
    unsafe { heap.give(objects[0].class, &mut batch) };
    assert_eq!(batch.len(), 0, "the heap refused objects it owns");
}

fn check_mark(object: &Held) {
    // SAFETY: the object is held, so its memory is mapped and its holder's.
    let mark = unsafe { (object.address as *const usize).add(1).read() };
    assert_eq!(
        mark, object.mark,
        "an object's memory changed under its holder"
    );
}

/// What a holder may always ask of an object it holds, without a lock.
fn check_held(heap: &Heap, object: &Held) {
    assert_eq!(
        heap.object_size(object.address),
        Some(CLASS_SIZES[object.class])
    );
    assert!(!heap.holds_no_object_at(object.address));
}

/// Checks the heap once every thread is done: its records agree with its lists, and the
/// objects it counts live are exactly the held ones, each held once and unchanged.
fn check_settled(heap: &Heap, held: &[Held]) {
    assert_eq!(
        heap.audit(),
        held.len(),
        "the heap's live objects are not the held ones"
    );
    for (index, object) in held.iter().enumerate() {
        check_mark(object);
        check_held(heap, object);
        assert!(
            held[..index]
                .iter()
                .all(|other| other.address != object.address),
            "one object held twice"
        );
    }
}

/// Runs `work` on a model thread of its own, with the heap. (Not on the model's main thread:
/// loom did not run another thread between two steps of a lock-free read there, which hid a
/// transient count carved of 0 that the same read on a spawned thread finds.)
fn on_a_thread<T: Send + 'static>(
    heap: &Arc<Heap>,
    work: impl FnOnce(&Heap) -> T + Send + 'static,
) -> loom::thread::JoinHandle<T> {
    let heap = Arc::clone(heap);
    loom::thread::spawn(move || work(&heap))
}

fn new_heap() -> Arc<Heap> {
    os::set_clock(0);
    let heap = Heap::new();
    assert!(heap.reserve_map());
    Arc::new(heap)
}

/// Runs `scenario` in every interleaving loom explores, unmapping each one's memory after it,
/// and prints how many it explored.
fn explore(name: &str, scenario: impl Fn() + Sync + Send + 'static) {
    let explored = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = explored.clone();
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(move || {
        count.fetch_add(1, Ordering::Relaxed);
        scenario();
        os::unmap_all();
    });
    println!("{name}: {} interleavings", explored.load(Ordering::Relaxed));
}

/// A span emptied by a batch of one class goes to the free spans while a batch of another
/// class takes a span: the emptied one or a fresh one.
#[test]
fn a_span_emptied_in_one_class_is_taken_by_another_whole() {
    explore("emptied span, another class", || {
        let heap = new_heap();
        let kept = take(&heap, LARGE, 1, 1);
        let emptied = take(&heap, SMALL, 2, 2);
        let giver = on_a_thread(&heap, move |heap| give(heap, &emptied));
        let taker = on_a_thread(&heap, move |heap| take(heap, MIDDLE, 1, 3));
        giver.join().unwrap();
        let mut held = taker.join().unwrap();
        held.extend(kept);
        check_settled(&heap, &held);
    });
}

/// A holder asks the heap about its object, without a lock (its size, as a size-less free
/// does) and under its class's lock (whether it is free, as the checking mode does), while
/// another batch gives objects of its span back and a third takes from it.
#[test]
fn a_holder_sees_its_object_live_while_its_span_gives_and_takes() {
    explore("a holder, its span changing", || {
        let heap = new_heap();
        let kept = take(&heap, SMALL, 1, 1);
        let given = take(&heap, SMALL, 2, 2);
        let giver = on_a_thread(&heap, move |heap| give(heap, &given));
        let taker = on_a_thread(&heap, move |heap| take(heap, SMALL, 2, 3));
        let asked = kept[0];
        let asker = on_a_thread(&heap, move |heap| check_held(heap, &asked));
        giver.join().unwrap();
        asker.join().unwrap();
        let mut held = taker.join().unwrap();
        held.extend(kept);
        check_settled(&heap, &held);
    });
}

/// A batch of one class empties a span while another batch of the same class takes objects:
/// from that span before it empties, or from a span taken after.
#[test]
fn a_span_emptied_while_its_class_takes_hands_each_object_to_one_holder() {
    explore("emptied span, same class", || {
        let heap = new_heap();
        let emptied = take(&heap, SMALL, 2, 1);
        let giver = on_a_thread(&heap, move |heap| give(heap, &emptied));
        let taker = on_a_thread(&heap, move |heap| take(heap, SMALL, 2, 2));
        giver.join().unwrap();
        let held = taker.join().unwrap();
        check_settled(&heap, &held);
    });
}

/// Free spans given back to the system by a release and, once they have been idle long
/// enough, by the heap's own return as another span empties, while a batch takes a span for
/// its class: no span in use is given back, and each free span is on one list.
#[test]
fn free_spans_given_back_while_a_class_takes_one_are_never_in_use() {
    explore("spans given back, a take", || {
        let heap = new_heap();
        let idle = take(&heap, SMALL, 1, 1);
        give(&heap, &idle);
        let emptied = take(&heap, LARGE, 1, 2);
        os::set_clock(5_000);
        let releaser = on_a_thread(&heap, |heap| {
            heap.return_free_spans();
        });
        let taker = on_a_thread(&heap, move |heap| take(heap, MIDDLE, 1, 3));
        let emptier = on_a_thread(&heap, move |heap| give(heap, &emptied));
        emptier.join().unwrap();
        releaser.join().unwrap();
        let held = taker.join().unwrap();
        check_settled(&heap, &held);
    });
}
