//! The per-CPU caches of a [`super::PerCpuAlloc`]: one range of fresh zeroed address space
//! (`os::reserve_zeroed`, not the inner allocator) that holds a header and, for every possible
//! CPU, a region of its own. The allocator behind the caches (here `inner`: the own heap, or the
//! inner allocator) holds only the cached objects.
//!
//! A CPU's region holds, each part starting on a line of its own:
//! - a stack head (`count`, `stopped`) per size class, as tcmalloc's slab keeps one per class;
//! - the tallies of hits, misses and spills, written only by restartable sequences on that
//!   CPU (a thread that cannot commit one adds it atomically to a word beside them instead);
//! - the pass-through count and the releaser's notes, updated atomically;
//! - each class's slots: room for its most objects (`Capacities::most`), of which a push uses
//!   up to the class's capacity now (`Capacities::limit`, moved between the classes as the
//!   program asks, see `capacity`).
//!
//! A pop and a push are one guarded stack section each: check `stopped`, read `count`, move
//! one address, commit the count with one store. The count is the only word they commit, so it
//! is exact: an aborted push leaves an address in a slot no count covers, an aborted pop
//! changes nothing. The fast path's sections (`ops::stack_pop_here`, `ops::stack_push_here`)
//! read the CPU inside themselves and find its stack from it: a class's head and slots lie at
//! the same place in every CPU's region and the regions are a power of two apart, so the
//! caller passes CPU 0's addresses and the stride, and reads no CPU before the section. The
//! slow path's (`ops::stack_pop`, `ops::stack_push`, the pool's) check a CPU read before them,
//! which the slow path also needs for its tallies.
//!
//! # Releasing a CPU's cache
//! Under the release lock, the releaser stores `RELEASING` into `stopped` on every class of
//! the CPU, fences that CPU once (`fence::fence_cpu`: a section that read `stopped` clear
//! before the store has committed or aborted when the fence returns, and every later one sees
//! it set and leaves), gives every cached object back to the inner allocator, stores 0 into
//! each count and clears the flags with a release store. Sections never write `stopped`, the
//! watch below never overwrites `RELEASING`, and releases are serialised, so no step has to
//! check that it still owns the flags. Where membarrier is refused, the releaser runs on the
//! CPU and pops its stacks there with the same sections.
//!
//! # Watching for idle CPUs
//! `release_idle` releases a CPU only if, since its previous look, the CPU's fingerprint
//! (`activity`: counts, misses, spills, hits) did not change *and* no section ran on any of
//! its classes. Calls served from the cache change neither counts nor tallies (hits are
//! counted only when asked for), so the second test needs a mark: at each look that does not
//! release a CPU holding objects, the watcher stores `WATCHED` into every class's `stopped`
//! where it is 0 (a compare-exchange, so never over a releaser's `RELEASING`). Sections read
//! the word as they always do and leave for the slow path at any non-zero value; the slow path
//! clears a `WATCHED` (compare-exchange back to 0, so never a `RELEASING` either) and retries
//! its section, and passes through to the inner allocator only at `RELEASING`. At the next
//! look a class still marked was not touched since the mark, so a CPU counts as idle when its
//! fingerprint is unchanged and every class is still marked. A busy CPU pays one trip through
//! the slow path per class it uses per look; the fast path is unchanged (it already left at a
//! non-zero `stopped`). A release stores `RELEASING` over any mark and clears every flag to 0
//! when it ends, so it ends the watch too.
//!
//! # Memory
//! Pages are touched only where a CPU pushes: the region is fresh address space, which reads
//! as zero until written (zero is an empty stack, an unset flag and a zero counter), so a CPU
//! that never caches costs address space only. Not from the inner allocator: `alloc_zeroed`
//! may zero what it returns by writing it (`System` does for an alignment above 16), which
//! makes every page of every CPU resident at the first allocation. The classes' capacities add
//! up to at most `per_cpu_bytes`, so a CPU's cache settles within it; at any moment it holds at
//! most its classes' most objects (see `capacity`).
//!
//! # Safety
//! The sections index the slots without bounds checks, from addresses computed here; the
//! releaser reads and writes a stopped and fenced CPU's stacks. Each block states why it holds.

use super::capacity::Capacities;
use super::classes::{CLASS_SIZES, CLASSES, class_layout};
use super::fork_stamp;
use super::transfer::{self, Batch, MAX_BATCH, Transfer};
use crate::decided_once::Claimants;
use crate::fence::{self, FenceUnavailable};
use crate::ops::{self, ByCpu, Position, StackHead, StackOutcome};
use crate::sync::atomic::{AtomicU64 as SectionWord, AtomicUsize as Slot};
use crate::topology;
use core::alloc::GlobalAlloc;
use core::mem::size_of;
use core::sync::atomic::{AtomicU64, Ordering};

/// `stopped` while a releaser owns the stack (see the module documentation).
const RELEASING: u64 = 1;
/// `stopped` while `release_idle` waits to see whether the CPU uses the class.
const WATCHED: u64 = 2;

/// One pass-through in this many, per CPU, asks the system whether the release it waits for
/// still has its holder: a holder that died in this process is rare (a release unwinds
/// through its guards), and the question costs two system calls.
const LIVENESS_EVERY: u64 = 1024;

/// The release lock's word for a holder: its thread id, stamped with the fork generation it
/// took the lock in (`fork_stamp`).
fn holder_word(thread: i32, generation: u32) -> u64 {
    fork_stamp::stamp(thread as u32, generation)
}

/// The thread id in a held lock word.
fn holder_thread(word: u64) -> i32 {
    fork_stamp::mark(word) as i32
}

/// The alignment of each part of a region: a cache line on every supported machine.
const LINE: usize = 128;

/// What a CPU's tallies count: the index of each one's word.
#[derive(Clone, Copy, Debug)]
pub(super) enum Tally {
    /// Allocations served from the cache (counted only when asked for).
    Hits = 0,
    /// Allocations that found the cache empty.
    Misses = 1,
    /// Frees that found it full.
    Spills = 2,
}

const TALLIES: usize = 3;

/// One CPU's counters that sections do not write: updated with atomic read-modify-writes,
/// rarely (a call that found the cache being released), and the releaser's note.
#[derive(Default)]
#[repr(C)]
pub(super) struct SlowCounters {
    pub(super) passed: AtomicU64,
    /// Tallies of this CPU that no section could commit (a thread that aborted
    /// `ABORT_LIMIT` times in a row), by `Tally`.
    uncommitted: [AtomicU64; TALLIES],
    /// What `release_idle` saw of the CPU last time (see `Caches::activity`).
    seen: AtomicU64,
}

/// The header of the caches' range, and the map of a CPU's region.
pub(super) struct Caches {
    /// Start of CPU 0's region.
    base: *mut u8,
    /// Regions: possible CPUs when the caches were made.
    pub(super) cpus: usize,
    /// log2 of the bytes from one CPU's region to the next (a power of two: a shift, not a
    /// multiplication, on the fast path).
    stride_shift: u32,
    counters_offset: usize,
    tallies_offset: usize,
    slot_offsets: [usize; CLASSES],
    /// Each class's capacity per CPU, and the most it may grow to.
    capacity: Capacities<CLASSES>,
    /// Each class's transfer list's slots: its first share of a CPU's budget.
    transfer_capacities: [u64; CLASSES],
    /// The length of the whole range, header included, as `os::reserve_zeroed` was asked.
    length: usize,
    /// The holder of the release lock (`holder_word`), 0 if none.
    releasing: AtomicU64,
    /// Each class's transfer list: batches of objects between CPUs' caches, in the range
    /// after this header, `CLASSES` of them, zeroed (an empty, unlocked list).
    transfers: *const Transfer,
    /// Each list's slots, after the lists: `transfer_capacities[class]` each.
    transfer_slots: [*const Slot; CLASSES],
    /// Liveness checks of a holder (system calls) made on this allocator's behalf.
    #[cfg(test)]
    liveness_checks: AtomicU64,
}

// The header and every part start on a line of the range, whose start is aligned to
// `RESERVED_ALIGN`.
const _: () = assert!(LINE <= crate::os::RESERVED_ALIGN && LINE >= align_of::<Caches>());

/// LeakSanitizer looks for pointers in the heap, globals, stacks and thread-locals, not in
/// mapped ranges: the objects a cache holds are reachable only from the caches' range, which
/// is one, and a process built with it would report every cached object as leaked at exit.
/// The range is registered as a root while it exists.
#[cfg(thiscpu_lsan)]
pub(super) mod leak_roots {
    use core::ffi::c_void;

    unsafe extern "C" {
        fn __lsan_register_root_region(start: *const c_void, size: usize);
        fn __lsan_unregister_root_region(start: *const c_void, size: usize);
    }

    pub(in crate::allocator) fn register(start: *const u8, length: usize) {
        // SAFETY: the sanitizer's runtime, linked in by `-Zsanitizer`, records the range in its
        // list of roots and reads nothing now; at a leak check it reads the range, a live
        // mapping of `length` bytes until `unregister`.
        unsafe { __lsan_register_root_region(start.cast(), length) };
    }

    pub(in crate::allocator) fn unregister(start: *const u8, length: usize) {
        // SAFETY: removes the root `register` recorded, with the same start and length, before
        // the range is unmapped.
        unsafe { __lsan_unregister_root_region(start.cast(), length) };
    }
}

/// Rounds `n` up to a multiple of `to`, a power of two.
const fn round_up(n: usize, to: usize) -> usize {
    (n + to - 1) & !(to - 1)
}

impl Caches {
    /// Reserves and initialises the caches of `cpus` CPUs holding at most `per_cpu_bytes`
    /// each. `None` if the system refuses the address space, or if nothing would be cached.
    pub(super) fn allocate(cpus: usize, per_cpu_bytes: usize) -> Option<*const Caches> {
        let capacity = Capacities::new(CLASS_SIZES, per_cpu_bytes);
        let most: [u64; CLASSES] = core::array::from_fn(|class| capacity.most(class));
        let transfer_capacities: [u64; CLASSES] =
            core::array::from_fn(|class| capacity.limit(class));
        if most.iter().all(|&most| most == 0) || cpus == 0 {
            return None;
        }
        let heads = CLASSES * size_of::<StackHead>();
        let counters_offset = round_up(heads, LINE);
        let tallies_offset = round_up(counters_offset + size_of::<SlowCounters>(), LINE);
        let mut slot_offsets = [0usize; CLASSES];
        let mut end = round_up(tallies_offset + TALLIES * size_of::<SectionWord>(), LINE);
        for (offset, &most) in slot_offsets.iter_mut().zip(&most) {
            *offset = end;
            end += most as usize * size_of::<Slot>();
        }
        let stride = end.next_power_of_two();
        let stride_shift = stride.trailing_zeros();
        let transfers_offset = round_up(size_of::<Caches>(), LINE);
        let mut transfer_slot_offsets = [0usize; CLASSES];
        let mut header = round_up(transfers_offset + CLASSES * size_of::<Transfer>(), LINE);
        for (offset, &capacity) in transfer_slot_offsets.iter_mut().zip(&transfer_capacities) {
            *offset = header;
            header += capacity as usize * size_of::<Slot>();
        }
        let header = round_up(header, LINE);
        let length = stride.checked_mul(cpus)?.checked_add(header)?;
        let start = crate::os::reserve_zeroed(length)?.as_ptr();
        // Before any release lock is taken: a lock word of this process then names the
        // generation every later fork's child tells apart from its own.
        crate::os::count_forks();
        #[cfg(thiscpu_lsan)]
        leak_roots::register(start, length);
        // SAFETY: `header` bytes from `start` lie inside the range (`length` is larger).
        let base = unsafe { start.add(header) };
        let caches = start.cast::<Caches>();
        // SAFETY: the range starts with room for a `Caches` (`header` bytes), aligned to
        // `RESERVED_ALIGN`, which is enough (asserted beside `LINE`), and nothing else uses it.
        unsafe {
            caches.write(Caches {
                base,
                cpus,
                stride_shift,
                counters_offset,
                tallies_offset,
                slot_offsets,
                capacity,
                transfer_capacities,
                length,
                releasing: AtomicU64::new(0),
                transfers: start.wrapping_add(transfers_offset).cast(),
                transfer_slots: transfer_slot_offsets
                    .map(|offset| start.wrapping_add(offset).cast_const().cast()),
                #[cfg(test)]
                liveness_checks: AtomicU64::new(0),
            })
        };
        // SAFETY: just written.
        let made = unsafe { &*caches };
        // Zeroed memory is an empty stack, an unset flag and zero counters; the model checker's
        // atomics are not plain words and must be made in place.
        #[cfg(thiscpu_model)]
        for class in 0..CLASSES {
            // SAFETY: inside the header's room for the lists and their slots, aligned (the
            // lists start on a line, and a `Transfer` is a line; slots are words), and nothing
            // refers to them yet.
            unsafe {
                made.transfers.cast_mut().add(class).write(Transfer::new());
                for slot in 0..made.transfer_capacities[class] as usize {
                    made.transfer_slots[class]
                        .cast_mut()
                        .add(slot)
                        .write(Slot::new(0));
                }
            }
        }
        #[cfg(thiscpu_model)]
        for cpu in 0..cpus {
            // SAFETY: every address is inside CPU `cpu`'s region, aligned for its type (the
            // parts start on lines, and the types' sizes are multiples of their alignments),
            // and nothing refers to it yet.
            unsafe {
                for class in 0..CLASSES {
                    made.head(cpu, class).cast_mut().write(StackHead::default());
                    let slots = made.slots(cpu, class).cast::<Slot>();
                    for slot in 0..made.capacity.most(class) as usize {
                        slots.add(slot).write(Slot::new(0));
                    }
                }
                for tally in 0..TALLIES {
                    made.tally_word(cpu, tally)
                        .cast::<SectionWord>()
                        .write(SectionWord::new(0));
                }
            }
        }
        Some(made)
    }

    /// Gives every cached object back to `inner`, and the caches' range to the system.
    ///
    /// # Safety
    /// `caches` came from [`Caches::allocate`], its objects from `inner`, and nothing else uses
    /// it any more: no section runs on it and no reference to it outlives this call.
    pub(super) unsafe fn free<A: GlobalAlloc>(caches: *const Caches, inner: &A) {
        // SAFETY: the caller's contract: the caches are ours alone.
        let this = unsafe { &*caches };
        // SAFETY: nothing else uses the caches, so the lists' objects are ours.
        unsafe { this.empty_transfers(inner, |_| true) };
        #[cfg(thiscpu_model)]
        for class in 0..CLASSES {
            // SAFETY: made in place by `allocate`, and dropped once, here.
            unsafe {
                core::ptr::drop_in_place(this.transfers.cast_mut().add(class));
                for slot in 0..this.transfer_capacities[class] as usize {
                    core::ptr::drop_in_place(this.transfer_slots[class].cast_mut().add(slot));
                }
            }
        }
        for cpu in 0..this.cpus {
            // SAFETY: nothing else uses the caches, so every stack is ours.
            unsafe { this.empty_owned(cpu, inner) };
            #[cfg(thiscpu_model)]
            // SAFETY: made in place by `allocate`, and dropped once, here.
            unsafe {
                for class in 0..CLASSES {
                    core::ptr::drop_in_place(this.head(cpu, class).cast_mut());
                    let slots = this.slots(cpu, class).cast::<Slot>();
                    for slot in 0..this.capacity.most(class) as usize {
                        core::ptr::drop_in_place(slots.add(slot));
                    }
                }
                for tally in 0..TALLIES {
                    core::ptr::drop_in_place(this.tally_word(cpu, tally).cast::<SectionWord>());
                }
            }
        }
        let length = this.length;
        #[cfg(thiscpu_lsan)]
        leak_roots::unregister(caches.cast(), length);
        // SAFETY: `allocate` returned the start of the range it reserved, never null.
        let start = unsafe { core::ptr::NonNull::new_unchecked(caches.cast_mut().cast::<u8>()) };
        // SAFETY: the range `allocate` reserved, which starts with the header, with the length
        // it was reserved with; `this` is not used after this, and nothing else refers to the
        // range (the caller's contract). The header needs no drop (atomics and numbers).
        unsafe { crate::os::unreserve(start, length) };
    }

    /// `class`'s transfer list.
    fn transfer(&self, class: usize) -> &Transfer {
        assert!(class < CLASSES);
        // SAFETY: one of the `CLASSES` lists in the header's room for them (checked),
        // initialised (zeroed, or made in place under the model), only accessed through shared
        // references.
        unsafe { &*self.transfers.add(class) }
    }

    /// CPU `cpu`'s head for `class` (`cpu` below `self.cpus`).
    #[inline(always)]
    fn head(&self, cpu: usize, class: usize) -> *const StackHead {
        self.base
            .wrapping_add((cpu << self.stride_shift) + class * size_of::<StackHead>())
            .cast()
    }

    /// CPU `cpu`'s first slot for `class` (`cpu` below `self.cpus`).
    #[inline(always)]
    fn slots(&self, cpu: usize, class: usize) -> *mut usize {
        self.base
            .wrapping_add((cpu << self.stride_shift) + self.slot_offsets[class])
            .cast()
    }

    /// CPU `cpu`'s word for tally number `tally` (`cpu` below `self.cpus`).
    fn tally_word(&self, cpu: usize, tally: usize) -> *mut u64 {
        self.base
            .wrapping_add(
                (cpu << self.stride_shift) + self.tallies_offset + tally * size_of::<SectionWord>(),
            )
            .cast()
    }

    /// CPU `cpu`'s slow-path counters (`cpu` below `self.cpus`).
    pub(super) fn counters(&self, cpu: usize) -> &SlowCounters {
        assert!(cpu < self.cpus);
        // SAFETY: inside CPU `cpu`'s region (checked), on a line of its own, zero-initialised
        // (a valid `SlowCounters`), and only ever accessed through shared references.
        unsafe {
            &*self
                .base
                .add((cpu << self.stride_shift) + self.counters_offset)
                .cast::<SlowCounters>()
        }
    }

    /// CPU `cpu`'s head for `class`, as a reference (`cpu` below `self.cpus`).
    fn head_ref(&self, cpu: usize, class: usize) -> &StackHead {
        assert!(cpu < self.cpus && class < CLASSES);
        // SAFETY: inside CPU `cpu`'s region (checked), initialised (zeroed or made in place),
        // and only ever accessed through shared references and the sections.
        unsafe { &*self.head(cpu, class) }
    }

    /// Slot `slot` of CPU `cpu`'s stack for `class` (all in bounds).
    fn slot_ref(&self, cpu: usize, class: usize, slot: usize) -> &Slot {
        assert!(cpu < self.cpus && class < CLASSES && slot < self.capacity.most(class) as usize);
        // SAFETY: inside the class's slots (checked), initialised, accessed atomically here.
        unsafe { &*self.slots(cpu, class).cast::<Slot>().add(slot) }
    }

    /// One try at popping an object of `class` from the cache of `at`'s CPU. `at.index()` must
    /// be below `self.cpus` (checked by the caller, so that the fast path checks once).
    ///
    /// # Safety
    /// `at` was read by the calling thread just now; `at.index() < self.cpus`.
    #[inline(always)]
    pub(super) unsafe fn pop_at(&self, at: Position<ByCpu>, class: usize) -> (StackOutcome, usize) {
        let cpu = at.index() as usize;
        // SAFETY: the head and slots are CPU `cpu`'s stack for `class` (`cpu < self.cpus` by
        // the caller's contract, `class < CLASSES` by its type's construction), whose count and
        // slots only sections positioned on `cpu` write, or a releaser that set `stopped` and
        // fenced `cpu`, which the section checks.
        unsafe { ops::stack_pop(at, self.head(cpu, class), self.slots(cpu, class)) }
    }

    /// One try at pushing `object` onto the cache of `at`'s CPU for `class`.
    ///
    /// # Safety
    /// As for [`Caches::pop_at`]; `object` is an allocation of `class`'s layout by the inner
    /// allocator that the caller owns, and gives up if the push commits.
    #[inline(always)]
    pub(super) unsafe fn push_at(
        &self,
        at: Position<ByCpu>,
        class: usize,
        object: *mut u8,
    ) -> StackOutcome {
        let cpu = at.index() as usize;
        // SAFETY: as in `pop_at`; the class's capacity is at most the slots its region has
        // (`Capacities::limit`), whichever capacity the section compares the count with.
        unsafe {
            ops::stack_push(
                at,
                self.head(cpu, class),
                self.slots(cpu, class),
                self.capacity.limit(class),
                object as usize,
            )
        }
    }

    /// One try at popping up to `max` objects of `class` from the cache of `at`'s CPU into
    /// `out`, in one section; how many it took, meaningful only when committed.
    ///
    /// # Safety
    /// As for [`Caches::pop_at`]; `out` is valid for `max` writes and only the calling thread
    /// uses it.
    unsafe fn pop_batch_at(
        &self,
        at: Position<ByCpu>,
        class: usize,
        out: *mut usize,
        max: usize,
    ) -> (StackOutcome, usize) {
        let cpu = at.index() as usize;
        // SAFETY: as in `pop_at`; `out` as the caller says.
        unsafe { ops::stack_pop_batch(at, self.head(cpu, class), self.slots(cpu, class), out, max) }
    }

    /// One try at pushing the last of the `len` objects at `items` onto the cache of `at`'s
    /// CPU for `class`, as many as fit, in one section; how many it took (the last ones),
    /// meaningful only when committed.
    ///
    /// # Safety
    /// As for [`Caches::push_at`], for each of the `len` objects at `items`, which the caller
    /// gives up as far as the push takes them.
    unsafe fn push_batch_at(
        &self,
        at: Position<ByCpu>,
        class: usize,
        items: *const usize,
        len: usize,
    ) -> (StackOutcome, usize) {
        let cpu = at.index() as usize;
        // SAFETY: as in `push_at`; `items` as the caller says.
        unsafe {
            ops::stack_push_batch(
                at,
                self.head(cpu, class),
                self.slots(cpu, class),
                self.capacity.limit(class),
                items,
                len,
            )
        }
    }

    /// An object of `class` popped from the cache of the CPU the calling thread runs on, read
    /// inside the section; `None` if the section did not commit (see `ops::stack_pop_here`: an
    /// empty or stopped cache, an abort, a thread without rseq): the slow path says which.
    #[inline(always)]
    pub(super) fn pop_here(&self, class: usize) -> Option<*mut u8> {
        // SAFETY: CPU `c`'s head and slots for `class` lie `c << stride_shift` bytes after CPU
        // 0's (`head`, `slots`) for every `c < self.cpus`, in regions the caches own, and only
        // sections running on `c` or a releaser that set `stopped` and fenced `c` write them;
        // cached objects are never null.
        let object = unsafe {
            ops::stack_pop_here(
                self.cpus as u64,
                self.stride_shift,
                self.head(0, class),
                self.slots(0, class),
            )
        };
        (object != 0).then_some(object as *mut u8)
    }

    /// One try at pushing `object` onto the cache of the CPU the calling thread runs on, read
    /// inside the section (see `ops::stack_push_here`).
    ///
    /// # Safety
    /// `object` is an allocation of `class`'s layout by the backing that the caller owns, and
    /// gives up if the push commits.
    #[inline(always)]
    pub(super) unsafe fn push_here(&self, class: usize, object: *mut u8) -> StackOutcome {
        // SAFETY: as in `pop_here`; the class's capacity is at most the slots its region has
        // (`Capacities::limit`), whichever capacity the section compares the count with.
        unsafe {
            ops::stack_push_here(
                self.cpus as u64,
                self.stride_shift,
                self.head(0, class),
                self.slots(0, class),
                self.capacity.limit(class),
                object as usize,
            )
        }
    }

    /// How many objects an empty cache of `class` takes at once: half its capacity, at most
    /// `MAX_BATCH`.
    pub(super) fn batch_length(&self, class: usize) -> usize {
        (self.capacity.limit(class) as usize / 2).clamp(1, MAX_BATCH)
    }

    /// How many objects a full cache hands to `class`'s transfer list at once: half its
    /// capacity, so that the frees after a spill find room, at most what the list holds.
    fn hand_over_length(&self, class: usize) -> usize {
        self.batch_length(class)
            .min(self.transfer_capacities[class] as usize)
            .max(1)
    }

    /// `class` missed or spilled on some CPU: it may grow (see `capacity`).
    pub(super) fn ask_for_room(&self, class: usize) {
        self.capacity.ask(class, crate::os::fork_generation());
    }

    /// The most bytes one CPU's cache can hold: every class's most objects.
    pub(super) fn bound_bytes(&self) -> u64 {
        CLASS_SIZES
            .iter()
            .enumerate()
            .map(|(class, &size)| self.capacity.most(class) * size as u64)
            .sum()
    }

    /// Growths of a class's capacity since the start.
    pub(super) fn growths(&self) -> u64 {
        self.capacity.growths()
    }

    /// `class`'s transfer list's slots: one CPU's share of the class, so that the layer adds at
    /// most one CPU's worth of cached bytes to the caches' bound.
    fn transfer_slots(&self, class: usize) -> transfer::Slots {
        transfer::Slots {
            first: self.transfer_slots[class],
            capacity: self.transfer_capacities[class] as usize,
        }
    }

    /// For a free that found its cache of `class` full: `object` and up to a batch's worth more
    /// taken from the calling thread's CPU's cache, handed to the class's transfer list. Returns
    /// what the list did not take (it is locked by another thread, or full), for the inner
    /// allocator: an empty batch when it took them.
    ///
    /// # Safety
    /// `object` is an allocation of `class`'s layout by the inner allocator that the caller
    /// gives up.
    pub(super) unsafe fn hand_over(&self, class: usize, object: *mut u8) -> Batch {
        let mut batch = Batch::new();
        batch.push(object);
        let more = self.hand_over_length(class) - 1;
        if more > 0
            && let Some(at) = ops::position()
            && (at.index() as usize) < self.cpus
        {
            let (unused, room) = batch.unused();
            // SAFETY: `at` was just read on this thread; its index is below the CPUs; the
            // batch's unused places are this call's, and the pop writes at most `room`.
            let (outcome, popped) = unsafe { self.pop_batch_at(at, class, unused, more.min(room)) };
            if outcome == StackOutcome::Committed {
                // A committed pop made this call the objects' only owner. Top first, as
                // popping one at a time would give them.
                batch.filled(popped);
                batch.reverse_from(1);
            }
        }
        self.transfer(class)
            .give(self.transfer_slots(class), &mut batch);
        batch
    }

    /// For an allocation that found its cache of `class` empty: a batch from the class's
    /// transfer list into `batch` (the caller's, empty), one object of it for the caller and
    /// the rest pushed onto the calling thread's CPU's cache (those that do not fit go to
    /// `inner`), which leaves `batch` empty; `None` if the list has no batch or another thread
    /// holds it.
    pub(super) fn take_over_batch<A: GlobalAlloc>(
        &self,
        class: usize,
        batch: &mut Batch,
        inner: &A,
    ) -> Option<*mut u8> {
        if !self
            .transfer(class)
            .take(self.transfer_slots(class), self.batch_length(class), batch)
        {
            return None;
        }
        let object = batch.pop()?;
        self.keep(class, batch, inner);
        Some(object)
    }

    /// Pushes the objects of `batch`, of `class` and the caller's, onto the calling thread's
    /// CPU's cache in one section, again after an abort (a preemption or a signal should not
    /// send them to the inner allocator); those that do not fit, or all of them when the cache
    /// is stopped, the thread has no CPU to push on or it kept aborting, go to `inner`.
    pub(super) fn keep<A: GlobalAlloc>(&self, class: usize, batch: &mut Batch, inner: &A) {
        let mut aborts = ops::AbortRun::new();
        // The first object ends on top, as pushing them from last to first one at a time would
        // leave them.
        batch.reverse_from(0);
        while batch.len() > 0 {
            let Some(at) = ops::position() else { break };
            if at.index() as usize >= self.cpus {
                break;
            }
            // SAFETY: `at` was just read on this thread, its index is below the CPUs, and the
            // batch's objects are the caller's to give; the batch stays put during the call.
            match unsafe { self.push_batch_at(at, class, batch.as_ptr(), batch.len()) } {
                (StackOutcome::Committed, pushed) => {
                    // The cache took the last `pushed`; the rest did not fit.
                    batch.taken(pushed);
                    break;
                }
                (StackOutcome::Aborted, _) if !aborts.gives_up() => ops::note_abort(),
                _ => break,
            }
        }
        while let Some(rest) = batch.pop() {
            // SAFETY: an object of the class's layout by `inner` (every cached object is),
            // which no push took.
            unsafe { inner.dealloc(rest, class_layout(class)) };
        }
    }

    /// Gives the objects of the transfer lists of the classes for which `chosen(class)` holds
    /// back to `inner`; the bytes.
    ///
    /// # Safety
    /// Every object in the lists is an allocation of its class's layout by `inner`.
    pub(super) unsafe fn empty_transfers<A: GlobalAlloc>(
        &self,
        inner: &A,
        mut chosen: impl FnMut(&Transfer) -> bool,
    ) -> u64 {
        let mut bytes = 0;
        for (class, &size) in CLASS_SIZES.iter().enumerate() {
            let transfer = self.transfer(class);
            if !chosen(transfer) {
                continue;
            }
            let mut batch = Batch::new();
            while transfer.take_patiently(self.transfer_slots(class), MAX_BATCH, &mut batch) {
                while let Some(object) = batch.pop() {
                    // SAFETY: the caller's contract; taking the batch made its objects ours.
                    unsafe { inner.dealloc(object, class_layout(class)) };
                    bytes += size as u64;
                }
            }
        }
        bytes
    }

    /// Objects and bytes in the transfer lists now, and batches handed over and taken since
    /// the start.
    pub(super) fn transferring(&self) -> TransferFigures {
        let mut figures = TransferFigures::default();
        for (class, size) in CLASS_SIZES.iter().enumerate() {
            let transfer = self.transfer(class);
            let objects = transfer.objects();
            let (given, taken) = transfer.moves();
            figures.objects += objects;
            figures.bytes += objects * *size as u64;
            figures.given += given;
            figures.taken += taken;
        }
        figures
    }

    /// Counts one `tally` on the CPU of `at` (which the caller just read, on a CPU below
    /// `self.cpus`), or, if that section aborts, on the calling thread's CPU then, retrying; a
    /// thread that cannot commit the count adds it atomically to that CPU's uncommitted word,
    /// so that the total stays exact.
    pub(super) fn count(&self, mut at: Position<ByCpu>, tally: Tally) {
        let mut aborts = ops::AbortRun::new();
        let mut cpu = at.index() as usize;
        loop {
            // SAFETY: `at` was read by this thread; the word is CPU `cpu`'s tally, written only
            // by sections positioned on `cpu` (like this one), 8-byte aligned, on a line that
            // no other CPU writes; readers load it atomically.
            match unsafe { ops::load_add_store(at, self.tally_word(cpu, tally as usize), 1) } {
                ops::Outcome::Committed(()) => return,
                _ => {
                    ops::note_abort();
                    if aborts.gives_up() {
                        break;
                    }
                }
            }
            match ops::position() {
                Some(now) if (now.index() as usize) < self.cpus => {
                    at = now;
                    cpu = at.index() as usize;
                }
                _ => break,
            }
        }
        self.counters(cpu).uncommitted[tally as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// `tally` counted on CPU `cpu`.
    pub(super) fn tally(&self, cpu: usize, tally: Tally) -> u64 {
        let uncommitted = self.counters(cpu).uncommitted[tally as usize].load(Ordering::Relaxed);
        // SAFETY: CPU `cpu`'s tally word (`counters` checked the CPU), initialised; sections
        // write it with plain stores of whole words, which an atomic load may read.
        let committed = unsafe { &*self.tally_word(cpu, tally as usize).cast::<SectionWord>() }
            .load(Ordering::Relaxed);
        committed + uncommitted
    }

    /// Whether `object` is cached in `class` now, on any CPU or in the class's transfer list,
    /// read without stopping anything (see `PerCpuAlloc::caches_object`).
    pub(super) fn holds(&self, class: usize, object: usize) -> bool {
        let on_a_cpu = (0..self.cpus).any(|cpu| {
            let count = self.head_ref(cpu, class).count.load(Ordering::Relaxed);
            let count = count.min(self.capacity.most(class)) as usize;
            (0..count).any(|slot| self.slot_ref(cpu, class, slot).load(Ordering::Relaxed) == object)
        });
        on_a_cpu
            || self
                .transfer(class)
                .holds(self.transfer_slots(class), object)
    }

    /// Objects and bytes in CPU `cpu`'s cache now.
    pub(super) fn cached(&self, cpu: usize) -> (u64, u64) {
        let mut objects = 0;
        let mut bytes = 0;
        for (class, size) in CLASS_SIZES.iter().enumerate() {
            let count = self.head_ref(cpu, class).count.load(Ordering::Relaxed);
            objects += count;
            bytes += count * *size as u64;
        }
        (objects, bytes)
    }

    /// The bytes of one CPU's capacities now: what its cache settles within.
    pub(super) fn capacity_bytes(&self) -> u64 {
        self.capacity.used_bytes()
    }

    /// A fingerprint of CPU `cpu`'s cache: its counts and its slow paths' counters. Unchanged
    /// between two looks means no miss, spill or change of contents in between.
    pub(super) fn activity(&self, cpu: usize) -> u64 {
        let mut fingerprint = 0xcbf2_9ce4_8422_2325u64;
        let counts =
            (0..CLASSES).map(|class| self.head_ref(cpu, class).count.load(Ordering::Relaxed));
        for word in [
            self.tally(cpu, Tally::Misses),
            self.tally(cpu, Tally::Spills),
            self.tally(cpu, Tally::Hits),
        ]
        .into_iter()
        .chain(counts)
        {
            fingerprint = (fingerprint ^ word).wrapping_mul(0x0100_0000_01b3);
        }
        fingerprint | 1
    }

    /// Marks every class of CPU `cpu` that is neither marked nor being released as watched:
    /// the next call that uses the class clears the mark, and `watched` tells.
    pub(super) fn watch(&self, cpu: usize) {
        for class in 0..CLASSES {
            let stopped = &self.head_ref(cpu, class).stopped;
            // A plain load first: a class still marked needs no locked instruction, and its
            // line is not taken from the CPU that reads it on every section.
            if stopped.load(Ordering::Relaxed) == 0 {
                let _ = stopped.compare_exchange(0, WATCHED, Ordering::Relaxed, Ordering::Relaxed);
            }
        }
    }

    /// Whether every class of CPU `cpu` still carries the mark of `watch`: no section of the
    /// CPU found one cleared since, and no release ran on it.
    pub(super) fn watched(&self, cpu: usize) -> bool {
        (0..CLASSES)
            .all(|class| self.head_ref(cpu, class).stopped.load(Ordering::Relaxed) == WATCHED)
    }

    /// For a call whose section on CPU `cpu` left at `class`'s `stopped`: clears a watch mark
    /// (the CPU is in use) and says whether to retry the section; `false` while a releaser
    /// owns the stack, when the call passes through. Never clears `RELEASING`: that would let
    /// sections commit on a stack the releaser is emptying.
    pub(super) fn unwatch(&self, cpu: usize, class: usize) -> bool {
        let stopped = &self.head_ref(cpu, class).stopped;
        // Relaxed: the mark publishes nothing. The retried section loads the word with acquire
        // ordering, which is what pairs with a releaser's clearing store.
        match stopped.compare_exchange(WATCHED, 0, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => true,
            Err(now) => now != RELEASING,
        }
    }

    /// Records `activity` as what CPU `cpu` showed; returns what it showed before.
    pub(super) fn swap_seen(&self, cpu: usize, activity: u64) -> u64 {
        self.counters(cpu).seen.swap(activity, Ordering::Relaxed)
    }

    /// Takes the release lock until the guard is dropped; `None` if this very thread holds it
    /// (a signal handler that interrupted a release), which would otherwise wait for itself.
    ///
    /// The lock word holds its holder's thread id and fork generation (`holder_word`), so that
    /// a waiter can tell a holder that no longer exists in this process and take the lock
    /// over, as the process decision does (`DecidedOnce`): a word of an older generation was
    /// written in the parent of a `fork` (the child's kernel may have given the id to a thread
    /// of its own, so the id alone cannot tell), and a thread of this generation that the
    /// system no longer knows died holding it. The flags such a holder set protect nothing any
    /// more, and the new holder clears them; the counts it left are exact, because a release
    /// takes each object out of its count before giving it back (`empty_owned`).
    pub(super) fn lock_releases(&self) -> Option<ReleaseLock<'_>> {
        let me = crate::os::Threads.me();
        loop {
            let mine = holder_word(me, crate::os::fork_generation());
            let held =
                match self
                    .releasing
                    .compare_exchange(0, mine, Ordering::Acquire, Ordering::Relaxed)
                {
                    Ok(_) => return Some(ReleaseLock(&self.releasing)),
                    Err(held) => held,
                };
            // Under the model checker every model thread has the one OS thread's id.
            if held == mine && !cfg!(thiscpu_model) {
                return None;
            }
            // A waiter asks the system on every round: it waits for a release, which takes
            // far longer than the question.
            if (fork_stamp::stamped_before_fork(held) || self.holder_is_gone(held))
                && self
                    .releasing
                    .compare_exchange(held, mine, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                self.resume_every_cpu();
                return Some(ReleaseLock(&self.releasing));
            }
            crate::sync::yield_now();
        }
    }

    /// Whether the thread in the held lock word `held` no longer exists in this process: a
    /// system call or two (`Threads::is_gone`), so asked rarely.
    fn holder_is_gone(&self, held: u64) -> bool {
        #[cfg(test)]
        self.liveness_checks.fetch_add(1, Ordering::Relaxed);
        crate::os::Threads.is_gone(holder_thread(held))
    }

    /// Clears every CPU's flags: only for the holder of the release lock, which no other
    /// releaser can be using.
    fn resume_every_cpu(&self) {
        for cpu in 0..self.cpus {
            for class in 0..CLASSES {
                self.head_ref(cpu, class)
                    .stopped
                    .store(0, Ordering::Release);
            }
        }
    }

    /// For a call that found CPU `cpu`'s cache stopped and goes to the inner allocator: counts
    /// it, and resumes the cache if the release that stopped it was abandoned.
    ///
    /// A live release is left alone (the call passes through meanwhile) at the cost of one
    /// more load and no system call: the lock word says whether it was taken before a `fork`
    /// (the child inherits the flags of a release in another thread, and nobody would ever
    /// clear them). Only one pass-through in `LIVENESS_EVERY` on the CPU asks the system
    /// whether the holder still exists, for a holder that died in this process: such a
    /// release is taken over at the latest that many pass-throughs of a CPU later.
    pub(super) fn pass_through(&self, cpu: usize) {
        // The CPU's first pass-through and every `LIVENESS_EVERY`th after it ask.
        let earlier = self.counters(cpu).passed.fetch_add(1, Ordering::Relaxed);
        let held = self.releasing.load(Ordering::Acquire);
        if held != 0
            && (fork_stamp::stamped_before_fork(held)
                || (earlier.is_multiple_of(LIVENESS_EVERY) && self.holder_is_gone(held)))
        {
            self.take_over_abandoned(held);
        }
    }

    /// Takes over the release that `held`, an abandoned holder's lock word, names, clears
    /// every flag it may have left, and frees the lock; another caller that took it first
    /// does the same.
    #[cold]
    #[inline(never)]
    fn take_over_abandoned(&self, held: u64) {
        let mine = holder_word(crate::os::Threads.me(), crate::os::fork_generation());
        if self
            .releasing
            .compare_exchange(held, mine, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            self.resume_every_cpu();
            self.releasing.store(0, Ordering::Release);
        }
    }

    /// Gives CPU `cpu`'s cached objects back to `inner` by the stop-and-fence protocol;
    /// returns the bytes given back. The caller holds the release lock; `cpu < self.cpus`.
    pub(super) fn release_fenced<A: GlobalAlloc>(
        &self,
        cpu: usize,
        inner: &A,
        _lock: &ReleaseLock<'_>,
    ) -> Result<u64, FenceUnavailable> {
        fence::register()?;
        for class in 0..CLASSES {
            // A swap, as the model's sections store (`arch/model.rs`): loom may order a plain
            // store before another thread's compare-exchange that cleared a watch mark, so that
            // sections would read that 0 as newer than the stop, which no hardware does. On
            // x86_64 a sequentially consistent store is this same instruction.
            let _ = self
                .head_ref(cpu, class)
                .stopped
                .swap(RELEASING, Ordering::SeqCst);
        }
        // Clears the flags however this returns (an inner allocator's `dealloc` may panic).
        let _resume = Resume { caches: self, cpu };
        let fenced = fence::fence_cpu(cpu as u32);
        if fenced.is_ok() {
            // Acquire: pairs with nothing a section writes, but orders the reads below after
            // the fence's return, as `fence::take_over` does.
            let _ = self.head_ref(cpu, 0).stopped.load(Ordering::Acquire);
        }
        let bytes = match fenced {
            // SAFETY: every class's `stopped` is set and CPU `cpu` was fenced: a section there
            // that read the flag clear has committed or aborted, and later ones leave at the
            // flag, so the stacks are ours until the flags are cleared (only releasers write
            // them, and the caller holds the release lock). The fence made the sections' plain
            // stores visible.
            Ok(()) => unsafe { self.empty_owned(cpu, inner) },
            Err(_) => 0,
        };
        fenced.map(|()| bytes)
    }

    /// Gives every object cached on `cpu` to `inner` and empties its stacks; the bytes.
    ///
    /// # Safety
    /// No section can commit on CPU `cpu`'s stacks until this returns (stopped and fenced, or
    /// no user left).
    unsafe fn empty_owned<A: GlobalAlloc>(&self, cpu: usize, inner: &A) -> u64 {
        let mut bytes = 0;
        for (class, size) in CLASS_SIZES.iter().enumerate() {
            let head = self.head_ref(cpu, class);
            let count = head.count.load(Ordering::Relaxed) as usize;
            // Top down, each object out of the count before it is given back: a `fork` by
            // another thread meanwhile leaves the child a count that covers no freed object.
            for slot in (0..count).rev() {
                let object = self.slot_ref(cpu, class, slot).load(Ordering::Relaxed);
                head.count.store(slot as u64, Ordering::Relaxed);
                // SAFETY: a slot below the count held an object that a committed push gave
                // to the cache: an allocation of the class's layout by `inner`, owned by the
                // cache alone, and taken out of it by the count's store above.
                unsafe { inner.dealloc(object as *mut u8, class_layout(class)) };
            }
            bytes += (count * size) as u64;
        }
        bytes
    }

    /// The fallback where membarrier is refused: runs this thread on `cpu` and pops its stacks
    /// there, giving the objects to `inner`. `None` if this thread cannot run there or has no
    /// rseq. The caller holds the release lock.
    pub(super) fn release_by_visiting<A: GlobalAlloc>(
        &self,
        cpu: usize,
        inner: &A,
        _lock: &ReleaseLock<'_>,
    ) -> Option<u64> {
        ops::position()?;
        // Restores this thread's affinity when the function returns.
        let _pinned = topology::pin_to_beyond_mask(cpu as u32).ok()?;
        let mut bytes = 0;
        for (class, &size) in CLASS_SIZES.iter().enumerate() {
            // Pushes by other threads on `cpu` meanwhile may refill the stack: stop after a
            // full stack's worth beyond what was there.
            let limit =
                self.head_ref(cpu, class).count.load(Ordering::Relaxed) + self.capacity.most(class);
            let mut tries = 0;
            let mut taken = 0;
            while taken < limit && tries < 4 * limit + 16 {
                tries += 1;
                let Some(at) = ops::position() else { break };
                if at.index() as usize != cpu {
                    crate::sync::yield_now();
                    continue;
                }
                // SAFETY: `at` was just read on this thread, and its index is `cpu`, below
                // `self.cpus`.
                match unsafe { self.pop_at(at, class) } {
                    (StackOutcome::Committed, object) => {
                        // SAFETY: a committed pop made this call the object's only owner; it
                        // is an allocation of the class's layout by `inner`.
                        unsafe { inner.dealloc(object as *mut u8, class_layout(class)) };
                        taken += 1;
                        bytes += size as u64;
                    }
                    (StackOutcome::Aborted, _) => ops::note_abort(),
                    // A watch mark (this thread holds the release lock, so it is no release's):
                    // cleared, and the pop retried.
                    (StackOutcome::Stopped, _) if self.unwatch(cpu, class) => {}
                    _ => break,
                }
            }
        }
        Some(bytes)
    }
}

#[cfg(all(test, not(thiscpu_model)))]
impl Caches {
    /// `class`'s transfer list.
    pub(super) fn transfer_list(&self, class: usize) -> &Transfer {
        self.transfer(class)
    }

    /// What a releaser that vanished in the middle of its work leaves: the lock held by
    /// `thread` in fork generation `generation`, and CPU `cpu`'s flags set.
    pub(super) fn abandon_release(&self, thread: i32, generation: u32, cpu: usize) {
        self.releasing
            .store(holder_word(thread, generation), Ordering::SeqCst);
        for class in 0..CLASSES {
            self.head_ref(cpu, class).stopped.store(1, Ordering::SeqCst);
        }
    }

    /// Ends what `abandon_release` left: clears every flag and the lock.
    pub(super) fn end_abandoned_release(&self) {
        self.resume_every_cpu();
        self.releasing.store(0, Ordering::SeqCst);
    }

    /// Liveness checks of a release's holder made so far.
    pub(super) fn liveness_checks(&self) -> u64 {
        self.liveness_checks.load(Ordering::Relaxed)
    }

    /// Whether any CPU's flags are set.
    pub(super) fn stopped_anywhere(&self) -> bool {
        (0..self.cpus).any(|cpu| {
            (0..CLASSES).any(|class| self.head_ref(cpu, class).stopped.load(Ordering::SeqCst) != 0)
        })
    }

    /// The start and length of the caches' region (header included), to ask the kernel which
    /// of its pages are resident.
    #[cfg(target_os = "linux")]
    pub(super) fn region(&self) -> (*const u8, usize) {
        (core::ptr::from_ref(self).cast(), self.length)
    }
}

/// What the transfer lists hold and moved (`Caches::transferring`).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct TransferFigures {
    pub(super) objects: u64,
    pub(super) bytes: u64,
    pub(super) given: u64,
    pub(super) taken: u64,
}

/// The release lock, held until dropped.
pub(super) struct ReleaseLock<'a>(&'a AtomicU64);

impl Drop for ReleaseLock<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Release);
    }
}

/// Clears a stopped CPU's flags when dropped: its stacks go back to the sections, which then
/// see (release, paired with their acquire load of the flag) everything the releaser stored.
struct Resume<'a> {
    caches: &'a Caches,
    cpu: usize,
}

impl Drop for Resume<'_> {
    fn drop(&mut self) {
        for class in 0..CLASSES {
            self.caches
                .head_ref(self.cpu, class)
                .stopped
                .store(0, Ordering::Release);
        }
    }
}
