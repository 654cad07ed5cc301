//! A loop of `alloc`, a write and `dealloc` of one allocator, the loop of `bench alloc`'s
//! pairs, for counting one pair's instructions:
//!
//! ```text
//! cargo build --release -p thiscpu-cli --example alloc_pairs
//! valgrind --tool=callgrind --cache-sim=yes target/release/examples/alloc_pairs jemalloc 100000
//! valgrind --tool=callgrind --cache-sim=yes target/release/examples/alloc_pairs jemalloc 200000
//! ```
//!
//! The difference of the two runs' totals over 100,000 is one pair's instructions (`Ir`),
//! loads (`Dr`) and stores (`Dw`). thiscpu's caches need rseq, which valgrind does not offer
//! (its pairs there go to glibc): count them in the loop's disassembly instead, `objdump -d
//! -M intel --no-show-raw-insn -C` of this program, the `alloc_pairs::pairs` whose loop calls
//! no allocator, along the path where the cache serves both calls.
//!
//! Usage: `alloc_pairs ALLOCATOR PAIRS [SIZE]`, ALLOCATOR one of glibc, thiscpu and, on x86_64
//! Linux, jemalloc and mimalloc; SIZE in bytes, 64 by default.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::process::ExitCode;

static THISCPU: thiscpu::PerCpuAlloc = thiscpu::PerCpuAlloc::new();

/// `pairs` pairs of `size`-byte objects, after 1,000 to set the allocator up.
#[inline(never)]
fn pairs<A: GlobalAlloc>(alloc: &A, layout: Layout, pairs: u64) {
    let alloc = black_box(alloc);
    let layout = black_box(layout);
    for pair in 0..pairs {
        // SAFETY: the layout's size is not zero.
        let object = unsafe { alloc.alloc(layout) };
        if object.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        // SAFETY: a new allocation of at least 8 bytes, aligned to 8.
        unsafe { object.cast::<u64>().write(pair) };
        // SAFETY: made just above with `layout`, freed once.
        unsafe { alloc.dealloc(black_box(object), layout) };
    }
}

fn run<A: GlobalAlloc>(alloc: &A, layout: Layout, count: u64) {
    pairs(alloc, layout, 1000);
    pairs(alloc, layout, count);
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: alloc_pairs ALLOCATOR PAIRS [SIZE] (ALLOCATOR: glibc, thiscpu, jemalloc, \
                 mimalloc)";
    let (Some(which), Some(Ok(count))) = (args.first(), args.get(1).map(|n| n.parse::<u64>()))
    else {
        eprintln!("{usage}");
        return ExitCode::from(2);
    };
    let size = match args.get(2).map(|n| n.parse::<usize>()) {
        None => 64,
        Some(Ok(size)) if size > 0 => size,
        Some(_) => {
            eprintln!("{usage}: SIZE is a number of bytes above 0");
            return ExitCode::from(2);
        }
    };
    let Ok(layout) = Layout::from_size_align(size, 8) else {
        eprintln!("{usage}: SIZE is too large");
        return ExitCode::from(2);
    };
    match which.as_str() {
        "glibc" => run(&System, layout, count),
        "thiscpu" => run(&THISCPU, layout, count),
        #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
        "jemalloc" => run(&tikv_jemallocator::Jemalloc, layout, count),
        #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
        "mimalloc" => run(&mimalloc::MiMalloc, layout, count),
        other => {
            eprintln!("{usage}: no allocator {other:?} here");
            return ExitCode::from(2);
        }
    }
    ExitCode::SUCCESS
}
