//! The rseq registration on Linux with an architecture port: finding glibc's areas
//! (`__rseq_size`, `__rseq_offset`), the kernel's feature size and alignment (`getauxval`),
//! probing and making the `rseq` system call on thiscpu's own area.
//!
//! # Safety
//! This module calls `dlsym`, `dladdr`, `dlopen`, `getauxval`, `getenv` and the `rseq` syscall,
//! and writes the calling thread's own area before registering it; each block states why it
//! holds.

use super::facts::{Registrar, RseqFacts, Unavailable};
use super::inject;
use crate::abi::{self, Rseq};
use crate::arch;
use std::cell::Cell;
use std::ffi::CStr;

/// Whether the environment variable `name` holds one of `values`.
fn env_is(name: &CStr, values: &[&[u8]]) -> bool {
    // SAFETY: `getenv` with a NUL-terminated name; the result is read before any other call
    // that could change the environment in this function.
    let value = unsafe { libc::getenv(name.as_ptr()) };
    if value.is_null() {
        return false;
    }
    // SAFETY: a non-null `getenv` result is a NUL-terminated string.
    let value = unsafe { CStr::from_ptr(value) }.to_bytes();
    values.contains(&value)
}

fn rseq_turned_off() -> bool {
    env_is(c"THISCPU_RSEQ", &[b"off", b"0", b"false", b"no"])
}

/// `THISCPU_RSEQ_AREA=legacy`: register thiscpu's own area with the original 32 bytes even
/// where the kernel offers the optimized mode (for comparisons; glibc's registration is not
/// affected).
fn legacy_area_asked() -> bool {
    env_is(c"THISCPU_RSEQ_AREA", &[b"legacy"])
}

/// Looks up a data symbol of glibc at run time, so that the binary also links and runs on
/// glibc before 2.35 and on libcs without rseq support.
fn glibc_symbol<T: Copy>(name: &CStr) -> Option<T> {
    // SAFETY: `dlsym` with `RTLD_DEFAULT` and a NUL-terminated name has no precondition.
    let address = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    let address = if address.is_null() {
        linked_glibc_symbol(name)?
    } else {
        address.cast_const()
    };
    // SAFETY: glibc declares `__rseq_offset` as `ptrdiff_t` and `__rseq_size`/`__rseq_flags`
    // as `unsigned int` (sys/rseq.h); the callers ask for exactly those types.
    Some(unsafe { address.cast::<T>().read() })
}

/// In a statically linked program `dlsym` finds none of the program's own symbols, glibc's
/// included. There the symbols are referenced weakly at link time instead: a static glibc 2.35
/// or later always links them in (its start-up code registers rseq and sets them), and a weak
/// reference that nothing defines (an older glibc, musl) is null. A dynamically linked program
/// keeps to `dlsym`: a weak reference there would tie the binary to the glibc version it was
/// built against.
#[cfg(target_feature = "crt-static")]
fn linked_glibc_symbol(name: &CStr) -> Option<*const core::ffi::c_void> {
    unsafe extern "C" {
        static __thiscpu_0_1_linked_rseq_size: *const core::ffi::c_void;
        static __thiscpu_0_1_linked_rseq_offset: *const core::ffi::c_void;
    }
    // SAFETY: two pointer-sized words in read-only-after-relocation data (below), written only
    // by the linker (or by the start-up code's self-relocation in a static PIE).
    let address = unsafe {
        match name.to_bytes() {
            b"__rseq_size" => __thiscpu_0_1_linked_rseq_size,
            b"__rseq_offset" => __thiscpu_0_1_linked_rseq_offset,
            _ => return None,
        }
    };
    (!address.is_null()).then_some(address)
}

// The words `linked_glibc_symbol` reads: the addresses of glibc's symbols, or 0. The same
// directives on every architecture.
#[cfg(target_feature = "crt-static")]
core::arch::global_asm!(
    ".weak __rseq_size",
    ".weak __rseq_offset",
    ".pushsection .data.rel.ro.__thiscpu_0_1_linked_glibc,\"aw\"",
    ".balign 8",
    ".globl __thiscpu_0_1_linked_rseq_size",
    ".hidden __thiscpu_0_1_linked_rseq_size",
    "__thiscpu_0_1_linked_rseq_size:",
    ".quad __rseq_size",
    ".globl __thiscpu_0_1_linked_rseq_offset",
    ".hidden __thiscpu_0_1_linked_rseq_offset",
    "__thiscpu_0_1_linked_rseq_offset:",
    ".quad __rseq_offset",
    ".popsection",
);

#[cfg(not(target_feature = "crt-static"))]
fn linked_glibc_symbol(_name: &CStr) -> Option<*const core::ffi::c_void> {
    None
}

/// Result of the cheap probe `rseq(NULL, 0, 0, 0)`: `EINVAL` means the syscall exists.
fn probe_syscall() -> Result<(), Unavailable> {
    // SAFETY: a null area with length 0 is rejected by the kernel before it touches memory.
    let ret =
        unsafe { libc::syscall(libc::SYS_rseq, core::ptr::null_mut::<Rseq>(), 0u32, 0, 0u32) };
    let errno = if ret == 0 {
        0
    } else {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    };
    match errno {
        libc::EINVAL => Ok(()),
        libc::ENOSYS => Err(Unavailable::NoSyscall),
        other => Err(Unavailable::Refused(other)),
    }
}

/// Keeps the object that holds this copy of thiscpu (the program, or a shared library loaded
/// with `dlopen`) mapped until the process ends, whatever `dlclose` is called later.
///
/// Once thiscpu ran in a thread, that thread's rseq area points at a critical-section
/// descriptor inside this object, and thiscpu's own area (when it registers one) lives in this
/// object's static TLS. If the object were unmapped, the kernel would read the descriptor from
/// unmapped memory at the thread's next preemption or signal (a SIGSEGV), and keep writing the
/// CPU number into static TLS that glibc hands to the next library loaded. Marking the object
/// `RTLD_NODELETE` (found through one of its own addresses, reopened with `RTLD_NOLOAD`, which
/// never loads anything) makes `dlclose` leave it in place. The handle is never closed: it is
/// the pin. A statically linked program has nothing to unload.
fn pin_own_module() {
    #[cfg(not(target_feature = "crt-static"))]
    {
        // SAFETY: `Dl_info` is plain pointers, for which zero is a valid value.
        let mut info: libc::Dl_info = unsafe { core::mem::zeroed() };
        let own_address = pin_own_module as *const libc::c_void;
        // SAFETY: `dladdr` reads the loader's tables and fills `info`; the address is one of
        // this object's functions.
        if unsafe { libc::dladdr(own_address, &mut info) } == 0 || info.dli_fname.is_null() {
            return;
        }
        // SAFETY: `dli_fname` is the NUL-terminated path of an object that is loaded (it holds
        // this code); `RTLD_NOLOAD` only looks it up, so no initializer runs. For the main
        // program the lookup may fail, which is harmless: the program is never unloaded.
        let _pin = unsafe {
            libc::dlopen(
                info.dli_fname,
                libc::RTLD_LAZY | libc::RTLD_NOLOAD | libc::RTLD_NODELETE,
            )
        };
    }
}

/// Registers the thread that makes the decision, so that a registration made elsewhere (by
/// another library, or a libc that publishes no `__rseq_offset`) is found now rather than
/// failing in every thread later. Returns the length the area is registered with.
fn register_deciding_thread(size: u32) -> Result<u32, Unavailable> {
    let _ = REGISTRATION_TRIED.try_with(|tried| tried.set(true));
    registration_outcome(size, register_own_area)
}

/// What the deciding thread's registration with `size` bytes (by `register`) means for the
/// process.
fn registration_outcome(
    size: u32,
    register: impl Fn(u32) -> Result<u32, NotRegistered>,
) -> Result<u32, Unavailable> {
    let registered = match register(size) {
        // Kernels that know only the original area refuse a longer one with EINVAL.
        Err(NotRegistered::Refused(libc::EINVAL)) if size > abi::ORIGINAL_AREA_SIZE => {
            register(abi::ORIGINAL_AREA_SIZE)
        }
        other => other,
    };
    match registered {
        Ok(size) => Ok(size),
        // Another area (or this one, with another length) is registered for this thread.
        Err(NotRegistered::Refused(libc::EINVAL)) => Err(Unavailable::RegisteredElsewhere),
        Err(NotRegistered::Refused(errno)) => Err(Unavailable::Refused(errno)),
        Err(NotRegistered::NoCpuId) => Err(Unavailable::NoCpuId),
    }
}

/// Who registers rseq in this process, and with which length.
pub(super) fn decide_registrar() -> RseqFacts {
    pin_own_module();
    // SAFETY: `getauxval` has no precondition; it returns 0 for absent entries.
    let kernel_feature_size = unsafe { libc::getauxval(abi::AT_RSEQ_FEATURE_SIZE) } as u32;
    // SAFETY: as above.
    let kernel_align = unsafe { libc::getauxval(abi::AT_RSEQ_ALIGN) } as u32;
    let glibc_rseq_size = glibc_symbol::<u32>(c"__rseq_size");
    let glibc_rseq_offset = glibc_symbol::<isize>(c"__rseq_offset");
    let mut found = RseqFacts {
        registrar: Registrar::None,
        unavailable: None,
        kernel_feature_size,
        kernel_align,
        registered_size: 0,
        usable_size: 0,
        glibc_rseq_size,
        glibc_rseq_offset,
    };
    if rseq_turned_off() {
        found.unavailable = Some(Unavailable::TurnedOff);
        return found;
    }
    if let (Some(size), Some(_)) = (glibc_rseq_size, glibc_rseq_offset)
        && size > 0
    {
        found.registrar = Registrar::Glibc;
        // glibc registers 32 bytes when it reports 20, 28 or 32, and its reported size (the
        // kernel's feature size) when that is larger (2.41+).
        found.registered_size = size.max(abi::ORIGINAL_AREA_SIZE);
        found.usable_size = abi::usable_size(size, kernel_feature_size);
        return found;
    }
    let own_size =
        abi::own_registration_size(kernel_feature_size, kernel_align, legacy_area_asked());
    match probe_syscall().and_then(|()| register_deciding_thread(own_size)) {
        Ok(size) => {
            found.registrar = Registrar::Thiscpu;
            found.registered_size = size;
            found.usable_size = abi::usable_size(size, kernel_feature_size);
        }
        Err(why) => found.unavailable = Some(why),
    }
    found
}

thread_local! {
    /// Whether this thread already tried to register thiscpu's own area, so a refused
    /// registration costs one syscall per thread, not one per call.
    static REGISTRATION_TRIED: Cell<bool> = const { Cell::new(false) };
    /// The length this thread's own area was registered with, 0 until it is.
    static OWN_REGISTERED_LENGTH: Cell<u32> = const { Cell::new(0) };
}

/// Registers thiscpu's own area for the calling thread, once per thread (a refused
/// registration costs one syscall per thread, not one per call); whether it is registered.
pub(super) fn register_thread(size: u32) -> bool {
    let tried = REGISTRATION_TRIED
        .try_with(|tried| tried.replace(true))
        .unwrap_or(true);
    !tried && register_own_area(size).is_ok()
}

/// Notes that this thread's own area is registered with `size` bytes, and returns it.
fn registered_with(size: u32) -> u32 {
    let _ = OWN_REGISTERED_LENGTH.try_with(|length| length.set(size));
    size
}

/// Why the calling thread's own area is not registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum NotRegistered {
    /// The kernel refused the registration with this errno.
    Refused(i32),
    /// The kernel accepted it but left `cpu_id` negative; the registration was withdrawn.
    NoCpuId,
}

/// Registers thiscpu's own area for the calling thread with `size` bytes (32, or an
/// optimized-mode length from `abi::own_registration_size`), and returns the length it is
/// registered with.
///
/// An area that is registered already is left as it is: its id fields belong to the kernel
/// (a write to them kills the process in optimized mode). That happens to the thread of a
/// decision that unwound after registering it, and to the child of a `fork` made from a
/// signal handler in the middle of the decision, which inherits the registration; the next
/// decision on that thread finds it here.
///
/// A registration the kernel accepts but whose `cpu_id` stays negative is withdrawn: kept, the
/// kernel would start filling the area later, and this thread would then run restartable
/// sequences (plain stores) on data that the rest of the process, told that nobody owns rseq,
/// updates with atomics.
pub(super) fn register_own_area(size: u32) -> Result<u32, NotRegistered> {
    debug_assert!((abi::ORIGINAL_AREA_SIZE..=abi::OWN_AREA_CAPACITY).contains(&size));
    let size = size.clamp(abi::ORIGINAL_AREA_SIZE, abi::OWN_AREA_CAPACITY);
    let own = arch::area_at(arch::own_area_offset());
    // SAFETY: `own` is this thread's static-TLS area, which lives as long as the thread;
    // `cpu_id` is an aligned `i32` that only this thread and the kernel write.
    if unsafe { core::ptr::addr_of!((*own).cpu_id).read_volatile() } >= 0 {
        let registered = OWN_REGISTERED_LENGTH.try_with(Cell::get).unwrap_or(0);
        return Ok(if registered == 0 { size } else { registered });
    }
    // SAFETY: `own` is this thread's static-TLS area of `OWN_AREA_CAPACITY` bytes, aligned to
    // as much (see `arch`), which no other thread writes; `size` is clamped to it. It is not
    // registered (a registered area has a non-negative `cpu_id`, checked above, and nothing
    // else unregisters it), so none of its fields belongs to the kernel yet. The kernel
    // requires `cpu_id = -1`, `rseq_cs = 0` and the rest 0 (the bytes past the original 32
    // included: time-slice requests live there) before registration. The area lives in static
    // TLS, freed only after the kernel has seen the thread exit, so it may stay registered
    // until then.
    let ret = unsafe {
        own.write_volatile(Rseq::UNREGISTERED);
        own.cast::<u8>()
            .add(abi::ORIGINAL_AREA_SIZE as usize)
            .write_bytes(
                0,
                (abi::OWN_AREA_CAPACITY - abi::ORIGINAL_AREA_SIZE) as usize,
            );
        own_area_syscall(own, size, 0)
    };
    if ret != 0 {
        return match std::io::Error::last_os_error().raw_os_error().unwrap_or(0) {
            // This very area is registered with this length (its `cpu_id` not filled in yet).
            libc::EBUSY => Ok(registered_with(size)),
            errno => Err(NotRegistered::Refused(errno)),
        };
    }
    // SAFETY: as above.
    let cpu_id = unsafe { core::ptr::addr_of!((*own).cpu_id).read_volatile() };
    if cpu_id >= 0 && !inject::no_cpu_id() {
        return Ok(registered_with(size));
    }
    // SAFETY: the area was registered just above, with the same address, length and signature.
    if unsafe { own_area_syscall(own, size, abi::FLAG_UNREGISTER) } != 0 {
        // Still registered: the kernel will fill it in, so it counts as registered.
        return Ok(registered_with(size));
    }
    // SAFETY: as above; no longer registered, so only this thread writes it.
    unsafe { core::ptr::addr_of_mut!((*own).cpu_id).write_volatile(abi::CPU_ID_UNINITIALIZED) };
    Err(NotRegistered::NoCpuId)
}

/// The `rseq` system call on thiscpu's own area with `size` bytes and `flags`.
///
/// # Safety
/// `own` is the calling thread's own area and `size` at most its capacity; for a registration
/// (`flags == 0`) it is prepared as the kernel requires, for `FLAG_UNREGISTER` it is registered
/// with `size` bytes.
pub(super) unsafe fn own_area_syscall(own: *mut Rseq, size: u32, flags: i32) -> libc::c_long {
    // SAFETY: the caller's contract.
    unsafe { libc::syscall(libc::SYS_rseq, own, size, flags, arch::RSEQ_SIG) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_registration_refused_with_einval_is_retried_with_the_original_length() {
        let tried = std::cell::RefCell::new(Vec::new());
        let kernel_without_long_areas = |size| {
            tried.borrow_mut().push(size);
            if size > abi::ORIGINAL_AREA_SIZE {
                Err(NotRegistered::Refused(libc::EINVAL))
            } else {
                Ok(size)
            }
        };
        assert_eq!(registration_outcome(64, kernel_without_long_areas), Ok(32));
        assert_eq!(*tried.borrow(), [64, 32]);
        let elsewhere = |_| Err(NotRegistered::Refused(libc::EINVAL));
        assert_eq!(
            registration_outcome(64, elsewhere),
            Err(Unavailable::RegisteredElsewhere)
        );
        assert_eq!(
            registration_outcome(32, elsewhere),
            Err(Unavailable::RegisteredElsewhere)
        );
        let refused = |_| Err(NotRegistered::Refused(libc::EPERM));
        assert_eq!(
            registration_outcome(64, refused),
            Err(Unavailable::Refused(libc::EPERM))
        );
    }
}
