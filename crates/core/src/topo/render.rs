//! Text for people: the host summary, the nvidia-smi `topo -m` style matrix
//! and the plan.

use std::fmt::Write;

use super::graph::{NodeKind, Topology};
use super::plan::{Cluster, Plan};

/// The endpoints of the matrix: GPUs, then NIC ports (and NIC endpoints without
/// port details, from partial files), as (label, node, legend name).
pub fn endpoints(t: &Topology) -> Vec<(String, usize, String)> {
    let mut out = Vec::new();
    for (i, &g) in t.gpus.iter().enumerate() {
        out.push((format!("GPU{i}"), g, t.nodes[g].id.clone()));
    }
    let mut k = 0;
    for &net in &t.nets {
        if let Some(nic) = t.nic_of_net(net) {
            out.push((format!("NIC{k}"), nic, t.nodes[net].id.clone()));
            k += 1;
        }
    }
    for &nic in &t.nics {
        let has_port = t.links[nic]
            .iter()
            .any(|l| t.nodes[l.to].kind == NodeKind::Net);
        if !has_port {
            out.push((format!("NIC{k}"), nic, t.nodes[nic].id.clone()));
            k += 1;
        }
    }
    out
}

fn gbps(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

/// CPUs/NUMA nodes, GPUs and NICs, one per line.
pub fn summary(t: &Topology, notes: &[String]) -> String {
    let s = &t.system;
    let mut o = String::new();
    let _ = writeln!(o, "host: {}", s.name.as_deref().unwrap_or("(unnamed)"));
    let c0 = s.cpus.first();
    let _ = writeln!(
        o,
        "CPUs: {} in {} NUMA node(s){}",
        s.cpu_count(),
        s.numa_nodes(),
        c0.map_or(String::new(), |c| {
            let mut d = Vec::new();
            d.extend(c.vendor.clone());
            d.extend(c.arch.clone());
            d.extend(c.familyid.map(|f| format!("family {f}")));
            d.extend(c.modelid.map(|m| format!("model {m}")));
            if d.is_empty() {
                String::new()
            } else {
                format!(" ({})", d.join(", "))
            }
        })
    );
    for c in &s.cpus {
        let cpus = match c.affinity.as_ref() {
            None => "unknown".to_string(),
            Some(a) if a.is_empty() => "none (memory only)".to_string(),
            Some(a) => a.to_list(),
        };
        let gpu_mem = c
            .attrs
            .get("gpu_memory")
            .map_or(String::new(), |g| format!(" (memory of GPU {g})"));
        if c.numaid < 0 {
            let _ = writeln!(o, "  no NUMA node: cpus {cpus}");
        } else {
            let _ = writeln!(o, "  NUMA {}: cpus {cpus}{gpu_mem}", c.numaid);
        }
    }
    if s.numa_nodes() > 1 {
        if let (Some(&a), Some(&b)) = (t.cpus.first(), t.cpus.get(1)) {
            if let Some(p) = t.path(a, b) {
                let _ = writeln!(o, "  inter-socket link: {} GB/s", gbps(p.bw));
            }
        }
    }
    let gpus = s.gpus();
    if gpus.is_empty() {
        let _ = writeln!(o, "GPUs: none");
    } else {
        let nvs = s.nvswitches();
        let _ = writeln!(
            o,
            "GPUs: {}{}",
            gpus.len(),
            if nvs.is_empty() {
                String::new()
            } else {
                format!(", NVSwitches: {} ({})", nvs.len(), nvs.join(" "))
            }
        );
    }
    for (i, g) in gpus.iter().enumerate() {
        let mut line = format!("  GPU{i} {} NUMA {}", g.pci.busid, g.numaid);
        if let Some(gi) = &g.pci.gpu {
            if let Some(sm) = gi.sm {
                let _ = write!(line, " sm{sm}");
            }
            let links: u32 = gi.nvlinks.iter().map(|l| l.count).sum();
            if links > 0 {
                let _ = write!(line, " NVLink x{links}");
            }
            let c2c: u32 = gi.c2c.iter().map(|c| c.count).sum();
            if c2c > 0 {
                let bw: f64 = gi.c2c.iter().map(|c| c.total_bw()).sum();
                let _ = write!(line, " C2C x{c2c} {} GB/s", gbps(bw));
            }
            let ranks = 1 + g.pci.extra_gpus.len();
            if ranks > 1 {
                let _ = write!(line, " ({ranks} gpu elements: one GPU, {ranks} ranks)");
            }
        } else {
            line.push_str(" (PCI placement only)");
        }
        if let (Some(sp), Some(w)) = (&g.pci.link_speed, g.pci.link_width) {
            let sp = sp.trim_end_matches(" PCIe");
            if w == 0 {
                let _ = write!(line, " PCIe {sp} x0 (read as x16)");
            } else {
                let _ = write!(line, " PCIe {sp} x{w}");
            }
        }
        let _ = writeln!(o, "{line}");
    }
    let nets = s.nets();
    let bare = s.bare_nic_endpoints();
    if nets.is_empty() && bare.is_empty() {
        let _ = writeln!(o, "NICs: none");
    } else {
        let _ = writeln!(o, "NICs: {}", nets.len() + bare.len());
    }
    for n in &nets {
        let rate = n.net.speed.map_or("rate unknown".to_string(), |sp| {
            format!("{} Gb/s", sp / 1000)
        });
        let _ = writeln!(
            o,
            "  {} {} {} state {} {} NUMA {}{}",
            n.net.name,
            n.net.kind(),
            rate,
            n.net.state.as_deref().unwrap_or("unknown"),
            n.pci
                .map_or("not on PCI".to_string(), |p| format!("pci {}", p.busid)),
            n.numaid,
            n.net
                .link_layer
                .as_deref()
                .map_or(String::new(), |l| format!(" link_layer {l}"))
        );
    }
    for (numa, p) in &bare {
        let ph = super::graph::placeholder_net(p);
        let _ = writeln!(
            o,
            "  {} (PCI placement only; planned as an {} placeholder port) NUMA {numa}",
            p.busid,
            ph.kind()
        );
    }
    for n in notes {
        let _ = writeln!(o, "note: {n}");
    }
    o
}

/// The GPU/NIC matrix the way `nvidia-smi topo -m` prints it.
pub fn matrix(t: &Topology) -> String {
    let eps = endpoints(t);
    let mut o = String::new();
    if eps.is_empty() {
        let _ = writeln!(o, "(no GPUs or NICs to show)");
        return o;
    }
    let w = eps
        .iter()
        .map(|(l, _, _)| l.len())
        .max()
        .unwrap_or(4)
        .max(5)
        + 2;
    let affinity = |node: usize| {
        let numa = t.nodes[node].numaid;
        t.system
            .cpus
            .iter()
            .find(|c| c.numaid == numa)
            .and_then(|c| c.affinity.as_ref())
            .map_or("N/A".to_string(), |a| a.to_list())
    };
    // The CPU column is as wide as its longest list (and its title).
    let aw = eps
        .iter()
        .map(|(_, a, _)| affinity(*a).len())
        .max()
        .unwrap_or(0)
        .max("CPU Affinity".len())
        + 2;
    let _ = write!(o, "{:w$}", "");
    for (l, _, _) in &eps {
        let _ = write!(o, "{l:<w$}");
    }
    let _ = writeln!(o, "{:<aw$}NUMA Affinity", "CPU Affinity");
    for (l, a, _) in &eps {
        let _ = write!(o, "{l:<w$}");
        for (lb, b, _) in &eps {
            let label = if a == b && !std::ptr::eq(l, lb) {
                "PIX".to_string() // two ports of one NIC
            } else {
                t.smi_label(*a, *b)
            };
            let _ = write!(o, "{label:<w$}");
        }
        let numa = t.nodes[*a].numaid;
        let _ = writeln!(o, "{:<aw$}{numa}", affinity(*a));
    }
    let _ = writeln!(o);
    let _ = writeln!(o, "Legend:");
    let _ = writeln!(o);
    for (k, v) in [
        ("X", "Self"),
        ("SYS", "Connection traversing PCIe as well as the SMP interconnect between NUMA nodes"),
        ("NODE", "Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node"),
        ("PHB", "Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)"),
        ("PXB", "Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)"),
        ("PIX", "Connection traversing at most a single PCIe bridge"),
        ("NV#", "Connection traversing a bonded set of # NVLinks"),
    ] {
        let _ = writeln!(o, "  {k:<4} = {v}");
    }
    if eps.iter().any(|(l, _, _)| l.starts_with("NIC")) {
        let _ = writeln!(o);
        let _ = writeln!(o, "NIC Legend:");
        let _ = writeln!(o);
        for (l, _, name) in eps.iter().filter(|(l, _, _)| l.starts_with("NIC")) {
            let _ = writeln!(o, "  {l}: {name}");
        }
    }
    o
}

/// Paths between GPUs, GPUs and NICs (GPU first, with NCCL's PXN and P2C
/// relays) and NICs, with NCCL's classes and GB/s.
pub fn paths(t: &Topology) -> String {
    let mut o = String::new();
    let eps = endpoints(t);
    for (i, (la, a, _)) in eps.iter().enumerate() {
        for (lb, b, _) in eps.iter().skip(i + 1) {
            if a == b {
                continue;
            }
            let (ka, kb) = (t.nodes[*a].kind, t.nodes[*b].kind);
            let p = match (ka, kb) {
                (NodeKind::Gpu, NodeKind::Nic) => t.gpu_nic_path(*a, *b),
                (NodeKind::Nic, NodeKind::Gpu) => t.gpu_nic_path(*b, *a),
                _ => t.path(*a, *b).cloned(),
            };
            let (la, lb) = if (ka, kb) == (NodeKind::Nic, NodeKind::Gpu) {
                (lb, la)
            } else {
                (la, lb)
            };
            if let Some(p) = p {
                let _ = writeln!(o, "  {la} -> {lb}: {} {} GB/s", p.kind, gbps(p.bw));
            }
        }
    }
    o
}

/// The plan: ranks, the transport matrix, the rails and the rings.
pub fn plan(c: &Cluster, p: &Plan) -> String {
    let mut o = String::new();
    let n = c.ranks.len();
    let _ = writeln!(o, "ranks: {n} on {} host(s)", c.hosts.len());
    for (r, place) in c.ranks.iter().enumerate() {
        let nics = p
            .rank_nics
            .get(r)
            .filter(|v| !v.is_empty())
            .map_or("-".to_string(), |v| v.join(","));
        let _ = writeln!(
            o,
            "  rank {r:<3} host {:<12} {:<14} nic {nics}",
            c.hosts[place.host].name,
            place.gpu.as_deref().map_or(
                format!("cpu numa {}", place.numa.unwrap_or(0)),
                |g| format!("gpu {g}")
            ),
        );
    }
    let _ = writeln!(o, "transports:");
    let _ = write!(o, "{:>8}", "");
    for b in 0..n {
        let _ = write!(o, "{b:>8}");
    }
    let _ = writeln!(o);
    for (a, row) in p.transports.iter().enumerate() {
        let _ = write!(o, "{a:>8}");
        for t in row {
            let _ = write!(o, "{:>8}", t.map_or("-", |t| t.name()));
        }
        let _ = writeln!(o);
    }
    if c.hosts.len() > 1 {
        let hops: Vec<&super::plan::Hop> = p
            .rings
            .iter()
            .flat_map(|r| r.hops.iter())
            .filter(|h| h.nic_out.is_some() || h.nic_in.is_some())
            .collect();
        let same = hops.iter().filter(|h| h.same_rail() == Some(true)).count();
        let _ = writeln!(
            o,
            "rails: {} (BRAID_CROSS_NIC={}); hops between hosts: {}, on one rail: {}",
            p.rails.len(),
            p.cross_nic.value(),
            hops.len(),
            same
        );
        for rail in &p.rails {
            let mut names: Vec<String> = rail
                .ports
                .iter()
                .map(|x| x.clone().unwrap_or_else(|| "-".into()))
                .collect();
            names.dedup();
            let _ = writeln!(o, "  rail {}: {}", rail.id, names.join(" "));
        }
    }
    let _ = writeln!(o, "rings: {} channel(s)", p.rings.len());
    let mut i = 0;
    while i < p.rings.len() {
        let mut j = i;
        while j + 1 < p.rings.len() && p.rings[j + 1] == p.rings[i] {
            j += 1;
        }
        let ring = &p.rings[i];
        let chans = if i == j {
            format!("{i}")
        } else {
            format!("{i}-{j}")
        };
        let order: Vec<String> = ring.order.iter().map(|r| r.to_string()).collect();
        let _ = writeln!(o, "  channel {chans}: {}", order.join(" "));
        for h in &ring.hops {
            let via = match (&h.nic_out, &h.nic_in) {
                (Some(a), Some(b)) => {
                    let rail = |r: Option<u32>| r.map_or("?".to_string(), |r| r.to_string());
                    let class = |k: Option<super::graph::PathType>| {
                        k.map_or("?".to_string(), |k| k.to_string())
                    };
                    let same = match h.same_rail() {
                        Some(true) => format!("rail {}", rail(h.rail_out)),
                        Some(false) => {
                            format!("crosses rails {} -> {}", rail(h.rail_out), rail(h.rail_in))
                        }
                        None => "rail unknown".to_string(),
                    };
                    format!(
                        " via {a} -> {b} ({same}; {} out, {} in)",
                        class(h.path_out),
                        class(h.path_in)
                    )
                }
                _ => String::new(),
            };
            let _ = writeln!(
                o,
                "    {} -> {}: {} {} {} GB/s{via}",
                h.from,
                h.to,
                h.transport,
                h.path,
                gbps(h.bw)
            );
        }
        i = j + 1;
    }
    for note in &p.notes {
        let _ = writeln!(o, "note: {note}");
    }
    o
}
