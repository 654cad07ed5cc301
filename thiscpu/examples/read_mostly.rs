//! Read-mostly server state: a configuration behind a `thiscpu::RwLock` and a routing table in
//! a `thiscpu::EpochCell`, read on every request by every worker and replaced now and then by a
//! reloader thread. Readers make no atomic read-modify-write and write no shared cache line.
//!
//! ```text
//! cargo run --release -p thiscpu --example read_mostly
//! ```
//!
//! Each reload writes a configuration whose fields agree with each other (the same generation
//! everywhere) and a routing table of that generation; every request checks that what it read
//! is whole, and the run ends with the totals.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use thiscpu::{EpochCell, RwLock};

/// A configuration whose fields a reader must see from one reload, never mixed.
#[derive(Debug, Clone)]
struct Config {
    generation: u64,
    max_body_bytes: u64,
    greeting: String,
}

impl Config {
    fn of(generation: u64) -> Config {
        Config {
            generation,
            max_body_bytes: 1024 * (generation + 1),
            greeting: format!("hello from generation {generation}"),
        }
    }

    fn is_whole(&self) -> bool {
        self.max_body_bytes == 1024 * (self.generation + 1)
            && self.greeting == format!("hello from generation {}", self.generation)
    }
}

/// Paths to backends, and the generation that built them.
fn routes(generation: u64) -> (u64, HashMap<String, u64>) {
    let table = (0..16)
        .map(|i| (format!("/service/{i}"), generation * 100 + i))
        .collect();
    (generation, table)
}

/// How long the workers serve.
const SERVE_FOR: Duration = Duration::from_millis(300);

pub fn main() {
    let config = RwLock::new(Config::of(0));
    let table = EpochCell::new(routes(0));
    let done = AtomicBool::new(false);
    let served = AtomicU64::new(0);
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let reloads = std::thread::scope(|s| {
        for worker in 0..workers {
            let (config, table, done, served) = (&config, &table, &done, &served);
            s.spawn(move || {
                let mut mine = 0u64;
                while !done.load(Ordering::Relaxed) {
                    // One request: read the configuration, then route.
                    let limit = {
                        let config = config.read();
                        assert!(
                            config.is_whole(),
                            "a configuration half reloaded: {config:?}"
                        );
                        config.max_body_bytes
                    };
                    let path = format!("/service/{}", (mine + worker as u64) % 16);
                    let routes = table.load();
                    let (generation, ref paths) = *routes;
                    assert_eq!(paths[&path] / 100, generation, "a table of two generations");
                    std::hint::black_box(limit);
                    mine += 1;
                }
                served.fetch_add(mine, Ordering::Relaxed);
            });
        }
        let start = Instant::now();
        let mut generation = 0;
        while start.elapsed() < SERVE_FOR {
            std::thread::sleep(Duration::from_millis(10));
            generation += 1;
            *config.write() = Config::of(generation);
            table.store(routes(generation));
        }
        done.store(true, Ordering::Relaxed);
        generation
    });
    assert_eq!(config.read().generation, reloads);
    assert_eq!(table.load().0, reloads);
    println!(
        "{} requests served by {workers} workers across {reloads} reloads; every read was whole \
         ({})",
        served.load(Ordering::Relaxed),
        if config.uses_rseq() {
            "readers counted with rseq"
        } else {
            "readers counted with atomics"
        }
    );
}
