//! glibc's own allocator, reached past any interposition through the `__libc_*` entry points
//! it exports for allocators that replace `malloc`; and the usable size of one of its chunks,
//! which `free` needs to find a size class and C does not pass.

use core::alloc::{GlobalAlloc, Layout};
use core::ffi::c_void;

unsafe extern "C" {
    fn __libc_malloc(size: usize) -> *mut c_void;
    fn __libc_calloc(count: usize, size: usize) -> *mut c_void;
    fn __libc_realloc(object: *mut c_void, size: usize) -> *mut c_void;
    fn __libc_memalign(align: usize, size: usize) -> *mut c_void;
    fn __libc_free(object: *mut c_void);
    fn malloc_trim(pad: usize) -> core::ffi::c_int;
}

/// The alignment of every chunk glibc's `malloc` returns on 64-bit targets (two words).
pub const MALLOC_ALIGN: usize = 16;

/// glibc's allocator as a Rust allocator: the caches' inner allocator, and the library's own
/// global allocator (so that nothing the library allocates for itself comes back through its
/// own `malloc`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Glibc;

// SAFETY: every block comes from glibc's allocator, aligned as asked (`malloc` aligns to 16,
// `memalign` to any power of two), and goes back to it through `free`, which takes any of them.
unsafe impl GlobalAlloc for Glibc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: glibc's functions take any size and power-of-two alignment.
        unsafe {
            if layout.align() <= MALLOC_ALIGN {
                __libc_malloc(layout.size()).cast()
            } else {
                __libc_memalign(layout.align(), layout.size()).cast()
            }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.align() <= MALLOC_ALIGN {
            // SAFETY: glibc's `calloc` takes any count and size.
            return unsafe { __libc_calloc(1, layout.size()).cast() };
        }
        // SAFETY: the caller's non-zero layout.
        let object = unsafe { self.alloc(layout) };
        if !object.is_null() {
            // SAFETY: the block holds `layout.size()` bytes.
            unsafe { object.write_bytes(0, layout.size()) };
        }
        object
    }

    unsafe fn dealloc(&self, object: *mut u8, _layout: Layout) {
        // SAFETY: `object` came from glibc's allocator (the caller's contract).
        unsafe { __libc_free(object.cast()) }
    }

    unsafe fn realloc(&self, object: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.align() <= MALLOC_ALIGN {
            // SAFETY: `object` came from glibc's allocator; its `realloc` keeps the 16-byte
            // alignment and leaves the block as it was when it fails.
            return unsafe { __libc_realloc(object.cast(), new_size).cast() };
        }
        // SAFETY: the caller's contract, as `GlobalAlloc::realloc` states it.
        let moved =
            unsafe { self.alloc(Layout::from_size_align_unchecked(new_size, layout.align())) };
        if !moved.is_null() {
            // SAFETY: both blocks hold at least the smaller size and are distinct; the old one
            // is the caller's to give up.
            unsafe {
                core::ptr::copy_nonoverlapping(object, moved, layout.size().min(new_size));
                self.dealloc(object, layout);
            }
        }
        moved
    }
}

/// Gives `object` to glibc's `free`.
///
/// # Safety
/// `object` is a live block of glibc's allocator that the caller gives up.
pub unsafe fn free(object: *mut u8) {
    // SAFETY: the caller's contract.
    unsafe { __libc_free(object.cast()) }
}

/// glibc's `realloc` of `object`.
///
/// # Safety
/// `object` is a live block of glibc's allocator that the caller gives up if the result is
/// not null.
pub unsafe fn realloc(object: *mut u8, size: usize) -> *mut u8 {
    // SAFETY: the caller's contract.
    unsafe { __libc_realloc(object.cast(), size).cast() }
}

/// Gives the free pages of glibc's heaps back to the system (`malloc_trim(0)`: it returns the
/// top of each heap and advises the kernel to drop every whole free page inside them). glibc
/// does so on its own only for the top of a heap past its trim threshold, so a burst freed in
/// any other order stays resident.
pub fn trim() {
    // SAFETY: glibc's `malloc_trim` takes any padding and touches only its own heaps; the
    // library does not export the name, so this is glibc's.
    unsafe { malloc_trim(0) };
}

/// The bits of a chunk's size word that are flags, not size (glibc's `PREV_INUSE`,
/// `IS_MMAPPED` and `NON_MAIN_ARENA`).
const CHUNK_FLAGS: usize = 0b111;
/// glibc's `IS_MMAPPED`: the chunk is a mapping of its own.
const IS_MMAPPED: usize = 0b010;

/// The bytes usable in the block at `object`, as glibc's `malloc_usable_size` answers. A
/// chunk's size word is the word before the block, with three flags in its low bits; a chunk
/// of a heap also lends its user the first word of the next chunk, so its usable size is its
/// size less one word, and a mapped chunk's is its size less two.
///
/// # Safety
/// `object` is a live block of glibc's allocator (not null).
pub unsafe fn usable_size(object: *const u8) -> usize {
    // SAFETY: a block of glibc's allocator is preceded by its chunk's size word, 8-byte
    // aligned and readable while the block is live.
    let word = unsafe { object.cast::<usize>().sub(1).read() };
    let size = word & !CHUNK_FLAGS;
    let overhead = if word & IS_MMAPPED != 0 { 2 } else { 1 };
    size.saturating_sub(overhead * size_of::<usize>())
}

/// Whether `usable` can be a chunk's usable size as `usable_size` reads it: a heap chunk's size
/// is a multiple of 16 of at least 32 (so its usable size is 8 more than a multiple of 16), a
/// mapped chunk's a multiple of the page size (usable: 16 less).
pub fn plausible_usable_size(usable: usize) -> bool {
    (usable >= 24 && usable % 16 == 8) || (usable + 16).is_multiple_of(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// glibc's own `malloc_usable_size`: the definition after this executable's, which is
    /// the library's own.
    fn glibc_usable_size(object: *mut u8) -> usize {
        // SAFETY: a name and a pseudo-handle that `dlsym` takes.
        let found = unsafe { libc::dlsym(libc::RTLD_NEXT, c"malloc_usable_size".as_ptr()) };
        assert!(!found.is_null(), "glibc's malloc_usable_size not found");
        // SAFETY: glibc's `size_t malloc_usable_size(void *)`.
        let function: unsafe extern "C" fn(*mut c_void) -> usize =
            unsafe { core::mem::transmute(found) };
        // SAFETY: the callers pass live blocks of glibc's allocator.
        unsafe { function(object.cast()) }
    }

    #[test]
    fn usable_sizes_read_from_the_header_are_glibc_s_own() {
        for size in (0..5000).step_by(7).chain([128 << 10, 1 << 20, 5 << 20]) {
            let layout = Layout::from_size_align(size.max(1), 8).unwrap();
            // SAFETY: a non-zero layout.
            let object = unsafe { Glibc.alloc(layout) };
            assert!(!object.is_null());
            // SAFETY: a live block of glibc's allocator.
            let (ours, theirs) = (unsafe { usable_size(object) }, glibc_usable_size(object));
            assert_eq!(ours, theirs, "{size}");
            assert!(plausible_usable_size(ours), "{size}: {ours}");
            assert!(ours >= size, "{size}: {ours}");
            // SAFETY: allocated just above.
            unsafe { Glibc.dealloc(object, layout) };
        }
    }
}
