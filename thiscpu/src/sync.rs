//! The synchronisation primitives that the concurrent protocols are written with, named through
//! this module so that a model check runs the real code rather than a copy. Two ways:
//! - a test includes one source file with `#[path]` beside a `sync` module of its own that
//!   takes loom's (tests/model_decision.rs, for `decided_once`);
//! - a build with `RUSTFLAGS="--cfg thiscpu_model"` compiles the whole crate against loom's
//!   atomics, locks, thread-locals and yields from here, and `arch::model`'s sections and
//!   fences (tests/model.rs, for `Sharded`, `fence::take_over` and the pool's drain).
//!
//! The cell follows loom's interface (`with`, `with_mut`), which lets loom see every access
//! to a value that a protocol hands between threads.
//!
//! Under `--cfg thiscpu_model`:
//! - [`atomic::AtomicU32`], [`atomic::AtomicU64`] and [`atomic::AtomicUsize`] are loom's,
//!   wrapped to keep an `as_ptr`: the pointer it gives is the wrapper's own address, not an
//!   integer's, and only the model's sections read through it (`arch::model` turns it back into
//!   the atomic). Every word a section addresses must therefore be one of these; a type whose
//!   words are still `core`'s (`Counter`, `Histogram`, the dense rows) must not run under the
//!   model. The wrappers' `SeqCst` loads, stores, swaps, adds and compare-exchanges are a
//!   `SeqCst` fence followed by the access (see `seq_cst_as_fence`); their other methods are
//!   loom's. `AtomicBool`, `Ordering` and `fence` are loom's too; the other atomics stay
//!   `core`'s (the process decision's statics need their `const fn new`).
//! - [`Mutex`] is loom's: a `std` lock held by one model thread would block the whole model.
//! - [`thread_local!`] is loom's: the model runs its threads on one OS thread.
//! - [`yield_now`] lets the model run another thread; a waiting loop that spins without it
//!   never ends under the model.

#[cfg(not(thiscpu_model))]
pub(crate) use core::sync::atomic;

pub(crate) mod cell {
    /// `core::cell::UnsafeCell` with loom's access methods.
    #[derive(Debug)]
    pub(crate) struct UnsafeCell<T>(core::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        pub(crate) const fn new(value: T) -> Self {
            UnsafeCell(core::cell::UnsafeCell::new(value))
        }

        /// Calls `f` with a pointer for reading the value.
        #[inline(always)]
        pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            f(self.0.get())
        }

        /// Calls `f` with a pointer for writing the value.
        #[inline(always)]
        pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }
    }
}

#[cfg(not(thiscpu_model))]
pub(crate) use std::sync::{Mutex, MutexGuard};
#[cfg(not(thiscpu_model))]
pub(crate) use std::thread::yield_now;
#[cfg(not(thiscpu_model))]
pub(crate) use std::thread_local;

#[cfg(thiscpu_model)]
pub(crate) use loom::sync::{Mutex, MutexGuard};
#[cfg(thiscpu_model)]
pub(crate) use loom::thread::yield_now;
/// loom's `thread_local!`, which also takes an initializer written `const { ... }`.
#[cfg(thiscpu_model)]
macro_rules! model_thread_local {
    ($(#[$attr:meta])* $vis:vis static $name:ident: $t:ty = const { $init:expr };) => {
        loom::thread_local!($(#[$attr])* $vis static $name: $t = $init;);
    };
    ($(#[$attr:meta])* $vis:vis static $name:ident: $t:ty = $init:expr;) => {
        loom::thread_local!($(#[$attr])* $vis static $name: $t = $init;);
    };
}
#[cfg(thiscpu_model)]
pub(crate) use model_thread_local as thread_local;

/// Atomics: `core::sync::atomic`, or loom's under the model.
#[cfg(thiscpu_model)]
pub(crate) mod atomic {
    pub(crate) use core::sync::atomic::AtomicI32;
    pub(crate) use loom::sync::atomic::{AtomicBool, Ordering, fence};

    macro_rules! addressable {
        ($name:ident, $int:ty) => {
            /// Loom's atomic, with the address that `core`'s `as_ptr` would give: a token for
            /// `arch::model`'s sections, which read the atomic back from it.
            #[derive(Debug, Default)]
            pub struct $name(loom::sync::atomic::$name);

            impl $name {
                #[track_caller]
                pub(crate) fn new(value: $int) -> Self {
                    $name(loom::sync::atomic::$name::new(value))
                }

                /// This atomic's own address, cast: not a pointer to an integer (see the module).
                #[allow(dead_code)]
                pub(crate) fn as_ptr(&self) -> *mut $int {
                    (self as *const $name).cast_mut().cast()
                }

                /// The atomic whose `as_ptr` gave `ptr`.
                ///
                /// # Safety
                /// `ptr` came from `as_ptr` (or is its place in an array of this type), and the
                /// atomic outlives `'a`.
                #[allow(dead_code)]
                pub(crate) unsafe fn from_ptr<'a>(ptr: *mut $int) -> &'a $name {
                    // SAFETY: the caller's contract: `ptr` is the address of a live `$name`.
                    unsafe { &*ptr.cast::<$name>() }
                }

                #[allow(dead_code)]
                #[track_caller]
                pub(crate) fn load(&self, order: Ordering) -> $int {
                    self.0.load(seq_cst_as_fence(order, Ordering::Acquire))
                }

                #[allow(dead_code)]
                #[track_caller]
                pub(crate) fn store(&self, value: $int, order: Ordering) {
                    self.0
                        .store(value, seq_cst_as_fence(order, Ordering::Release))
                }

                #[allow(dead_code)]
                #[track_caller]
                pub(crate) fn swap(&self, value: $int, order: Ordering) -> $int {
                    self.0
                        .swap(value, seq_cst_as_fence(order, Ordering::AcqRel))
                }

                #[allow(dead_code)]
                #[track_caller]
                pub(crate) fn fetch_add(&self, value: $int, order: Ordering) -> $int {
                    self.0
                        .fetch_add(value, seq_cst_as_fence(order, Ordering::AcqRel))
                }

                #[allow(dead_code)]
                #[track_caller]
                pub(crate) fn compare_exchange(
                    &self,
                    current: $int,
                    new: $int,
                    success: Ordering,
                    failure: Ordering,
                ) -> Result<$int, $int> {
                    if success == Ordering::SeqCst || failure == Ordering::SeqCst {
                        fence(Ordering::SeqCst);
                    }
                    let success = if success == Ordering::SeqCst {
                        Ordering::AcqRel
                    } else {
                        success
                    };
                    let failure = if failure == Ordering::SeqCst {
                        Ordering::Acquire
                    } else {
                        failure
                    };
                    self.0.compare_exchange(current, new, success, failure)
                }
            }

            impl core::ops::Deref for $name {
                type Target = loom::sync::atomic::$name;

                fn deref(&self) -> &Self::Target {
                    &self.0
                }
            }
        };
    }

    /// A `SeqCst` access as loom can check it: a `SeqCst` fence, then the access with
    /// `strong` (acquire, release, or both) ordering. loom models `SeqCst` fences, but treats
    /// `SeqCst` accesses as acquire and release ones (besides a rule about `SeqCst` stores), so it
    /// would report executions that the language forbids, where a writer's fence misses a
    /// reader's `SeqCst` add and the reader's `SeqCst` load misses the writer's flag. The fence
    /// before each access is how compilers implement `SeqCst` on POWER, so the executions
    /// loom then explores are ones a real machine can run. It is stronger than the language
    /// in one way: the fence also orders the thread's earlier non-`SeqCst` accesses before its
    /// later ones, so a protocol that needs a fence there and has only a `SeqCst` access passes.
    /// Other orderings are unchanged.
    fn seq_cst_as_fence(order: Ordering, strong: Ordering) -> Ordering {
        if order == Ordering::SeqCst {
            fence(Ordering::SeqCst);
            strong
        } else {
            order
        }
    }

    addressable!(AtomicU32, u32);
    addressable!(AtomicU64, u64);
    addressable!(AtomicUsize, usize);
}
