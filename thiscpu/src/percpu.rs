//! `PerCpu<T>`: one cache-padded slot per possible CPU.

use crate::topology;

/// A value alone on its own 128 bytes, so that two slots never share a cache line or a pair of
/// adjacent lines.
///
/// Size and alignment: 128 bytes (or a multiple, for larger `T`) on every target. Why 128 and
/// not 64: Intel CPUs since Sandy Bridge fetch cache lines in adjacent pairs (the spatial
/// prefetcher, Intel 64 and IA-32 Optimization Reference Manual, section 2.5.5.4 in recent
/// editions), so two 64-byte-apart counters still interfere; several arm64 cores (Apple M1,
/// Marvell ThunderX2, Fujitsu A64FX) have 128-byte lines. crossbeam's `CachePadded` and the
/// Linux `____cacheline_aligned_in_smp` on those machines use the same figure.
#[repr(C, align(128))]
#[derive(Debug, Default)]
pub struct CachePadded<T>(pub T);

impl<T> core::ops::Deref for CachePadded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> core::ops::DerefMut for CachePadded<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

/// One value per possible CPU, each alone on its cache lines, indexed by CPU id (or by
/// `mm_cid`, which is always below the number of possible CPUs).
///
/// `PerCpu` only lays the data out; concurrent updates need either atomics in `T` or the
/// restartable operations of [`crate::ops`] (as [`crate::Counter`] does).
///
/// Size: `possible_cpus() * max(128, size_of::<T>() rounded up to 128)` bytes. For many small
/// per-CPU values prefer [`crate::Counter`], which packs them densely.
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// let hits = thiscpu::PerCpu::<AtomicU64>::default();
/// hits.current().fetch_add(1, Ordering::Relaxed);
/// assert_eq!(hits.iter().map(|slot| slot.load(Ordering::Relaxed)).sum::<u64>(), 1);
/// ```
pub struct PerCpu<T> {
    slots: Box<[CachePadded<T>]>,
}

impl<T> PerCpu<T> {
    /// Builds one slot per possible CPU, `init(cpu)` giving each value.
    ///
    /// ```
    /// let ids = thiscpu::PerCpu::new(|cpu| cpu);
    /// assert_eq!(ids[0], 0);
    /// ```
    pub fn new(mut init: impl FnMut(u32) -> T) -> Self {
        // CPU ids come from /sys as u32s, so every one below the count fits in a u32.
        let slots = (0..topology::possible_cpus())
            .map(|cpu| CachePadded(init(cpu as u32)))
            .collect();
        PerCpu { slots }
    }

    /// Number of slots: the number of possible CPUs.
    ///
    /// ```
    /// let slots = thiscpu::PerCpu::<u8>::default();
    /// assert_eq!(slots.len(), thiscpu::topology::possible_cpus());
    /// ```
    #[inline]
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Always false: there is at least one CPU.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The slot of CPU (or `mm_cid`) `index`, if it exists.
    ///
    /// ```
    /// let slots = thiscpu::PerCpu::<u8>::default();
    /// assert!(slots.get(slots.len() as u32).is_none());
    /// ```
    #[inline]
    pub fn get(&self, index: u32) -> Option<&T> {
        self.slots.get(index as usize).map(|slot| &slot.0)
    }

    /// The slot of the CPU this thread runs on now. The thread may migrate right after: the
    /// slot is a good guess for locality, not a guarantee of exclusivity.
    ///
    /// ```
    /// let slots = thiscpu::PerCpu::new(|cpu| cpu);
    /// let _ = slots.current();
    /// ```
    #[inline]
    pub fn current(&self) -> &T {
        let cpu = crate::cpu::current_cpu() as usize;
        // `current_cpu()` is below the number of possible CPUs by the kernel's guarantee; the
        // modulo keeps this total even on a machine whose /sys undercounts.
        &self.slots[if cpu < self.slots.len() {
            cpu
        } else {
            cpu % self.slots.len()
        }]
        .0
    }

    /// The slots in CPU order.
    ///
    /// ```
    /// let slots = thiscpu::PerCpu::new(|cpu| cpu);
    /// assert!(slots.iter().zip(0..).all(|(&value, cpu)| cpu == value));
    /// ```
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &T> + '_ {
        self.slots.iter().map(|slot| &slot.0)
    }

    /// The slots in CPU order, mutably (no other thread can touch them meanwhile).
    pub fn iter_mut(&mut self) -> impl ExactSizeIterator<Item = &mut T> + '_ {
        self.slots.iter_mut().map(|slot| &mut slot.0)
    }
}

impl<T: Default> Default for PerCpu<T> {
    fn default() -> Self {
        PerCpu::new(|_| T::default())
    }
}

impl<T> core::ops::Index<u32> for PerCpu<T> {
    type Output = T;

    /// The slot of CPU `index`; panics if `index` is not a possible CPU.
    fn index(&self, index: u32) -> &T {
        &self.slots[index as usize].0
    }
}

impl<T: core::fmt::Debug> core::fmt::Debug for PerCpu<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}
