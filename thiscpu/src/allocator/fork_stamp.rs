//! Lock words stamped with the fork generation they were written in (`os::fork_generation`),
//! the allocator's two locks' common shape: the holder's own mark in the low half (never 0, so
//! a held word is never the free one), the generation in the high half. A word of an older
//! generation was written in the parent of a `fork`, by a thread that does not exist in the
//! child, whatever thread holds its id there.

/// The word of a holder marked `mark` (not 0) in fork generation `generation`.
pub(super) fn stamp(mark: u32, generation: u32) -> u64 {
    (u64::from(generation) << 32) | u64::from(mark)
}

/// The holder's mark in a held word.
pub(super) fn mark(word: u64) -> u32 {
    word as u32
}

/// Whether a held word was written before a `fork` of this process.
pub(super) fn stamped_before_fork(word: u64) -> bool {
    (word >> 32) as u32 != crate::os::fork_generation()
}
