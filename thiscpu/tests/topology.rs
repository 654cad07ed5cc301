//! The `/sys` topology as thiscpu reads it, against `/sys` read by the test; the calling
//! thread's affinity against `/proc/thread-self/status`.
//!
//! Linux only: it compares with `/proc`, `/sys` and Linux's system calls (tests/common).
#![cfg(target_os = "linux")]

mod common;

use common::*;
use thiscpu::topology;

#[test]
fn possible_cpus_is_one_past_the_last_possible_id() {
    let possible = sys_possible_cpus();
    assert_eq!(
        topology::possible_cpus(),
        *possible.last().unwrap() as usize + 1
    );
}

#[test]
fn online_and_allowed_cpus_are_possible() {
    let possible = topology::possible_cpus() as u32;
    let online = topology::online_cpus();
    assert!(!online.is_empty());
    assert!(online.iter().all(|&cpu| cpu < possible), "{online:?}");
    let sys_online = cpulist(&std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap());
    assert_eq!(online, sys_online);
    for cpu in allowed_cpus() {
        assert!(
            online.contains(&cpu),
            "allowed CPU {cpu} is not online: {online:?}"
        );
    }
}

#[test]
fn every_present_cpu_has_the_node_sys_names_and_nothing_else_has_any() {
    let possible = topology::possible_cpus() as u32;
    let present = cpulist(&std::fs::read_to_string("/sys/devices/system/cpu/present").unwrap());
    let nodes = sys_nodes();
    for cpu in 0..possible {
        let node = topology::node_of_cpu(cpu);
        if present.contains(&cpu) {
            assert!(node.is_some(), "present CPU {cpu} has no node");
        }
        // The link names the node of offline CPUs too; the node cpulists only of online ones.
        if let Some(linked) = sys_node_of_cpu(cpu) {
            assert_eq!(node, Some(linked), "CPU {cpu}: cpu{cpu}/node{linked} link");
        }
        let listed: Vec<u32> = nodes
            .iter()
            .filter(|(_, cpus)| cpus.contains(&cpu))
            .map(|(n, _)| *n)
            .collect();
        if !listed.is_empty() {
            assert_eq!(listed, vec![node.unwrap()], "CPU {cpu} in node cpulists");
        }
    }
    assert_eq!(topology::node_of_cpu(possible), None);
    assert_eq!(topology::node_of_cpu(u32::MAX), None);
}

#[test]
fn cpu_lists_parse_as_the_kernel_means_them() {
    let parse = |text| topology::parse_cpu_list(text);
    assert_eq!(parse("0-3,2-5\n").unwrap(), vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(parse("7,1-2").unwrap(), vec![1, 2, 7]);
    assert_eq!(parse("").unwrap(), Vec::<u32>::new());
    assert!(parse("1,,x").is_err());
    assert!(parse("-1").is_err());
    assert!(parse("0-4294967295").is_err(), "a range no kernel writes");
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap();
    assert_eq!(parse(&text).unwrap(), cpulist(&text));
}

/// `Cpus_allowed_list` of the calling thread, from `/proc/thread-self/status`, less the CPUs
/// that are offline: the kernel keeps those in the mask but `sched_getaffinity` leaves them out
/// (the hot-plug guests of `.ci/kernels` run with CPUs offline).
#[cfg(thiscpu_linux)]
fn proc_allowed_cpus() -> Vec<u32> {
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    let line = status
        .lines()
        .find_map(|line| line.strip_prefix("Cpus_allowed_list:"))
        .expect("Cpus_allowed_list in /proc/thread-self/status");
    let online = cpulist(&std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap());
    cpulist(line)
        .into_iter()
        .filter(|cpu| online.contains(cpu))
        .collect()
}

// Pins threads: affinity is Linux's (`thiscpu_linux`, set by the build script); elsewhere
// `pin_to` returns `Unsupported` (tests/portable.rs).
#[cfg(thiscpu_linux)]
#[test]
fn allowed_cpus_are_the_threads_mask_as_proc_lists_it() {
    std::thread::spawn(|| {
        assert_eq!(topology::allowed_cpus().unwrap(), proc_allowed_cpus());
        assert_eq!(topology::allowed_cpus().unwrap(), allowed_cpus());
        let narrowed = *allowed_cpus().last().unwrap();
        set_affinity(0, &Mask::of(&[narrowed])).unwrap();
        assert_eq!(topology::allowed_cpus().unwrap(), [narrowed]);
    })
    .join()
    .unwrap();
}

// Pins threads: affinity is Linux's (`thiscpu_linux`, set by the build script); elsewhere
// `pin_to` returns `Unsupported` (tests/portable.rs).
#[cfg(thiscpu_linux)]
#[test]
fn a_pin_holds_until_its_guard_is_dropped_and_then_the_mask_comes_back() {
    std::thread::spawn(|| {
        let before = proc_allowed_cpus();
        for &cpu in &before {
            {
                let _pinned = topology::pin_to(cpu).unwrap();
                std::thread::yield_now();
                // SAFETY: no precondition.
                assert_eq!(unsafe { libc::sched_getcpu() }, cpu as i32);
                assert_eq!(kernel_getcpu().0, cpu);
                assert_eq!(thiscpu::current_cpu(), cpu);
                assert_eq!(proc_allowed_cpus(), [cpu]);
            }
            assert_eq!(proc_allowed_cpus(), before, "after the pin to CPU {cpu}");
        }
    })
    .join()
    .unwrap();
}

// Pins threads: affinity is Linux's (`thiscpu_linux`, set by the build script); elsewhere
// `pin_to` returns `Unsupported` (tests/portable.rs).
#[cfg(thiscpu_linux)]
#[test]
fn a_kept_pin_outlives_its_guard() {
    let cpu = allowed_cpus()[0];
    std::thread::spawn(move || {
        topology::pin_to(cpu).unwrap().keep();
        assert_eq!(proc_allowed_cpus(), [cpu]);
    })
    .join()
    .unwrap();
}

// Pins threads: affinity is Linux's (`thiscpu_linux`, set by the build script); elsewhere
// `pin_to` returns `Unsupported` (tests/portable.rs).
#[cfg(thiscpu_linux)]
#[test]
fn pins_outside_the_allowed_cpus_are_errors_that_change_nothing() {
    let possible = topology::possible_cpus() as u32;
    std::thread::spawn(move || {
        let before = proc_allowed_cpus();
        for beyond in [possible, possible + 1, u32::MAX] {
            let error = topology::pin_to(beyond).unwrap_err();
            assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput, "{error}");
        }
        assert_eq!(proc_allowed_cpus(), before);
        // Narrow the mask to one CPU: every other possible CPU is then outside it.
        let Some(&kept) = before.first() else {
            panic!("no allowed CPU")
        };
        set_affinity(0, &Mask::of(&[kept])).unwrap();
        if possible == 1 {
            eprintln!("one possible CPU: no CPU outside the mask to try");
            return;
        }
        for other in (0..possible).filter(|&cpu| cpu != kept) {
            let error = topology::pin_to(other).unwrap_err();
            assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput, "{error}");
            assert_eq!(proc_allowed_cpus(), [kept], "after refusing CPU {other}");
        }
    })
    .join()
    .unwrap();
}

/// Some container runtimes bind-mount a `/sys/devices/system/cpu/possible` that lists fewer
/// CPUs than the process runs on. Here a child process makes a mount namespace of its own in
/// which the file says CPU 0 alone, and starts a grandchild there (thiscpu reads the file when
/// a process starts), while two or more CPUs are online: `possible_cpus()` must still exceed
/// every CPU the grandchild is handed, and a counter added to on each of them must be exact.
#[test]
fn possible_cpus_covers_every_cpu_in_use_when_sys_lists_fewer() {
    const ROLE: &str = "THISCPU_TEST_POSSIBLE_SAYS_ONE";
    const NAME: &str = "possible_cpus_covers_every_cpu_in_use_when_sys_lists_fewer";
    const POSSIBLE: &str = "/sys/devices/system/cpu/possible";
    let limit = std::time::Duration::from_secs(120);
    let online = cpulist(&std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap());
    match std::env::var(ROLE).as_deref() {
        Ok("mount") => {
            if bind_one_cpu_over(POSSIBLE) {
                eprint!("{}", rerun_alone(NAME, &[(ROLE, "check")], limit));
            }
        }
        Ok("check") => {
            assert_eq!(std::fs::read_to_string(POSSIBLE).unwrap(), "0\n");
            let possible = topology::possible_cpus();
            eprintln!("{POSSIBLE} says 0, online {online:?}: possible_cpus() = {possible}");
            let counter = thiscpu::Counter::new();
            for &cpu in &online {
                // The portable path cannot pin (qemu-user runs it): the CPU it is on then.
                let _pinned = match topology::pin_to(cpu) {
                    Err(why) if why.kind() == std::io::ErrorKind::Unsupported => None,
                    pinned => Some(pinned.unwrap()),
                };
                let here = thiscpu::current_cpu();
                assert!(
                    (here as usize) < possible,
                    "running on CPU {here}, possible_cpus() = {possible}"
                );
                counter.add(u64::from(cpu) + 1);
            }
            let expected: u64 = online.iter().map(|&cpu| u64::from(cpu) + 1).sum();
            assert_eq!(counter.sum(), expected);
        }
        _ => {
            if online.len() < 2 {
                eprintln!("one CPU online: a file that lists one CPU would tell the truth");
                return;
            }
            let said = rerun_alone(NAME, &[(ROLE, "mount")], limit);
            eprint!("{said}");
            // SAFETY: geteuid has no precondition.
            if unsafe { libc::geteuid() } == 0 {
                assert!(
                    said.contains("possible_cpus() = "),
                    "as root the child must be able to bind-mount and check"
                );
            }
        }
    }
}

/// Puts the calling thread in a mount namespace of its own, private to it, in which `path`
/// reads "0"; `false` where namespaces are refused (no privilege).
fn bind_one_cpu_over(path: &str) -> bool {
    // SAFETY: unshare has no memory preconditions.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        eprintln!(
            "no mount namespace here: {}",
            std::io::Error::last_os_error()
        );
        return false;
    }
    let root = std::ffi::CString::new("/").unwrap();
    // SAFETY: a null source, type and data are allowed for a propagation change; `root` is a
    // NUL-terminated path that lives across the call.
    let private = unsafe {
        libc::mount(
            std::ptr::null(),
            root.as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    };
    assert_eq!(
        private,
        0,
        "make the new namespace's mounts private (else the bind mount would reach the host): {}",
        std::io::Error::last_os_error()
    );
    let lie = std::env::temp_dir().join(format!("thiscpu-possible-{}", std::process::id()));
    std::fs::write(&lie, "0\n").unwrap();
    let source = std::ffi::CString::new(lie.as_os_str().as_encoded_bytes()).unwrap();
    let target = std::ffi::CString::new(path).unwrap();
    // SAFETY: both paths are NUL-terminated and live across the call; a bind mount takes no
    // type or data.
    let bound = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    let bind_error = std::io::Error::last_os_error();
    assert_eq!(bound, 0, "bind-mount over {path}: {bind_error}");
    // The mount holds the file open: it can go from the directory now.
    let _ = std::fs::remove_file(&lie);
    true
}
