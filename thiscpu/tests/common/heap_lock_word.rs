//! What the own heap's lock (`src/allocator/heap_lock.rs`) is written with in its model
//! checks: loom's atomics, and a futex modelled by a mutex and a condition variable: a waiter
//! checks the word and sleeps in one step under the mutex, as the kernel checks it and queues
//! the waiter in one step, and a wake takes the mutex first.

pub(crate) use loom::sync::atomic::{AtomicU32, Ordering};
use loom::sync::{Condvar, Mutex};

loom::lazy_static! {
    static ref FUTEX: (Mutex<()>, Condvar) = (Mutex::new(()), Condvar::new());
}

pub(crate) fn wait(word: &AtomicU32, expected: u32) {
    let queue = FUTEX.0.lock().unwrap();
    if word.load(Ordering::SeqCst) == expected {
        drop(FUTEX.1.wait(queue).unwrap());
    }
}

pub(crate) fn wake(_word: &AtomicU32, _count: i32) {
    let _queue = FUTEX.0.lock().unwrap();
    FUTEX.1.notify_all();
}
