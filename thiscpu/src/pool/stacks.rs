//! The per-CPU stacks of a [`Pool`]'s caches and the restartable sequences on them.
//!
//! Each CPU has a stack: a `count` word and a `stopped` word on one cache line, and an array of
//! `capacity` object pointers on lines of its own. A push is one restartable sequence: check
//! `stopped`, load `count`, leave if the stack is full, store the pointer into the slot beyond
//! `count`, and commit `count + 1`. A pop loads the pointer below `count` and commits
//! `count - 1`. The count is the only committed word, so it is exact: an aborted push leaves a
//! pointer in a slot that no count covers, an aborted pop changes nothing.
//!
//! # Safety
//! The sections index the slots without bounds checks, from the addresses `Stacks` computes;
//! objects go in and out of the slots as raw pointers from `Box::into_raw`. Each block states
//! why it holds.

use super::Pool;
use crate::ops::{self, Position, StackHead, StackOutcome};
use crate::percpu::CachePadded;
use crate::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use core::mem::size_of;

/// Slots per 128-byte chunk: 16 on 64-bit targets, 32 on 32-bit ones.
const CHUNK: usize = 128 / size_of::<AtomicUsize>();
type Chunk = CachePadded<[AtomicUsize; CHUNK]>;
const _: () = assert!(size_of::<Chunk>() == CHUNK * size_of::<AtomicUsize>());

/// One CPU's stack head, and on the same line whether the CPU is in the pool's `touched` mask.
#[derive(Default)]
pub(super) struct Head {
    stack: StackHead,
    /// Set, after the CPU's bit in the pool's `touched` mask, by the first push onto this
    /// stack; never cleared, like the bit.
    touched: AtomicBool,
}

impl core::ops::Deref for Head {
    type Target = StackHead;

    fn deref(&self) -> &StackHead {
        &self.stack
    }
}

/// Every CPU's stack: heads on lines of their own, and `chunks_per_cpu` chunks of slots per
/// CPU on lines of their own.
pub(super) struct Stacks {
    pub(super) heads: Box<[CachePadded<Head>]>,
    chunks: Box<[Chunk]>,
    chunks_per_cpu: usize,
}

impl Stacks {
    /// Stacks for `cpus` CPUs of `capacity` slots each. Panics, before allocating anything, if
    /// the slots would not fit in the address space: the sections index them without bounds
    /// checks, so a wrapped size would let them write past the allocation.
    pub(super) fn new(cpus: usize, capacity: usize) -> Stacks {
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
                .map(|_| CachePadded(core::array::from_fn(|_| AtomicUsize::new(0))))
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

impl<T> Pool<T> {
    /// Pops the stack of `at`'s CPU in one restartable sequence.
    #[inline(always)]
    pub(super) fn pop_at(&self, stacks: &Stacks, at: Position) -> Result<Box<T>, StackOutcome> {
        let cpu = at.index();
        let head: &StackHead = &stacks.heads[cpu as usize];
        let slots = stacks.slots_ptr(cpu as usize);
        // SAFETY: `at` was just read from this thread's area (by CPU); `head`
        // and `slots` are CPU `cpu`'s stack (`cpu` is below the number of heads, as indexing
        // `heads` checked, so `slots` starts `chunks_per_cpu * CHUNK >= capacity` words inside
        // `chunks`), whose count and slots only sections positioned on `cpu` write, or a
        // drainer that set `stopped` and fenced `cpu` (which the section checks).
        let (outcome, item) = unsafe { ops::stack_pop(at, head, slots) };
        match outcome {
            // SAFETY: a committed pop took the pointer below the count: it came from
            // `Box::into_raw` in a committed push, and the count's decrement made this call its
            // only owner.
            StackOutcome::Committed => Ok(unsafe { Box::from_raw(item as *mut T) }),
            other => Err(other),
        }
    }

    /// Pushes onto the stack of `at`'s CPU in one restartable sequence; gives the object back
    /// if the push did not commit.
    #[inline(always)]
    pub(super) fn push_at(
        &self,
        stacks: &Stacks,
        at: Position,
        object: Box<T>,
    ) -> Result<(), (Box<T>, StackOutcome)> {
        let cpu = at.index();
        let head: &Head = &stacks.heads[cpu as usize];
        // Before the object can be in the cache: `Drop` and `drain_all` visit touched CPUs
        // only. The head's flag is set after the bit, and neither is ever cleared, so a flag
        // seen set (acquire) means the bit is set already, by a store that this push, and so
        // `Drop` and any drain after it, happen after. The flag shares the line the section
        // reads next; the mask is only read on the first push onto each CPU's stack.
        if !head.touched.load(Ordering::Acquire) {
            self.touched.set(cpu);
            head.touched.store(true, Ordering::Release);
        }
        let slots = stacks.slots_ptr(cpu as usize);
        let raw = Box::into_raw(object);
        // SAFETY: as in `pop_at`; the capacity is at most the slots' length; `raw` is owned by
        // this call until the push commits.
        let outcome =
            unsafe { ops::stack_push(at, &**head, slots, self.capacity as u64, raw as usize) };
        if outcome == StackOutcome::Committed {
            return Ok(());
        }
        // SAFETY: the push did not commit, so no count covers `raw`: it is still ours.
        Err((unsafe { Box::from_raw(raw) }, outcome))
    }

    /// Pushes onto the current CPU's cache, retrying aborts. Gives the object back with
    /// `Refused` if the cache is full, or `Stopped` if a drainer owns it, this thread cannot
    /// use a cache (no rseq, a CPU beyond the caches), or [`ops::ABORT_LIMIT`] tries in a row
    /// aborted.
    pub(super) fn push_here(
        &self,
        stacks: &Stacks,
        mut object: Box<T>,
    ) -> Result<(), (Box<T>, StackOutcome)> {
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
    pub(super) fn pop_here(&self, stacks: &Stacks) -> Result<Box<T>, StackOutcome> {
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

    /// Empties CPU `cpu`'s stack and returns its objects.
    ///
    /// # Safety
    /// No restartable sequence may commit on that stack until this returns: the stack is
    /// stopped and its CPU fenced, or the pool is exclusively borrowed.
    pub(super) unsafe fn take_stack(&self, stacks: &Stacks, cpu: u32) -> Vec<Box<T>> {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::Caches;

    /// Each way a pop can end, through the section itself (on x86_64 the pop reports them as
    /// codes in a register, which the pool's public behaviour would hide if two were swapped):
    /// an empty stack refuses, a stopped one stops and keeps its objects, a pushed object comes
    /// back out.
    #[test]
    fn a_pop_refuses_an_empty_stack_stops_a_stopped_one_and_returns_what_was_pushed() {
        let pool = Pool::with_capacity(4, || 0u64);
        let Caches::Rseq(stacks) = &pool.caches else {
            eprintln!("no rseq in this process: the pool caches under locks, no section to test");
            return;
        };
        let cpu = crate::topology::allowed_cpus().unwrap()[0];
        let _pinned = crate::topology::pin_to(cpu).unwrap();
        // Pinned, a section aborts only when preempted or signalled: retry those.
        let pop = || loop {
            let at = ops::position().expect("a process with rseq registers its threads");
            assert_eq!(at.index(), cpu);
            match pool.pop_at(stacks, at) {
                Err(StackOutcome::Aborted) => continue,
                other => return other.map(|object| *object),
            }
        };
        let push = |value: u64| {
            let mut object = Box::new(value);
            loop {
                let at = ops::position().unwrap();
                match pool.push_at(stacks, at, object) {
                    Ok(()) => return,
                    Err((back, StackOutcome::Aborted)) => object = back,
                    Err((_, other)) => panic!("push of {value}: {other:?}"),
                }
            }
        };

        assert_eq!(pop(), Err(StackOutcome::Refused));
        push(7);
        push(8);
        assert_eq!(pop(), Ok(8));
        let head = &stacks.heads[cpu as usize];
        head.stopped.store(1, Ordering::SeqCst);
        assert_eq!(pop(), Err(StackOutcome::Stopped));
        head.stopped.store(0, Ordering::SeqCst);
        assert_eq!(pop(), Ok(7), "a stopped pop left the object in place");
        assert_eq!(pop(), Err(StackOutcome::Refused));
    }

    #[test]
    #[should_panic(expected = "do not fit in the address space")]
    fn stacks_refuse_a_size_that_wraps() {
        // 2^60 chunks per CPU times 16 CPUs is 2^64: 0 once wrapped.
        let _ = Stacks::new(16, usize::MAX);
    }
}
