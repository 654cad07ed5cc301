//! A probe for the disassembly check in `.ci/check_fast_path.py`: `current_cpu()` compiled into
//! a function of its own, under a fixed symbol name, so its machine code can be read back from
//! the release binary. Run it to see it answer:
//!
//! ```text
//! cargo run --release -p thiscpu --example fast_path_probe
//! ```

/// `thiscpu::current_cpu()` and nothing else, kept out of line so it survives as its own symbol.
#[inline(never)]
#[unsafe(no_mangle)]
pub fn thiscpu_probe_current_cpu() -> u32 {
    thiscpu::current_cpu()
}

/// `Counter::inc()` and nothing else, for the check that its fast path has no `lock` prefix.
#[inline(never)]
#[unsafe(no_mangle)]
pub fn thiscpu_probe_counter_inc(counter: &thiscpu::Counter) {
    counter.inc();
}

/// `n` increments through one `Counter::adder()`, for the check that the loop keeps what the
/// adder read in registers (no load besides the section's own).
#[inline(never)]
#[unsafe(no_mangle)]
pub fn thiscpu_probe_adder_loop(counter: &thiscpu::Counter, n: u64) {
    let adder = counter.adder();
    for _ in 0..n {
        adder.inc();
    }
}

fn main() {
    let probe: fn() -> u32 = std::hint::black_box(thiscpu_probe_current_cpu);
    let cpu = probe();
    println!(
        "thiscpu_probe_current_cpu() = {cpu} (answered by {})",
        thiscpu::source().this_thread.name()
    );
    let counter = thiscpu::Counter::new();
    let inc: fn(&thiscpu::Counter) = std::hint::black_box(thiscpu_probe_counter_inc);
    for _ in 0..1000 {
        inc(&counter);
    }
    assert_eq!(counter.sum(), 1000);
    println!("thiscpu_probe_counter_inc() x 1000: the counter sums to 1000");
    let adder_loop: fn(&thiscpu::Counter, u64) = std::hint::black_box(thiscpu_probe_adder_loop);
    adder_loop(&counter, 1000);
    assert_eq!(counter.sum(), 2000);
    println!("thiscpu_probe_adder_loop(1000): the counter sums to 2000");
}
