//! Compares the library's view of the CPUs and their NUMA nodes with `/sys`, in a guest of the
//! kernel matrix (.ci/kernels/guest.sh).
//!
//!   probe topology        possible CPUs, online CPUs and the node of every possible CPU
//!   probe wait CPU        the same once a line arrives on stdin, and then `getcpu()`,
//!                         `current_node()` and `node_of_cpu()` on CPU, where the caller has
//!                         moved this process (`taskset -p`) after bringing CPU online
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
        _ => Err("usage: probe topology | probe wait CPU".to_owned()),
    };
    match result {
        Ok(0) => ExitCode::SUCCESS,
        Ok(disagreements) => {
            println!("probe: {disagreements} disagreement(s) with /sys");
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
