//! A request counter shared by every worker of a server: a process-wide `thiscpu::Counter`
//! in a `static`, incremented once per request from many threads, with no atomic
//! read-modify-write and no cache line bouncing between CPUs.
//!
//! ```text
//! cargo run --release -p thiscpu --example request_counter
//! ```
//!
//! The "server" is a loop over fake requests that runs for a fixed time. Each worker also
//! tallies its own requests in a local variable, so the exact total is known and checked
//! against the counter at the end. The same loop with a shared `AtomicU64` runs after it for
//! comparison.

use std::hint::black_box;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Requests handled by the whole process. `Counter::new` allocates, so a `static` goes
/// through `LazyLock`; the first `inc` pays for it.
static REQUESTS: LazyLock<thiscpu::Counter> = LazyLock::new(thiscpu::Counter::new);

/// The same count kept the usual way, for comparison.
static REQUESTS_ATOMIC: AtomicU64 = AtomicU64::new(0);

/// How long each loop serves.
const SERVE_FOR: Duration = Duration::from_millis(300);

/// A stand-in for handling one request: a little work on its id, so that counting is not the
/// only thing the loop does.
fn handle(id: u64) -> u64 {
    let h = id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (h ^ h >> 29).wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

/// Runs `workers` threads that handle requests for `SERVE_FOR`, counting each with `count`;
/// returns how many they handled (from their own tallies) and how long they took.
fn serve(workers: usize, count: impl Fn() + Sync) -> (u64, Duration) {
    let start = Instant::now();
    let handled = std::thread::scope(|s| {
        let threads: Vec<_> = (0..workers as u64)
            .map(|worker| {
                let count = &count;
                s.spawn(move || {
                    let mut handled = 0u64;
                    while start.elapsed() < SERVE_FOR {
                        // Requests come in batches between clock reads.
                        for _ in 0..256 {
                            black_box(handle(worker << 40 | handled));
                            count();
                            handled += 1;
                        }
                    }
                    handled
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).sum()
    });
    (handled, start.elapsed())
}

pub fn main() {
    let workers = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .max(2);
    let rate = |n: u64, elapsed: Duration| n as f64 / elapsed.as_secs_f64() / 1e6;

    let before = REQUESTS.sum();
    let (handled, elapsed) = serve(workers, || REQUESTS.inc());
    let total = REQUESTS.sum() - before;
    println!(
        "thiscpu::Counter: {total} requests on {workers} threads, {:.1} M requests/s",
        rate(total, elapsed)
    );
    // Exact once the workers are joined: no increment lost or doubled, whatever preemption,
    // migration or signals happened meanwhile.
    assert_eq!(total, handled, "requests lost or counted twice");

    let shares: Vec<String> = REQUESTS
        .per_cpu()
        .filter(|&(_, n)| n > 0)
        .map(|(cpu, n)| format!("cpu{cpu}: {n}"))
        .collect();
    println!("  per CPU: {}", shares.join(", "));

    let before = REQUESTS_ATOMIC.load(Ordering::Relaxed);
    let (handled, elapsed) = serve(workers, || {
        REQUESTS_ATOMIC.fetch_add(1, Ordering::Relaxed);
    });
    let total = REQUESTS_ATOMIC.load(Ordering::Relaxed) - before;
    println!(
        "AtomicU64:        {total} requests on {workers} threads, {:.1} M requests/s",
        rate(total, elapsed)
    );
    assert_eq!(total, handled);
    println!(
        "counted by {} (aborted and retried increments so far: {})",
        thiscpu::source().this_thread.name(),
        thiscpu::ops::aborts()
    );
}
