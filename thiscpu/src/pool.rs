//! `Pool<T>`: an object pool with a bounded cache per CPU, in the manner of tcmalloc's per-CPU
//! caches. `get` and `put` pop and push on the current CPU's cache inside a restartable
//! sequence (no atomic instruction, no lock); a full cache spills half of itself to a shared
//! list, an empty one refills from it, and another thread can drain any CPU's cache while that
//! CPU keeps using the pool.
//!
//! # The per-CPU caches
//! Each CPU has a stack: a `count` word and a `stopped` word on one cache line, and an array of
//! `capacity` object pointers on lines of its own. A push is one restartable sequence: check
//! `stopped`, load `count`, leave if the stack is full, store the pointer into the slot beyond
//! `count`, and commit `count + 1`. A pop loads the pointer below `count` and commits
//! `count - 1`. The count is the only committed word, so it is exact: an aborted push leaves a
//! pointer in a slot that no count covers, an aborted pop changes nothing.
//!
//! # Draining another CPU's cache
//! [`Pool::drain_cpu`] takes CPU `c`'s cached objects back to the shared list while threads
//! on `c` go on:
//! 1. the drainer sets `c`'s `stopped` flag (only drainers write it, atomically; drains of one
//!    pool are serialized);
//! 2. it fences CPU `c` with `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ)` targeted at
//!    `c`: every section on `c` that started before the flag was visible is aborted or already
//!    committed, and every later one sees the flag and leaves (steps 1, 2 and 4 are
//!    [`crate::fence::take_over`], which [`crate::Sharded`]'s readers use too);
//! 3. `c`'s count and slots are now the drainer's alone: it takes the objects and stores 0
//!    into the count;
//! 4. it clears the flag with a release store; sections on `c` resume with an empty stack.
//!
//! Meanwhile a `get` or `put` that finds the flag set uses the shared list.
//!
//! **Fallback** where membarrier is refused (kernels before 5.10, seccomp, or
//! `THISCPU_MEMBARRIER=off`): the drainer pins itself to CPU `c` (`sched_setaffinity`), pops
//! the stack there with the same restartable sequences as any thread on `c` (exact by
//! construction), and restores its affinity. If it may not run on `c` (a cpuset without `c`,
//! `c` offline) or has no rseq itself, the drain returns [`DrainError::Unavailable`] and the
//! cache stays as it was.
//!
//! # Without rseq
//! When the process has no rseq at all (old kernel, valgrind, `THISCPU_RSEQ=off`), each CPU's
//! cache is a `Mutex<Vec>` picked by the fallback's CPU number: still exact, slower. A thread
//! without rseq in a process that uses it (a thread made by a raw `clone`) uses the shared
//! list, so no word is ever written both by plain stores in sections and by atomic
//! instructions.
//!
//! # Safety
//! The module runs the guarded stack sections of `crate::arch` on the caller's CPU, moves
//! objects in and out of the caches as raw pointers from `Box::into_raw`, and pins the calling
//! thread with `sched_setaffinity` in the drain fallback; each block states why it holds.

use crate::arch::{StackHead, StackOutcome};
use crate::fence::{self, FenceUnavailable};
use crate::mask::CpuMask;
use crate::ops::{self, BY_CPU, Position};
use crate::percpu::CachePadded;
use crate::registration::{self, Registrar};
use crate::topology;
use core::mem::{ManuallyDrop, size_of};
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Slots per 128-byte chunk.
const CHUNK: usize = 16;
type Chunk = CachePadded<[AtomicUsize; CHUNK]>;
const _: () = assert!(size_of::<Chunk>() == CHUNK * size_of::<AtomicUsize>());

/// Every CPU's stack: heads on lines of their own, and `stride` slots per CPU on lines of
/// their own.
struct Stacks {
    heads: Box<[CachePadded<StackHead>]>,
    chunks: Box<[Chunk]>,
    chunks_per_cpu: usize,
}

impl Stacks {
    /// Stacks for `cpus` CPUs of `capacity` slots each. Panics, before allocating anything, if
    /// the slots would not fit in the address space: the sections index them without bounds
    /// checks, so a wrapped size would let them write past the allocation.
    fn new(cpus: usize, capacity: usize) -> Stacks {
        let chunks_per_cpu = capacity.div_ceil(CHUNK);
        let chunks = cpus
            .checked_mul(chunks_per_cpu)
            .filter(|chunks| {
                chunks
                    .checked_mul(size_of::<Chunk>())
                    .is_some_and(|bytes| bytes <= isize::MAX as usize)
            })
            .unwrap_or_else(|| {
                panic!(
                    "thiscpu::Pool: {capacity} objects per CPU for {cpus} CPUs do not fit in \
                     the address space"
                )
            });
        Stacks {
            heads: (0..cpus).map(|_| CachePadded::default()).collect(),
            chunks: (0..chunks)
                .map(|_| CachePadded([const { AtomicUsize::new(0) }; CHUNK]))
                .collect(),
            chunks_per_cpu,
        }
    }

    /// The address of CPU `cpu`'s first slot, for the sections (`cpu` below the number of
    /// heads, so that the address lies inside `chunks`). No bounds check on the fast path.
    #[inline(always)]
    fn slots_ptr(&self, cpu: usize) -> *mut usize {
        self.chunks
            .as_ptr()
            .wrapping_add(cpu * self.chunks_per_cpu)
            .cast::<usize>()
            .cast_mut()
    }

    /// CPU `cpu`'s slots (`cpu` below the number of heads).
    fn slots(&self, cpu: usize) -> &[AtomicUsize] {
        let chunks = &self.chunks[cpu * self.chunks_per_cpu..(cpu + 1) * self.chunks_per_cpu];
        // SAFETY: a chunk is an array of CHUNK `AtomicUsize` with no padding (asserted above),
        // and the chunks of a boxed slice are contiguous, so `chunks` covers exactly
        // `len * CHUNK` consecutive `AtomicUsize`s of one allocation, borrowed from `self`.
        unsafe {
            core::slice::from_raw_parts(chunks.as_ptr().cast::<AtomicUsize>(), chunks.len() * CHUNK)
        }
    }
}

/// A list of objects behind a lock: the shared list, and each CPU's cache without rseq.
type Locked<T> = CachePadded<Mutex<Vec<Box<T>>>>;

/// The per-CPU caches: restartable stacks, or locked vectors when the process has no rseq.
enum Caches<T> {
    Rseq(Stacks),
    Locked(Box<[Locked<T>]>),
}

fn lock<V>(mutex: &Mutex<V>) -> MutexGuard<'_, V> {
    // A panic while the lock was held (in `Vec` growth) leaves the vector consistent.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How [`Pool::drain_cpu`] reached the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DrainMethod {
    /// The `stopped` flag and a membarrier fence of the CPU.
    Fence,
    /// The drainer moved itself to the CPU and popped there (membarrier refused).
    Migrate,
    /// The process has no rseq: the cache is a locked vector.
    Lock,
}

/// What a drain moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Drained {
    /// Objects moved from the CPU's cache to the shared list.
    pub objects: usize,
    /// How the cache was reached.
    pub method: DrainMethod,
}

/// Why a drain did nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DrainError {
    /// The CPU is beyond the pool's caches (not a possible CPU).
    NoSuchCpu(u32),
    /// membarrier is refused here, and the fallback could not run on the CPU (not in this
    /// thread's allowed CPUs, offline, or this thread has no rseq).
    Unavailable(FenceUnavailable),
}

impl core::fmt::Display for DrainError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            DrainError::NoSuchCpu(cpu) => write!(f, "CPU {cpu} is not a possible CPU"),
            DrainError::Unavailable(why) => write!(
                f,
                "cannot drain another CPU's cache: {why}, and this thread cannot run there"
            ),
        }
    }
}

impl std::error::Error for DrainError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DrainError::NoSuchCpu(_) => None,
            DrainError::Unavailable(why) => Some(why),
        }
    }
}

/// What [`Pool::drain_all`] did when some CPU's cache could not be drained: the objects it
/// moved from the others, and each CPU it could not reach with the reason.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DrainAllError {
    /// Objects moved to the shared list from the caches that could be drained.
    pub moved: usize,
    /// The CPUs whose cache stayed as it was, in CPU order, each with its reason.
    pub failed: Vec<(u32, DrainError)>,
}

impl core::fmt::Display for DrainAllError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "moved {} objects, but {} CPU caches could not be drained",
            self.moved,
            self.failed.len()
        )?;
        if let Some((cpu, why)) = self.failed.first() {
            write!(f, " (CPU {cpu}: {why})")?;
        }
        Ok(())
    }
}

impl std::error::Error for DrainAllError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.failed
            .first()
            .map(|(_, why)| why as &(dyn std::error::Error + 'static))
    }
}

/// Default objects cached per CPU.
pub const DEFAULT_CAPACITY: usize = 64;

/// The most objects a [`Pool`] caches per CPU: 2^20, 8 MiB of pointers per possible CPU.
/// [`Pool::with_capacity`] refuses more, so that the caches' size (this times the number of
/// possible CPUs) can never wrap around.
pub const MAX_CAPACITY: usize = 1 << 20;

/// An object pool with a bounded cache per CPU.
///
/// - [`get`](Pool::get) returns a [`Pooled`] guard that puts the object back when dropped;
///   objects come back in the state they were left in. When the CPU's cache and the shared
///   list are both empty, the pool makes a new object with the function given to
///   [`new`](Pool::new).
/// - `get` and `put` on the current CPU's cache are restartable sequences: no lock, no atomic
///   read-modify-write. Every object is in exactly one place at a time (a cache, the shared
///   list, or one guard): none is lost and none is handed out twice, under preemption,
///   migration, signals, thread exit and concurrent drains.
/// - Not async-signal-safe: the slow paths take a lock.
///
/// ```
/// let buffers = thiscpu::Pool::new(|| Vec::<u8>::with_capacity(4096));
/// std::thread::scope(|s| {
///     for _ in 0..4 {
///         s.spawn(|| {
///             for i in 0..1000u32 {
///                 let mut buffer = buffers.get();
///                 buffer.clear();
///                 buffer.extend_from_slice(&i.to_le_bytes());
///             } // back to this CPU's cache
///         });
///     }
/// });
/// assert!(buffers.created() <= 4 * 2, "objects are reused: {}", buffers.created());
/// ```
pub struct Pool<T> {
    caches: Caches<T>,
    capacity: usize,
    batch: usize,
    touched: CpuMask,
    shared: Locked<T>,
    drains: Mutex<()>,
    created: AtomicU64,
    make: Box<dyn Fn() -> T + Send + Sync>,
}

impl<T: Default + 'static> Default for Pool<T> {
    fn default() -> Self {
        Pool::new(T::default)
    }
}

impl<T> Pool<T> {
    /// A pool that makes objects with `make`, caching up to [`DEFAULT_CAPACITY`] per CPU.
    ///
    /// ```
    /// let pool = thiscpu::Pool::new(|| String::with_capacity(64));
    /// assert_eq!(pool.get().capacity(), 64);
    /// ```
    pub fn new(make: impl Fn() -> T + Send + Sync + 'static) -> Self {
        Pool::with_capacity(DEFAULT_CAPACITY, make)
    }

    /// A pool caching up to `per_cpu` objects per CPU (at least 1). A full cache moves half
    /// of itself to the shared list; an empty one takes up to half from it. The caches are
    /// allocated up front: one pointer per object per possible CPU.
    ///
    /// ```
    /// let pool = thiscpu::Pool::with_capacity(8, || 0u64);
    /// assert_eq!(pool.capacity(), 8);
    /// ```
    ///
    /// # Panics
    /// When `per_cpu` exceeds [`MAX_CAPACITY`].
    pub fn with_capacity(per_cpu: usize, make: impl Fn() -> T + Send + Sync + 'static) -> Self {
        assert!(
            per_cpu <= MAX_CAPACITY,
            "thiscpu::Pool: {per_cpu} objects per CPU requested, at most {MAX_CAPACITY} allowed"
        );
        let capacity = per_cpu.max(1);
        let cpus = topology::possible_cpus().max(1);
        let caches = if registration::process().registrar == Registrar::None {
            Caches::Locked(
                (0..cpus)
                    .map(|_| CachePadded(Mutex::new(Vec::new())))
                    .collect(),
            )
        } else {
            Caches::Rseq(Stacks::new(cpus, capacity))
        };
        Pool {
            caches,
            capacity,
            batch: (capacity / 2).max(1),
            touched: CpuMask::with_capacity(cpus),
            shared: CachePadded(Mutex::new(Vec::new())),
            drains: Mutex::new(()),
            created: AtomicU64::new(0),
            make: Box::new(make),
        }
    }

    /// Objects cached per CPU at most.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// An object: from this CPU's cache, else the shared list, else a new one.
    ///
    /// ```
    /// let pool = thiscpu::Pool::new(|| 7);
    /// let mut seven = pool.get();
    /// *seven += 1;
    /// drop(seven);
    /// assert_eq!(*pool.get(), 8, "the same object, as it was left");
    /// ```
    #[inline]
    #[must_use = "dropping the guard at once puts the object straight back"]
    pub fn get(&self) -> Pooled<'_, T> {
        let object = match self.pop_fast() {
            Some(object) => object,
            None => self.get_slow(),
        };
        Pooled {
            pool: self,
            object: ManuallyDrop::new(object),
        }
    }

    /// Adds `value` to the pool (to this CPU's cache when it has room).
    ///
    /// ```
    /// let pool = thiscpu::Pool::new(|| 0);
    /// pool.put(5);
    /// assert_eq!(*pool.get(), 5);
    /// assert_eq!(pool.created(), 0);
    /// ```
    pub fn put(&self, value: T) {
        self.put_box(Box::new(value));
    }

    /// Adds a boxed object to the pool without moving it.
    ///
    /// ```
    /// let pool = thiscpu::Pool::new(|| [0u8; 4096]);
    /// pool.put_box(Box::new([1; 4096]));
    /// assert_eq!(pool.get()[0], 1);
    /// ```
    #[inline]
    pub fn put_box(&self, object: Box<T>) {
        if let Caches::Rseq(stacks) = &self.caches {
            let at = ops::position_as_is::<BY_CPU>();
            // One unsigned comparison rejects an unregistered area and CPUs beyond the caches.
            if (at.index() as usize) < stacks.heads.len() {
                let object = match self.push_at(stacks, at, object) {
                    Ok(()) => return,
                    Err((object, StackOutcome::Aborted)) => {
                        ops::note_abort();
                        object
                    }
                    Err((object, _)) => object,
                };
                return self.put_slow(object);
            }
        }
        self.put_slow(object)
    }

    /// One try at popping this CPU's cache.
    #[inline]
    fn pop_fast(&self) -> Option<Box<T>> {
        let Caches::Rseq(stacks) = &self.caches else {
            return None;
        };
        let at = ops::position_as_is::<BY_CPU>();
        if (at.index() as usize) >= stacks.heads.len() {
            return None;
        }
        match self.pop_at(stacks, at) {
            Ok(object) => Some(object),
            Err(StackOutcome::Aborted) => {
                ops::note_abort();
                None
            }
            Err(_) => None,
        }
    }

    /// Pops the stack of `at`'s CPU in one restartable sequence.
    #[inline(always)]
    fn pop_at(&self, stacks: &Stacks, at: Position<BY_CPU>) -> Result<Box<T>, StackOutcome> {
        let cpu = at.index();
        let head: &StackHead = &stacks.heads[cpu as usize];
        let slots = stacks.slots_ptr(cpu as usize);
        let mut out = 0usize;
        // SAFETY: `at` was just read from this thread's area (BY_CPU); `head`
        // and `slots` are CPU `cpu`'s stack (`cpu` is below the number of heads, as indexing
        // `heads` checked, so `slots` starts `chunks_per_cpu * CHUNK >= capacity` words inside
        // `chunks`), whose count and slots only sections positioned on `cpu` write, or a
        // drainer that set `stopped` and fenced `cpu` (which the section checks). `out` is a
        // local.
        let outcome = unsafe { ops::stack_pop(at, head, slots, &mut out) };
        match outcome {
            // SAFETY: a committed pop took the pointer below the count: it came from
            // `Box::into_raw` in a committed push, and the count's decrement made this call its
            // only owner.
            StackOutcome::Committed => Ok(unsafe { Box::from_raw(out as *mut T) }),
            other => Err(other),
        }
    }

    /// Pushes onto the stack of `at`'s CPU in one restartable sequence; gives the object back
    /// if the push did not commit.
    #[inline(always)]
    fn push_at(
        &self,
        stacks: &Stacks,
        at: Position<BY_CPU>,
        object: Box<T>,
    ) -> Result<(), (Box<T>, StackOutcome)> {
        let cpu = at.index();
        let head: &StackHead = &stacks.heads[cpu as usize];
        // Before the object can be in the cache: `Drop` and `drain_all` visit touched CPUs
        // only. A stack only becomes non-empty through a push onto an empty one, and touched
        // bits are never cleared, so a count seen non-zero means the bit is set already (by a
        // thread that `Drop` and a later drain happen after). The count's line is the one the
        // section reads next.
        if head.count.load(Ordering::Relaxed) == 0 {
            self.touched.set(cpu);
        }
        let slots = stacks.slots_ptr(cpu as usize);
        let raw = Box::into_raw(object);
        // SAFETY: as in `pop_at`; the capacity is at most the slots' length; `raw` is owned by
        // this call until the push commits.
        let outcome =
            unsafe { ops::stack_push(at, head, slots, self.capacity as u64, raw as usize) };
        if outcome == StackOutcome::Committed {
            return Ok(());
        }
        // SAFETY: the push did not commit, so no count covers `raw`: it is still ours.
        Err((unsafe { Box::from_raw(raw) }, outcome))
    }

    #[cold]
    #[inline(never)]
    fn get_slow(&self) -> Box<T> {
        match &self.caches {
            Caches::Rseq(stacks) => match self.pop_here(stacks) {
                Ok(object) => return object,
                Err(StackOutcome::Refused) => return self.refill(stacks),
                Err(_) => {}
            },
            Caches::Locked(lists) => {
                if let Some(object) = lock(&lists[self.locked_index(lists.len())]).pop() {
                    return object;
                }
            }
        }
        let from_shared = lock(&self.shared).pop();
        from_shared.unwrap_or_else(|| self.make_new())
    }

    /// This CPU's cache is empty: take a batch from the shared list, keep one, cache the rest.
    fn refill(&self, stacks: &Stacks) -> Box<T> {
        let mut batch = {
            let mut shared = lock(&self.shared);
            let keep = shared.len().saturating_sub(self.batch);
            shared.split_off(keep)
        };
        let Some(first) = batch.pop() else {
            return self.make_new();
        };
        while let Some(object) = batch.pop() {
            if let Err((object, _)) = self.push_here(stacks, object) {
                batch.push(object);
                lock(&self.shared).append(&mut batch);
                break;
            }
        }
        first
    }

    /// Pushes onto the current CPU's cache, retrying aborts. Gives the object back with
    /// `Refused` if the cache is full, or `Stopped` if a drainer owns it, this thread cannot
    /// use a cache (no rseq, a CPU beyond the caches), or [`ops::ABORT_LIMIT`] tries in a row
    /// aborted.
    fn push_here(&self, stacks: &Stacks, mut object: Box<T>) -> Result<(), (Box<T>, StackOutcome)> {
        let mut aborts = ops::AbortRun::new();
        while let Some(at) = ops::position() {
            if at.index() as usize >= stacks.heads.len() {
                break;
            }
            match self.push_at(stacks, at, object) {
                Ok(()) => return Ok(()),
                Err((back, StackOutcome::Aborted)) => {
                    ops::note_abort();
                    object = back;
                    if aborts.gives_up() {
                        break;
                    }
                }
                Err(refused_or_stopped) => return Err(refused_or_stopped),
            }
        }
        Err((object, StackOutcome::Stopped))
    }

    /// Pops the current CPU's cache, retrying aborts: `Refused` if it is empty, `Stopped` as for
    /// `push_here`.
    fn pop_here(&self, stacks: &Stacks) -> Result<Box<T>, StackOutcome> {
        let mut aborts = ops::AbortRun::new();
        while let Some(at) = ops::position() {
            if at.index() as usize >= stacks.heads.len() {
                break;
            }
            match self.pop_at(stacks, at) {
                Ok(object) => return Ok(object),
                Err(StackOutcome::Aborted) => {
                    ops::note_abort();
                    if aborts.gives_up() {
                        break;
                    }
                }
                Err(refused_or_stopped) => return Err(refused_or_stopped),
            }
        }
        Err(StackOutcome::Stopped)
    }

    #[cold]
    #[inline(never)]
    fn put_slow(&self, object: Box<T>) {
        match &self.caches {
            Caches::Rseq(stacks) => match self.push_here(stacks, object) {
                Ok(()) => {}
                Err((back, StackOutcome::Refused)) => self.overflow(stacks, back),
                Err((back, _)) => lock(&self.shared).push(back),
            },
            Caches::Locked(lists) => {
                let index = self.locked_index(lists.len());
                self.touched.set(index as u32);
                let mut list = lock(&lists[index]);
                if list.len() < self.capacity {
                    list.push(object);
                    return;
                }
                let keep = list.len() - self.batch;
                let mut spill = list.split_off(keep);
                drop(list);
                spill.push(object);
                lock(&self.shared).append(&mut spill);
            }
        }
    }

    /// This CPU's cache is full: move a batch from it, and `object`, to the shared list.
    fn overflow(&self, stacks: &Stacks, object: Box<T>) {
        let mut spill = Vec::with_capacity(self.batch + 1);
        while spill.len() < self.batch {
            match self.pop_here(stacks) {
                Ok(cached) => spill.push(cached),
                Err(_) => break,
            }
        }
        spill.push(object);
        lock(&self.shared).append(&mut spill);
    }

    fn locked_index(&self, len: usize) -> usize {
        crate::current_cpu() as usize % len
    }

    #[cold]
    fn make_new(&self) -> Box<T> {
        let object = Box::new((self.make)());
        self.created.fetch_add(1, Ordering::Relaxed);
        object
    }

    /// How many objects the pool has made with its `make` function so far.
    ///
    /// ```
    /// let pool = thiscpu::Pool::new(|| 0u8);
    /// drop(pool.get());
    /// drop(pool.get());
    /// assert_eq!(pool.created(), 1);
    /// ```
    pub fn created(&self) -> u64 {
        self.created.load(Ordering::Relaxed)
    }

    /// Objects in CPU `cpu`'s cache (0 for a CPU beyond the caches); a snapshot while other
    /// threads use the pool.
    ///
    /// ```
    /// let pool = thiscpu::Pool::new(|| 0u8);
    /// drop(pool.get());
    /// let cached: usize = (0..thiscpu::topology::possible_cpus() as u32).map(|cpu| pool.cached_on(cpu)).sum();
    /// assert_eq!(cached + pool.shared_len(), 1);
    /// ```
    pub fn cached_on(&self, cpu: u32) -> usize {
        match &self.caches {
            Caches::Rseq(stacks) => stacks
                .heads
                .get(cpu as usize)
                .map_or(0, |head| head.count.load(Ordering::Relaxed) as usize),
            Caches::Locked(lists) => lists.get(cpu as usize).map_or(0, |list| lock(list).len()),
        }
    }

    /// Objects in all CPU caches: the sum over [`touched`](Pool::touched) CPUs.
    ///
    /// ```
    /// let pool = thiscpu::Pool::new(|| 0u8);
    /// pool.put(1);
    /// assert_eq!(pool.cached() + pool.shared_len(), 1);
    /// ```
    pub fn cached(&self) -> usize {
        self.touched.iter().map(|cpu| self.cached_on(cpu)).sum()
    }

    /// Objects in the shared list.
    pub fn shared_len(&self) -> usize {
        lock(&self.shared).len()
    }

    /// The CPUs whose cache has ever held an object, as a copy taken now. Readers that visit
    /// every cache ([`cached`](Pool::cached), [`drain_all`](Pool::drain_all), dropping the
    /// pool) skip the others, which matters on machines with hundreds of possible CPUs. A copy,
    /// because those readers rely on bits never being cleared.
    ///
    /// ```
    /// let pool = thiscpu::Pool::new(|| 0u8);
    /// drop(pool.get());
    /// assert!(pool.touched().count() <= 1);
    /// ```
    pub fn touched(&self) -> CpuMask {
        self.touched.clone()
    }

    /// Moves CPU `cpu`'s cached objects to the shared list, while threads on `cpu` keep using
    /// the pool (see the module documentation for the protocol and its fallback). Objects
    /// pushed during the drain may stay in the cache.
    ///
    /// ```
    /// let pool = thiscpu::Pool::new(|| 0u8);
    /// pool.put(1);
    /// let cpu = pool.touched().first().unwrap_or(0);
    /// match pool.drain_cpu(cpu) {
    ///     Ok(drained) => assert_eq!(pool.cached_on(cpu), 0, "{drained:?}"),
    ///     Err(why) => println!("{why}"),
    /// }
    /// ```
    pub fn drain_cpu(&self, cpu: u32) -> Result<Drained, DrainError> {
        let taken = match &self.caches {
            Caches::Locked(lists) => {
                let list = lists.get(cpu as usize).ok_or(DrainError::NoSuchCpu(cpu))?;
                let mut taken = core::mem::take(&mut *lock(list));
                let objects = taken.len();
                lock(&self.shared).append(&mut taken);
                return Ok(Drained {
                    objects,
                    method: DrainMethod::Lock,
                });
            }
            Caches::Rseq(stacks) => {
                if cpu as usize >= stacks.heads.len() {
                    return Err(DrainError::NoSuchCpu(cpu));
                }
                let _one_drain_at_a_time = lock(&self.drains);
                match self.drain_fenced(stacks, cpu) {
                    Ok(taken) => (taken, DrainMethod::Fence),
                    Err(refused) => (
                        self.drain_by_migrating(stacks, cpu)
                            .ok_or(DrainError::Unavailable(refused))?,
                        DrainMethod::Migrate,
                    ),
                }
            }
        };
        let (mut objects, method) = taken;
        let count = objects.len();
        lock(&self.shared).append(&mut objects);
        Ok(Drained {
            objects: count,
            method,
        })
    }

    /// Drains every touched CPU's cache ([`drain_cpu`](Pool::drain_cpu)); returns how many
    /// objects moved. A CPU that cannot be drained does not stop the others: the error then
    /// says what was moved anyway and which CPUs were not reached.
    ///
    /// ```
    /// let pool = thiscpu::Pool::new(|| 0u8);
    /// pool.put(1);
    /// let moved = match pool.drain_all() {
    ///     Ok(moved) => moved,
    ///     Err(partial) => partial.moved,
    /// };
    /// assert_eq!(pool.shared_len(), moved);
    /// ```
    pub fn drain_all(&self) -> Result<usize, DrainAllError> {
        let mut moved = 0;
        let mut failed = Vec::new();
        for cpu in self.touched.iter() {
            match self.drain_cpu(cpu) {
                Ok(drained) => moved += drained.objects,
                Err(why) => failed.push((cpu, why)),
            }
        }
        if failed.is_empty() {
            Ok(moved)
        } else {
            Err(DrainAllError { moved, failed })
        }
    }

    /// Steps 1-4 of the drain protocol. The caller holds the drain lock.
    fn drain_fenced(&self, stacks: &Stacks, cpu: u32) -> Result<Vec<Box<T>>, FenceUnavailable> {
        let head = &stacks.heads[cpu as usize];
        // Sections never write `stopped`, and drains are serialized, so the flag is 0 here and
        // still 1 after the fence: the take-over cannot come back empty-handed.
        let Some(_taken_over) = fence::take_over(Some(cpu), &head.stopped, 0, 1)? else {
            debug_assert!(false, "only drainers write the stopped flag, one at a time");
            return Ok(Vec::new());
        };
        // SAFETY: the take-over returned: no section on `cpu` that missed the flag can commit
        // any more, and every later one leaves at the flag, so the count and slots are ours
        // until the guard clears the flag (with a release store, paired with the sections'
        // load of `stopped`, a load-acquire on aarch64: a section that sees the flag clear
        // sees the count of 0); the fence also made the sections' plain stores visible here.
        Ok(unsafe { self.take_stack(stacks, cpu) })
    }

    /// Empties CPU `cpu`'s stack and returns its objects.
    ///
    /// # Safety
    /// No restartable sequence may commit on that stack until this returns: the stack is
    /// stopped and its CPU fenced, or the pool is exclusively borrowed.
    unsafe fn take_stack(&self, stacks: &Stacks, cpu: u32) -> Vec<Box<T>> {
        let head = &stacks.heads[cpu as usize];
        let count = (head.count.load(Ordering::Acquire) as usize).min(self.capacity);
        let taken = stacks.slots(cpu as usize)[..count]
            .iter()
            // SAFETY: the slots below the count hold pointers from `Box::into_raw` of committed
            // pushes, not popped since (nothing else runs on this stack, by the contract);
            // resetting the count below gives them to this call.
            .map(|slot| unsafe { Box::from_raw(slot.load(Ordering::Relaxed) as *mut T) })
            .collect();
        head.count.store(0, Ordering::Relaxed);
        taken
    }

    /// The fallback: run on `cpu` and pop its stack there. `None` if this thread cannot.
    fn drain_by_migrating(&self, stacks: &Stacks, cpu: u32) -> Option<Vec<Box<T>>> {
        ops::position()?;
        let previous = Affinity::current()?;
        if !Affinity::only(cpu).apply() {
            return None;
        }
        let mut taken = Vec::new();
        // `sched_setaffinity` on oneself returns on an allowed CPU; pop while there. Pushes by
        // other threads on `cpu` meanwhile may refill the stack: stop after a full stack's
        // worth beyond what was there.
        let limit = self.cached_on(cpu) + self.capacity;
        let mut attempts = 0;
        while taken.len() < limit && attempts < 4 * limit + 16 {
            attempts += 1;
            let Some(at) = ops::position() else { break };
            if at.index() != cpu {
                std::thread::yield_now();
                continue;
            }
            match self.pop_at(stacks, at) {
                Ok(object) => taken.push(object),
                Err(StackOutcome::Aborted) => ops::note_abort(),
                Err(_) => break,
            }
        }
        previous.apply();
        Some(taken)
    }
}

/// A saved CPU affinity of the calling thread.
struct Affinity(libc::cpu_set_t);

impl Affinity {
    fn current() -> Option<Affinity> {
        // SAFETY: a zeroed cpu_set_t is a valid empty set, which sched_getaffinity fills.
        unsafe {
            let mut set: libc::cpu_set_t = core::mem::zeroed();
            (libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) == 0)
                .then_some(Affinity(set))
        }
    }

    fn only(cpu: u32) -> Affinity {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET is called only for an id
        // inside it. A CPU beyond it leaves the set empty, which the kernel refuses.
        unsafe {
            let mut set: libc::cpu_set_t = core::mem::zeroed();
            if (cpu as usize) < 8 * size_of::<libc::cpu_set_t>() {
                libc::CPU_SET(cpu as usize, &mut set);
            }
            Affinity(set)
        }
    }

    fn apply(&self) -> bool {
        // SAFETY: sets the calling thread's affinity from a valid cpu_set_t.
        unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &self.0) == 0 }
    }
}

impl<T> Drop for Pool<T> {
    fn drop(&mut self) {
        if let Caches::Rseq(stacks) = &self.caches {
            // `&mut self`: no guard is alive, so no section on these stacks is running. Every
            // push set its CPU's touched bit first, so untouched stacks are empty.
            for cpu in self.touched.iter() {
                // SAFETY: the pool is exclusively borrowed: no section runs on its stacks.
                drop(unsafe { self.take_stack(stacks, cpu) });
            }
        }
    }
}

impl<T> core::fmt::Debug for Pool<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Pool")
            .field("capacity", &self.capacity)
            .field("cached", &self.cached())
            .field("shared", &self.shared_len())
            .field("created", &self.created())
            .field("touched", &self.touched)
            .finish()
    }
}

/// An object taken from a [`Pool`]; dereferences to it, and puts it back when dropped.
///
/// ```
/// let pool = thiscpu::Pool::new(Vec::<u32>::new);
/// let mut list = pool.get();
/// list.push(1);
/// let kept: Vec<u32> = thiscpu::Pooled::into_inner(list);
/// assert_eq!(kept, [1]);
/// ```
#[must_use = "dropping the guard puts the object back into the pool at once"]
pub struct Pooled<'a, T> {
    pool: &'a Pool<T>,
    object: ManuallyDrop<Box<T>>,
}

impl<T> Pooled<'_, T> {
    /// Takes the object out of the pool's circulation.
    pub fn into_inner(this: Self) -> T {
        *Pooled::into_box(this)
    }

    /// Takes the boxed object out of the pool's circulation, without moving it.
    ///
    /// ```
    /// let pool = thiscpu::Pool::new(|| 3u8);
    /// assert_eq!(*thiscpu::Pooled::into_box(pool.get()), 3);
    /// ```
    pub fn into_box(this: Self) -> Box<T> {
        let mut this = ManuallyDrop::new(this);
        // SAFETY: `this` is never dropped, so the object is taken exactly once.
        unsafe { ManuallyDrop::take(&mut this.object) }
    }
}

impl<T> core::ops::Deref for Pooled<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        &self.object
    }
}

impl<T> core::ops::DerefMut for Pooled<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        &mut self.object
    }
}

impl<T> Drop for Pooled<'_, T> {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: the guard is being dropped; the object is taken exactly once, here.
        let object = unsafe { ManuallyDrop::take(&mut self.object) };
        self.pool.put_box(object);
    }
}

impl<T: core::fmt::Debug> core::fmt::Debug for Pooled<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_tuple("Pooled").field(&**self.object).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "do not fit in the address space")]
    fn stacks_refuse_a_size_that_wraps() {
        // 2^60 chunks per CPU times 16 CPUs is 2^64: 0 once wrapped.
        let _ = Stacks::new(16, usize::MAX);
    }

    /// A pool with locked caches for `caches` CPUs, whose touched mask also names CPUs beyond
    /// them, as a CPU whose drain fails.
    fn pool_with_unreachable_cpus(caches: usize, touched: &[u32]) -> Pool<u8> {
        let pool = Pool {
            caches: Caches::Locked(
                (0..caches)
                    .map(|_| CachePadded(Mutex::new(Vec::new())))
                    .collect(),
            ),
            capacity: 8,
            batch: 4,
            touched: CpuMask::with_capacity(caches + touched.len()),
            shared: CachePadded(Mutex::new(Vec::new())),
            drains: Mutex::new(()),
            created: AtomicU64::new(0),
            make: Box::new(|| 0),
        };
        for &cpu in touched {
            pool.touched.set(cpu);
        }
        pool
    }

    #[test]
    fn drain_all_reports_what_it_moved_when_a_cpu_fails() {
        let pool = pool_with_unreachable_cpus(1, &[0, 1]);
        let Caches::Locked(lists) = &pool.caches else {
            unreachable!()
        };
        lock(&lists[0]).extend([Box::new(1), Box::new(2), Box::new(3)]);
        let partial = pool.drain_all().expect_err("CPU 1 has no cache");
        assert_eq!(partial.moved, 3);
        assert_eq!(partial.failed, vec![(1, DrainError::NoSuchCpu(1))]);
        assert_eq!(pool.shared_len(), 3);
        let source = std::error::Error::source(&partial).expect("the first failure");
        assert_eq!(source.to_string(), DrainError::NoSuchCpu(1).to_string());
        assert!(partial.to_string().contains("moved 3 objects"), "{partial}");
    }

    #[test]
    fn drain_error_names_the_fence_error_as_its_source() {
        let refused = crate::fence::FenceUnavailable::refused(libc::EPERM);
        let error = DrainError::Unavailable(refused);
        let source = std::error::Error::source(&error).expect("the fence's error");
        assert_eq!(source.to_string(), refused.to_string());
        assert!(std::error::Error::source(&DrainError::NoSuchCpu(7)).is_none());
    }
}
