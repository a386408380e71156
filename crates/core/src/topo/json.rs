//! JSON export of the full model (and import of braid's own JSON).
//!
//! The document holds `system` (the model, field for field), `nodes` and
//! `links` (the graph), and `paths` between every pair of GPUs, NICs and
//! CPUs (type, bottleneck GB/s, hops).

use serde_json::{json, Value};

use super::graph::{NodeKind, Topology};
use super::model::System;
use super::TopoError;

/// The JSON document for a topology.
pub fn to_value(t: &Topology) -> Value {
    let ends: Vec<usize> = t
        .gpus
        .iter()
        .chain(&t.nics)
        .chain(&t.cpus)
        .copied()
        .collect();
    let mut paths = Vec::new();
    for &a in &ends {
        for &b in &ends {
            if a == b {
                continue;
            }
            if let Some(p) = t.path(a, b) {
                paths.push(json!({
                    "from": t.nodes[a].id,
                    "to": t.nodes[b].id,
                    "type": p.kind.name(),
                    "bw_gbps": round2(p.bw),
                    "hops": p.hops(),
                }));
            }
        }
    }
    let links: Vec<Value> = t
        .links
        .iter()
        .enumerate()
        .flat_map(|(a, ls)| {
            ls.iter().map(move |l| {
                json!({"from": a, "to": l.to, "type": format!("{:?}", l.kind).to_uppercase(),
                       "bw_gbps": round2(l.bw), "count": l.count})
            })
        })
        .collect();
    let nodes: Vec<Value> = t
        .nodes
        .iter()
        .map(|n| {
            json!({"kind": format!("{:?}", n.kind), "id": n.id, "numaid": n.numaid,
                   "hostbridge": n.hostbridge})
        })
        .collect();
    let _ = NodeKind::Cpu;
    json!({
        "format": "braid-topo/1",
        "system": serde_json::to_value(&t.system).unwrap_or(Value::Null),
        "nodes": nodes,
        "links": links,
        "paths": paths,
    })
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Pretty JSON text for a topology.
pub fn to_json(t: &Topology) -> String {
    serde_json::to_string_pretty(&to_value(t)).unwrap_or_default() + "\n"
}

/// Read braid JSON: a full document (with `system`) or a bare model.
pub fn from_json(file: &str, text: &str) -> Result<System, TopoError> {
    let v: Value = serde_json::from_str(text).map_err(|e| TopoError::Parse {
        file: file.into(),
        line: e.line(),
        msg: e.to_string(),
    })?;
    let sys = v.get("system").cloned().unwrap_or(v);
    serde_json::from_value(sys).map_err(|e| TopoError::Parse {
        file: file.into(),
        line: 1,
        msg: format!("not a braid topology: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topo::xml;

    /// Found reading the decoder, confirmed with the `topo_json` fuzz target: a CPU id near `u32::MAX` was
    /// accepted, and exporting the model as XML (`to_mask`) then allocated
    /// 512 MiB for one word per 32 CPUs.
    #[test]
    fn huge_cpu_id_is_refused() {
        let input: &[u8] =
            b"{\"cpus\":[{\"numaid\":0,\"affinity\":[4294967295],\"pci\":[],\"nics\":[]}]}";
        let e = from_json("t.json", std::str::from_utf8(input).unwrap()).unwrap_err();
        assert!(
            e.to_string().contains("CPU id 4294967295 is out of range"),
            "{e}"
        );
        // Ids in range are kept, sorted and deduplicated, and export.
        let ok = b"{\"cpus\":[{\"numaid\":0,\"affinity\":[65535,3,3],\"pci\":[],\"nics\":[]}]}";
        let sys = from_json("t.json", std::str::from_utf8(ok).unwrap()).unwrap();
        let aff = sys.cpus[0].affinity.as_ref().unwrap();
        assert_eq!(aff.0, vec![3, 65535]);
        assert_eq!(xml::from_xml("x.xml", &xml::to_xml(&sys)).unwrap(), sys);
    }

    #[test]
    fn masks_and_lists_refuse_huge_ids() {
        use crate::topo::CpuSet;
        assert!(CpuSet::from_list("4294967295").is_none());
        assert!(CpuSet::from_list("65530-65536").is_none());
        assert_eq!(
            CpuSet::from_list("65534-65535").unwrap().0,
            vec![65534, 65535]
        );
        // Bit 0 of group 2048 is CPU 65536.
        let mut groups = vec!["00000000"; 2049];
        groups[0] = "00000001";
        assert!(CpuSet::from_mask(&groups.join(",")).is_none());
        groups[0] = "00000000";
        groups[1] = "80000000";
        assert_eq!(CpuSet::from_mask(&groups.join(",")).unwrap().0, vec![65535]);
    }
}
