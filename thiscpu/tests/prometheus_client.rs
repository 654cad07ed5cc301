//! thiscpu's counter and histogram in a `prometheus_client` registry, next to the crate's own:
//! encoded to text and the numbers parsed back.
#![cfg(feature = "prometheus-client")]

use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;
use std::sync::Barrier;

fn threads() -> usize {
    2 * std::thread::available_parallelism().map_or(2, |n| n.get()) + 2
}

/// The value of the sample line `series` in OpenMetrics `text`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().expect("a number"))
        })
}

#[test]
fn counter_and_histogram_encode_exact_numbers() {
    let requests = thiscpu::prometheus::Counter::new();
    let theirs = prometheus_client::metrics::counter::Counter::<u64>::default();
    let latency = thiscpu::prometheus::Histogram::new([1.0, 10.0, 100.0]);
    let mut registry = Registry::default();
    registry.register("requests", "Requests served", requests.clone());
    registry.register(
        "theirs",
        "The same, counted by prometheus-client",
        theirs.clone(),
    );
    registry.register("latency", "Latency in ms", latency.clone());

    let n = threads();
    const EACH: u64 = 20_000;
    let start = Barrier::new(n);
    std::thread::scope(|s| {
        for t in 0..n as u64 {
            let (requests, theirs, latency, start) = (&requests, &theirs, &latency, &start);
            s.spawn(move || {
                start.wait();
                for i in 0..EACH {
                    requests.inc();
                    theirs.inc();
                    latency.observe(((i + t) % 150) as f64);
                }
            });
        }
    });

    let mut text = String::new();
    encode(&mut text, &registry).unwrap();
    let total = (n as u64 * EACH) as f64;
    assert!(text.contains("# TYPE requests counter\n"), "{text}");
    assert_eq!(sample(&text, "requests_total"), Some(total), "{text}");
    assert_eq!(sample(&text, "theirs_total"), Some(total));

    assert!(text.contains("# TYPE latency histogram\n"), "{text}");
    let mut cumulative = [0u64; 4];
    let mut sum = 0u64;
    for t in 0..n as u64 {
        for i in 0..EACH {
            let v = (i + t) % 150;
            sum += v;
            for (b, le) in [1.0, 10.0, 100.0, f64::INFINITY].into_iter().enumerate() {
                if v as f64 <= le {
                    cumulative[b] += 1;
                }
            }
        }
    }
    for (le, expected) in ["1.0", "10.0", "100.0", "+Inf"].into_iter().zip(cumulative) {
        let series = format!("latency_bucket{{le=\"{le}\"}}");
        assert_eq!(
            sample(&text, &series),
            Some(expected as f64),
            "{series} in {text}"
        );
    }
    assert_eq!(sample(&text, "latency_count"), Some(total));
    assert_eq!(sample(&text, "latency_sum"), Some(sum as f64));
}

#[test]
fn an_empty_histogram_encodes_zeros() {
    let h = thiscpu::prometheus::Histogram::new([0.5]);
    let mut registry = Registry::default();
    registry.register("idle", "Nothing observed", h);
    let mut text = String::new();
    encode(&mut text, &registry).unwrap();
    assert_eq!(sample(&text, "idle_count"), Some(0.0), "{text}");
    assert_eq!(sample(&text, "idle_sum"), Some(0.0));
    assert_eq!(sample(&text, "idle_bucket{le=\"+Inf\"}"), Some(0.0));
    assert!(thiscpu::prometheus::Histogram::try_new([1.0, 0.0]).is_err());
}
