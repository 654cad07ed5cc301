//! A per-CPU object pool in a server loop: every request borrows a response buffer from a
//! `thiscpu::Pool`, fills it, "sends" it and gives it back, so buffers are reused by the CPU
//! that last used them (still warm in its cache) and `get`/`put` take no lock and make no
//! atomic read-modify-write. A housekeeping thread trims the per-CPU caches now and then, as
//! a server does when it goes idle, while the workers keep going.
//!
//! ```text
//! cargo run --release -p thiscpu --example object_pool
//! ```
//!
//! Checked at the end: no buffer was handed to two requests at once (each request finds its
//! own bytes in its buffer after filling it), every buffer the pool made is back in it, far
//! fewer buffers were made than requests served, and the request counter is exact.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use thiscpu::{Counter, Pool};

/// How long the workers serve.
const SERVE_FOR: Duration = Duration::from_millis(300);
/// How often the housekeeping thread trims the caches.
const TRIM_EVERY: Duration = Duration::from_millis(50);
/// Bytes in a response.
const RESPONSE: usize = 512;

/// Fills `buffer` with the response to request `id`: its id, then bytes derived from it.
fn respond(buffer: &mut Vec<u8>, id: u64) {
    buffer.clear();
    buffer.extend_from_slice(&id.to_le_bytes());
    buffer.extend((0..RESPONSE - 8).map(|i| (id as usize + i) as u8));
}

/// "Sends" the response: checks that the buffer still holds what request `id` wrote (another
/// request holding the same buffer would have overwritten it) and returns a checksum.
fn send(buffer: &[u8], id: u64) -> u64 {
    assert_eq!(buffer.len(), RESPONSE);
    assert_eq!(
        buffer[..8],
        id.to_le_bytes(),
        "a buffer was shared by two requests"
    );
    buffer.iter().map(|&b| u64::from(b)).sum()
}

pub fn main() {
    let buffers = Pool::new(|| Vec::<u8>::with_capacity(RESPONSE));
    let served = Counter::new();
    let workers = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .max(2);
    let done = AtomicBool::new(false);
    let start = Instant::now();

    let (tallies, trims) = std::thread::scope(|s| {
        let housekeeping = s.spawn(|| {
            let (mut trims, mut moved) = (0u32, 0usize);
            while !done.load(Ordering::Acquire) {
                std::thread::sleep(TRIM_EVERY);
                // Give cached buffers back to the shared list; a kernel without membarrier
                // (and a thread that cannot run on a CPU) makes this refuse, which is fine.
                match buffers.drain_all() {
                    Ok(n) => {
                        trims += 1;
                        moved += n;
                    }
                    Err(partial) => {
                        moved += partial.moved;
                        println!("trim incomplete: {partial}");
                    }
                }
            }
            (trims, moved)
        });
        let threads: Vec<_> = (0..workers as u64)
            .map(|worker| {
                let (buffers, served) = (&buffers, &served);
                s.spawn(move || {
                    let mut handled = 0u64;
                    let mut checksum = 0u64;
                    while start.elapsed() < SERVE_FOR {
                        for _ in 0..64 {
                            let id = worker << 48 | handled;
                            let mut buffer = buffers.get();
                            respond(&mut buffer, id);
                            // A little work between filling and sending, so preemption and
                            // migration can land while the buffer is out.
                            std::hint::spin_loop();
                            checksum = checksum.wrapping_add(send(&buffer, id));
                            drop(buffer); // back to this CPU's cache
                            served.inc();
                            handled += 1;
                        }
                    }
                    std::hint::black_box(checksum);
                    handled
                })
            })
            .collect();
        let tallies: Vec<u64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        done.store(true, Ordering::Release);
        (tallies, housekeeping.join().unwrap())
    });

    let handled: u64 = tallies.iter().sum();
    let elapsed = start.elapsed();
    println!(
        "{handled} requests on {workers} threads in {:.0} ms ({:.3} M requests/s)",
        elapsed.as_secs_f64() * 1e3,
        handled as f64 / elapsed.as_secs_f64() / 1e6
    );
    println!(
        "buffers made: {}, cached per CPU: {}, in the shared list: {}; {} trims moved {} buffers",
        buffers.created(),
        buffers.cached(),
        buffers.shared_len(),
        trims.0,
        trims.1
    );
    assert_eq!(
        served.sum(),
        handled,
        "the request counter lost or doubled one"
    );
    // Every buffer made is back: in a CPU's cache or in the shared list.
    assert_eq!(
        buffers.created(),
        (buffers.cached() + buffers.shared_len()) as u64,
        "a buffer was lost"
    );
    // Reuse: at most a few buffers per worker (one out at a time, plus what the caches and
    // the trims shuffled around), however many requests were served.
    assert!(
        buffers.created() <= (workers * 2 * buffers.capacity()) as u64,
        "{} buffers made for {handled} requests",
        buffers.created()
    );
}
