//! Variance and guard checks, compiled only as doctests (the guard checks are at the end).
//! Each type that writes a `T` through a shared borrow must be invariant in `T`, as `Cell<T>`
//! is. Were it covariant, safe code could
//! shorten a borrow of a `Type<&'static str>` to a `Type<&'short str>`, write a string that
//! dies at the end of the short scope, and read it afterwards as `&'static str`: a read of
//! freed memory. Each program below is that attack; it must fail with E0597 (the string does
//! not live long enough), the error a covariant type would not raise. The error code is named
//! so that a program failing for another reason (a renamed method) fails the check instead of
//! passing it. `EpochCell::store`'s check is in `EpochCell`'s own documentation.
//!
//! Where a shortened borrow is harmless no check is needed:
//! - `PerCpu<T>` and `CachePadded<T>` are covariant, as `Box<[T]>` is: they write no `T`
//!   through `&self`. A `T` that can be written through `&T` (a `Cell`, a lock) is itself
//!   invariant, and makes them so.
//! - `RwLockReadGuard` and `EpochGuard` only read (they are invariant anyway, through the
//!   borrow of their lock or cell). `MappedRwLockReadGuard<'_, U>` only reads too, and is
//!   covariant in `U`, as `&U` is.
//! - `Counter<S>`, `Adder<'_, S>` and `ops::Position<S>` hold no `T`: `S` is a sealed marker
//!   of the spread. The covariance of `Adder`, `mask::Iter` and `fence::TakenOver` in their
//!   lifetime only lets a borrow end sooner.
//! - `metrics::PerCpuLayered<R>` and `Publisher<R>` require `R: 'static`: no lifetime to
//!   shorten. thiscpu-opentelemetry's `PerCpuInstrumentBuilder<'_, I>` holds a `&Meter` and
//!   `I` as a marker of the instrument it builds.

/// `RwLock::write` through a shortened `&RwLock`.
///
/// ```compile_fail,E0597
/// use thiscpu::RwLock;
/// let lock = RwLock::new("static");
/// {
///     let s = String::from("freed before it is read");
///     let short: &RwLock<&str> = &lock;
///     *short.write() = s.as_str();
/// }
/// let dangling: &'static str = *lock.read();
/// println!("{dangling}");
/// ```
struct RwLockWrite;

/// A `RwLockWriteGuard` shortened by value.
///
/// ```compile_fail,E0597
/// use thiscpu::{RwLock, RwLockWriteGuard};
/// let lock = RwLock::new("static");
/// {
///     let s = String::from("freed before it is read");
///     let guard: RwLockWriteGuard<'_, &'static str> = lock.write();
///     let mut short: RwLockWriteGuard<'_, &str> = guard;
///     *short = s.as_str();
/// }
/// let dangling: &'static str = *lock.read();
/// println!("{dangling}");
/// ```
struct RwLockWriteGuardByValue;

/// A `MappedRwLockWriteGuard` shortened by value: it holds a pointer into the lock, not the
/// lock, so its invariance must come from the guard itself.
///
/// ```compile_fail,E0597
/// use thiscpu::{MappedRwLockWriteGuard, RwLock, RwLockWriteGuard};
/// let lock = RwLock::new(("static", 0));
/// {
///     let s = String::from("freed before it is read");
///     let guard: MappedRwLockWriteGuard<'_, &'static str> =
///         RwLockWriteGuard::map(lock.write(), |pair| &mut pair.0);
///     let mut short: MappedRwLockWriteGuard<'_, &str> = guard;
///     *short = s.as_str();
/// }
/// let dangling: &'static str = lock.read().0;
/// println!("{dangling}");
/// ```
struct MappedRwLockWriteGuardByValue;

/// `Sharded::with_current` through a shortened `&Sharded`.
///
/// ```compile_fail,E0597
/// use thiscpu::Sharded;
/// let sharded = Sharded::new(|_| "static");
/// {
///     let s = String::from("freed before it is read");
///     let short: &Sharded<&str> = &sharded;
///     short.with_current(|value| *value = s.as_str());
/// }
/// let dangling: &'static str = sharded.fold("", |_, value| *value);
/// println!("{dangling}");
/// ```
struct ShardedWithCurrent;

/// A `ShardGuard` shortened by value.
///
/// ```compile_fail,E0597
/// use thiscpu::{ShardGuard, Sharded};
/// let sharded = Sharded::new(|_| "static");
/// {
///     let s = String::from("freed before it is read");
///     let guard: ShardGuard<'_, &'static str> = sharded.lock_current();
///     let mut short: ShardGuard<'_, &str> = guard;
///     *short = s.as_str();
/// }
/// let dangling: &'static str = sharded.fold("", |_, value| *value);
/// println!("{dangling}");
/// ```
struct ShardGuardByValue;

/// `Pool::put` through a shortened `&Pool`.
///
/// ```compile_fail,E0597
/// use thiscpu::Pool;
/// let pool = Pool::new(|| "static");
/// {
///     let s = String::from("freed before it is read");
///     let short: &Pool<&str> = &pool;
///     short.put(s.as_str());
/// }
/// let dangling: &'static str = *pool.get();
/// println!("{dangling}");
/// ```
struct PoolPut;

/// A `Pooled` shortened by value, written, and put back when dropped.
///
/// ```compile_fail,E0597
/// use thiscpu::{Pool, Pooled};
/// let pool = Pool::new(|| "static");
/// {
///     let s = String::from("freed before it is read");
///     let object: Pooled<'_, &'static str> = pool.get();
///     let mut short: Pooled<'_, &str> = object;
///     *short = s.as_str();
/// }
/// let dangling: &'static str = *pool.get();
/// println!("{dangling}");
/// ```
struct PooledByValue;

/// `EpochCell::swap` through a shortened `&EpochCell`.
///
/// ```compile_fail,E0597
/// use std::sync::Arc;
/// use thiscpu::EpochCell;
/// let cell = EpochCell::new("static");
/// {
///     let s = String::from("freed before it is read");
///     let short: &EpochCell<&str> = &cell;
///     drop(short.swap(Arc::new(s.as_str())));
/// }
/// let dangling: &'static str = *cell.load();
/// println!("{dangling}");
/// ```
struct EpochCellSwap;

/// `EpochCellOption::store` through a shortened `&EpochCellOption`.
///
/// ```compile_fail,E0597
/// use std::sync::Arc;
/// use thiscpu::EpochCellOption;
/// let cell = EpochCellOption::from_pointee("static");
/// {
///     let s = String::from("freed before it is read");
///     let short: &EpochCellOption<&str> = &cell;
///     short.store(Some(Arc::new(s.as_str())));
/// }
/// let dangling: &'static str = *cell.load().unwrap();
/// println!("{dangling}");
/// ```
struct EpochCellOptionStore;

// Guard checks: a guard made from another (mapped, upgraded, downgraded) takes the other's
// place and keeps its borrow of the lock, so it can neither outlive the lock nor be held
// beside the guard it came from. Each program tries one of those and must fail with the
// error named: E0597 (the lock does not live long enough) or E0382 (the guard it came from
// was moved).

/// A mapped read guard kept after its lock is dropped.
///
/// ```compile_fail,E0597
/// use thiscpu::{MappedRwLockReadGuard, RwLock, RwLockReadGuard};
/// let kept: MappedRwLockReadGuard<'_, u32>;
/// {
///     let lock = RwLock::new((1u32, 2u32));
///     kept = RwLockReadGuard::map(lock.read(), |pair| &pair.0);
/// }
/// println!("{}", *kept);
/// ```
struct MappedReadGuardOutlivesItsLock;

/// A mapped write guard beside the write guard it was made from: two writers' views at once.
///
/// ```compile_fail,E0382
/// use thiscpu::{RwLock, RwLockWriteGuard};
/// let lock = RwLock::new((1u32, 2u32));
/// let whole = lock.write();
/// let mut first = RwLockWriteGuard::map(whole, |pair| &mut pair.0);
/// *first = 3;
/// println!("{}", whole.1);
/// ```
struct MappedWriteGuardBesideItsSource;

/// An upgradable read guard used after its upgrade: a reader's view beside the writer's.
///
/// ```compile_fail,E0382
/// use thiscpu::{RwLock, RwLockUpgradableReadGuard};
/// let lock = RwLock::new(1u32);
/// let upgradable = lock.upgradable_read();
/// let mut writer = RwLockUpgradableReadGuard::upgrade(upgradable);
/// *writer = 2;
/// println!("{}", *upgradable);
/// ```
struct UpgradableGuardUsedAfterUpgrade;

/// A write guard used after its downgrade: a writer beside the readers it let in.
///
/// ```compile_fail,E0382
/// use thiscpu::{RwLock, RwLockWriteGuard};
/// let lock = RwLock::new(1u32);
/// let writer = lock.write();
/// let reader = RwLockWriteGuard::downgrade(writer);
/// let mut again = writer;
/// *again = 2;
/// println!("{}", *reader);
/// ```
struct WriteGuardUsedAfterDowngrade;

/// An upgraded guard kept after its lock is dropped.
///
/// ```compile_fail,E0597
/// use thiscpu::{RwLock, RwLockUpgradableReadGuard, RwLockWriteGuard};
/// let kept: RwLockWriteGuard<'_, u32>;
/// {
///     let lock = RwLock::new(1u32);
///     kept = RwLockUpgradableReadGuard::upgrade(lock.upgradable_read());
/// }
/// println!("{}", *kept);
/// ```
struct UpgradedGuardOutlivesItsLock;
