//! The machine's CPUs and NUMA nodes as Linux describes them in `/sys`.
//!
//! Per-CPU data is sized by the number of *possible* CPUs (every CPU that could ever come
//! online, `/sys/devices/system/cpu/possible`), not by `sysconf`, which counts configured or
//! online CPUs and can be smaller than the largest CPU id the kernel hands out.

use std::sync::OnceLock;

/// A CPU list such as `0-3,8,10-11` (the kernel's "cpulist" format) could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuListError {
    text: String,
}

impl std::fmt::Display for CpuListError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "not a CPU list: {:?}", self.text)
    }
}

impl std::error::Error for CpuListError {}

/// Parses the kernel's cpulist format (`0-3,8,10-11`, possibly empty) into sorted CPU ids.
///
/// ```
/// assert_eq!(thiscpu::topology::parse_cpu_list("0-2,5\n").unwrap(), vec![0, 1, 2, 5]);
/// assert!(thiscpu::topology::parse_cpu_list("3-1").is_err());
/// ```
pub fn parse_cpu_list(text: &str) -> Result<Vec<u32>, CpuListError> {
    let error = || CpuListError {
        text: text.to_owned(),
    };
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|part| !part.is_empty()) {
        let (first, last) = match part.split_once('-') {
            Some((first, last)) => (first, last),
            None => (part, part),
        };
        let first: u32 = first.trim().parse().map_err(|_| error())?;
        let last: u32 = last.trim().parse().map_err(|_| error())?;
        if last < first || last - first > 1 << 20 {
            return Err(error());
        }
        cpus.extend(first..=last);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

fn read_cpu_list(path: &str) -> Option<Vec<u32>> {
    parse_cpu_list(&std::fs::read_to_string(path).ok()?).ok()
}

fn configured_cpus() -> usize {
    // SAFETY: `sysconf` has no precondition.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
    usize::try_from(n).unwrap_or(1).max(1)
}

/// Number of possible CPUs: one more than the largest CPU id the kernel can ever report.
/// Every per-CPU structure has this many slots. Read once and cached.
///
/// ```
/// assert!(thiscpu::current_cpu() < thiscpu::topology::possible_cpus() as u32);
/// ```
pub fn possible_cpus() -> usize {
    static POSSIBLE: OnceLock<usize> = OnceLock::new();
    *POSSIBLE.get_or_init(|| {
        let from_sys = read_cpu_list("/sys/devices/system/cpu/possible")
            .and_then(|cpus| cpus.last().map(|&last| last as usize + 1));
        from_sys.unwrap_or_else(configured_cpus)
    })
}

/// The CPUs online right now (read afresh on every call: CPUs can be hot-plugged).
///
/// ```
/// assert!(!thiscpu::topology::online_cpus().is_empty());
/// ```
pub fn online_cpus() -> Vec<u32> {
    read_cpu_list("/sys/devices/system/cpu/online")
        .unwrap_or_else(|| (0..configured_cpus() as u32).collect())
}

/// The NUMA node of every possible CPU, indexed by CPU. On machines without NUMA support in
/// `/sys` every CPU is on node 0.
fn node_table() -> &'static [u32] {
    static NODES: OnceLock<Vec<u32>> = OnceLock::new();
    NODES.get_or_init(|| {
        let mut table = vec![0; possible_cpus()];
        let Ok(entries) = std::fs::read_dir("/sys/devices/system/node") else {
            return table;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(node) = name.to_str().and_then(|n| n.strip_prefix("node")) else {
                continue;
            };
            let Ok(node) = node.parse::<u32>() else {
                continue;
            };
            let cpulist = entry.path().join("cpulist");
            for cpu in read_cpu_list(cpulist.to_str().unwrap_or_default()).unwrap_or_default() {
                if let Some(slot) = table.get_mut(cpu as usize) {
                    *slot = node;
                }
            }
        }
        table
    })
}

/// The NUMA node of `cpu`, or `None` if `cpu` is not a possible CPU.
///
/// ```
/// let here = thiscpu::getcpu();
/// assert_eq!(thiscpu::topology::node_of_cpu(here.cpu), Some(here.node));
/// ```
pub fn node_of_cpu(cpu: u32) -> Option<u32> {
    node_table().get(cpu as usize).copied()
}

/// Reads the tables that later lookups need, so that they never allocate afterwards
/// (lookups may then run in signal handlers).
pub(crate) fn prepare() {
    let _ = possible_cpus();
    let _ = node_table();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_like_the_kernel_writes_them() {
        assert_eq!(parse_cpu_list("0\n").unwrap(), vec![0]);
        assert_eq!(parse_cpu_list("0-1").unwrap(), vec![0, 1]);
        assert_eq!(
            parse_cpu_list("0-3,8,10-11").unwrap(),
            vec![0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_cpu_list("\n").unwrap(), Vec::<u32>::new());
        assert!(parse_cpu_list("a-b").is_err());
        assert!(parse_cpu_list("4-2").is_err());
        assert!(parse_cpu_list("1-").is_err());
    }

    #[test]
    fn possible_covers_online() {
        let possible = possible_cpus();
        assert!(online_cpus().iter().all(|&cpu| (cpu as usize) < possible));
    }
}
