//! The transfer layer: for each size class, a bounded array of free objects' addresses that a
//! CPU whose cache is full hands a batch to and a CPU whose cache is empty takes a batch from,
//! so that objects freed on one CPU serve allocations on another without a trip through the
//! inner allocator (the role of tcmalloc's transfer cache). A producer thread on one CPU and a
//! consumer on another then move their objects through here, a batch at a time.
//!
//! Only addresses move: the objects' memory is never read or written here, so a batch costs
//! no cache line of the objects, which a CPU that freed them may still hold.
//!
//! # The lock
//! Each list has a try-lock: a caller that still finds it taken after a brief spin does what it
//! would have done without the layer (a spill goes to the inner allocator, a miss asks it), so
//! no allocation waits for a thread that is not running. The lock word is 0 when free and otherwise names the fork
//! generation it was taken in: a word of an older generation was left by a thread of the
//! parent of a `fork`, which does not exist in the child, and the child takes the lock over.
//! That is safe because the count is the list's only committed word: a batch is written above
//! the count before one store of the count covers it, and taken by one store of the count
//! below it, so a holder stopped at any instruction leaves a list whose count covers only
//! addresses it holds.
//!
//! A release waits for a taken lock, yielding, a bounded while, and then leaves the list as it
//! is: the holder may be the very thread it interrupted (a signal handler), which would never
//! give it back.
//!
//! The slots are atomics accessed with relaxed loads and stores under the lock, whose acquiring
//! compare-exchange and releasing store order them between holders.

use super::fork_stamp;
use crate::sync::atomic::{AtomicU64, AtomicUsize as Slot, Ordering};

/// How many times a spill or a miss tries a taken lock before it turns to the inner
/// allocator. With 64, a producer and a consumer on two CPUs of a loaded machine gave up on
/// about one hand-over in five (the holder was copying lines from the other CPU's cache);
/// giving up is correct at any count, so the model checker, for which each try is a step to
/// interleave, tries 4 times.
const BRIEF_TRIES: usize = if cfg!(thiscpu_model) { 4 } else { 1024 };

/// How many times a release yields to the holder of a list's lock before it leaves the list
/// as it is.
const PATIENT_ROUNDS: usize = 1000;

/// The most objects one batch holds. A batch lives on the stack of the call that moves it: at
/// 128, with batches returned by value and copied on the way, a process whose address space
/// was used up (`RLIMIT_AS`, the C library's stress test) could not grow its stack for a
/// miss's deeper frames and died of it in 10 of 12 runs, and at 64 in 1 of 8 runs of its
/// checking mode; at 64 with one batch per miss, filled in place, it passed 16 of 16.
pub(super) const MAX_BATCH: usize = 64;

/// Up to `MAX_BATCH` free objects of one class, held by the caller.
#[derive(Debug)]
pub(super) struct Batch {
    objects: [usize; MAX_BATCH],
    len: usize,
}

impl Batch {
    /// An empty batch.
    pub(super) fn new() -> Batch {
        Batch {
            objects: [0; MAX_BATCH],
            len: 0,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// How many more objects it has room for.
    pub(super) fn room(&self) -> usize {
        MAX_BATCH - self.len
    }

    /// Adds `object`, which the caller gives to the batch. The batch must not be full.
    pub(super) fn push(&mut self, object: *mut u8) {
        self.objects[self.len] = object as usize;
        self.len += 1;
    }

    /// Takes one object out.
    pub(super) fn pop(&mut self) -> Option<*mut u8> {
        self.len = self.len.checked_sub(1)?;
        Some(self.objects[self.len] as *mut u8)
    }

    /// Where a section may write objects for the batch: the first unused place, and how many
    /// there are. The batch holds them only once [`Batch::filled`] says how many were written.
    pub(super) fn unused(&mut self) -> (*mut usize, usize) {
        (self.objects[self.len..].as_mut_ptr(), self.room())
    }

    /// The next `written` unused places now hold objects that the caller gives to the batch.
    pub(super) fn filled(&mut self, written: usize) {
        assert!(written <= self.room());
        self.len += written;
    }

    /// The objects, for a section to read: valid for `len()` reads while the batch is neither
    /// moved nor changed.
    pub(super) fn as_ptr(&self) -> *const usize {
        self.objects.as_ptr()
    }

    /// Reverses the order of the objects from the `from`th on.
    pub(super) fn reverse_from(&mut self, from: usize) {
        self.objects[from.min(self.len)..self.len].reverse();
    }

    /// Keeps the objects for which `keep` holds, in their order, and gives up the others to
    /// `keep`, which sees each object once.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(*mut u8) -> bool) {
        let mut kept = 0;
        for place in 0..self.len {
            let object = self.objects[place];
            if keep(object as *mut u8) {
                self.objects[kept] = object;
                kept += 1;
            }
        }
        self.len = kept;
    }

    /// Gives up the last `taken` objects, which a section took over.
    pub(super) fn taken(&mut self, taken: usize) {
        assert!(taken <= self.len);
        self.len -= taken;
    }
}

/// One class's list: its lock and count, beside an array of slots that `Caches` keeps.
/// Zeroed memory is an empty, unlocked list.
#[derive(Debug)]
#[repr(align(128))]
pub(super) struct Transfer {
    /// 0, or 1 stamped with the holder's fork generation (`fork_stamp`).
    lock: AtomicU64,
    /// Objects in the slots: the first `count` slots hold their addresses.
    count: AtomicU64,
    /// Batches handed over and taken since the start.
    given: AtomicU64,
    taken: AtomicU64,
    /// `given + taken` when `release_idle` last looked.
    seen: AtomicU64,
}

/// The list, locked: released when dropped.
struct Locked<'a>(&'a Transfer);

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        self.0.lock.store(0, Ordering::Release);
    }
}

/// A list's slots: `capacity` of them from `first`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Slots {
    pub(super) first: *const Slot,
    pub(super) capacity: usize,
}

impl Slots {
    fn slot(&self, at: usize) -> &Slot {
        assert!(at < self.capacity);
        // SAFETY: `first` starts `capacity` initialised slots that live as long as the caches
        // (`Caches` makes them so), at most `capacity` apart from it (checked).
        unsafe { &*self.first.add(at) }
    }
}

impl Transfer {
    /// An empty, unlocked list: what zeroed memory holds, written out for the model checker,
    /// whose atomics are not plain words.
    #[cfg(thiscpu_model)]
    pub(super) fn new() -> Transfer {
        Transfer {
            lock: AtomicU64::new(0),
            count: AtomicU64::new(0),
            given: AtomicU64::new(0),
            taken: AtomicU64::new(0),
            seen: AtomicU64::new(0),
        }
    }

    /// The lock if it is free, or left by the parent of a `fork`; `None` if another thread
    /// of this process holds it.
    fn try_lock(&self) -> Option<Locked<'_>> {
        let mine = fork_stamp::stamp(1, crate::os::fork_generation());
        let held = match self
            .lock
            .compare_exchange(0, mine, Ordering::Acquire, Ordering::Relaxed)
        {
            Ok(_) => return Some(Locked(self)),
            Err(held) => held,
        };
        // A guard is made only once the lock is ours: dropping one releases the lock.
        (fork_stamp::stamped_before_fork(held)
            && self
                .lock
                .compare_exchange(held, mine, Ordering::Acquire, Ordering::Relaxed)
                .is_ok())
        .then(|| Locked(self))
    }

    /// The lock, after up to `BRIEF_TRIES` tries: a holder keeps it for a few dozen
    /// instructions, a copy of at most `MAX_BATCH` addresses, but the lines it copies may have
    /// to come from another CPU's cache first, which can take a few hundred nanoseconds.
    /// `None` if it is still held then (its holder may be preempted).
    fn lock_briefly(&self) -> Option<Locked<'_>> {
        for _ in 1..BRIEF_TRIES {
            if let Some(locked) = self.try_lock() {
                return Some(locked);
            }
            core::hint::spin_loop();
        }
        self.try_lock()
    }

    /// The lock, yielding to its holder up to `PATIENT_ROUNDS` times: a holder that runs
    /// keeps it for a moment, but one this very thread interrupted (a signal handler that
    /// releases) never gives it back, and a release must not hang on it. `None` then.
    fn lock_patiently(&self) -> Option<Locked<'_>> {
        for _ in 0..PATIENT_ROUNDS {
            if let Some(locked) = self.lock_briefly() {
                return Some(locked);
            }
            crate::sync::yield_now();
        }
        None
    }

    /// Hands every object of `batch` over into `slots`, leaving the batch empty, unless the
    /// list is locked by another thread or has no room for all of them: then the batch keeps
    /// them, and the call returns false.
    pub(super) fn give(&self, slots: Slots, batch: &mut Batch) -> bool {
        if batch.len == 0 {
            return true;
        }
        let Some(_locked) = self.lock_briefly() else {
            return false;
        };
        let count = self.count.load(Ordering::Relaxed) as usize;
        if count + batch.len > slots.capacity {
            return false;
        }
        for (at, &object) in batch.objects[..batch.len].iter().enumerate() {
            slots.slot(count + at).store(object, Ordering::Relaxed);
        }
        self.count
            .store((count + batch.len) as u64, Ordering::Relaxed);
        self.given.fetch_add(1, Ordering::Relaxed);
        batch.len = 0;
        true
    }

    /// Takes up to `want` objects (at most the room of `batch`, the caller's empty batch) from
    /// `slots` into `batch`, if the list has any and no other thread holds it; whether it took
    /// any. The caller's batch rather than a returned one, so that a miss keeps one batch on
    /// its stack, not a copy per call it passes through.
    pub(super) fn take(&self, slots: Slots, want: usize, batch: &mut Batch) -> bool {
        if self.count.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let Some(_locked) = self.lock_briefly() else {
            return false;
        };
        let took = self.take_locked(slots, want, batch);
        if took {
            self.taken.fetch_add(1, Ordering::Relaxed);
        }
        took
    }

    /// Takes up to `want` objects into `batch`, the caller's empty batch, waiting a while for
    /// the lock (`lock_patiently`); false once the list is empty, or if the lock stays taken.
    pub(super) fn take_patiently(&self, slots: Slots, want: usize, batch: &mut Batch) -> bool {
        if self.count.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let Some(_locked) = self.lock_patiently() else {
            return false;
        };
        self.take_locked(slots, want, batch)
    }

    /// The top `want` objects (at most the room of `batch`), taken into `batch` by one store
    /// of the count; whether there were any. The caller holds the lock.
    fn take_locked(&self, slots: Slots, want: usize, batch: &mut Batch) -> bool {
        let count = self.count.load(Ordering::Relaxed) as usize;
        let len = count.min(want).min(batch.room());
        if len == 0 {
            return false;
        }
        for at in count - len..count {
            batch.push(slots.slot(at).load(Ordering::Relaxed) as *mut u8);
        }
        self.count.store((count - len) as u64, Ordering::Relaxed);
        true
    }

    /// Whether `object` is in the list now, read without its lock: the count and slots are
    /// atomics, so a list that changes meanwhile gives a stale answer, never a wrong read.
    pub(super) fn holds(&self, slots: Slots, object: usize) -> bool {
        let count = (self.count.load(Ordering::Relaxed) as usize).min(slots.capacity);
        (0..count).any(|at| slots.slot(at).load(Ordering::Relaxed) == object)
    }

    /// Objects in the list now.
    pub(super) fn objects(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Batches handed over and taken since the start.
    pub(super) fn moves(&self) -> (u64, u64) {
        (
            self.given.load(Ordering::Relaxed),
            self.taken.load(Ordering::Relaxed),
        )
    }

    /// Whether no batch moved since the previous call (`false` the first time after a move).
    pub(super) fn idle_since_last_look(&self) -> bool {
        let (given, taken) = self.moves();
        self.seen.swap(given + taken, Ordering::Relaxed) == given + taken
    }
}

#[cfg(all(test, not(thiscpu_model)))]
impl Transfer {
    /// Takes the lock and keeps it until the guard is dropped, as a holder that a signal
    /// handler interrupted would (for tests); panics if it is taken.
    pub(super) fn hold(&self) -> impl Drop + '_ {
        self.try_lock().expect("the list's lock is free")
    }

    /// Leaves the lock taken by a holder of fork generation `generation`, as a thread of the
    /// parent does for the child of a `fork` made while it held the lock (for tests).
    pub(super) fn abandon(&self, generation: u32) {
        self.lock
            .store(fork_stamp::stamp(1, generation), Ordering::SeqCst);
    }
}
