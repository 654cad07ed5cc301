//! A model machine for the model checker: the restartable sequences, the CPU a thread runs on
//! and the `membarrier` fences, as loom steps, in builds with `RUSTFLAGS="--cfg thiscpu_model"`
//! only (`arch` then takes the sections, `field_at` and `active_field` from here instead of the
//! real architecture file, which still provides the rest of the contract).
//!
//! # The machine
//! [`cpus`] model CPUs (2 unless a test sets another number with [`set_cpus`]). Each model
//! thread runs on one of them: CPU 0 until it calls [`run_on`], which moves it (a migration).
//! Threads on one CPU run at the same time in the model, where the real CPU would run them
//! one after another; what the kernel does about that, the model does with a *generation* per
//! CPU, a counter kept under a loom mutex that also stands for "running on that CPU":
//! - a section starts by checking that its position's index is the thread's CPU (the real
//!   section's comparison of `cpu_id`), then bumps its CPU's generation and keeps the value:
//!   whatever section was in flight there has been preempted by this one;
//! - a thread arriving on a CPU ([`run_on`]) bumps the generation of the CPU it leaves and of
//!   the one it reaches;
//! - a fence of CPU `c` bumps `c`'s generation, a fence of every CPU bumps them all
//!   (`membarrier`);
//! - each store of a section (a slot, and the commit) is made under the CPU's mutex, and only
//!   if the generation is still the one the section started with; otherwise the section
//!   reports that it was aborted. Its loads are plain loom loads, each a step of its own.
//!
//! So loom lets a section commit, or be aborted, at every point before its commit, and lets
//! other CPUs' threads act between any two of its steps, as the kernel does. The mutex also
//! orders what happens on one CPU one after another (a context switch is a full barrier) and a
//! fence with the sections before and after it (membarrier's barriers on the target CPU). The
//! loads and stores of the sections use the orderings of the aarch64 file, the weaker of the
//! two architectures.
//!
//! Words that sections address are `crate::sync::atomic` atomics, reached back from the
//! pointers the sections are given (see that module).
//!
//! # The process
//! The rseq decision is not modelled: `process` (which `registration::decided` returns
//! under the model) says that thiscpu registers every thread, and `field_at` answers the
//! model CPU for `cpu_id` and `mm_cid`, so every model thread has a registered area and
//! `registration` never runs. `mm_cid` is never reported usable, so by-`mm_cid` types spread
//! by CPU. `membarrier` stands in for the system call of `fence` and succeeds unless a test
//! calls [`refuse_membarrier`]; then `fence::visit_cpu` runs the thread on the CPU it fences
//! (`visit`), as the real one does.
//! `futex_wait` and `futex_wake` stand in for `park`'s futex: a waiter sleeps until a
//! wake of its word, so a forgotten wake-up leaves it asleep, and loom reports the deadlock.

use super::{AreaOffset, Outcome, StackHead, StackOutcome};
use crate::abi::{self, offset};
use crate::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use core::cell::Cell;
use core::sync::atomic::AtomicUsize as PlainUsize;
use loom::sync::Mutex;

/// The most model CPUs a test may ask for.
pub const MAX_CPUS: usize = 4;

/// The number of model CPUs: the same for every execution of a test, so a plain atomic.
static CPUS: PlainUsize = PlainUsize::new(2);

/// One model CPU: its generation, under the lock that stands for running on it.
struct Cpu {
    generation: Mutex<u64>,
}

loom::lazy_static! {
    /// The model CPUs of the current execution (made anew for each one).
    static ref MACHINE: Vec<Cpu> = (0..MAX_CPUS).map(|_| Cpu { generation: Mutex::new(0) }).collect();
}

/// The futex of the model kernel: the threads asleep, each on the word at an address. A wait
/// that took the lock compared its word under it, so a wake that takes the lock after a change
/// to the word either finds the sleeper queued or was seen by its comparison.
struct Futex {
    sleepers: Vec<Sleeper>,
    tickets: u64,
}

/// A thread asleep on a word until a wake takes its ticket out of the queue.
struct Sleeper {
    word: usize,
    ticket: u64,
    thread: loom::thread::Thread,
}

/// The kernel's side of the model machine (made anew for each execution).
struct Kernel {
    futex: Mutex<Futex>,
    /// Whether `membarrier` refuses fences now (see [`refuse_membarrier`]): a plain atomic,
    /// since the kernel's filter is not memory that the protocols order.
    fences_refused: core::sync::atomic::AtomicBool,
}

loom::lazy_static! {
    static ref KERNEL: Kernel = Kernel {
        futex: Mutex::new(Futex { sleepers: Vec::new(), tickets: 0 }),
        fences_refused: core::sync::atomic::AtomicBool::new(false),
    };
}

loom::thread_local! {
    /// The model CPU the calling model thread runs on.
    static HERE: Cell<u32> = Cell::new(0);
}

/// Runs `body` under loom in every interleaving within the preemption bound (3, unless
/// `LOOM_MAX_PREEMPTIONS` sets another), then prints how many it explored and how long that
/// took: the model tests' one entry point.
pub fn explore(name: &str, body: impl Fn() + Send + Sync + 'static) {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
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

/// Sets the number of model CPUs (1 to [`MAX_CPUS`]): what `topology::possible_cpus` reports,
/// so set it before making a `Sharded` or a `Pool`.
pub fn set_cpus(count: usize) {
    assert!(
        (1..=MAX_CPUS).contains(&count),
        "1 to {MAX_CPUS} model CPUs"
    );
    CPUS.store(count, core::sync::atomic::Ordering::Relaxed);
}

/// The number of model CPUs.
pub fn cpus() -> usize {
    CPUS.load(core::sync::atomic::Ordering::Relaxed)
}

/// The model CPU the calling thread runs on.
pub fn current() -> u32 {
    HERE.with(Cell::get)
}

/// Moves the calling thread to model CPU `cpu`: a section it starts later at a position read
/// before aborts, and its arrival preempts whatever section runs there.
pub fn run_on(cpu: u32) {
    assert!((cpu as usize) < cpus(), "model CPU {cpu} does not exist");
    bump(current());
    HERE.with(|here| here.set(cpu));
    bump(cpu);
}

/// Ends every section in flight on `cpu`: preemption, a signal, or a fence.
fn bump(cpu: u32) {
    *lock(cpu) += 1;
}

fn lock(cpu: u32) -> loom::sync::MutexGuard<'static, u64> {
    MACHINE[cpu as usize]
        .generation
        .lock()
        .expect("no model thread panics while it holds a CPU")
}

/// From now on in this execution, `membarrier` refuses fences with `EPERM`, as under a seccomp
/// filter installed after start-up: objects made before keep their mode, and their writers
/// fence by visiting every CPU ([`visit`]). Registering still succeeds (the process registered
/// once, before).
pub fn refuse_membarrier() {
    KERNEL
        .fences_refused
        .store(true, core::sync::atomic::Ordering::Relaxed);
}

/// The `membarrier` system call of `fence`: registering succeeds, a fence of one CPU (beyond
/// the model CPUs: none, as for an offline CPU) or of every CPU ends the sections in flight
/// there unless [`refuse_membarrier`] was called, anything else is refused with `EINVAL`.
/// Returns what the system call would.
pub(crate) fn membarrier(cmd: i32, flags: u32, cpu: i32) -> Result<(), i32> {
    if cmd == abi::MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ
        && KERNEL
            .fences_refused
            .load(core::sync::atomic::Ordering::Relaxed)
    {
        return Err(libc::EPERM);
    }
    match (cmd, flags) {
        (abi::MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ, 0) => Ok(()),
        (abi::MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ, abi::MEMBARRIER_CMD_FLAG_CPU) => {
            if (0..cpus() as i32).contains(&cpu) {
                bump(cpu as u32);
            }
            Ok(())
        }
        (abi::MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ, 0) => {
            (0..cpus() as u32).for_each(bump);
            Ok(())
        }
        _ => Err(libc::EINVAL),
    }
}

/// `fence::visit_cpu`: the calling thread runs on `cpu` for a moment, then back where it was,
/// which is all a visit guarantees: the arrival preempts the section in flight there (it aborts)
/// and, with the CPU's lock, orders the visitor's earlier stores before what the CPU runs next.
/// A CPU beyond the model's needs no visit (the kernel's `EINVAL`, which the visit takes as
/// done).
pub(crate) fn visit(cpu: u32) {
    if cpu as usize >= cpus() {
        return;
    }
    let home = current();
    run_on(cpu);
    run_on(home);
}

/// `FUTEX_WAIT`: sleeps while `word` holds `expected`, until a `futex_wake` of the word
/// takes this thread out of the queue. The real call also returns on a signal; the model's
/// never returns unwoken, since such a return would hide a wake-up the protocol forgot: a
/// thread that nobody wakes stays asleep for ever, which loom reports as a deadlock.
pub(crate) fn futex_wait(word: &crate::sync::atomic::AtomicU32, expected: u32) {
    let ticket = {
        let mut futex = lock_futex();
        // Relaxed, as the kernel reads it: the lock, which wakes take too, is what orders this
        // comparison with a change made before a wake.
        if word.load(Ordering::Relaxed) != expected {
            return;
        }
        let ticket = futex.tickets;
        futex.tickets += 1;
        futex.sleepers.push(Sleeper {
            word: address(word),
            ticket,
            thread: loom::thread::current(),
        });
        ticket
    };
    loop {
        loom::thread::park();
        if !lock_futex().sleepers.iter().any(|s| s.ticket == ticket) {
            return;
        }
    }
}

/// `FUTEX_WAKE`: wakes up to `count` threads asleep on `word`, the longest asleep first.
pub(crate) fn futex_wake(word: &crate::sync::atomic::AtomicU32, count: i32) {
    let word = address(word);
    let mut futex = lock_futex();
    let mut woken = 0;
    futex.sleepers.retain(|sleeper| {
        if sleeper.word != word || woken >= count {
            return true;
        }
        woken += 1;
        sleeper.thread.unpark();
        false
    });
}

fn address(word: &crate::sync::atomic::AtomicU32) -> usize {
    core::ptr::from_ref(word).addr()
}

fn lock_futex() -> loom::sync::MutexGuard<'static, Futex> {
    KERNEL
        .futex
        .lock()
        .expect("no model thread panics in the futex")
}

/// The area's field `FIELD`: the model CPU for `cpu_id` and `mm_cid`, the real area's field
/// otherwise.
pub(crate) fn field_at<const FIELD: usize>(area: AreaOffset) -> i32 {
    if FIELD == offset::CPU_ID || FIELD == offset::MM_CID {
        current() as i32
    } else {
        super::imp::field_at::<FIELD>(area)
    }
}

/// The active area's field `FIELD`, as [`field_at`] answers it: `current_cpu()` (the atomic
/// mode's rows, the fallbacks) must see the model CPU too, not the CPU that runs the test.
pub(crate) fn active_field<const FIELD: usize>() -> i32 {
    field_at::<FIELD>(super::imp::area_offset())
}

/// A section in flight: the CPU it started on and that CPU's generation then.
struct Section {
    cpu: u32,
    generation: u64,
}

impl Section {
    /// Starts a section positioned at `index`: `None` (aborted) if the thread is not on that
    /// CPU any more.
    fn start(index: u32) -> Option<Section> {
        let cpu = current();
        if index != cpu {
            return None;
        }
        let mut generation = lock(cpu);
        *generation += 1;
        Some(Section {
            cpu,
            generation: *generation,
        })
    }

    /// Makes one of the section's stores, unless the section was preempted, migrated or fenced
    /// since it started: then nothing is stored and the section is over (`false`).
    ///
    /// The sections store with `swap`, whose result they ignore: loom orders a plain store
    /// only after the stores its thread has seen, so a later load could still return an older
    /// read-modify-write of another thread (a take-over's) as the newest value, which no
    /// hardware does (each location's stores have one order, and a read-modify-write's value
    /// directly follows the value it read). A swap is ordered after every earlier store.
    fn store(&self, store: impl FnOnce()) -> bool {
        let generation = lock(self.cpu);
        if *generation != self.generation {
            return false;
        }
        store();
        true
    }
}

/// The atomic at `word`, a pointer from `crate::sync::atomic`'s `as_ptr`.
///
/// # Safety
/// As for `AtomicU64::from_ptr`.
unsafe fn word64<'a>(word: *mut u64) -> &'a AtomicU64 {
    // SAFETY: forwarded contract.
    unsafe { AtomicU64::from_ptr(word) }
}

/// See `ops::load_add_store`.
///
/// # Safety
/// As for the architecture file's, with `v` from `AtomicU64::as_ptr` of `crate::sync`.
pub(crate) unsafe fn load_add_store<const FIELD: usize>(
    _area: AreaOffset,
    index: u32,
    v: *mut u64,
    count: u64,
) -> Outcome {
    let Some(section) = Section::start(index) else {
        return Outcome::Aborted;
    };
    // SAFETY: the caller's contract.
    let v = unsafe { word64(v) };
    let sum = v.load(Ordering::Relaxed).wrapping_add(count);
    if section.store(|| {
        v.swap(sum, Ordering::Relaxed);
    }) {
        Outcome::Committed(())
    } else {
        Outcome::Aborted
    }
}

/// See `ops::load_cbne_store`: the commit is a store-release.
///
/// # Safety
/// As for the architecture file's, with `v` from `AtomicU64::as_ptr` of `crate::sync`.
pub(crate) unsafe fn load_cbne_store<const FIELD: usize>(
    _area: AreaOffset,
    index: u32,
    v: *mut u64,
    expect: u64,
    newv: u64,
) -> Outcome {
    let Some(section) = Section::start(index) else {
        return Outcome::Aborted;
    };
    // SAFETY: the caller's contract.
    let v = unsafe { word64(v) };
    if v.load(Ordering::Relaxed) != expect {
        return Outcome::Mismatch;
    }
    if section.store(|| {
        v.swap(newv, Ordering::Release);
    }) {
        Outcome::Committed(())
    } else {
        Outcome::Aborted
    }
}

/// See `ops::load_cbeq_load_store`.
///
/// # Safety
/// As for the architecture file's, with `head` and every node's `next` field (at byte offset
/// `NEXT`) `crate::sync` `AtomicUsize`s, `head` from their `as_ptr`.
pub(crate) unsafe fn load_cbeq_load_store<const FIELD: usize, const NEXT: usize>(
    _area: AreaOffset,
    index: u32,
    head: *mut usize,
    out: *mut usize,
) -> Outcome {
    let Some(section) = Section::start(index) else {
        return Outcome::Aborted;
    };
    // SAFETY: the caller's contract.
    let head = unsafe { AtomicUsize::from_ptr(head) };
    let first = head.load(Ordering::Acquire);
    if first == 0 {
        return Outcome::Mismatch;
    }
    // SAFETY: a non-null head is a live node whose `next` field is at `NEXT` (contract).
    let next =
        unsafe { AtomicUsize::from_ptr((first + NEXT) as *mut usize) }.load(Ordering::Relaxed);
    // SAFETY: `out` is valid for a pointer write (contract); only committed pops read it.
    unsafe { out.write(first) };
    if section.store(|| {
        head.swap(next, Ordering::Relaxed);
    }) {
        Outcome::Committed(())
    } else {
        Outcome::Aborted
    }
}

/// The `n`th slot of a stack whose slots start at `slots`.
///
/// # Safety
/// `slots` came from the `as_ptr` of the first of at least `n + 1` consecutive
/// `crate::sync` `AtomicUsize`s.
unsafe fn slot<'a>(slots: *const usize, n: u64) -> &'a AtomicUsize {
    // SAFETY: the caller's contract.
    unsafe { &*slots.cast::<AtomicUsize>().add(n as usize) }
}

/// See `ops::stack_push`: `stopped` is loaded with acquire, the commit is a store-release.
///
/// # Safety
/// As for the architecture file's, with the slots `crate::sync` `AtomicUsize`s.
pub(crate) unsafe fn stack_push<const FIELD: usize>(
    _area: AreaOffset,
    index: u32,
    head: *const StackHead,
    slots: *mut usize,
    capacity: u64,
    item: usize,
) -> StackOutcome {
    let Some(section) = Section::start(index) else {
        return StackOutcome::Aborted;
    };
    // SAFETY: the caller's contract: `head` is a live stack head.
    let head = unsafe { &*head };
    if head.stopped.load(Ordering::Acquire) != 0 {
        return StackOutcome::Stopped;
    }
    let n = head.count.load(Ordering::Relaxed);
    if n >= capacity {
        return StackOutcome::Refused;
    }
    // SAFETY: `n < capacity`, and the slots hold `capacity` atomics (contract).
    let slot = unsafe { slot(slots, n) };
    if section.store(|| {
        slot.swap(item, Ordering::Relaxed);
    }) && section.store(|| {
        head.count.swap(n + 1, Ordering::Release);
    }) {
        StackOutcome::Committed
    } else {
        StackOutcome::Aborted
    }
}

/// See `ops::stack_pop`: `stopped` is loaded with acquire, the commit is a plain store.
///
/// # Safety
/// As for [`stack_push`].
pub(crate) unsafe fn stack_pop<const FIELD: usize>(
    _area: AreaOffset,
    index: u32,
    head: *const StackHead,
    slots: *const usize,
) -> (StackOutcome, usize) {
    let Some(section) = Section::start(index) else {
        return (StackOutcome::Aborted, 0);
    };
    // SAFETY: the caller's contract: `head` is a live stack head.
    let head = unsafe { &*head };
    if head.stopped.load(Ordering::Acquire) != 0 {
        return (StackOutcome::Stopped, 0);
    }
    let n = head.count.load(Ordering::Relaxed);
    if n == 0 {
        return (StackOutcome::Refused, 0);
    }
    // SAFETY: a count is at most the capacity, the number of slots (contract).
    let item = unsafe { slot(slots, n - 1) }.load(Ordering::Relaxed);
    if section.store(|| {
        head.count.swap(n - 1, Ordering::Relaxed);
    }) {
        (StackOutcome::Committed, item)
    } else {
        (StackOutcome::Aborted, 0)
    }
}

/// See `ops::stack_pop_batch`: as [`stack_pop`], with the top `k = min(count, max)` slots
/// copied out to the caller's buffer before the commit.
///
/// # Safety
/// As for [`stack_push`]; `out` is valid for `max` writes and only the calling thread uses it.
pub(crate) unsafe fn stack_pop_batch<const FIELD: usize>(
    _area: AreaOffset,
    index: u32,
    head: *const StackHead,
    slots: *const usize,
    out: *mut usize,
    max: usize,
) -> (StackOutcome, usize) {
    if max == 0 {
        return (StackOutcome::Committed, 0);
    }
    let Some(section) = Section::start(index) else {
        return (StackOutcome::Aborted, 0);
    };
    // SAFETY: the caller's contract: `head` is a live stack head.
    let head = unsafe { &*head };
    if head.stopped.load(Ordering::Acquire) != 0 {
        return (StackOutcome::Stopped, 0);
    }
    let n = head.count.load(Ordering::Relaxed);
    if n == 0 {
        return (StackOutcome::Refused, 0);
    }
    let k = (n as usize).min(max);
    let from = n - k as u64;
    for j in 0..k {
        // SAFETY: `from + j < n`, at most the capacity, the number of slots (contract).
        let item = unsafe { slot(slots, from + j as u64) }.load(Ordering::Relaxed);
        // SAFETY: `j < max`, and `out` is the caller's for `max` writes.
        unsafe { out.add(j).write(item) };
    }
    if section.store(|| {
        head.count.swap(from, Ordering::Relaxed);
    }) {
        (StackOutcome::Committed, k)
    } else {
        (StackOutcome::Aborted, 0)
    }
}

/// See `ops::stack_push_batch`: as [`stack_push`], with the last `k = min(capacity - count,
/// len)` items stored beyond the count, one store each, before the commit.
///
/// # Safety
/// As for [`stack_push`]; `items` is valid for `len` reads.
pub(crate) unsafe fn stack_push_batch<const FIELD: usize>(
    _area: AreaOffset,
    index: u32,
    head: *const StackHead,
    slots: *mut usize,
    capacity: u64,
    items: *const usize,
    len: usize,
) -> (StackOutcome, usize) {
    if len == 0 {
        return (StackOutcome::Committed, 0);
    }
    let Some(section) = Section::start(index) else {
        return (StackOutcome::Aborted, 0);
    };
    // SAFETY: the caller's contract: `head` is a live stack head.
    let head = unsafe { &*head };
    if head.stopped.load(Ordering::Acquire) != 0 {
        return (StackOutcome::Stopped, 0);
    }
    let n = head.count.load(Ordering::Relaxed);
    if n >= capacity {
        return (StackOutcome::Refused, 0);
    }
    let k = ((capacity - n) as usize).min(len);
    for j in 0..k {
        // SAFETY: `len - k + j < len`, and `items` is valid for `len` reads (contract).
        let item = unsafe { items.add(len - k + j).read() };
        // SAFETY: `n + j < capacity`, and the slots hold `capacity` atomics (contract).
        let slot = unsafe { slot(slots, n + j as u64) };
        if !section.store(|| {
            slot.swap(item, Ordering::Relaxed);
        }) {
            return (StackOutcome::Aborted, 0);
        }
    }
    if section.store(|| {
        head.count.swap(n + k as u64, Ordering::Release);
    }) {
        (StackOutcome::Committed, k)
    } else {
        (StackOutcome::Aborted, 0)
    }
}

/// See `ops::stack_pop_here`: the model's CPU, read before a section that checks it, as the
/// architecture files' sections read it inside themselves.
///
/// # Safety
/// As for the architecture file's, with the slots `crate::sync` `AtomicUsize`s.
pub(crate) unsafe fn stack_pop_here(
    area: AreaOffset,
    cpus: u64,
    shift: u32,
    head: *const StackHead,
    slots: *const usize,
) -> usize {
    let cpu = field_at::<{ offset::CPU_ID }>(area);
    if cpu < 0 || cpu as u64 >= cpus {
        return 0;
    }
    let at = (cpu as usize) << shift;
    // SAFETY: CPU `cpu`'s stack, below `cpus` (the caller's contract).
    match unsafe {
        stack_pop::<{ offset::CPU_ID }>(
            area,
            cpu as u32,
            head.wrapping_byte_add(at),
            slots.wrapping_byte_add(at),
        )
    } {
        (StackOutcome::Committed, item) => item,
        _ => 0,
    }
}

/// See `ops::stack_push_here`, and [`stack_pop_here`].
///
/// # Safety
/// As for the architecture file's, with the slots `crate::sync` `AtomicUsize`s.
pub(crate) unsafe fn stack_push_here(
    area: AreaOffset,
    cpus: u64,
    shift: u32,
    head: *const StackHead,
    slots: *mut usize,
    capacity: u64,
    item: usize,
) -> StackOutcome {
    let cpu = field_at::<{ offset::CPU_ID }>(area);
    if cpu < 0 || cpu as u64 >= cpus {
        return StackOutcome::Aborted;
    }
    let at = (cpu as usize) << shift;
    // SAFETY: CPU `cpu`'s stack, below `cpus` (the caller's contract).
    unsafe {
        stack_push::<{ offset::CPU_ID }>(
            area,
            cpu as u32,
            head.wrapping_byte_add(at),
            slots.wrapping_byte_add(at),
            capacity,
            item,
        )
    }
}
