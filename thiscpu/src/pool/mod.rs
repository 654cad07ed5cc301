//! `Pool<T>`: an object pool with a bounded cache per CPU, in the manner of tcmalloc's per-CPU
//! caches. `get` and `put` pop and push on the current CPU's cache inside a restartable
//! sequence (no atomic instruction, no lock); a full cache spills half of itself to a shared
//! list, an empty one refills from it, and another thread can drain any CPU's cache while that
//! CPU keeps using the pool.
//!
//! # The per-CPU caches
//! Each CPU's cache is a bounded stack of object pointers whose count is the only word a
//! restartable sequence commits: an aborted push leaves a pointer that no count covers, an
//! aborted pop changes nothing, so the count is exact.
//!
//! # Draining another CPU's cache
//! [`Pool::drain_cpu`] takes CPU `c`'s cached objects back to the shared list while threads
//! on `c` go on: it raises a flag on `c`'s stack, fences `c` with
//! `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ)` so that no section there can still
//! commit, takes the objects and clears the flag. Meanwhile a `get` or `put` that finds the
//! flag set uses the shared list.
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
//! This file moves objects out of guards and empties the stacks of a pool being dropped; the
//! sections themselves are in `stacks`, the drain in `drain`. Each block states why it holds.

mod drain;
mod stacks;

pub use drain::{DrainAllError, DrainError, DrainMethod, Drained};

use crate::mask::CpuMask;
use crate::ops::{self, ByCpu, StackOutcome};
use crate::percpu::CachePadded;
use crate::registration::{self, Registrar};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::{Mutex, MutexGuard};
use crate::topology;
use core::mem::ManuallyDrop;
use stacks::Stacks;

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
///   [`new`](Pool::new). It also makes one when the calling thread's sections abort
///   [`ops::ABORT_LIMIT`] times in a row while the shared list is empty (a debugger
///   single-stepping the thread), since its CPU's cache is then out of its reach; such calls
///   are counted by [`ops::abort_fallbacks`].
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
/// // A thread makes an object only when its CPU's cache and the shared list are both empty:
/// // once per thread, and again after a move to a CPU whose cache is empty.
/// assert!(buffers.created() < 100, "objects are reused: {}", buffers.created());
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
    /// The pool keeps `make` for its whole life and may call it from any thread, so it must be
    /// `'static` (and `Send + Sync`): a closure that borrows a local, such as a counter of what
    /// it makes, does not compile (E0373). Move a shared handle into it instead:
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicU64, Ordering};
    ///
    /// let made = Arc::new(AtomicU64::new(0));
    /// let pool = thiscpu::Pool::new({
    ///     let made = made.clone();
    ///     move || {
    ///         made.fetch_add(1, Ordering::Relaxed);
    ///         String::with_capacity(64)
    ///     }
    /// });
    /// assert_eq!(pool.get().capacity(), 64);
    /// assert_eq!(made.load(Ordering::Relaxed), pool.created());
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
        // Without a decision (a signal handler that interrupted it) the pool never runs sections.
        let caches = if registration::decided()
            .is_none_or(|process| process.rseq.registrar == Registrar::None)
        {
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

    /// An object: from this CPU's cache, else the shared list, else a new one. A thread that
    /// moves to another CPU between a drop and a `get` finds a different cache, so the example
    /// pins itself to get back the object it left.
    ///
    /// ```
    /// // Pinning is Linux's; unpinned, the thread may find another CPU's cache.
    /// let pinned = thiscpu::topology::pin_to(thiscpu::current_cpu());
    /// let pool = thiscpu::Pool::new(|| 7);
    /// let mut seven = pool.get();
    /// *seven += 1;
    /// drop(seven);
    /// if pinned.is_ok() {
    ///     assert_eq!(*pool.get(), 8, "the same object, as it was left");
    /// }
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
    /// // Pinning is Linux's; unpinned, the thread may find another CPU's cache.
    /// let pinned = thiscpu::topology::pin_to(thiscpu::current_cpu());
    /// let pool = thiscpu::Pool::new(|| 0);
    /// pool.put(5);
    /// if pinned.is_ok() {
    ///     assert_eq!(*pool.get(), 5);
    ///     assert_eq!(pool.created(), 0);
    /// }
    /// ```
    pub fn put(&self, value: T) {
        self.put_box(Box::new(value));
    }

    /// Adds a boxed object to the pool without moving it.
    ///
    /// ```
    /// // Pinning is Linux's; unpinned, the thread may find another CPU's cache.
    /// let pinned = thiscpu::topology::pin_to(thiscpu::current_cpu());
    /// let pool = thiscpu::Pool::new(|| [0u8; 4096]);
    /// pool.put_box(Box::new([1; 4096]));
    /// if pinned.is_ok() {
    ///     assert_eq!(pool.get()[0], 1);
    /// }
    /// ```
    #[inline]
    pub fn put_box(&self, object: Box<T>) {
        if let Caches::Rseq(stacks) = &self.caches {
            let at = ops::position_as_is::<ByCpu>();
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
        let at = ops::position_as_is::<ByCpu>();
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
        crate::cpu::current_cpu() as usize % len
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
    /// // Pinned (Linux), the second `get` finds the first object in the same CPU's cache.
    /// let pinned = thiscpu::topology::pin_to(thiscpu::current_cpu());
    /// let pool = thiscpu::Pool::new(|| 0u8);
    /// drop(pool.get());
    /// drop(pool.get());
    /// if pinned.is_ok() {
    ///     assert_eq!(pool.created(), 1);
    /// }
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
