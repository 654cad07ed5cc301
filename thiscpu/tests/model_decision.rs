//! Model check of the process decision's publication (`src/decided_once.rs`, compiled here
//! with loom's atomics): every interleaving of a few threads that ask for the decision at once,
//! with a decision that a signal handler re-enters, that unwinds, or whose claimant vanished
//! (the child of a `fork` made in the middle of it).
//!
//! Run with `RUSTFLAGS="--cfg thiscpu_model" cargo test -p thiscpu --release --test model_decision`.
#![cfg(thiscpu_model)]

/// The primitives `decided_once` is written with, taken from loom here.
mod sync {
    pub(crate) use loom::sync::atomic;
    pub(crate) mod cell {
        pub(crate) use loom::cell::UnsafeCell;
    }
}

#[path = "../src/decided_once.rs"]
#[allow(dead_code, unsafe_code)]
mod decided_once;

use decided_once::{Claimants, DecidedOnce, UNDECIDED};
use loom::sync::Arc;
use loom::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::mem::MaybeUninit;

/// A model thread's id, and the ids of claimants that no longer exist.
struct Ids {
    me: i32,
    gone: &'static [i32],
}

impl Claimants for Ids {
    fn me(&self) -> i32 {
        self.me
    }
    fn is_gone(&self, id: i32) -> bool {
        self.gone.contains(&id)
    }
    fn pause(&self) {
        loom::thread::yield_now();
    }
}

/// Every interleaving with up to three preemptions (loom's default explores all of them, which
/// the waiters' retry loops make too many).
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(f);
}

fn decision(claim: i32) -> DecidedOnce<u64> {
    DecidedOnce::new(
        AtomicI32::new(claim),
        loom::cell::UnsafeCell::new(MaybeUninit::uninit()),
    )
}

/// The value a decision returns: which thread made it, so that every caller can check it saw
/// that one.
fn decide_as(me: i32, runs: &AtomicUsize) -> u64 {
    runs.fetch_add(1, Ordering::Relaxed);
    1000 + me as u64
}

#[test]
fn concurrent_first_calls_see_one_decision_made_once() {
    model(|| {
        let once = Arc::new(decision(UNDECIDED));
        let runs = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (1..=1)
            .map(|me| {
                let (once, runs) = (once.clone(), runs.clone());
                loom::thread::spawn(move || {
                    let ids = Ids { me, gone: &[] };
                    *once.get_or_decide(&ids, || decide_as(me, &runs)).unwrap()
                })
            })
            .collect();
        let ids = Ids { me: 2, gone: &[] };
        let mine = *once.get_or_decide(&ids, || decide_as(2, &runs)).unwrap();
        for thread in threads {
            assert_eq!(
                thread.join().unwrap(),
                mine,
                "two callers saw different decisions"
            );
        }
        assert_eq!(
            runs.load(Ordering::Relaxed),
            1,
            "the decision ran more than once"
        );
        assert_eq!(once.get().copied(), Some(mine));
    });
}

#[test]
fn a_handler_on_the_deciding_thread_gets_none_and_others_wait() {
    model(|| {
        let once = Arc::new(decision(UNDECIDED));
        let other = {
            let once = once.clone();
            loom::thread::spawn(move || {
                let ids = Ids { me: 2, gone: &[] };
                *once.get_or_decide(&ids, || 2000).unwrap()
            })
        };
        let ids = Ids { me: 1, gone: &[] };
        let mine = *once
            .get_or_decide(&ids, || {
                // A signal handler that interrupts the decision and asks for it.
                assert!(once.get_or_decide(&ids, || 3000).is_none());
                1000
            })
            .or_else(|| once.get())
            .unwrap();
        assert_eq!(other.join().unwrap(), mine);
    });
}

#[test]
fn a_decision_that_unwinds_is_made_again_by_the_next_caller() {
    model(|| {
        let once = Arc::new(decision(UNDECIDED));
        let other = {
            let once = once.clone();
            loom::thread::spawn(move || {
                let ids = Ids { me: 2, gone: &[] };
                *once.get_or_decide(&ids, || 2000).unwrap()
            })
        };
        let ids = Ids { me: 1, gone: &[] };
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            once.get_or_decide(&ids, || panic!("the decision failed"))
                .copied()
        }));
        // Either the other thread decided first, or this one unwound and handed the claim back.
        let seen = match unwound {
            Ok(value) => value.unwrap(),
            Err(_) => *once.get_or_decide(&ids, || 1000).unwrap(),
        };
        assert_eq!(other.join().unwrap(), seen);
    });
}

#[test]
fn a_claimant_gone_with_the_parent_of_a_fork_is_taken_over() {
    model(|| {
        // The child of a fork made while thread 7 of the parent was deciding.
        let once = Arc::new(decision(7));
        let runs = Arc::new(AtomicUsize::new(0));
        let other = {
            let (once, runs) = (once.clone(), runs.clone());
            loom::thread::spawn(move || {
                let ids = Ids { me: 2, gone: &[7] };
                *once.get_or_decide(&ids, || decide_as(2, &runs)).unwrap()
            })
        };
        let ids = Ids { me: 1, gone: &[7] };
        let mine = *once.get_or_decide(&ids, || decide_as(1, &runs)).unwrap();
        assert_eq!(other.join().unwrap(), mine);
        assert_eq!(runs.load(Ordering::Relaxed), 1);
    });
}
