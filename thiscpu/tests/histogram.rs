//! `Histogram`: exact bucket counts, sum, minimum and maximum from many threads; bucket
//! boundaries; invalid bounds.

use std::sync::Barrier;
use thiscpu::Histogram;
use thiscpu::histogram::InvalidBuckets;

/// More threads than CPUs, so that threads share CPUs and are preempted inside `observe`.
fn threads() -> usize {
    2 * std::thread::available_parallelism().map_or(2, |n| n.get()) + 2
}

#[test]
fn observations_from_many_threads_are_exact() {
    let bounds = [1.0, 10.0, 100.0];
    let h = Histogram::new(&bounds).unwrap();
    let n = threads();
    const EACH: u64 = 30_000;
    let start = Barrier::new(n);
    std::thread::scope(|s| {
        for t in 0..n {
            let (h, start) = (&h, &start);
            s.spawn(move || {
                start.wait();
                for i in 0..EACH {
                    // Integers: every partial sum is exact in an f64, in any order.
                    h.observe(((i * 7 + t as u64) % 200) as f64);
                }
            });
        }
    });
    let mut counts = [0u64; 4];
    let mut sum = 0u64;
    for t in 0..n as u64 {
        for i in 0..EACH {
            let v = (i * 7 + t) % 200;
            sum += v;
            counts[bounds.iter().position(|&le| v as f64 <= le).unwrap_or(3)] += 1;
        }
    }
    let snapshot = h.snapshot();
    let got: Vec<u64> = snapshot.buckets.iter().map(|b| b.count).collect();
    assert_eq!(got, counts);
    assert_eq!(snapshot.count, n as u64 * EACH);
    assert_eq!(snapshot.sum, sum as f64);
    assert_eq!((snapshot.min, snapshot.max), (0.0, 199.0));
}

#[test]
fn boundaries_belong_to_their_bucket() {
    let h = Histogram::new(&[-1.0, 0.0, 2.5]).unwrap();
    for v in [
        f64::NEG_INFINITY,
        -1.0,
        -0.5,
        0.0,
        2.5,
        2.6,
        f64::INFINITY,
        f64::NAN,
    ] {
        h.observe(v);
    }
    let counts: Vec<u64> = h.snapshot().buckets.iter().map(|b| b.count).collect();
    // NaN is counted in +Inf, as prometheus-client counts it.
    assert_eq!(counts, [2, 2, 1, 3]);
}

#[test]
fn empty_and_single_bucket_histograms() {
    let h = Histogram::new(&[]).unwrap();
    let empty = h.snapshot();
    assert_eq!(
        (empty.count, empty.sum, empty.mean(), empty.buckets.len()),
        (0, 0.0, None, 1)
    );
    assert_eq!((empty.min, empty.max), (f64::INFINITY, f64::NEG_INFINITY));
    h.observe_many(3.0, 5);
    h.observe_many(9.0, 0);
    let s = h.snapshot();
    assert_eq!((s.count, s.sum, s.min, s.max), (5, 15.0, 3.0, 3.0));
    assert_eq!(s.cumulative(), [(f64::INFINITY, 5)]);
}

#[test]
fn many_buckets_span_several_lines_per_cpu() {
    let bounds: Vec<f64> = (1..=40).map(f64::from).collect();
    let h = Histogram::new(&bounds).unwrap();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| (0..=41).for_each(|v| h.observe(f64::from(v))));
        }
    });
    let counts: Vec<u64> = h.snapshot().buckets.iter().map(|b| b.count).collect();
    let mut expected = vec![4u64; 41];
    expected[0] = 8; // 0 and 1
    expected[40] = 4; // 41
    assert_eq!(counts, expected);
}

#[test]
fn invalid_bounds_are_refused() {
    assert_eq!(
        Histogram::new(&[1.0, 0.5]).err(),
        Some(InvalidBuckets::NotIncreasing)
    );
    assert_eq!(
        Histogram::new(&[1.0, 1.0]).err(),
        Some(InvalidBuckets::NotIncreasing)
    );
    assert_eq!(
        Histogram::new(&[0.0, f64::NAN]).err(),
        Some(InvalidBuckets::NotANumber)
    );
    assert_eq!(
        Histogram::new(&[f64::INFINITY, f64::INFINITY]).err(),
        Some(InvalidBuckets::NotIncreasing)
    );
    assert!(
        InvalidBuckets::NotIncreasing
            .to_string()
            .contains("increasing")
    );
}
