//! The algorithms measured side by side on emulated hosts (network
//! namespaces, [`crate::netns`]): for each cell (collective, size), every
//! algorithm that runs it forced with `BRAID_ALGO`, then the tuner's own
//! pick, each a `braid-perf` run with one process per rank, all under the
//! same delayed, rate-limited links. Used by `braid-algo-bench` (the
//! table of `docs/algorithms.md`, `scripts/algo-bench.sh`) and by a small
//! timed case in `tests/algorithms.rs`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::netns::Hosts;
use crate::ranks::wait_all;

/// One cell: a `braid-perf` benchmark at one size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cell {
    /// `all_reduce`, `broadcast`, `all_gather`, …
    pub bench: String,
    pub bytes: u64,
}

impl Cell {
    /// Parses `all_reduce:64K` (K, M, G suffixes).
    pub fn parse(s: &str) -> Result<Cell, String> {
        let (b, size) = s
            .split_once(':')
            .ok_or_else(|| format!("cell `{s}`: expected BENCH:SIZE"))?;
        Ok(Cell {
            bench: b.to_string(),
            bytes: parse_size(size)?,
        })
    }

    /// The algorithms that run this collective, as `BRAID_ALGO` names them.
    pub fn algorithms(&self) -> &'static [&'static str] {
        match self.bench.as_str() {
            "all_reduce" => &["ring", "rd", "rabenseifner", "tree", "hier"],
            "all_gather" => &["ring", "direct", "bruck"],
            "reduce_scatter" => &["ring", "bruck"],
            "broadcast" => &["ring", "direct", "tree"],
            "reduce" => &["ring", "tree", "rabenseifner"],
            _ => &[],
        }
    }

    /// Short name (`all_reduce 64K`).
    pub fn name(&self) -> String {
        format!("{} {}", self.bench, fmt_size(self.bytes))
    }
}

/// `8`, `64K`, `1M`, `64M`, `1G`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .map(|n| n * mul)
        .map_err(|_| format!("bad size `{s}`"))
}

/// `64K` for 65536.
pub fn fmt_size(b: u64) -> String {
    for (m, u) in [(1u64 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")] {
        if b >= m && b.is_multiple_of(m) {
            return format!("{}{u}", b / m);
        }
    }
    b.to_string()
}

/// How a run is set up.
#[derive(Clone, Debug)]
pub struct Setup {
    /// Hosts and ranks per host.
    pub hosts: usize,
    pub per_host: usize,
    /// One-way delay each host adds to what it sends, µs (500: 1 ms round
    /// trip), and its send rate, Mbit/s.
    pub delay_us: u32,
    pub rate_mbit: u32,
    /// `braid-perf` and `braid-netdelay`.
    pub perf: PathBuf,
    pub delayer: PathBuf,
    /// Timed iterations for a size (warm-up is a third, at least one).
    pub iters: fn(u64) -> u32,
    /// Time each call alone (`braid-perf -z 2 -a 3`: an untimed barrier
    /// before each call, the last rank's time) instead of calls back to
    /// back (the ranks' average), where rooted collectives overlap: the
    /// root starts the next Broadcast while the last ranks still receive.
    pub alone: bool,
    /// Where the runs' JSON goes.
    pub workdir: PathBuf,
}

/// One measurement: the time of the out-of-place operation (µs, the
/// ranks' average as braid-perf prints it) and the algorithm it ran.
#[derive(Clone, Debug)]
pub struct Measured {
    /// `BRAID_ALGO` (`None`: the tuner chose).
    pub forced: Option<String>,
    pub time_us: f64,
    /// As braid-perf names it, `rd (model)`.
    pub algorithm: String,
}

/// Iterations by size: enough to average over noise, one above 1 MiB (a
/// 64 MiB AllReduce takes seconds over the emulated links).
pub fn default_iters(bytes: u64) -> u32 {
    match bytes {
        0..=65536 => 20,
        65537..=1048576 => 8,
        _ => 1,
    }
}

/// Emulated hosts with their links delayed and rate-limited.
pub fn make_hosts(s: &Setup) -> Result<Hosts, String> {
    let mut h = Hosts::new(s.hosts)?;
    let delayer =
        std::fs::canonicalize(&s.delayer).map_err(|e| format!("{}: {e}", s.delayer.display()))?;
    let delayer = delayer.to_str().ok_or("delayer path")?;
    for i in 0..s.hosts {
        h.netem_us(i, s.delay_us, s.rate_mbit, delayer)?;
    }
    Ok(h)
}

fn secret() -> String {
    let mut b = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = std::io::Read::read_exact(&mut f, &mut b);
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Run `cell` once on `h` with `BRAID_ALGO=forced` (or the tuner).
pub fn run_cell(
    h: &Hosts,
    s: &Setup,
    cell: &Cell,
    forced: Option<&str>,
    port: u16,
) -> Result<Measured, String> {
    let n = s.hosts * s.per_host;
    let id = format!("{}:{port}/{}", h.addr(0), secret());
    let json = s.workdir.join(format!(
        "{}-{}-{}.json",
        cell.bench,
        cell.bytes,
        forced.unwrap_or("tuner")
    ));
    let _ = std::fs::remove_file(&json);
    let iters = (s.iters)(cell.bytes);
    let size = cell.bytes.to_string();
    // Absolute: the ranks start inside the hosts' namespaces.
    let perf = std::fs::canonicalize(&s.perf).map_err(|e| format!("{}: {e}", s.perf.display()))?;
    let perf = perf.to_str().ok_or("perf path")?;
    let kids = (0..n)
        .map(|r| {
            let mut c = h.command(r / s.per_host, perf);
            c.args([
                cell.bench.as_str(),
                "-b",
                &size,
                "-e",
                &size,
                "-n",
                &iters.to_string(),
                "-w",
                &(iters / 3).max(1).to_string(),
                "-c",
                "1",
                "-T",
                "120",
                "-J",
            ])
            .arg(&json)
            .args(if s.alone {
                &["-z", "2", "-a", "3"][..]
            } else {
                &[][..]
            })
            .env("BRAID_UNIQUE_ID", &id)
            .env("BRAID_RANK", r.to_string())
            .env("BRAID_NRANKS", n.to_string())
            .env("BRAID_LOCAL_RANK", (r % s.per_host).to_string())
            .env("BRAID_LOCAL_SIZE", s.per_host.to_string())
            // Many ranks on few cores: waiting ranks yield at once.
            .env("BRAID_SPIN", "0")
            .env_remove("BRAID_HOST_ID")
            .env_remove("BRAID_TRANSPORT")
            .env_remove("BRAID_TUNING_FILE")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
            match forced {
                Some(a) => c.env("BRAID_ALGO", a),
                None => c.env_remove("BRAID_ALGO"),
            };
            c.spawn().map_err(|e| format!("starting braid-perf: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let res = wait_all(kids, Duration::from_secs(1200));
    for (r, (code, out)) in res.iter().enumerate() {
        if *code != Some(0) {
            return Err(format!(
                "{} with {}: rank {r} exited {code:?}:\n{out}",
                cell.name(),
                forced.unwrap_or("the tuner")
            ));
        }
    }
    let text = std::fs::read_to_string(&json).map_err(|e| format!("{}: {e}", json.display()))?;
    parse_json(&text, forced)
}

/// The first row's out-of-place time and algorithm from braid-perf's JSON.
fn parse_json(text: &str, forced: Option<&str>) -> Result<Measured, String> {
    let find = |key: &str| -> Option<String> {
        let at = text.find(&format!("\"{key}\""))?;
        let rest = &text[at + key.len() + 2..];
        let rest = rest.trim_start().strip_prefix(':')?.trim_start();
        let end = if let Some(r) = rest.strip_prefix('"') {
            return r.split('"').next().map(str::to_string);
        } else {
            rest.find([',', '}']).unwrap_or(rest.len())
        };
        Some(rest[..end].trim().to_string())
    };
    let oop = text
        .find("\"out_of_place\"")
        .ok_or("no out_of_place in the JSON")?;
    let sub = &text[oop..];
    let t = sub
        .find("\"time_us\"")
        .and_then(|i| {
            let r = sub[i + 9..].trim_start().strip_prefix(':')?.trim_start();
            let end = r.find([',', '}']).unwrap_or(r.len());
            r[..end].trim().parse::<f64>().ok()
        })
        .ok_or("no time_us in the JSON")?;
    Ok(Measured {
        forced: forced.map(str::to_string),
        time_us: t,
        algorithm: find("algorithm").unwrap_or_else(|| "?".into()),
    })
}

/// Every algorithm of `cell` forced, then the tuner, on `h`; runs
/// alternate so that drift hits all alike.
pub fn measure_cell(
    h: &Hosts,
    s: &Setup,
    cell: &Cell,
    port: &mut u16,
    rounds: usize,
) -> Result<Vec<Measured>, String> {
    let mut names: Vec<Option<&str>> = cell.algorithms().iter().map(|a| Some(*a)).collect();
    if s.per_host == 1 {
        // One rank per host: hier is the flat algorithm of its leaders.
        names.retain(|a| *a != Some("hier"));
    }
    names.push(None);
    let mut best: Vec<Option<Measured>> = vec![None; names.len()];
    for _ in 0..rounds {
        for (i, a) in names.iter().enumerate() {
            *port = port.wrapping_add(1).max(20000);
            let t0 = Instant::now();
            let m = run_cell(h, s, cell, *a, *port)?;
            eprintln!(
                "  {} {:>14}: {:>10.1} µs  ({}; run took {:.1} s)",
                cell.name(),
                a.unwrap_or("tuner"),
                m.time_us,
                m.algorithm,
                t0.elapsed().as_secs_f64()
            );
            if best[i].as_ref().is_none_or(|b| m.time_us < b.time_us) {
                best[i] = Some(m);
            }
        }
    }
    Ok(best.into_iter().flatten().collect())
}

/// The Markdown table of one setup: a row per cell, a column per
/// algorithm (µs, the best of the rounds), the tuner's pick and time, and
/// its ratios to the best forced algorithm (marked when the pick is that
/// algorithm: the ratio is then the runs' noise) and to the ring.
pub fn table(s: &Setup, rows: &[(Cell, Vec<Measured>)]) -> String {
    let cols = [
        "ring",
        "rd",
        "rabenseifner",
        "tree",
        "hier",
        "direct",
        "bruck",
    ];
    let mut t = format!(
        "{} hosts × {} rank{} ({} µs one way, {} Mbit/s per host; {}):\n\n| cell | {} | tuner (pick) | tuner / best | tuner / ring |\n|---|{}---|---|---|\n",
        s.hosts,
        s.per_host,
        if s.per_host == 1 { "" } else { "s" },
        s.delay_us,
        s.rate_mbit,
        if s.alone {
            "each call alone, the last rank's time"
        } else {
            "calls back to back, the ranks' average"
        },
        cols.join(" | "),
        "---|".repeat(cols.len())
    );
    for (cell, ms) in rows {
        let get = |a: &str| ms.iter().find(|m| m.forced.as_deref() == Some(a));
        let forced_best = ms
            .iter()
            .filter(|m| m.forced.is_some())
            .map(|m| m.time_us)
            .fold(f64::INFINITY, f64::min);
        let tuner = ms.iter().find(|m| m.forced.is_none());
        t += &format!("| {} |", cell.name());
        for c in cols {
            t += &match get(c) {
                Some(m) if (m.time_us - forced_best).abs() < 1e-9 => {
                    format!(" **{}** |", fmt_us(m.time_us))
                }
                Some(m) => format!(" {} |", fmt_us(m.time_us)),
                None => " – |".into(),
            };
        }
        match tuner {
            Some(m) => {
                let ring = get("ring").map(|r| m.time_us / r.time_us);
                let pick = m.algorithm.trim_end_matches(" (model)");
                // The best forced algorithm's name (as BRAID_ALGO names it;
                // braid-perf prints hier with its leaders' algorithm).
                let best_name = ms
                    .iter()
                    .filter(|b| (b.time_us - forced_best).abs() < 1e-9)
                    .find_map(|b| b.forced.as_deref());
                // The algorithm without what chose it ("ring (timed)").
                let algo = pick.split(" (").next().unwrap_or(pick);
                let same =
                    best_name.is_some_and(|b| algo == b || algo.starts_with(&format!("{b}(")));
                t += &format!(
                    " {} ({pick}) | {:.2}{} | {} |\n",
                    fmt_us(m.time_us),
                    m.time_us / forced_best,
                    if same { " (same algorithm)" } else { "" },
                    ring.map_or("–".into(), |r| format!("{r:.2}"))
                );
            }
            None => t += " – | – | – |\n",
        }
    }
    t
}

fn fmt_us(us: f64) -> String {
    if us >= 10000.0 {
        format!("{:.1} ms", us / 1000.0)
    } else {
        format!("{us:.0} µs")
    }
}

/// Where this binary's sibling binaries are (`braid-perf` is built in the
/// same target folder by `cargo build -p braid-perf`).
pub fn sibling(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_default()
        .join(name)
}
