//! A latency histogram per CPU: workers record into the current CPU's buckets with
//! `Sharded::with_current` (a restartable take, no atomic read-modify-write), and a reporter
//! merges the shards now and then while they run. At the end the merged histogram holds
//! exactly the samples recorded.

use std::sync::atomic::{AtomicBool, Ordering};
use thiscpu::Sharded;

/// Power-of-two buckets: bucket `b` counts values in `[2^(b-1), 2^b)` (bucket 0: zero).
const BUCKETS: usize = 32;

#[derive(Clone, Debug, Default)]
struct Histogram {
    counts: [u64; BUCKETS],
    sum: u64,
}

impl Histogram {
    fn record(&mut self, value: u64) {
        let bucket = (u64::BITS - value.leading_zeros()) as usize;
        self.counts[bucket.min(BUCKETS - 1)] += 1;
        self.sum += value;
    }

    fn merge(mut self, other: &Histogram) -> Histogram {
        for (mine, theirs) in self.counts.iter_mut().zip(other.counts) {
            *mine += theirs;
        }
        self.sum += other.sum;
        self
    }

    fn samples(&self) -> u64 {
        self.counts.iter().sum()
    }
}

pub fn main() {
    let latencies: Sharded<Histogram> = Sharded::default();
    let done = AtomicBool::new(false);
    let (workers, per_worker) = (4u64, 50_000u64);
    std::thread::scope(|s| {
        let writers: Vec<_> = (0..workers)
            .map(|w| {
                let latencies = &latencies;
                s.spawn(move || {
                    for i in 0..per_worker {
                        let nanos = (i * 7919 + w) % 100_000; // stand-in for a measured latency
                        latencies.with_current(|h| h.record(nanos));
                    }
                })
            })
            .collect();
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                let so_far = latencies.fold(Histogram::default(), Histogram::merge);
                assert!(so_far.samples() <= workers * per_worker);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        });
        for writer in writers {
            writer.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
    });
    let total = latencies.fold(Histogram::default(), Histogram::merge);
    let expected_sum: u64 = (0..workers)
        .flat_map(|w| (0..per_worker).map(move |i| (i * 7919 + w) % 100_000))
        .sum();
    assert_eq!(total.samples(), workers * per_worker);
    assert_eq!(total.sum, expected_sum);
    let used = latencies
        .into_inner()
        .iter()
        .filter(|h| h.samples() > 0)
        .count();
    println!(
        "{} samples, mean {} ns, from {used} CPU shard(s)",
        total.samples(),
        total.sum / total.samples()
    );
    for (bucket, count) in total.counts.iter().enumerate().filter(|(_, c)| **c > 0) {
        println!("  < {:>7} ns: {count}", 1u64 << bucket);
    }
}
