//! The `/sys` topology as thiscpu reads it, against `/sys` read by the test.

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
