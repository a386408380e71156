//! The JSON written by `-J` (and by `import-mpi`), read back by `plot`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::format::Meas;

/// One measurement, as stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JsonMeas {
    pub time_us: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    /// Wrong elements summed over ranks; null when not checked.
    pub wrong: Option<u64>,
    /// Timed iterations (`-n`, or as many as `-D` took); 0 where unknown
    /// (files from before it, MPI's CSV).
    #[serde(default)]
    pub iters: u64,
}

impl From<&Meas> for JsonMeas {
    fn from(m: &Meas) -> Self {
        JsonMeas {
            time_us: m.time_us,
            algbw_gbps: m.algbw,
            busbw_gbps: m.busbw,
            wrong: m.wrong,
            iters: m.iters,
        }
    }
}

/// One table row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Benchmark name (`all_reduce`, `all_gather`, ...).
    pub collective: String,
    pub nranks: u32,
    /// Bytes, as nccl-tests prints them (the whole array for all_gather,
    /// reduce_scatter, alltoall).
    pub size: u64,
    /// Elements, as nccl-tests prints them (per rank for all_gather,
    /// reduce_scatter; per peer for alltoall).
    pub count: u64,
    #[serde(rename = "type")]
    pub dtype: String,
    pub redop: String,
    /// -1 for collectives without a root.
    pub root: i64,
    /// Sweep number (`-N`), from 0.
    #[serde(default)]
    pub cycle: u32,
    /// null where not measured (e.g. in-place alltoall).
    pub out_of_place: Option<JsonMeas>,
    pub in_place: Option<JsonMeas>,
    /// The algorithm braid ran and what chose it (`rd (model)`), where the
    /// collective has a choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<String>,
}

/// A whole run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// `braid-perf`, or `mpi_coll_bench` for imported Open MPI rows.
    pub tool: String,
    pub version: String,
    /// Name of the run in plot legends (`--label`).
    pub label: String,
    /// The command line, for the record.
    #[serde(default)]
    pub command: String,
    /// How the buffers were allocated and touched.
    #[serde(default)]
    pub buffers: String,
    /// Host name and transports per peer of each rank (braid runs).
    #[serde(default)]
    pub ranks: Vec<String>,
    pub rows: Vec<Row>,
    /// Mean busbw over every measurement, like the footer.
    pub avg_busbw_gbps: f64,
    /// Total wrong elements (the footer's out-of-bounds values).
    pub out_of_bounds: u64,
}

impl Report {
    /// Read a report, with a message naming the file on failure.
    pub fn load(path: &Path) -> Result<Report, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| {
            format!(
                "{} is not a braid-perf JSON report ({e}); write one with braid-perf -J or import-mpi",
                path.display()
            )
        })
    }

    /// Write the report as pretty JSON.
    pub fn save(&self, path: &Path) -> Result<(), String> {
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| format!("cannot encode the JSON report: {e}"))?;
        std::fs::write(path, text + "\n")
            .map_err(|e| format!("cannot write {}: {e}", path.display()))
    }
}

/// mpi_coll_bench's collective names → braid-perf's.
fn mpi_coll_name(c: &str) -> String {
    match c {
        "allreduce" => "all_reduce",
        "allgather" => "all_gather",
        "reducescatter" => "reduce_scatter",
        "bcast" => "broadcast",
        "reduce" => "reduce",
        "alltoall" => "alltoall",
        other => other,
    }
    .to_string()
}

/// Convert the CSV of `tools/peers/mpi-best.sh` (`mpi_coll_bench -o`)
/// into a report. Columns are found by header name: tag, impl, nranks,
/// coll, size, count, type, redop, root, time_us, algbw_GBps, busbw_GBps,
/// wrong (extra columns are ignored).
pub fn import_mpi_csv(text: &str, label: Option<&str>) -> Result<Report, String> {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<&str> = lines
        .next()
        .ok_or("the CSV is empty: expected mpi_coll_bench's header line first")?
        .split(',')
        .map(str::trim)
        .collect();
    let col = |name: &str| {
        header.iter().position(|h| *h == name).ok_or_else(|| {
            format!("the CSV has no '{name}' column: is it mpi_coll_bench's output (mpi-best.sh OUTDIR/mpi.csv)?")
        })
    };
    let (c_tag, c_nr, c_coll, c_size, c_count) = (
        col("tag")?,
        col("nranks")?,
        col("coll")?,
        col("size")?,
        col("count")?,
    );
    let (c_type, c_redop, c_root, c_time, c_alg, c_bus, c_wrong) = (
        col("type")?,
        col("redop")?,
        col("root")?,
        col("time_us")?,
        col("algbw_GBps")?,
        col("busbw_GBps")?,
        col("wrong")?,
    );
    let mut rows = Vec::new();
    let mut tag = None;
    for (i, line) in lines.enumerate() {
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let lineno = i + 2;
        let get = |c: usize| {
            f.get(c)
                .copied()
                .ok_or_else(|| format!("line {lineno}: too few columns"))
        };
        fn num<T: std::str::FromStr>(v: &str, what: &str, lineno: usize) -> Result<T, String> {
            v.parse()
                .map_err(|_| format!("line {lineno}: {what} '{v}' is not a number"))
        }
        if f.len() == header.len() && f.iter().zip(&header).all(|(a, b)| a == b) {
            continue; // a repeated header from concatenated files
        }
        tag.get_or_insert_with(|| get(c_tag).unwrap_or("").to_string());
        let wrong: i64 = num(get(c_wrong)?, "wrong", lineno)?;
        let collective = mpi_coll_name(get(c_coll)?);
        let meas = Some(JsonMeas {
            time_us: num(get(c_time)?, "time_us", lineno)?,
            algbw_gbps: num(get(c_alg)?, "algbw_GBps", lineno)?,
            busbw_gbps: num(get(c_bus)?, "busbw_GBps", lineno)?,
            wrong: u64::try_from(wrong).ok(),
            iters: 0,
        });
        // MPI_Bcast works in place (one buffer): its rows compare with
        // braid's in-place Broadcast; every other MPI call here is out of
        // place.
        let (out_of_place, in_place) = if collective == "broadcast" {
            (None, meas)
        } else {
            (meas, None)
        };
        rows.push(Row {
            collective,
            nranks: num(get(c_nr)?, "nranks", lineno)?,
            size: num(get(c_size)?, "size", lineno)?,
            count: num(get(c_count)?, "count", lineno)?,
            dtype: get(c_type)?.to_string(),
            redop: get(c_redop)?.to_string(),
            root: num(get(c_root)?, "root", lineno)?,
            cycle: 0,
            out_of_place,
            in_place,
            algorithm: None,
        });
    }
    if rows.is_empty() {
        return Err("the CSV has a header but no rows".into());
    }
    let n = rows.len() as f64;
    let meas = |r: &Row| r.out_of_place.clone().or_else(|| r.in_place.clone());
    let avg = rows
        .iter()
        .filter_map(meas)
        .map(|m| m.busbw_gbps)
        .sum::<f64>()
        / n;
    let oob = rows.iter().filter_map(|r| meas(r)?.wrong).sum();
    let label = label
        .map(str::to_string)
        .or_else(|| {
            tag.filter(|t| !t.is_empty())
                .map(|t| format!("openmpi {t}"))
        })
        .unwrap_or_else(|| "openmpi".into());
    Ok(Report {
        tool: "mpi_coll_bench".into(),
        version: String::new(),
        label,
        command: "import-mpi".into(),
        buffers:
            "see mpi_coll_bench's header (mpi-best.sh: glibc malloc on transparent huge pages)"
                .into(),
        ranks: Vec::new(),
        rows,
        avg_busbw_gbps: avg,
        out_of_bounds: oob,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const CSV: &str = "tag,impl,nranks,coll,size,count,type,redop,root,time_us,time_max_us,algbw_GBps,busbw_GBps,wrong,iters,pagefaults_per_iter
np2_shm_thp,mpi,2,allreduce,8,2,float,sum,-1,0.412,0.500,0.0194,0.0194,0,1000,0.0
np2_shm_thp,mpi,2,allgather,1048576,262144,float,none,-1,150.000,160.000,6.9905,3.4953,0,100,0.0
np2_shm_thp,mpi,2,bcast,1048576,262144,float,none,0,30.000,31.000,34.9525,34.9525,0,100,0.0
";

    #[test]
    fn imports_mpi_coll_bench_csv() {
        let r = import_mpi_csv(CSV, None).unwrap();
        assert_eq!(r.label, "openmpi np2_shm_thp");
        assert_eq!(r.rows.len(), 3);
        assert_eq!(r.rows[0].collective, "all_reduce");
        // MPI_Bcast works in place: compared with braid's in-place rows.
        assert_eq!(r.rows[2].collective, "broadcast");
        assert!(r.rows[2].out_of_place.is_none());
        assert_eq!(r.rows[2].in_place.as_ref().unwrap().busbw_gbps, 34.9525);
        assert!((r.avg_busbw_gbps - (0.0194 + 3.4953 + 34.9525) / 3.0).abs() < 1e-9);
        assert_eq!(r.rows[1].collective, "all_gather");
        assert_eq!(r.rows[1].size, 1048576);
        let m = r.rows[1].out_of_place.as_ref().unwrap();
        assert_eq!(m.busbw_gbps, 3.4953);
        assert_eq!(m.wrong, Some(0));
        let r = import_mpi_csv(CSV, Some("openmpi")).unwrap();
        assert_eq!(r.label, "openmpi");
        // Round trip through JSON.
        let back: Report = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn bad_csv_says_what_is_wrong() {
        assert!(import_mpi_csv("", None).unwrap_err().contains("empty"));
        assert!(import_mpi_csv("a,b\n1,2\n", None)
            .unwrap_err()
            .contains("column"));
        let bad = CSV.replace("0.412", "fast");
        assert!(import_mpi_csv(&bad, None).unwrap_err().contains("line 2"));
        let header_only = CSV.lines().next().unwrap();
        assert!(import_mpi_csv(header_only, None).is_err());
    }
}
