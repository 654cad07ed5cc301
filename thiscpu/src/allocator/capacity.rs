//! How many objects each size class may cache per CPU, moved between the classes as the
//! program's use of them changes, within one budget of bytes per CPU.
//!
//! Every class starts with an equal share of the budget. A class that keeps missing (its
//! caches empty when asked) or spilling (full when given back) asks for room: every
//! `ASKS_PER_GROWTH`th ask grows it by a quarter, up to its most slots. When the budget has no
//! room left, the growth takes capacity from the classes that asked least since the last time
//! room was taken (the asks then halve, so that old asks count less), never below a class's
//! floor of a quarter of its first share. One thread moves capacity at a time; a thread that
//! finds another moving skips its turn rather than wait: growth is a slow-path nicety, never a
//! reason to block. The mover's word holds the fork generation it moved in (`os::fork_generation`,
//! passed in by the caller), so that the child of a `fork` made while a thread of the parent
//! was moving, which has no such thread, takes the word over rather than never growing again;
//! it counts the budget's bytes afresh, since the parent's thread may have stopped between two
//! of its stores.
//!
//! The capacity is one number per class for every CPU: the fast path loads it as it loaded the
//! fixed one, and a push compares the count with it inside its section. A push that loaded the
//! capacity before a class shrank may still fill the slot the shrink took away, and a class
//! that shrank keeps its objects above the new capacity until pops take them (or a release
//! does): the budget bounds what the caches settle to, and the classes' most slots bound what
//! they may hold at any moment. Neither depends on the number of threads.
//!
//! Written against `super::capacity_words`, so that tests/model_capacity.rs compiles this very
//! file with loom's atomics and checks the budget and the bounds in every interleaving of
//! threads that grow classes at once.

use super::capacity_words::{AtomicU64, Ordering};

/// Asks (misses and spills) of one class between two growths of it.
pub(crate) const ASKS_PER_GROWTH: u64 = 16;

/// The most objects one class caches per CPU, whatever the budget.
pub(crate) const MAX_SLOTS_PER_CLASS: u64 = 2048;

/// The largest part of the budget one class may grow to: an eighth.
const LARGEST_SHARE: u64 = 8;

/// The capacities of `N` classes.
pub(crate) struct Capacities<const N: usize> {
    /// Each class's object size.
    sizes: [u64; N],
    /// Each class's most slots: what a CPU's region reserves for it.
    most: [u64; N],
    /// Each class's fewest slots: a quarter of its first share.
    fewest: [u64; N],
    /// Each class's capacity now, between `fewest` and `most`.
    limits: [AtomicU64; N],
    /// Each class's asks since room was last taken from the others (halved then).
    asks: [AtomicU64; N],
    /// The bytes of all capacities, at most `budget`; written only by the mover.
    used: AtomicU64,
    budget: u64,
    /// 0, or the fork generation plus one of the one thread that moves capacity.
    moving: AtomicU64,
    /// Growths since the start.
    growths: AtomicU64,
}

impl<const N: usize> Capacities<N> {
    /// Capacities for classes of `sizes` bytes within `budget` bytes per CPU: each class's
    /// first share is `budget / N` bytes, in whole objects, at most `MAX_SLOTS_PER_CLASS`.
    pub(crate) fn new(sizes: [usize; N], budget: usize) -> Self {
        Self::with_largest_share(sizes, budget, LARGEST_SHARE)
    }

    /// As `new`, one class growing to at most `1 / largest_share` of the budget.
    pub(crate) fn with_largest_share(sizes: [usize; N], budget: usize, largest_share: u64) -> Self {
        let sizes = sizes.map(|size| size as u64);
        let budget = budget as u64;
        let first = sizes.map(|size| (budget / N as u64 / size).min(MAX_SLOTS_PER_CLASS));
        let mut most = [0u64; N];
        let mut fewest = [0u64; N];
        for class in 0..N {
            most[class] = (budget / largest_share / sizes[class])
                .min(MAX_SLOTS_PER_CLASS)
                .max(first[class]);
            fewest[class] = first[class] / 4;
        }
        let used = (0..N).map(|class| first[class] * sizes[class]).sum();
        Capacities {
            sizes,
            most,
            fewest,
            limits: first.map(AtomicU64::new),
            asks: [0; N].map(AtomicU64::new),
            used: AtomicU64::new(used),
            budget,
            moving: AtomicU64::new(0),
            growths: AtomicU64::new(0),
        }
    }

    /// `class`'s capacity now: at most `most(class)`, always.
    #[inline(always)]
    pub(crate) fn limit(&self, class: usize) -> u64 {
        self.limits[class].load(Ordering::Relaxed)
    }

    /// The slots a CPU's region reserves for `class`.
    pub(crate) fn most(&self, class: usize) -> u64 {
        self.most[class]
    }

    /// The bytes of all capacities now: at most the budget.
    pub(crate) fn used_bytes(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Growths of a class since the start.
    pub(crate) fn growths(&self) -> u64 {
        self.growths.load(Ordering::Relaxed)
    }

    /// `class` missed or spilled: counts the ask, and grows the class at every
    /// `ASKS_PER_GROWTH`th. True if it grew. `generation` is the process's fork generation.
    ///
    /// The count is a load and a store, not a read-modify-write: two CPUs asking at once may
    /// count one ask, which only delays a growth. A locked add here would wait for every store
    /// before it to reach the cache, and a miss or spill comes right after a batch's stores.
    pub(crate) fn ask(&self, class: usize, generation: u32) -> bool {
        let asks = self.asks[class].load(Ordering::Relaxed) + 1;
        self.asks[class].store(asks, Ordering::Relaxed);
        asks.is_multiple_of(ASKS_PER_GROWTH) && self.grow(class, generation)
    }

    /// Makes the calling thread, of fork generation `generation`, the mover; false if a thread
    /// of this generation is. A word of another generation was left by a thread of a parent
    /// process that a `fork` did not copy: it is taken over, and the budget's bytes counted
    /// again from the capacities.
    fn become_mover(&self, generation: u32) -> bool {
        let mine = u64::from(generation) + 1;
        let held = self.moving.load(Ordering::Relaxed);
        if held == mine
            || self
                .moving
                .compare_exchange(held, mine, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return false;
        }
        if held != 0 {
            let used: u64 = (0..N)
                .map(|class| self.limits[class].load(Ordering::Relaxed) * self.sizes[class])
                .sum();
            self.used.store(used, Ordering::Relaxed);
        }
        true
    }

    /// Grows `class` by a quarter (at least one slot, at most to its most), taking the bytes
    /// from the budget's room or else from the classes that asked least, or by what they can
    /// give if that is less; true if it grew. Skips when another thread is moving capacity.
    pub(crate) fn grow(&self, class: usize, generation: u32) -> bool {
        if !self.become_mover(generation) {
            return false;
        }
        let size = self.sizes[class];
        let limit = self.limits[class].load(Ordering::Relaxed);
        let mut step = (limit / 4).max(1).min(self.most[class] - limit);
        if step > 0 {
            let room = self.budget - self.used.load(Ordering::Relaxed);
            if room < step * size {
                self.take_room(class, step * size - room);
            }
            let room = self.budget - self.used.load(Ordering::Relaxed);
            step = step.min(room / size);
        }
        if step > 0 {
            self.limits[class].store(limit + step, Ordering::Relaxed);
            self.used.fetch_add(step * size, Ordering::Relaxed);
            self.growths.fetch_add(1, Ordering::Relaxed);
        }
        self.moving.store(0, Ordering::Release);
        step > 0
    }

    /// Shrinks the classes other than `class` that asked least, each by at most a quarter and
    /// never below its fewest, until `bytes` are freed or none can give more, and halves every
    /// class's asks. The caller is the mover.
    fn take_room(&self, class: usize, bytes: u64) {
        let mut freed = 0;
        let mut taken = [false; N];
        while freed < bytes {
            let coldest = (0..N)
                .filter(|&other| {
                    other != class
                        && !taken[other]
                        && self.limits[other].load(Ordering::Relaxed) > self.fewest[other]
                })
                .min_by_key(|&other| self.asks[other].load(Ordering::Relaxed));
            let Some(victim) = coldest else { break };
            taken[victim] = true;
            let limit = self.limits[victim].load(Ordering::Relaxed);
            let spare = (limit - self.fewest[victim]).min(limit.div_ceil(4));
            let cut = spare.min((bytes - freed).div_ceil(self.sizes[victim]));
            self.limits[victim].store(limit - cut, Ordering::Relaxed);
            self.used
                .fetch_sub(cut * self.sizes[victim], Ordering::Relaxed);
            freed += cut * self.sizes[victim];
        }
        for asks in &self.asks {
            asks.store(asks.load(Ordering::Relaxed) / 2, Ordering::Relaxed);
        }
    }
}

#[cfg(all(test, not(thiscpu_model)))]
mod tests {
    use super::*;

    /// Sixteen classes: a first share is a sixteenth of the budget, the largest an eighth.
    const SIZES: [usize; 16] = [
        16, 32, 48, 64, 80, 96, 112, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096,
    ];
    const BUDGET: usize = 256 * 1024;

    fn first(class: usize) -> u64 {
        (BUDGET / 16 / SIZES[class]) as u64
    }

    /// The bytes of the capacities, counted afresh; and checks every class's bounds.
    fn checked_total(capacities: &Capacities<16>) -> u64 {
        (0..16)
            .map(|class| {
                let limit = capacities.limit(class);
                assert!(
                    limit <= capacities.most(class),
                    "class {class} above its most"
                );
                assert!(
                    limit >= capacities.fewest[class],
                    "class {class} below its fewest"
                );
                limit * SIZES[class] as u64
            })
            .sum()
    }

    #[test]
    fn every_class_starts_with_an_equal_share() {
        let capacities = Capacities::new(SIZES, BUDGET);
        for (class, size) in SIZES.iter().enumerate() {
            assert_eq!(capacities.limit(class), first(class));
            assert_eq!(capacities.most(class), (BUDGET / 8 / size) as u64);
        }
        let total = checked_total(&capacities);
        assert!(total <= BUDGET as u64 && total > BUDGET as u64 - 16 * 4096);
        assert_eq!(capacities.used_bytes(), total);
    }

    #[test]
    fn a_class_that_keeps_asking_grows_from_the_quiet_ones_within_the_budget() {
        let capacities = Capacities::new(SIZES, BUDGET);
        let mut grew = 0;
        for _ in 0..ASKS_PER_GROWTH * 40 {
            grew += u64::from(capacities.ask(9, 0));
            let total = checked_total(&capacities);
            assert!(total <= BUDGET as u64);
            assert_eq!(total, capacities.used_bytes());
        }
        assert!(grew > 0 && capacities.growths() == grew);
        assert_eq!(capacities.limit(9), capacities.most(9));
        // The others gave what the grown class took.
        assert!((0..16).any(|class| capacities.limit(class) < first(class)));
    }

    #[test]
    fn a_class_stops_at_its_most_slots() {
        let capacities = Capacities::new(SIZES, BUDGET);
        while capacities.grow(0, 0) {}
        assert_eq!(capacities.limit(0), capacities.most(0));
        assert_eq!(capacities.limit(0), (BUDGET / 8 / 16) as u64);
        assert!(checked_total(&capacities) <= BUDGET as u64);
    }

    #[test]
    fn growth_takes_from_the_classes_that_asked_least() {
        let capacities = Capacities::new(SIZES, BUDGET);
        // Every class but 15 asks (short of a growth); 15 never does.
        for class in 0..15 {
            for _ in 0..ASKS_PER_GROWTH - 1 {
                capacities.ask(class, 0);
            }
        }
        assert!(capacities.grow(2, 0));
        for class in 0..15 {
            assert!(
                capacities.limit(class) >= first(class),
                "class {class} shrank"
            );
        }
        assert!(capacities.limit(15) < first(15));
        // The asks halved when room was taken.
        assert_eq!(
            capacities.asks[0].load(Ordering::Relaxed),
            (ASKS_PER_GROWTH - 1) / 2
        );
    }

    #[test]
    fn when_nobody_can_give_a_class_grows_by_what_there_is() {
        let capacities = Capacities::new(SIZES, BUDGET);
        // Every other class down to its fewest.
        for class in 0..16 {
            capacities.limits[class].store(capacities.fewest[class], Ordering::Relaxed);
        }
        let used = checked_total(&capacities);
        capacities.used.store(used, Ordering::Relaxed);
        while capacities.grow(15, 0) {}
        assert_eq!(capacities.limit(15), capacities.most(15));
        assert!(checked_total(&capacities) <= BUDGET as u64);
        assert_eq!(checked_total(&capacities), capacities.used_bytes());
    }

    #[test]
    fn a_thread_that_finds_another_moving_skips() {
        let capacities = Capacities::new(SIZES, BUDGET);
        capacities.moving.store(1, Ordering::Relaxed);
        assert!(!capacities.grow(2, 0));
        assert_eq!(capacities.limit(2), first(2));
        assert_eq!(capacities.growths(), 0);
    }

    /// The child of a fork made while a parent's thread moved capacity: the word names the
    /// parent's generation, and the bytes that thread counted may be half updated.
    #[test]
    fn a_mover_left_by_a_fork_is_taken_over_and_the_bytes_counted_again() {
        let capacities = Capacities::new(SIZES, BUDGET);
        capacities.moving.store(1, Ordering::Relaxed);
        capacities
            .used
            .store(BUDGET as u64 + 4096, Ordering::Relaxed);
        assert!(capacities.grow(2, 1));
        assert_eq!(capacities.moving.load(Ordering::Relaxed), 0);
        let total = checked_total(&capacities);
        assert!(total <= BUDGET as u64);
        assert_eq!(capacities.used_bytes(), total);
    }
}
