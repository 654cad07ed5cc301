//! thiscpu: which CPU (and NUMA node) am I running on, in about a nanosecond, and per-CPU data
//! that many threads update without atomic instructions.
//!
//! ```
//! let here = thiscpu::getcpu();
//! println!("cpu {} on node {} (via {})", here.cpu, here.node, thiscpu::source().this_thread.name());
//!
//! let requests = thiscpu::Counter::new();
//! std::thread::scope(|s| {
//!     for _ in 0..4 {
//!         s.spawn(|| (0..1000).for_each(|_| requests.inc()));
//!     }
//! });
//! assert_eq!(requests.sum(), 4000);
//! ```
//!
//! # Restartable sequences
//! Linux keeps, for every thread that registers one, a small *restartable sequences* (rseq)
//! area (`rseq(2)`, since Linux 4.18) whose `cpu_id` field the kernel rewrites whenever the
//! thread comes back to user space on a CPU. Reading the current CPU is then a single load, as
//! the kernel does for itself on arm64 (`thread_info->cpu`). A *restartable sequence* is a short
//! run of instructions that the kernel promises to abort (jump to a handler) if the thread is
//! preempted, migrated or signalled in the middle: per-CPU data can be updated with plain loads
//! and stores, no `lock` prefix, and no other thread can interleave on that CPU. An aborted
//! sequence has stored nothing and is simply retried, so the updates stay exact.
//!
//! # Where the answer comes from
//! 1. glibc 2.35+ registers an rseq area for every thread; thiscpu reads that one.
//! 2. When glibc did not (`GLIBC_TUNABLES=glibc.pthread.rseq=0`, older glibc, other libcs),
//!    thiscpu registers an area of its own in each thread, on first use, in static TLS: 32
//!    bytes, or where the kernel's `AT_RSEQ_FEATURE_SIZE` exceeds 32 (Linux 7.x) the feature
//!    size rounded up to `AT_RSEQ_ALIGN`, which the kernel runs in its optimized mode
//!    ([`RseqMode`]; `THISCPU_RSEQ_AREA=legacy` keeps 32 bytes).
//! 3. Without rseq (old kernels, valgrind, qemu-user, seccomp, or `THISCPU_RSEQ=off`), the
//!    fallback chosen once per process answers: `rdpid` where the CPU has it, then the vDSO's
//!    `getcpu`, then the system call. [`source()`] says which.
//!
//! Every type keeps working down this chain: without rseq, [`Counter`] adds atomically to the
//! word of the CPU the fallback reports. Exact, but no faster than an atomic.
//!
//! # Platforms
//! The same API builds on every target with `std`; only the cost changes. Restartable
//! sequences are used on Linux x86_64, aarch64 and riscv64. Everywhere else nobody registers
//! ([`Unavailable::NotPorted`]), every per-CPU update is an atomic read-modify-write on the
//! current CPU's slot, and `Sharded`, `RwLock` and `EpochCell` run in their atomic modes.
//!
//! | target | "which CPU" ([`CpuSource`]) | per-CPU updates |
//! |---|---|---|
//! | Linux x86_64, aarch64, riscv64 | rseq; else `rdpid`, vDSO, system call | restartable sequences |
//! | Linux, other architectures | glibc's `sched_getcpu` (reads glibc's rseq area, 2.35+) | atomic |
//! | macOS 11+, iOS 14.2+ | `pthread_cpu_number_np` | atomic |
//! | Windows | `GetCurrentProcessorNumberEx`, groups made one index | atomic |
//! | FreeBSD 13.1+ | `sched_getcpu` | atomic |
//! | others (wasm, ...) | a per-thread index, so threads still spread | atomic |
//!
//! What the atomic updates cost is measured on Linux by running the same structures with
//! `THISCPU_RSEQ=off` (the `-rseq-off` cases of `thiscpu bench counter sharded rwlock`); the
//! repository's recorded figures are in its `docs/platforms.md`, checked against the recorded
//! runs.
//!
//! Off Linux, [`topology`] counts CPUs with `std::thread::available_parallelism` and the
//! system's configured processors and puts every CPU on node 0; [`topology::pin_to`] and
//! [`topology::allowed_cpus`] return an error of kind `Unsupported`; the [`fence`] functions
//! return their "unavailable" errors. The `thiscpu` command is Linux only.
//!
//! # What is inside
//! - [`current_cpu`], [`getcpu`], [`current_node`], [`mm_cid`]: where this thread runs.
//! - [`Counter`]: an exact per-CPU counter whose `add` is one restartable sequence.
//! - [`Histogram`]: an exact per-CPU histogram with fixed buckets, `observe` a restartable add
//!   and a restartable compare-and-store.
//! - [`PerCpu`] and [`CachePadded`]: one value per possible CPU, each on its own cache lines.
//! - [`Pool`]: an object pool with a bounded cache per CPU, `get` and `put` as restartable
//!   sequences, and caches that another thread can drain while they are in use.
//! - [`Sharded`]: one value of any type per CPU (a map, a histogram, a free list), taken on the
//!   current CPU by a restartable sequence and released with one store; readers visit every
//!   shard.
//! - [`RwLock`] and [`EpochCell`]: a reader-writer lock and an `ArcSwap`-like cell for
//!   read-mostly data, whose readers count themselves per CPU with restartable sequences (no
//!   atomic instruction, no shared cache line written) and whose writers fence with
//!   `membarrier`.
//! - [`PerCpuAlloc`]: a per-CPU cache of small objects in front of any global allocator
//!   (`#[global_allocator]` in one line), each `alloc` a restartable pop and each `dealloc` a
//!   restartable push, bounded per CPU, releasable from any thread ([`allocator`]).
//! - [`CpuMask`]: a set of CPUs whose `set` skips the atomic write when the bit already holds.
//! - [`fence`]: `membarrier`-based fences that let one thread take over another CPU's data.
//! - [`ops`]: the raw restartable operations (add, compare-and-store, list pop and push) for
//!   building other per-CPU structures; [`dense`]: the allocator that packs per-CPU words.
//! - [`topology`]: possible and online CPUs, and their NUMA nodes, from `/sys`.
//! - [`via`]: every other way to read the current CPU (the system call, the vDSO, the CPU's own
//!   instructions), each on its own, for comparison and for code that picks one
//!   ([`CpuSource`]).
//! - `metrics` (feature `metrics`): a backend for the `metrics` facade whose counters are
//!   per-CPU, so that `metrics::counter!(..).increment(1)` makes no atomic read-modify-write;
//!   with feature `metrics-layer`, `metrics::PerCpuLayer` puts per-CPU counters in front of any
//!   other recorder (an exporter's) and publishes their totals to it.
//! - `prometheus` (feature `prometheus-client`): a per-CPU counter and histogram for a
//!   `prometheus_client` registry.
//!
//! One public module is hidden from the documentation and outside the stable surface (it may
//! change in any release): `abi`, the kernel's rseq structures as thiscpu uses them.
//!
//! # When not to use thiscpu
//! - **Little contention.** A counter that one thread, or a few threads now and then, update is
//!   well served by an `AtomicU64`: an uncontended atomic add costs a few nanoseconds and
//!   reading it is one load. Per-CPU data pays on the read side instead (a [`Counter::sum`]
//!   visits one word per CPU that ever wrote it) and in memory (8 bytes per CPU per counter).
//!   It wins when many CPUs write the same thing often and reads are rare.
//! - **Reads that need a linearizable snapshot.** A sum over per-CPU words is a value the
//!   counter passed through while it was read, not its value at one instant, and two counters
//!   read one after the other are not consistent with each other. Unique ids, sequence
//!   numbers, a limit that must never be exceeded, or a compare-and-set on the total need one
//!   shared atomic (or a lock).
//! - **Heavy CPU hot-plug.** Per-CPU data is sized for the CPUs that are *possible* at start.
//!   A CPU taken offline keeps what was stored on its slot (still summed, but cached objects
//!   on it are out of reach until it comes back), and a process that brings CPUs on and off all
//!   the time gains nothing from locality it keeps losing.
//! - **Not Linux, not x86_64, aarch64 or riscv64, if speed is the reason.** rseq is a Linux
//!   system call with a port per architecture; every other target builds the same API on the
//!   portable path above. There, and on Linux before 4.18 or where rseq is missing (some
//!   sandboxes, valgrind, qemu-user), every update is an atomic read-modify-write on the CPU's
//!   own slot: exact and free of contention, but slower than one atomic used directly.
//! - **Code that must not use rseq.** A seccomp policy that forbids `rseq(2)` makes thiscpu
//!   fall back, as above. A process where another library manages rseq registration on its own
//!   terms, or checkpoint/restore tools that do not carry rseq state, are better served by plain
//!   atomics.
//! - **Per-task rather than per-CPU data.** State that belongs to a thread or an async task
//!   (and may be batched before it is published) is better kept there; the CPU a task runs on
//!   says nothing about which task's data it touches.
//!
//! # Features
//! All are off by default; without them thiscpu depends on `libc` alone. Items that need one
//! are marked with it in the documentation.
//! - `metrics`: the `metrics` module, a per-CPU backend for the `metrics` 0.24 facade; and
//!   `AllocStats::record`, which publishes the allocator's statistics through the facade to
//!   any recorder.
//! - `metrics-layer` (implies `metrics`): `metrics::PerCpuLayer`, per-CPU counters in front of
//!   another recorder, as a `metrics-util` 0.20 `Layer`.
//! - `prometheus-client`: the `prometheus` module, a per-CPU counter and histogram for a
//!   `prometheus-client` 0.26 registry; and `allocator::AllocCollector`, a collector that
//!   encodes the allocator's statistics at every scrape.
//! - `serde`: `Serialize` and `Deserialize` on the plain data types ([`CpuNode`], [`Source`]
//!   and the enums in it, written as snake_case ids such as `"rseq_glibc"`,
//!   [`dense::DenseStats`], [`histogram::HistogramSnapshot`], whose infinite bounds are written
//!   `"+Inf"`), and `Serialize` on the `metrics` backend's snapshot and on the allocator's
//!   statistics ([`allocator::AllocStats`]).
//!
//! The integrations re-export the crates they plug into (`metrics::metrics`,
//! `metrics::metrics_util`, `prometheus::prometheus_client`): using those paths keeps a
//! program on the releases thiscpu implements.

#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(unsafe_code)]
// clippy 1.96 asks for `const` initialisers on Windows although every `thread_local!` here has
// one: std's macro expands differently there (keyed TLS), and the lint misreads it.
#![cfg_attr(windows, allow(clippy::missing_const_for_thread_local))]

#[doc(hidden)]
pub mod abi;
#[allow(unsafe_code)]
pub mod allocator;
#[allow(unsafe_code)]
mod arch;
#[allow(unsafe_code)]
mod counter;
mod cpu;
#[allow(unsafe_code)]
// The model checker stands in for the decision (`arch::model`).
#[cfg_attr(thiscpu_model, allow(dead_code))]
mod decided_once;
#[allow(unsafe_code)]
pub mod dense;
#[allow(unsafe_code)]
mod epoch;
#[allow(unsafe_code)]
pub mod fence;
#[allow(unsafe_code)]
pub mod histogram;
#[allow(unsafe_code)]
pub mod mask;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
#[allow(unsafe_code)]
pub mod ops;
#[allow(unsafe_code)]
mod os;
mod park;
mod percpu;
#[allow(unsafe_code)]
pub mod pool;
#[cfg(feature = "prometheus-client")]
#[cfg_attr(docsrs, doc(cfg(feature = "prometheus-client")))]
pub mod prometheus;
#[allow(unsafe_code)]
mod reader_counts;
#[allow(unsafe_code)]
// The model checker stands in for the decision (`arch::model`).
#[cfg_attr(thiscpu_model, allow(dead_code))]
mod registration;
#[allow(unsafe_code)]
mod rwlock;
#[allow(unsafe_code)]
mod sharded;
#[allow(unsafe_code)]
mod sync;
pub mod topology;
pub mod via;
// Compile-fail checks that no type written through `&self` lets a borrow shorten its `T`.
#[cfg(doctest)]
mod variance_checks;
// The model machine of `--cfg thiscpu_model` builds (tests/model.rs).
#[cfg(thiscpu_model)]
#[doc(hidden)]
pub use arch::model;

pub use allocator::PerCpuAlloc;
pub use counter::{Adder, Counter};
pub use cpu::{Source, current_cpu, current_node, getcpu, mm_cid, source};
pub use epoch::{AsRawPtr, EpochCell, EpochCellAny, EpochCellOption, EpochGuard, EpochPointer};
pub use histogram::Histogram;
pub use mask::CpuMask;
pub use ops::{ByCpu, ByMmCid, Spread};
pub use percpu::{CachePadded, PerCpu};
pub use pool::{Pool, Pooled};
pub use registration::{Registrar, RseqMode, Unavailable};
pub use rwlock::{
    MappedRwLockReadGuard, MappedRwLockWriteGuard, RwLock, RwLockReadGuard,
    RwLockUpgradableReadGuard, RwLockWriteGuard,
};
pub use sharded::{ShardGuard, Sharded};
pub use via::{CpuNode, CpuSource};

// With `--cfg thiscpu_global_alloc` (the CI's global-alloc step), every program that links the
// library allocates through per-CPU caches: its own test suite, harness and std included.
#[cfg(thiscpu_global_alloc)]
#[global_allocator]
static GLOBAL_ALLOCATOR: PerCpuAlloc = PerCpuAlloc::new();

// The Rust snippets of the README, the guide and the allocator's page, compiled and run as doctests when every
// feature they use is on (CI's features step), so that the documentation cannot drift from
// the API. docs/opentelemetry.md is thiscpu-opentelemetry's, compiled by that crate; the
// repository's tests (cli/tests/docs.rs) check that every Markdown file holding Rust snippets
// is included by one of the two crates.
#[cfg(all(
    doctest,
    feature = "metrics-layer",
    feature = "prometheus-client",
    feature = "serde"
))]
#[doc = include_str!("../../README.md")]
#[doc = include_str!("../../docs/guide.md")]
#[doc = include_str!("../../docs/allocator.md")]
struct MarkdownSnippets;

#[cfg(test)]
mod crate_docs {
    /// The crate's `[features]` table, as `(name, enables)` lines, from its manifest.
    fn features() -> Vec<&'static str> {
        let manifest = include_str!("../Cargo.toml");
        let table = &manifest[manifest.find("\n[features]\n").expect("a [features] table")..];
        let table = &table["\n[features]\n".len()..];
        let table = &table[..table.find("\n[").unwrap_or(table.len())];
        table
            .lines()
            .filter_map(|line| line.split_once(" = "))
            .map(|(name, _)| name.trim())
            .filter(|&name| name != "default")
            .collect()
    }

    #[test]
    fn the_features_section_lists_every_feature() {
        let docs = include_str!("lib.rs");
        let section = &docs[docs.find("//! # Features\n").expect("a Features section")..];
        let section = &section[..section.find("\n\n").expect("the section ends")];
        let features = features();
        assert!(features.len() >= 4, "{features:?}");
        for feature in features {
            assert!(
                section.contains(&format!("//! - `{feature}`")),
                "feature `{feature}` is not listed in the crate docs' Features section"
            );
        }
    }
}
