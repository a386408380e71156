//! Ports: the network ports (NICs) each rank uses, their rails, and why a
//! host talks socket rather than ib to other hosts.

use super::paths::Ctx;
use crate::topo::graph::Topology;
use crate::transport::TransportKind;

/// The network ports of every rank, as node indices of its host's topology
/// and as names.
pub(super) struct Ports {
    /// Per rank: the ports of the kind it uses (RDMA or kernel interfaces),
    /// the candidates its ports are chosen from (and rails numbered by).
    pub(super) kind_ports: Vec<Vec<usize>>,
    /// Per rank: the ports it uses, in channel order ([`rank_ports`]).
    pub(super) port_nodes: Vec<Vec<usize>>,
    /// Per rank: the name of its first port.
    pub(super) nearest_nic: Vec<Option<String>>,
    /// Per rank: the names of its ports, in channel order.
    pub(super) rank_nics: Vec<Vec<String>>,
    /// Per rank: the rail of each of its ports.
    pub(super) rank_rails: Vec<Vec<u32>>,
}

impl Ports {
    /// The ports of every rank: the RDMA ports where it talks ib to another
    /// host (or, with no other host, where it would: its host has an RDMA
    /// port up and the policy allows ib), kernel interfaces otherwise (RDMA
    /// ports when the host has no other). Notes why hosts talk socket
    /// rather than ib to other hosts ([`why_not_ib`]).
    pub(super) fn of(
        cx: &Ctx,
        transports: &[Vec<Option<TransportKind>>],
        notes: &mut Vec<String>,
    ) -> Ports {
        let (c, policy) = (cx.c, cx.policy);
        let n = c.ranks.len();
        let ib_allowed = !policy.disabled.contains(&TransportKind::Ib)
            && policy.forced.is_none_or(|f| f == TransportKind::Ib);
        let kind_ports: Vec<Vec<usize>> = (0..n)
            .map(|r| {
                let t = cx.topo(r);
                let remote = (0..n).any(|b| c.ranks[b].host != c.ranks[r].host);
                let ib = transports[r].contains(&Some(TransportKind::Ib))
                    || (!remote && ib_allowed && cx.host_has_rdma(r));
                let ports = if ib {
                    t.ports(Some(true))
                } else {
                    t.ports(Some(false)).or_else(|| t.ports(None))
                };
                ports.unwrap_or_default()
            })
            .collect();
        why_not_ib(cx, transports, ib_allowed, notes);
        let port_nodes: Vec<Vec<usize>> =
            (0..n).map(|r| rank_ports(cx, r, &kind_ports[r])).collect();
        let name_of = |r: usize, net: usize| cx.topo(r).nodes[net].id.clone();
        let nearest_nic: Vec<Option<String>> = (0..n)
            .map(|r| port_nodes[r].first().map(|&x| name_of(r, x)))
            .collect();
        let rank_nics: Vec<Vec<String>> = (0..n)
            .map(|r| port_nodes[r].iter().map(|&x| name_of(r, x)).collect())
            .collect();
        let rank_rails: Vec<Vec<u32>> = (0..n)
            .map(|r| {
                port_nodes[r]
                    .iter()
                    .map(|&x| rail_of(cx.topo(r), &kind_ports[r], x))
                    .collect()
            })
            .collect();
        Ports {
            kind_ports,
            port_nodes,
            nearest_nic,
            rank_nics,
            rank_rails,
        }
    }
}

/// The ports of rank `r` (node indices of its host's topology), in channel
/// order: NCCL's spreading for a GPU; for a CPU-only rank the ports nearest
/// its NUMA node shared out among the CPU ranks of that node.
fn rank_ports(cx: &Ctx, r: usize, ports: &[usize]) -> Vec<usize> {
    let t = cx.topo(r);
    let mut out: Vec<usize> = Vec::new();
    match cx.gpu[r] {
        Some(g) => {
            let local = t.local_nets(g, ports);
            let Some(&first) = local.first() else {
                return out;
            };
            let near = t.local_gpus(first).len().max(1);
            let per = local.len().div_ceil(near).max(1);
            for ch in 0..per {
                if let Some(n) = t.spread_net(g, ports, ch) {
                    if !out.contains(&n) {
                        out.push(n);
                    }
                }
            }
        }
        None => {
            let local = t.local_nets(cx.cpu[r], ports);
            if local.is_empty() {
                return out;
            }
            let peers: Vec<usize> = (0..cx.c.ranks.len())
                .filter(|&x| {
                    cx.c.ranks[x].host == cx.c.ranks[r].host
                        && cx.gpu[x].is_none()
                        && cx.cpu[x] == cx.cpu[r]
                })
                .collect();
            let idx = peers.iter().position(|&x| x == r).unwrap_or(0);
            let per = local.len().div_ceil(peers.len().max(1)).max(1);
            for ch in 0..per {
                let n = local[(idx * per + ch) % local.len()];
                if !out.contains(&n) {
                    out.push(n);
                }
            }
        }
    }
    out
}

/// The rail of port node `net` in `topo`: its `rail` attribute, else its
/// `dev` (NCCL's device index), else its place among `ports`.
pub(super) fn rail_of(topo: &Topology, ports: &[usize], net: usize) -> u32 {
    let info = topo.net_of(net);
    info.and_then(|n| n.attrs.get("rail").and_then(|r| r.trim().parse().ok()))
        .or(info.and_then(|n| n.dev))
        .unwrap_or_else(|| ports.iter().position(|&x| x == net).unwrap_or(0) as u32)
}

/// Why the ranks of a host talk socket to other hosts rather than ib, for
/// the log (NCCL logs each transport decision): once per such host, the
/// host's ports and why none is an RDMA port that is up; else, where the
/// policy ruled ib out, that.
fn why_not_ib(
    cx: &Ctx,
    transports: &[Vec<Option<TransportKind>>],
    ib_allowed: bool,
    notes: &mut Vec<String>,
) {
    let c = cx.c;
    let n = c.ranks.len();
    let mut noted: Vec<usize> = Vec::new();
    let mut policy_noted = false;
    for (a, row) in transports.iter().enumerate() {
        let h = c.ranks[a].host;
        let socket_out =
            (0..n).any(|b| c.ranks[b].host != h && row[b] == Some(TransportKind::Socket));
        if !socket_out || noted.contains(&h) {
            continue;
        }
        if cx.host_has_rdma(a) {
            if !ib_allowed && !policy_noted {
                policy_noted = true;
                notes.push(
                    "socket between hosts, not ib: ib is disabled or another transport forced (BRAID_IB_DISABLE, BRAID_TRANSPORT, or ib not available on every rank)"
                        .into(),
                );
            }
            // Otherwise the host at the other end has no RDMA port: its
            // own note says why.
            continue;
        }
        noted.push(h);
        let t = cx.topo(a);
        let ports: Vec<String> = (0..t.nets.len())
            .map(|i| {
                let net = &t.net_info[i];
                let at = t
                    .nic_of_net(t.nets[i])
                    .map(|x| t.nodes[x].id.clone())
                    .filter(|id| *id != net.name)
                    .unwrap_or_else(|| "not on PCI".into());
                let why = if net.is_rdma() {
                    format!(
                        "an RDMA device, but {}",
                        net.state.as_deref().unwrap_or("down")
                    )
                } else if net.rdma == Some(false) {
                    "a kernel interface with no RDMA device".to_string()
                } else if net.port == Some(0) {
                    "no RDMA device (port 0: a socket port in NCCL's files)".to_string()
                } else {
                    "no RDMA device (no verbs device name, port or GUID)".to_string()
                };
                format!("{} ({at}): {why}", net.name)
            })
            .collect();
        let ports = if ports.is_empty() {
            "it has no network port in its model".to_string()
        } else {
            ports.join("; ")
        };
        notes.push(format!(
            "host {}: socket to other hosts, not ib: no RDMA port up: {ports}",
            c.hosts[h].name
        ));
    }
}
