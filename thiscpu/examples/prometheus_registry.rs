//! thiscpu's per-CPU counter and histogram in a `prometheus_client` registry, encoded as a
//! Prometheus counter and histogram.
//!
//! ```text
//! cargo run --release -p thiscpu --features prometheus-client --example prometheus_registry
//! ```
//!
//! The workers tally what they did, so the encoded numbers are checked against exact totals.

use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;
use thiscpu::prometheus::{Counter, Histogram};

/// The value of sample line `series` in OpenMetrics `text`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let (name, value) = line.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok())?
    })
}

pub fn main() {
    let requests = Counter::new();
    let sizes = Histogram::new([64.0, 1024.0, 16384.0]);
    let mut registry = Registry::default();
    registry.register("requests", "Requests served", requests.clone());
    registry.register("response_bytes", "Size of each response", sizes.clone());

    let workers = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .max(2);
    let (handled, bytes): (u64, u64) = std::thread::scope(|s| {
        let threads: Vec<_> = (0..workers as u64)
            .map(|worker| {
                let (requests, sizes) = (&requests, &sizes);
                s.spawn(move || {
                    let mut bytes = 0u64;
                    for request in 0..50_000u64 {
                        let size = (request * 37 + worker) % 20_000;
                        requests.inc(); // one restartable add on this CPU's word
                        sizes.observe(size as f64); // one add and one compare-and-store
                        bytes += size;
                    }
                    (50_000, bytes)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .fold((0, 0), |(n, b), (tn, tb)| (n + tn, b + tb))
    });

    let mut text = String::new();
    encode(&mut text, &registry).expect("writing to a String");
    println!("{text}");
    assert_eq!(sample(&text, "requests_total"), Some(handled as f64));
    assert_eq!(sample(&text, "response_bytes_count"), Some(handled as f64));
    assert_eq!(sample(&text, "response_bytes_sum"), Some(bytes as f64));
    assert_eq!(
        sample(&text, r#"response_bytes_bucket{le="+Inf"}"#),
        Some(handled as f64)
    );
    println!("{handled} requests, {bytes} bytes, exact in the encoded registry");
}
