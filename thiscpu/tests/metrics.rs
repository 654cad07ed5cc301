//! The `metrics` backend: exact counters through the facade's macros from many threads,
//! `absolute` under concurrent increments, gauges, histograms, descriptions, the per-thread
//! handle cache and the global install.
#![cfg(feature = "metrics")]

use metrics::{CounterFn, Key, Label};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use thiscpu::metrics::{MetricKind, PerCpuCounter, PerCpuRecorder, THREAD_CACHE_KEYS};

/// More threads than this machine has CPUs, so that threads share CPUs and get preempted
/// inside their increments.
fn threads() -> usize {
    2 * std::thread::available_parallelism().map_or(2, |n| n.get()) + 2
}

/// Runs `work(thread index)` on `n` threads at once, each under `recorder` as its local
/// recorder.
fn on_threads(recorder: &PerCpuRecorder, n: usize, work: impl Fn(usize) + Sync) {
    let start = Barrier::new(n);
    std::thread::scope(|s| {
        for t in 0..n {
            let (start, work) = (&start, &work);
            s.spawn(move || {
                metrics::with_local_recorder(recorder, || {
                    start.wait();
                    work(t);
                })
            });
        }
    });
}

#[test]
fn macro_increments_from_many_threads_are_exact() {
    let recorder = PerCpuRecorder::new();
    let n = threads();
    const EACH: u64 = 20_000;
    on_threads(&recorder, n, |t| {
        for i in 0..EACH {
            metrics::counter!("requests").increment(1);
            metrics::counter!("bytes", "dir" => "in").increment(i % 7);
            if t % 2 == 0 {
                // A key made at run time, as `counter!(format!(..))` makes it.
                metrics::counter!(format!("shard_{}", i % 3)).increment(2);
            }
        }
    });
    let snapshot = recorder.snapshot();
    let n = n as u64;
    assert_eq!(snapshot.counter("requests"), Some(n * EACH));
    let bytes_per_thread: u64 = (0..EACH).map(|i| i % 7).sum();
    let bytes = Key::from_parts("bytes", vec![Label::new("dir", "in")]);
    assert_eq!(snapshot.counter(bytes), Some(n * bytes_per_thread));
    let even_threads = n.div_ceil(2);
    let shards: u64 = (0..3)
        .map(|shard| snapshot.counter(format!("shard_{shard}")).unwrap())
        .sum();
    assert_eq!(shards, even_threads * EACH * 2);
    assert_eq!(snapshot.counters.len(), 5);
    assert!(snapshot.counters.windows(2).all(|w| w[0].0 < w[1].0));
}

#[test]
fn handles_kept_and_moved_between_threads_count_once() {
    let recorder = PerCpuRecorder::new();
    // Registered on this thread, incremented and dropped on others.
    let handle = metrics::with_local_recorder(&recorder, || metrics::counter!("moved"));
    std::thread::scope(|s| {
        for _ in 0..4 {
            let handle = handle.clone();
            s.spawn(move || (0..1000).for_each(|_| handle.increment(1)));
        }
    });
    drop(handle);
    metrics::with_local_recorder(&recorder, || metrics::counter!("moved").increment(1));
    assert_eq!(recorder.snapshot().counter("moved"), Some(4001));
}

#[test]
fn equal_keys_share_one_counter_however_they_are_made() {
    let recorder = PerCpuRecorder::new();
    on_threads(&recorder, 3, |t| {
        for i in 0..3_000u64 {
            // The same key from a literal, from a fresh String, and with labels that differ
            // only in value, interleaved so that the thread's last-key shortcut keeps changing.
            metrics::counter!("k").increment(1);
            metrics::counter!(String::from("k")).increment(2);
            let parity = if (i + t as u64).is_multiple_of(2) {
                "even"
            } else {
                "odd"
            };
            metrics::counter!("k", "parity" => parity).increment(1);
        }
    });
    let snapshot = recorder.snapshot();
    assert_eq!(snapshot.counter("k"), Some(3 * 3_000 * 3));
    let labelled =
        |p: &'static str| snapshot.counter(Key::from_parts("k", vec![Label::new("parity", p)]));
    assert_eq!(
        labelled("even").unwrap() + labelled("odd").unwrap(),
        3 * 3_000
    );
    assert_eq!(snapshot.counters.len(), 3);
}

#[test]
fn keys_beyond_the_thread_cache_still_count() {
    let recorder = PerCpuRecorder::new();
    let keys = THREAD_CACHE_KEYS + 50;
    on_threads(&recorder, 3, |_| {
        for round in 0..3u64 {
            for k in 0..keys {
                metrics::counter!(format!("k{k}")).increment(round + 1);
            }
        }
    });
    let snapshot = recorder.snapshot();
    assert_eq!(snapshot.counters.len(), keys);
    assert!(
        snapshot.counters.iter().all(|(_, v)| *v == 3 * 6),
        "{:?}",
        snapshot.counters.iter().find(|(_, v)| *v != 18)
    );
}

#[test]
fn recorders_do_not_share_counters() {
    // Many recorders, made and dropped on the same thread: each keeps its own counts, even
    // when a new one is allocated where an old one was.
    for round in 1..=20u64 {
        let recorder = PerCpuRecorder::new();
        metrics::with_local_recorder(&recorder, || {
            for _ in 0..round {
                metrics::counter!("same_name").increment(1);
            }
        });
        let other = PerCpuRecorder::new();
        metrics::with_local_recorder(&other, || metrics::counter!("same_name").increment(1000));
        assert_eq!(recorder.snapshot().counter("same_name"), Some(round));
        assert_eq!(other.snapshot().counter("same_name"), Some(1000));
    }
}

#[test]
fn absolute_is_set_to_at_least() {
    let c = PerCpuCounter::new();
    c.absolute(0);
    assert_eq!(c.value(), 0);
    c.increment(5);
    c.absolute(3); // below: nothing
    assert_eq!(c.value(), 5);
    c.absolute(100);
    assert_eq!(c.value(), 100);
    c.increment(1);
    assert_eq!(c.value(), 101);
    c.absolute(101); // equal: nothing
    c.absolute(50);
    assert_eq!(c.value(), 101);
    c.absolute(u64::MAX);
    assert_eq!(c.value(), u64::MAX);
    assert_eq!(c.increments(), 6);
}

/// Increments, `absolute` calls and readers all at once: no increment lost, the value
/// monotonic for every reader, each `absolute(v)` visible to its caller on return, and the
/// final value within the documented bound.
#[test]
fn absolute_with_concurrent_increments() {
    let counter = Arc::new(PerCpuCounter::new());
    let handle = metrics::Counter::from_arc(counter.clone());
    let writers = threads();
    const EACH: u64 = 50_000;
    const STEP: u64 = 1_000;
    let stop = AtomicBool::new(false);
    // Readers, incrementers and the setter all start together, so the reads overlap the
    // updates however the threads get scheduled.
    let start = Barrier::new(2 + writers + 1);
    let mut highest_absolute = 0;
    std::thread::scope(|s| {
        let readers: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    let mut last = 0;
                    let mut reads = 0u64;
                    loop {
                        let now = counter.value();
                        assert!(now >= last, "value went down: {last} then {now}");
                        last = now;
                        reads += 1;
                        if stop.load(Ordering::Relaxed) {
                            return reads;
                        }
                    }
                })
            })
            .collect();
        let incrementers: Vec<_> = (0..writers)
            .map(|_| {
                let (handle, start) = (handle.clone(), &start);
                s.spawn(move || {
                    start.wait();
                    (0..EACH).for_each(|_| handle.increment(1))
                })
            })
            .collect();
        // Catch up with an "external" count that runs ahead of the increments, sometimes
        // repeating an older, smaller value.
        let setter = s.spawn(|| {
            start.wait();
            let mut highest = 0;
            for i in 1..=200u64 {
                let v = i * STEP + counter.increments();
                let v = if i % 5 == 0 { v / 2 } else { v };
                counter.absolute(v);
                highest = highest.max(v);
                assert!(counter.value() >= v, "absolute({v}) returned below it");
            }
            highest
        });
        highest_absolute = setter.join().unwrap();
        for t in incrementers {
            t.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        let reads: Vec<u64> = readers.into_iter().map(|r| r.join().unwrap()).collect();
        eprintln!("reads checked for monotonicity: {reads:?}");
    });
    let increments = writers as u64 * EACH;
    assert_eq!(counter.increments(), increments, "an increment was lost");
    let value = counter.value();
    assert!(value >= highest_absolute && value >= increments);
    // `absolute(v)` adds at most what `v` exceeded the increments by when it read them: the
    // final offset is at most `highest_absolute`, and strictly less unless no increment had
    // been counted then.
    assert!(
        value <= highest_absolute + increments,
        "{value} > {highest_absolute} + {increments}"
    );
}

#[test]
fn gauges_are_exact_under_concurrent_updates() {
    let recorder = PerCpuRecorder::new();
    let n = threads();
    on_threads(&recorder, n, |t| {
        for _ in 0..5_000 {
            metrics::gauge!("in_flight").increment(3.0);
            metrics::gauge!("in_flight").decrement(1.0);
        }
        if t == 0 {
            metrics::gauge!("config_version").set(7.0);
        }
    });
    let snapshot = recorder.snapshot();
    // Small integers are exact in an f64: any lost update would show.
    assert_eq!(snapshot.gauge("in_flight"), Some(n as f64 * 10_000.0));
    assert_eq!(snapshot.gauge("config_version"), Some(7.0));
    assert_eq!(snapshot.gauge("absent"), None);
}

#[test]
fn histograms_keep_count_sum_min_max() {
    let recorder = PerCpuRecorder::new();
    let n = threads();
    on_threads(&recorder, n, |t| {
        for i in 0..1_000u32 {
            metrics::histogram!("latency").record(f64::from(i % 10) + t as f64);
        }
        metrics::histogram!("latency").record_many(0.5, 4);
    });
    let summary = recorder.snapshot().histogram("latency").unwrap();
    assert_eq!(summary.count, n as u64 * 1_004);
    let per_thread = |t: usize| 100.0 * 45.0 + 1_000.0 * t as f64 + 2.0;
    assert_eq!(summary.sum, (0..n).map(per_thread).sum::<f64>());
    assert_eq!(summary.min, 0.0);
    assert_eq!(summary.max, 9.0 + (n - 1) as f64);
    assert_eq!(summary.mean(), Some(summary.sum / summary.count as f64));

    let empty = PerCpuRecorder::new();
    metrics::with_local_recorder(&empty, || drop(metrics::histogram!("never")));
    let none = empty.snapshot().histogram("never").unwrap();
    assert_eq!((none.count, none.mean()), (0, None));
}

#[test]
fn histograms_count_every_value_in_its_bucket() {
    let recorder = PerCpuRecorder::with_buckets(&[1.0, 5.0, 10.0]).unwrap();
    let n = threads();
    on_threads(&recorder, n, |t| {
        for i in 0..1_000u32 {
            // 0..=9 plus the thread's index: the buckets' shares are known per thread.
            metrics::histogram!("size").record(f64::from(i % 10) + t as f64);
        }
        metrics::histogram!("size").record_many(0.5, 4);
    });
    let size = recorder.snapshot().histogram("size").unwrap();
    let mut expected = [0u64; 4];
    for t in 0..n {
        for v in 0..10 {
            let v = (v + t) as f64;
            let bucket = [1.0, 5.0, 10.0].iter().position(|&le| v <= le).unwrap_or(3);
            expected[bucket] += 100;
        }
        expected[0] += 4;
    }
    let counts: Vec<u64> = size.buckets.iter().map(|b| b.count).collect();
    assert_eq!(counts, expected);
    let bounds: Vec<f64> = size.buckets.iter().map(|b| b.le).collect();
    assert_eq!(bounds, [1.0, 5.0, 10.0, f64::INFINITY]);
    assert_eq!(size.count, n as u64 * 1_004);
    assert!(PerCpuRecorder::with_buckets(&[1.0, 1.0]).is_err());
}

#[test]
fn descriptions_keep_the_first_per_name_and_kind() {
    let recorder = PerCpuRecorder::new();
    metrics::with_local_recorder(&recorder, || {
        metrics::describe_counter!("io", metrics::Unit::Bytes, "bytes moved");
        metrics::describe_counter!("io", "again");
        metrics::describe_gauge!("io", "a gauge of the same name");
    });
    let d = recorder.snapshot().descriptions;
    assert_eq!(d.len(), 2);
    assert_eq!(
        (d[0].kind, d[0].name.as_str(), d[0].unit, &*d[0].text),
        (
            MetricKind::Counter,
            "io",
            Some(metrics::Unit::Bytes),
            "bytes moved"
        )
    );
    assert_eq!(
        (d[1].kind, &*d[1].text),
        (MetricKind::Gauge, "a gauge of the same name")
    );
}

/// The only test in this binary that installs a global recorder (there is one per process):
/// threads with no local recorder record into it.
#[test]
fn installed_recorder_sees_every_thread() {
    let recorder = PerCpuRecorder::new();
    recorder
        .install()
        .expect("no other test installs a recorder");
    assert!(PerCpuRecorder::new().install().is_err());
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| (0..2_500).for_each(|_| metrics::counter!("global_hits").increment(1)));
        }
    });
    assert_eq!(recorder.snapshot().counter("global_hits"), Some(10_000));
    assert!(format!("{recorder:?}").contains("counters: 1"));
}
