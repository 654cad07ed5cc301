//! Per-CPU counters in front of the Prometheus exporter: every `metrics::counter!` in the
//! program increments a per-CPU counter (no atomic), and `PerCpuLayer` publishes the totals to
//! metrics-exporter-prometheus, which renders them for a scrape.
//!
//! ```text
//! cargo run --release -p thiscpu --features metrics-layer --example prometheus_layer
//! ```
//!
//! The workers tally their own requests, so the exact totals are known and checked against
//! the rendered exposition text.

use metrics_exporter_prometheus::PrometheusBuilder;
use metrics_util::layers::Layer;
use std::time::Duration;
use thiscpu::metrics::PerCpuLayer;

/// The value of sample line `series` in Prometheus exposition `text`.
fn sample(text: &str, series: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (name, value) = line.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok())?
    })
}

pub fn main() {
    // The exporter's recorder, without its HTTP listener: a server would serve
    // `handle.render()` on its own /metrics route (or use `PrometheusBuilder::install`).
    let exporter = PrometheusBuilder::new()
        .set_buckets(&[0.001, 0.01, 0.1])
        .expect("increasing buckets")
        .build_recorder();
    let handle = exporter.handle();
    // Counters become per-CPU; totals reach the exporter every 5 s and at each flush.
    let layered = PerCpuLayer::new()
        .interval(Duration::from_secs(5))
        .layer(exporter);
    let publisher = layered.publisher();
    metrics::set_global_recorder(layered).expect("the first recorder of this process");

    let workers = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .max(2);
    let handled: u64 = std::thread::scope(|s| {
        let threads: Vec<_> = (0..workers)
            .map(|worker| {
                s.spawn(move || {
                    let mut handled = 0u64;
                    for request in 0..100_000u64 {
                        let route = if request % 4 == 0 { "/login" } else { "/" };
                        metrics::counter!("http_requests_total", "route" => route).increment(1);
                        if request % 1000 == 0 {
                            metrics::histogram!("request_seconds").record(0.002 * worker as f64);
                        }
                        handled += 1;
                    }
                    handled
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).sum()
    });

    // What a /metrics handler does: publish, then render.
    publisher.flush();
    let text = handle.render();
    println!("{text}");
    let root = sample(&text, r#"http_requests_total{route="/"}"#).expect("published");
    let login = sample(&text, r#"http_requests_total{route="/login"}"#).expect("published");
    assert_eq!(root + login, handled, "requests lost or counted twice");
    assert_eq!(login, handled / 4);
    assert_eq!(sample(&text, "request_seconds_count"), Some(handled / 1000));
    println!("{handled} requests from {workers} threads, all in the exposition");
    // At exit: stop the publishing thread and publish a last time.
    publisher.shutdown();
}
