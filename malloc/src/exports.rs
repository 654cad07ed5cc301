//! The C functions: the standard allocation calls and the library's own four.

use crate::glibc::{self, Glibc, MALLOC_ALIGN};
use core::alloc::{GlobalAlloc, Layout};
use core::ffi::{c_int, c_void};
use thiscpu::PerCpuAlloc;

/// The caches every exported call uses, in front of the own heap for the size classes and of
/// glibc's allocator for everything else.
static CACHES: PerCpuAlloc<Glibc> = PerCpuAlloc::with_inner(Glibc).with_own_heap(true);

/// What the library allocates for itself (its statistics, its topology) goes straight to
/// glibc, never back through its own `malloc`.
#[global_allocator]
static OWN: Glibc = Glibc;

/// The largest size served from the 16-byte steps of the size classes: every usable size
/// `16 k + 8` from 24 up to this is a class.
const LAST_STEP: usize = 1032;

/// The layout of the size class whose size is exactly `usable`, a usable size of glibc's chunks
/// (all from 24 up), if there is one.
fn class_layout_of(usable: usize) -> Option<Layout> {
    let is_class = if usable <= LAST_STEP {
        usable >= 24 && usable % 16 == 8
    } else {
        thiscpu::allocator::size_classes()
            .binary_search(&usable)
            .is_ok()
    };
    is_class.then(|| Layout::from_size_align(usable, MALLOC_ALIGN).ok())?
}

/// The layout the caches take `object` back with, if it is an object of a size class: one of
/// the own heap's (found by its address), or a chunk of glibc's of exactly a class's size (found
/// by its header); `None` for any other chunk of glibc's.
///
/// # Safety
/// `object` is a live block from this library's (or glibc's) allocation functions.
unsafe fn class_layout_at(object: *const u8) -> Option<Layout> {
    if let Some(size) = CACHES.heap_object_size(object) {
        return Layout::from_size_align(size, MALLOC_ALIGN).ok();
    }
    // SAFETY: a block the heap does not own is glibc's (the caller's contract).
    class_layout_of(unsafe { glibc::usable_size(object) })
}

/// The bytes the block at `object` holds.
///
/// # Safety
/// As for [`class_layout_at`].
unsafe fn usable_size_at(object: *const u8) -> usize {
    match CACHES.heap_object_size(object) {
        Some(size) => size,
        // SAFETY: a block the heap does not own is glibc's (the caller's contract).
        None => unsafe { glibc::usable_size(object) },
    }
}

/// Sets `errno` to `code`.
fn set_errno(code: c_int) {
    // SAFETY: glibc's `__errno_location` returns the calling thread's `errno`, always valid.
    unsafe { *libc::__errno_location() = code };
}

/// Null, with `errno` set to `ENOMEM`, as a failed allocation returns.
fn out_of_memory() -> *mut c_void {
    set_errno(libc::ENOMEM);
    core::ptr::null_mut()
}

/// `size` bytes (one for 0, as glibc gives a distinct pointer) aligned to `align`.
fn allocate(size: usize, align: usize) -> *mut c_void {
    let Ok(layout) = Layout::from_size_align(size.max(1), align.max(MALLOC_ALIGN)) else {
        return out_of_memory();
    };
    // SAFETY: a layout of at least one byte.
    or_out_of_memory(unsafe { CACHES.alloc(layout) })
}

/// `object`, or null with `errno` set to `ENOMEM` if it is null.
fn or_out_of_memory(object: *mut u8) -> *mut c_void {
    if object.is_null() {
        out_of_memory()
    } else {
        object.cast()
    }
}

/// `malloc`: `size` bytes aligned to 16.
#[unsafe(no_mangle)]
pub extern "C" fn malloc(size: usize) -> *mut c_void {
    allocate(size, MALLOC_ALIGN)
}

/// `free`: gives `object` back (nothing for null).
///
/// # Safety
/// `object` is null or a live block from this library's (or glibc's) allocation functions,
/// which the caller gives up. In the checking mode, a call that breaks this contract in the
/// ways `checking::before_free` finds ends the process with a message instead.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn free(object: *mut c_void) {
    if object.is_null() {
        return;
    }
    let object = object.cast::<u8>();
    if checking::on() {
        checking::before_free(object);
    }
    // SAFETY: a live block (the caller's contract).
    match unsafe { class_layout_at(object) } {
        // SAFETY: an object of the heap's class, or a chunk of exactly the class's size, as the
        // caches make them: the class's layout is one the caches could have allocated it with.
        Some(layout) => unsafe { CACHES.dealloc(object, layout) },
        // SAFETY: a chunk of glibc's that no class holds.
        None => unsafe { glibc::free(object) },
    }
}

/// The checking mode, on where `THISCPU_MALLOC_CHECK=1` is set: `free` and `realloc` first
/// look for the mistakes that would otherwise corrupt the caches silently, and end the
/// process with a message on standard error (`abort`, as glibc does on the ones it finds).
mod checking {
    use super::{CACHES, class_layout_of, glibc};
    use core::alloc::Layout;
    use core::sync::atomic::{AtomicU8, Ordering::Relaxed};

    /// Not read yet, off, on.
    static MODE: AtomicU8 = AtomicU8::new(UNREAD);
    const UNREAD: u8 = 0;
    const OFF: u8 = 1;
    const ON: u8 = 2;

    /// Whether the checking mode is on (the variable is read once, with `getenv`, which does
    /// not allocate).
    #[inline]
    pub(super) fn on() -> bool {
        match MODE.load(Relaxed) {
            UNREAD => {
                // SAFETY: a NUL-terminated name; `getenv` returns null or a NUL-terminated
                // string that no allocation call of this library changes.
                let value = unsafe { libc::getenv(c"THISCPU_MALLOC_CHECK".as_ptr()) };
                // SAFETY: null was excluded; a NUL-terminated string otherwise.
                let on = !value.is_null() && unsafe { core::ffi::CStr::from_ptr(value) } == c"1";
                MODE.store(if on { ON } else { OFF }, Relaxed);
                on
            }
            mode => mode == ON,
        }
    }

    /// Ends the process with `what` about `object` on standard error, allocating nothing: the
    /// heap may be corrupt.
    fn report(what: &str, object: *const u8) -> ! {
        let mut line = [0u8; 160];
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            let end = (at + bytes.len()).min(line.len());
            line[at..end].copy_from_slice(&bytes[..end - at]);
            at = end;
        };
        put(b"thiscpu_malloc: ");
        put(what.as_bytes());
        put(b" (0x");
        let address = object as usize;
        for shift in (0..usize::BITS).step_by(4).rev() {
            put(&[b"0123456789abcdef"[(address >> shift) & 0xf]]);
        }
        put(b")\n");
        // SAFETY: writes the bytes of `line` built above to standard error, then ends the
        // process.
        unsafe {
            libc::write(2, line.as_ptr().cast(), at);
            libc::abort()
        }
    }

    /// Before `object` is freed: a pointer that no allocation can have returned (not aligned
    /// to 16, or whose chunk size word is no chunk's), and an object the caches or its heap
    /// span hold already (freed twice, and not allocated again in between), end the process.
    pub(super) fn before_free(object: *const u8) {
        if !(object as usize).is_multiple_of(glibc::MALLOC_ALIGN) {
            report("free of a pointer no allocation returned", object);
        }
        if CACHES.heap_object_is_free(object) {
            report(
                "double free: the heap holds the object free already",
                object,
            );
        }
        if let Some(size) = CACHES.heap_object_size(object) {
            let layout =
                Layout::from_size_align(size, glibc::MALLOC_ALIGN).expect("a class's layout");
            if CACHES.caches_object(object, layout) {
                report("double free: the object is cached already", object);
            }
            return;
        }
        // SAFETY: the caller's pointer, aligned, which it says is a live block; the word before
        // a block this library or glibc returned is readable. A pointer into another mapping
        // (a stack, a static) has a readable word before it too, unless it is a mapping's
        // first byte, which no check short of a table of every block could tell.
        let usable = unsafe { glibc::usable_size(object) };
        if !glibc::plausible_usable_size(usable) {
            report("free of a pointer no allocation returned", object);
        }
        if let Some(layout) = class_layout_of(usable)
            && CACHES.caches_object(object, layout)
        {
            report("double free: the object is cached already", object);
        }
    }
}

/// C23's `free_sized`: `free`, which needs no size.
///
/// # Safety
/// As for [`free`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn free_sized(object: *mut c_void, _size: usize) {
    // SAFETY: the caller's contract.
    unsafe { free(object) }
}

/// C23's `free_aligned_sized`: `free`, which needs no size or alignment.
///
/// # Safety
/// As for [`free`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn free_aligned_sized(object: *mut c_void, _align: usize, _size: usize) {
    // SAFETY: the caller's contract.
    unsafe { free(object) }
}

/// `calloc`: `count × size` zeroed bytes; null with `ENOMEM` if the product overflows.
#[unsafe(no_mangle)]
pub extern "C" fn calloc(count: usize, size: usize) -> *mut c_void {
    let Some(bytes) = count.checked_mul(size) else {
        return out_of_memory();
    };
    let Ok(layout) = Layout::from_size_align(bytes.max(1), MALLOC_ALIGN) else {
        return out_of_memory();
    };
    // SAFETY: a layout of at least one byte.
    or_out_of_memory(unsafe { CACHES.alloc_zeroed(layout) })
}

/// `realloc`: `object` resized to `size`, moved if need be; `malloc(size)` for null, and, as
/// glibc does, `free(object)` and null for a size of 0. On failure `object` is left as it was.
///
/// # Safety
/// `object` is null or a live block from this library's allocation functions; the caller gives
/// it up if the result is not null (or the size is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn realloc(object: *mut c_void, size: usize) -> *mut c_void {
    if object.is_null() {
        return malloc(size);
    }
    if size == 0 {
        // SAFETY: the caller's contract.
        unsafe { free(object) };
        return core::ptr::null_mut();
    }
    if Layout::from_size_align(size, MALLOC_ALIGN).is_err() {
        return out_of_memory();
    }
    let object = object.cast::<u8>();
    if checking::on() {
        checking::before_free(object);
    }
    // SAFETY: a live block (the caller's contract).
    let moved = match unsafe { class_layout_at(object) } {
        // SAFETY: as in `free`, the chunk could have been allocated with this layout; the new
        // size, rounded up to 16, fits in `isize` (checked above).
        Some(layout) => unsafe { CACHES.realloc(object, layout, size) },
        // SAFETY: a chunk of glibc's that no class holds: glibc resizes its own.
        None => unsafe { glibc::realloc(object, size) },
    };
    or_out_of_memory(moved)
}

/// `reallocarray`: `realloc(object, count × size)`, or null with `ENOMEM` (and `object` left)
/// if the product overflows.
///
/// # Safety
/// As for [`realloc`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn reallocarray(
    object: *mut c_void,
    count: usize,
    size: usize,
) -> *mut c_void {
    match count.checked_mul(size) {
        // SAFETY: the caller's contract.
        Some(bytes) => unsafe { realloc(object, bytes) },
        None => out_of_memory(),
    }
}

/// `posix_memalign`: stores a block of `size` bytes aligned to `align` at `*out` and returns
/// 0; `EINVAL` if `align` is not a power of two multiple of a pointer's size, `ENOMEM` if no
/// memory is left (leaving `*out` as it was either way).
///
/// # Safety
/// `out` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> c_int {
    if !align.is_power_of_two() || !align.is_multiple_of(size_of::<*mut c_void>()) {
        return libc::EINVAL;
    }
    let object = allocate(size, align);
    if object.is_null() {
        return libc::ENOMEM;
    }
    // SAFETY: the caller's contract.
    unsafe { out.write(object) };
    0
}

/// `aligned_alloc`: `size` bytes aligned to `align`, a power of two (else null with `EINVAL`).
#[unsafe(no_mangle)]
pub extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    if !align.is_power_of_two() {
        set_errno(libc::EINVAL);
        return core::ptr::null_mut();
    }
    allocate(size, align)
}

/// `memalign`: `size` bytes aligned to `align`, rounded up to a power of two as glibc does.
#[unsafe(no_mangle)]
pub extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
    match align.checked_next_power_of_two() {
        Some(align) => allocate(size, align),
        None => out_of_memory(),
    }
}

/// The page size.
fn page_size() -> usize {
    // SAFETY: `sysconf` reads a value the kernel gave the process.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page).unwrap_or(4096)
}

/// `valloc`: `size` bytes aligned to a page.
#[unsafe(no_mangle)]
pub extern "C" fn valloc(size: usize) -> *mut c_void {
    allocate(size, page_size())
}

/// `pvalloc`: `size` rounded up to whole pages (one for 0), aligned to a page.
#[unsafe(no_mangle)]
pub extern "C" fn pvalloc(size: usize) -> *mut c_void {
    let page = page_size();
    match size.max(1).checked_next_multiple_of(page) {
        Some(size) => allocate(size, page),
        None => out_of_memory(),
    }
}

/// `malloc_usable_size`: the bytes the block at `object` holds, at least what was asked; 0 for
/// null.
///
/// # Safety
/// `object` is null or a live block from this library's allocation functions.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn malloc_usable_size(object: *mut c_void) -> usize {
    if object.is_null() {
        return 0;
    }
    // SAFETY: a live block (the caller's contract).
    unsafe { usable_size_at(object.cast()) }
}

/// 1 if the per-CPU caches serve this process, 0 if every call goes to glibc's allocator (no
/// rseq here: an old kernel, valgrind, a seccomp filter that refuses it).
#[unsafe(no_mangle)]
pub extern "C" fn thiscpu_malloc_caching() -> c_int {
    c_int::from(CACHES.stats().caching)
}

/// The bytes a release gave back, counting those of the CPUs it reached when it could not
/// reach one.
fn released(outcome: Result<usize, thiscpu::allocator::ReleaseError>) -> usize {
    match outcome {
        Ok(bytes)
        | Err(thiscpu::allocator::ReleaseError::Unavailable {
            released: bytes, ..
        }) => bytes,
        Err(_) => 0,
    }
}

/// Gives every CPU's cached objects back (to the own heap, or to glibc's allocator for its
/// chunks), the pages of the heap's free spans back to the system, and glibc's free pages too
/// (`malloc_trim(0)`); returns the bytes of objects given back.
#[unsafe(no_mangle)]
pub extern "C" fn thiscpu_malloc_release() -> usize {
    let bytes = released(CACHES.release());
    glibc::trim();
    bytes
}

/// Gives back the caches of CPUs that did not use them since the previous call; returns the
/// bytes given back. Call it now and then, from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn thiscpu_malloc_release_idle() -> usize {
    released(CACHES.release_idle())
}

/// Sets how many milliseconds a free span of the heap keeps its pages before the heap's next
/// change gives them back to the system (1,000 until changed); a negative value turns that off,
/// leaving it to `thiscpu_malloc_release()`. Returns the previous setting (-1 for off).
#[unsafe(no_mangle)]
pub extern "C" fn thiscpu_malloc_set_idle_return_ms(ms: i64) -> i64 {
    let previous = thiscpu::allocator::idle_return()
        .map_or(-1, |after| after.as_millis().min(i64::MAX as u128) as i64);
    thiscpu::allocator::set_idle_return(
        u64::try_from(ms)
            .ok()
            .map(core::time::Duration::from_millis),
    );
    previous
}

/// Misses and spills of every CPU's cache so far: calls that went to glibc's allocator or to
/// another CPU's objects. A program whose calls reach this library sees it grow.
#[unsafe(no_mangle)]
pub extern "C" fn thiscpu_malloc_slow_calls() -> u64 {
    let stats = CACHES.stats();
    stats.misses() + stats.spills()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errno() -> c_int {
        // SAFETY: as in `set_errno`.
        unsafe { *libc::__errno_location() }
    }

    #[test]
    fn exactly_the_class_sizes_are_cached() {
        // Every class but the smallest (16 bytes), which is no usable size of glibc's: its
        // objects come from the own heap, or from glibc as 24-byte chunks.
        let classes = thiscpu::allocator::size_classes();
        for usable in 0..=5000 {
            assert_eq!(
                class_layout_of(usable).is_some(),
                usable != 16 && classes.contains(&usable),
                "{usable}"
            );
        }
    }

    /// Every size up to past the largest class: aligned, as large as asked, the bytes kept
    /// until the free, and a zeroed object zero though the cache held a written one.
    #[test]
    fn objects_hold_what_was_asked_and_calloc_zeroes_recycled_ones() {
        for size in (0..4200).step_by(13).chain([65536, 1 << 20]) {
            let object = malloc(size).cast::<u8>();
            assert!(
                !object.is_null() && (object as usize).is_multiple_of(16),
                "{size}"
            );
            // SAFETY: a live block of at least `size` bytes.
            unsafe {
                assert!(malloc_usable_size(object.cast()) >= size, "{size}");
                object.write_bytes(0xa5, size);
                free(object.cast());
            }
            let zeroed = calloc(1, size).cast::<u8>();
            assert!(!zeroed.is_null());
            // SAFETY: a live block of at least `size` zeroed bytes.
            unsafe {
                let bytes = core::slice::from_raw_parts(zeroed, size);
                assert!(bytes.iter().all(|&byte| byte == 0), "{size}");
                free_sized(zeroed.cast(), size);
            }
        }
    }

    #[test]
    fn realloc_keeps_the_bytes_across_classes_and_glibc_s_own_sizes() {
        let mut object = malloc(10).cast::<u8>();
        let mut size = 10;
        // SAFETY: a live block of `size` bytes.
        unsafe { object.write_bytes(7, size) };
        for next in [24, 1000, 1033, 4104, 5000, 200_000, 3000, 40, 17] {
            // SAFETY: a live block from this library, given up for the moved one.
            let moved = unsafe { realloc(object.cast(), next) }.cast::<u8>();
            assert!(!moved.is_null(), "{next}");
            let kept = size.min(next);
            // SAFETY: the moved block holds at least `next` bytes, the first `kept` of them
            // from the old block.
            unsafe {
                let bytes = core::slice::from_raw_parts(moved, kept);
                assert!(bytes.iter().all(|&byte| byte == 7), "{size} to {next}");
                moved.write_bytes(7, next);
            }
            (object, size) = (moved, next);
        }
        // SAFETY: as above; a size of 0 frees the block.
        unsafe {
            assert!(realloc(object.cast(), 0).is_null());
            let fresh = realloc(core::ptr::null_mut(), 100);
            assert!(!fresh.is_null());
            free(fresh);
        }
    }

    /// The calls go through pointers the optimiser cannot see through: it knows `malloc` and
    /// `calloc` by name and drops an allocation whose only use is a test for null (called by
    /// name, `calloc(usize::MAX / 2, 4).is_null()` was false in a release build of this test).
    #[test]
    fn overflows_and_bad_alignments_fail_with_the_c_errors() {
        use std::hint::black_box;
        let calloc = black_box(calloc as extern "C" fn(usize, usize) -> *mut c_void);
        let malloc = black_box(malloc as extern "C" fn(usize) -> *mut c_void);
        let aligned_alloc = black_box(aligned_alloc as extern "C" fn(usize, usize) -> *mut c_void);
        set_errno(0);
        assert!(calloc(usize::MAX / 2, 4).is_null());
        assert_eq!(errno(), libc::ENOMEM);
        set_errno(0);
        assert!(malloc(usize::MAX - 8).is_null());
        assert_eq!(errno(), libc::ENOMEM);
        let object = malloc(10);
        set_errno(0);
        // SAFETY: a live block from this library, left live by the failure.
        unsafe {
            assert!(reallocarray(object, usize::MAX / 2, 4).is_null());
            assert_eq!(errno(), libc::ENOMEM);
            let mut out = object;
            assert_eq!(posix_memalign(&mut out, 24, 8), libc::EINVAL);
            assert_eq!(posix_memalign(&mut out, 4, 8), libc::EINVAL);
            assert_eq!(out, object, "a failed posix_memalign leaves its output");
            free(object);
        }
        set_errno(0);
        assert!(aligned_alloc(48, 8).is_null());
        assert_eq!(errno(), libc::EINVAL);
    }

    #[test]
    fn aligned_blocks_are_aligned_and_free_like_any_other() {
        let page = page_size();
        for align in [8, 16, 32, 64, 4096, 1 << 16] {
            for size in [1, 40, 1000, 4104, 10_000] {
                let mut out = core::ptr::null_mut();
                // SAFETY: `out` is a valid place for a pointer; each block is freed once.
                unsafe {
                    assert_eq!(posix_memalign(&mut out, align, size), 0);
                    let others = [aligned_alloc(align, size), memalign(align - 1, size)];
                    for (object, align) in [(out, align)]
                        .into_iter()
                        .chain(others.map(|object| (object, align)))
                    {
                        assert!(
                            !object.is_null() && (object as usize).is_multiple_of(align),
                            "{align}"
                        );
                        assert!(malloc_usable_size(object) >= size);
                        object.cast::<u8>().write_bytes(1, size);
                        free(object);
                    }
                }
            }
        }
        let (whole, rounded) = (valloc(10), pvalloc(page + 1));
        assert!((whole as usize).is_multiple_of(page) && (rounded as usize).is_multiple_of(page));
        // SAFETY: live blocks from this library, freed once.
        unsafe {
            assert!(malloc_usable_size(rounded) >= 2 * page);
            free(whole);
            free(rounded);
            free_aligned_sized(core::ptr::null_mut(), 16, 0);
        }
    }
}
