//! Rings: the channels of a plan, inside one host or across hosts (as
//! NCCL's `graph/rings.cc` and `graph/connect.cc` build them), with the
//! ports and rails every hop between hosts uses.

use super::paths::Ctx;
use super::ports::{rail_of, Ports};
use super::search::best_order;
use super::{CrossNic, Hop, Rail, RankPlace, Ring};
use crate::topo::graph::{PathType, NET_BW_FALLBACK};
use crate::transport::TransportKind;

/// The channels of a plan, and the rails they run on (across hosts only).
pub(super) struct Channels {
    pub(super) rings: Vec<Ring>,
    pub(super) rails: Vec<Rail>,
}

/// GB/s of a ring's narrowest GPU link that one channel inside a host
/// carries: a host's ring gets one channel per this much bandwidth.
const GBPS_PER_CHANNEL: f64 = 12.0;

/// Most channels inside one host.
const MAX_HOST_CHANNELS: usize = 16;

/// The channels of ranks that all share one host: the best cycle of its
/// ranks, once per [`GBPS_PER_CHANNEL`] of the ring's narrowest link where
/// every hop is a GPU link (NVLink or PCIe P2P), at most
/// [`MAX_HOST_CHANNELS`]; once through host memory.
pub(super) fn one_host(cx: &Ctx, transports: &[Vec<Option<TransportKind>>]) -> Channels {
    let n = cx.c.ranks.len();
    let rs: Vec<usize> = (0..n).collect();
    let order = best_order(cx, transports, &rs, None, true, &|_| (f64::INFINITY, 0));
    let ring = make_ring(cx, transports, &order, &[]);
    let all_gpu_links = ring
        .hops
        .iter()
        .all(|h| matches!(h.transport, TransportKind::Nvlink | TransportKind::Pcie));
    let nch = if all_gpu_links && n > 1 {
        ((ring.bottleneck() / GBPS_PER_CHANNEL).floor() as usize).clamp(1, MAX_HOST_CHANNELS)
    } else {
        1
    };
    Channels {
        rings: vec![ring; nch],
        rails: Vec::new(),
    }
}

/// The channels of ranks on several hosts: one per rail common to all
/// hosts (or, where a ring may change rail, one per port of the host with
/// the fewest), each a path through every host in turn that enters and
/// leaves the host through the port of its rail. Notes where hops change
/// rail.
pub(super) fn across_hosts(
    cx: &Ctx,
    transports: &[Vec<Option<TransportKind>>],
    ports: &Ports,
    notes: &mut Vec<String>,
) -> Channels {
    let f = Fabric::new(cx, transports, ports);
    let rails = f.rails();
    if cx.policy.cross_nic != CrossNic::Allow
        && f.common.is_empty()
        && f.host_rails.iter().any(|r| !r.is_empty())
    {
        notes.push(
            "the hosts have no rail (port index) in common: hops between hosts change rail".into(),
        );
    }
    let nch = if f.same_rail {
        f.common.len()
    } else {
        f.host_rails.iter().map(Vec::len).min().unwrap_or(1).max(1)
    };
    let rings = (0..nch).map(|ch| f.channel(ch, notes)).collect();
    Channels { rings, rails }
}

/// One rail of one host: the rail and the port (node index) on it.
type RailPort = (u32, usize);

/// The hosts of a plan across hosts, their ranks and their rails.
struct Fabric<'a> {
    cx: &'a Ctx<'a>,
    transports: &'a [Vec<Option<TransportKind>>],
    ports: &'a Ports,
    /// Hosts in order of their first rank.
    hosts: Vec<usize>,
    /// Per host (in `hosts` order): its ranks.
    members: Vec<Vec<usize>>,
    /// Per host (in `hosts` order): its rails, each with the port on it
    /// (of the ports its ranks use), ordered by rail.
    host_rails: Vec<Vec<RailPort>>,
    /// The rails every host has.
    common: Vec<u32>,
    /// Whether every channel stays on one rail (not `BRAID_CROSS_NIC=1`,
    /// and the hosts have a rail in common).
    same_rail: bool,
}

/// The ports a channel enters and leaves one host by.
#[derive(Clone, Copy)]
struct HostEnds {
    entry: Option<usize>,
    exit: Option<usize>,
}

/// One host's part of a channel: its ranks in ring order, and its ports.
struct Segment {
    order: Vec<usize>,
    ends: HostEnds,
}

impl<'a> Fabric<'a> {
    /// The hosts of `cx`'s cluster, their ranks and rails.
    fn new(
        cx: &'a Ctx<'a>,
        transports: &'a [Vec<Option<TransportKind>>],
        ports: &'a Ports,
    ) -> Fabric<'a> {
        let c = cx.c;
        let n = c.ranks.len();
        let mut hosts: Vec<usize> = Vec::new();
        for p in &c.ranks {
            if !hosts.contains(&p.host) {
                hosts.push(p.host);
            }
        }
        let members: Vec<Vec<usize>> = hosts
            .iter()
            .map(|&h| (0..n).filter(|&r| c.ranks[r].host == h).collect())
            .collect();
        let host_rails: Vec<Vec<RailPort>> = members
            .iter()
            .map(|rs| {
                let mut v: Vec<RailPort> = Vec::new();
                for &r in rs {
                    for (i, &port) in ports.port_nodes[r].iter().enumerate() {
                        let rail = ports.rank_rails[r][i];
                        if !v.iter().any(|x| x.0 == rail) {
                            v.push((rail, port));
                        }
                    }
                }
                v.sort();
                v
            })
            .collect();
        let common: Vec<u32> = host_rails
            .first()
            .map(|first| {
                first
                    .iter()
                    .map(|x| x.0)
                    .filter(|k| host_rails.iter().all(|hr| hr.iter().any(|x| x.0 == *k)))
                    .collect()
            })
            .unwrap_or_default();
        let same_rail = cx.policy.cross_nic != CrossNic::Allow && !common.is_empty();
        Fabric {
            cx,
            transports,
            ports,
            hosts,
            members,
            host_rails,
            common,
            same_rail,
        }
    }

    /// Every rail of any host, with each host's port on it.
    fn rails(&self) -> Vec<Rail> {
        let mut all_rails: Vec<u32> = self.host_rails.iter().flatten().map(|x| x.0).collect();
        all_rails.sort();
        all_rails.dedup();
        all_rails
            .into_iter()
            .map(|k| {
                let mut ports = vec![None; self.cx.c.hosts.len()];
                for (hi, &h) in self.hosts.iter().enumerate() {
                    if let Some(&(_, node)) = self.host_rails[hi].iter().find(|x| x.0 == k) {
                        let r0 = self.members[hi][0];
                        ports[h] = Some(self.cx.topo(r0).nodes[node].id.clone());
                    }
                }
                Rail { id: k, ports }
            })
            .collect()
    }

    /// Channel `ch`: every host's segment in turn, joined into a ring.
    fn channel(&self, ch: usize, notes: &mut Vec<String>) -> Ring {
        let mut order = Vec::new();
        let mut ends: Vec<HostEnds> = Vec::new();
        for hi in 0..self.hosts.len() {
            let seg = self.segment(ch, hi, notes);
            ends.push(seg.ends);
            order.extend(seg.order);
        }
        make_ring(
            self.cx,
            self.transports,
            &order,
            &ends_by_rank(&self.hosts, &ends, &self.cx.c.ranks, &order),
        )
    }

    /// Channel `ch`'s path through host `hosts[hi]`: it enters by the port
    /// of the channel's rail at the rank that uses that port first, and
    /// leaves from the rank whose path to the exit port is best (on one
    /// rail: that port; otherwise the last rank's own port, preferring the
    /// next rail so that every port carries one channel out and one in).
    fn segment(&self, ch: usize, hi: usize, notes: &mut Vec<String>) -> Segment {
        let cx = self.cx;
        let same_rail = self.same_rail;
        let port_nodes = &self.ports.port_nodes;
        let rs = &self.members[hi];
        let hr = &self.host_rails[hi];
        // The port this channel enters by (and, on one rail, leaves by).
        let rail_port: Option<usize> = if same_rail {
            hr.iter().find(|x| x.0 == self.common[ch]).map(|x| x.1)
        } else if hr.is_empty() {
            None
        } else {
            Some(hr[ch % hr.len()].1)
        };
        let next_port: Option<usize> = (!hr.is_empty()).then(|| hr[(ch + 1) % hr.len()].1);
        // Entry: the rank that uses that port on the earliest channel.
        let entry = rail_port
            .and_then(|p| {
                rs.iter()
                    .copied()
                    .filter_map(|r| port_nodes[r].iter().position(|&x| x == p).map(|i| (i, r)))
                    .min()
                    .map(|(_, r)| r)
            })
            .unwrap_or(rs[0]);
        let own_port = |r: usize| -> Option<usize> {
            let v = &port_nodes[r];
            (!v.is_empty()).then(|| v[ch % v.len()])
        };
        let class = |k: PathType| -> u8 {
            if k <= PathType::Pxb {
                0
            } else if k <= PathType::Pxn {
                1
            } else {
                2
            }
        };
        let t = cx.topo(rs[0]);
        let exit_score = |last: usize| -> (f64, u8) {
            if same_rail {
                match rail_port.and_then(|p| t.net_path(cx.from(last), p)) {
                    Some(p) => (p.bw, class(p.kind)),
                    None => (f64::INFINITY, 2),
                }
            } else {
                // Any rail: leave from a rank on the next rail, so
                // that every port carries one channel out and one in.
                let own = own_port(last);
                let bw = own
                    .and_then(|p| t.net_path(cx.from(last), p))
                    .map_or(f64::INFINITY, |p| p.bw);
                let pref = if last != entry && own == rail_port && own.is_some() {
                    0
                } else if own == next_port {
                    1
                } else {
                    2
                };
                (bw, pref)
            }
        };
        let order = best_order(cx, self.transports, rs, Some(entry), false, &exit_score);
        let last = *order.last().unwrap_or(&entry);
        let mut exit = if same_rail { rail_port } else { own_port(last) };
        if same_rail && cx.policy.cross_nic == CrossNic::Auto {
            if let (Some(rp), Some(op)) = (rail_port, own_port(last)) {
                if self.leaves_by_own_port(ch, hi, last, rp, op, notes) {
                    exit = Some(op);
                }
            }
        }
        Segment {
            order,
            ends: HostEnds {
                entry: rail_port,
                exit,
            },
        }
    }

    /// `BRAID_CROSS_NIC=2`: whether rank `last`, the last of channel `ch`
    /// on host `hosts[hi]`, leaves through its own port `op` rather than
    /// the rail's port `rp` because `op` is faster to reach (and if so, a
    /// note that says where and why).
    fn leaves_by_own_port(
        &self,
        ch: usize,
        hi: usize,
        last: usize,
        rp: usize,
        op: usize,
        notes: &mut Vec<String>,
    ) -> bool {
        let cx = self.cx;
        let t = cx.topo(self.members[hi][0]);
        let kind_ports = &self.ports.kind_ports;
        let bw = |p: usize| t.net_path(cx.from(last), p).map_or(0.0, |x| x.bw);
        let faster = op != rp && bw(op) > bw(rp) + 1e-9;
        if !faster {
            return false;
        }
        let kind = |p: usize| {
            t.net_path(cx.from(last), p)
                .map_or("?".to_string(), |x| x.kind.to_string())
        };
        notes.push(format!(
            "channel {ch}: rank {last} on host {} leaves through {} (rail {}) instead of {} (rail {}): {} {:.1} GB/s against {} {:.1} GB/s (BRAID_CROSS_NIC=2; 0 keeps the rail)",
            cx.c.hosts[self.hosts[hi]].name,
            t.nodes[op].id,
            rail_of(t, &kind_ports[last], op),
            t.nodes[rp].id,
            rail_of(t, &kind_ports[last], rp),
            kind(op),
            bw(op),
            kind(rp),
            bw(rp),
        ));
        true
    }
}

/// Where a ring enters or leaves a host: at rank `rank`, in through
/// `port_in` and/or out through `port_out` (port node indices).
struct RankEnd {
    rank: usize,
    port_in: Option<usize>,
    port_out: Option<usize>,
}

/// Per rank of `order`: the port it enters its host by (first rank of its
/// host's segment) and the port it leaves by (last rank), for [`make_ring`].
fn ends_by_rank(
    hosts: &[usize],
    ends: &[HostEnds],
    ranks: &[RankPlace],
    order: &[usize],
) -> Vec<RankEnd> {
    let mut out = Vec::new();
    for (hi, &h) in hosts.iter().enumerate() {
        let seg: Vec<usize> = order
            .iter()
            .copied()
            .filter(|&r| ranks[r].host == h)
            .collect();
        if let (Some(&first), Some(&last)) = (seg.first(), seg.last()) {
            out.push(RankEnd {
                rank: first,
                port_in: ends[hi].entry,
                port_out: None,
            });
            out.push(RankEnd {
                rank: last,
                port_in: None,
                port_out: ends[hi].exit,
            });
        }
    }
    out
}

/// The ring through `order` (a cycle): each hop's transport, path class
/// and bottleneck GB/s; across hosts the ports, rails and path classes at
/// both ends, with the ports from `ends` (none: [`NET_BW_FALLBACK`]).
fn make_ring(
    cx: &Ctx,
    transports: &[Vec<Option<TransportKind>>],
    order: &[usize],
    ends: &[RankEnd],
) -> Ring {
    let n = order.len();
    let mut hops = Vec::new();
    let port_in = |r: usize| ends.iter().filter(|e| e.rank == r).find_map(|e| e.port_in);
    let port_out = |r: usize| ends.iter().filter(|e| e.rank == r).find_map(|e| e.port_out);
    if n > 1 {
        for i in 0..n {
            let (a, b) = (order[i], order[(i + 1) % n]);
            let t = transports[a][b].unwrap_or(TransportKind::Shm);
            let mut hop = Hop {
                from: a as u32,
                to: b as u32,
                transport: t,
                path: PathType::Net,
                bw: 0.0,
                nic_out: None,
                nic_in: None,
                rail_out: None,
                rail_in: None,
                path_out: None,
                path_in: None,
            };
            if matches!(t, TransportKind::Ib | TransportKind::Socket) {
                let mut bw = f64::INFINITY;
                for (r, port, out) in [(a, port_out(a), true), (b, port_in(b), false)] {
                    let topo = cx.topo(r);
                    let Some(p) = port else {
                        bw = bw.min(NET_BW_FALLBACK);
                        continue;
                    };
                    let path = topo.net_path(cx.from(r), p);
                    bw = bw.min(path.as_ref().map_or(NET_BW_FALLBACK, |x| x.bw));
                    let ports = topo
                        .ports(topo.net_of(p).map(|x| x.is_rdma()))
                        .unwrap_or_default();
                    let rail = Some(rail_of(topo, &ports, p));
                    let name = Some(topo.nodes[p].id.clone());
                    let kind = path.map(|x| x.kind);
                    if out {
                        (hop.nic_out, hop.rail_out, hop.path_out) = (name, rail, kind);
                    } else {
                        (hop.nic_in, hop.rail_in, hop.path_in) = (name, rail, kind);
                    }
                }
                hop.bw = bw;
            } else {
                let (k, bw) = cx.link(a, b, t);
                hop.path = k;
                hop.bw = bw;
            }
            hops.push(hop);
        }
    }
    Ring {
        order: order.iter().map(|&r| r as u32).collect(),
        hops,
    }
}
