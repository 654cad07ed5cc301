//! thiscpu's per-CPU allocator ([`thiscpu::PerCpuAlloc`]) as a C library, for any C, C++ or
//! Rust program on Linux with glibc:
//!
//! ```text
//! LD_PRELOAD=target/release/libthiscpu_malloc.so python3 program.py
//! cc program.c target/release/libthiscpu_malloc.a -lpthread -ldl -lm
//! ```
//!
//! It exports `malloc`, `free`, `calloc`, `realloc`, `reallocarray`, `posix_memalign`,
//! `aligned_alloc`, `memalign`, `valloc`, `pvalloc`, `malloc_usable_size`, C23's `free_sized`
//! and `free_aligned_sized`, and four calls of its own (`include/thiscpu_malloc.h`). Objects of
//! up to 4,104 bytes come from the calling CPU's cache, which misses and spills to the
//! allocator's own heap (spans of one size class each); everything else goes to glibc's
//! allocator directly, through the `__libc_*` entry points glibc exports for allocators that
//! replace it.
//!
//! # Finding a freed object's size
//! C's `free` does not say the size, which the caches need to find the object's class. An
//! object of the own heap is found by its address: a bit of the heap's map of its chunks, then
//! its span's record, which names the class ([`thiscpu::PerCpuAlloc::heap_object_size`], a few
//! loads, nothing at the object). Any other block is one of glibc's chunks, whose header gives
//! its usable size ([`glibc::usable_size`], one load); the size classes are glibc's usable
//! sizes, so a chunk of exactly a class's size (glibc made some before the heap started, or
//! while the system refused it memory) is cached like the heap's objects and goes back to
//! glibc's `free` when it leaves the caches. Any other chunk (a large one, or one glibc made
//! for an alignment or by splitting) goes straight to glibc's `free`. The sizes that
//! `free_sized` and `free_aligned_sized` are told are not needed.
//!
//! # The checking mode
//! With `THISCPU_MALLOC_CHECK=1` in the environment, `free` and `realloc` first check that the
//! pointer can be an allocation's and that neither the caches nor its heap span hold it already
//! (a double free),
//! and end the process with a message on standard error and `abort()` if not.
//!
//! # Where it does not apply
//! Only glibc's chunk layout is read, so the library is built for Linux with glibc alone (on
//! every other target it is empty); it cannot be combined with glibc's debugging allocator
//! (`libc_malloc_debug.so`), whose chunks have other headers.

#![cfg_attr(not(all(target_os = "linux", target_env = "gnu")), allow(unused))]

#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub mod glibc;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod exports;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub use exports::*;
