//! `thiscpu info`: the machine, who registered rseq, which sources can say "which CPU", which
//! one answers, the CPUs and their nodes, and where the calling thread runs now.

use crate::error::Result;
use crate::machine::{self, Machine, format_cpu_list};
use crate::report::output::{Output, SCHEMA_VERSION};
use serde::Serialize;
use thiscpu::{CpuSource, Registrar, RseqMode, Source, Unavailable, topology};

/// Everything `info --json` prints. Each fact appears once: the machine's hardware and
/// software under `machine`, rseq under `rseq`, the CPUs under `cpus`; what answers "which
/// CPU" under `chosen` and `fallback`, each with its id and its display name.
#[derive(Debug, Serialize)]
pub struct Info {
    /// The version of this document's shape.
    pub schema_version: u32,
    /// The machine: CPU model, architecture, kernel, glibc.
    pub machine: MachineInfo,
    /// rseq in detail.
    pub rseq: RseqDetail,
    /// Every way to ask "which CPU am I on", and whether it works here.
    pub sources: Vec<SourceState>,
    /// What answers `current_cpu()` in this thread.
    pub chosen: Named<CpuSource>,
    /// What answers where rseq cannot.
    pub fallback: Named<CpuSource>,
    /// The CPUs.
    pub cpus: Cpus,
    /// Where the calling thread runs now.
    pub now: Now,
    /// How `thiscpu::RwLock` and `EpochCell` made here count their readers.
    pub read_mostly: ReadMostly,
}

/// The mode a new `thiscpu::RwLock` (and `EpochCell`) takes in this process.
#[derive(Debug, Serialize)]
pub struct ReadMostly {
    /// How readers count: `rseq` (restartable sequences, writers fence with `membarrier`) or
    /// `atomic` (`SeqCst` atomic adds and fences).
    pub readers: &'static str,
    /// Bytes of per-CPU reader counts per lock.
    pub counts_bytes: usize,
}

/// The machine, without the facts `info` gives in their own sections.
#[derive(Debug, Serialize)]
pub struct MachineInfo {
    /// `model name` from `/proc/cpuinfo`.
    pub cpu_model: String,
    /// `x86_64`, `aarch64`, `riscv64`.
    pub arch: String,
    /// The kernel release.
    pub kernel: String,
    /// glibc's version, `null` with other C libraries.
    pub glibc: Option<String>,
}

/// A machine id (`rseq_glibc`, as the library's serde names it) beside the name people read
/// (`rseq (glibc)`).
#[derive(Debug, Serialize)]
pub struct Named<T> {
    /// The stable id, for scripts.
    pub id: T,
    /// The display name.
    pub name: String,
}

impl Named<CpuSource> {
    fn of(source: CpuSource) -> Self {
        Named {
            id: source,
            name: source.name().to_owned(),
        }
    }
}

/// rseq as the library found it, with glibc's and the kernel's numbers.
#[derive(Debug, Serialize)]
pub struct RseqDetail {
    /// `"glibc"`, `"thiscpu"` or `"none"`.
    pub registered_by: String,
    /// Why rseq is not used, when it is not.
    pub unavailable: Option<Named<Unavailable>>,
    /// glibc's `__rseq_size`.
    pub glibc_rseq_size: Option<u32>,
    /// glibc's `__rseq_offset`.
    pub glibc_rseq_offset: Option<isize>,
    /// The kernel's `AT_RSEQ_FEATURE_SIZE`.
    pub kernel_feature_size: u32,
    /// The kernel's `AT_RSEQ_ALIGN`.
    pub kernel_align: u32,
    /// The length the areas thiscpu reads are registered with (0 without rseq).
    pub registered_size: u32,
    /// The kernel's mode for those registrations: `"legacy"` or `"optimized"`; `null` without
    /// rseq.
    pub mode: Option<&'static str>,
    /// The length of an optimized-mode registration of thiscpu's own area on this kernel;
    /// `null` where the kernel offers only legacy mode.
    pub optimized_size: Option<u32>,
    /// Why the registration is legacy on a kernel that offers optimized mode, and what changes
    /// that; `null` otherwise.
    pub mode_advice: Option<String>,
    /// Bytes of the area the kernel keeps current.
    pub usable_size: u32,
    /// Whether `node_id` is usable.
    pub node_id: bool,
    /// Whether `mm_cid` is usable.
    pub mm_cid: bool,
}

/// One source and whether it works here.
#[derive(Debug, Serialize)]
pub struct SourceState {
    /// `rseq`, `rdpid`, `rdtscp`, `vdso`, `syscall`.
    #[serde(rename = "id")]
    pub name: &'static str,
    /// Whether it answers on this machine.
    pub available: bool,
    /// Why not, when it does not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The machine's CPUs.
#[derive(Debug, Serialize)]
pub struct Cpus {
    /// Number of possible CPUs.
    pub possible: usize,
    /// The online CPUs.
    pub online: Vec<u32>,
    /// The NUMA node of each possible CPU, indexed by CPU.
    pub node_of_cpu: Vec<Option<u32>>,
}

/// Where the calling thread runs.
#[derive(Debug, Serialize)]
pub struct Now {
    /// `current_cpu()`.
    pub cpu: u32,
    /// `getcpu().node`.
    pub node: u32,
    /// `mm_cid()`.
    pub mm_cid: Option<u32>,
}

/// Gathers everything.
pub fn gather() -> Info {
    let source = thiscpu::source();
    let sources = source_states(&source);
    let here = thiscpu::getcpu();
    let machine = Machine::describe();
    Info {
        schema_version: SCHEMA_VERSION,
        machine: MachineInfo {
            cpu_model: machine.cpu_model,
            arch: machine.arch,
            kernel: machine.kernel,
            glibc: machine.glibc,
        },
        rseq: rseq_detail(&source),
        sources,
        chosen: Named::of(source.this_thread),
        fallback: Named::of(source.fallback),
        cpus: Cpus {
            possible: topology::possible_cpus(),
            online: topology::online_cpus(),
            node_of_cpu: (0..topology::possible_cpus() as u32)
                .map(topology::node_of_cpu)
                .collect(),
        },
        now: Now {
            cpu: thiscpu::current_cpu(),
            node: here.node,
            mm_cid: thiscpu::mm_cid(),
        },
        read_mostly: {
            let lock = thiscpu::RwLock::new(());
            ReadMostly {
                readers: if lock.uses_rseq() { "rseq" } else { "atomic" },
                counts_bytes: lock.counts_bytes(),
            }
        },
    }
}

/// Each way of asking for the CPU, whether it works here, and why not.
fn source_states(source: &Source) -> Vec<SourceState> {
    let rseq_in_use = matches!(
        source.this_thread,
        CpuSource::RseqGlibc | CpuSource::RseqThiscpu
    );
    let vdso = thiscpu::via::vdso().is_some();
    vec![
        SourceState {
            name: "rseq",
            available: rseq_in_use,
            reason: (!rseq_in_use).then(|| {
                source
                    .unavailable
                    .map_or("not registered in this thread".to_owned(), |why| {
                        why.to_string()
                    })
            }),
        },
        instruction_state("rdpid", thiscpu::via::rdpid().is_some()),
        instruction_state("rdtscp", thiscpu::via::rdtscp().is_some()),
        SourceState {
            name: "vdso",
            available: vdso,
            reason: (!vdso).then(|| "the vDSO has no getcpu".to_owned()),
        },
        SourceState {
            name: "syscall",
            available: true,
            reason: None,
        },
    ]
}

/// An x86_64 instruction as a source: an instruction the CPU lists can still fail the check
/// against the kernel's answer.
fn instruction_state(name: &'static str, works: bool) -> SourceState {
    SourceState {
        name,
        available: works,
        reason: (!works).then(|| {
            if !cfg!(target_arch = "x86_64") {
                "an x86_64 instruction".to_owned()
            } else if !machine::cpu_has_flag(name) {
                format!("CPU lacks {}", name.to_uppercase())
            } else {
                "listed by the CPU, but unusable here (its answer disagrees with the kernel's, \
                 or an emulator hides it)"
                    .to_owned()
            }
        }),
    }
}

/// rseq as this process registered it.
fn rseq_detail(source: &Source) -> RseqDetail {
    RseqDetail {
        registered_by: source.registrar.name().to_owned(),
        unavailable: source.unavailable.map(|why| Named {
            id: why,
            name: why.to_string(),
        }),
        glibc_rseq_size: source.glibc_rseq_size,
        glibc_rseq_offset: source.glibc_rseq_offset,
        kernel_feature_size: source.kernel_feature_size,
        kernel_align: source.kernel_align,
        registered_size: source.registered_size,
        mode: source.mode.map(RseqMode::name),
        optimized_size: source.optimized_size,
        mode_advice: mode_advice(source),
        usable_size: source.usable_size,
        node_id: source.node_id,
        mm_cid: source.mm_cid,
    }
}

/// Why a registration is legacy on a kernel that offers the optimized mode, and what changes
/// that: `None` when the registration is optimized, or legacy is all the kernel offers.
pub fn mode_advice(source: &Source) -> Option<String> {
    let optimized = source.optimized_size?;
    if source.mode != Some(RseqMode::Legacy) {
        return None;
    }
    let registered = source.registered_size;
    Some(match source.registrar {
        Registrar::Glibc => format!(
            "glibc registered {registered}-byte areas, which the kernel runs in legacy mode \
             although it offers the optimized mode ({optimized} bytes); with \
             GLIBC_TUNABLES=glibc.pthread.rseq=0 glibc keeps out and thiscpu registers its own, \
             optimized, areas"
        ),
        _ => format!(
            "THISCPU_RSEQ_AREA=legacy asked for {registered}-byte areas; without it thiscpu \
             registers {optimized} bytes, in optimized mode"
        ),
    })
}

/// What glibc's `__rseq_size` and `__rseq_offset` say, and why the size may differ from the
/// registration's: its meaning changed between glibc releases.
fn glibc_symbols(r: &RseqDetail) -> String {
    let (Some(size), Some(offset)) = (r.glibc_rseq_size, r.glibc_rseq_offset) else {
        return "glibc exports no __rseq_size/__rseq_offset (older than 2.35, or not glibc)"
            .to_owned();
    };
    let meaning = match size {
        0 => "glibc did not register".to_owned(),
        20 => "the original ABI's 20 bytes, which glibc 2.40 and its stable backports report \
               whatever they register; the kernel fills the fields past them all the same"
            .to_owned(),
        32 => "glibc's registration, as glibc 2.35 to 2.39 report it".to_owned(),
        _ => "the kernel's feature size, as glibc 2.41 and later report it".to_owned(),
    };
    format!("glibc __rseq_size {size} ({meaning}) · __rseq_offset {offset}")
}

/// `optimized (thiscpu's own 64-byte registration)`, or `legacy, the kernel's only mode`.
fn mode_line(r: &RseqDetail) -> Option<String> {
    let mode = r.mode?;
    let whose = if r.registered_by == "glibc" {
        "glibc's"
    } else {
        "thiscpu's own"
    };
    let mut line = format!("{mode} ({whose} {}-byte registration)", r.registered_size);
    match r.optimized_size {
        Some(size) if mode == "optimized" => {
            line.push_str(&format!(" · kernel alignment {}", r.kernel_align));
            if size != r.registered_size {
                line.push_str(&format!(" · thiscpu's own would be {size} bytes"));
            }
        }
        Some(_) => {}
        None if r.kernel_feature_size <= 32 => {
            line = format!(
                "{mode}, the only mode this kernel has ({whose} {}-byte registration; the \
                 optimized mode comes with a feature size above 32, Linux 7.1 and later)",
                r.registered_size
            );
        }
        None => line.push_str(&format!(
            " · the kernel's optimized mode (feature size {}, alignment {}) needs more than \
             thiscpu's own 64-byte area",
            r.kernel_feature_size, r.kernel_align
        )),
    }
    Some(line)
}

/// Runs `thiscpu info`: text, or JSON to a file (then also the text) or to standard output.
pub fn run(json: Option<&std::path::Path>) -> Result<()> {
    let output = json.map(Output::open).transpose()?;
    let info = gather();
    if !output.as_ref().is_some_and(Output::is_stdout) {
        println!("{}", render(&info));
    }
    if let Some(output) = output {
        output.commit_json(&info)?;
    }
    Ok(())
}

fn yes_no(flag: bool) -> &'static str {
    if flag { "yes" } else { "no" }
}

/// The human-readable form.
pub fn render(info: &Info) -> String {
    let m = &info.machine;
    let mut lines: Vec<(&str, String)> = Vec::new();
    lines.push((
        "machine",
        format!(
            "{} · {} · Linux {} · {}",
            m.cpu_model,
            m.arch,
            m.kernel,
            m.glibc
                .as_ref()
                .map_or("no glibc".to_owned(), |v| format!("glibc {v}"))
        ),
    ));
    push_rseq_lines(&mut lines, &info.rseq);
    push_source_lines(&mut lines, info);
    lines.push((
        "RwLock",
        format!(
            "readers count {} · {} bytes of counts per RwLock, twice that per EpochCell",
            if info.read_mostly.readers == "rseq" {
                "with rseq, writers fence with membarrier"
            } else {
                "with SeqCst atomics (no rseq or no membarrier)"
            },
            info.read_mostly.counts_bytes
        ),
    ));
    lines.push((
        "CPUs",
        format!(
            "possible {} · online {} · {}",
            info.cpus.possible,
            format_cpu_list(&info.cpus.online),
            nodes(&info.cpus.node_of_cpu)
        ),
    ));
    lines.push((
        "now",
        format!(
            "cpu {} · node {} · mm_cid {}",
            info.now.cpu,
            info.now.node,
            info.now
                .mm_cid
                .map_or("unavailable".to_owned(), |c| c.to_string())
        ),
    ));
    labelled_table(&lines)
}

/// The registration, glibc's symbols and the mode.
fn push_rseq_lines(lines: &mut Vec<(&str, String)>, r: &RseqDetail) {
    let registrar = match &r.unavailable {
        Some(why) => format!("not in use: {}", why.name),
        None => format!(
            "registered by {}: a {}-byte area per thread, of which the kernel fills {} (its \
             feature size)",
            r.registered_by,
            r.registered_size,
            r.kernel_feature_size.min(r.registered_size)
        ),
    };
    lines.push(("rseq", registrar));
    lines.push((
        "",
        format!(
            "usable {} bytes · node_id {} · mm_cid {}",
            r.usable_size,
            yes_no(r.node_id),
            yes_no(r.mm_cid)
        ),
    ));
    lines.push(("", glibc_symbols(r)));
    if let Some(line) = mode_line(r) {
        lines.push(("mode", line));
    }
    if let Some(advice) = &r.mode_advice {
        lines.push(("", advice.clone()));
    }
}

/// Every source with a tick or a cross, why the crossed ones fail, and which one answers.
fn push_source_lines(lines: &mut Vec<(&str, String)>, info: &Info) {
    let chosen_kind = info.chosen.name.split(' ').next().unwrap_or_default();
    let sources: Vec<String> = info
        .sources
        .iter()
        .map(|s| {
            let mut text = format!("{} {}", s.name, if s.available { "✓" } else { "✗" });
            if s.name == chosen_kind {
                text.push_str(" (answers)");
            } else if s.name == info.fallback.name {
                text.push_str(" (fallback)");
            }
            text
        })
        .collect();
    lines.push(("sources", sources.join(" · ")));
    for s in info.sources.iter().filter(|s| !s.available) {
        if let Some(reason) = &s.reason {
            lines.push(("", format!("{}: {reason}", s.name)));
        }
    }
    lines.push((
        "answers",
        format!(
            "current_cpu() from {}; without rseq: {}",
            info.chosen.name, info.fallback.name
        ),
    ));
}

/// Each text wrapped to the terminal width, its continuation lines under its first.
fn labelled_table(lines: &[(&str, String)]) -> String {
    let mut table = comfy_table::Table::new();
    table
        .load_preset(comfy_table::presets::NOTHING)
        .set_content_arrangement(comfy_table::ContentArrangement::Dynamic)
        .set_width(crate::report::table::WIDTH);
    for (label, text) in lines {
        table.add_row(vec![format!("{label:<8}"), text.clone()]);
    }
    for (index, padding) in [(0, (0, 0)), (1, (1, 0))] {
        if let Some(column) = table.column_mut(index) {
            column.set_padding(padding);
        }
    }
    crate::report::table::render(&table)
}

/// `node 0: CPUs 0-1 · node 1: CPUs 2-3`.
fn nodes(node_of_cpu: &[Option<u32>]) -> String {
    let mut nodes: Vec<u32> = node_of_cpu.iter().flatten().copied().collect();
    nodes.sort_unstable();
    nodes.dedup();
    nodes
        .iter()
        .map(|&node| {
            let cpus: Vec<u32> = node_of_cpu
                .iter()
                .enumerate()
                .filter(|(_, n)| **n == Some(node))
                .map(|(cpu, _)| cpu as u32)
                .collect();
            format!("node {node}: CPUs {}", format_cpu_list(&cpus))
        })
        .collect::<Vec<_>>()
        .join(" · ")
}
