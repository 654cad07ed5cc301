//! Per-CPU caches in front of the system allocator for a whole program: four threads build and
//! drop maps of short strings, then the caches report what they did and give their memory back.
//!
//! `cargo run --release -p thiscpu --example per_cpu_alloc`

use std::collections::HashMap;

// With `--cfg thiscpu_global_alloc` the library declares the global allocator itself, and
// this one only reports.
#[cfg_attr(not(thiscpu_global_alloc), global_allocator)]
static ALLOCATOR: thiscpu::PerCpuAlloc = thiscpu::PerCpuAlloc::new();

fn main() {
    std::thread::scope(|s| {
        for thread in 0..4u64 {
            s.spawn(move || {
                let mut total = 0;
                for round in 0..200u64 {
                    let map: HashMap<u64, String> = (0..500)
                        .map(|key| (key, format!("{thread}/{round}/{key}")))
                        .collect();
                    total += map.values().map(String::len).sum::<usize>();
                }
                total
            });
        }
    });
    let stats = ALLOCATOR.stats();
    if !stats.caching {
        println!("no per-CPU caches in this process (no rseq): every call went to malloc");
        return;
    }
    for cpu in stats
        .per_cpu
        .iter()
        .filter(|cpu| cpu.misses + cpu.cached_objects > 0)
    {
        println!(
            "CPU {:>3}: {:>7} misses, {:>7} spills, {:>6} objects ({} bytes) cached",
            cpu.cpu, cpu.misses, cpu.spills, cpu.cached_objects, cpu.cached_bytes
        );
    }
    match ALLOCATOR.release() {
        Ok(bytes) => println!("released {bytes} bytes to malloc"),
        Err(why) => println!("release: {why}"),
    }
    println!(
        "cached after the release: {} bytes",
        ALLOCATOR.stats().cached_bytes()
    );
}
