//! Runs the examples that check their own results, in this process: each example's `main`
//! asserts exact totals and panics otherwise.

#[path = "../examples/request_counter.rs"]
mod request_counter;

#[path = "../examples/per_cpu_stats.rs"]
mod per_cpu_stats;

#[path = "../examples/object_pool.rs"]
mod object_pool;

#[cfg(feature = "metrics-layer")]
#[path = "../examples/prometheus_layer.rs"]
mod prometheus_layer;

#[cfg(feature = "prometheus-client")]
#[path = "../examples/prometheus_registry.rs"]
mod prometheus_registry;

#[test]
fn request_counter_counts_every_request() {
    request_counter::main();
}

#[test]
fn per_cpu_stats_reports_exact_totals() {
    per_cpu_stats::main();
}

#[test]
fn object_pool_loses_and_shares_no_buffer() {
    object_pool::main();
}

#[path = "../examples/read_mostly.rs"]
mod read_mostly;

#[test]
fn read_mostly_reads_whole_values_across_reloads() {
    read_mostly::main();
}

#[path = "../examples/per_cpu_histogram.rs"]
mod per_cpu_histogram;

#[test]
fn per_cpu_histogram_merges_every_sample() {
    per_cpu_histogram::main();
}

#[cfg(feature = "metrics-layer")]
#[test]
fn prometheus_layer_renders_exact_totals() {
    prometheus_layer::main();
}

#[cfg(feature = "prometheus-client")]
#[test]
fn prometheus_registry_encodes_exact_totals() {
    prometheus_registry::main();
}
