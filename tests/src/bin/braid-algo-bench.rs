//! The emulated-host table of `docs/algorithms.md`: every algorithm forced
//! and the tuner's pick, side by side, on hosts emulated with network
//! namespaces (one process per rank, `braid-perf`), links delayed and
//! rate-limited. Needs root (see `braid_tests::netns`); run it through
//! `scripts/algo-bench.sh`, which builds everything in release mode.
//!
//!   braid-algo-bench [--hosts 8,16] [--hier 2x4] [--delay-us 500]
//!                    [--rate-mbit 200] [--rounds 2] [--timing alone|stream]
//!                    [--cells all_reduce:8,all_reduce:64K,...]
//!                    [--hier-cells all_reduce:64K,...]
//!
//! `--hosts` lists host counts with one rank each; `--hier` adds setups of
//! HOSTSxRANKS (the hierarchical AllReduce's case). Each cell runs every
//! algorithm that can run it and then the tuner, `--rounds` times in turn,
//! keeping each one's best time. Prints one Markdown table per setup.
//! `--timing alone` (the default) times each call by itself after an
//! untimed barrier and reports the last rank's time — what a caller waits
//! for; `--timing stream` times calls back to back (the ranks' average),
//! where a Broadcast's root starts the next call while the last ranks
//! still receive the one before.

use braid_tests::algobench::{
    default_iters, make_hosts, measure_cell, sibling, table, Cell, Setup,
};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let list = |name: &str, default: &str| -> Vec<String> {
        get(name)
            .unwrap_or_else(|| default.to_string())
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    };
    let num = |name: &str, default: u32| -> u32 {
        get(name).and_then(|v| v.parse().ok()).unwrap_or(default)
    };
    let cells: Vec<Cell> = list(
        "--cells",
        "all_reduce:8,all_reduce:64K,all_reduce:1M,all_reduce:64M,broadcast:64K,all_gather:64K",
    )
    .iter()
    .map(|c| Cell::parse(c).unwrap_or_else(|e| panic!("{e}")))
    .collect();
    let hier_cells: Vec<Cell> = list(
        "--hier-cells",
        "all_reduce:8,all_reduce:64K,all_reduce:1M,all_reduce:64M",
    )
    .iter()
    .map(|c| Cell::parse(c).unwrap_or_else(|e| panic!("{e}")))
    .collect();
    let mut setups: Vec<(usize, usize, &Vec<Cell>)> = list("--hosts", "8,16")
        .iter()
        .map(|h| (h.parse().expect("--hosts: numbers"), 1, &cells))
        .collect();
    for hx in list("--hier", "2x4") {
        let (h, m) = hx.split_once('x').expect("--hier HOSTSxRANKS");
        setups.push((
            h.parse().expect("hosts"),
            m.parse().expect("ranks"),
            &hier_cells,
        ));
    }
    let rounds = num("--rounds", 2) as usize;
    let workdir = std::env::temp_dir().join(format!("braid-algo-bench-{}", std::process::id()));
    std::fs::create_dir_all(&workdir).expect("work folder");
    let mut port = 20000 + (std::process::id() % 20000) as u16;
    for (hosts, per_host, cells) in setups {
        let s = Setup {
            hosts,
            per_host,
            delay_us: num("--delay-us", 500),
            rate_mbit: num("--rate-mbit", 200),
            perf: get("--perf").map_or_else(|| sibling("braid-perf"), Into::into),
            delayer: sibling("braid-netdelay"),
            iters: default_iters,
            alone: match get("--timing").as_deref() {
                None | Some("alone") => true,
                Some("stream") => false,
                Some(t) => panic!("--timing {t}: expected alone or stream"),
            },
            workdir: workdir.clone(),
        };
        let h = make_hosts(&s).unwrap_or_else(|e| panic!("emulated hosts: {e}"));
        let mut rows = Vec::new();
        for cell in cells {
            eprintln!("{hosts} hosts × {per_host}: {}", cell.name());
            let ms =
                measure_cell(&h, &s, cell, &mut port, rounds).unwrap_or_else(|e| panic!("{e}"));
            rows.push((cell.clone(), ms));
        }
        drop(h);
        println!("{}", table(&s, &rows));
    }
    let _ = std::fs::remove_dir_all(&workdir);
}
