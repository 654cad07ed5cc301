//! The process's one heap of small objects: started by the first allocator that uses it, and
//! shared by every allocator after, with its locks taken around a `fork`.

use super::heap::Heap;
use core::sync::atomic::{AtomicBool, AtomicU8, Ordering};

const UNSTARTED: u8 = 0;
const STARTING: u8 = 1;
const READY: u8 = 2;
const FAILED: u8 = 3;

static HEAP: Heap = Heap::new();
static STATE: AtomicU8 = AtomicU8::new(UNSTARTED);

/// The heap, if it was started.
#[inline]
pub(super) fn started() -> Option<&'static Heap> {
    (STATE.load(Ordering::Acquire) == READY).then_some(&HEAP)
}

/// The heap, starting it on first use; `None` if the system refused its ownership map, or
/// while another thread starts it (which may allocate, and come back here).
#[cold]
pub(super) fn start() -> Option<&'static Heap> {
    if cfg!(thiscpu_model) {
        // The model checker runs the caches' protocol against the inner allocator alone.
        return None;
    }
    if let Some(heap) = started() {
        return Some(heap);
    }
    if STATE
        .compare_exchange(UNSTARTED, STARTING, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        return None;
    }
    if !HEAP.reserve_map() {
        STATE.store(FAILED, Ordering::Release);
        return None;
    }
    crate::os::at_fork(lock_for_fork, unlock_after_fork, unlock_after_fork);
    STATE.store(READY, Ordering::Release);
    Some(&HEAP)
}

/// Whether `lock_for_fork` took the locks, for the handlers after the fork: the heap may have
/// started on another thread in between, and its locks are then not the forking thread's to
/// release.
static LOCKED_FOR_FORK: AtomicBool = AtomicBool::new(false);

extern "C" fn lock_for_fork() {
    if let Some(heap) = started() {
        heap.lock_all();
        LOCKED_FOR_FORK.store(true, Ordering::Relaxed);
    }
}

extern "C" fn unlock_after_fork() {
    if LOCKED_FOR_FORK.swap(false, Ordering::Relaxed) {
        HEAP.unlock_all();
    }
}
