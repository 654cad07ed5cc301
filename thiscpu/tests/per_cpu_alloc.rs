//! `PerCpuAlloc` as the program's global allocator: this test executable, its harness and std
//! included, allocates through it. Every object the tests make carries a canary (a pattern
//! derived from its address and size over all of its bytes), checked before it is freed and,
//! for what `realloc` kept, after it moved; a second allocator, `PerCpuAlloc<CountingInner>`,
//! runs the same storms over an inner allocator that holds every live allocation by address,
//! so that an object lost in a cache, handed out twice or freed twice shows up there.
//!
//! The storms: random sizes and alignments, `realloc` across the cached limit, frees on other
//! threads, thread churn, migration and signals; 100,000 short threads; `fork` while other
//! threads allocate; `release_cpu` racing the threads of that CPU. The odd states: no rseq
//! (`THISCPU_RSEQ=off`, in a child), destructors of thread-locals at thread exit, and with
//! `--cfg thiscpu_inject` a signal handler that allocates while the first rseq decision is made.
//!
//! Linux only (`sched_setaffinity`, `tgkill`, `fork`). Not built under the model checker, nor
//! with `--cfg thiscpu_global_alloc`, where the library declares the global allocator itself.
#![cfg(all(target_os = "linux", not(thiscpu_model), not(thiscpu_global_alloc)))]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thiscpu::allocator::{self, AllocStats, PerCpuAlloc};

#[global_allocator]
static GLOBAL: PerCpuAlloc = PerCpuAlloc::new();

// --- objects with canaries ----------------------------------------------------------------

/// An allocation made by a test, with the layout it was made with.
#[derive(Debug)]
struct Object {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: an `Object` is a plain allocation that one thread at a time owns; any thread may free
// it (the allocators under test are `Sync`, and a free on another thread is what is tested).
unsafe impl Send for Object {}

/// The canary of an object at `address` of `size` bytes: word `n` of it (8 bytes, little-endian)
/// is `canary_start(address, size) + n * CANARY_STEP`, wrapping, and a last partial word is
/// that word's first bytes.
fn canary_start(address: usize, size: usize) -> u64 {
    (address as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (size as u64).rotate_left(29)
}

/// See [`canary_start`].
const CANARY_STEP: u64 = 0xd1b5_4a32_d192_ed03;

// The tests run unoptimised (under qemu's TCG in CI's guests too), where writing and checking
// the canaries through `copy_nonoverlapping`, slices or `read_unaligned` costs a call and a
// precondition check a word: 96 % of the instructions of
// `threads_allocate_in_their_exit_destructors` (callgrind). Plain loads and stores through
// `wrapping_add` do without, a word at a time where the object is 8-aligned (nearly always)
// and a byte at a time elsewhere: that test then ran 1.41 billion instructions, not 8.07.

/// Byte `at` of the canary whose word holding it is `word`.
fn canary_byte(word: u64, at: usize) -> u8 {
    (word >> (8 * (at % 8))) as u8
}

/// Writes the canary of `(address, size)` over the first `size` bytes at `ptr`.
///
/// # Safety
/// `ptr` must be valid for writes of `size` bytes.
unsafe fn write_canary(ptr: *mut u8, address: usize, size: usize) {
    let mut word = canary_start(address, size);
    let mut at = 0;
    if ptr.cast::<u64>().is_aligned() {
        while size - at >= 8 {
            // SAFETY: bytes `at..at + 8` of the `size` at `ptr`, valid for writes (the caller),
            // and 8-aligned (`ptr` and `at` are multiples of 8).
            unsafe { *ptr.wrapping_add(at).cast::<u64>() = word.to_le() };
            word = word.wrapping_add(CANARY_STEP);
            at += 8;
        }
    }
    while at < size {
        // SAFETY: byte `at < size` at `ptr`, valid for writes (the caller).
        unsafe { *ptr.wrapping_add(at) = canary_byte(word, at) };
        at += 1;
        if at % 8 == 0 {
            word = word.wrapping_add(CANARY_STEP);
        }
    }
}

/// Checks that the first `prefix` bytes at `ptr` hold the canary of `(address, size)`;
/// otherwise describes the first byte that does not.
///
/// # Safety
/// `ptr` must be valid for reads of `prefix` bytes.
unsafe fn check_canary(
    ptr: *const u8,
    address: usize,
    size: usize,
    prefix: usize,
) -> Result<(), String> {
    let mut word = canary_start(address, size);
    let mut at = 0;
    if ptr.cast::<u64>().is_aligned() {
        // Up to the first word that differs, whose bytes the loop below compares.
        while prefix - at >= 8 {
            // SAFETY: bytes `at..at + 8` of the `prefix` at `ptr`, valid for reads (the
            // caller), and 8-aligned (`ptr` and `at` are multiples of 8).
            if unsafe { *ptr.wrapping_add(at).cast::<u64>() } != word.to_le() {
                break;
            }
            word = word.wrapping_add(CANARY_STEP);
            at += 8;
        }
    }
    while at < prefix {
        // SAFETY: byte `at < prefix` at `ptr`, valid for reads (the caller).
        if unsafe { *ptr.wrapping_add(at) } != canary_byte(word, at) {
            return Err(format!(
                "the object of {size} bytes made at {address:#x} lost its canary at byte {at} \
                 (of {prefix} checked, now at {ptr:?})"
            ));
        }
        at += 1;
        if at % 8 == 0 {
            word = word.wrapping_add(CANARY_STEP);
        }
    }
    Ok(())
}

/// The canary reads the same however its bytes lie: written at an 8-aligned address (a word at
/// a time) and copied to an odd one (checked a byte at a time), and the other way round; and a
/// changed byte is found, in a whole word or in the last partial one, at either alignment.
#[test]
fn a_canary_survives_a_move_and_names_the_byte_that_changed() {
    let mut aligned = vec![0u64; 40];
    let mut odd = vec![0u64; 41];
    let aligned = aligned.as_mut_ptr().cast::<u8>();
    // SAFETY: byte 1 of a buffer of 328 bytes.
    let odd = unsafe { odd.as_mut_ptr().cast::<u8>().add(1) };
    let (address, size) = (0x1234_5670usize, 317);
    for (first, second) in [(aligned, odd), (odd, aligned)] {
        // SAFETY: both buffers hold `size` bytes at these pointers, and do not overlap.
        unsafe {
            write_canary(first, address, size);
            assert_eq!(check_canary(first, address, size, size), Ok(()));
            std::ptr::copy_nonoverlapping(first, second, size);
            assert_eq!(check_canary(second, address, size, size), Ok(()));
            assert_eq!(check_canary(second, address, size, 100), Ok(()));
            assert!(check_canary(second, address + 8, size, size).is_err());
            for changed in [0, 7, 8, 123, 311, 312, 316] {
                *second.add(changed) ^= 0x10;
                let found = check_canary(second, address, size, size).unwrap_err();
                assert!(found.contains(&format!("at byte {changed} ")), "{found}");
                assert_eq!(check_canary(second, address, size, changed), Ok(()));
                *second.add(changed) ^= 0x10;
            }
        }
    }
}

/// A xorshift generator: the tests need cheap, not good, randomness.
struct Random(u64);

impl Random {
    fn seeded() -> Random {
        static NEXT: AtomicU64 = AtomicU64::new(0x2545_f491_4f6c_dd1d);
        Random(NEXT.fetch_add(0x9e37_79b9, Ordering::Relaxed) | 1)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n.max(1) as u64) as usize
    }

    /// A size in `1..=8192`, half of them small enough to be cached.
    fn size(&mut self) -> usize {
        if self.below(2) == 0 {
            1 + self.below(allocator::MAX_CACHED_SIZE)
        } else {
            1 + self.below(8192)
        }
    }

    /// An alignment in `1..=64`, mostly at most 16 (what the caches serve).
    fn align(&mut self) -> usize {
        1 << [0, 0, 1, 2, 3, 3, 3, 4, 4, 5, 6][self.below(11)]
    }

    /// A new size for an object of `old` bytes: half of the time on the other side of the
    /// cached limit.
    fn resize(&mut self, old: usize) -> usize {
        match (self.below(2), old <= allocator::MAX_CACHED_SIZE) {
            (0, _) => self.size(),
            (_, true) => {
                allocator::MAX_CACHED_SIZE + 1 + self.below(8192 - allocator::MAX_CACHED_SIZE)
            }
            (_, false) => 1 + self.below(allocator::MAX_CACHED_SIZE),
        }
    }
}

/// A heap under test, with canaried objects.
trait Heap: GlobalAlloc + Sync {
    /// The addresses its objects hold now, where the test keeps them (for a counted allocator).
    fn held(&self) -> Option<&Mutex<BTreeSet<usize>>> {
        None
    }

    /// Marks `ptr` held: fails if it is already, by an object not freed yet.
    fn hold(&self, ptr: *mut u8) {
        if let Some(held) = self.held() {
            let fresh = held.lock().unwrap().insert(ptr as usize);
            assert!(fresh, "{ptr:?} handed out while another object holds it");
        }
    }

    /// Marks `ptr` free again, before it is given back.
    fn unhold(&self, ptr: *mut u8) {
        if let Some(held) = self.held() {
            held.lock().unwrap().remove(&(ptr as usize));
        }
    }

    /// Allocates `layout` (zeroed if asked), checks the address and the zeros, writes the
    /// canary.
    fn make(&self, layout: Layout, zeroed: bool) -> Object {
        // SAFETY: the tests make no zero-sized layout.
        let ptr = unsafe {
            if zeroed {
                self.alloc_zeroed(layout)
            } else {
                self.alloc(layout)
            }
        };
        assert!(!ptr.is_null(), "allocation of {layout:?} failed");
        assert_eq!(ptr as usize % layout.align(), 0, "{ptr:?} for {layout:?}");
        self.hold(ptr);
        if zeroed {
            // SAFETY: the allocation just made, `layout.size()` bytes.
            let bytes = unsafe { std::slice::from_raw_parts(ptr, layout.size()) };
            if let Some(at) = bytes.iter().position(|&b| b != 0) {
                panic!(
                    "alloc_zeroed({layout:?}) at {ptr:?}: byte {at} is {:#x}",
                    bytes[at]
                );
            }
        }
        // SAFETY: as above.
        unsafe { write_canary(ptr, ptr as usize, layout.size()) };
        Object { ptr, layout }
    }

    /// Checks the canary and frees the object.
    fn free(&self, object: Object) {
        let Object { ptr, layout } = object;
        // SAFETY: a live object of `layout.size()` bytes.
        if let Err(why) = unsafe { check_canary(ptr, ptr as usize, layout.size(), layout.size()) } {
            panic!("before its free: {why}");
        }
        self.unhold(ptr);
        // SAFETY: allocated by this heap with `layout`, freed once (it is moved in).
        unsafe { self.dealloc(ptr, layout) };
    }

    /// Checks the canary, reallocates to `new_size`, checks that the bytes kept still hold the
    /// old canary, and writes the new one.
    fn resize(&self, object: &mut Object, new_size: usize) {
        let Object { ptr, layout } = *object;
        // SAFETY: a live object of `layout.size()` bytes.
        if let Err(why) = unsafe { check_canary(ptr, ptr as usize, layout.size(), layout.size()) } {
            panic!("before its realloc: {why}");
        }
        self.unhold(ptr);
        // SAFETY: allocated by this heap with `layout`; `new_size` is not zero and, rounded
        // to the alignment, far from overflowing.
        let moved = unsafe { self.realloc(ptr, layout, new_size) };
        assert!(
            !moved.is_null(),
            "realloc of {layout:?} to {new_size} failed"
        );
        assert_eq!(
            moved as usize % layout.align(),
            0,
            "realloc to {moved:?} for {layout:?}"
        );
        self.hold(moved);
        let kept = layout.size().min(new_size);
        // SAFETY: the new allocation holds at least `kept` bytes.
        if let Err(why) = unsafe { check_canary(moved, ptr as usize, layout.size(), kept) } {
            panic!("after a realloc to {new_size} bytes: {why}");
        }
        let layout = Layout::from_size_align(new_size, layout.align()).unwrap();
        // SAFETY: `new_size` bytes at `moved`.
        unsafe { write_canary(moved, moved as usize, new_size) };
        *object = Object { ptr: moved, layout };
    }
}

impl Heap for PerCpuAlloc {}

// --- an inner allocator that knows what is live -------------------------------------------

/// What a `CountingInner` knows, shared with the test so that it can be read after the
/// allocator (and the inner allocator with it) is dropped.
#[derive(Debug, Default)]
struct Ledger {
    live: Mutex<BTreeMap<usize, Layout>>,
    errors: Mutex<Vec<String>>,
    /// The addresses of the test's objects of the `PerCpuAlloc` over this inner allocator.
    held: Mutex<BTreeSet<usize>>,
}

impl Ledger {
    fn live(&self) -> BTreeMap<usize, Layout> {
        self.live.lock().unwrap().clone()
    }

    fn errors(&self) -> Vec<String> {
        self.errors.lock().unwrap().clone()
    }

    fn error(&self, what: String) {
        self.errors.lock().unwrap().push(what);
    }
}

/// An inner allocator (the system's) whose ledger holds every live allocation by address with
/// its layout. A free of an address it does not hold (lost track of, or freed twice), or with
/// another layout than its allocation's, is recorded as an error and not passed on: it never
/// unwinds out of an allocator.
#[derive(Debug, Default)]
struct CountingInner(Arc<Ledger>);

impl CountingInner {
    fn note(&self, ptr: *mut u8, layout: Layout) {
        if ptr.is_null() {
            return;
        }
        if let Some(old) = self.0.live.lock().unwrap().insert(ptr as usize, layout) {
            self.0.error(format!(
                "the system handed out {ptr:?} ({layout:?}) while it was live ({old:?})"
            ));
        }
    }
}

// SAFETY: every allocation comes from `System` and is freed there with its own layout; the
// ledger only refuses frees it cannot vouch for (leaking them).
unsafe impl GlobalAlloc for CountingInner {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, passed on.
        let ptr = unsafe { System.alloc(layout) };
        self.note(ptr, layout);
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, passed on.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        self.note(ptr, layout);
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let known = self.0.live.lock().unwrap().remove(&(ptr as usize));
        match known {
            Some(made) if made == layout => {
                // SAFETY: allocated here by `System` with `layout`, and live until now.
                unsafe { System.dealloc(ptr, layout) }
            }
            Some(made) => {
                self.0.error(format!(
                    "{ptr:?} freed as {layout:?}, allocated as {made:?}"
                ));
            }
            None => self.0.error(format!(
                "{ptr:?} ({layout:?}) freed, but it is not live (freed twice, or never made)"
            )),
        }
    }
}

/// A `PerCpuAlloc` over a `CountingInner`.
type Counted = PerCpuAlloc<CountingInner>;

/// Each object of a counted allocator is also marked held while the test holds it: an object
/// handed out while another holds it fails at once.
impl Heap for Counted {
    fn held(&self) -> Option<&Mutex<BTreeSet<usize>>> {
        Some(&self.inner().0.held)
    }
}

/// An allocator with a cap of `cache_bytes` per CPU over a `CountingInner`, and its ledger.
fn counted(cache_bytes: usize) -> (Counted, Arc<Ledger>) {
    let inner = CountingInner::default();
    let ledger = inner.0.clone();
    (
        PerCpuAlloc::with_inner(inner).with_cache_bytes(cache_bytes),
        ledger,
    )
}

/// Whether the class layouts (what cached objects are made with) include `layout`.
fn is_class_layout(layout: &Layout) -> bool {
    layout.align() == 16 && allocator::size_classes().contains(&layout.size())
}

/// After every object was freed and every cache released: the inner allocator holds nothing
/// (it holds only cached objects; the caches' own range is not its), and nothing went wrong in
/// it.
fn assert_nothing_lost(heap: &Counted, ledger: &Ledger) {
    assert_eq!(
        ledger.errors(),
        Vec::<String>::new(),
        "frees the inner allocator refused"
    );
    let stats = heap.stats();
    assert_eq!(stats.cached_bytes(), 0, "after release(): {stats:?}");
    let live = ledger.live();
    let objects: Vec<_> = live
        .iter()
        .filter(|(_, layout)| is_class_layout(layout))
        .collect();
    assert!(
        live.is_empty(),
        "after every free and release(), the inner allocator still holds {} allocations \
         ({} of them cached objects, e.g. {:?})",
        live.len(),
        objects.len(),
        live.first_key_value()
    );
}

/// Whether the caches are in use in this process: rseq, as the environment provides it.
fn caching() -> bool {
    common::registrar_from_environment() != thiscpu::Registrar::None
}

/// How long each storm runs: `THISCPU_TEST_ALLOC_STORM_MS`, else 2.5 s.
fn storm_duration() -> Duration {
    let ms = std::env::var("THISCPU_TEST_ALLOC_STORM_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .unwrap_or(2500);
    Duration::from_millis(ms)
}

// --- the storm ------------------------------------------------------------------------------

/// Counts what a storm did.
#[derive(Debug, Default)]
struct Tally {
    allocations: AtomicU64,
    frees: AtomicU64,
    reallocs: AtomicU64,
    handed_over: AtomicU64,
    short_threads: AtomicU64,
    migrations: AtomicU64,
    signals: AtomicU64,
}

impl Tally {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// Signals the storm's handler ran: it allocates nothing, and counts.
static HANDLED: AtomicU64 = AtomicU64::new(0);

extern "C" fn on_storm_signal(_: libc::c_int) {
    HANDLED.fetch_add(1, Ordering::Relaxed);
}

fn install_storm_handler() {
    // SAFETY: installs a handler that only adds to an atomic; SA_RESTART keeps the workers'
    // system calls going.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_storm_signal as extern "C" fn(libc::c_int) as usize;
        action.sa_flags = libc::SA_RESTART;
        assert_eq!(
            libc::sigaction(libc::SIGUSR1, &action, std::ptr::null_mut()),
            0
        );
    }
}

/// Objects any thread may take and free.
type Exchange = Mutex<Vec<Object>>;

/// One step of a worker over its live objects: make (sometimes zeroed), free, resize, hand
/// over to the exchange, or take from the exchange and free.
fn step<H: Heap>(
    heap: &H,
    rng: &mut Random,
    live: &mut Vec<Object>,
    exchange: &Exchange,
    tally: &Tally,
) {
    match rng.below(100) {
        0..40 if live.len() < 200 => {
            let layout = Layout::from_size_align(rng.size(), rng.align()).unwrap();
            live.push(heap.make(layout, rng.below(4) == 0));
            Tally::add(&tally.allocations, 1);
        }
        0..65 if !live.is_empty() => {
            let object = live.swap_remove(rng.below(live.len()));
            heap.free(object);
            Tally::add(&tally.frees, 1);
        }
        65..80 if !live.is_empty() => {
            let n = rng.below(live.len());
            let new_size = rng.resize(live[n].layout.size());
            heap.resize(&mut live[n], new_size);
            Tally::add(&tally.reallocs, 1);
        }
        80..90 if !live.is_empty() => {
            let object = live.swap_remove(rng.below(live.len()));
            exchange.lock().unwrap().push(object);
            Tally::add(&tally.handed_over, 1);
        }
        _ => {
            let taken = exchange.lock().unwrap().pop();
            if let Some(object) = taken {
                heap.free(object);
                Tally::add(&tally.frees, 1);
            }
        }
    }
}

/// The fewest allocations a storm must make before it ends.
const STORM_MIN_ALLOCATIONS: u64 = 100;

/// Runs the storm over `heap` for `duration` (longer on a slow machine, see
/// `STORM_MIN_ALLOCATIONS`): `workers` threads stepping at random, a thread that moves them
/// between the allowed CPUs and signals them, and a thread that starts short threads which
/// allocate, free and hand over. Everything made is freed before it returns. `watch` runs now
/// and then on the main thread while the storm lasts.
/// Sets its flags when dropped, by the end of a storm or by a panic's unwinding.
struct StopOnDrop<'a>([&'a AtomicBool; 2]);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        for flag in self.0 {
            flag.store(true, Ordering::Relaxed);
        }
    }
}

fn storm<H: Heap>(heap: &H, workers: usize, duration: Duration, mut watch: impl FnMut()) -> Tally {
    install_storm_handler();
    let tally = Tally::default();
    let exchange: Exchange = Mutex::new(Vec::new());
    let cpus = common::allowed_cpus();
    let tids: Mutex<Vec<libc::pid_t>> = Mutex::new(Vec::new());
    let workers_stop = AtomicBool::new(false);
    let storm_stop = AtomicBool::new(false);
    let signalled_before = HANDLED.load(Ordering::Relaxed);
    std::thread::scope(|s| {
        let mut threads = Vec::new();
        for _ in 0..workers {
            threads.push(s.spawn(|| {
                let mut rng = Random::seeded();
                let mut live = Vec::new();
                tids.lock().unwrap().push(common::gettid());
                while !workers_stop.load(Ordering::Relaxed) {
                    step(heap, &mut rng, &mut live, &exchange, &tally);
                }
                for object in live {
                    heap.free(object);
                }
            }));
        }
        // Moves and signals the workers, which stay alive until it has stopped.
        let disturber = s.spawn(|| {
            let mut rng = Random::seeded();
            while !storm_stop.load(Ordering::Relaxed) {
                let tid = {
                    let tids = tids.lock().unwrap();
                    if tids.is_empty() {
                        continue;
                    }
                    tids[rng.below(tids.len())]
                };
                let cpu = cpus[rng.below(cpus.len())];
                if common::set_affinity(tid, &common::Mask::of(&[cpu])).is_ok() {
                    Tally::add(&tally.migrations, 1);
                }
                if rng.below(2) == 0 {
                    // SAFETY: signals a worker of this process, alive until this thread
                    // stops; the handler only adds to an atomic.
                    if unsafe {
                        libc::syscall(libc::SYS_tgkill, libc::getpid(), tid, libc::SIGUSR1)
                    } == 0
                    {
                        Tally::add(&tally.signals, 1);
                    }
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        });
        // Short threads, one after another.
        let churner = s.spawn(|| {
            let mut rng = Random::seeded();
            while !storm_stop.load(Ordering::Relaxed) {
                let seed = rng.below(usize::MAX) as u64 | 1;
                std::thread::scope(|t| {
                    t.spawn(|| {
                        let mut rng = Random(seed);
                        let mut live = Vec::new();
                        for _ in 0..20 {
                            step(heap, &mut rng, &mut live, &exchange, &tally);
                        }
                        for object in live {
                            if rng.below(2) == 0 {
                                exchange.lock().unwrap().push(object);
                            } else {
                                heap.free(object);
                            }
                        }
                    });
                });
                Tally::add(&tally.short_threads, 1);
            }
        });
        // A slow guest may step the workers only a few dozen times in `duration`: the storm
        // then goes on until it has made `STORM_MIN_ALLOCATIONS`, for at most twenty times as
        // long, so that every test sees a storm worth the name.
        // A `watch` that panics stops every thread first, so that the test fails instead of
        // waiting at the end of the scope for threads that would never stop.
        let _stop_all = StopOnDrop([&storm_stop, &workers_stop]);
        let start = Instant::now();
        while start.elapsed() < duration
            || (tally.allocations.load(Ordering::Relaxed) < STORM_MIN_ALLOCATIONS
                && start.elapsed() < duration * 20)
        {
            watch();
            std::thread::sleep(Duration::from_millis(10));
        }
        storm_stop.store(true, Ordering::Relaxed);
        disturber.join().unwrap();
        churner.join().unwrap();
        workers_stop.store(true, Ordering::Relaxed);
        for thread in threads {
            thread.join().unwrap();
        }
    });
    for object in exchange.into_inner().unwrap() {
        heap.free(object);
    }
    let handled = HANDLED.load(Ordering::Relaxed) - signalled_before;
    eprintln!("{tally:?}; signals handled: {handled}");
    assert!(
        tally.allocations.load(Ordering::Relaxed) >= STORM_MIN_ALLOCATIONS,
        "{tally:?}"
    );
    tally
}

// --- the tests -------------------------------------------------------------------------------

/// The global allocator under the storm: every object keeps its canary, every address is
/// aligned, zeroed allocations are zeros, the capacities stay within the cap, and no CPU holds
/// more than its classes' most objects.
#[test]
fn the_storm_keeps_every_object_of_the_global_allocator_intact() {
    let _serial = common::serial();
    let cap = allocator::DEFAULT_CACHE_BYTES as u64;
    let mut most = 0;
    storm(&GLOBAL, 4, storm_duration(), || {
        let stats = GLOBAL.stats();
        assert!(stats.capacity_bytes <= cap, "{stats:?} above the cap {cap}");
        for cpu in &stats.per_cpu {
            assert!(
                cpu.cached_bytes <= stats.bound_bytes,
                "{cpu:?} above the bound {}",
                stats.bound_bytes
            );
            most = most.max(cpu.cached_bytes);
        }
    });
    let stats = GLOBAL.stats();
    eprintln!("most cached on a CPU: {most} bytes; {stats:?}");
    assert_eq!(stats.caching, caching(), "{stats:?}");
    if stats.caching {
        assert!(
            most > 0 && stats.misses() > 0,
            "the caches were never used: {stats:?}"
        );
    }
}

/// The same storm over an allocator whose inner allocator knows every live allocation, with a
/// small cap so that caches spill often: no object is lost, handed out while live, or freed
/// twice; after every free and `release()` the inner allocator holds nothing.
#[test]
fn the_storm_loses_and_duplicates_nothing_of_a_counted_allocator() {
    let _serial = common::serial();
    const CAP: usize = 16 << 10;
    let (heap, ledger) = counted(CAP);
    start_caches(&heap, &ledger);
    storm(&heap, 4, storm_duration(), || {
        let stats = heap.stats();
        assert!(
            stats.capacity_bytes <= CAP as u64,
            "{stats:?} above the cap {CAP}"
        );
        for cpu in &stats.per_cpu {
            assert!(
                cpu.cached_bytes <= stats.bound_bytes,
                "{cpu:?} above the bound {}",
                stats.bound_bytes
            );
        }
    });
    let stats = heap.stats();
    eprintln!("{stats:?}");
    if stats.caching {
        assert!(
            stats.spills() > 0,
            "a {CAP}-byte cap never spilled: {stats:?}"
        );
    }
    let released = heap.release().expect("release");
    eprintln!("released {released} bytes");
    assert_nothing_lost(&heap, &ledger);
}

/// Makes the caches (one object made and freed), releases them, and checks that the inner
/// allocator then holds nothing: the caches' range is not its.
fn start_caches(heap: &Counted, ledger: &Ledger) {
    heap.free(heap.make(Layout::from_size_align(24, 8).unwrap(), false));
    heap.release().expect("release");
    let live = ledger.live();
    assert!(
        live.is_empty(),
        "the inner allocator holds {} allocations after release(): {live:?}",
        live.len()
    );
}

/// Dropping an allocator gives every cached object back to the inner allocator.
#[test]
fn dropping_an_allocator_frees_everything_it_held() {
    let (heap, ledger) = counted(allocator::DEFAULT_CACHE_BYTES);
    let objects: Vec<_> = (0..100)
        .map(|n| heap.make(Layout::from_size_align(1 + n * 37, 8).unwrap(), false))
        .collect();
    for object in objects {
        heap.free(object);
    }
    let stats = heap.stats();
    if stats.caching {
        assert!(
            stats.cached_bytes() > 0,
            "freed objects were cached: {stats:?}"
        );
        assert!(!ledger.live().is_empty());
    }
    drop(heap);
    assert_eq!(ledger.errors(), Vec::<String>::new());
    let live = ledger.live();
    assert!(
        live.is_empty(),
        "the dropped allocator left {} allocations: {live:?}",
        live.len()
    );
}

/// Runs `body` on a new thread pinned to the CPU it starts on, and returns that CPU.
fn on_a_pinned_thread(body: impl FnOnce(u32) + Send) -> u32 {
    std::thread::scope(|s| {
        s.spawn(|| {
            let cpu = common::kernel_getcpu().0;
            common::pin(cpu);
            body(cpu);
            cpu
        })
        .join()
        .unwrap()
    })
}

/// The statistics on one pinned thread, exact: every allocation from an empty cache misses;
/// every freed object is cached, handed to a transfer list or given back (the inner
/// allocator holds exactly the first two), and the cache holds no more than its capacity,
/// itself within the cap; the cached objects come back as counted hits; `release()` returns the bytes
/// that were cached and leaves none. Without rseq, nothing is cached or counted.
#[test]
fn statistics_count_misses_spills_and_hits_within_the_cap() {
    const CAP: usize = 64 << 10;
    let (heap, ledger) = counted(CAP);
    let heap = heap.counting_hits();
    let layout = Layout::from_size_align(256, 8).unwrap();
    // What each such object occupies in a cache: its class's size.
    let class = *allocator::size_classes()
        .iter()
        .find(|&&size| size >= 256)
        .unwrap() as u64;
    on_a_pinned_thread(|cpu| {
        let objects: Vec<_> = (0..100).map(|_| heap.make(layout, false)).collect();
        let stats = heap.stats();
        eprintln!("after 100 allocations: {stats:?}");
        if !stats.caching {
            assert_eq!(
                (stats.misses(), stats.cached_bytes(), stats.hits()),
                (0, 0, Some(0)),
                "{stats:?}"
            );
            assert_eq!(
                ledger.live().len(),
                100,
                "every object from the inner allocator"
            );
            objects.into_iter().for_each(|object| heap.free(object));
            assert!(
                ledger.live().is_empty(),
                "every object back to the inner allocator"
            );
            return;
        }
        assert!(
            stats.capacity_bytes > 0 && stats.capacity_bytes <= CAP as u64,
            "{stats:?}"
        );
        let here = *of_cpu(&stats, cpu);
        assert_eq!(
            here.misses, 100,
            "an empty cache misses every time: {here:?}"
        );
        assert_eq!(
            (here.cached_bytes, here.spills, here.hits),
            (0, 0, Some(0)),
            "{here:?}"
        );
        objects.into_iter().for_each(|object| heap.free(object));
        let stats = heap.stats();
        let here = *of_cpu(&stats, cpu);
        eprintln!("after 100 frees: {here:?}");
        assert!(here.cached_objects > 0, "nothing cached: {here:?}");
        assert_eq!(
            ledger.live().len() as u64,
            here.cached_objects + stats.transfer_objects,
            "each freed object cached, handed to a transfer list, or given back: {stats:?}"
        );
        assert!(
            here.cached_objects == 100 || here.spills > 0,
            "a free that found no room spilled: {here:?}"
        );
        assert_eq!(here.cached_objects * class, here.cached_bytes, "{here:?}");
        assert!(
            here.cached_bytes <= stats.capacity_bytes,
            "{here:?} beyond {stats:?}"
        );
        let cached = here.cached_objects;
        let again: Vec<_> = (0..cached).map(|_| heap.make(layout, false)).collect();
        let here = *of_cpu(&heap.stats(), cpu);
        assert_eq!((here.hits, here.misses), (Some(cached), 100), "{here:?}");
        assert_eq!(here.cached_bytes, 0, "{here:?}");
        again.into_iter().for_each(|object| heap.free(object));
        let stats = heap.stats();
        let before = stats.cached_bytes();
        assert_eq!(before, cached * class + stats.transfer_bytes);
        let released = heap.release().expect("release");
        assert_eq!(
            released as u64, before,
            "release() returns the bytes it gave back"
        );
        assert_eq!(heap.stats().cached_bytes(), 0);
        assert_eq!(
            ledger.live().len(),
            0,
            "the inner allocator holds no object any more"
        );
    });
    assert_eq!(ledger.errors(), Vec::<String>::new());
    let default = PerCpuAlloc::new().stats();
    assert_eq!(
        default.hits(),
        None,
        "hits are not counted unless asked for: {default:?}"
    );
}

fn of_cpu(stats: &AllocStats, cpu: u32) -> &allocator::CpuAllocStats {
    stats
        .per_cpu
        .iter()
        .find(|c| c.cpu == cpu)
        .unwrap_or_else(|| panic!("no statistics for CPU {cpu}: {stats:?}"))
}

/// Layouts that the caches do not serve (larger than `MAX_CACHED_SIZE`, aligned beyond 16)
/// pass through to the inner allocator with their own size and alignment, raised to 16 when it
/// is smaller (the alignment of every cached object, so that `realloc` can move any object
/// through the inner allocator), and are never cached; cached ones reach it with their class's
/// layout (size class, aligned to 16).
#[test]
fn large_and_overaligned_objects_pass_through_with_their_layout() {
    let (heap, ledger) = counted(allocator::DEFAULT_CACHE_BYTES);
    let layouts = [
        Layout::from_size_align(allocator::MAX_CACHED_SIZE + 1, 8).unwrap(),
        Layout::from_size_align(64, 32).unwrap(),
        Layout::from_size_align(8, 64).unwrap(),
        Layout::from_size_align(1 << 20, 16).unwrap(),
    ];
    for layout in layouts {
        let object = heap.make(layout, false);
        let address = object.ptr as usize;
        let passed = Layout::from_size_align(layout.size(), layout.align().max(16)).unwrap();
        assert_eq!(ledger.live().get(&address), Some(&passed));
        heap.free(object);
        assert_eq!(ledger.live().get(&address), None, "{layout:?} kept");
    }
    assert_eq!(heap.stats().cached_bytes(), 0, "{:?}", heap.stats());
    for size in [1, 17, 100, 1000, allocator::MAX_CACHED_SIZE] {
        let object = heap.make(Layout::from_size_align(size, 4).unwrap(), false);
        let made = ledger.live().get(&(object.ptr as usize)).copied();
        let class = *allocator::size_classes()
            .iter()
            .find(|&&class| class >= size)
            .unwrap();
        assert_eq!(
            made,
            Some(Layout::from_size_align(class, 16).unwrap()),
            "{size} bytes"
        );
        heap.free(object);
    }
    assert_eq!(ledger.errors(), Vec::<String>::new());
}

/// `release_idle` leaves the cache of a CPU that was used since the previous call and releases
/// it at the next call without use in between.
#[test]
fn release_idle_releases_only_the_caches_of_idle_cpus() {
    let (heap, ledger) = counted(allocator::DEFAULT_CACHE_BYTES);
    let layout = Layout::from_size_align(100, 4).unwrap();
    let use_cpu = |cpu: u32| {
        std::thread::scope(|s| {
            s.spawn(|| {
                common::pin(cpu);
                let objects: Vec<_> = (0..10).map(|_| heap.make(layout, false)).collect();
                objects.into_iter().for_each(|object| heap.free(object));
            });
        })
    };
    let cpu = on_a_pinned_thread(|_| {});
    use_cpu(cpu);
    let cached = |heap: &Counted| of_cpu(&heap.stats(), cpu).cached_bytes;
    if !heap.stats().caching {
        assert_eq!(heap.release_idle().expect("release_idle"), 0);
        return;
    }
    assert!(cached(&heap) > 0);
    // Used since the allocator was made (or since the previous call): kept.
    let first = heap.release_idle().expect("release_idle");
    assert!(
        cached(&heap) > 0,
        "released a cache in use (returned {first})"
    );
    let before = cached(&heap);
    let second = heap.release_idle().expect("release_idle");
    assert_eq!(cached(&heap), 0, "an idle CPU's cache kept");
    assert!(
        second as u64 >= before,
        "returned {second}, {before} were cached"
    );
    use_cpu(cpu);
    assert!(heap.release_idle().expect("release_idle") == 0 || cached(&heap) > 0);
    assert!(
        cached(&heap) > 0,
        "released a cache used since the previous call"
    );
    heap.release_idle().expect("release_idle");
    assert_eq!(cached(&heap), 0);
    assert_eq!(ledger.errors(), Vec::<String>::new());
}

/// A thread pinned to one CPU runs allocation and free pairs without pause, keeping ten objects
/// cached there, while a thread on another CPU calls `release_idle` forty times: the busy CPU
/// never counts as idle, so its cache is never emptied. Pairs served from the cache change
/// neither the counts nor the tallies (hits are not counted), so only the watch mark tells
/// that CPU from an idle one.
#[test]
fn release_idle_keeps_the_cache_of_a_cpu_serving_pairs() {
    let _serial = common::serial();
    let (heap, ledger) = counted(allocator::DEFAULT_CACHE_BYTES);
    let cpus = common::allowed_cpus();
    let (cpu, watcher_cpu) = (cpus[0], cpus[cpus.len() - 1]);
    let layout = Layout::from_size_align(64, 8).unwrap();
    heap.free(heap.make(layout, false));
    if !heap.stats().caching {
        // Without rseq every call passes through: there is no cache to keep. (Under valgrind,
        // which runs one thread at a time, the looks would also wait for the busy thread's
        // time slices: minutes.)
        heap.release().expect("release");
        assert_nothing_lost(&heap, &ledger);
        return;
    }
    // Only the busy CPU caches anything from here on, so each look's bytes are its.
    heap.release().expect("release");
    let warm = AtomicBool::new(false);
    let stop = AtomicBool::new(false);
    let pairs = AtomicU64::new(0);
    let mut emptied = Vec::new();
    let mut quiet = 0;
    std::thread::scope(|s| {
        s.spawn(|| {
            common::pin(cpu);
            let objects: Vec<_> = (0..10).map(|_| heap.make(layout, false)).collect();
            objects.into_iter().for_each(|object| heap.free(object));
            warm.store(true, Ordering::Release);
            while !stop.load(Ordering::Relaxed) {
                heap.free(heap.make(layout, false));
                pairs.fetch_add(1, Ordering::SeqCst);
            }
        });
        while !warm.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
        common::pin(watcher_cpu);
        // The pairs counted when the previous look returned (its marks were set by then).
        let mut after_previous = pairs.load(Ordering::SeqCst);
        for look in 0..40 {
            std::thread::sleep(Duration::from_millis(2));
            let before = pairs.load(Ordering::SeqCst);
            let released = heap.release_idle().expect("release_idle");
            // The busy thread used its cache between the previous look's marks and this look
            // only if a whole pair began after the first: the pair after the one that was in
            // progress when `after_previous` was read. A look without one (the host ran
            // something else on that CPU meanwhile) may find the CPU idle, rightly.
            let used = before >= after_previous + 2;
            after_previous = pairs.load(Ordering::SeqCst);
            if !used {
                quiet += 1;
            } else if released > 0 {
                emptied.push((look, released));
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    let stats = heap.stats();
    eprintln!(
        "{} pairs, {quiet} looks without one; {stats:?}",
        pairs.load(Ordering::Relaxed)
    );
    assert!(
        emptied.is_empty(),
        "the cache of busy CPU {cpu} was emptied at {} of 40 looks (look, bytes released): \
         {emptied:?}",
        emptied.len()
    );
    if quiet == 0 {
        // The ten objects, less the one in the busy thread's hands at the end of a pair.
        assert!(of_cpu(&stats, cpu).cached_objects >= 9, "{stats:?}");
    }
    heap.release().expect("release");
    assert_nothing_lost(&heap, &ledger);
}

/// A CPU whose cache is left alone is still found idle: its cache is released by the second
/// look (the first only notes and marks it), or the third where another release cleared the
/// marks in between.
#[test]
fn release_idle_releases_an_idle_cpu_by_the_third_look() {
    let (heap, ledger) = counted(allocator::DEFAULT_CACHE_BYTES);
    let layout = Layout::from_size_align(64, 8).unwrap();
    let cpu = on_a_pinned_thread(|_| {
        let objects: Vec<_> = (0..10).map(|_| heap.make(layout, false)).collect();
        objects.into_iter().for_each(|object| heap.free(object));
    });
    if !heap.stats().caching {
        return;
    }
    let cached = |heap: &Counted| of_cpu(&heap.stats(), cpu).cached_bytes;
    assert!(cached(&heap) > 0);
    let looks = (1..=3)
        .find(|_| {
            heap.release_idle().expect("release_idle");
            cached(&heap) == 0
        })
        .unwrap_or_else(|| panic!("idle CPU {cpu} keeps its cache after three looks"));
    eprintln!("released at look {looks}");
    assert_nothing_lost(&heap, &ledger);
}

/// `release_cpu` of a CPU, over and over from another CPU, while threads pinned to it allocate,
/// realloc and free there: every object keeps its canary, none is lost, handed out twice or
/// freed twice.
#[test]
fn release_cpu_races_the_threads_of_that_cpu() {
    let _serial = common::serial();
    let (heap, ledger) = counted(64 << 10);
    start_caches(&heap, &ledger);
    let cpus = common::allowed_cpus();
    // The releaser runs on another CPU where there is one, so that its stop, fence and emptying
    // overlap sections in flight rather than preempt them.
    let (cpu, releaser_cpu) = (cpus[0], cpus[cpus.len() - 1]);
    let stop = AtomicBool::new(false);
    let exchange: Exchange = Mutex::new(Vec::new());
    let tally = Tally::default();
    let releases = AtomicU64::new(0);
    let released = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                common::pin(cpu);
                let mut rng = Random::seeded();
                let mut live = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    step(&heap, &mut rng, &mut live, &exchange, &tally);
                }
                live.into_iter().for_each(|object| heap.free(object));
            });
        }
        s.spawn(|| {
            common::pin(releaser_cpu);
            while !stop.load(Ordering::Relaxed) {
                let bytes = heap
                    .release_cpu(cpu)
                    .expect("release_cpu of an allowed CPU");
                releases.fetch_add(1, Ordering::Relaxed);
                released.fetch_add(bytes as u64, Ordering::Relaxed);
                if !heap.stats().caching {
                    // Nothing to race: leave the CPU to the others (valgrind runs one thread
                    // at a time).
                    std::thread::yield_now();
                }
            }
        });
        // With `--cfg thiscpu_inject`, delays inside every section widen the windows in which
        // a release meets a section in flight.
        #[cfg(thiscpu_inject)]
        (0..thiscpu::ops::inject::POINTS)
            .for_each(|point| thiscpu::ops::inject::set_delay(point, 20_000));
        std::thread::sleep(storm_duration().min(Duration::from_secs(2)));
        #[cfg(thiscpu_inject)]
        (0..thiscpu::ops::inject::POINTS)
            .for_each(|point| thiscpu::ops::inject::set_delay(point, 0));
        stop.store(true, Ordering::Relaxed);
    });
    for object in exchange.into_inner().unwrap() {
        heap.free(object);
    }
    eprintln!(
        "{tally:?}; {} releases gave back {} bytes; {:?}",
        releases.load(Ordering::Relaxed),
        released.load(Ordering::Relaxed),
        heap.stats()
    );
    if heap.stats().caching {
        assert!(releases.load(Ordering::Relaxed) > 0, "no release ran");
        // Not asserted: in an emulated guest (bookworm, 2 of 4 CPUs online) 414 releases gave
        // back nothing. Each release there keeps the CPU stopped long enough that 1,537 of its
        // 2,672 calls passed through, and the few objects cached in between were taken again
        // before the next release; the release after the storm (below) must empty the caches,
        // and that, with nothing lost or doubled, is what is asserted.
        if released.load(Ordering::Relaxed) == 0 {
            eprintln!("no release found anything cached");
        }
    }
    // Every thread has stopped: a release gives back exactly what the caches hold.
    let cached = heap.stats().cached_bytes();
    let given_back = heap.release().expect("release");
    assert_eq!(given_back as u64, cached, "{:?}", heap.stats());
    assert_nothing_lost(&heap, &ledger);
    if heap.stats().caching {
        assert_eq!(
            heap.release_cpu(u32::MAX),
            Err(allocator::ReleaseError::NoSuchCpu(u32::MAX))
        );
    }
}

/// How many short threads `a_hundred_thousand_short_threads` starts:
/// `THISCPU_TEST_ALLOC_THREADS`, else 100,000 (fewer where every thread is slow: under
/// valgrind, in emulated guests).
fn short_threads() -> u64 {
    std::env::var("THISCPU_TEST_ALLOC_THREADS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(100_000)
}

/// 100,000 threads, four at a time, each making a few objects, freeing some and leaving one to
/// its parent, which frees it: every canary intact. Bounded to 120 s, a limit on the test's
/// duration only.
#[test]
fn a_hundred_thousand_short_threads() {
    let _serial = common::serial();
    let limit = Duration::from_secs(120);
    let start = Instant::now();
    let started = AtomicU64::new(0);
    let total = short_threads();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let mut rng = Random::seeded();
                while started.fetch_add(1, Ordering::Relaxed) < total && start.elapsed() < limit {
                    let seed = rng.below(usize::MAX) as u64 | 1;
                    let left = std::thread::spawn(move || {
                        let mut rng = Random(seed);
                        let mut objects: Vec<Object> = (0..4)
                            .map(|_| {
                                let layout =
                                    Layout::from_size_align(1 + rng.below(512), 8).unwrap();
                                GLOBAL.make(layout, false)
                            })
                            .collect();
                        let left = objects.pop().unwrap();
                        objects.into_iter().for_each(|object| GLOBAL.free(object));
                        left
                    })
                    .join()
                    .unwrap();
                    GLOBAL.free(left);
                }
            });
        }
    });
    let done = started.load(Ordering::Relaxed).min(total);
    eprintln!(
        "{done} threads in {:?}; {:?}",
        start.elapsed(),
        GLOBAL.stats()
    );
    assert!(done == total || start.elapsed() >= limit);
}

/// How many objects each child of `fork_while_other_threads_allocate` makes.
const FORK_CHILD_OBJECTS: u64 = 120;

/// How many children `fork_while_other_threads_allocate` forks: `THISCPU_TEST_ALLOC_FORKS`,
/// else 40 (fewer in emulated guests, where each fork of the busy process took about a third of
/// a second of the test executable's time under qemu).
fn forks() -> u64 {
    std::env::var("THISCPU_TEST_ALLOC_FORKS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(40)
}

/// `fork` while other threads allocate and free and another releases one CPU's cache after
/// another: each child allocates, checks and frees through the global allocator, finds its
/// caches serving it on every CPU (not every call passed through), releases its caches,
/// allocates again, and exits 0 within 10 s.
#[test]
fn fork_while_other_threads_allocate() {
    let _serial = common::serial();
    let stop = AtomicBool::new(false);
    let exchange: Exchange = Mutex::new(Vec::new());
    let tally = Tally::default();
    let mut statuses = Vec::new();
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                let mut rng = Random::seeded();
                let mut live = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    step(&GLOBAL, &mut rng, &mut live, &exchange, &tally);
                }
                live.into_iter().for_each(|object| GLOBAL.free(object));
            });
        }
        // Releases one CPU's cache after another, without pause: a fork often lands in one.
        s.spawn(|| {
            let cpus = common::allowed_cpus();
            for n in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let _ = GLOBAL.release_cpu(cpus[n % cpus.len()]);
            }
        });
        for fork in 0..forks() {
            std::thread::sleep(Duration::from_millis(5));
            // SAFETY: the child only allocates and frees through the global allocator (whose
            // inner allocator, glibc's malloc, is fork-safe), and leaves with `_exit`.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
            if pid == 0 {
                let ok = std::panic::catch_unwind(|| {
                    let mut rng = Random(fork + 1);
                    let mut live = Vec::new();
                    let mut objects: Vec<Box<[u64]>> = Vec::new();
                    // About a hundred objects: at 2,000 the forty children took most of the
                    // executable's time (8.0 of 12 s on a 2-CPU host, with the guests'
                    // settings, when the canaries were still written a few bytes per call).
                    for n in 0..FORK_CHILD_OBJECTS {
                        let layout = Layout::from_size_align(rng.size(), rng.align()).unwrap();
                        live.push(GLOBAL.make(layout, n % 3 == 0));
                        if n % 2 == 0 {
                            let object = live.swap_remove(rng.below(live.len()));
                            GLOBAL.free(object);
                        }
                        objects.push(vec![n; n as usize % 64 + 1].into_boxed_slice());
                    }
                    live.into_iter().for_each(|object| GLOBAL.free(object));
                    let whole = objects
                        .iter()
                        .enumerate()
                        .all(|(n, o)| o.iter().all(|&v| v == n as u64));
                    // The child's caches serve it on every CPU: a cache that was being
                    // released at the fork must not stay stopped (every call passed through).
                    let mut caches_serve = true;
                    if GLOBAL.stats().caching {
                        let layout = Layout::from_size_align(64, 8).unwrap();
                        for cpu in common::allowed_cpus() {
                            common::pin(cpu);
                            let passed = |stats: AllocStats| of_cpu(&stats, cpu).passed_through;
                            let before = passed(GLOBAL.stats());
                            for _ in 0..100 {
                                GLOBAL.free(GLOBAL.make(layout, false));
                            }
                            caches_serve &= passed(GLOBAL.stats()) - before < 200;
                        }
                    }
                    // The child's caches are its own: it releases them, and allocates after.
                    let released = GLOBAL.release().is_ok();
                    drop(objects);
                    let after = GLOBAL.make(Layout::from_size_align(100, 8).unwrap(), false);
                    GLOBAL.free(after);
                    whole && caches_serve && released
                });
                // SAFETY: ends the child without running the parent's exit handlers.
                unsafe { libc::_exit(if matches!(ok, Ok(true)) { 0 } else { 1 }) };
            }
            let status = wait_for(pid, Duration::from_secs(10));
            statuses.push(status);
            if status != Some(0) {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    for object in exchange.into_inner().unwrap() {
        GLOBAL.free(object);
    }
    eprintln!("{tally:?}");
    for (fork, status) in statuses.into_iter().enumerate() {
        assert_eq!(
            status,
            Some(0),
            "child {fork}'s exit status (None: hung and killed; 1: a check failed)"
        );
    }
}

/// Waits up to `limit` for child `pid` and returns its exit status; kills it and returns `None`
/// if it does not end (or ends by a signal).
fn wait_for(pid: libc::pid_t, limit: Duration) -> Option<i32> {
    let start = Instant::now();
    let mut status = 0;
    loop {
        // SAFETY: waits for our own child without blocking.
        let ret = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if ret == pid {
            return libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
        }
        if start.elapsed() > limit {
            // SAFETY: kills and reaps our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return None;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Set in the environment of this test executable when a test runs it again.
const CHILD: &str = "THISCPU_TEST_ALLOC_CHILD";

/// With `THISCPU_RSEQ=off` (in a child) nothing is cached: every allocation passes through to
/// the inner allocator, and the storm keeps every canary.
#[test]
fn without_rseq_every_allocation_passes_through() {
    if std::env::var_os(CHILD).is_none() {
        let stderr = common::rerun_alone(
            "without_rseq_every_allocation_passes_through",
            &[
                (CHILD, "1"),
                ("THISCPU_RSEQ", "off"),
                ("THISCPU_TEST_ALLOC_STORM_MS", "500"),
            ],
            Duration::from_secs(60),
        );
        eprint!("{stderr}");
        return;
    }
    assert!(common::rseq_turned_off_by_env());
    storm(&GLOBAL, 2, storm_duration(), || {});
    let (heap, ledger) = counted(allocator::DEFAULT_CACHE_BYTES);
    let objects: Vec<_> = (0..100)
        .map(|n| heap.make(Layout::from_size_align(1 + n, 8).unwrap(), false))
        .collect();
    assert_eq!(
        ledger.live().len(),
        100,
        "every object from the inner allocator"
    );
    objects.into_iter().for_each(|object| heap.free(object));
    for stats in [GLOBAL.stats(), heap.stats()] {
        eprintln!("{stats:?}");
        assert!(!stats.caching, "{stats:?}");
        assert_eq!(stats.cached_bytes(), 0, "{stats:?}");
        assert_eq!((stats.misses(), stats.spills()), (0, 0), "{stats:?}");
    }
    assert_eq!(
        ledger.live().len(),
        0,
        "every object back to the inner allocator"
    );
    assert_eq!(ledger.errors(), Vec::<String>::new());
}

/// Objects made by thread-local destructors at thread exit, which another thread frees.
static FROM_DESTRUCTORS: Mutex<Vec<Object>> = Mutex::new(Vec::new());

/// Allocations, reallocs and frees in a thread's last moments: in the destructor of the first
/// thread-local it touched (so that it runs after the destructors of thread-locals touched
/// later, thiscpu's and std's included), in a thread-local destructor that this destructor
/// registers, and in a `pthread_key` destructor, which glibc runs after every thread-local
/// destructor. Each keeps objects alive for the main thread to check and free.
#[test]
fn threads_allocate_in_their_exit_destructors() {
    struct Last(u32);
    impl Drop for Last {
        fn drop(&mut self) {
            exit_work(self.0);
            if self.0 == 0 {
                LATER.with(|later| later.set(true));
            }
        }
    }
    struct Later(std::cell::Cell<bool>);
    impl Later {
        fn set(&self, value: bool) {
            self.0.set(value);
        }
    }
    impl Drop for Later {
        fn drop(&mut self) {
            if self.0.get() {
                exit_work(1);
            }
        }
    }
    thread_local! {
        static FIRST: std::cell::RefCell<Option<Last>> = const { std::cell::RefCell::new(None) };
        static LATER: Later = const { Later(std::cell::Cell::new(false)) };
        static LOCAL_VEC: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    extern "C" fn key_destructor(_: *mut libc::c_void) {
        exit_work(2);
    }
    let mut key: libc::pthread_key_t = 0;
    // SAFETY: creates a key with a destructor that runs in exiting threads.
    let created = unsafe { libc::pthread_key_create(&mut key, Some(key_destructor)) };
    assert_eq!(created, 0);
    let threads = 200;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|n| {
                s.spawn(move || {
                    // The first thread-local with a destructor this thread touches.
                    FIRST.with(|first| *first.borrow_mut() = Some(Last(0)));
                    LOCAL_VEC.with(|v| v.borrow_mut().extend(0..=255u8));
                    // SAFETY: a non-null value, so that the key's destructor runs at exit.
                    unsafe { libc::pthread_setspecific(key, std::ptr::dangling::<libc::c_void>()) };
                    let _ = thiscpu::current_cpu();
                    let object = GLOBAL.make(Layout::from_size_align(64 + n, 8).unwrap(), false);
                    GLOBAL.free(object);
                })
            })
            .collect();
        // `join` waits for the thread's exit, destructors included (the scope's end does not).
        handles
            .into_iter()
            .for_each(|handle| handle.join().unwrap());
    });
    // SAFETY: the key is no longer used.
    unsafe { libc::pthread_key_delete(key) };
    let objects = std::mem::take(&mut *FROM_DESTRUCTORS.lock().unwrap());
    assert_eq!(
        objects.len(),
        3 * threads * 2,
        "objects kept by the destructors"
    );
    objects.into_iter().for_each(|object| GLOBAL.free(object));
}

/// What each exit destructor does: makes, resizes across the cached limit and frees objects,
/// and keeps two of them for the main thread.
fn exit_work(which: u32) {
    let mut rng = Random(u64::from(which) * 7 + 1);
    let mut kept = Vec::new();
    for n in 0..20 {
        let mut object = GLOBAL.make(
            Layout::from_size_align(rng.size(), rng.align()).unwrap(),
            n % 5 == 0,
        );
        let new_size = rng.resize(object.layout.size());
        GLOBAL.resize(&mut object, new_size);
        if n % 10 == 0 {
            kept.push(object);
        } else {
            GLOBAL.free(object);
        }
    }
    FROM_DESTRUCTORS.lock().unwrap().extend(kept);
}

/// With `--cfg thiscpu_inject`: the storm over a counted allocator with a delay at every point
/// of every section, so that migrations, signals and `release_idle` land inside the pops and
/// pushes and abort them: nothing lost, handed out twice or freed twice.
#[cfg(thiscpu_inject)]
#[test]
fn the_storm_with_delays_inside_every_section_loses_nothing() {
    use thiscpu::ops::inject;
    let _serial = common::serial();
    const CAP: usize = 16 << 10;
    let (heap, ledger) = counted(CAP);
    start_caches(&heap, &ledger);
    let aborts = thiscpu::ops::aborts();
    (0..inject::POINTS).for_each(|point| inject::set_delay(point, 2000));
    storm(
        &heap,
        4,
        storm_duration().min(Duration::from_millis(1500)),
        || {
            let _ = heap.release_idle();
        },
    );
    (0..inject::POINTS).for_each(|point| inject::set_delay(point, 0));
    let aborted = thiscpu::ops::aborts() - aborts;
    eprintln!("{aborted} sections aborted; {:?}", heap.stats());
    if heap.stats().caching {
        assert!(aborted > 0, "no section was aborted");
    }
    heap.release().expect("release");
    assert_nothing_lost(&heap, &ledger);
}

/// Set in the environment of the re-executed test binary: the decision waits for first use
/// and raises this signal on the deciding thread halfway through (fault injection).
#[cfg(thiscpu_inject)]
const SIGNAL_IN_DECISION: &str = "THISCPU_INJECT_SIGNAL_IN_DECISION";

/// What the handler of the signal raised in the middle of the decision did: 0 not run, 1 ran
/// and its objects were whole, 2 an object was wrong.
#[cfg(thiscpu_inject)]
static IN_DECISION: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

#[cfg(thiscpu_inject)]
extern "C" fn allocate_in_decision(_: libc::c_int) {
    // The handler interrupts the decision, which runs inside the first allocation that asks
    // for it, outside the inner allocator: allocating here is what is tested.
    let mut ok = true;
    for size in [8, 100, 4000, 5000] {
        let layout = Layout::from_size_align(size, 8).unwrap();
        // SAFETY: a non-zero layout.
        let ptr = unsafe { GLOBAL.alloc(layout) };
        if ptr.is_null() {
            ok = false;
            continue;
        }
        // SAFETY: `size` bytes at `ptr`.
        unsafe {
            write_canary(ptr, ptr as usize, size);
            ok &= check_canary(ptr, ptr as usize, size, size).is_ok();
            GLOBAL.dealloc(ptr, layout);
        }
    }
    IN_DECISION.store(if ok { 1 } else { 2 }, Ordering::Relaxed);
}

/// Installs the handler before `main`, where nothing has allocated yet, when the test runs
/// itself again with the decision deferred.
#[cfg(thiscpu_inject)]
#[used]
#[unsafe(link_section = ".init_array")]
static INSTALL_BEFORE_MAIN: extern "C" fn() = install_before_main;

#[cfg(thiscpu_inject)]
extern "C" fn install_before_main() {
    // SAFETY: `getenv` with a NUL-terminated name; only the result's nullness is used.
    if unsafe { libc::getenv(c"THISCPU_INJECT_SIGNAL_IN_DECISION".as_ptr()) }.is_null() {
        return;
    }
    // SAFETY: installs a handler that allocates through the global allocator and stores to an
    // atomic.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = allocate_in_decision as extern "C" fn(libc::c_int) as usize;
        action.sa_flags = libc::SA_RESTART;
        libc::sigaction(libc::SIGUSR1, &action, std::ptr::null_mut());
    }
}

/// A signal handler that allocates and frees, run on the thread making the process's rseq
/// decision while it makes it (the decision deferred to its first use, which with this global
/// allocator is an allocation): its allocations pass through and are whole, and the process
/// then caches as the environment allows. With glibc's registration and with thiscpu's own.
#[cfg(thiscpu_inject)]
#[test]
fn a_signal_handler_allocates_during_the_first_decision() {
    if std::env::var_os(SIGNAL_IN_DECISION).is_some() {
        let source = thiscpu::source();
        eprintln!("after a signal during the decision: {source:?}");
        assert_eq!(
            IN_DECISION.load(Ordering::Relaxed),
            1,
            "the handler ran, its objects whole"
        );
        let objects: Vec<_> = (0..100)
            .map(|n| GLOBAL.make(Layout::from_size_align(8 + n, 8).unwrap(), false))
            .collect();
        objects.into_iter().for_each(|object| GLOBAL.free(object));
        let stats = GLOBAL.stats();
        eprintln!("{stats:?}");
        assert_eq!(stats.caching, caching(), "{stats:?}");
        return;
    }
    let signal = libc::SIGUSR1.to_string();
    for tunables in ["", "glibc.pthread.rseq=0"] {
        let stderr = common::rerun_alone(
            "a_signal_handler_allocates_during_the_first_decision",
            &[
                (SIGNAL_IN_DECISION, &signal),
                ("GLIBC_TUNABLES", tunables),
                ("THISCPU_RSEQ", "on"),
            ],
            Duration::from_secs(60),
        );
        eprint!("{stderr}");
    }
}
