//! thiscpu linked into a shared library (the `shared_library` example, a `cdylib` that
//! `cargo test` builds) and loaded with `dlopen`: it links, loads, and answers like the
//! program's own copy. Not in a statically linked test, which has no dynamic loader to speak of.
//!
//! What it checks (the library stays mapped for the rseq areas that point into it) is the rseq path's (`thiscpu_rseq`, set by the build script).
#![cfg(thiscpu_rseq)]
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
    example_library("libshared_library.so")
}

/// `target/<profile>/examples/NAME`.
fn example_library(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let profile = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("tests run from <profile>/deps");
    profile.join("examples").join(name)
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

/// Loads the example library `file` (`lib<example>.so`) for the rest of the process. The name
/// is given whole, as a literal: the emulated guests' runner copies in the example libraries
/// whose file names appear in the test executable.
fn open_example(file: &str) -> *mut c_void {
    let path = example_library(file);
    let name = file
        .strip_prefix("lib")
        .and_then(|rest| rest.strip_suffix(".so"))
        .unwrap_or(file);
    assert!(
        path.exists(),
        "{} is missing: `cargo test` builds it (alone: cargo build -p thiscpu --example {name})",
        path.display()
    );
    let c_path = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path; the library's initializers are Rust's and thiscpu's.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(
        !handle.is_null(),
        "dlopen {}: {}",
        path.display(),
        dlerror()
    );
    handle
}

fn library() -> &'static Library {
    static LIBRARY: OnceLock<Library> = OnceLock::new();
    LIBRARY.get_or_init(|| {
        let handle = open_example("libshared_library.so");
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

/// The `alloc_shared_library` example: a library whose global allocator is `PerCpuAlloc`.
struct AllocLibrary {
    churn: extern "C" fn(u64, u64) -> u64,
    one: extern "C" fn(usize) -> u32,
    caching: extern "C" fn() -> u32,
    cached_bytes: extern "C" fn() -> u64,
    misses: extern "C" fn() -> u64,
    release: extern "C" fn() -> u64,
}

fn alloc_library() -> &'static AllocLibrary {
    static LIBRARY: OnceLock<AllocLibrary> = OnceLock::new();
    LIBRARY.get_or_init(|| {
        let handle = open_example("liballoc_shared_library.so");
        // SAFETY: each symbol is an `extern "C"` function of the example with exactly this
        // signature; the library stays loaded for the rest of the process.
        unsafe {
            AllocLibrary {
                churn: std::mem::transmute::<*mut c_void, extern "C" fn(u64, u64) -> u64>(symbol(
                    handle,
                    c"alloc_churn",
                )),
                one: std::mem::transmute::<*mut c_void, extern "C" fn(usize) -> u32>(symbol(
                    handle,
                    c"alloc_one",
                )),
                caching: std::mem::transmute::<*mut c_void, extern "C" fn() -> u32>(symbol(
                    handle,
                    c"alloc_caching",
                )),
                cached_bytes: std::mem::transmute::<*mut c_void, extern "C" fn() -> u64>(symbol(
                    handle,
                    c"alloc_cached_bytes",
                )),
                misses: std::mem::transmute::<*mut c_void, extern "C" fn() -> u64>(symbol(
                    handle,
                    c"alloc_misses",
                )),
                release: std::mem::transmute::<*mut c_void, extern "C" fn() -> u64>(symbol(
                    handle,
                    c"alloc_release",
                )),
            }
        }
    })
}

/// A library loaded with `dlopen` whose global allocator is `PerCpuAlloc`, in a program that
/// allocates with the system's: its boxes, strings and vectors are whole when made, filled and
/// freed from four threads at once (each pinned to a CPU in turn) and the main thread; its
/// caches are in use where glibc registered rseq (both copies of thiscpu read glibc's area),
/// never without rseq; `release` empties them, and the library allocates as before afterwards.
#[test]
fn a_loaded_library_allocates_through_its_per_cpu_allocator() {
    let library = alloc_library();
    let cpus = allowed_cpus();
    std::thread::scope(|s| {
        for n in 0..4u64 {
            let cpus = &cpus;
            s.spawn(move || {
                for (round, &cpu) in cpus.iter().enumerate() {
                    pin(cpu);
                    assert_eq!((library.churn)(50, n * 7 + round as u64), 0, "on CPU {cpu}");
                    for size in [1, 24, 100, 4096, 4097, 10_000] {
                        assert_eq!((library.one)(size), 1, "{size} bytes");
                    }
                }
            });
        }
    });
    assert_eq!((library.churn)(50, 99), 0);
    let caching = (library.caching)() == 1;
    let (cached, misses) = ((library.cached_bytes)(), (library.misses)());
    let registrar = thiscpu::source().registrar;
    eprintln!(
        "the library's allocator: caching {caching}, {cached} bytes cached, {misses} misses \
         (the program's registrar: {registrar:?})"
    );
    match registrar {
        thiscpu::Registrar::Glibc => assert!(caching, "glibc's area is there for both copies"),
        thiscpu::Registrar::None => assert!(!caching, "no rseq in this process"),
        thiscpu::Registrar::Thiscpu => {}
    }
    if caching {
        assert!(misses > 0, "a caching allocator that never missed");
    } else {
        assert_eq!((cached, misses), (0, 0));
    }
    let released = (library.release)();
    assert_ne!(released, u64::MAX, "release failed");
    // Reading the figures allocates their list, whose miss refills one batch of its class
    // (at most 32 objects of at most 4,104 bytes): all that may be cached after the release.
    let after = (library.cached_bytes)();
    assert!(
        after <= 32 * 4104,
        "{after} bytes cached after a release of {released}"
    );
    assert_eq!((library.churn)(20, 5), 0, "after release");
}

/// Builds a C file of `tests/c` with the system's C compiler (`$CC`, else `cc`) into `out`;
/// `None` where there is no C compiler (the arm64 guest).
fn build_c(source: &str, out: &std::path::Path, flags: &[&str]) -> Option<()> {
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/c")
        .join(source);
    let output = match std::process::Command::new(&compiler)
        .args(flags)
        .arg("-o")
        .arg(out)
        .arg(&source)
        .output()
    {
        Ok(output) => output,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => panic!("{compiler}: {e}"),
    };
    assert!(
        output.status.success(),
        "{compiler} {}: {}",
        source.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    Some(())
}

/// A C program loads the library, uses it from four threads, unloads it with `dlclose`, loads a
/// library with initial-exec TLS words, and keeps the threads running while they take signals:
/// the library must stay mapped (its critical-section descriptors are still named by every
/// thread's rseq area, and its own areas live in its static TLS), so that no thread faults and
/// nothing writes the new library's words. With glibc's registration and with thiscpu's own.
#[test]
fn unloading_the_library_leaves_the_process_intact() {
    // Built beforehand where the tests run without a C compiler (the arm64 guest: see
    // .ci/aarch64/test.sh), else built here.
    let prebuilt = std::env::var_os("THISCPU_TEST_C_DIR").map(PathBuf::from);
    let dir = prebuilt.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("thiscpu-unload-{}", std::process::id()))
    });
    let host = dir.join("unload_host");
    let tls_library = dir.join("libtls_words.so");
    if prebuilt.is_some() {
        assert!(
            host.exists() && tls_library.exists(),
            "THISCPU_TEST_C_DIR={} lacks unload_host or libtls_words.so",
            dir.display()
        );
    } else {
        std::fs::create_dir_all(&dir).unwrap();
        let built = build_c("unload_host.c", &host, &["-O1", "-pthread"])
            .and_then(|()| build_c("tls_words.c", &tls_library, &["-O1", "-shared", "-fPIC"]));
        if built.is_none() {
            eprintln!("skipped: no C compiler to build the host with");
            return;
        }
    }
    let registrations = [
        ("glibc's registration", None),
        ("thiscpu's own", Some("glibc.pthread.rseq=0")),
    ];
    for (registration, tunables) in registrations {
        for run in 0..3 {
            let mut command = std::process::Command::new(&host);
            command
                .arg(library_path())
                .arg(&tls_library)
                .env_remove("THISCPU_RSEQ")
                .env_remove("GLIBC_TUNABLES");
            if let Some(tunables) = tunables {
                command.env("GLIBC_TUNABLES", tunables);
            }
            let output = command.output().expect("run the C host");
            let stdout = String::from_utf8_lossy(&output.stdout);
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(
                output.status.success(),
                "{registration}, run {run}: {}\n{stdout}{stderr}",
                output.status
            );
            assert!(stdout.contains("still mapped"), "{stdout}");
            if run == 0 {
                eprint!("{registration}: {stdout}");
            }
        }
    }
    if prebuilt.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
