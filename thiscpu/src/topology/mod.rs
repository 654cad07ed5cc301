//! The machine's CPUs and NUMA nodes as Linux describes them in `/sys`.
//!
//! Per-CPU data is sized by the number of *possible* CPUs (every CPU that could ever come
//! online, `/sys/devices/system/cpu/possible`), not by `sysconf`, which counts configured or
//! online CPUs and can be smaller than the largest CPU id the kernel hands out.
//!
//! The calling thread's affinity is here too: [`allowed_cpus`], and [`pin_to`], which pins the
//! thread to one CPU until its guard is dropped.
//!
//! Where `/sys` does not exist (every system but Linux), the possible and online CPUs are
//! `0..n`, with `n` the larger of `std::thread::available_parallelism` and the processors the
//! system has configured (`sysconf(_SC_NPROCESSORS_CONF)` on Unix, `GetActiveProcessorCount`
//! on Windows); every CPU is on node 0; and the affinity functions return an error of kind
//! [`std::io::ErrorKind::Unsupported`].

mod affinity;

#[cfg(not(thiscpu_model))]
use affinity::largest_allowed_cpu;
pub use affinity::{PinGuard, allowed_cpus, pin_to};
pub(crate) use affinity::{pin_to_beyond_mask, some_thread_may_run_on};

use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

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
    crate::os::configured_cpus()
}

/// Number of possible CPUs: one more than the largest CPU id the kernel can ever report.
/// Every per-CPU structure has this many slots. Read once and cached.
///
/// The kernel's count (`/sys/devices/system/cpu/possible`) is taken at least as large as what
/// the process sees for itself when it asks: the CPUs online, the CPUs this thread may run
/// on, and the CPU it runs on. Where a container runtime bind-mounts a `possible` file that
/// lists fewer CPUs than run, those keep the count from falling short of a CPU number the
/// process is handed; a CPU beyond all of them that comes online later is not foreseen.
///
/// ```
/// assert!(thiscpu::current_cpu() < thiscpu::topology::possible_cpus() as u32);
/// ```
#[cfg(not(thiscpu_model))]
pub fn possible_cpus() -> usize {
    static POSSIBLE: OnceLock<usize> = OnceLock::new();
    *POSSIBLE.get_or_init(|| {
        let from_sys = read_cpu_list("/sys/devices/system/cpu/possible")
            .and_then(|cpus| cpus.last().map(|&last| last as usize + 1));
        from_sys.unwrap_or_else(configured_cpus).max(seen_cpus())
    })
}

/// One more than the largest CPU number the process can see in use: online, allowed to this
/// thread, or running it.
#[cfg(not(thiscpu_model))]
fn seen_cpus() -> usize {
    let online = online_cpus().last().copied();
    let running = crate::os::getcpu_syscall().map(|(cpu, _)| cpu);
    [online, largest_allowed_cpu(), running]
        .into_iter()
        .flatten()
        .map(|cpu| cpu as usize + 1)
        .max()
        .unwrap_or(1)
}

/// The model machine's CPUs, under the model checker.
#[cfg(thiscpu_model)]
pub fn possible_cpus() -> usize {
    crate::arch::model::cpus()
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

/// A node table entry for a CPU whose node `/sys` did not name (yet).
const UNKNOWN_NODE: u32 = u32::MAX;

/// The NUMA node of every possible CPU, as far as `/sys` names it.
struct NodeTable {
    /// Indexed by CPU: its node, or [`UNKNOWN_NODE`].
    nodes: Box<[AtomicU32]>,
    /// The largest node id that can exist (`/sys/devices/system/node/possible`); nodes are
    /// searched up to it when a CPU's node is looked up again.
    last_node: u32,
}

/// Reads the node of each of `possible` CPUs from the `/sys` tree under `sys`.
///
/// The link `devices/system/cpu/cpuN/nodeM` comes first: it exists for every present CPU,
/// online or not. The per-node `cpulist` files are only a fallback, because they list online
/// CPUs only (an offline CPU would otherwise fall into no node). Without a
/// `devices/system/node` directory the kernel has no NUMA support and every CPU is on node 0.
fn read_node_table(sys: &Path, possible: usize) -> NodeTable {
    let node_dir = sys.join("devices/system/node");
    let mut listed = vec![UNKNOWN_NODE; possible];
    let mut any_node = false;
    let mut last_seen = 0;
    if let Ok(entries) = std::fs::read_dir(&node_dir) {
        for entry in entries.flatten() {
            let Some(node) = node_number(&entry.file_name()) else {
                continue;
            };
            any_node = true;
            last_seen = last_seen.max(node);
            let cpus = std::fs::read_to_string(entry.path().join("cpulist"))
                .ok()
                .and_then(|text| parse_cpu_list(&text).ok())
                .unwrap_or_default();
            for cpu in cpus {
                if let Some(slot) = listed.get_mut(cpu as usize) {
                    *slot = node;
                }
            }
        }
    }
    let nodes = (0..possible)
        .map(|cpu| {
            let node = if any_node {
                linked_node(sys, cpu).unwrap_or(listed[cpu])
            } else {
                0
            };
            AtomicU32::new(node)
        })
        .collect();
    let last_node = std::fs::read_to_string(node_dir.join("possible"))
        .ok()
        .and_then(|text| parse_cpu_list(&text).ok())
        .and_then(|ids| ids.last().copied())
        .unwrap_or(0)
        .max(last_seen);
    NodeTable { nodes, last_node }
}

/// `M` from a directory entry named `nodeM`.
fn node_number(name: &std::ffi::OsStr) -> Option<u32> {
    name.to_str()?.strip_prefix("node")?.parse().ok()
}

/// The node that `devices/system/cpu/cpuN/nodeM` names for CPU `cpu`.
fn linked_node(sys: &Path, cpu: usize) -> Option<u32> {
    let entries = std::fs::read_dir(sys.join(format!("devices/system/cpu/cpu{cpu}"))).ok()?;
    entries
        .flatten()
        .find_map(|entry| node_number(&entry.file_name()))
}

fn node_table() -> &'static NodeTable {
    static NODES: OnceLock<NodeTable> = OnceLock::new();
    NODES.get_or_init(|| read_node_table(Path::new("/sys"), possible_cpus()))
}

/// Whether `/sys/devices/system/cpu/cpu{cpu}/node{node}` exists. Builds the path on the stack
/// and asks `access`, which is async-signal-safe: lookups may run in signal handlers.
fn cpu_linked_to_node(cpu: u32, node: u32) -> bool {
    fn push(path: &mut [u8; 64], len: &mut usize, bytes: &[u8]) {
        path[*len..*len + bytes.len()].copy_from_slice(bytes);
        *len += bytes.len();
    }
    fn push_number(path: &mut [u8; 64], len: &mut usize, mut n: u32) {
        let mut digits = [0u8; 10];
        let mut count = 0;
        loop {
            digits[count] = b'0' + (n % 10) as u8;
            count += 1;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        digits[..count].reverse();
        push(path, len, &digits[..count]);
    }
    // 24 + 10 + 5 + 10 + 1 bytes at most.
    let mut path = [0u8; 64];
    let mut len = 0;
    push(&mut path, &mut len, b"/sys/devices/system/cpu/cpu");
    push_number(&mut path, &mut len, cpu);
    push(&mut path, &mut len, b"/node");
    push_number(&mut path, &mut len, node);
    // `path` was zeroed, so it is NUL-terminated after `len` bytes.
    core::ffi::CStr::from_bytes_until_nul(&path).is_ok_and(crate::os::path_exists)
}

/// The NUMA node of `cpu`, or `None` if `cpu` is not a possible CPU or `/sys` does not say
/// which node it belongs to (a possible CPU that is not present yet: once the kernel adds
/// it, the next lookup finds its node).
///
/// A CPU that is offline keeps its node. Nodes are read from `/sys` once per CPU and then
/// cached; a CPU that is hot-removed and added again in another node is not followed.
///
/// ```
/// let here = thiscpu::getcpu();
/// assert_eq!(thiscpu::topology::node_of_cpu(here.cpu), Some(here.node));
/// ```
pub fn node_of_cpu(cpu: u32) -> Option<u32> {
    let table = node_table();
    let slot = table.nodes.get(cpu as usize)?;
    let node = slot.load(Ordering::Relaxed);
    if node != UNKNOWN_NODE {
        return Some(node);
    }
    let node = (0..=table.last_node).find(|&node| cpu_linked_to_node(cpu, node))?;
    slot.store(node, Ordering::Relaxed);
    Some(node)
}

/// Reads the tables that later lookups need, so that they never allocate afterwards
/// (lookups may then run in signal handlers).
pub(crate) fn prepare() {
    let _ = possible_cpus();
    let _ = node_table();
}

/// Writes increasing CPU ids in the kernel's cpulist format, ranges folded: `0-3,8`.
pub(crate) fn write_cpu_list(
    f: &mut impl core::fmt::Write,
    cpus: impl Iterator<Item = u32>,
) -> core::fmt::Result {
    let mut cpus = cpus.peekable();
    let mut first = true;
    while let Some(start) = cpus.next() {
        let mut end = start;
        while cpus.peek() == Some(&(end + 1)) {
            end += 1;
            cpus.next();
        }
        if !first {
            f.write_str(",")?;
        }
        first = false;
        if start == end {
            write!(f, "{start}")?;
        } else {
            write!(f, "{start}-{end}")?;
        }
    }
    Ok(())
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

    /// A `/sys` tree in a fresh temporary directory, removed on drop.
    struct FakeSys(std::path::PathBuf);

    impl FakeSys {
        fn new(name: &str) -> Self {
            let root = std::env::temp_dir()
                .join(format!("thiscpu-fake-sys-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(root.join("devices/system/cpu")).unwrap();
            FakeSys(root)
        }

        fn node(&self, node: u32, cpulist: &str) -> &Self {
            let dir = self.0.join(format!("devices/system/node/node{node}"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("cpulist"), cpulist).unwrap();
            self
        }

        fn cpu_link(&self, cpu: u32, node: u32) -> &Self {
            let dir = self
                .0
                .join(format!("devices/system/cpu/cpu{cpu}/node{node}"));
            std::fs::create_dir_all(dir).unwrap();
            self
        }

        fn table(&self, possible: usize) -> Vec<u32> {
            let table = read_node_table(&self.0, possible);
            table
                .nodes
                .iter()
                .map(|n| n.load(Ordering::Relaxed))
                .collect()
        }
    }

    impl Drop for FakeSys {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn an_offline_cpu_keeps_the_node_its_link_names() {
        // CPU 3 of node 1 is offline: node1/cpulist no longer lists it, its link remains.
        let sys = FakeSys::new("offline");
        sys.node(0, "0-1\n").node(1, "2\n");
        for (cpu, node) in [(0, 0), (1, 0), (2, 1), (3, 1)] {
            sys.cpu_link(cpu, node);
        }
        assert_eq!(sys.table(4), vec![0, 0, 1, 1]);
    }

    #[test]
    fn cpulists_answer_where_links_are_missing_and_nothing_else_is_guessed() {
        let sys = FakeSys::new("nolinks");
        sys.node(0, "0,2\n").node(1, "1\n");
        // CPU 3 is possible but neither listed nor linked: not present.
        assert_eq!(sys.table(4), vec![0, 1, 0, UNKNOWN_NODE]);
        assert_eq!(read_node_table(&sys.0, 4).last_node, 1);
    }

    #[test]
    fn without_numa_in_sys_every_cpu_is_on_node_0() {
        let sys = FakeSys::new("nonuma");
        assert_eq!(sys.table(3), vec![0, 0, 0]);
    }

    #[test]
    fn the_signal_safe_link_check_agrees_with_the_directory() {
        for cpu in 0..possible_cpus() as u32 {
            let linked = (0..64).find(|&node| cpu_linked_to_node(cpu, node));
            let listed = linked_node(Path::new("/sys"), cpu as usize);
            if listed.is_none_or(|node| node < 64) {
                assert_eq!(linked, listed, "CPU {cpu}");
            }
        }
        assert!(!cpu_linked_to_node(u32::MAX, u32::MAX));
    }

    #[test]
    fn possible_covers_online() {
        let possible = possible_cpus();
        assert!(online_cpus().iter().all(|&cpu| (cpu as usize) < possible));
    }
}
