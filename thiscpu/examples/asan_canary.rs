//! A deliberate heap use-after-free, for `.ci/run`'s `asan` step: built with the same
//! `-Zsanitizer=address` flags as the tests it runs, it must die with AddressSanitizer's
//! "heap-use-after-free" report. If it does not, the flags did not reach the build and that
//! step's clean test results prove nothing. Run it only under AddressSanitizer.

fn main() {
    let raw = Box::into_raw(Box::new(0x5eed_u64));
    // SAFETY: `raw` comes from `Box::into_raw` just above and is freed only here.
    drop(unsafe { Box::from_raw(raw) });
    // SAFETY: none: this read of freed memory is intentional, the fault AddressSanitizer must
    // report; the program is run only in builds instrumented by it, which stop it here.
    let stale = unsafe { raw.read_volatile() };
    eprintln!("read {stale:#x} from freed memory unreported: AddressSanitizer is not active");
    std::process::exit(1);
}
