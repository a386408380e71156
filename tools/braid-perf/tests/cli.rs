//! End-to-end tests of the built `braid-perf` binary: real ranks (processes)
//! over shared memory started with `-np`, nccl-tests' table, JSON, plots,
//! and failure exit codes.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_braid-perf");

/// Launcher variables that would make braid-perf join some other job.
const LAUNCH_VARS: &[&str] = &[
    "BRAID_UNIQUE_ID",
    "BRAID_RANK",
    "BRAID_NRANKS",
    "RANK",
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "BRAID_PERF_FAULT",
];

fn perf(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(BIN);
    c.args(args);
    for v in LAUNCH_VARS {
        c.env_remove(v);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run braid-perf")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("braid-perf-test-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

const HEADER: &str = "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong";

/// Check nccl-tests' shape and that no row has wrong elements; returns the
/// data rows split into columns.
fn check_table(out: &str, in_place: bool) -> Vec<Vec<String>> {
    assert!(out.contains(HEADER), "no table header in:\n{out}");
    assert!(
        out.contains("(B)    (elements)"),
        "no units line in:\n{out}"
    );
    assert!(
        out.contains("# Out of bounds values : 0 OK"),
        "footer not OK:\n{out}"
    );
    assert!(
        out.contains("# Avg bus bandwidth    : "),
        "no avg busbw:\n{out}"
    );
    assert!(
        out.contains("#  Rank  0 Group  0 Pid"),
        "no rank lines:\n{out}"
    );
    let rows: Vec<Vec<String>> = out
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect();
    for r in &rows {
        assert_eq!(r.len(), 13, "row {r:?}");
        assert_eq!(r[8], "0", "out-of-place #wrong in {r:?}");
        if in_place {
            assert_eq!(r[12], "0", "in-place #wrong in {r:?}");
        } else {
            assert_eq!(r[9..], ["N/A", "N/A", "N/A", "N/A"], "in-place of {r:?}");
        }
    }
    rows
}

fn run_bench(bench: &str, in_place: bool) {
    for np in ["2", "3"] {
        let t0 = Instant::now();
        let o = perf(
            &[
                bench, "-np", np, "-b", "8", "-e", "64K", "-f", "4", "-n", "3", "-w", "1", "-T",
                "30",
            ],
            &[],
        );
        let (out, err) = text(&o);
        assert!(
            o.status.success(),
            "{bench} -np {np}: {:?}\n{out}\n{err}",
            o.status
        );
        let rows = check_table(&out, in_place);
        // 8, 32, ..., 32K.
        assert_eq!(rows.len(), 7, "{bench} -np {np}:\n{out}");
        assert!(out.contains(&format!("# nranks {np} ")), "{out}");
        // Only rank 0 prints: one table.
        assert_eq!(out.matches(HEADER).count(), 1, "{out}");
        eprintln!("{bench} -np {np}: {:?}", t0.elapsed());
    }
}

#[test]
fn all_reduce_np2_np3() {
    run_bench("all_reduce", true);
}

#[test]
fn all_gather_np2_np3() {
    run_bench("all_gather", true);
}

#[test]
fn reduce_scatter_np2_np3() {
    run_bench("reduce_scatter", true);
}

#[test]
fn broadcast_np2_np3() {
    run_bench("broadcast", true);
}

#[test]
fn reduce_np2_np3() {
    run_bench("reduce", true);
}

#[test]
fn alltoall_np2_np3() {
    run_bench("alltoall", false);
}

#[test]
fn sendrecv_np2_np3() {
    run_bench("sendrecv", false);
}

#[test]
fn every_type_op_and_root() {
    let o = perf(
        &[
            "all_reduce",
            "-np",
            "2",
            "-b",
            "8",
            "-e",
            "512",
            "-f",
            "8",
            "-n",
            "1",
            "-w",
            "0",
            "-d",
            "all",
            "-o",
            "all",
            "-T",
            "30",
        ],
        &[],
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let rows = check_table(&out, true);
    assert_eq!(rows.len(), 10 * 5 * 3);
    for t in [
        "int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "bfloat16", "float",
        "double",
    ] {
        for op in ["sum", "prod", "min", "max", "avg"] {
            assert!(rows.iter().any(|r| r[2] == t && r[3] == op), "{t} {op}");
        }
    }
    let o = perf(
        &[
            "reduce", "-np", "3", "-b", "64", "-e", "64", "-n", "1", "-w", "0", "-d", "all", "-o",
            "all", "-r", "all", "-T", "30",
        ],
        &[],
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let rows = check_table(&out, true);
    assert_eq!(rows.len(), 10 * 5 * 3);
    assert!(rows.iter().any(|r| r[4] == "2"));
}

#[test]
fn json_output_has_every_row_and_plot_is_a_png() {
    let (json, png) = (tmp("ag.json"), tmp("ag.png"));
    let o = perf(
        &[
            "all_gather",
            "-np",
            "2",
            "-b",
            "1K",
            "-e",
            "64K",
            "-f",
            "2",
            "-n",
            "2",
            "-w",
            "1",
            "-J",
            json.to_str().unwrap(),
            "--plot",
            png.to_str().unwrap(),
            "--label",
            "shm",
            "-T",
            "30",
        ],
        &[],
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["label"], "shm");
    assert_eq!(v["tool"], "braid-perf");
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 7);
    assert_eq!(rows[0]["collective"], "all_gather");
    assert_eq!(rows[0]["size"], 1024);
    assert_eq!(rows[0]["count"], 128);
    assert_eq!(rows[0]["nranks"], 2);
    assert_eq!(rows[0]["type"], "float");
    assert_eq!(rows[0]["out_of_place"]["wrong"], 0);
    assert!(rows[6]["in_place"]["busbw_gbps"].as_f64().unwrap() > 0.0);
    assert_png(&png);

    // Overlay this run with an Open MPI CSV.
    let csv = tmp("mpi.csv");
    std::fs::write(
        &csv,
        "tag,impl,nranks,coll,size,count,type,redop,root,time_us,time_max_us,algbw_GBps,busbw_GBps,wrong,iters,pagefaults_per_iter\n\
         np2,mpi,2,allgather,1024,256,float,none,-1,1.5,1.6,0.68,0.34,0,100,0.0\n\
         np2,mpi,2,allgather,65536,16384,float,none,-1,20.0,21.0,3.27,1.64,0,100,0.0\n",
    )
    .unwrap();
    let mpi_json = tmp("mpi.json");
    let o = perf(
        &[
            "import-mpi",
            csv.to_str().unwrap(),
            "--label",
            "openmpi",
            "-o",
            mpi_json.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{:?}", text(&o));
    let overlay = tmp("overlay.png");
    let o = perf(
        &[
            "plot",
            json.to_str().unwrap(),
            mpi_json.to_str().unwrap(),
            "-o",
            overlay.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{:?}", text(&o));
    assert_png(&overlay);
    // A file that is not a report: a clear error.
    let o = perf(
        &[
            "plot",
            csv.to_str().unwrap(),
            "-o",
            overlay.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).1.contains("not a braid-perf JSON report"));
    // Its own files only: tests run at once share the directory (removing
    // it failed the -D test's JSON write once).
    for f in [&json, &png, &csv, &mpi_json, &overlay] {
        let _ = std::fs::remove_file(f);
    }
}

fn assert_png(p: &Path) {
    let b = std::fs::read(p).unwrap();
    assert!(b.len() > 1000, "{} is {} bytes", p.display(), b.len());
    assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n");
    // IHDR: width and height.
    let w = u32::from_be_bytes(b[16..20].try_into().unwrap());
    let h = u32::from_be_bytes(b[20..24].try_into().unwrap());
    assert!(w >= 800 && h >= 600, "{w}x{h}");
}

#[test]
fn wrong_results_fail_the_run() {
    let o = perf(
        &[
            "all_reduce",
            "-np",
            "2",
            "-b",
            "64",
            "-e",
            "256",
            "-f",
            "4",
            "-n",
            "1",
            "-T",
            "30",
        ],
        &[("BRAID_PERF_FAULT", "wrong:1")],
    );
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}\n{err}");
    assert!(out.contains("# Out of bounds values : 4 FAILED"), "{out}");
    assert!(err.contains("wrong elements"), "{err}");
    // -c 0: nothing checked, N/A.
    let o = perf(
        &[
            "all_reduce",
            "-np",
            "2",
            "-b",
            "64",
            "-e",
            "64",
            "-n",
            "1",
            "-c",
            "0",
            "-T",
            "30",
        ],
        &[("BRAID_PERF_FAULT", "wrong:1")],
    );
    let (out, _) = text(&o);
    assert!(o.status.success());
    assert!(
        out.lines()
            .any(|l| l.ends_with("   N/A") && !l.starts_with('#')),
        "{out}"
    );
}

#[test]
fn a_dead_rank_stops_the_run() {
    let t0 = Instant::now();
    let o = perf(
        &[
            "all_reduce",
            "-np",
            "3",
            "-b",
            "8",
            "-e",
            "1M",
            "-f",
            "2",
            "-n",
            "5",
            "-T",
            "60",
        ],
        &[("BRAID_PERF_FAULT", "exit:1")],
    );
    let (out, err) = text(&o);
    // Which rank the launcher sees fail first is a race: the dying rank
    // (exit 3) or a survivor whose operation failed because of it (exit 1).
    let code = o.status.code();
    assert!(
        matches!(code, Some(1) | Some(3)),
        "exit {code:?}\n{out}\n{err}"
    );
    assert!(err.contains("rank 1: exiting on purpose"), "{err}");
    assert!(err.contains("of 3 failed"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
}

#[test]
fn usage_errors_exit_2_with_a_hint() {
    for (args, says) in [
        (&["all_reduce", "-b", "1Q"][..], "not a size"),
        (&["all_reduce", "-d", "complex"], "unknown datatype"),
        (&["all_reduce", "-o", "xor"], "unknown reduction"),
        (&["all_reduce", "--frobnicate"], "unknown option"),
        (&["all_reduce", "-b", "1M", "-e", "1K"], "minbytes"),
        (&["al_reduce"], "unknown benchmark"),
        (&["all_reduce", "-b", "8"], "-np N"),
        (&["broadcast", "-np", "2", "-r", "2"], "root out of range"),
        (&["all_reduce", "-D", "0"], "positive number of seconds"),
        (&["all_reduce", "-D", "soon"], "seconds"),
    ] {
        let o = perf(args, &[]);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    let o = perf(&["--help"], &[]);
    assert!(o.status.success());
    assert!(text(&o).0.contains("--agg_iters"));
}

/// `-D` times each size for about that long: more iterations than `-n`,
/// as many on every rank (else the ranks' calls would not match and the
/// run would fail), the count in the JSON output; without it, `-n`.
#[test]
fn duration_times_each_size_for_about_that_long() {
    for (dur, json) in [(Some("0.1"), tmp("dur.json")), (None, tmp("nodur.json"))] {
        let mut args = vec![
            "all_reduce",
            "-np",
            "2",
            "-b",
            "8",
            "-e",
            "64",
            "-f",
            "8",
            "-n",
            "3",
            "-J",
            json.to_str().unwrap(),
            "-T",
            "30",
        ];
        if let Some(d) = dur {
            args.extend(["-D", d]);
        }
        let o = perf(&args, &[]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{out}\n{err}");
        assert_eq!(out.contains("# duration: "), dur.is_some(), "{out}");
        check_table(&out, true);
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let rows = v["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 2);
        for r in rows {
            for col in ["out_of_place", "in_place"] {
                let n = r[col]["iters"].as_u64().unwrap();
                // An 8- or 64-byte AllReduce takes well under 10 ms even on
                // a loaded machine, so 0.1 s is more than 10 of them.
                if dur.is_some() {
                    assert!(n > 10, "{col} of {}: {n} iterations", r["size"]);
                } else {
                    assert_eq!(n, 3, "{col} of {}", r["size"]);
                }
            }
        }
        let _ = std::fs::remove_file(&json);
    }
}

/// The CPUs rank `r`'s line says it may run on.
fn rank_cpus(out: &str, r: usize) -> String {
    let line = out
        .lines()
        .find(|l| l.starts_with(&format!("#  Rank {r:>2} ")))
        .unwrap_or_else(|| panic!("no line for rank {r}:\n{out}"));
    line.split(" cpus ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .unwrap_or_else(|| panic!("no cpus in {line}"))
        .to_string()
}

/// `-np` binds each rank to a core of its own, as mpirun binds two ranks,
/// says so in the header, and leaves ranks unbound with `--bind none` or
/// when there are more ranks than cores.
#[test]
fn np_binds_ranks_to_cores() {
    let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
    let args = [
        "all_reduce",
        "-b",
        "8",
        "-e",
        "8",
        "-n",
        "2",
        "-w",
        "1",
        "-T",
        "30",
    ];
    let run = |extra: &[&str]| {
        let mut a: Vec<&str> = args.to_vec();
        a.extend_from_slice(extra);
        let o = perf(&a, &[]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{extra:?}: {out}\n{err}");
        out
    };
    let unbound = run(&["-np", "2", "--bind", "none"]);
    assert!(
        unbound.contains("# binding: none (--bind none)"),
        "{unbound}"
    );
    let all = rank_cpus(&unbound, 0);
    assert_eq!(rank_cpus(&unbound, 1), all, "{unbound}");
    if allowed >= 2 {
        let bound = run(&["-np", "2"]);
        assert!(
            bound.contains("# binding: one core per rank (rank:CPUs) 0:"),
            "{bound}"
        );
        let (c0, c1) = (rank_cpus(&bound, 0), rank_cpus(&bound, 1));
        assert_ne!(c0, c1, "{bound}");
        assert_ne!(c0, all, "rank 0 not bound:\n{bound}");
    } else {
        eprintln!("SKIP the bound case: this process may use one CPU");
    }
    // More ranks than cores (at most `allowed` cores): no binding.
    let n = (allowed + 1).to_string();
    if allowed < 8 {
        let over = run(&["-np", &n]);
        assert!(over.contains("# binding: none ("), "{over}");
        assert_eq!(rank_cpus(&over, 0), all, "{over}");
    }
}

/// `-R 1`: the buffers are `braid::HostBuffer`s; a peer reads every
/// single-copy piece through a mapping of the owner's buffer (the debug log
/// says so — without `-R 1` it never does), and results check out for the
/// moving collectives (direct and ring plans: 2 and 3 ranks) and a reducing
/// one.
#[test]
fn registered_buffers_are_read_through_mappings() {
    const MAPPED: &str = "mapped the peer's host buffer";
    let run = |bench: &str, np: &str, register: &str| {
        let o = perf(
            &[
                bench, "-np", np, "-b", "256K", "-e", "1M", "-f", "4", "-n", "2", "-w", "1", "-R",
                register, "-T", "30",
            ],
            &[
                ("BRAID_SINGLE_COPY_MIN_BYTES", "65536"),
                ("BRAID_DEBUG", "DEBUG"),
            ],
        );
        let (out, err) = text(&o);
        assert!(
            o.status.success(),
            "{bench} -np {np} -R {register}: {:?}\n{out}\n{err}",
            o.status
        );
        (out, err)
    };
    for (bench, in_place) in [
        ("all_gather", true),
        ("alltoall", false),
        ("broadcast", true),
        ("sendrecv", false),
        ("all_reduce", true),
    ] {
        for np in ["2", "3"] {
            let (out, err) = run(bench, np, "1");
            assert_eq!(check_table(&out, in_place).len(), 2, "{out}");
            assert!(
                out.contains("# buffers: 2 x 1048584 bytes per rank (-R 1: braid::HostBuffer"),
                "{out}"
            );
            if bench != "all_reduce" {
                assert!(err.contains(MAPPED), "{bench} -np {np}:\n{err}");
            }
        }
    }
    let (out, err) = run("all_gather", "2", "0");
    check_table(&out, true);
    assert!(!err.contains(MAPPED), "{err}");
}
