//! The allocators `bench alloc` compares, and the `thiscpu` program's global allocator: a
//! switch among them, so that a child process of `bench alloc` can run a whole program-shaped
//! task on one of them.
//!
//! The choice is made once, on the process's first allocation, from [`CHILD_ENV`] (read with
//! `getenv`, which does not allocate): the part before its first `/` names the allocator. Any
//! other value, or none, means glibc's, so every command but `bench alloc`'s children runs on
//! glibc's allocator as before. The choice is stored before the first allocation returns and
//! never changes afterwards, so no object is ever freed to an allocator other than the one that
//! made it.
//!
//! Every call goes through one table of `&dyn GlobalAlloc`: a load of the choice, a predicted
//! branch and an indirect call, the same instructions whichever allocator is chosen. For the
//! other families this costs nothing measurable: `thiscpu bench counter --quick` and
//! `thiscpu bench otel --quick` (whose SDK cases allocate) gave the same figures, within their
//! round-to-round spread, with and without the switch (see `docs/command.md`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::CStr;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

/// thiscpu's per-CPU allocator front, over glibc's allocator.
pub type ThiscpuAlloc = thiscpu::PerCpuAlloc;
/// A new [`ThiscpuAlloc`], with the library's defaults.
const fn thiscpu_alloc() -> ThiscpuAlloc {
    thiscpu::PerCpuAlloc::new()
}
/// What the thiscpu rows call, for the tables' legend.
pub const THISCPU_WHAT: &str = "thiscpu::PerCpuAlloc over glibc malloc";

/// Set in the environment of a child process of `bench alloc` to `ALLOCATOR/TASK/SIZE`.
pub const CHILD_ENV: &str = "THISCPU_BENCH_ALLOC_CHILD";
/// [`CHILD_ENV`] for `getenv`.
const CHILD_ENV_C: &CStr = c"THISCPU_BENCH_ALLOC_CHILD";

/// The allocators compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Glibc,
    Mimalloc,
    Jemalloc,
    Tcmalloc,
    Thiscpu,
}

impl Kind {
    /// Every allocator, in the tables' order.
    pub const ALL: [Kind; 5] = [
        Kind::Glibc,
        Kind::Mimalloc,
        Kind::Jemalloc,
        Kind::Tcmalloc,
        Kind::Thiscpu,
    ];
    /// The peers thiscpu's allocator is held against (glibc's is the floor, not a peer).
    pub const PEERS: [Kind; 3] = [Kind::Mimalloc, Kind::Jemalloc, Kind::Tcmalloc];

    /// The name in case names and in [`CHILD_ENV`].
    pub const fn name(self) -> &'static str {
        match self {
            Kind::Glibc => "glibc",
            Kind::Mimalloc => "mimalloc",
            Kind::Jemalloc => "jemalloc",
            Kind::Tcmalloc => "tcmalloc",
            Kind::Thiscpu => "thiscpu",
        }
    }

    /// What the allocator is, in a few words.
    pub const fn what(self) -> &'static str {
        match self {
            Kind::Glibc => "glibc malloc (std::alloc::System)",
            Kind::Mimalloc => "mimalloc::MiMalloc",
            Kind::Jemalloc => "tikv_jemallocator::Jemalloc",
            Kind::Tcmalloc => "tcmalloc_better::TCMalloc (per-CPU caches on rseq)",
            Kind::Thiscpu => THISCPU_WHAT,
        }
    }

    /// The allocator named `name`.
    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::from_bytes(name.as_bytes())
    }

    /// As [`Kind::from_name`], without allocating (it runs inside the global allocator).
    fn from_bytes(name: &[u8]) -> Option<Kind> {
        let mut at = 0;
        while at < Kind::ALL.len() {
            if Kind::ALL[at].name().as_bytes() == name {
                return Some(Kind::ALL[at]);
            }
            at += 1;
        }
        None
    }
}

/// glibc's allocator.
pub static GLIBC: System = System;
/// mimalloc.
pub static MIMALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;
/// jemalloc.
pub static JEMALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
/// tcmalloc.
pub static TCMALLOC: tcmalloc_better::TCMalloc = tcmalloc_better::TCMalloc;
/// thiscpu's allocator. The global switch's instance is this one too.
pub static THISCPU: ThiscpuAlloc = thiscpu_alloc();

/// The allocators by [`Kind`], in [`Kind::ALL`]'s order.
static TABLE: [&(dyn GlobalAlloc + Sync); 5] = [&GLIBC, &MIMALLOC, &JEMALLOC, &TCMALLOC, &THISCPU];

/// No allocation has been made yet.
const UNDECIDED: u8 = u8::MAX;
/// The index in [`TABLE`] of the process's allocator, or [`UNDECIDED`].
static CHOSEN: AtomicU8 = AtomicU8::new(UNDECIDED);

/// The process's global allocator: the one [`CHILD_ENV`] named at the first allocation.
#[derive(Debug)]
pub struct Switch;

#[global_allocator]
static GLOBAL: Switch = Switch;

/// The allocator the process uses, chosen on the first call.
#[inline(always)]
fn chosen_allocator() -> &'static (dyn GlobalAlloc + Sync) {
    let mut index = CHOSEN.load(Relaxed);
    if index == UNDECIDED {
        index = decide();
    }
    TABLE[index as usize]
}

/// Reads [`CHILD_ENV`] and stores the choice; a thread that lost the race takes the winner's.
#[cold]
#[inline(never)]
fn decide() -> u8 {
    let index = from_environment().unwrap_or(Kind::Glibc) as u8;
    match CHOSEN.compare_exchange(UNDECIDED, index, Relaxed, Relaxed) {
        Ok(_) => index,
        Err(earlier) => earlier,
    }
}

/// The allocator [`CHILD_ENV`] names, without allocating.
fn from_environment() -> Option<Kind> {
    // SAFETY: `getenv` reads the environment and returns a pointer into it or null; it does
    // not allocate. This program never changes its own environment (no `set_var`), so no
    // other thread rewrites it meanwhile.
    let value = unsafe { libc::getenv(CHILD_ENV_C.as_ptr()) };
    if value.is_null() {
        return None;
    }
    // SAFETY: a non-null result of `getenv` is a NUL-terminated string in the environment,
    // which stays as it is (see above).
    let value = unsafe { CStr::from_ptr(value) }.to_bytes();
    Kind::from_bytes(value.split(|&byte| byte == b'/').next()?)
}

/// The allocator this process uses (glibc's until the first allocation, which is made long
/// before `main`).
pub fn chosen() -> Kind {
    Kind::ALL[chosen_allocator_index()]
}

fn chosen_allocator_index() -> usize {
    match CHOSEN.load(Relaxed) {
        UNDECIDED => Kind::Glibc as usize,
        index => index as usize,
    }
}

// SAFETY: every call is passed unchanged to one allocator, the same for the life of the
// process (`CHOSEN` is set once, before the first allocation returns), so what one of them
// allocated is freed and reallocated by that one, as the trait requires.
unsafe impl GlobalAlloc for Switch {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's promises about `layout` are passed on.
        unsafe { chosen_allocator().alloc(layout) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, that is from the chosen one, with `layout`.
        unsafe { chosen_allocator().dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        unsafe { chosen_allocator().alloc_zeroed(layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `dealloc`; the caller's promises about `new_size` are passed on.
        unsafe { chosen_allocator().realloc(ptr, layout, new_size) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_the_variable_is_spelt_once() {
        for kind in Kind::ALL {
            assert_eq!(Kind::from_name(kind.name()), Some(kind));
        }
        assert_eq!(Kind::from_name("ptmalloc"), None);
        assert_eq!(CHILD_ENV_C.to_str(), Ok(CHILD_ENV));
    }

    #[test]
    fn the_test_process_runs_on_glibc() {
        let _made = Box::new(1u8);
        assert_eq!(chosen(), Kind::Glibc);
    }
}

unsafe extern "C" {
    /// tcmalloc's own answer: whether its per-CPU caches are in use in this process.
    fn MallocExtension_Internal_GetPerCpuCachesActive() -> bool;
}

/// Whether tcmalloc's per-CPU caches are in use in this process (it registers rseq for
/// itself, which fails where glibc registered it first).
pub fn tcmalloc_per_cpu_caches() -> bool {
    // SAFETY: a query without arguments, defined by the linked tcmalloc.
    unsafe { MallocExtension_Internal_GetPerCpuCachesActive() }
}
