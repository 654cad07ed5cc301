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
//! Every call goes through one table of function pointers: a load of the choice, an indexed
//! load and an indirect jump (`__rust_alloc` is four instructions), the same for whichever
//! allocator is chosen. It costs the other families nothing measurable: five alternating runs
//! each of `thiscpu bench counter otel metrics --quick` built with and without it gave medians
//! whose ratios had a geometric mean of 1.002 over 56 results, every single-thread result within
//! its round-to-round spread of the other build's.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::CStr;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

/// thiscpu's per-CPU allocator, its own heap behind it and glibc's allocator for large objects.
pub type ThiscpuAlloc = thiscpu::PerCpuAlloc;
/// A new [`ThiscpuAlloc`], with the library's defaults.
const fn thiscpu_alloc() -> ThiscpuAlloc {
    thiscpu::PerCpuAlloc::new()
}
/// What the thiscpu rows call, for the tables' legend.
pub const THISCPU_WHAT: &str = "thiscpu::PerCpuAlloc, own heap (glibc malloc above 4 KiB)";

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
            Kind::Tcmalloc => "tcmalloc_better::TCMalloc",
            Kind::Thiscpu => THISCPU_WHAT,
        }
    }

    /// Whether the allocator is in this program (see [`PEERS_BUILT`] and [`TCMALLOC_BUILT`]).
    pub const fn built(self) -> bool {
        match self {
            Kind::Glibc | Kind::Thiscpu => true,
            Kind::Tcmalloc => TCMALLOC_BUILT,
            Kind::Mimalloc | Kind::Jemalloc => PEERS_BUILT,
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
pub use peers::{JEMALLOC, MIMALLOC};
pub use tcmalloc::{TCMALLOC, tcmalloc_per_cpu_caches};

/// Whether the peers (mimalloc, jemalloc, tcmalloc) are in this program: on x86_64 Linux only
/// (see the command's manifest). Elsewhere their cases are left out and the switch never
/// chooses them.
pub const PEERS_BUILT: bool = cfg!(all(target_os = "linux", target_arch = "x86_64"));

/// Whether tcmalloc is in this program: on x86_64 Linux with the command's feature `tcmalloc`
/// only (see the command's manifest: linked in, it takes the threads' rseq areas at start-up
/// where glibc does not register them).
pub const TCMALLOC_BUILT: bool = cfg!(all(
    target_os = "linux",
    target_arch = "x86_64",
    feature = "tcmalloc"
));

/// The peers.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod peers {
    /// mimalloc.
    pub static MIMALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;
    /// jemalloc.
    pub static JEMALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
}

/// tcmalloc, where it is built.
#[cfg(all(target_os = "linux", target_arch = "x86_64", feature = "tcmalloc"))]
mod tcmalloc {
    /// tcmalloc.
    pub static TCMALLOC: tcmalloc_better::TCMalloc = tcmalloc_better::TCMalloc;

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
}

/// The peers' places where they are not built: glibc's allocator, never called (their cases
/// are left out, and the switch never chooses them).
#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
mod peers {
    use std::alloc::System;
    pub static MIMALLOC: System = System;
    pub static JEMALLOC: System = System;
}

/// tcmalloc's place where it is not built: glibc's allocator, never called.
#[cfg(not(all(target_os = "linux", target_arch = "x86_64", feature = "tcmalloc")))]
mod tcmalloc {
    use std::alloc::System;
    pub static TCMALLOC: System = System;

    pub fn tcmalloc_per_cpu_caches() -> bool {
        false
    }
}
/// thiscpu's allocator. The global switch's instance is this one too.
pub static THISCPU: ThiscpuAlloc = thiscpu_alloc();

/// One allocator's functions, each a direct call of that allocator's own method.
struct Entry {
    alloc: unsafe fn(Layout) -> *mut u8,
    dealloc: unsafe fn(*mut u8, Layout),
    alloc_zeroed: unsafe fn(Layout) -> *mut u8,
    realloc: unsafe fn(*mut u8, Layout, usize) -> *mut u8,
}

/// The [`Entry`] of the allocator in the static `$allocator`.
macro_rules! entry {
    ($allocator:path) => {
        Entry {
            // SAFETY: the caller's promises about the layout are passed on.
            alloc: |layout| unsafe { $allocator.alloc(layout) },
            // SAFETY: the pointer came from this allocator (the switch never changes it), with
            // this layout.
            dealloc: |ptr, layout| unsafe { $allocator.dealloc(ptr, layout) },
            // SAFETY: as for `alloc`.
            alloc_zeroed: |layout| unsafe { $allocator.alloc_zeroed(layout) },
            // SAFETY: as for `dealloc`; the caller's promises about the new size are passed on.
            realloc: |ptr, layout, size| unsafe { $allocator.realloc(ptr, layout, size) },
        }
    };
}

/// The entries by index: 0 decides (see [`decide`]) and passes the call on, `1 + Kind as
/// usize` is that allocator's.
static ENTRIES: [Entry; 6] = [
    Entry {
        // SAFETY: as in `entry!`, for whichever allocator `decide` chose.
        alloc: |layout| unsafe { (decide().alloc)(layout) },
        // SAFETY: as above.
        dealloc: |ptr, layout| unsafe { (decide().dealloc)(ptr, layout) },
        // SAFETY: as above.
        alloc_zeroed: |layout| unsafe { (decide().alloc_zeroed)(layout) },
        // SAFETY: as above.
        realloc: |ptr, layout, size| unsafe { (decide().realloc)(ptr, layout, size) },
    },
    entry!(GLIBC),
    entry!(MIMALLOC),
    entry!(JEMALLOC),
    entry!(TCMALLOC),
    entry!(THISCPU),
];

/// The index in [`ENTRIES`] of the process's allocator: 0 until the first call decides.
static CHOSEN: AtomicU8 = AtomicU8::new(0);

/// The process's global allocator: the one [`CHILD_ENV`] named at the first allocation.
#[derive(Debug)]
pub struct Switch;

#[global_allocator]
static GLOBAL: Switch = Switch;

/// The entry of the process's allocator (the deciding one before the first call): a load and
/// an indexed load, then the caller's indirect call; the same for every allocator.
#[inline(always)]
fn entry() -> &'static Entry {
    let index = CHOSEN.load(Relaxed) as usize;
    // SAFETY: `CHOSEN` only ever holds 0 or an index stored by `decide`, `1 + Kind as usize`,
    // at most 5: all indices of `ENTRIES`.
    unsafe { ENTRIES.get_unchecked(index) }
}

/// Reads [`CHILD_ENV`] and stores the choice; a thread that lost the race takes the winner's.
#[cold]
#[inline(never)]
fn decide() -> &'static Entry {
    let kind = from_environment()
        .filter(|kind| kind.built())
        .unwrap_or(Kind::Glibc);
    let index = 1 + kind as u8;
    let index = match CHOSEN.compare_exchange(0, index, Relaxed, Relaxed) {
        Ok(_) => index,
        Err(earlier) => earlier,
    };
    &ENTRIES[index as usize]
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
    match CHOSEN.load(Relaxed) {
        0 => Kind::Glibc,
        index => Kind::ALL[index as usize - 1],
    }
}

// SAFETY: every call is passed unchanged to one allocator, the same for the life of the
// process (`CHOSEN` is set once, before the first allocation returns), so what one of them
// allocated is freed and reallocated by that one, as the trait requires.
unsafe impl GlobalAlloc for Switch {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's promises about `layout` are passed on.
        unsafe { (entry().alloc)(layout) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, that is from the chosen one, with `layout`.
        unsafe { (entry().dealloc)(ptr, layout) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        unsafe { (entry().alloc_zeroed)(layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `dealloc`; the caller's promises about `new_size` are passed on.
        unsafe { (entry().realloc)(ptr, layout, new_size) }
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
