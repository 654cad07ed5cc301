//! The size classes of [`super::PerCpuAlloc`]'s caches, and the table that finds a size's class
//! in one load.
//!
//! The classes are the sizes glibc's `malloc` gives anyway: it rounds a request of `n` bytes
//! up to a chunk of `max(32, (n + 8 + 15) & !15)` bytes, of which all but 8 are usable, so the
//! usable sizes are 24, 40, 56, ... (16 k + 8). A class of exactly such a size costs glibc
//! nothing on a miss or a spill: it does what the request alone would have made it do. Rounding
//! to coarser classes did not: serde_json parsing a 1 MiB document took 8.1 to 9.5 ms a parse
//! (median of 30) with requests rounded up to multiples of 16 or to four classes per doubling,
//! against 5.2 ms with the requests as they were and 5.8 ms rounded to glibc's usable sizes,
//! because glibc's chunks grow by 16 bytes for every request that reached a multiple of 16.
//!
//! So: every usable size from 24 to 1,032 bytes (64 classes, the range of glibc's per-thread
//! cache), then four per doubling up to 4,104 (the usable size of a 4 KiB request), which round
//! up by less than a quarter. Below them, one class of 16 bytes for the requests of at most
//! 16, which the own heap packs at a stride of 16 where glibc's smallest chunk is 32 (from
//! glibc it is a 24-byte chunk like any other): a million short `String`s take half the
//! memory. 73 classes.

use core::alloc::Layout;

/// The largest size served from the per-CPU caches (the usable size glibc gives a 4,096-byte
/// request); larger requests go to the inner allocator.
pub const MAX_CACHED_SIZE: usize = 4104;

/// The largest alignment served from the caches. Every cached object is aligned to this,
/// whatever alignment its user asked for: the heap's strides are multiples of it, and the inner
/// allocator is asked for it.
pub(crate) const CACHED_ALIGN: usize = 16;

/// Number of size classes.
pub(crate) const CLASSES: usize = 73;

/// The smallest class: requests of at most 16 bytes.
const SMALLEST: usize = 16;

/// The largest class of 16-byte steps: the usable size of glibc's largest per-thread cached
/// chunk (1,040 bytes).
const LAST_STEP: usize = 1032;

/// Every class's object size, smallest first.
pub(crate) const CLASS_SIZES: [usize; CLASSES] = {
    let mut sizes = [0usize; CLASSES];
    sizes[0] = SMALLEST;
    let mut class = 1;
    while 16 * class + 8 <= LAST_STEP {
        sizes[class] = 16 * class + 8;
        class += 1;
    }
    let large = [1288, 1544, 1800, 2056, 2568, 3080, 3592, 4104];
    let mut i = 0;
    while class < CLASSES {
        sizes[class] = large[i];
        class += 1;
        i += 1;
    }
    sizes
};

/// The class of each size, indexed by `(size + 7) / 8`: sizes from `8 i - 7` to `8 i` share
/// entry `i`, and every class boundary is a multiple of 8. Entry 0 (requests of no bytes) is
/// the smallest class. The table ends at `MAX_CACHED_SIZE`: an index past it is a size no class
/// holds.
const CLASS_OF: [u8; MAX_CACHED_SIZE.div_ceil(8) + 1] = {
    let mut table = [0u8; MAX_CACHED_SIZE.div_ceil(8) + 1];
    let mut index = 0;
    let mut class = 0;
    while index < table.len() {
        // The largest size of this entry.
        while CLASS_SIZES[class] < 8 * index {
            class += 1;
        }
        table[index] = class as u8;
        index += 1;
    }
    table
};

/// Every size class's object size, smallest first: what a cached allocation of a given size
/// really occupies (the smallest class at least as large).
///
/// ```
/// let classes = thiscpu::allocator::size_classes();
/// assert_eq!(classes.last(), Some(&thiscpu::allocator::MAX_CACHED_SIZE));
/// assert!(classes.windows(2).all(|pair| pair[0] < pair[1]));
/// ```
pub fn size_classes() -> &'static [usize] {
    &CLASS_SIZES
}

/// The class that serves `layout`, or `None` if the caches do not serve it (too large, or
/// aligned beyond [`CACHED_ALIGN`]).
#[inline(always)]
pub(crate) fn class_of(layout: Layout) -> Option<usize> {
    if layout.align() > CACHED_ALIGN {
        return None;
    }
    // The table's bounds are the size limit: one comparison for both. A layout's size is at
    // most `isize::MAX`, so adding 7 cannot wrap.
    CLASS_OF
        .get((layout.size() + 7) >> 3)
        .map(|&class| class as usize)
}

/// The layout every object of `class` is allocated with from the inner allocator.
#[inline(always)]
pub(crate) fn class_layout(class: usize) -> Layout {
    // SAFETY: every class size is a non-zero multiple of the alignment, a power of two, and
    // far below `isize::MAX`.
    unsafe { Layout::from_size_align_unchecked(CLASS_SIZES[class], CACHED_ALIGN) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_size_goes_to_the_smallest_class_that_holds_it() {
        for size in 1..=MAX_CACHED_SIZE {
            for align in [1, 2, 4, 8, 16] {
                let layout = Layout::from_size_align(size, align).unwrap();
                let class = class_of(layout).unwrap();
                assert!(
                    CLASS_SIZES[class] >= size,
                    "{size} in {}",
                    CLASS_SIZES[class]
                );
                assert!(
                    class == 0 || CLASS_SIZES[class - 1] < size,
                    "{size} could have gone to {}",
                    CLASS_SIZES[class - 1]
                );
            }
        }
    }

    #[test]
    fn large_or_overaligned_layouts_are_not_cached() {
        assert_eq!(
            class_of(Layout::from_size_align(MAX_CACHED_SIZE + 1, 8).unwrap()),
            None
        );
        assert_eq!(class_of(Layout::from_size_align(64, 32).unwrap()), None);
        assert_eq!(class_of(Layout::from_size_align(4096, 4096).unwrap()), None);
    }

    #[test]
    fn small_sizes_get_what_glibc_would_give_them() {
        for size in 1..=SMALLEST {
            let class = CLASS_SIZES[class_of(Layout::from_size_align(size, 1).unwrap()).unwrap()];
            assert_eq!(class, SMALLEST, "{size}");
        }
        for size in SMALLEST + 1..=LAST_STEP {
            let glibc_usable = ((size + 8 + 15) & !15).max(32) - 8;
            let class = CLASS_SIZES[class_of(Layout::from_size_align(size, 1).unwrap()).unwrap()];
            assert_eq!(class, glibc_usable, "{size}");
        }
    }

    #[test]
    fn larger_sizes_are_rounded_up_by_at_most_a_quarter_to_a_usable_size() {
        for size in LAST_STEP + 1..=MAX_CACHED_SIZE {
            let class = CLASS_SIZES[class_of(Layout::from_size_align(size, 1).unwrap()).unwrap()];
            assert!(class - size <= size / 4, "{size} rounded to {class}");
            assert_eq!(class % 16, 8, "{class} is not a size glibc gives");
        }
    }

    #[test]
    fn class_layouts_satisfy_every_layout_of_their_class() {
        for (class, &size) in CLASS_SIZES.iter().enumerate() {
            let layout = class_layout(class);
            assert_eq!(layout.size(), size);
            assert_eq!(layout.align(), CACHED_ALIGN);
        }
    }
}
