//! The auto traits of every public type, stated both ways: which are `Send`, `Sync`, `Unpin`
//! and unwind-safe, and which must not be. Several types implement `Send` and `Sync` by hand
//! (`unsafe impl`) and the rest inherit them from private fields that may change, so a bound
//! loosened by mistake, or a field that stops carrying `T`'s, would let safe code share or
//! send what must stay on one thread: this file then stops compiling.
//!
//! Each positive statement is a call of a function bounded by the trait. Each negative one
//! (`assert_not!`) is the ambiguity the `static_assertions` crate uses: a trait with one
//! blanket implementation for every type and a second for the types with the trait; naming
//! the implementation for the type then fails with E0283 (type annotations needed) exactly
//! when the type has the trait. It is an ordinary compile error of this file, so nothing else
//! can make it pass, unlike a `compile_fail` doctest.
//!
//! The variance checks (a borrow of a type written through `&self` that must not be
//! shortened) are `compile_fail` doctests in `src/variance_checks.rs`.

use std::cell::Cell;
use std::panic::{RefUnwindSafe, UnwindSafe};
use std::rc::Rc;
use std::sync::MutexGuard;
use thiscpu::{
    Adder, ByCpu, ByMmCid, CachePadded, Counter, CpuMask, CpuNode, CpuSource, EpochCell,
    EpochCellOption, EpochGuard, Histogram, MappedRwLockReadGuard, MappedRwLockWriteGuard, PerCpu,
    Pool, Pooled, Registrar, RseqMode, RwLock, RwLockReadGuard, RwLockUpgradableReadGuard,
    RwLockWriteGuard, ShardGuard, Sharded, Source, Unavailable,
};

fn send<T: ?Sized + Send>() {}
fn sync<T: ?Sized + Sync>() {}
fn unpin<T: ?Sized + Unpin>() {}
/// Usable across `catch_unwind` without `AssertUnwindSafe`, owned and shared.
fn unwind_safe<T: ?Sized + UnwindSafe + RefUnwindSafe>() {}
/// Usable across `catch_unwind` when owned (moved in), not necessarily when shared.
fn owned_unwind_safe<T: ?Sized + UnwindSafe>() {}

/// `Send`, `Sync` and `Unpin`: what a value that threads share or move needs.
macro_rules! send_sync_unpin {
    ($($ty:ty),+ $(,)?) => {
        $(
            send::<$ty>();
            sync::<$ty>();
            unpin::<$ty>();
        )+
    };
}

/// Fails to compile (E0283) if `$ty` implements `$tr`.
macro_rules! assert_not {
    ($ty:ty: $tr:path) => {
        const _: fn() = || {
            trait AmbiguousIfImplemented<A> {
                fn check() {}
            }
            impl<T: ?Sized> AmbiguousIfImplemented<()> for T {}
            struct Implemented;
            impl<T: ?Sized + $tr> AmbiguousIfImplemented<Implemented> for T {}
            <$ty as AmbiguousIfImplemented<_>>::check();
        };
    };
}

/// Not `Send` (so not `Send` by any other route either): a `T` that must stay on its thread.
type NotSend = Rc<u8>;
/// `Send` but not `Sync`: may move to another thread, never be shared with one.
type NotSync = Cell<u8>;
/// `Sync` but not `Send`.
type SyncOnly = MutexGuard<'static, u8>;

#[test]
fn counters_and_plain_data_are_send_sync_and_unwind_safe() {
    send_sync_unpin!(
        Counter,
        Counter<ByMmCid>,
        Adder<'static>,
        Adder<'static, ByMmCid>,
        ByCpu,
        ByMmCid,
        CpuMask,
        thiscpu::mask::Iter<'static>,
        Histogram,
        thiscpu::histogram::Bucket,
        thiscpu::histogram::HistogramSnapshot,
        thiscpu::histogram::InvalidBuckets,
        thiscpu::fence::TakenOver<'static>,
        thiscpu::fence::FenceUnavailable,
        thiscpu::fence::VisitRefused,
        thiscpu::dense::DenseStats,
        thiscpu::topology::CpuListError,
        thiscpu::pool::Drained,
        thiscpu::pool::DrainError,
        thiscpu::pool::DrainAllError,
        thiscpu::pool::DrainMethod,
        thiscpu::abi::Rseq,
        thiscpu::abi::RseqCs,
        Registrar,
        RseqMode,
        Unavailable,
        Source,
        CpuNode,
        CpuSource,
    );
    // Every update of these is one atomic or restartable store: a panic cannot leave one
    // half made, so they may be shared into `catch_unwind` as they are.
    unwind_safe::<Counter>();
    unwind_safe::<Adder<'static>>();
    unwind_safe::<CpuMask>();
    unwind_safe::<Histogram>();
    // Errors, boxed as `Box<dyn Error + Send + Sync>` by their callers.
    unwind_safe::<thiscpu::pool::DrainError>();
    unwind_safe::<thiscpu::pool::DrainAllError>();
    unwind_safe::<thiscpu::histogram::InvalidBuckets>();
    unwind_safe::<thiscpu::fence::FenceUnavailable>();
}

#[test]
fn per_cpu_slots_are_what_their_values_are() {
    send_sync_unpin!(PerCpu<u64>, CachePadded<u64>, PerCpu<String>);
    // Every thread reaches its CPU's slot through `&PerCpu`: sharing it shares `&T`.
    send::<PerCpu<NotSync>>();
    send::<CachePadded<NotSync>>();
}
assert_not!(PerCpu<NotSync>: Sync);
assert_not!(PerCpu<NotSend>: Send);
assert_not!(CachePadded<NotSync>: Sync);

#[test]
fn pools_need_only_send_objects() {
    send_sync_unpin!(Pool<String>, Pooled<'static, String>);
    // An object moves whole from the thread that puts it to the one that gets it, and only
    // the holder of a `Pooled` reaches it, as with `Mutex<T>`.
    send::<Pool<NotSync>>();
    sync::<Pool<NotSync>>();
    send::<Pooled<'static, NotSync>>();
}
assert_not!(Pool<NotSend>: Send);
assert_not!(Pool<NotSend>: Sync);
assert_not!(Pooled<'static, NotSend>: Send);
// Sharing a `Pooled` shares `&T`.
assert_not!(Pooled<'static, NotSync>: Sync);

#[test]
fn sharded_values_are_reached_by_one_holder_at_a_time() {
    send_sync_unpin!(Sharded<String>, Sharded<String, ByMmCid>);
    // A shard's value is reached only by the thread holding it, as with `Mutex<T>`.
    send::<Sharded<NotSync>>();
    sync::<Sharded<NotSync>>();
    // The guard may be shared where `T` may (it hands out `&T`), never sent: the shard's word
    // names the thread that holds it, and a release from another thread would not match.
    sync::<ShardGuard<'static, String>>();
    unpin::<ShardGuard<'static, String>>();
    owned_unwind_safe::<Sharded<u64>>();
}
assert_not!(Sharded<NotSend>: Send);
assert_not!(Sharded<NotSend>: Sync);
assert_not!(ShardGuard<'static, String>: Send);
assert_not!(ShardGuard<'static, NotSync>: Sync);
// No poisoning: a panic inside `with_current` leaves its partial update to the next holder,
// so a `catch_unwind` around code that shares the `Sharded` must say `AssertUnwindSafe`.
assert_not!(Sharded<u64>: RefUnwindSafe);

#[test]
fn rwlocks_are_sync_for_send_and_sync_values() {
    send_sync_unpin!(
        RwLock<String>,
        RwLockReadGuard<'static, String>,
        RwLockWriteGuard<'static, String>,
        RwLockUpgradableReadGuard<'static, String>,
        MappedRwLockReadGuard<'static, String>,
        MappedRwLockWriteGuard<'static, String>,
    );
    // A lock may move with its value.
    send::<RwLock<NotSync>>();
    owned_unwind_safe::<RwLock<u64>>();
    // A mapped guard no longer names the lock's type: its bounds are its part's. A mapped read
    // guard hands out only `&U`, wherever it is sent; a mapped write guard shared hands out
    // only `&U` too.
    send::<MappedRwLockReadGuard<'static, SyncOnly>>();
    sync::<MappedRwLockWriteGuard<'static, SyncOnly>>();
}
// Readers on several threads share `&T`, and a writer gets `&mut T` on any thread.
assert_not!(RwLock<NotSync>: Sync);
assert_not!(RwLock<NotSend>: Send);
assert_not!(RwLock<SyncOnly>: Sync);
// Guards may be dropped on another thread than the one that locked, and hand out `&T` (and the
// write guard `&mut T`) there.
assert_not!(RwLockReadGuard<'static, NotSync>: Send);
assert_not!(RwLockReadGuard<'static, NotSync>: Sync);
assert_not!(RwLockWriteGuard<'static, NotSync>: Send);
assert_not!(RwLockWriteGuard<'static, NotSync>: Sync);
assert_not!(RwLockWriteGuard<'static, SyncOnly>: Send);
// An upgradable guard hands out `&T`, and `&mut T` once upgraded, on any thread.
assert_not!(RwLockUpgradableReadGuard<'static, NotSync>: Send);
assert_not!(RwLockUpgradableReadGuard<'static, NotSync>: Sync);
assert_not!(RwLockUpgradableReadGuard<'static, SyncOnly>: Send);
// A mapped read guard hands out `&U` on the thread it is sent to or shared with; a mapped
// write guard hands out `&mut U` where it is sent and `&U` where it is shared.
assert_not!(MappedRwLockReadGuard<'static, NotSync>: Send);
assert_not!(MappedRwLockReadGuard<'static, NotSync>: Sync);
assert_not!(MappedRwLockWriteGuard<'static, NotSend>: Send);
assert_not!(MappedRwLockWriteGuard<'static, SyncOnly>: Send);
assert_not!(MappedRwLockWriteGuard<'static, NotSync>: Sync);
// No poisoning: a writer that panics leaves its partial update to the next readers.
assert_not!(RwLock<u64>: RefUnwindSafe);

#[test]
fn epoch_cells_need_send_and_sync_values() {
    send_sync_unpin!(
        EpochCell<String>,
        EpochCellOption<String>,
        EpochGuard<'static, String>
    );
    // A store replaces the whole value: a panic cannot leave one half written.
    unwind_safe::<EpochCell<String>>();
    unwind_safe::<EpochCellOption<String>>();
}
// Readers on every thread share `&T`, and the value is dropped by whichever writer replaces
// it last, on any thread.
assert_not!(EpochCell<NotSend>: Send);
assert_not!(EpochCell<NotSend>: Sync);
assert_not!(EpochCell<NotSync>: Send);
assert_not!(EpochCell<NotSync>: Sync);
assert_not!(EpochCell<SyncOnly>: Send);
assert_not!(EpochCell<SyncOnly>: Sync);
assert_not!(EpochCellOption<NotSync>: Send);
assert_not!(EpochCellOption<NotSync>: Sync);
assert_not!(EpochCellOption<SyncOnly>: Send);
assert_not!(EpochGuard<'static, NotSync>: Send);
assert_not!(EpochGuard<'static, NotSync>: Sync);

#[test]
fn thread_bound_handles_stay_on_their_thread() {
    unpin::<thiscpu::ops::Position>();
    unpin::<thiscpu::topology::PinGuard>();
}
// A position names the calling thread's own rseq area.
assert_not!(thiscpu::ops::Position: Send);
assert_not!(thiscpu::ops::Position: Sync);
assert_not!(thiscpu::ops::Position<ByMmCid>: Send);
// Dropping the guard restores the affinity of the thread it runs on.
assert_not!(thiscpu::topology::PinGuard: Send);

#[cfg(feature = "metrics")]
#[test]
fn metrics_types_are_send_and_sync() {
    use thiscpu::metrics::{Description, MetricKind, PerCpuCounter, PerCpuRecorder, Snapshot};
    // A recorder is installed for every thread (`metrics::set_global_recorder` asks for both).
    send_sync_unpin!(
        PerCpuCounter,
        PerCpuRecorder,
        MetricKind,
        Description,
        Snapshot
    );
}

#[cfg(feature = "metrics-layer")]
#[test]
fn metrics_layer_types_are_send_and_sync() {
    use thiscpu::metrics::{PerCpuLayer, PerCpuLayered, PerCpuRecorder, Publisher};
    send_sync_unpin!(
        PerCpuLayer,
        PerCpuLayered<PerCpuRecorder>,
        Publisher<PerCpuRecorder>,
    );
}

#[cfg(feature = "prometheus-client")]
#[test]
fn prometheus_types_are_send_and_sync() {
    // A registry holds metrics that every thread updates and the scraping thread encodes.
    send_sync_unpin!(thiscpu::prometheus::Counter, thiscpu::prometheus::Histogram);
}

/// A global allocator is a `static` every thread calls: `PerCpuAlloc` is `Sync` when its inner
/// allocator is, and not otherwise (its caches hold the inner allocator's objects).
#[test]
fn the_allocator_is_shared_as_its_inner_allocator_is() {
    use thiscpu::allocator::{AllocStats, CpuAllocStats, PerCpuAlloc, ReleaseError};
    send_sync_unpin!(PerCpuAlloc, AllocStats, CpuAllocStats, ReleaseError);
    unwind_safe::<PerCpuAlloc>();
    unwind_safe::<AllocStats>();
    unwind_safe::<ReleaseError>();
}

/// An inner allocator that one thread alone may use.
#[allow(dead_code)]
struct OneThreadAllocator(Cell<usize>);

// SAFETY: never called; the type exists for the auto-trait check below.
unsafe impl std::alloc::GlobalAlloc for OneThreadAllocator {
    unsafe fn alloc(&self, _: std::alloc::Layout) -> *mut u8 {
        core::ptr::null_mut()
    }
    unsafe fn dealloc(&self, _: *mut u8, _: std::alloc::Layout) {}
}

assert_not!(thiscpu::PerCpuAlloc<OneThreadAllocator>: Sync);
