//! Binding the ranks a launcher starts on one host to cores, as `mpirun`
//! does by default for two ranks (`--bind-to core`): which CPUs each rank
//! gets. Pure but for [`allowed_cpus`]; sysfs is read through a caller's
//! function, so tests replay hand-written trees.

use super::model::CpuSet;

/// The CPUs the calling thread may run on (`Cpus_allowed_list` of
/// `/proc/thread-self/status`, so that ranks run as threads bound one by one
/// are seen as bound; `/proc/self/status` on kernels before 3.17); `None`
/// where neither can be read.
pub fn allowed_cpus() -> Option<CpuSet> {
    let status = std::fs::read_to_string("/proc/thread-self/status")
        .or_else(|_| std::fs::read_to_string("/proc/self/status"))
        .ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .and_then(CpuSet::from_list)
}

/// The cores among the `allowed` CPUs, each as the allowed CPUs of that core
/// (its hyperthreads), ordered by their first CPU. `read` returns a file
/// under the sysfs root, e.g. `sys/devices/system/cpu/cpu3/topology/core_cpus_list`
/// (`thread_siblings_list` on kernels before 5.3); a CPU without either is
/// a core of its own.
pub fn cores(read: impl Fn(&str) -> Option<String>, allowed: &CpuSet) -> Vec<CpuSet> {
    let mut out: Vec<CpuSet> = Vec::new();
    for &cpu in &allowed.0 {
        if out.iter().any(|c| c.0.contains(&cpu)) {
            continue;
        }
        let dir = format!("sys/devices/system/cpu/cpu{cpu}/topology");
        let siblings = read(&format!("{dir}/core_cpus_list"))
            .or_else(|| read(&format!("{dir}/thread_siblings_list")))
            .and_then(|l| CpuSet::from_list(&l))
            .map(|s| CpuSet(s.0.into_iter().filter(|c| allowed.0.contains(c)).collect()))
            .filter(|s| s.0.contains(&cpu))
            .unwrap_or_else(|| CpuSet(vec![cpu]));
        out.push(siblings);
    }
    out.sort_by_key(|c| c.0.first().copied());
    out
}

/// One core for each of `np` ranks, in order (rank `r` gets core `r`), as
/// `mpirun` maps two ranks by core: neighbouring cores, which on most hosts
/// share a last-level cache, where shared-memory transfers are cheapest.
/// `None` when there are more ranks than cores: binding would stack ranks on
/// cores, so placement is left to the scheduler (as `mpirun
/// --oversubscribe` leaves it).
pub fn by_core(np: usize, cores: &[CpuSet]) -> Option<Vec<CpuSet>> {
    if np == 0 || np > cores.len() {
        return None;
    }
    Some(cores[..np].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn tree(files: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = files
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |p| m.get(p).cloned()
    }

    fn set(l: &str) -> CpuSet {
        CpuSet::from_list(l).unwrap()
    }

    /// Four cores with two hyperthreads each, numbered as Linux does on most
    /// x86 hosts: CPU c and c + 4 share a core.
    fn ht_host() -> impl Fn(&str) -> Option<String> {
        let lists: Vec<(String, String)> = (0..8)
            .map(|c| {
                (
                    format!("sys/devices/system/cpu/cpu{c}/topology/core_cpus_list"),
                    format!("{},{}", c % 4, c % 4 + 4),
                )
            })
            .collect();
        let refs: Vec<(&str, &str)> = lists
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        tree(&refs)
    }

    #[test]
    fn hyperthreads_of_a_core_stay_together() {
        let c = cores(ht_host(), &set("0-7"));
        assert_eq!(c, vec![set("0,4"), set("1,5"), set("2,6"), set("3,7")]);
        // Two ranks get two different cores, not two threads of one.
        assert_eq!(by_core(2, &c), Some(vec![set("0,4"), set("1,5")]));
        assert_eq!(by_core(4, &c).unwrap().len(), 4);
        assert_eq!(by_core(5, &c), None);
    }

    #[test]
    fn only_allowed_cpus_count() {
        // A cgroup or taskset left this process CPUs 1, 2 and 5.
        let c = cores(ht_host(), &set("1-2,5"));
        assert_eq!(c, vec![set("1,5"), set("2")]);
        assert_eq!(by_core(2, &c), Some(vec![set("1,5"), set("2")]));
        assert_eq!(by_core(3, &c), None);
    }

    #[test]
    fn older_kernels_and_missing_files() {
        let old = tree(&[
            (
                "sys/devices/system/cpu/cpu0/topology/thread_siblings_list",
                "0-1",
            ),
            (
                "sys/devices/system/cpu/cpu1/topology/thread_siblings_list",
                "0-1",
            ),
        ]);
        assert_eq!(
            cores(old, &set("0-3")),
            vec![set("0-1"), set("2"), set("3")]
        );
        // No topology at all (a container without sysfs): one core per CPU.
        let none = tree(&[]);
        assert_eq!(
            by_core(2, &cores(none, &set("0-1"))),
            Some(vec![set("0"), set("1")])
        );
        assert_eq!(by_core(0, &[set("0")]), None);
    }
}
