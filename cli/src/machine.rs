//! The machine a run happened on, as every report describes it: CPU model, kernel, glibc,
//! CPUs, and the state of rseq.

use serde::{Deserialize, Serialize};
use thiscpu::Source;

/// The machine description every benchmark report carries (`info --json` gives the same
/// facts in its own sections).
///
/// The first six fields are the schema's required ones; the rest are extras that readers
/// may ignore (and that older reports may lack).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Machine {
    /// `model name` from `/proc/cpuinfo` (or the closest line other architectures have).
    pub cpu_model: String,
    /// The kernel release, as `uname -r` prints it.
    pub kernel: String,
    /// glibc's version (`gnu_get_libc_version`), `null` with other C libraries.
    pub glibc: Option<String>,
    /// Number of possible CPUs (one more than the largest CPU id).
    pub cpus_possible: usize,
    /// Number of CPUs online.
    pub cpus_online: usize,
    /// The state of rseq in the process that wrote the report.
    pub rseq: RseqState,
    /// The machine architecture (`x86_64`, `aarch64`, `riscv64`).
    #[serde(default)]
    pub arch: String,
    /// The online CPUs in the kernel's list format (`0-3,8`).
    #[serde(default)]
    pub online_list: String,
    /// What answers `current_cpu()` in the main thread.
    #[serde(default)]
    pub cpu_source: String,
    /// What answers where rseq cannot.
    #[serde(default)]
    pub fallback: String,
    /// The processor's identity where the model name hides it (VMs often show one name for
    /// several generations): x86's vendor, family, model and stepping, arm64's implementer and
    /// part (absent where `/proc/cpuinfo` gives neither, and in older reports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_id: Option<String>,
}

/// rseq as the library found it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RseqState {
    /// `"glibc"`, `"thiscpu"` or `"none"`.
    pub registered_by: String,
    /// The kernel's `AT_RSEQ_FEATURE_SIZE` (0 before Linux 6.3).
    pub feature_size: u32,
    /// Whether the kernel keeps `node_id` current for this registration.
    pub node_id: bool,
    /// Whether the kernel keeps `mm_cid` current for this registration.
    pub mm_cid: bool,
    /// Why rseq is not used, when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
    /// The kernel's mode for the registration: `"legacy"` or `"optimized"` (absent without
    /// rseq, and in reports written before the mode was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
}

impl Machine {
    /// Describes this machine and this process's rseq state.
    pub fn describe() -> Machine {
        let source = thiscpu::source();
        let online = thiscpu::topology::online_cpus();
        Machine {
            cpu_model: cpu_model(),
            kernel: kernel_release(),
            glibc: glibc_version(),
            cpus_possible: thiscpu::topology::possible_cpus(),
            cpus_online: online.len(),
            rseq: RseqState::of(&source),
            arch: std::env::consts::ARCH.to_owned(),
            online_list: format_cpu_list(&online),
            cpu_source: source.this_thread.name().to_owned(),
            fallback: source.fallback.name().to_owned(),
            cpu_id: cpu_id(),
        }
    }

    /// One line: `AMD EPYC · Linux 6.1.0 · glibc 2.36 · 2 CPUs`.
    pub fn summary(&self) -> String {
        let glibc = match &self.glibc {
            Some(version) => format!("glibc {version}"),
            None => "no glibc".to_owned(),
        };
        let model = match &self.cpu_id {
            Some(id) => format!("{} ({id})", self.cpu_model),
            None => self.cpu_model.clone(),
        };
        format!(
            "{} · Linux {} · {} · {} CPU{} online",
            model,
            self.kernel,
            glibc,
            self.cpus_online,
            if self.cpus_online == 1 { "" } else { "s" }
        )
    }
}

impl RseqState {
    fn of(source: &Source) -> RseqState {
        RseqState {
            registered_by: source.registrar.name().to_owned(),
            feature_size: source.kernel_feature_size,
            node_id: source.node_id,
            mm_cid: source.mm_cid,
            unavailable: source.unavailable.map(|why| why.to_string()),
            mode: source.mode.map(|mode| mode.name().to_owned()),
        }
    }

    /// One line: `rseq registered by glibc, kernel feature size 28, node_id and mm_cid kept`.
    pub fn summary(&self) -> String {
        if let Some(why) = &self.unavailable {
            return format!("rseq not in use: {why}");
        }
        let fields = match (self.node_id, self.mm_cid) {
            (true, true) => "node_id and mm_cid usable",
            (true, false) => "node_id usable, no mm_cid",
            (false, true) => "mm_cid usable, no node_id",
            (false, false) => "no node_id or mm_cid (Linux < 6.3)",
        };
        let mode = self
            .mode
            .as_ref()
            .map_or(String::new(), |mode| format!(" ({mode} mode)"));
        format!(
            "rseq registered by {}{mode}, kernel feature size {}, {}",
            self.registered_by, self.feature_size, fields
        )
    }
}

/// The CPU's model name, or the closest thing `/proc/cpuinfo` offers on this architecture.
fn cpu_model() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    // riscv64 names a model only where the device tree gives one (`uarch`); its ISA string is
    // the closest thing otherwise.
    for key in [
        "model name",
        "Model",
        "Hardware",
        "cpu model",
        "cpu",
        "uarch",
        "isa",
    ] {
        if let Some(value) = cpuinfo_value(&cpuinfo, key) {
            return value.to_owned();
        }
    }
    format!("unknown {} CPU", std::env::consts::ARCH)
}

/// The processor's numbers from `/proc/cpuinfo`: `AuthenticAMD family 25 model 17 stepping 1`
/// on x86, `implementer 0x41 part 0xd0c` on arm64; `None` where neither is listed.
fn cpu_id() -> Option<String> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    cpu_id_of(&cpuinfo)
}

fn cpu_id_of(cpuinfo: &str) -> Option<String> {
    let value = |key| cpuinfo_value(cpuinfo, key);
    if let (Some(family), Some(model)) = (value("cpu family"), value("model")) {
        let vendor = value("vendor_id").map_or(String::new(), |vendor| format!("{vendor} "));
        let stepping = value("stepping").map_or(String::new(), |s| format!(" stepping {s}"));
        return Some(format!("{vendor}family {family} model {model}{stepping}"));
    }
    let (implementer, part) = (value("CPU implementer")?, value("CPU part")?);
    Some(format!("implementer {implementer} part {part}"))
}

/// The first value of `key` in `/proc/cpuinfo`'s `key : value` lines.
fn cpuinfo_value<'a>(cpuinfo: &'a str, key: &str) -> Option<&'a str> {
    cpuinfo.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        (name.trim() == key && !value.trim().is_empty()).then(|| value.trim())
    })
}

/// Whether the CPU lists `flag` among its features in `/proc/cpuinfo` (x86 `flags`, arm64
/// `Features`).
pub fn cpu_has_flag(flag: &str) -> bool {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    ["flags", "Features"].iter().any(|key| {
        cpuinfo_value(&cpuinfo, key)
            .is_some_and(|flags| flags.split_whitespace().any(|f| f == flag))
    })
}

fn kernel_release() -> String {
    // SAFETY: `utsname` is plain old data, valid when zeroed.
    let mut name: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `uname` fills the struct we own; it only fails for an invalid pointer.
    if unsafe { libc::uname(&mut name) } != 0 {
        return "unknown".to_owned();
    }
    // SAFETY: the kernel NUL-terminates `release` within its fixed size.
    let release = unsafe { std::ffi::CStr::from_ptr(name.release.as_ptr()) };
    release.to_string_lossy().into_owned()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn glibc_version() -> Option<String> {
    // SAFETY: `gnu_get_libc_version` has no precondition and returns a static string.
    let version = unsafe { std::ffi::CStr::from_ptr(libc::gnu_get_libc_version()) };
    Some(version.to_string_lossy().into_owned())
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn glibc_version() -> Option<String> {
    None
}

/// Formats CPU ids the way the kernel writes CPU lists: `0-3,8,10-11`.
pub fn format_cpu_list(cpus: &[u32]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let first = sorted[i];
        let mut last = first;
        while i + 1 < sorted.len() && sorted[i + 1] == last + 1 {
            i += 1;
            last = sorted[i];
        }
        parts.push(if first == last {
            first.to_string()
        } else {
            format!("{first}-{last}")
        });
        i += 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_processor_is_named_by_its_numbers() {
        let x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n\
                   model name\t: AMD EPYC\nstepping\t: 1\n";
        assert_eq!(
            cpu_id_of(x86).as_deref(),
            Some("AuthenticAMD family 25 model 17 stepping 1")
        );
        let arm64 = "processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n\
                     CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd0c\n";
        assert_eq!(
            cpu_id_of(arm64).as_deref(),
            Some("implementer 0x41 part 0xd0c")
        );
        assert_eq!(cpu_id_of("processor\t: 0\nisa\t: rv64imafdc\n"), None);
    }

    #[test]
    fn cpu_lists_round_trip_through_the_library_parser() {
        for list in ["0", "0-1", "0-3,8,10-11", "1,3,5", ""] {
            let cpus = thiscpu::topology::parse_cpu_list(list).unwrap();
            assert_eq!(format_cpu_list(&cpus), list);
        }
    }

    #[test]
    fn cpuinfo_values_are_trimmed() {
        let text = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu rdpid\n";
        assert_eq!(cpuinfo_value(text, "model name"), Some("AMD EPYC"));
        assert_eq!(cpuinfo_value(text, "Model"), None);
    }
}
