//! Compares the library's view of the CPUs and their NUMA nodes with `/sys`, in a guest of the
//! kernel matrix (.ci/kernels/guest.sh).
//!
//!   probe topology        possible CPUs, online CPUs and the node of every possible CPU
//!   probe wait CPU        the same once a line arrives on stdin, and then `getcpu()`,
//!                         `current_node()` and `node_of_cpu()` on CPU, where the caller has
//!                         moved this process (`taskset -p`) after bringing CPU online
//!   probe write-cpu-id MODE
//!                         checks that this thread's area is registered in MODE (`optimized`
//!                         or `legacy`), then writes a CPU number that no CPU has into the
//!                         area's `cpu_id` and migrates between the online CPUs: a kernel that
//!                         enforces the read-only ID fields (Linux 7.x optimized mode, or any
//!                         mode with `rseq_debug=1`) kills the process with SIGSEGV; elsewhere
//!                         it prints `survived` and exits 0 if the kernel has rewritten the
//!                         field by then (1 if not). Exit status 3 when the mode differs.
//!
//! `wait` is how a process that started while a CPU was offline is checked after that CPU
//! comes back: the library reads its tables once per process, so a check that starts after
//! the change cannot see that case. Prints one line per comparison; exit status 1 if any
//! disagrees, 2 on bad arguments or unreadable `/sys`.

use std::path::Path;
use std::process::ExitCode;

const CPU_DIR: &str = "/sys/devices/system/cpu";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["topology"] => topology(),
        ["wait", cpu] => match cpu.parse::<u32>() {
            Ok(cpu) => wait_then_check(cpu),
            Err(_) => Err(format!("not a CPU number: {cpu}")),
        },
        ["write-cpu-id", mode] => write_cpu_id(mode),
        _ => Err(
            "usage: probe topology | probe wait CPU | probe write-cpu-id optimized|legacy"
                .to_owned(),
        ),
    };
    match result {
        Ok(0) => ExitCode::SUCCESS,
        Ok(disagreements) => {
            println!("probe: {disagreements} check(s) failed");
            ExitCode::FAILURE
        }
        Err(why) => {
            eprintln!("probe: {why}");
            ExitCode::from(2)
        }
    }
}

/// Prints `ok` or `FAIL` with what was compared; returns 1 for a disagreement.
fn compare<T: PartialEq + std::fmt::Debug>(what: &str, library: T, sys: T) -> usize {
    if library == sys {
        println!("ok   {what}: {library:?}");
        0
    } else {
        println!("FAIL {what}: library {library:?}, /sys {sys:?}");
        1
    }
}

/// The CPUs of a list file such as `/sys/devices/system/cpu/online`.
fn sys_cpu_list(name: &str) -> Result<Vec<u32>, String> {
    let path = Path::new(CPU_DIR).join(name);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    thiscpu::topology::parse_cpu_list(&text).map_err(|e| format!("{}: {e:?}", path.display()))
}

/// The node of `cpu` from its `nodeN` link, which the kernel keeps while the CPU is offline.
fn sys_node_of_cpu(cpu: u32) -> Result<u32, String> {
    let dir = Path::new(CPU_DIR).join(format!("cpu{cpu}"));
    let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    entries
        .flatten()
        .find_map(|entry| {
            let name = entry.file_name();
            name.to_str()?.strip_prefix("node")?.parse::<u32>().ok()
        })
        .ok_or_else(|| format!("{} has no nodeN link", dir.display()))
}

fn topology() -> Result<usize, String> {
    let possible = sys_cpu_list("possible")?;
    let mut disagreements = compare(
        "possible_cpus()",
        thiscpu::topology::possible_cpus(),
        possible.last().map_or(0, |&last| last as usize + 1),
    );
    disagreements += compare(
        "online_cpus()",
        thiscpu::topology::online_cpus(),
        sys_cpu_list("online")?,
    );
    for cpu in possible {
        disagreements += compare(
            &format!("node_of_cpu({cpu})"),
            thiscpu::topology::node_of_cpu(cpu),
            Some(sys_node_of_cpu(cpu)?),
        );
    }
    Ok(disagreements)
}

fn wait_then_check(cpu: u32) -> Result<usize, String> {
    // The library reads its tables on first use: make that happen before the CPU comes back.
    let at_start = thiscpu::topology::node_of_cpu(cpu);
    println!(
        "started with CPUs {:?} online; node_of_cpu({cpu}) = {at_start:?}",
        thiscpu::topology::online_cpus()
    );
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .map_err(|e| format!("stdin: {e}"))?;
    let node = sys_node_of_cpu(cpu)?;
    let here = thiscpu::getcpu();
    let mut disagreements = compare("getcpu().cpu", here.cpu, cpu);
    disagreements += compare("getcpu().node", here.node, node);
    disagreements += compare("current_node()", thiscpu::current_node(), node);
    disagreements += compare(
        &format!("node_of_cpu({cpu})"),
        thiscpu::topology::node_of_cpu(cpu),
        Some(node),
    );
    Ok(disagreements + topology()?)
}

/// Offset of `cpu_id` in `struct rseq` (after `cpu_id_start`).
const CPU_ID_OFFSET: isize = 4;
/// What the write puts into `cpu_id`: no CPU has this number, so the kernel's own copy never
/// matches it.
const BOGUS_CPU_ID: u32 = 0x7ead_beef;

fn write_cpu_id(mode: &str) -> Result<usize, String> {
    let wanted = match mode {
        "optimized" => thiscpu::RseqMode::Optimized,
        "legacy" => thiscpu::RseqMode::Legacy,
        _ => return Err(format!("not a mode: {mode}")),
    };
    let source = thiscpu::source();
    println!(
        "registered by {} · {} bytes · mode {:?} · area at thread pointer {:+?}",
        source.registrar.name(),
        source.registered_size,
        source.mode,
        source.area_offset
    );
    if source.mode != Some(wanted) {
        println!("FAIL: the area is not registered in {mode} mode, nothing written");
        std::process::exit(3);
    }
    let Some(offset) = source.area_offset else {
        return Err("no area offset although a mode is reported".to_owned());
    };
    let cpus = thiscpu::topology::online_cpus();
    if cpus.len() < 2 {
        return Err(format!("needs two online CPUs to migrate, has {cpus:?}"));
    }
    let cpu_id = (thread_pointer() as isize + offset + CPU_ID_OFFSET) as *mut u32;
    // SAFETY: `source()` registered this thread's area, which lies `offset` bytes from the
    // thread pointer for as long as the thread lives, so `cpu_id` is a valid, aligned u32 of
    // it. The write breaks the rseq contract (the field belongs to the kernel) on purpose: this
    // throwaway process exists to see whether the kernel enforces that, and nothing reads the
    // area's answers after it (the CPU numbers below come from `sched_getcpu`).
    unsafe { cpu_id.write_volatile(BOGUS_CPU_ID) };
    println!("wrote {BOGUS_CPU_ID:#x} to cpu_id; migrating across CPUs {cpus:?}");
    let mut migrations = 0;
    for round in 0..4 {
        for &cpu in &cpus {
            pin_to(cpu)?;
            std::thread::sleep(std::time::Duration::from_millis(10));
            migrations += 1;
            // SAFETY: sched_getcpu has no preconditions.
            let now = unsafe { libc::sched_getcpu() };
            if round == 0 && now != cpu as i32 {
                return Err(format!("pinned to CPU {cpu} but running on {now}"));
            }
        }
    }
    // SAFETY: as for the write; the read is of the same field of the live area.
    let last = unsafe { cpu_id.read_volatile() };
    println!("survived {migrations} migrations; cpu_id now reads {last:#x}");
    if last == BOGUS_CPU_ID {
        println!("FAIL: the kernel never rewrote cpu_id: the write missed its area");
    }
    // A kernel that lets the write stand has not rewritten the field: then the write did not
    // land in the area it keeps current, and surviving it proves nothing.
    Ok(usize::from(last == BOGUS_CPU_ID))
}

fn pin_to(cpu: u32) -> Result<(), String> {
    // SAFETY: cpu_set_t is plain data for which all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu as usize >= libc::CPU_SETSIZE as usize {
        return Err(format!("CPU {cpu} does not fit a cpu_set_t"));
    }
    // SAFETY: `set` is a valid cpu_set_t and `cpu` fits it (checked above).
    unsafe { libc::CPU_SET(cpu as usize, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; 0 names the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!(
            "sched_setaffinity({cpu}): {}",
            std::io::Error::last_os_error()
        ))
    }
}

#[cfg(target_arch = "x86_64")]
fn thread_pointer() -> usize {
    let tp: usize;
    // SAFETY: on x86_64 Linux, %fs:0 holds the thread control block's pointer to itself (the
    // TLS ABI), which is the thread pointer; the load touches nothing else.
    unsafe {
        std::arch::asm!("mov {}, fs:0", out(reg) tp, options(nostack, readonly, preserves_flags))
    };
    tp
}

#[cfg(target_arch = "aarch64")]
fn thread_pointer() -> usize {
    let tp: usize;
    // SAFETY: reading TPIDR_EL0, the thread pointer register, has no side effects.
    unsafe {
        std::arch::asm!("mrs {}, tpidr_el0", out(reg) tp, options(nostack, nomem, preserves_flags))
    };
    tp
}
