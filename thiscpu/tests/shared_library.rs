//! thiscpu linked into a shared library (the `shared_library` example, a `cdylib` that
//! `cargo test` builds) and loaded with `dlopen`: it links, loads, and answers like the
//! program's own copy. Not in a statically linked test, which has no dynamic loader to speak of.
#![cfg(not(target_feature = "crt-static"))]

mod common;

use common::{allowed_cpus, kernel_getcpu, pin};
use std::ffi::{CStr, CString, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

struct Library {
    current_cpu: extern "C" fn() -> u32,
    registrar: extern "C" fn() -> u32,
    count: extern "C" fn(u64),
    total: extern "C" fn() -> u64,
}

/// `target/<profile>/examples/libshared_library.so`, next to this test's `deps/` directory.
fn library_path() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let profile = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("tests run from <profile>/deps");
    profile.join("examples").join("libshared_library.so")
}

fn dlerror() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated message, read at once.
    let message = unsafe { libc::dlerror() };
    if message.is_null() {
        "no dlerror message".to_owned()
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(message) }
            .to_string_lossy()
            .into_owned()
    }
}

fn symbol(handle: *mut c_void, name: &CStr) -> *mut c_void {
    // SAFETY: `handle` came from a successful dlopen and is never closed; `name` is
    // NUL-terminated.
    let address = unsafe { libc::dlsym(handle, name.as_ptr()) };
    assert!(!address.is_null(), "dlsym {name:?}: {}", dlerror());
    address
}

fn library() -> &'static Library {
    static LIBRARY: OnceLock<Library> = OnceLock::new();
    LIBRARY.get_or_init(|| {
        let path = library_path();
        assert!(
            path.exists(),
            "{} is missing: `cargo test` builds it (alone: cargo build -p thiscpu --example shared_library)",
            path.display()
        );
        let c_path = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path; the library's initializers are Rust's and thiscpu's.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!handle.is_null(), "dlopen {}: {}", path.display(), dlerror());
        // SAFETY: each symbol is an `extern "C"` function of the example with exactly this
        // signature; the library stays loaded for the rest of the process.
        unsafe {
            Library {
                current_cpu: std::mem::transmute::<*mut c_void, extern "C" fn() -> u32>(symbol(
                    handle,
                    c"shared_current_cpu",
                )),
                registrar: std::mem::transmute::<*mut c_void, extern "C" fn() -> u32>(symbol(
                    handle,
                    c"shared_registrar",
                )),
                count: std::mem::transmute::<*mut c_void, extern "C" fn(u64)>(symbol(
                    handle,
                    c"shared_count",
                )),
                total: std::mem::transmute::<*mut c_void, extern "C" fn() -> u64>(symbol(
                    handle,
                    c"shared_total",
                )),
            }
        }
    })
}

/// Each copy asks first in one thread and second in another: with thiscpu's own registration,
/// the copy that asks first registers the thread's area and the other falls back there.
#[test]
fn the_loaded_library_answers_the_cpu_it_runs_on() {
    let library = library();
    for cpu in allowed_cpus() {
        for library_first in [true, false] {
            std::thread::spawn(move || {
                pin(cpu);
                let (there, here) = if library_first {
                    ((library.current_cpu)(), thiscpu::current_cpu())
                } else {
                    let here = thiscpu::current_cpu();
                    ((library.current_cpu)(), here)
                };
                assert_eq!(there, cpu, "the library, pinned to {cpu}");
                assert_eq!(here, cpu, "the program, pinned to {cpu}");
                assert_eq!(kernel_getcpu().0, cpu);
            })
            .join()
            .unwrap();
        }
    }
}

#[test]
fn the_loaded_library_reads_the_same_area_as_the_program() {
    let library = library();
    let here = thiscpu::source().registrar;
    let there = match (library.registrar)() {
        0 => thiscpu::Registrar::None,
        1 => thiscpu::Registrar::Glibc,
        2 => thiscpu::Registrar::Thiscpu,
        other => panic!("unknown registrar {other}"),
    };
    eprintln!("program: {here:?}, library: {there:?}");
    // Two copies of thiscpu in one process: with glibc's registration both read glibc's area;
    // without rseq neither has it. (With thiscpu's own registration, each thread's area belongs
    // to whichever copy registered it first; the other copy falls back.)
    if here == thiscpu::Registrar::Thiscpu {
        assert_ne!(
            there,
            thiscpu::Registrar::Glibc,
            "glibc registered nothing here"
        );
    } else {
        assert_eq!(here, there);
    }
}

#[test]
fn the_loaded_library_counts_exactly_from_many_threads() {
    let library = library();
    const THREADS: u64 = 4;
    const EACH: u64 = 100_000;
    let before = (library.total)();
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| (0..EACH).for_each(|_| (library.count)(1)));
        }
    });
    assert_eq!((library.total)() - before, THREADS * EACH);
}
