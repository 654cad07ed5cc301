//! Model check of how the allocator moves capacity between size classes
//! (`src/allocator/capacity.rs`, compiled here with loom's atomics): every interleaving of
//! threads that ask for room and grow classes at once, one of them taking room from the
//! others. In each, the classes' capacities stay within their most slots, and once the threads
//! are done their bytes are within the budget and are what the mover counted: movers that did
//! not exclude each other (two growths reading the same room) fail it.
//!
//! Run with `RUSTFLAGS="--cfg thiscpu_model" cargo test -p thiscpu --release --test
//! model_capacity`.
#![cfg(thiscpu_model)]

/// What `capacity` is written with: loom's atomics.
mod capacity_words {
    pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
}

#[path = "../src/allocator/capacity.rs"]
#[allow(dead_code)]
mod capacity;

use capacity::Capacities;
use loom::sync::Arc;

const SIZES: [usize; 3] = [16, 64, 256];
/// Each class's first share is 256 bytes; one may grow to half the budget.
const BUDGET: usize = 768;

fn bytes(capacities: &Capacities<3>) -> u64 {
    (0..3)
        .map(|class| capacities.limit(class) * SIZES[class] as u64)
        .sum()
}

/// What holds at every moment: each class within its most slots.
fn check_bounds(capacities: &Capacities<3>) {
    for class in 0..3 {
        assert!(capacities.limit(class) <= capacities.most(class));
    }
}

/// What holds once the movers are done (joined): the budget, and the mover's count of bytes.
/// (While one moves, a thread that reads the capacities without taking part may see a class's
/// growth before the shrink that paid for it: the capacities are relaxed words, each read on
/// its own by the sections.)
fn check_settled(capacities: &Capacities<3>) {
    check_bounds(capacities);
    assert!(bytes(capacities) <= BUDGET as u64, "over the budget");
    assert_eq!(bytes(capacities), capacities.used_bytes());
}

#[test]
fn growths_at_once_keep_the_budget_and_the_bounds() {
    loom::model(|| {
        let capacities = Arc::new(Capacities::with_largest_share(SIZES, BUDGET, 2));
        let other = Arc::clone(&capacities);
        let grower = loom::thread::spawn(move || {
            other.grow(0, 0);
            check_bounds(&other);
        });
        capacities.grow(1, 0);
        check_bounds(&capacities);
        grower.join().unwrap();
        check_settled(&capacities);
    });
}

#[test]
fn a_growth_that_takes_room_races_one_that_finds_it() {
    loom::model(|| {
        let capacities = Arc::new(Capacities::with_largest_share(SIZES, BUDGET, 2));
        // The budget is full from the start: each growth below takes room from a class that
        // asked less, and the asks an asker adds may race the halving of every class's asks
        // (an ask may be lost then; the asks only choose whom to take from).
        let other = Arc::clone(&capacities);
        let grower = loom::thread::spawn(move || {
            other.ask(1, 0);
            other.grow(1, 0);
            check_bounds(&other);
        });
        capacities.grow(0, 0);
        check_bounds(&capacities);
        grower.join().unwrap();
        check_settled(&capacities);
    });
}
