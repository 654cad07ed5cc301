//! The dense per-CPU allocator behind `Counter`: reuse, growth, untouched rows, and counters
//! created and dropped while other threads update and read.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use thiscpu::{ByMmCid, Counter, dense};

#[test]
fn a_reused_slot_starts_at_zero() {
    for _ in 0..100 {
        let counter = Counter::new();
        counter.add(12345);
        std::thread::scope(|s| {
            s.spawn(|| counter.add(1));
        });
        assert_eq!(counter.sum(), 12346);
        drop(counter);
        let fresh = Counter::new();
        assert_eq!(fresh.sum(), 0, "a slot came back with its old value");
        assert!(fresh.per_cpu().all(|(_, value)| value == 0));
    }
}

#[test]
fn many_counters_grow_across_ranges_and_stay_independent() {
    let per_range = dense::STRIDE / 8;
    let counters: Vec<Counter> = (0..per_range * 2 + 10).map(|_| Counter::new()).collect();
    let stats = dense::stats();
    assert!(stats.ranges >= 2, "{stats:?}");
    assert!(stats.slots >= counters.len());
    for (i, counter) in counters.iter().enumerate() {
        counter.add(i as u64);
    }
    for (i, counter) in counters.iter().enumerate() {
        assert_eq!(counter.sum(), i as u64);
    }
}

/// Threads create, increment and drop counters while others increment and read long-lived
/// ones: every long-lived total is exact and every fresh counter starts at zero.
#[test]
fn counters_come_and_go_while_others_count() {
    let lived = Arc::new((0..64).map(|_| Counter::new()).collect::<Vec<_>>());
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(6));
    let mut workers = Vec::new();
    for t in 0..3u64 {
        let (lived, stop, start) = (lived.clone(), stop.clone(), start.clone());
        workers.push(std::thread::spawn(move || {
            start.wait();
            let mut made = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for (i, counter) in lived.iter().enumerate() {
                    counter.add(t + i as u64);
                }
                made += 1;
            }
            made
        }));
    }
    let mut churners = Vec::new();
    for _ in 0..2 {
        let (stop, start) = (stop.clone(), start.clone());
        churners.push(std::thread::spawn(move || {
            start.wait();
            let mut checked = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let batch: Vec<Counter> = (0..100).map(|_| Counter::new()).collect();
                for counter in &batch {
                    assert_eq!(counter.sum(), 0, "a fresh counter carried an old value");
                    counter.add(3);
                }
                let by_cid = Counter::by_mm_cid();
                by_cid.add(5);
                assert_eq!(by_cid.sum(), 5);
                assert!(batch.iter().all(|counter| counter.sum() == 3));
                checked += batch.len() as u64;
            }
            checked
        }));
    }
    start.wait();
    std::thread::sleep(std::time::Duration::from_millis(800));
    stop.store(true, Ordering::Relaxed);
    let rounds: Vec<u64> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let checked: u64 = churners.into_iter().map(|c| c.join().unwrap()).sum();
    assert!(checked > 0);
    for (i, counter) in lived.iter().enumerate() {
        let expected: u64 = rounds
            .iter()
            .enumerate()
            .map(|(t, &r)| r * (t as u64 + i as u64))
            .sum();
        assert_eq!(counter.sum(), expected, "counter {i}");
    }
}

#[test]
fn take_returns_every_increment_exactly_once_while_writers_run() {
    let counter = Arc::new(Counter::new());
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..4)
        .map(|_| {
            let (counter, stop) = (counter.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut made = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    counter.inc();
                    made += 1;
                }
                made
            })
        })
        .collect();
    // A reader racing the taker: a sum must never wrap below zero into a huge value.
    let reader = {
        let (counter, stop) = (counter.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut reads = 0u64;
            loop {
                let sum = counter.sum();
                assert!(sum < 1 << 40, "sum wrapped while a take ran: {sum}");
                reads += 1;
                if stop.load(Ordering::Relaxed) {
                    return reads;
                }
            }
        })
    };
    let mut taken = 0u64;
    let began = std::time::Instant::now();
    while began.elapsed() < std::time::Duration::from_millis(500) {
        taken += counter.take();
    }
    stop.store(true, Ordering::Relaxed);
    let reads = reader.join().unwrap();
    eprintln!("sums read while taking: {reads}");
    let made: u64 = writers.into_iter().map(|w| w.join().unwrap()).sum();
    taken += counter.take();
    assert_eq!(taken, made);
    assert_eq!(counter.sum(), 0);
}

#[test]
fn mm_cid_counters_are_exact() {
    let counter = Arc::new(Counter::<ByMmCid>::by_mm_cid());
    std::thread::scope(|s| {
        for _ in 0..8 {
            let counter = &counter;
            s.spawn(move || (0..50_000).for_each(|_| counter.inc()));
        }
    });
    assert_eq!(counter.sum(), 400_000);
    if thiscpu::mm_cid().is_some() {
        let used = counter.per_cpu().filter(|&(_, value)| value > 0).count();
        assert!(used <= 8, "more concurrency ids than threads: {used}");
    }
}
