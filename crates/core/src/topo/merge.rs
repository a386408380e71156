//! A topology file merged with detection, as NCCL merges `NCCL_TOPO_FILE`
//! with what it detects (`ncclTopoGetSystem`): the file is read first and
//! detection fills in.
//!
//! - A detected GPU or NIC port found in the file (a `pci` element with its
//!   bus id, a `net` with its name) keeps the file's place and attributes;
//!   what the file leaves unset (a GPU's `sm`, NVLinks when the file has
//!   none, a port's speed, GUID, state) comes from detection. A NIC port
//!   whose PCI function the file lists (partial vendor files: only `class`
//!   and `busid`) is placed there.
//! - What detection knows about a NIC it found wins over the file: whether
//!   a port is an RDMA (verbs) device (`rdma`), and which ports a detected
//!   PCI function has. The file's ports on a function detection found that
//!   detection did not find there are dropped (a port the file calls
//!   `mlx5_0` on a function where detection found only `eth0` is not on
//!   this host: libibverbs would not find it either), so a NIC without an
//!   RDMA device is never planned as `ib`. A detected NIC whose ports the
//!   file lists elsewhere (Azure's `eth0` outside the PCI tree) is not
//!   added a second time, bare, where an RDMA placeholder would stand for
//!   it. The file's NICs on functions detection did not find keep the
//!   file's claims.
//! - A detected device the file does not list is added where detection
//!   found it: under the deepest PCI ancestor the file has, else under its
//!   NUMA node.
//! - NUMA nodes: the file's attributes win, detection fills in unset ones;
//!   nodes only detection knows are added.
//! - Trimming: NCCL drops every branch of the file holding no device it
//!   detected. braid does so for each kind of device detection can see
//!   here: the file's GPUs when the GPU provider found GPUs, its RDMA ports
//!   (and bare NIC-class endpoints) when detection found RDMA devices, its
//!   kernel interfaces when detection found some; then PCI branches left
//!   with no device. A file used where detection sees no GPU or no RDMA
//!   device (a container without `/sys/class/infiniband`, a machine without
//!   NVML) keeps those devices instead of losing them: a deliberate
//!   difference from NCCL, which would then have none.

use super::model::{Cpu, Gpu, Net, Nic, Pci, System};

/// Merge the file's model with the detected one (see the module docs).
pub fn merge(file: &System, detected: &System) -> (System, Vec<String>) {
    let mut out = file.clone();
    let mut notes = Vec::new();
    if out.name.is_none() {
        out.name.clone_from(&detected.name);
    }
    // NUMA nodes.
    for d in &detected.cpus {
        match out.cpus.iter_mut().find(|c| c.numaid == d.numaid) {
            Some(c) => fill_cpu(c, d),
            None => {
                notes.push(format!(
                    "NUMA node {}: not in the file; added as detected",
                    d.numaid
                ));
                out.cpus.push(Cpu {
                    pci: Vec::new(),
                    nics: Vec::new(),
                    ..d.clone()
                });
            }
        }
    }
    let mut matched_pci: Vec<String> = Vec::new();
    let mut matched_nets: Vec<String> = Vec::new();
    // PCI functions where detection found a NIC, with the ports it found.
    let mut detected_nics: Vec<(String, Vec<String>)> = Vec::new();
    // Detected GPUs and NICs in the PCI tree.
    for d in &detected.cpus {
        for top in &d.pci {
            let mut chain: Vec<&Pci> = Vec::new();
            visit(top, &mut chain, &mut |chain: &[&Pci]| {
                let dev = chain[chain.len() - 1];
                if dev.gpu.is_none() && dev.nic.is_none() {
                    return;
                }
                if let Some(n) = &dev.nic {
                    let names = n.nets.iter().map(|x| x.name.clone()).collect();
                    detected_nics.push((dev.busid.clone(), names));
                    // A NIC (only) that the file does not list at this
                    // function but whose ports it has elsewhere (NCCL's
                    // `net` found by name): the ports stay where the file
                    // has them, with what detection knows; the function
                    // is not added bare (a bare NIC-class endpoint would
                    // be planned as an RDMA placeholder).
                    if dev.gpu.is_none()
                        && !n.nets.is_empty()
                        && find_pci_mut(&mut out, &dev.busid).is_none()
                        && n.nets
                            .iter()
                            .all(|x| find_net_mut(&mut out, &x.name).is_some())
                    {
                        for net in &n.nets {
                            matched_nets.push(net.name.clone());
                            attach_net(&mut out, &dev.busid, net, &mut notes);
                            notes.push(format!(
                                "{} (detected on {}) is in the file outside that function: kept where the file has it, with what detection knows of it",
                                net.name, dev.busid
                            ));
                        }
                        return;
                    }
                }
                place(&mut out, d.numaid, chain, &mut notes);
                let Some(target) = find_pci_mut(&mut out, &dev.busid) else {
                    return;
                };
                fill_pci(target, dev);
                if let Some(g) = &dev.gpu {
                    matched_pci.push(dev.busid.clone());
                    match &mut target.gpu {
                        Some(fg) => fill_gpu(fg, g),
                        None => target.gpu = Some(g.clone()),
                    }
                }
                if let Some(n) = &dev.nic {
                    for net in &n.nets {
                        matched_nets.push(net.name.clone());
                        attach_net(&mut out, &dev.busid, net, &mut notes);
                    }
                }
            });
        }
        // NICs outside the PCI tree.
        for nic in &d.nics {
            for net in &nic.nets {
                matched_nets.push(net.name.clone());
                if let Some(fnet) = find_net_mut(&mut out, &net.name) {
                    fill_net(fnet, net, &mut notes);
                    continue;
                }
                if let Some(c) = out.cpus.iter_mut().find(|c| c.numaid == d.numaid) {
                    c.nics.push(Nic {
                        nets: vec![net.clone()],
                        attrs: nic.attrs.clone(),
                    });
                }
            }
        }
    }
    // Trim what detection could have seen but did not.
    let gpus_known = !detected.gpus().is_empty();
    let nets = detected.nets();
    let rdma_known = nets.iter().any(|n| n.net.is_rdma());
    let sock_known = nets.iter().any(|n| !n.net.is_rdma());
    let mut dropped: Vec<String> = Vec::new();
    for c in &mut out.cpus {
        for p in &mut c.pci {
            trim_devices(
                p,
                &Seen {
                    gpus: &matched_pci,
                    nets: &matched_nets,
                    nics: &detected_nics,
                },
                (gpus_known, rdma_known, sock_known),
                &mut dropped,
                &mut notes,
            );
        }
        c.nics.retain_mut(|n| {
            n.nets.retain(|x| {
                let keep = matched_nets.contains(&x.name)
                    || !(if x.is_rdma() { rdma_known } else { sock_known });
                if !keep {
                    dropped.push(format!("port {}", x.name));
                }
                keep
            });
            !n.nets.is_empty()
        });
        c.pci.retain_mut(prune_empty);
    }
    for d in dropped {
        notes.push(format!(
            "the file's {d} was not detected on this host: dropped (NCCL trims what it does not detect)"
        ));
    }
    for (what, known) in [
        ("GPU", gpus_known),
        ("RDMA device", rdma_known),
        ("kernel network interface", sock_known),
    ] {
        if !known {
            notes.push(format!(
                "detection found no {what} here: the file's are kept as the file has them"
            ));
        }
    }
    (out, notes)
}

fn visit<'a>(p: &'a Pci, chain: &mut Vec<&'a Pci>, f: &mut impl FnMut(&[&'a Pci])) {
    chain.push(p);
    f(chain);
    for c in &p.children {
        visit(c, chain, f);
    }
    chain.pop();
}

/// Make sure the device at the end of `chain` (detected, top first) is in
/// `out`: where the file has it, else under the deepest ancestor the file
/// has, else under NUMA node `numaid`.
fn place(out: &mut System, numaid: i32, chain: &[&Pci], notes: &mut Vec<String>) {
    let dev = chain[chain.len() - 1];
    if find_pci_mut(out, &dev.busid).is_some() {
        return;
    }
    let mut at = None;
    for (i, anc) in chain.iter().enumerate().rev().skip(1) {
        if find_pci_mut(out, &anc.busid).is_some() {
            at = Some(i);
            break;
        }
    }
    // The part of the chain the file lacks, as one subtree (devices only:
    // what hangs below them is merged on its own).
    let start = at.map_or(0, |i| i + 1);
    let mut sub: Option<Pci> = None;
    for p in chain[start..].iter().rev() {
        let mut q = Pci {
            children: Vec::new(),
            gpu: None,
            extra_gpus: Vec::new(),
            nic: None,
            ..(*p).clone()
        };
        if let Some(s) = sub.take() {
            q.children.push(s);
        }
        sub = Some(q);
    }
    let Some(sub) = sub else { return };
    notes.push(format!(
        "{} (a {}): not in the file; placed as detected",
        dev.busid,
        if dev.gpu.is_some() { "GPU" } else { "NIC" }
    ));
    match at {
        Some(i) => {
            if let Some(parent) = find_pci_mut(out, &chain[i].busid) {
                parent.children.push(sub);
            }
        }
        None => {
            let ci = out
                .cpus
                .iter()
                .position(|c| c.numaid == numaid)
                .unwrap_or(0);
            if let Some(c) = out.cpus.get_mut(ci) {
                c.pci.push(sub);
            }
        }
    }
}

fn find_pci_mut<'a>(sys: &'a mut System, busid: &str) -> Option<&'a mut Pci> {
    fn go<'a>(p: &'a mut Pci, busid: &str) -> Option<&'a mut Pci> {
        if p.busid.eq_ignore_ascii_case(busid) {
            return Some(p);
        }
        p.children.iter_mut().find_map(|c| go(c, busid))
    }
    sys.cpus
        .iter_mut()
        .flat_map(|c| c.pci.iter_mut())
        .find_map(|p| go(p, busid))
}

fn find_net_mut<'a>(sys: &'a mut System, name: &str) -> Option<&'a mut Net> {
    fn go<'a>(p: &'a mut Pci, name: &str) -> Option<&'a mut Net> {
        if let Some(n) = p
            .nic
            .as_mut()
            .and_then(|n| n.nets.iter_mut().find(|x| x.name == name))
        {
            return Some(n);
        }
        p.children.iter_mut().find_map(|c| go(c, name))
    }
    for c in &mut sys.cpus {
        for p in &mut c.pci {
            if let Some(n) = go(p, name) {
                return Some(n);
            }
        }
        if let Some(n) = c
            .nics
            .iter_mut()
            .flat_map(|n| n.nets.iter_mut())
            .find(|x| x.name == name)
        {
            return Some(n);
        }
    }
    None
}

/// A detected port: into the file's port of that name, else into the NIC
/// of the PCI function `busid` (already in `out`).
fn attach_net(out: &mut System, busid: &str, net: &Net, notes: &mut Vec<String>) {
    if let Some(f) = find_net_mut(out, &net.name) {
        fill_net(f, net, notes);
        return;
    }
    if let Some(p) = find_pci_mut(out, busid) {
        p.nic
            .get_or_insert_with(Nic::default)
            .nets
            .push(net.clone());
    }
}

fn fill<T: Clone>(a: &mut Option<T>, b: &Option<T>) {
    if a.is_none() {
        a.clone_from(b);
    }
}

fn fill_cpu(c: &mut Cpu, d: &Cpu) {
    fill(&mut c.affinity, &d.affinity);
    fill(&mut c.arch, &d.arch);
    fill(&mut c.vendor, &d.vendor);
    fill(&mut c.familyid, &d.familyid);
    fill(&mut c.modelid, &d.modelid);
    for (k, v) in &d.attrs {
        c.attrs.entry(k.clone()).or_insert_with(|| v.clone());
    }
}

fn fill_pci(p: &mut Pci, d: &Pci) {
    fill(&mut p.class, &d.class);
    fill(&mut p.vendor, &d.vendor);
    fill(&mut p.device, &d.device);
    fill(&mut p.subsystem_vendor, &d.subsystem_vendor);
    fill(&mut p.subsystem_device, &d.subsystem_device);
    fill(&mut p.link_speed, &d.link_speed);
    fill(&mut p.link_width, &d.link_width);
    fill(&mut p.hostbridge, &d.hostbridge);
}

fn fill_gpu(g: &mut Gpu, d: &Gpu) {
    fill(&mut g.dev, &d.dev);
    fill(&mut g.sm, &d.sm);
    fill(&mut g.rank, &d.rank);
    fill(&mut g.gdr, &d.gdr);
    if g.nvlinks.is_empty() {
        g.nvlinks.clone_from(&d.nvlinks);
    }
    if g.c2c.is_empty() {
        g.c2c.clone_from(&d.c2c);
    }
}

/// The file's port `n` with what detection found of it (`d`): detection
/// decides whether it is an RDMA device; the file's other attributes win.
fn fill_net(n: &mut Net, d: &Net, notes: &mut Vec<String>) {
    if let Some(r) = d.rdma {
        if n.is_rdma() != r {
            notes.push(format!(
                "{}: the file makes it {}; detection found {}: taken as detected",
                n.name,
                if r {
                    "a kernel interface"
                } else {
                    "an RDMA device"
                },
                if r {
                    "an RDMA device"
                } else {
                    "a kernel interface with no RDMA device"
                }
            ));
        }
        n.rdma = Some(r);
    }
    fill(&mut n.dev, &d.dev);
    fill(&mut n.speed, &d.speed);
    fill(&mut n.port, &d.port);
    fill(&mut n.latency, &d.latency);
    fill(&mut n.guid, &d.guid);
    fill(&mut n.maxconn, &d.maxconn);
    fill(&mut n.gdr, &d.gdr);
    fill(&mut n.coll, &d.coll);
    fill(&mut n.link_layer, &d.link_layer);
    fill(&mut n.state, &d.state);
}

/// What detection found: GPUs (bus ids), ports (names), and the PCI
/// functions it found a NIC on, with their ports.
struct Seen<'a> {
    gpus: &'a [String],
    nets: &'a [String],
    nics: &'a [(String, Vec<String>)],
}

/// Drop, below `p`, the file's devices of the kinds detection can see that
/// it did not see (`known`: GPUs, RDMA ports, kernel interfaces), and on a
/// function where detection found a NIC, the file's ports it did not find.
fn trim_devices(
    p: &mut Pci,
    seen_by: &Seen,
    known: (bool, bool, bool),
    dropped: &mut Vec<String>,
    notes: &mut Vec<String>,
) {
    let (gpus_known, rdma_known, sock_known) = known;
    let (gpus, nets) = (seen_by.gpus, seen_by.nets);
    let seen = gpus.iter().any(|b| b.eq_ignore_ascii_case(&p.busid));
    // The ports detection found on this function, where it found a NIC.
    let detected_here: Option<&Vec<String>> = seen_by
        .nics
        .iter()
        .find(|(b, _)| b.eq_ignore_ascii_case(&p.busid))
        .map(|(_, names)| names);
    if gpus_known && !seen && p.is_gpu() {
        dropped.push(format!("GPU {}", p.busid));
        p.gpu = None;
        p.extra_gpus.clear();
        p.attrs.insert("trimmed".into(), "1".into());
    }
    let bare_nic = p.nic.is_none() && p.is_nic();
    let busid = p.busid.clone();
    match &mut p.nic {
        Some(nic) => {
            nic.nets.retain(|x| {
                if let (Some(found), false) = (detected_here, nets.contains(&x.name)) {
                    // Detection found this NIC and knows its ports: one
                    // the file names that it did not find is not there.
                    notes.push(format!(
                        "the file's port {} on {busid} is not on this host: detection found that NIC with {} only, {}: dropped{}",
                        x.name,
                        found.join(", "),
                        if x.is_rdma() { "no RDMA device on it" } else { "no interface of that name" },
                        if x.is_rdma() { " (no ib through it)" } else { "" },
                    ));
                    return false;
                }
                let keep =
                    nets.contains(&x.name) || !(if x.is_rdma() { rdma_known } else { sock_known });
                if !keep {
                    dropped.push(format!("port {} ({busid})", x.name));
                }
                keep
            });
            if nic.nets.is_empty() {
                p.nic = None;
                p.attrs.insert("trimmed".into(), "1".into());
            }
        }
        None if bare_nic && detected_here.is_some() => {
            // Detection found a NIC here whose ports the file lists
            // elsewhere: no placeholder port stands for it.
            notes.push(format!(
                "the file's NIC {busid}: detection found its ports ({}) where the file has them: not planned again as an RDMA placeholder",
                detected_here.map(|v| v.join(", ")).unwrap_or_default()
            ));
            p.attrs.insert("trimmed".into(), "1".into());
        }
        None if bare_nic && rdma_known => {
            // A bare NIC-class endpoint of a partial file that detection
            // did not fill: no NIC the RDMA transport can use is there.
            dropped.push(format!("NIC {}", p.busid));
            p.attrs.insert("trimmed".into(), "1".into());
        }
        None => {}
    }
    for c in &mut p.children {
        trim_devices(c, seen_by, known, dropped, notes);
    }
}

/// Keep `p` when a GPU, a NIC or a kept endpoint is at or below it; drop
/// trimmed endpoints and branches left empty.
fn prune_empty(p: &mut Pci) -> bool {
    p.children.retain_mut(prune_empty);
    let trimmed = p.attrs.remove("trimmed").is_some();
    let device = p.gpu.is_some() || p.nic.is_some();
    let bare_endpoint = !trimmed && (p.is_gpu() || p.is_nic());
    device || bare_endpoint || !p.children.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topo::xml::from_xml;

    fn sys(text: &str) -> System {
        from_xml("t.xml", text).unwrap()
    }

    /// A partial file (only bus ids and classes) placed the detected NIC
    /// and GPU; the file's place wins, detection's attributes fill in.
    #[test]
    fn partial_file_places_detected_devices() {
        let file = sys(r#"<system version="1"><cpu numaid="0" affinity="0000ffff">
            <pci busid="ffff:ff:01.0" class="0x060400" link_speed="16 GT/s" link_width="16">
              <pci busid="0001:00:00.0" class="0x030200" link_speed="16 GT/s" link_width="16"/>
              <pci busid="0101:00:00.0" class="0x020700" link_speed="16 GT/s" link_width="16"/>
              <pci busid="0102:00:00.0" class="0x020700"/>
            </pci></cpu></system>"#);
        let det = sys(
            r#"<system version="1"><cpu numaid="0" affinity="000000ff" vendor="AuthenticAMD">
            <pci busid="0001:00:00.0" class="0x030200" link_speed="8 GT/s" link_width="16"><gpu dev="0" sm="80"/></pci>
            <pci busid="0101:00:00.0" class="0x020700"><nic><net name="mlx5_0" dev="0" speed="200000" port="1" rdma="1"/></nic></pci>
            <pci busid="0000:00:08.0" class="0x020000"><nic><net name="eth0" dev="0" rdma="0"/></nic></pci>
            </cpu></system>"#,
        );
        let (m, notes) = merge(&file, &det);
        let c = &m.cpus[0];
        assert_eq!(c.affinity.as_ref().unwrap().to_list(), "0-15", "file wins");
        assert_eq!(c.vendor.as_deref(), Some("AuthenticAMD"), "detection fills");
        let sw = &c.pci[0];
        assert_eq!(sw.busid, "ffff:ff:01.0");
        let gpu = &sw.children[0];
        assert_eq!(gpu.link_speed.as_deref(), Some("16 GT/s"), "file wins");
        assert_eq!(gpu.gpu.as_ref().unwrap().sm, Some(80));
        let nic = &sw.children[1];
        assert_eq!(nic.nic.as_ref().unwrap().nets[0].name, "mlx5_0");
        assert_eq!(sw.children.len(), 2, "undetected 0102:00:00.0 trimmed");
        assert!(
            notes.iter().any(|n| n.contains("NIC 0102:00:00.0")),
            "{notes:?}"
        );
        assert_eq!(c.pci[1].busid, "0000:00:08.0", "eth0 added as detected");
    }

    /// Detection decides whether a port is an RDMA device: a file's port
    /// marked RDMA (braid's `rdma="1"`, as `braid-topo --xml` writes it on
    /// another machine) that detection found as a kernel interface is one;
    /// the file's other attributes still win.
    #[test]
    fn detection_decides_rdma() {
        let file = sys(r#"<system version="1"><cpu numaid="0">
            <pci busid="0000:00:03.0" class="0x020000"><nic><net name="eth0" dev="0" speed="200000" port="1" rdma="1"/></nic></pci>
            </cpu></system>"#);
        assert!(file.nets()[0].net.is_rdma(), "the file alone: RDMA");
        let det = sys(r#"<system version="1"><cpu numaid="0" affinity="3">
            <pci busid="0000:00:03.0" class="0x020000"><nic><net name="eth0" dev="0" speed="10000" rdma="0"/></nic></pci>
            </cpu></system>"#);
        let (m, notes) = merge(&file, &det);
        let n = &m.nets()[0].net;
        assert!(!n.is_rdma(), "{n:?}");
        assert_eq!(n.speed, Some(200_000), "the file's speed wins");
        assert!(
            notes
                .iter()
                .any(|x| x.contains("eth0") && x.contains("no RDMA device")),
            "{notes:?}"
        );
    }

    /// Where detection sees nothing of a kind, the file's devices stay.
    #[test]
    fn nothing_detected_keeps_the_file() {
        let file = sys(r#"<system version="1"><cpu numaid="0">
            <pci busid="0001:00:00.0" class="0x030200"><gpu dev="0" sm="90"/></pci>
            <pci busid="0002:00:00.0" class="0x020700"><nic><net name="mlx5_0" dev="0" port="1"/></nic></pci>
            </cpu></system>"#);
        let det = sys(r#"<system version="1"><cpu numaid="0" affinity="3"/></system>"#);
        let (m, notes) = merge(&file, &det);
        assert_eq!(m.gpus().len(), 1);
        assert_eq!(m.nets().len(), 1);
        assert!(notes.iter().any(|n| n.contains("no GPU")), "{notes:?}");
    }
}
