//! `Sharded<T>`: one `T` per possible CPU (or per `mm_cid`), taken on the current CPU by a
//! restartable sequence instead of a `lock`-prefixed instruction.
//!
//! # The protocol
//! Each shard is a lock word and a `T`, alone on their cache lines. The word is `FREE` (0), or
//! holds the *token* of the thread that holds the shard: a number drawn once per thread from a
//! process-wide count, unique among every thread the process ever had and never 0.
//!
//! - **Taking the current CPU's shard** is one restartable sequence on that CPU
//!   ([`ops::load_cbne_store`]): compare the shard's word with `FREE`, leave if it differs,
//!   store the token as the commit. Plain load and store: no atomic read-modify-write. An
//!   acquire fence after the commit orders the holder's accesses to `T` after it (free on
//!   x86_64; a `dmb ishld` on aarch64, where the section's load is a plain `ldr`).
//! - **Releasing** is one store of `FREE` with release ordering, from whatever CPU the holder
//!   runs on by then. While the word holds a token no section commits on it (every section
//!   compares it with `FREE` first), so nothing races that store.
//! - **Two holders never meet.** Two sections on one CPU cannot interleave: the kernel aborts
//!   a section whose thread is preempted, migrated or signalled before its commit, and a
//!   section compares the CPU it was positioned for before it starts. For shards indexed by
//!   `mm_cid` the same holds because no two threads run with one concurrency id at once.
//!
//! # A holder that is preempted or migrates
//! It keeps the shard: the token stays in the word until its guard is dropped, wherever the
//! thread runs then. A thread that finds the current shard taken (its section leaves at the
//! comparison) backs off: it spins a little (the holder is most often a thread that migrated
//! away and is finishing), then yields its CPU a few times (the holder is most often a thread
//! preempted on this very CPU, which the yield lets run), then sleeps for growing periods, from
//! 10 µs up to 1 ms. It never spins for long, and it notices a release at most about 1 ms
//! late. No waiter queue: releasing stays a single store. A thread that finds its own token
//! in the word (it takes a shard it already holds) panics instead of waiting forever.
//!
//! # Readers and threads without rseq: taking a shard from another CPU
//! Another CPU's sections write the lock word with plain stores, so a thread elsewhere cannot
//! simply compare-and-swap it: a section that read `FREE` just before the swap would commit
//! over it. It uses the pool's drain protocol instead ([`crate::fence::take_over`]): swap the
//! word from `FREE` to its own token, fence the shard's CPU with `membarrier` (every CPU
//! running this process's threads, for shards indexed by `mm_cid`), then check the word still
//! holds its token; if a section committed in between, that section's thread holds the shard
//! and the reader backs off as above and tries again. The fence costs a few microseconds (an
//! inter-processor interrupt when a thread of the process runs on that CPU), so readers visiting
//! every shard ([`Sharded::for_each`], [`Sharded::fold`]) pay that per possible CPU. A thread
//! that has no rseq while the rest of the process has (one made by a raw `clone`, or whose own
//! registration was refused) takes the shard of the CPU it reads from the fallback the same way.
//! So does a thread on a CPU (or with a concurrency id) at or beyond the shard count, which
//! counted the possible CPUs at construction and can fall short where `/sys` is unreadable:
//! it shares shard `index % len` with that shard's own CPU.
//!
//! # When `membarrier` is refused after construction
//! A sandbox may install a seccomp filter on every thread after the shards began to be taken
//! by sections. The sections keep writing the lock words with plain stores, so a take from
//! another CPU still needs a fence: it then fences by running on the shard's CPU for a moment
//! ([`crate::fence::take_over_by_visiting`]; on every CPU for shards indexed by `mm_cid`), two
//! migrations per CPU instead of an interrupt. Where the thread cannot run there either
//! (`sched_setaffinity` refused too, or its affinity changed under it again and again), the
//! take panics with a message naming both refusals: it can neither wait for ever nor take the
//! shard unsafely. Only takes from another CPU are concerned ([`Sharded::lock`],
//! [`Sharded::for_each`], [`Sharded::fold`], and [`Sharded::lock_current`] in a thread without
//! rseq or beyond the shard count); the current CPU's shard is still taken by a section.
//!
//! # Without rseq or without fences
//! Where the process has no rseq (old kernel, valgrind, `THISCPU_RSEQ=off`), or `membarrier`
//! is refused when the `Sharded` is made (kernels before 5.10, seccomp,
//! `THISCPU_MEMBARRIER=off`, without which readers could not take a shard cheaply), it decides
//! at construction to take shards with a compare-and-swap of the same word, `FREE` to the
//! token, on the shard of the CPU the fallback reports: the same API and guarantees, at the
//! cost of an atomic read-modify-write per take.
//! [`Sharded::uses_rseq`] says which.
//!
//! # A panic inside the closure
//! No poisoning: unwinding drops the guard, which releases the shard, and `T` stays as the
//! closure left it, as with `parking_lot`'s mutex. A `T` whose invariants a panic can break
//! should restore them itself (or the program should abort on panic).
//!
//! # Costs, and when not to use it
//! - Memory: one shard of at least 128 bytes (`T` and the word, rounded up to 128) per
//!   possible CPU, whatever the number of threads; `T`'s own heap memory per shard that was
//!   used.
//! - Reads visit every shard and fence each one: use it where writes are frequent and reads
//!   rare (statistics, caches, free lists), not where every operation needs the total.
//! - The shards are not a snapshot of one instant: a fold sees shard 0 at one moment and the
//!   last shard later.
//! - A closure that blocks (I/O, a lock, a long computation) keeps its CPU's shard held: the
//!   next thread on that CPU waits, sleeping, until it ends. Keep closures short.
//! - Waiting is not fair: a waiter (a reader above all, whose take costs a fence) can be
//!   overtaken again and again by threads that take the shard without pause.
//! - Not async-signal-safe: a signal handler taking the shard its thread holds panics.
//! - A thread taking a shard it already holds (a nested `with_current`, `lock_current` or
//!   `lock`) panics rather than wait for itself.
//! - A guard leaked with `mem::forget` keeps its shard held for good; after `fork` in a
//!   multi-threaded program, shards held by other threads stay held in the child.
//!
//! # Safety
//! The module runs [`ops::load_cbne_store`] on the shards' lock words and hands out `&mut T`
//! to the holder of a shard; each block states why it holds.

use crate::fence;
use crate::ops::{self, ByCpu, ByMmCid, Outcome, Position, Spread};
use crate::percpu::CachePadded;
use crate::registration::{self, Registrar};
use crate::sync::atomic::{self, AtomicU64, Ordering};
use crate::topology;
use core::cell::UnsafeCell;
use core::marker::PhantomData;
use std::time::Duration;

/// The lock word of a shard nobody holds.
const FREE: u64 = 0;

/// One shard: the lock word and the value.
struct Shard<T> {
    lock: AtomicU64,
    value: UnsafeCell<T>,
}

// The token words are `core`'s even under the model checker: each is one thread's, and
// their `new` must be `const`.
crate::sync::thread_local! {
    /// This thread's token, drawn on its first take; `FREE` until then.
    static TOKEN: core::sync::atomic::AtomicU64 = const { core::sync::atomic::AtomicU64::new(FREE) };
}

/// The next token to draw. A 64-bit count never wraps: tokens are unique for the life of the
/// process, so a shard left held by a thread that exited (its guard leaked) never looks like a
/// later thread's own shard.
static NEXT_TOKEN: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(FREE + 1);

/// The calling thread's token if it has drawn one, else `FREE`: one thread-local load, for the
/// fast path, which leaves the first take of a thread to the slow path.
#[inline(always)]
fn drawn_token() -> u64 {
    TOKEN.with(|token| token.load(Ordering::Relaxed))
}

/// The calling thread's token: unique among every thread the process ever had, never `FREE`.
fn token() -> u64 {
    let token = drawn_token();
    if token != FREE { token } else { draw_token() }
}

#[cold]
#[inline(never)]
fn draw_token() -> u64 {
    let drawn = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
    // A signal handler that interrupted this thread between the draw and here may have set a
    // token already; keep that one, so the thread never changes token.
    TOKEN.with(|token| {
        match token.compare_exchange(FREE, drawn, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => drawn,
            Err(set) => set,
        }
    })
}

/// What one try of the slow path of [`Sharded::lock_current`] came to.
enum Step<'a, T> {
    Taken(ShardGuard<'a, T>),
    /// The section was aborted: try again at once.
    Retry,
    /// Shard `index` is held by another thread (or by this one: a nested take).
    Held(u32),
}

/// Waiting for a shard another thread holds: spin, then yield, then sleep.
struct Backoff {
    step: u32,
}

impl Backoff {
    const SPINS: u32 = 6;
    const YIELDS: u32 = 6;

    fn new() -> Backoff {
        Backoff { step: 0 }
    }

    fn wait(&mut self) {
        if cfg!(thiscpu_model) {
            // The model runs one thread at a time and has no clock: let the holder go on.
            return crate::sync::yield_now();
        }
        self.step = self.step.saturating_add(1);
        if self.step <= Self::SPINS {
            for _ in 0..(4u32 << self.step) {
                core::hint::spin_loop();
            }
        } else if self.step <= Self::SPINS + Self::YIELDS {
            std::thread::yield_now();
        } else {
            let doublings = (self.step - Self::SPINS - Self::YIELDS - 1).min(7);
            std::thread::sleep(
                Duration::from_micros(10 << doublings).min(Duration::from_millis(1)),
            );
        }
    }
}

/// One `T` per possible CPU (or per concurrency id, [`Sharded::by_mm_cid`]); a thread takes the
/// shard of the CPU it runs on with a restartable sequence (no lock prefix), updates it, and
/// gives it back with one store. Readers visit every shard.
///
/// - [`with_current`](Sharded::with_current) and [`lock_current`](Sharded::lock_current) take
///   the current CPU's shard; a thread that finds it held (its holder was preempted or moved
///   away) waits, spinning briefly, then yielding, then sleeping.
/// - [`lock`](Sharded::lock), [`for_each`](Sharded::for_each) and [`fold`](Sharded::fold) take
///   any shard from any thread, with a `membarrier` fence per shard;
///   [`iter_mut`](Sharded::iter_mut), [`get_mut`](Sharded::get_mut) and
///   [`into_inner`](Sharded::into_inner) need no lock at all.
/// - No poisoning: a panic inside the closure releases the shard (see the module's
///   documentation for the protocol, costs, and when not to use it).
///
/// ```
/// use std::collections::HashMap;
/// let seen: thiscpu::Sharded<HashMap<u64, u64>> = thiscpu::Sharded::default();
/// std::thread::scope(|s| {
///     for t in 0..4u64 {
///         let seen = &seen;
///         s.spawn(move || {
///             for i in 0..1000 {
///                 seen.with_current(|map| *map.entry(i % 10).or_default() += t);
///             }
///         });
///     }
/// });
/// let total = seen.fold(0, |sum, map| sum + map.values().sum::<u64>());
/// assert_eq!(total, 1000 * (0 + 1 + 2 + 3));
/// ```
pub struct Sharded<T, S: Spread = ByCpu> {
    shards: Box<[CachePadded<Shard<T>>]>,
    /// Shards are taken by restartable sequences (else by compare-and-swap).
    rseq: bool,
    /// Shards are indexed by `mm_cid` (only when `S` is `ByMmCid` and the kernel has it).
    by_mm_cid: bool,
    spread: PhantomData<S>,
}

// SAFETY: a `Sharded` owns its values; sending it sends them.
unsafe impl<T: Send, S: Spread> Send for Sharded<T, S> {}
// SAFETY: through `&Sharded` a value is reached only by the one thread holding its shard (the
// lock word says which), as with `Mutex<T>`, which is `Sync` for `T: Send`.
unsafe impl<T: Send, S: Spread> Sync for Sharded<T, S> {}

impl<T: Default> Default for Sharded<T, ByCpu> {
    fn default() -> Self {
        Sharded::new(|_| T::default())
    }
}

impl<T> Sharded<T, ByCpu> {
    /// One shard per possible CPU, `init(cpu)` giving each value.
    ///
    /// ```
    /// let sums = thiscpu::Sharded::new(|_cpu| 0u64);
    /// sums.with_current(|sum| *sum += 5);
    /// assert_eq!(sums.fold(0, |total, sum| total + sum), 5);
    /// ```
    #[must_use]
    pub fn new(init: impl FnMut(u32) -> T) -> Self {
        Sharded::build(init)
    }
}

impl<T> Sharded<T, ByMmCid> {
    /// One shard per possible concurrency id, indexed by `mm_cid` (Linux 6.3+), so the shards
    /// in use follow the threads running at once rather than the CPUs. Where the kernel has no
    /// `mm_cid`, shards are indexed by CPU. Readers fence every CPU per shard, not one.
    ///
    /// ```
    /// let hits = thiscpu::Sharded::by_mm_cid(|_| 0u64);
    /// hits.with_current(|n| *n += 1);
    /// assert_eq!(hits.fold(0, |total, n| total + n), 1);
    /// ```
    #[must_use]
    pub fn by_mm_cid(init: impl FnMut(u32) -> T) -> Self {
        Sharded::build(init)
    }
}

impl<T, S: Spread> Sharded<T, S> {
    fn build(init: impl FnMut(u32) -> T) -> Self {
        Sharded::with_shards(topology::possible_cpus(), init)
    }

    /// `shards` shards (at least one), whatever the number of CPUs: what a process whose
    /// possible CPUs were undercounted gets, so that tests can make CPUs beyond the shards.
    fn with_shards(shards: usize, mut init: impl FnMut(u32) -> T) -> Self {
        // CPU ids come from /sys as u32s, so every one below the count fits in a u32.
        let shards = (0..shards.max(1))
            .map(|index| {
                CachePadded(Shard {
                    lock: AtomicU64::new(FREE),
                    value: UnsafeCell::new(init(index as u32)),
                })
            })
            .collect();
        // Readers need fences to take a shard from sections; registering for them once here
        // keeps that system call (which may wait for an RCU grace period) off the first read.
        let rseq = registration::decided()
            .is_some_and(|process| process.rseq.registrar != Registrar::None)
            && fence::available();
        Sharded {
            shards,
            rseq,
            by_mm_cid: rseq
                && S::FIELD == ByMmCid::FIELD
                && registration::decided().is_some_and(|process| process.rseq.mm_cid_usable()),
            spread: PhantomData,
        }
    }

    /// Number of shards: the number of possible CPUs.
    ///
    /// ```
    /// let s = thiscpu::Sharded::new(|_| ());
    /// assert_eq!(s.len(), thiscpu::topology::possible_cpus());
    /// ```
    #[inline]
    #[must_use]
    pub fn len(&self) -> usize {
        self.shards.len()
    }

    /// Always false: there is at least one shard.
    #[inline]
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    /// Whether shards are taken with restartable sequences (`false`: with compare-and-swap,
    /// where rseq or `membarrier` is missing).
    ///
    /// ```
    /// let s = thiscpu::Sharded::new(|_| 0u8);
    /// if thiscpu::source().registrar == thiscpu::Registrar::None {
    ///     assert!(!s.uses_rseq());
    /// }
    /// ```
    #[must_use]
    pub fn uses_rseq(&self) -> bool {
        self.rseq
    }

    /// Whether shards are indexed by `mm_cid` (a [`Sharded::by_mm_cid`] on a kernel that
    /// provides it, with rseq); otherwise by CPU.
    #[must_use]
    pub fn indexed_by_mm_cid(&self) -> bool {
        self.by_mm_cid
    }

    /// Runs `f` on the current CPU's shard, held for the duration of the call.
    ///
    /// Panics if the calling thread already holds that shard (a nested call), or where it must
    /// take the shard from another CPU and can fence it neither with `membarrier` nor by
    /// running there (see the module's documentation).
    ///
    /// ```
    /// let counts = thiscpu::Sharded::new(|_| [0u64; 4]);
    /// let old = counts.with_current(|c| {
    ///     c[1] += 1;
    ///     c[1] - 1
    /// });
    /// assert_eq!(old, 0);
    /// ```
    #[inline]
    pub fn with_current<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let mut guard = self.lock_current();
        f(&mut guard)
    }

    /// Takes the current CPU's shard until the guard is dropped. The thread may migrate while
    /// it holds the guard; the shard stays its own, and other threads on the shard's CPU wait.
    /// Keep the guard briefly.
    ///
    /// Panics as [`with_current`](Sharded::with_current) does.
    ///
    /// ```
    /// let lists = thiscpu::Sharded::new(|_| Vec::<u32>::new());
    /// let mut mine = lists.lock_current();
    /// mine.push(7);
    /// let index = mine.index();
    /// drop(mine);
    /// assert_eq!(*lists.lock(index).unwrap(), [7]);
    /// ```
    #[inline]
    #[must_use = "the shard is released as soon as the guard is dropped"]
    pub fn lock_current(&self) -> ShardGuard<'_, T> {
        let token = drawn_token();
        // A section must not store `FREE`: a thread's first take draws its token on the slow
        // path.
        if self.rseq && token != FREE {
            let taken = if S::FIELD == ByMmCid::FIELD && self.by_mm_cid {
                ops::mm_cid_position().and_then(|at| self.try_section(at, token).ok())
            } else {
                ops::position().and_then(|at| self.try_section(at, token).ok())
            };
            if let Some(guard) = taken {
                return guard;
            }
        }
        self.lock_current_slow()
    }

    /// One restartable take of the shard at `at`: the section's outcome if it did not commit
    /// (`Mismatch` also for an index beyond the shards, where no section may run).
    #[inline(always)]
    fn try_section<By: Spread>(
        &self,
        at: Position<By>,
        token: u64,
    ) -> Result<ShardGuard<'_, T>, Outcome> {
        let index = at.index();
        let Some(shard) = self.shards.get(index as usize) else {
            return Err(Outcome::Mismatch);
        };
        // SAFETY: `at` was just read by this thread; the word is an aligned `u64` that lives as
        // long as `self`. Shards are indexed by `By` for the whole life of `self` (decided at
        // construction), so sections commit on this word only from `index`'s CPU (or
        // concurrency id), one at a time. Every other write to it is atomic and happens while
        // no section can commit there: takers (`fence::take_over` or
        // `fence::take_over_by_visiting`, after their fence) and the release store, made while
        // the word holds a token that every section's comparison rejects.
        let outcome = unsafe { ops::load_cbne_store(at, shard.lock.as_ptr(), FREE, token) };
        if outcome == Outcome::Committed(()) {
            // The section's load is the acquiring read of the last release.
            atomic::fence(Ordering::Acquire);
            return Ok(ShardGuard::new(shard, index));
        }
        if outcome == Outcome::Aborted {
            ops::note_abort();
        }
        Err(outcome)
    }

    #[cold]
    #[inline(never)]
    fn lock_current_slow(&self) -> ShardGuard<'_, T> {
        let token = token();
        let mut backoff = Backoff::new();
        let mut aborts = ops::AbortRun::new();
        loop {
            let step = if !self.rseq {
                self.take_step(self.fallback_index(), token)
            } else if S::FIELD == ByMmCid::FIELD && self.by_mm_cid {
                self.step_at(ops::mm_cid_position(), token, &mut aborts)
            } else {
                self.step_at(ops::position(), token, &mut aborts)
            };
            match step {
                Step::Taken(guard) => return guard,
                Step::Retry => {}
                Step::Held(index) => {
                    self.check_not_held_by(index, token);
                    backoff.wait();
                }
            }
        }
    }

    /// One try at the current shard with rseq, from `at`, the thread's position (`None` for a
    /// thread without rseq).
    fn step_at<By: Spread>(
        &self,
        at: Option<Position<By>>,
        token: u64,
        aborts: &mut ops::AbortRun,
    ) -> Step<'_, T> {
        let Some(at) = at else {
            // No rseq on this thread (made by a raw `clone`, or its registration was refused):
            // the shard of the CPU the fallback reports, taken as readers take one.
            return self.take_step(self.fallback_index(), token);
        };
        let index = at.index();
        let shards = self.shards.len() as u32;
        if index >= shards {
            // A CPU (or concurrency id) beyond the shards, which counted the possible CPUs at
            // construction (an undercount where /sys could not be read). No section runs for
            // it: share shard `index % shards` as readers do, which is correct from any CPU.
            return self.take_step(index % shards, token);
        }
        match self.try_section(at, token) {
            Ok(guard) => Step::Taken(guard),
            Err(Outcome::Aborted) if !aborts.gives_up() => Step::Retry,
            // Interrupted at every instruction: take it as readers do.
            Err(Outcome::Aborted) => self.take_step(index, token),
            // The section left at the comparison: contention, not an abort.
            Err(_) => Step::Held(index),
        }
    }

    fn take_step(&self, index: u32, token: u64) -> Step<'_, T> {
        match self.take(index, token) {
            Some(guard) => Step::Taken(guard),
            None => Step::Held(index),
        }
    }

    /// The shard for the CPU the fallback reports (without rseq).
    fn fallback_index(&self) -> u32 {
        crate::cpu::current_cpu() % self.shards.len() as u32
    }

    fn check_not_held_by(&self, index: u32, token: u64) {
        if self.shards[index as usize].lock.load(Ordering::Relaxed) == token {
            panic!("thiscpu::Sharded: this thread already holds shard {index} (a nested take)");
        }
    }

    /// One try at taking shard `index` (in range) from any thread: a fenced take-over with
    /// rseq, a compare-and-swap without. `None` if the shard is held.
    fn take(&self, index: u32, token: u64) -> Option<ShardGuard<'_, T>> {
        let shard = &self.shards[index as usize];
        if !self.rseq {
            shard
                .lock
                .compare_exchange(FREE, token, Ordering::Acquire, Ordering::Relaxed)
                .ok()?;
            return Some(ShardGuard::new(shard, index));
        }
        let cpu = (!self.by_mm_cid).then_some(index);
        // Concurrent take-overs of one word are told apart by their tokens, so they need no
        // lock.
        let taken = match fence::take_over(cpu, &shard.lock, FREE, token) {
            Ok(taken) => taken,
            Err(refused) => Self::take_by_visiting(cpu, shard, index, token, refused),
        }?;
        // The guard releases with the same store of FREE, with release ordering.
        core::mem::forget(taken);
        Some(ShardGuard::new(shard, index))
    }

    /// The take-over of [`take`](Sharded::take) where `membarrier` is refused now although it
    /// worked at construction (a seccomp filter installed since): the sections still write the
    /// word with plain stores, so the fence is made by running on the shard's CPU (on every CPU
    /// for shards indexed by `mm_cid`). Panics where this thread cannot run there.
    #[cold]
    #[inline(never)]
    fn take_by_visiting<'a>(
        cpu: Option<u32>,
        shard: &'a Shard<T>,
        index: u32,
        token: u64,
        refused: fence::FenceUnavailable,
    ) -> Option<fence::TakenOver<'a>> {
        match fence::take_over_by_visiting(cpu, &shard.lock, FREE, token) {
            Ok(taken) => taken,
            Err(visit) => panic!(
                "thiscpu::Sharded: cannot take shard {index} safely: {refused}, and this \
                 thread cannot fence by running on the CPU instead: {visit}"
            ),
        }
    }

    /// Takes shard `index` (a CPU, or a concurrency id for [`Sharded::by_mm_cid`]) from any
    /// thread, waiting while another thread holds it; `None` if there is no such shard. With
    /// rseq this fences the shard's CPU (a few microseconds).
    ///
    /// Panics if the calling thread already holds that shard, or where `membarrier` was
    /// refused after construction and this thread cannot run on the shard's CPU to fence it
    /// (see the module's documentation). [`for_each`](Sharded::for_each) and
    /// [`fold`](Sharded::fold) panic in the same cases.
    ///
    /// ```
    /// let s = thiscpu::Sharded::new(|cpu| cpu);
    /// assert_eq!(*s.lock(0).unwrap(), 0);
    /// assert!(s.lock(s.len() as u32).is_none());
    /// ```
    pub fn lock(&self, index: u32) -> Option<ShardGuard<'_, T>> {
        if index as usize >= self.len() {
            return None;
        }
        let token = token();
        let mut backoff = Backoff::new();
        loop {
            if let Some(guard) = self.take(index, token) {
                return Some(guard);
            }
            self.check_not_held_by(index, token);
            backoff.wait();
        }
    }

    /// Calls `f` with each shard's index and value, taking the shards one at a time (see
    /// [`lock`](Sharded::lock)), while other threads keep using them.
    ///
    /// ```
    /// let s = thiscpu::Sharded::new(|_| 0u64);
    /// s.with_current(|n| *n += 2);
    /// s.for_each(|_, n| *n *= 10);
    /// assert_eq!(s.fold(0, |total, n| total + n), 20);
    /// ```
    pub fn for_each(&self, mut f: impl FnMut(u32, &mut T)) {
        for index in 0..self.len() as u32 {
            if let Some(mut guard) = self.lock(index) {
                f(index, &mut guard);
            }
        }
    }

    /// Folds over every shard, taking them one at a time: not a snapshot of one instant.
    ///
    /// ```
    /// let s = thiscpu::Sharded::new(|_| 1u64);
    /// assert_eq!(s.fold(0, |total, one| total + one), s.len() as u64);
    /// ```
    pub fn fold<B>(&self, init: B, mut f: impl FnMut(B, &T) -> B) -> B {
        let mut acc = init;
        for index in 0..self.len() as u32 {
            if let Some(guard) = self.lock(index) {
                acc = f(acc, &guard);
            }
        }
        acc
    }

    /// Shard `index`'s value, without locking: `&mut self` excludes every other access.
    ///
    /// ```
    /// let mut s = thiscpu::Sharded::new(|cpu| cpu);
    /// *s.get_mut(0).unwrap() += 10;
    /// assert_eq!(*s.lock(0).unwrap(), 10);
    /// ```
    #[must_use]
    pub fn get_mut(&mut self, index: u32) -> Option<&mut T> {
        self.shards
            .get_mut(index as usize)
            .map(|shard| shard.0.value.get_mut())
    }

    /// Every shard's value, in index order, without locking.
    ///
    /// ```
    /// let mut s = thiscpu::Sharded::new(|_| 0u32);
    /// s.iter_mut().for_each(|n| *n = 3);
    /// assert_eq!(s.fold(0, |total, n| total + n), 3 * s.len() as u32);
    /// ```
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.shards.iter_mut().map(|shard| shard.0.value.get_mut())
    }

    /// The values, in index order.
    ///
    /// ```
    /// let s = thiscpu::Sharded::new(|cpu| cpu);
    /// assert_eq!(s.into_inner(), (0..thiscpu::topology::possible_cpus() as u32).collect::<Vec<_>>());
    /// ```
    pub fn into_inner(self) -> Vec<T> {
        self.shards
            .into_vec()
            .into_iter()
            .map(|shard| shard.0.value.into_inner())
            .collect()
    }
}

/// The shape of the shards, never their values, even for `T: Debug` (where [`PerCpu`]'s
/// `Debug` lists its values): a value may be read only by the thread holding its shard, and
/// taking every shard from inside `Debug` would wait for each holder (for ever if it is the
/// formatting thread's own, as in a `dbg!` inside [`with_current`](Sharded::with_current),
/// where a take panics instead), fence every CPU, and panic where `membarrier` and
/// `sched_setaffinity` are both refused. A one-try take would not avoid the fences or the
/// panic. To see the values, take them explicitly: [`fold`](Sharded::fold) or
/// [`for_each`](Sharded::for_each) from `&self`, [`iter_mut`](Sharded::iter_mut) (no lock at
/// all) from `&mut self`.
///
/// ```
/// let mut s = thiscpu::Sharded::new(|_| 7u64);
/// let debug = format!("{s:?}");
/// assert!(debug.starts_with("Sharded { shards: "), "{debug}");
/// let values: Vec<u64> = s.iter_mut().map(|v| *v).collect();
/// assert!(values.iter().all(|&v| v == 7));
/// ```
///
/// [`PerCpu`]: crate::PerCpu
impl<T, S: Spread> core::fmt::Debug for Sharded<T, S> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Sharded")
            .field("shards", &self.len())
            .field("uses_rseq", &self.rseq)
            .field("indexed_by_mm_cid", &self.by_mm_cid)
            .finish_non_exhaustive()
    }
}

/// A shard of a [`Sharded`] held by the calling thread; dereferences to its value and releases
/// it when dropped (one store, from whatever CPU the thread is on). Not `Send`: the shard's
/// word names the thread that holds it.
#[must_use = "the shard is released as soon as the guard is dropped"]
pub struct ShardGuard<'a, T> {
    shard: &'a Shard<T>,
    index: u32,
    not_send: PhantomData<*const ()>,
}

// SAFETY: sharing the guard shares only `&T` (as `MutexGuard` does, for `T: Sync`).
unsafe impl<T: Sync> Sync for ShardGuard<'_, T> {}

impl<'a, T> ShardGuard<'a, T> {
    #[inline(always)]
    fn new(shard: &'a Shard<T>, index: u32) -> Self {
        ShardGuard {
            shard,
            index,
            not_send: PhantomData,
        }
    }

    /// The shard's index: the CPU (or concurrency id) it belongs to.
    #[inline]
    #[must_use]
    pub fn index(&self) -> u32 {
        self.index
    }
}

impl<T> core::ops::Deref for ShardGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard holds the shard (its word holds our token), so no other reference
        // to the value exists until it is dropped.
        unsafe { &*self.shard.value.get() }
    }
}

impl<T> core::ops::DerefMut for ShardGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference the guard gives.
        unsafe { &mut *self.shard.value.get() }
    }
}

impl<T> Drop for ShardGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        // Pairs with the acquiring read of the next holder (a section's load and its fence,
        // a take-over's swap, or a compare-and-swap).
        self.shard.lock.store(FREE, Ordering::Release);
    }
}

impl<T: core::fmt::Debug> core::fmt::Debug for ShardGuard<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ShardGuard")
            .field("index", &self.index)
            .field("value", &**self)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    #[cfg(thiscpu_linux)]
    use std::sync::{Arc, Barrier};

    #[test]
    fn debug_takes_no_shard_even_from_inside_a_held_one() {
        let sharded = Sharded::new(|_| 0u64);
        let debug = sharded.with_current(|value| {
            *value += 1;
            format!("{sharded:?}")
        });
        assert!(debug.starts_with("Sharded { shards: "), "{debug}");
        // Every shard is free again: a take that waited on a shard Debug kept would hang here.
        assert_eq!(
            within_seconds("fold after Debug", move || sharded
                .fold(0, |sum, v| sum + v)),
            1
        );
    }

    /// Runs `take` on a new thread and waits for its answer: a take that hangs fails the test
    /// instead of hanging it.
    fn within_seconds<R: Send + 'static>(
        what: &str,
        take: impl FnOnce() -> R + Send + 'static,
    ) -> R {
        let (done, answer) = mpsc::channel();
        std::thread::spawn(move || done.send(take()).unwrap());
        answer
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("{what}: no answer within 10 s"))
    }

    // Pins threads: affinity is Linux's (`thiscpu_linux`, set by the build script).
    #[cfg(thiscpu_linux)]
    #[test]
    fn a_cpu_beyond_the_shards_takes_a_shard_instead_of_waiting_for_ever() {
        let allowed = topology::allowed_cpus().unwrap();
        let Some(&beyond) = allowed.iter().find(|&&cpu| cpu >= 1) else {
            eprintln!("skipped: this thread may run on CPU 0 only, none beyond one shard");
            return;
        };
        let sharded = Arc::new(Sharded::<u64, ByCpu>::with_shards(1, |_| 0));
        eprintln!("{sharded:?} on CPU {beyond}");
        let taker = Arc::clone(&sharded);
        let index = within_seconds("lock_current on a CPU beyond the shards", move || {
            let _pinned = topology::pin_to(beyond).unwrap();
            taker.with_current(|n| *n += 1);
            let mut guard = taker.lock_current();
            *guard += 1;
            guard.index()
        });
        // Every CPU beyond the only shard shares it.
        assert_eq!(index, 0);
        assert_eq!(*sharded.lock(0).unwrap(), 2);
    }

    // Pins threads: affinity is Linux's (`thiscpu_linux`, set by the build script).
    #[cfg(thiscpu_linux)]
    #[test]
    fn a_concurrency_id_beyond_the_shards_takes_a_shard_instead_of_waiting_for_ever() {
        let allowed = topology::allowed_cpus().unwrap();
        let [first, .., last] = allowed[..] else {
            eprintln!("skipped: one allowed CPU, so no two threads run at once");
            return;
        };
        let sharded = Arc::new(Sharded::<u64, ByMmCid>::with_shards(1, |_| 0));
        if !sharded.indexed_by_mm_cid() {
            eprintln!("skipped: shards are not indexed by mm_cid here: {sharded:?}");
            return;
        }
        // Two threads running at once on two CPUs have two concurrency ids: one is at least 1.
        let start = Arc::new(Barrier::new(2));
        let threads: Vec<_> = [first, last]
            .into_iter()
            .map(|cpu| {
                let (sharded, start) = (Arc::clone(&sharded), Arc::clone(&start));
                move || {
                    let _pinned = topology::pin_to(cpu).unwrap();
                    start.wait();
                    let (mut takes, mut beyond) = (0u64, 0u64);
                    let began = std::time::Instant::now();
                    while takes < 20_000 && began.elapsed() < Duration::from_secs(2) {
                        if ops::mm_cid_position().is_some_and(|at| at.index() >= 1) {
                            beyond += 1;
                        }
                        sharded.with_current(|n| *n += 1);
                        takes += 1;
                    }
                    (takes, beyond)
                }
            })
            .collect();
        let (done, answers) = mpsc::channel();
        for thread in threads {
            let done = done.clone();
            std::thread::spawn(move || done.send(thread()).unwrap());
        }
        let (mut takes, mut beyond) = (0, 0);
        for _ in 0..2 {
            let (t, b) = answers
                .recv_timeout(Duration::from_secs(10))
                .expect("a take with a concurrency id beyond the shards: no answer within 10 s");
            takes += t;
            beyond += b;
        }
        eprintln!("{takes} takes, {beyond} of them with a concurrency id beyond the shard");
        assert!(beyond > 0, "no thread had a concurrency id of 1 or more");
        assert_eq!(*sharded.lock(0).unwrap(), takes);
    }

    #[test]
    fn tokens_are_never_reused_by_later_threads() {
        let mut tokens: Vec<u64> = (0..16)
            .map(|_| std::thread::spawn(token).join().unwrap())
            .collect();
        tokens.push(token());
        assert!(tokens.iter().all(|&t| t != FREE));
        assert_eq!(token(), token(), "a thread keeps its token");
        let count = tokens.len();
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len(), count, "a token was drawn twice");
    }
}
