//! The synchronisation primitives that the concurrent protocols are written with, named through
//! this module so that a model check can compile the same source file against loom's instead
//! (tests/model_*.rs include such a file with `#[path]` beside a `sync` module of their own):
//! the model explores the interleavings of the real code rather than of a copy.
//!
//! The cell follows loom's interface (`with`, `with_mut`), which lets loom see every access
//! to a value that a protocol hands between threads.

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
