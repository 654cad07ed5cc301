//! The size classes of [`super::PerCpuAlloc`]'s caches, and the table that finds a size's class
//! in one load.
//!
//! Four classes per doubling from 128 bytes up (16-byte steps below): a request is rounded up
//! by at most 25 % (less than 16 bytes below 128), which is what tcmalloc's and jemalloc's
//! small classes waste at most too, and 28 classes keep one CPU's heads on seven cache lines.

use core::alloc::Layout;

/// The largest size served from the per-CPU caches; larger requests go to the inner allocator.
pub const MAX_CACHED_SIZE: usize = 4096;

/// The largest alignment served from the caches. Every cached object is an allocation of its
/// class size aligned to this by the inner allocator, whatever alignment its user asked for.
pub(crate) const CACHED_ALIGN: usize = 16;

/// Number of size classes.
pub(crate) const CLASSES: usize = 28;

/// Every class's object size, smallest first.
pub(crate) const CLASS_SIZES: [usize; CLASSES] = [
    16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
    1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096,
];

/// The class of each size rounded up to 16 bytes: `CLASS_OF[(size + 15) / 16]`. Entry 0 (a
/// zero-sized request, which `GlobalAlloc` callers may not make) is the smallest class.
const CLASS_OF: [u8; MAX_CACHED_SIZE / 16 + 1] = {
    let mut table = [0u8; MAX_CACHED_SIZE / 16 + 1];
    let mut sixteenths = 1;
    let mut class = 0;
    while sixteenths < table.len() {
        while CLASS_SIZES[class] < sixteenths * 16 {
            class += 1;
        }
        table[sixteenths] = class as u8;
        sixteenths += 1;
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
    // most `isize::MAX`, so adding 15 cannot wrap.
    CLASS_OF
        .get((layout.size() + 15) >> 4)
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
    fn rounding_wastes_at_most_a_quarter_above_128_bytes() {
        for size in 129..=MAX_CACHED_SIZE {
            let class = CLASS_SIZES[class_of(Layout::from_size_align(size, 1).unwrap()).unwrap()];
            assert!(class - size < size / 4 + 1, "{size} rounded to {class}");
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
