//! Per-CPU statistics: a struct of several `thiscpu::Counter`s (requests, bytes, errors) that
//! workers update on every request, and a reporter thread that sums them every few
//! milliseconds while the workers run, as a monitoring endpoint would.
//!
//! ```text
//! cargo run --release -p thiscpu --example per_cpu_stats
//! ```
//!
//! What a reader sees while writers run: each `sum` is a value the counter passed through
//! during the read, so successive reports never go down and never exceed the final total;
//! the three counters are read one after the other, so a report can show a request's bytes
//! without the request itself (or the reverse) for a moment. Once the workers are joined,
//! every sum is exact.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use thiscpu::Counter;

/// A server's statistics: each field is per-CPU, so the workers' updates never contend.
#[derive(Debug, Default)]
struct Stats {
    requests: Counter,
    bytes: Counter,
    errors: Counter,
}

/// One reading of all the counters.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Totals {
    requests: u64,
    bytes: u64,
    errors: u64,
}

impl Stats {
    fn record(&self, bytes: u64, failed: bool) {
        self.requests.inc();
        self.bytes.add(bytes);
        if failed {
            self.errors.inc();
        }
    }

    fn totals(&self) -> Totals {
        Totals {
            requests: self.requests.sum(),
            bytes: self.bytes.sum(),
            errors: self.errors.sum(),
        }
    }
}

const RUN_FOR: Duration = Duration::from_millis(500);
const REPORT_EVERY: Duration = Duration::from_millis(100);

/// The fake request `i` of a worker: its size, and whether it fails (one in 97).
fn request(i: u64) -> (u64, bool) {
    (64 + i % 1500, i.is_multiple_of(97))
}

pub fn main() {
    let stats = Stats::default();
    let workers = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .max(2);
    let done = AtomicBool::new(false);
    let start = Instant::now();

    let (reports, tallies) = std::thread::scope(|s| {
        let reporter = s.spawn(|| {
            let mut reports = Vec::new();
            let mut last = Totals::default();
            while !done.load(Ordering::Acquire) {
                std::thread::sleep(REPORT_EVERY);
                let now = stats.totals();
                let seconds = REPORT_EVERY.as_secs_f64();
                println!(
                    "{:>6.0} ms: {:>9} requests ({:>6.2} M/s), {:>11} bytes, {:>6} errors",
                    start.elapsed().as_secs_f64() * 1e3,
                    now.requests,
                    (now.requests - last.requests) as f64 / seconds / 1e6,
                    now.bytes,
                    now.errors,
                );
                // While the workers run, each counter only goes up between reports.
                assert!(now.requests >= last.requests && now.bytes >= last.bytes);
                assert!(now.errors >= last.errors);
                reports.push(now);
                last = now;
            }
            reports
        });
        // Each worker also keeps its own plain tally, to check the counters against.
        let workers: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Totals::default();
                    while start.elapsed() < RUN_FOR {
                        for _ in 0..256 {
                            let (bytes, failed) = request(mine.requests);
                            stats.record(bytes, failed);
                            mine.requests += 1;
                            mine.bytes += bytes;
                            mine.errors += u64::from(failed);
                        }
                    }
                    mine
                })
            })
            .collect();
        let tallies: Vec<Totals> = workers.into_iter().map(|w| w.join().unwrap()).collect();
        done.store(true, Ordering::Release);
        (reporter.join().unwrap(), tallies)
    });

    let expected = tallies.iter().fold(Totals::default(), |sum, t| Totals {
        requests: sum.requests + t.requests,
        bytes: sum.bytes + t.bytes,
        errors: sum.errors + t.errors,
    });
    let last = stats.totals();
    println!(
        "final after {:.0} ms: {} requests, {} bytes, {} errors ({} reports while running)",
        start.elapsed().as_secs_f64() * 1e3,
        last.requests,
        last.bytes,
        last.errors,
        reports.len()
    );
    assert_eq!(last, expected, "a statistic lost or doubled an update");
    // No report ever ran ahead of the final, exact totals.
    for report in &reports {
        assert!(report.requests <= expected.requests && report.bytes <= expected.bytes);
        assert!(report.errors <= expected.errors);
    }
    for (cpu, requests) in stats.requests.per_cpu().filter(|&(_, n)| n > 0) {
        println!("  cpu{cpu}: {requests} requests");
    }
}
