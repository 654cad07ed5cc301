//! The guards that an `RwLock` hands out, and the mapped guards of a part of its data: each
//! holds the lock in one way until it is dropped, and releases it through the protocol of
//! `Raw` (the mapped ones keep only that, as they no longer name the lock's `T`).

use super::RwLock;
use super::raw::{Raw, UPGRADABLE};
use core::marker::PhantomData;
use core::ptr::NonNull;
use std::time::{Duration, Instant};

/// A read lock on an [`RwLock`]: shared access to the data until dropped. It may be dropped on
/// another CPU or thread than the one that locked.
#[must_use = "the lock is released when the guard is dropped"]
pub struct RwLockReadGuard<'a, T: ?Sized> {
    pub(super) lock: &'a RwLock<T>,
}

impl<'a, T: ?Sized> RwLockReadGuard<'a, T> {
    /// A guard of a part of the data (a field, an element), which keeps the whole lock read
    /// locked until dropped. An associated function, as `parking_lot`'s: `guard.map(..)` would
    /// be a method of `T`.
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockReadGuard};
    /// let lock = RwLock::new((String::from("name"), 7));
    /// let name = RwLockReadGuard::map(lock.read(), |pair| pair.0.as_str());
    /// assert_eq!(&*name, "name");
    /// assert!(lock.try_write().is_none(), "still read locked");
    /// drop(name);
    /// assert!(lock.try_write().is_some());
    /// ```
    pub fn map<U: ?Sized, F>(guard: Self, f: F) -> MappedRwLockReadGuard<'a, U>
    where
        F: FnOnce(&T) -> &U,
    {
        // A panic in `f` drops `guard`, which releases the lock.
        let data = NonNull::from(f(&*guard));
        let raw = &guard.lock.raw;
        core::mem::forget(guard);
        MappedRwLockReadGuard {
            raw,
            data,
            _borrow: PhantomData,
        }
    }

    /// As [`map`](Self::map) where `f` may find no part: the original guard comes back then.
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockReadGuard};
    /// let lock = RwLock::new(vec![1, 2]);
    /// let guard = RwLockReadGuard::try_map(lock.read(), |v| v.get(5)).unwrap_err();
    /// let second = RwLockReadGuard::try_map(guard, |v| v.get(1)).unwrap();
    /// assert_eq!(*second, 2);
    /// ```
    pub fn try_map<U: ?Sized, F>(guard: Self, f: F) -> Result<MappedRwLockReadGuard<'a, U>, Self>
    where
        F: FnOnce(&T) -> Option<&U>,
    {
        let Some(data) = f(&*guard).map(NonNull::from) else {
            return Err(guard);
        };
        let raw = &guard.lock.raw;
        core::mem::forget(guard);
        Ok(MappedRwLockReadGuard {
            raw,
            data,
            _borrow: PhantomData,
        })
    }
}

impl<T: ?Sized> core::ops::Deref for RwLockReadGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this reader is counted and saw no writer, so no writer gets the data until it
        // leaves (see `RwLock`'s documentation).
        unsafe { &*self.lock.data.get() }
    }
}

impl<T: ?Sized> Drop for RwLockReadGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.raw.leave();
    }
}

impl<T: ?Sized + core::fmt::Debug> core::fmt::Debug for RwLockReadGuard<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        (**self).fmt(f)
    }
}

/// A write lock on an [`RwLock`]: exclusive access to the data until dropped.
#[must_use = "the lock is released when the guard is dropped"]
pub struct RwLockWriteGuard<'a, T: ?Sized> {
    pub(super) lock: &'a RwLock<T>,
}

impl<'a, T: ?Sized> RwLockWriteGuard<'a, T> {
    /// Turns the write lock into a read lock, atomically: no other writer gets the lock in
    /// between, so the reader sees exactly what this writer left. Readers waiting for this
    /// writer are let in. The writer counts itself as a reader before it releases the flag:
    /// a writer that takes the flag next waits for it as for any reader.
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockWriteGuard};
    /// let lock = RwLock::new(1);
    /// let mut writing = lock.write();
    /// *writing = 2;
    /// let reading = RwLockWriteGuard::downgrade(writing);
    /// assert_eq!(*reading, 2);
    /// assert!(lock.try_read().is_some(), "other readers get in");
    /// assert!(lock.try_write().is_none(), "writers wait for the downgraded reader");
    /// drop(reading);
    /// assert!(lock.try_write().is_some());
    /// ```
    pub fn downgrade(guard: Self) -> RwLockReadGuard<'a, T> {
        let lock = guard.lock;
        core::mem::forget(guard);
        lock.raw.downgrade_to_reader();
        RwLockReadGuard { lock }
    }

    /// Turns the write lock into an upgradable read lock, atomically: no writer gets in
    /// between, readers are let in, and the guard may be upgraded again later.
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockWriteGuard};
    /// let lock = RwLock::new(1);
    /// let mut writing = lock.write();
    /// *writing = 2;
    /// let reading = RwLockWriteGuard::downgrade_to_upgradable(writing);
    /// assert_eq!(*lock.try_read().unwrap(), 2, "readers get in");
    /// assert!(lock.try_write().is_none(), "writers do not");
    /// drop(reading);
    /// assert!(lock.try_write().is_some());
    /// ```
    pub fn downgrade_to_upgradable(guard: Self) -> RwLockUpgradableReadGuard<'a, T> {
        let lock = guard.lock;
        core::mem::forget(guard);
        // The upgradable reader is not counted: its bit keeps writers out, and readers ignore
        // it. Release: readers that now load the flag clear see this writer's data.
        lock.raw.release_to(UPGRADABLE);
        RwLockUpgradableReadGuard { lock }
    }

    /// A guard of a part of the data, which keeps the whole lock write locked until dropped.
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockWriteGuard};
    /// let lock = RwLock::new((String::from("name"), 7));
    /// let mut count = RwLockWriteGuard::map(lock.write(), |pair| &mut pair.1);
    /// *count += 1;
    /// drop(count);
    /// assert_eq!(lock.read().1, 8);
    /// ```
    pub fn map<U: ?Sized, F>(guard: Self, f: F) -> MappedRwLockWriteGuard<'a, U>
    where
        F: FnOnce(&mut T) -> &mut U,
    {
        let mut guard = guard;
        // A panic in `f` drops `guard`, which releases the lock.
        let data = NonNull::from(f(&mut *guard));
        let raw = &guard.lock.raw;
        core::mem::forget(guard);
        MappedRwLockWriteGuard {
            raw,
            data,
            _borrow: PhantomData,
        }
    }

    /// As [`map`](Self::map) where `f` may find no part: the original guard comes back then.
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockWriteGuard};
    /// let lock = RwLock::new(vec![1, 2]);
    /// let guard = RwLockWriteGuard::try_map(lock.write(), |v| v.get_mut(5)).unwrap_err();
    /// *RwLockWriteGuard::try_map(guard, |v| v.get_mut(0)).unwrap() = 3;
    /// assert_eq!(*lock.read(), [3, 2]);
    /// ```
    pub fn try_map<U: ?Sized, F>(guard: Self, f: F) -> Result<MappedRwLockWriteGuard<'a, U>, Self>
    where
        F: FnOnce(&mut T) -> Option<&mut U>,
    {
        let mut guard = guard;
        let Some(data) = f(&mut *guard).map(NonNull::from) else {
            return Err(guard);
        };
        let raw = &guard.lock.raw;
        core::mem::forget(guard);
        Ok(MappedRwLockWriteGuard {
            raw,
            data,
            _borrow: PhantomData,
        })
    }
}

impl<T: ?Sized> core::ops::Deref for RwLockWriteGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the writer saw every reader gone with the flag set: the data is its alone.
        unsafe { &*self.lock.data.get() }
    }
}

impl<T: ?Sized> core::ops::DerefMut for RwLockWriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this borrow the only one.
        unsafe { &mut *self.lock.data.get() }
    }
}

impl<T: ?Sized> Drop for RwLockWriteGuard<'_, T> {
    fn drop(&mut self) {
        self.lock.raw.release_to(0);
    }
}

impl<T: ?Sized + core::fmt::Debug> core::fmt::Debug for RwLockWriteGuard<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        (**self).fmt(f)
    }
}

/// An upgradable read lock on an [`RwLock`], made by [`RwLock::upgradable_read`]: shared
/// access to the data, beside readers, with no writer and no other upgradable reader until it
/// is dropped, upgraded or downgraded. It may be dropped on another CPU or thread than the one
/// that locked.
#[must_use = "the lock is released when the guard is dropped"]
pub struct RwLockUpgradableReadGuard<'a, T: ?Sized> {
    pub(super) lock: &'a RwLock<T>,
}

impl<'a, T: ?Sized> RwLockUpgradableReadGuard<'a, T> {
    /// Turns the upgradable read lock into a write lock: stops new readers, and waits for the
    /// readers inside to leave, as [`RwLock::write`] does. No writer gets in between, so what
    /// this guard read still holds when the write guard is handed out. Deadlocks if this
    /// thread also holds a read lock of the lock.
    pub fn upgrade(guard: Self) -> RwLockWriteGuard<'a, T> {
        let lock = guard.lock;
        core::mem::forget(guard);
        lock.raw.upgrade();
        // As in `write`: a panic in the fences drops the write guard, which releases the lock.
        let writing = RwLockWriteGuard { lock };
        lock.raw.drain(None);
        writing
    }

    /// As [`upgrade`](Self::upgrade), giving up after `timeout`: the upgradable guard comes
    /// back then, and the readers the attempt stopped are let in again.
    ///
    /// ```
    /// use std::time::Duration;
    /// use thiscpu::{RwLock, RwLockUpgradableReadGuard};
    /// let lock = RwLock::new(1);
    /// let upgradable = lock.upgradable_read();
    /// let reading = lock.read();
    /// let wait = Duration::from_millis(10);
    /// let upgradable = RwLockUpgradableReadGuard::try_upgrade_for(upgradable, wait).unwrap_err();
    /// drop(reading);
    /// *RwLockUpgradableReadGuard::try_upgrade_for(upgradable, wait).unwrap() = 2;
    /// ```
    pub fn try_upgrade_for(
        guard: Self,
        timeout: Duration,
    ) -> Result<RwLockWriteGuard<'a, T>, Self> {
        match Instant::now().checked_add(timeout) {
            Some(deadline) => Self::try_upgrade_until(guard, deadline),
            None => Ok(Self::upgrade(guard)),
        }
    }

    /// As [`upgrade`](Self::upgrade), giving up at `deadline` (see
    /// [`try_upgrade_for`](Self::try_upgrade_for)).
    pub fn try_upgrade_until(
        guard: Self,
        deadline: Instant,
    ) -> Result<RwLockWriteGuard<'a, T>, Self> {
        Self::upgrade_unless(guard, |raw| raw.drain(Some(deadline)))
    }

    /// Upgrades, fences and keeps the write lock if `drained` says the readers left; flips back
    /// to the upgradable read otherwise.
    fn upgrade_unless(
        guard: Self,
        drained: impl FnOnce(&Raw) -> bool,
    ) -> Result<RwLockWriteGuard<'a, T>, Self> {
        let lock = guard.lock;
        core::mem::forget(guard);
        lock.raw.upgrade();
        // As in `try_write`: a panic in the fences drops the write guard, which releases the
        // lock.
        let writing = RwLockWriteGuard { lock };
        if drained(&lock.raw) {
            return Ok(writing);
        }
        core::mem::forget(writing);
        // Back to `UPGRADABLE`, waking the readers that saw `WRITER` and went to sleep.
        lock.raw.release_to(UPGRADABLE);
        Err(RwLockUpgradableReadGuard { lock })
    }

    /// Upgrades if no reader is inside; never sleeps, but fences (two `membarrier` calls with
    /// rseq). The upgradable guard comes back otherwise, and the readers this attempt stopped
    /// are let in again.
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockUpgradableReadGuard};
    /// let lock = RwLock::new(1);
    /// let upgradable = lock.upgradable_read();
    /// let reading = lock.read();
    /// let upgradable = RwLockUpgradableReadGuard::try_upgrade(upgradable).unwrap_err();
    /// drop(reading);
    /// *RwLockUpgradableReadGuard::try_upgrade(upgradable).unwrap() = 2;
    /// assert_eq!(*lock.read(), 2);
    /// ```
    pub fn try_upgrade(guard: Self) -> Result<RwLockWriteGuard<'a, T>, Self> {
        Self::upgrade_unless(guard, Raw::fence_and_check)
    }

    /// Turns the upgradable read lock into a read lock, letting writers and upgradable readers
    /// in (once this reader leaves, for writers).
    ///
    /// ```
    /// use thiscpu::{RwLock, RwLockUpgradableReadGuard};
    /// let lock = RwLock::new(1);
    /// let reading = RwLockUpgradableReadGuard::downgrade(lock.upgradable_read());
    /// assert!(lock.try_upgradable_read().is_some());
    /// assert!(lock.try_write().is_none(), "a writer waits for the reader");
    /// drop(reading);
    /// assert!(lock.try_write().is_some());
    /// ```
    pub fn downgrade(guard: Self) -> RwLockReadGuard<'a, T> {
        let lock = guard.lock;
        core::mem::forget(guard);
        lock.raw.downgrade_to_reader();
        RwLockReadGuard { lock }
    }
}

impl<T: ?Sized> core::ops::Deref for RwLockUpgradableReadGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this holder's bit keeps every writer out (writers and upgrades take the lock
        // only while neither bit is set), and the acquire that took it saw the last writer's
        // release; readers beside it only read.
        unsafe { &*self.lock.data.get() }
    }
}

impl<T: ?Sized> Drop for RwLockUpgradableReadGuard<'_, T> {
    fn drop(&mut self) {
        self.lock.raw.release_to(0);
    }
}

impl<T: ?Sized + core::fmt::Debug> core::fmt::Debug for RwLockUpgradableReadGuard<'_, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        (**self).fmt(f)
    }
}

/// A read lock on an [`RwLock`] that reaches a part of its data, made by
/// [`RwLockReadGuard::map`]: the whole lock stays read locked until it is dropped.
#[must_use = "the lock is released when the guard is dropped"]
pub struct MappedRwLockReadGuard<'a, U: ?Sized> {
    raw: &'a Raw,
    /// Points into the lock's data, which stays read locked while this guard lives.
    data: NonNull<U>,
    /// Shared access to a `U` for `'a`: covariant in `U`, as `&'a U` is (nothing is written
    /// through it).
    _borrow: PhantomData<&'a U>,
}

// SAFETY: the guard hands out `&U` on whichever thread holds it (needs `U: Sync`), and may
// release the lock from another thread than the one that locked (the counts are per CPU, not
// per thread).
unsafe impl<U: ?Sized + Sync> Send for MappedRwLockReadGuard<'_, U> {}
// SAFETY: a shared guard hands out `&U` to every thread that shares it.
unsafe impl<U: ?Sized + Sync> Sync for MappedRwLockReadGuard<'_, U> {}

impl<'a, U: ?Sized> MappedRwLockReadGuard<'a, U> {
    /// A guard of a part of this part.
    pub fn map<V: ?Sized, F>(guard: Self, f: F) -> MappedRwLockReadGuard<'a, V>
    where
        F: FnOnce(&U) -> &V,
    {
        let data = NonNull::from(f(&*guard));
        let raw = guard.raw;
        core::mem::forget(guard);
        MappedRwLockReadGuard {
            raw,
            data,
            _borrow: PhantomData,
        }
    }

    /// As [`map`](Self::map) where `f` may find no part: the original guard comes back then.
    pub fn try_map<V: ?Sized, F>(guard: Self, f: F) -> Result<MappedRwLockReadGuard<'a, V>, Self>
    where
        F: FnOnce(&U) -> Option<&V>,
    {
        let Some(data) = f(&*guard).map(NonNull::from) else {
            return Err(guard);
        };
        let raw = guard.raw;
        core::mem::forget(guard);
        Ok(MappedRwLockReadGuard {
            raw,
            data,
            _borrow: PhantomData,
        })
    }
}

impl<U: ?Sized> core::ops::Deref for MappedRwLockReadGuard<'_, U> {
    type Target = U;
    #[inline]
    fn deref(&self) -> &U {
        // SAFETY: `data` came from a `&U` into the lock's data under a read lock that this
        // guard still holds (it releases only when dropped), so no writer changes it.
        unsafe { self.data.as_ref() }
    }
}

impl<U: ?Sized> Drop for MappedRwLockReadGuard<'_, U> {
    #[inline]
    fn drop(&mut self) {
        self.raw.leave();
    }
}

impl<U: ?Sized + core::fmt::Debug> core::fmt::Debug for MappedRwLockReadGuard<'_, U> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        (**self).fmt(f)
    }
}

/// A write lock on an [`RwLock`] that reaches a part of its data, made by
/// [`RwLockWriteGuard::map`]: the whole lock stays write locked until it is dropped.
#[must_use = "the lock is released when the guard is dropped"]
pub struct MappedRwLockWriteGuard<'a, U: ?Sized> {
    raw: &'a Raw,
    /// Points into the lock's data, which this guard holds exclusively.
    data: NonNull<U>,
    /// Exclusive access to a `U` for `'a`: invariant in `U`, as `&'a mut U` is, since a `U`
    /// is written through it (see `variance_checks`).
    _borrow: PhantomData<&'a mut U>,
}

// SAFETY: the guard hands out `&mut U` on whichever thread holds it (needs `U: Send`), and
// may release the lock from another thread than the one that locked.
unsafe impl<U: ?Sized + Send> Send for MappedRwLockWriteGuard<'_, U> {}
// SAFETY: a shared guard hands out only `&U`, to every thread that shares it.
unsafe impl<U: ?Sized + Sync> Sync for MappedRwLockWriteGuard<'_, U> {}

impl<'a, U: ?Sized> MappedRwLockWriteGuard<'a, U> {
    /// A guard of a part of this part.
    pub fn map<V: ?Sized, F>(guard: Self, f: F) -> MappedRwLockWriteGuard<'a, V>
    where
        F: FnOnce(&mut U) -> &mut V,
    {
        let mut guard = guard;
        let data = NonNull::from(f(&mut *guard));
        let raw = guard.raw;
        core::mem::forget(guard);
        MappedRwLockWriteGuard {
            raw,
            data,
            _borrow: PhantomData,
        }
    }

    /// As [`map`](Self::map) where `f` may find no part: the original guard comes back then.
    pub fn try_map<V: ?Sized, F>(guard: Self, f: F) -> Result<MappedRwLockWriteGuard<'a, V>, Self>
    where
        F: FnOnce(&mut U) -> Option<&mut V>,
    {
        let mut guard = guard;
        let Some(data) = f(&mut *guard).map(NonNull::from) else {
            return Err(guard);
        };
        let raw = guard.raw;
        core::mem::forget(guard);
        Ok(MappedRwLockWriteGuard {
            raw,
            data,
            _borrow: PhantomData,
        })
    }
}

impl<U: ?Sized> core::ops::Deref for MappedRwLockWriteGuard<'_, U> {
    type Target = U;
    fn deref(&self) -> &U {
        // SAFETY: `data` came from a `&mut U` into the lock's data under the write lock that
        // this guard still holds, and `&self` borrows the guard, so nothing writes meanwhile.
        unsafe { self.data.as_ref() }
    }
}

impl<U: ?Sized> core::ops::DerefMut for MappedRwLockWriteGuard<'_, U> {
    fn deref_mut(&mut self) -> &mut U {
        // SAFETY: as in `deref`; `&mut self` makes this borrow the only one.
        unsafe { self.data.as_mut() }
    }
}

impl<U: ?Sized> Drop for MappedRwLockWriteGuard<'_, U> {
    fn drop(&mut self) {
        self.raw.release_to(0);
    }
}

impl<U: ?Sized + core::fmt::Debug> core::fmt::Debug for MappedRwLockWriteGuard<'_, U> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        (**self).fmt(f)
    }
}
