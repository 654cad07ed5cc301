//! Unbound adds on the workload of `thiscpu bench otel` (three attributes, ten values each,
//! drawn by a xorshift), in a loop small enough to profile: under `valgrind --tool=callgrind`
//! (which runs without rseq, so the shards are taken by compare-and-swap) or `perf record`.
//!
//! ```text
//! cargo run --release -p thiscpu-opentelemetry --example unbound_adds -- [MODE] [ADDS]
//! ```
//!
//! MODE is `percpu` (`PerCpuCounter::add`, the default), `otel` (the same through the API's
//! `Counter<u64>`), `sdk` (the SDK's own counter), `attributes` (only the draws and the
//! `KeyValue`s every mode builds, so that their cost can be told apart from the add's),
//! `sharded` (those and the take of a `thiscpu::Sharded` shard, as every unbound add makes),
//! `owned` (`PerCpuCounter::add` of copies of the sets whose strings are owned, made at every
//! add) or `owned-attributes` (only those copies). The adds are preceded by a warm-up that
//! meets every set once.

use opentelemetry::KeyValue;
use opentelemetry::metrics::MeterProvider;
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use std::hint::black_box;
use std::time::{Duration, Instant};
use thiscpu_opentelemetry::PerCpuMeterExt;

const KEYS: [&str; 3] = ["attribute1", "attribute2", "attribute3"];
const VALUES: [&str; 10] = [
    "value1", "value2", "value3", "value4", "value5", "value6", "value7", "value8", "value9",
    "value10",
];

/// One add of a set, by the mode's instrument.
type Adds = dyn FnMut(&[KeyValue]);

#[inline(always)]
fn attributes(x: &mut u64) -> [KeyValue; 3] {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    let pick = |shift: u32| VALUES[((*x >> shift) % 10) as usize];
    [
        KeyValue::new(KEYS[0], pick(8)),
        KeyValue::new(KEYS[1], pick(24)),
        KeyValue::new(KEYS[2], pick(40)),
    ]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "percpu".to_owned());
    let adds: u64 = args.next().map_or(10_000_000, |n| n.parse().expect("ADDS"));
    // With a reader: the SDK aggregates nothing for a provider without one.
    let reader = PeriodicReader::builder(InMemoryMetricExporter::default())
        .with_interval(Duration::from_secs(3600))
        .build();
    let provider = SdkMeterProvider::builder().with_reader(reader).build();
    let meter = provider.meter("profile");
    let mut x = 0x9e37_79b9_7f4a_7c15_u64;
    let mut run: Box<Adds> = match mode.as_str() {
        "percpu" => {
            let counter = meter.percpu_u64_counter("adds").build();
            Box::new(move |set| counter.add(1, set))
        }
        "otel" => {
            let counter = meter.percpu_u64_counter("adds").build().counter();
            Box::new(move |set| counter.add(1, set))
        }
        "sdk" => {
            let counter = meter.u64_counter("adds").build();
            Box::new(move |set| counter.add(1, set))
        }
        "sharded" => {
            let sharded = thiscpu::Sharded::new(|_| 0u64);
            Box::new(move |set| sharded.with_current(|n| *n += set.len() as u64))
        }
        "owned" => {
            // The same sets with owned copies of their strings, made at every add: strings
            // whose addresses change from one add to the next.
            let counter = meter.percpu_u64_counter("adds").build();
            Box::new(move |set| {
                let owned = set.iter().map(|kv| {
                    KeyValue::new(kv.key.as_str().to_owned(), kv.value.as_str().into_owned())
                });
                let owned: Vec<KeyValue> = owned.collect();
                counter.add(1, &owned)
            })
        }
        "owned-attributes" => Box::new(|set| {
            let owned = set.iter().map(|kv| {
                KeyValue::new(kv.key.as_str().to_owned(), kv.value.as_str().into_owned())
            });
            black_box(owned.collect::<Vec<KeyValue>>());
        }),
        "attributes" => Box::new(|set| {
            black_box(set);
        }),
        other => panic!("unknown mode {other}"),
    };
    for _ in 0..10_000 {
        run(&attributes(&mut x));
    }
    let start = Instant::now();
    for _ in 0..adds {
        run(&attributes(&mut x));
    }
    let elapsed = start.elapsed();
    println!(
        "{mode}: {adds} adds, {:.1} ns each",
        elapsed.as_nanos() as f64 / adds as f64
    );
}
