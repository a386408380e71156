//! Topology fusion at communicator creation: every host's model, the
//! transports per rank pair and the ring, from `braid_core::topo`'s planner.
//!
//! 1. Each rank loads its host's topology: sysfs detection under `/` with
//!    GPUs and NVLinks from NVML (the CUDA driver where NVML is missing),
//!    merged with the file named by `BRAID_TOPO_FILE` when set, as NCCL
//!    merges `NCCL_TOPO_FILE` (an unreadable or malformed file is an error:
//!    the user asked for it; a host whose sysfs cannot be read gets a
//!    one-NUMA-node model and a warning).
//! 2. One bootstrap round carries, per rank, the transports its table holds
//!    and the NUMA node it is bound to; the first rank of each host adds its
//!    host's model (NCCL topology XML), so the round's size grows with hosts,
//!    not ranks.
//! 3. Every rank fuses the same inputs into a [`Cluster`] and runs the pure
//!    planner, so all ranks reach the same transports and ring. Transports
//!    that some rank lacks (not built, unavailable on its host) are removed
//!    for everybody; a forced transport that some rank lacks is an error.
//!
//! Every decision of this rank is logged at INFO (`BRAID_DEBUG=INFO`).

use std::collections::BTreeSet;
use std::path::Path;

use braid_core::topo::{
    self, xml, Cluster, Cpu, CpuSet, Plan, RankPlace, System, Topology, TransportKind,
    TransportPolicy,
};
use braid_core::transport::PeerDesc;
use tracing::{info, warn};

use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::transports::TransportTable;
use braid_core::transport::Transport;

/// What the planner decided for this rank.
#[derive(Debug)]
pub(crate) struct Placement {
    /// Per peer: the transport chosen (`None` for this rank).
    pub choice: Vec<Option<TransportKind>>,
    /// The ring order (channel 0).
    pub ring: Vec<u32>,
    /// The whole plan, for inspection.
    pub plan: Plan,
    /// The fused topology the plan was made for (ranks without GPUs): a
    /// device communicator places its GPUs in it and plans again.
    pub cluster: Cluster,
}

/// This host's model and where it came from (`env`: the communicator's
/// snapshot of the environment, for `BRAID_TOPO_FILE` and the like).
fn local_system(env: &dyn Fn(&str) -> Option<String>) -> Result<(System, String)> {
    match topo::load_host(env, Path::new("/"), &braid_cuda::CudaGpus) {
        Ok((sys, topo::Source::File(f), notes)) => {
            for n in notes {
                info!("braid: topology: {n}");
            }
            Ok((sys, format!("file {f}")))
        }
        Ok((sys, topo::Source::Merged { file, root }, notes)) => {
            for n in notes {
                info!("braid: topology: {n}");
            }
            Ok((sys, format!("file {file} merged with sysfs under {root}")))
        }
        Ok((sys, topo::Source::Detected(root), notes)) => {
            for n in notes {
                info!("braid: topology: {n}");
            }
            Ok((sys, format!("sysfs under {root}")))
        }
        // The user named a file: failing to read it is their error to fix.
        Err(e) if env(topo::TOPO_FILE_ENV).is_some_and(|f| !f.trim().is_empty()) => {
            Err(Error::Topology(e))
        }
        // Out of descriptors: a fallback would describe another machine.
        Err(e @ topo::TopoError::Exhausted { .. }) => Err(Error::Topology(e)),
        Err(e) => {
            warn!(
                "braid: topology detection failed ({e}); assuming one NUMA node, no GPUs, no NICs"
            );
            Ok((fallback_system(), "fallback (detection failed)".into()))
        }
    }
}

/// A host of one NUMA node holding every CPU this process may run on.
fn fallback_system() -> System {
    System {
        name: None,
        cpus: vec![Cpu {
            numaid: 0,
            affinity: topo::bind::allowed_cpus(),
            ..Cpu::default()
        }],
        attrs: Default::default(),
    }
}

/// The NUMA node of `sys` that holds most of `allowed`.
fn numa_of(sys: &System, allowed: Option<&CpuSet>) -> Option<i32> {
    let allowed = allowed?;
    sys.cpus
        .iter()
        .filter_map(|c| {
            let aff = c.affinity.as_ref()?;
            let n = allowed.0.iter().filter(|x| aff.0.contains(x)).count();
            (n > 0).then_some((n, c.numaid))
        })
        .max_by_key(|&(n, numa)| (n, std::cmp::Reverse(numa)))
        .map(|(_, numa)| numa)
}

/// What one rank contributes to the topology round.
#[derive(Debug, PartialEq)]
struct Contribution {
    /// Transports in this rank's table.
    transports: BTreeSet<TransportKind>,
    /// NUMA node the rank is bound to (-1: unknown).
    numa: i32,
    /// The host's model as NCCL XML (first rank of a host only).
    xml: Option<String>,
}

fn encode(c: &Contribution) -> Vec<u8> {
    let mask = c.transports.iter().fold(0u8, |m, t| {
        m | 1 << TransportKind::ALL.iter().position(|x| x == t).unwrap_or(7)
    });
    let mut v = vec![mask];
    v.extend_from_slice(&c.numa.to_le_bytes());
    if let Some(x) = &c.xml {
        v.extend_from_slice(x.as_bytes());
    }
    v
}

fn decode(b: &[u8], from: usize) -> Result<Contribution> {
    let bad = |what: &str| {
        Error::Bootstrap(format!(
            "rank {from} sent a malformed topology description ({what})"
        ))
    };
    let (&mask, rest) = b.split_first().ok_or_else(|| bad("empty"))?;
    let numa = rest
        .get(0..4)
        .and_then(|x| x.try_into().ok())
        .map(i32::from_le_bytes)
        .ok_or_else(|| bad("truncated"))?;
    let text = &rest[4..];
    let xml = if text.is_empty() {
        None
    } else {
        Some(
            std::str::from_utf8(text)
                .map_err(|_| bad("model is not UTF-8"))?
                .to_string(),
        )
    };
    let transports = TransportKind::ALL
        .iter()
        .enumerate()
        .filter(|(i, _)| mask & (1 << i) != 0)
        .map(|(_, t)| *t)
        .collect();
    Ok(Contribution {
        transports,
        numa,
        xml,
    })
}

/// The first rank of each host, hosts in order of their first rank.
fn host_leaders(peers: &[PeerDesc]) -> Vec<usize> {
    let mut seen: Vec<&str> = Vec::new();
    let mut leaders = Vec::new();
    for (r, p) in peers.iter().enumerate() {
        if !seen.contains(&p.host_id.as_str()) {
            seen.push(&p.host_id);
            leaders.push(r);
        }
    }
    leaders
}

/// Fuse every rank's contribution into a cluster and the policy the planner
/// runs under (a pure function: every rank computes the same result).
fn fuse(
    peers: &[PeerDesc],
    contribs: &[Contribution],
    policy: TransportPolicy,
) -> Result<(Cluster, TransportPolicy)> {
    let leaders = host_leaders(peers);
    let mut hosts = Vec::with_capacity(leaders.len());
    for &l in &leaders {
        let text = contribs[l].xml.as_deref().ok_or_else(|| {
            Error::Bootstrap(format!(
                "rank {l}, the first rank of host {}, sent no topology",
                peers[l].host_id
            ))
        })?;
        let sys = xml::from_xml(&format!("topology of rank {l}"), text)?;
        let name = sys.name.clone().unwrap_or_else(|| peers[l].host_id.clone());
        hosts.push(topo::plan::Host {
            name,
            topo: Topology::new(sys),
        });
    }
    let ranks = peers
        .iter()
        .zip(contribs)
        .map(|(p, c)| RankPlace {
            host: leaders
                .iter()
                .position(|&l| peers[l].host_id == p.host_id)
                .unwrap_or(0),
            gpu: None,
            numa: (c.numa >= 0).then_some(c.numa),
        })
        .collect();
    // Only what every rank has may be used.
    let common: BTreeSet<TransportKind> = contribs
        .iter()
        .map(|c| c.transports.clone())
        .reduce(|a, b| a.intersection(&b).copied().collect())
        .unwrap_or_default();
    let mut policy = policy;
    if let Some(f) = policy.forced {
        let lacking: Vec<String> = contribs
            .iter()
            .enumerate()
            .filter(|(_, c)| !c.transports.contains(&f))
            .map(|(r, _)| r.to_string())
            .collect();
        if !lacking.is_empty() {
            return Err(Error::Env(format!(
                "BRAID_TRANSPORT={f} is forced but rank(s) {} cannot use it (not built in, or unavailable on their host; their logs say why); unset BRAID_TRANSPORT or fix those hosts",
                lacking.join(", ")
            )));
        }
    }
    for t in TransportKind::ALL {
        if !common.contains(&t) {
            policy.disabled.insert(t);
        }
    }
    Ok((Cluster { hosts, ranks }, policy))
}

/// A plan this rank cannot carry out (a transport it chose is off here, or
/// cannot connect the pair): a topology error, not one of the launch
/// environment's.
pub(crate) fn planner_inconsistent(msg: String) -> Error {
    Error::Topology(topo::TopoError::Invalid(msg))
}

/// Plan this communicator: one bootstrap round, then the pure planner.
/// `allowed`: the CPUs this rank may run on (its NUMA node is the one
/// holding most of them).
pub(crate) fn place(
    boot: &Bootstrap,
    me: &PeerDesc,
    peers: &[PeerDesc],
    table: &TransportTable,
    policy: &TransportPolicy,
    allowed: Option<&CpuSet>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Placement> {
    let rank = me.rank as usize;
    let leaders = host_leaders(peers);
    let (sys, source) = local_system(env)?;
    let mine = Contribution {
        transports: table.ready().map(|(k, _)| k).collect(),
        numa: numa_of(&sys, allowed).unwrap_or(-1),
        xml: leaders.contains(&rank).then(|| xml::to_xml(&sys)),
    };
    if leaders.contains(&rank) {
        info!(rank, source = %source, "braid: topology of host {}", me.host_id);
    }
    let all = boot.allgather(&encode(&mine))?;
    let contribs: Vec<Contribution> = all
        .iter()
        .enumerate()
        .map(|(r, b)| decode(b, r))
        .collect::<Result<_>>()?;
    let policy = policy.clone();
    let policy_forced = policy.forced;
    let (cluster, policy) = fuse(peers, &contribs, policy)?;
    let plan = topo::plan(&cluster, &policy)?;
    for n in &plan.notes {
        info!(rank, "braid: topology plan: {n}");
    }
    let row = &plan.transports[rank];
    let mut choice = Vec::with_capacity(peers.len());
    for (q, t) in row.iter().enumerate() {
        let Some(t) = t else {
            choice.push(None);
            continue;
        };
        if table.get(*t).is_none() {
            return Err(planner_inconsistent(format!(
                "the planner chose {t} between ranks {rank} and {q} but this rank's {t} is {}",
                table.why_off(*t).unwrap_or_default()
            )));
        }
        let mut t = *t;
        let connects =
            |k: TransportKind| table.get(k).is_some_and(|x| x.can_connect(me, &peers[q]));
        if !connects(t) && policy_forced.is_none() {
            // A network transport whose ends are on different fabrics (IB
            // subnets, IB vs RoCE): the next one in the table that connects
            // them. Every rank sees the same fabrics, so both ends agree.
            if let Some(next) = TransportKind::ALL
                .into_iter()
                .filter(|&k| k > t)
                .find(|&k| connects(k))
            {
                info!(
                    rank,
                    peer = q,
                    "braid: {t} cannot connect ranks {rank} and {q} (different fabrics); using {next}"
                );
                t = next;
            }
        }
        if !connects(t) {
            return Err(planner_inconsistent(format!(
                "the planner chose {t} between ranks {rank} (host {}) and {q} (host {}), but {t} cannot connect them",
                me.host_id, peers[q].host_id
            )));
        }
        info!(
            rank,
            peer = q,
            transport = t.name(),
            "braid: transport selected (topology plan)"
        );
        choice.push(Some(t));
    }
    let ring: Vec<u32> = plan
        .rings
        .first()
        .map(|r| r.order.clone())
        .unwrap_or_else(|| (0..peers.len() as u32).collect());
    if let Some(r) = plan.rings.first() {
        for h in r.hops.iter().filter(|h| h.from as usize == rank) {
            info!(
                rank,
                next = h.to,
                transport = h.transport.name(),
                path = h.path.name(),
                gbps = h.bw,
                nic_out = h.nic_out.as_deref().unwrap_or("-"),
                "braid: ring hop"
            );
        }
    }
    info!(rank, ring = ?ring, channels = plan.rings.len(), "braid: ring order (topology plan)");
    Ok(Placement {
        choice,
        ring,
        plan,
        cluster,
    })
}

/// Identity of the memory domain this process runs in: ranks with the same
/// value can share memory. `BRAID_HOST_ID` overrides; otherwise the host name,
/// the device and inode of the `/dev/shm` mount and the pid namespace, so that
/// containers or network namespaces on one kernel that do not share
/// `/dev/shm` (or process ids) count as different hosts, and ones that do
/// count as one.
/// `set`: `BRAID_HOST_ID` from the communicator's settings (trimmed, not
/// empty).
pub(crate) fn host_id(set: Option<&str>) -> String {
    if let Some(v) = set {
        return v.to_string();
    }
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown-host".into());
    let shm = nix::sys::stat::stat("/dev/shm")
        .map(|st| format!("{:x}:{:x}", st.st_dev, st.st_ino))
        .unwrap_or_else(|_| "no-shm".into());
    // Liveness checks use process ids: ranks in different pid namespaces
    // must not count as one host even if they share /dev/shm.
    let pidns = std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "no-pidns".into());
    format!("{hostname}/{shm}/{pidns}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(rank: u32, host: &str) -> PeerDesc {
        PeerDesc {
            rank,
            host_id: host.into(),
            pid: 100 + rank,
            fabrics: Vec::new(),
        }
    }

    fn contrib(ts: &[TransportKind], xml: Option<String>) -> Contribution {
        Contribution {
            transports: ts.iter().copied().collect(),
            numa: 0,
            xml,
        }
    }

    fn vm_xml() -> String {
        let p = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../core/tests/fixtures/topo/pcie4.xml"
        );
        std::fs::read_to_string(p).expect("fixture")
    }

    #[test]
    fn contribution_round_trips_and_rejects_garbage() {
        let c = Contribution {
            transports: [TransportKind::Shm, TransportKind::Socket]
                .into_iter()
                .collect(),
            numa: 3,
            xml: Some("<system/>".into()),
        };
        assert_eq!(decode(&encode(&c), 0).unwrap(), c);
        let c2 = Contribution {
            xml: None,
            numa: -1,
            ..c
        };
        assert_eq!(decode(&encode(&c2), 0).unwrap(), c2);
        for bad in [&[][..], &[1, 2, 3][..], &[1, 0, 0, 0, 0, 0xff, 0xfe][..]] {
            let e = decode(bad, 5).unwrap_err().to_string();
            assert!(e.contains("rank 5"), "{e}");
        }
    }

    #[test]
    fn interleaved_hosts_keep_their_ranks_adjacent_and_cross_by_socket() {
        let peers: Vec<_> = [(0, "a"), (1, "b"), (2, "a"), (3, "b")]
            .into_iter()
            .map(|(r, h)| desc(r, h))
            .collect();
        let both = [TransportKind::Shm, TransportKind::Socket];
        let contribs = vec![
            contrib(&both, Some(vm_xml())),
            contrib(&both, Some(vm_xml())),
            contrib(&both, None),
            contrib(&both, None),
        ];
        let (c, pol) = fuse(&peers, &contribs, TransportPolicy::default()).unwrap();
        assert_eq!(c.hosts.len(), 2);
        assert_eq!(
            c.ranks.iter().map(|r| r.host).collect::<Vec<_>>(),
            [0, 1, 0, 1]
        );
        let plan = topo::plan(&c, &pol).unwrap();
        assert_eq!(plan.transports[0][2], Some(TransportKind::Shm));
        assert_eq!(plan.transports[0][1], Some(TransportKind::Socket));
        let ring = &plan.rings[0].order;
        let host = |r: u32| peers[r as usize].host_id.clone();
        let crossings = (0..4)
            .filter(|&i| host(ring[i]) != host(ring[(i + 1) % 4]))
            .count();
        assert_eq!(crossings, 2, "ring {ring:?}");
    }

    #[test]
    fn a_transport_some_rank_lacks_is_removed_or_refused_when_forced() {
        let peers = vec![desc(0, "a"), desc(1, "b")];
        let contribs = vec![
            contrib(
                &[TransportKind::Shm, TransportKind::Ib, TransportKind::Socket],
                Some(vm_xml()),
            ),
            contrib(&[TransportKind::Shm, TransportKind::Socket], Some(vm_xml())),
        ];
        let (_, pol) = fuse(&peers, &contribs, TransportPolicy::default()).unwrap();
        assert!(pol.disabled.contains(&TransportKind::Ib));
        assert!(!pol.disabled.contains(&TransportKind::Socket));
        let forced = TransportPolicy {
            forced: Some(TransportKind::Ib),
            ..TransportPolicy::default()
        };
        let e = fuse(&peers, &contribs, forced).unwrap_err().to_string();
        assert!(
            e.contains("BRAID_TRANSPORT=ib") && e.contains("rank(s) 1"),
            "{e}"
        );
    }

    #[test]
    fn a_host_without_a_model_is_an_error_naming_its_rank() {
        let peers = vec![desc(0, "a"), desc(1, "b")];
        let both = [TransportKind::Shm, TransportKind::Socket];
        let contribs = vec![contrib(&both, Some(vm_xml())), contrib(&both, None)];
        let e = fuse(&peers, &contribs, TransportPolicy::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 1"), "{e}");
    }

    #[test]
    fn numa_is_the_node_holding_most_allowed_cpus() {
        let mut sys = fallback_system();
        sys.cpus = vec![
            Cpu {
                numaid: 0,
                affinity: CpuSet::from_list("0-3"),
                ..Cpu::default()
            },
            Cpu {
                numaid: 1,
                affinity: CpuSet::from_list("4-7"),
                ..Cpu::default()
            },
        ];
        assert_eq!(numa_of(&sys, CpuSet::from_list("3-6").as_ref()), Some(1));
        assert_eq!(numa_of(&sys, CpuSet::from_list("1").as_ref()), Some(0));
        assert_eq!(numa_of(&sys, CpuSet::from_list("9").as_ref()), None);
        assert_eq!(numa_of(&sys, None), None);
    }
}
