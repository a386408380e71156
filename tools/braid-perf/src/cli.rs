//! Command-line parsing: nccl-tests' flags (getopt-style: `-b 8`, `-b8`,
//! `--minbytes 8`, `--minbytes=8`), plus braid's `-np`, `--plot`, `--label`,
//! and the `plot` / `import-mpi` subcommands.

use std::fmt;
use std::path::PathBuf;

use braid::{DataType, RedOp, UniqueId};

/// A usage error: the message says what to do; the process exits with 2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

fn usage<T>(msg: impl Into<String>) -> Result<T, UsageError> {
    Err(UsageError(msg.into()))
}

/// One benchmark (one nccl-tests binary).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bench {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
    AllToAll,
    SendRecv,
}

impl Bench {
    /// Every benchmark, in the order `--help` lists them.
    pub const ALL: [Bench; 7] = [
        Bench::AllReduce,
        Bench::AllGather,
        Bench::ReduceScatter,
        Bench::Broadcast,
        Bench::Reduce,
        Bench::AllToAll,
        Bench::SendRecv,
    ];

    /// The subcommand name (nccl-tests' binary name without `_perf`).
    pub const fn name(self) -> &'static str {
        match self {
            Bench::AllReduce => "all_reduce",
            Bench::AllGather => "all_gather",
            Bench::ReduceScatter => "reduce_scatter",
            Bench::Broadcast => "broadcast",
            Bench::Reduce => "reduce",
            Bench::AllToAll => "alltoall",
            Bench::SendRecv => "sendrecv",
        }
    }

    /// Parse a subcommand name; `all_reduce_perf` (the nccl-tests binary
    /// name) is accepted too.
    pub fn from_name(s: &str) -> Option<Bench> {
        let s = s.strip_suffix("_perf").unwrap_or(s);
        Bench::ALL.into_iter().find(|b| b.name() == s)
    }

    /// True for the collectives that take a reduction operator.
    pub const fn reduces(self) -> bool {
        matches!(
            self,
            Bench::AllReduce | Bench::ReduceScatter | Bench::Reduce
        )
    }

    /// True for the collectives that take a root.
    pub const fn rooted(self) -> bool {
        matches!(self, Bench::Broadcast | Bench::Reduce)
    }

    /// True when "size" is the whole array across ranks (nccl-tests:
    /// AllGather, ReduceScatter, AllToAll), so the per-rank count is
    /// size / nranks / typesize.
    pub const fn total_array(self) -> bool {
        matches!(
            self,
            Bench::AllGather | Bench::ReduceScatter | Bench::AllToAll
        )
    }

    /// braid has no in-place AllToAll, and a rank cannot lend one buffer to
    /// a send and a receive of the same group, so those columns print N/A.
    pub const fn has_in_place(self) -> bool {
        !matches!(self, Bench::AllToAll | Bench::SendRecv)
    }

    /// nccl-tests' bus-bandwidth factor: busbw = algbw × factor.
    pub fn bus_factor(self, nranks: u32) -> f64 {
        let n = f64::from(nranks.max(1));
        match self {
            Bench::AllReduce => 2.0 * (n - 1.0) / n,
            Bench::AllGather | Bench::ReduceScatter | Bench::AllToAll => (n - 1.0) / n,
            Bench::Broadcast | Bench::Reduce | Bench::SendRecv => 1.0,
        }
    }

    /// The redop column for operator `op` (`none` where nothing reduces;
    /// sendrecv prints `sum` like nccl-tests).
    pub fn redop_name(self, op: RedOp) -> &'static str {
        match self {
            Bench::AllReduce | Bench::ReduceScatter | Bench::Reduce => op.name(),
            Bench::SendRecv => "sum",
            _ => "none",
        }
    }
}

/// How step sizes grow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Multiply by this factor (> 1).
    Factor(u64),
    /// Add this many bytes (> 0).
    Bytes(u64),
}

/// `-r`: one root or every rank in turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RootSel {
    One(u32),
    All,
}

/// How `-z` times calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timing {
    /// `-z 0`: back to back, no barrier inside the timing.
    Stream,
    /// `-z 1`: a barrier after every iteration, inside the timing.
    Blocking,
    /// `-z 2`: every call alone — an untimed barrier before each, the call
    /// timed by itself (OSU's way: the time one call takes, not the rate
    /// of calls back to back, where rooted collectives overlap).
    Alone,
}

impl Timing {
    /// The `-z` value.
    pub fn code(self) -> u8 {
        match self {
            Timing::Stream => 0,
            Timing::Blocking => 1,
            Timing::Alone => 2,
        }
    }
}

/// `-a`: how the per-rank times combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Average {
    Rank0,
    Avg,
    Min,
    Max,
}

impl Average {
    pub const fn name(self) -> &'static str {
        match self {
            Average::Rank0 => "rank0",
            Average::Avg => "avg",
            Average::Min => "min",
            Average::Max => "max",
        }
    }
    pub const fn code(self) -> u32 {
        match self {
            Average::Rank0 => 0,
            Average::Avg => 1,
            Average::Min => 2,
            Average::Max => 3,
        }
    }
}

/// Identity of a rank started by `-np` (hidden flags).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Child {
    pub rank: u32,
    pub nranks: u32,
    pub id: UniqueId,
}

/// Options of one benchmark run.
#[derive(Clone, Debug, PartialEq)]
pub struct Opts {
    pub bench: Bench,
    pub min_bytes: u64,
    pub max_bytes: u64,
    pub step: Step,
    pub iters: u32,
    /// `-D`: time each size for about this many seconds (at least `iters`
    /// iterations), the count agreed across ranks.
    pub duration: Option<f64>,
    pub warmup: u32,
    pub agg: u32,
    /// 0 = forever.
    pub cycles: u32,
    pub check: u32,
    pub dtypes: Vec<DataType>,
    pub ops: Vec<RedOp>,
    pub root: RootSel,
    /// `-z`: how calls are timed.
    pub timing: Timing,
    pub average: Average,
    /// Seconds (BRAID_TIMEOUT semantics).
    pub timeout: Option<f64>,
    pub hugepages: bool,
    /// `-R 1`: buffers from `braid::HostBuffer` (registered host memory that
    /// peers on this host map and copy from without the kernel).
    pub register: bool,
    /// `--device cuda`: buffers on the GPU (the device communicator).
    pub cuda: bool,
    pub json: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub label: Option<String>,
    pub np: Option<u32>,
    /// With `-np`: bind each rank to a core of its own (`--bind core`, the
    /// default, as mpirun binds two ranks) or leave placement to the
    /// scheduler (`--bind none`).
    pub bind: bool,
    pub child: Option<Child>,
    /// The arguments as given (after the subcommand), for re-spawning ranks.
    pub raw_args: Vec<String>,
}

impl Opts {
    /// nccl-tests' defaults for `bench`.
    pub fn new(bench: Bench) -> Opts {
        Opts {
            bench,
            min_bytes: 32 << 20,
            max_bytes: 32 << 20,
            step: Step::Bytes(1 << 20),
            iters: 20,
            duration: None,
            warmup: 1,
            agg: 1,
            cycles: 1,
            check: 1,
            dtypes: vec![DataType::F32],
            ops: vec![RedOp::Sum],
            root: RootSel::One(0),
            timing: Timing::Stream,
            average: Average::Avg,
            timeout: None,
            hugepages: false,
            register: false,
            cuda: false,
            json: None,
            plot: None,
            label: None,
            np: None,
            bind: true,
            child: None,
            raw_args: Vec::new(),
        }
    }

    /// The operators to sweep (only `sum`'s row for non-reducing benchmarks).
    pub fn effective_ops(&self) -> Vec<RedOp> {
        if self.bench.reduces() {
            self.ops.clone()
        } else {
            vec![RedOp::Sum]
        }
    }
}

/// `plot` subcommand.
#[derive(Clone, Debug, PartialEq)]
pub struct PlotOpts {
    pub inputs: Vec<PathBuf>,
    pub out: PathBuf,
    pub title: Option<String>,
    pub in_place: bool,
    /// Only rows of this collective (e.g. `all_reduce`).
    pub coll: Option<String>,
}

/// `import-mpi` subcommand.
#[derive(Clone, Debug, PartialEq)]
pub struct ImportOpts {
    pub input: PathBuf,
    pub out: PathBuf,
    pub label: Option<String>,
}

/// What to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    Bench(Box<Opts>),
    Plot(PlotOpts),
    ImportMpi(ImportOpts),
    Help(String),
    Version,
}

/// Parse a byte size like nccl-tests: an integer with an optional binary
/// K/M/G suffix (`8`, `64K`, `32M`, `1G`; `KB`/`KiB` also accepted).
pub fn parse_size(s: &str) -> Result<u64, UsageError> {
    let t = s.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits_end);
    let bad = || {
        UsageError(format!(
            "'{s}' is not a size: give bytes as an integer with an optional K, M or G suffix (e.g. 8, 64K, 32M, 1G)"
        ))
    };
    if num.is_empty() {
        return Err(bad());
    }
    let n: u64 = num.parse().map_err(|_| bad())?;
    let unit: u64 = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(bad()),
    };
    n.checked_mul(unit)
        .ok_or_else(|| UsageError(format!("size '{s}' is too large")))
}

/// The sizes nccl-tests visits: from `min` while `<= max`, multiplying by
/// the factor or adding the step.
pub fn size_sequence(min: u64, max: u64, step: Step) -> Result<Vec<u64>, UsageError> {
    const MAX_SIZES: usize = 100_000;
    if min > max {
        return usage(format!(
            "minbytes ({min}) is larger than maxbytes ({max}): set -b <= -e"
        ));
    }
    let mut out = Vec::new();
    let mut s = min;
    loop {
        out.push(s);
        if out.len() > MAX_SIZES {
            return usage(format!(
                "-b/-e/-f/-i give more than {MAX_SIZES} sizes: use a larger step"
            ));
        }
        let next = match step {
            Step::Factor(f) => {
                if s == 0 && max > 0 {
                    return usage("-b 0 with a step factor never grows: use -b 1 or more, or -i");
                }
                s.checked_mul(f)
            }
            Step::Bytes(b) => s.checked_add(b),
        };
        match next {
            Some(n) if n <= max && n > s => s = n,
            _ => break,
        }
    }
    Ok(out)
}

/// The shortest `-T` (1 ms), as `BRAID_TIMEOUT`.
pub const MIN_TIMEOUT_S: f64 = 0.001;
/// The longest `-T` (a year), as `BRAID_TIMEOUT`.
pub const MAX_TIMEOUT_S: f64 = 365.0 * 24.0 * 3600.0;

/// The longest `-D` (an hour per size).
pub const MAX_DURATION_S: f64 = 3600.0;

/// The most iterations `-D` times at one size.
pub const MAX_DURATION_ITERS: u32 = 100_000_000;

/// `-T`'s seconds as a duration (clamped to the accepted range, so that it
/// never panics).
pub fn timeout_duration(secs: f64) -> std::time::Duration {
    let secs = if secs.is_nan() { MIN_TIMEOUT_S } else { secs };
    std::time::Duration::from_secs_f64(secs.clamp(MIN_TIMEOUT_S, MAX_TIMEOUT_S))
}

fn parse_num<T: std::str::FromStr>(flag: &str, v: &str, what: &str) -> Result<T, UsageError> {
    v.trim()
        .parse()
        .map_err(|_| UsageError(format!("{flag} '{v}': expected {what}")))
}

fn parse_bool(flag: &str, v: &str) -> Result<bool, UsageError> {
    match v.trim() {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => usage(format!("{flag} '{v}': expected 0 or 1")),
    }
}

/// A flag and how it is spelled.
struct Flag {
    short: Option<char>,
    long: &'static str,
    takes_value: bool,
}

const FLAGS: &[Flag] = &[
    Flag {
        short: Some('b'),
        long: "minbytes",
        takes_value: true,
    },
    Flag {
        short: Some('e'),
        long: "maxbytes",
        takes_value: true,
    },
    Flag {
        short: Some('f'),
        long: "stepfactor",
        takes_value: true,
    },
    Flag {
        short: Some('i'),
        long: "stepbytes",
        takes_value: true,
    },
    Flag {
        short: Some('n'),
        long: "iters",
        takes_value: true,
    },
    Flag {
        short: Some('D'),
        long: "duration",
        takes_value: true,
    },
    Flag {
        short: Some('w'),
        long: "warmup_iters",
        takes_value: true,
    },
    Flag {
        short: Some('m'),
        long: "agg_iters",
        takes_value: true,
    },
    Flag {
        short: Some('N'),
        long: "run_cycles",
        takes_value: true,
    },
    Flag {
        short: Some('c'),
        long: "check",
        takes_value: true,
    },
    Flag {
        short: Some('d'),
        long: "datatype",
        takes_value: true,
    },
    Flag {
        short: Some('o'),
        long: "op",
        takes_value: true,
    },
    Flag {
        short: Some('r'),
        long: "root",
        takes_value: true,
    },
    Flag {
        short: Some('z'),
        long: "blocking",
        takes_value: true,
    },
    Flag {
        short: Some('a'),
        long: "average",
        takes_value: true,
    },
    Flag {
        short: Some('T'),
        long: "timeout",
        takes_value: true,
    },
    Flag {
        short: Some('J'),
        long: "output_file",
        takes_value: true,
    },
    Flag {
        short: Some('H'),
        long: "hugepages",
        takes_value: true,
    },
    Flag {
        short: Some('R'),
        long: "local_register",
        takes_value: true,
    },
    Flag {
        short: None,
        long: "device",
        takes_value: true,
    },
    Flag {
        short: Some('t'),
        long: "nthreads",
        takes_value: true,
    },
    Flag {
        short: Some('g'),
        long: "ngpus",
        takes_value: true,
    },
    Flag {
        short: None,
        long: "plot",
        takes_value: true,
    },
    Flag {
        short: None,
        long: "label",
        takes_value: true,
    },
    Flag {
        short: None,
        long: "bind",
        takes_value: true,
    },
    Flag {
        short: None,
        long: "np",
        takes_value: true,
    },
    Flag {
        short: None,
        long: "child-rank",
        takes_value: true,
    },
    Flag {
        short: None,
        long: "child-nranks",
        takes_value: true,
    },
    Flag {
        short: None,
        long: "child-id",
        takes_value: true,
    },
    Flag {
        short: Some('h'),
        long: "help",
        takes_value: false,
    },
];

/// Split argv into (flag long name, value) pairs, getopt-style.
fn tokenize(args: &[String]) -> Result<Vec<(&'static str, Option<String>)>, UsageError> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        i += 1;
        let (flag, inline): (&Flag, Option<String>) = if a == "-np" {
            (
                FLAGS.iter().find(|f| f.long == "np").expect("np flag"),
                None,
            )
        } else if let Some(long) = a.strip_prefix("--") {
            let (name, val) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (long, None),
            };
            let Some(f) = FLAGS.iter().find(|f| f.long == name) else {
                return usage(format!("unknown option '--{name}'; see --help"));
            };
            (f, val)
        } else if let Some(short) = a.strip_prefix('-').filter(|s| !s.is_empty()) {
            let c = short.chars().next().unwrap_or('?');
            let Some(f) = FLAGS.iter().find(|f| f.short == Some(c)) else {
                return usage(format!("unknown option '-{c}'; see --help"));
            };
            let rest = &short[c.len_utf8()..];
            let val = if rest.is_empty() {
                None
            } else if f.takes_value {
                Some(rest.to_string())
            } else {
                return usage(format!("option '-{c}' takes no value (got '{a}')"));
            };
            (f, val)
        } else {
            return usage(format!(
                "unexpected argument '{a}': options start with - or --; see --help"
            ));
        };
        let val = if flag.takes_value {
            match inline {
                Some(v) => Some(v),
                None => {
                    let Some(v) = args.get(i) else {
                        return usage(format!("option --{} needs a value; see --help", flag.long));
                    };
                    i += 1;
                    Some(v.clone())
                }
            }
        } else {
            None
        };
        out.push((flag.long, val));
    }
    Ok(out)
}

/// Parse the whole command line (without argv\[0\]). `argv0` may name a
/// benchmark (a link called `all_reduce_perf`).
pub fn parse(argv0: &str, args: &[String]) -> Result<Command, UsageError> {
    let exe = std::path::Path::new(argv0)
        .file_name()
        .and_then(|s| s.to_str())
        .unwrap_or("");
    let (bench, rest) = if let Some(b) = Bench::from_name(exe) {
        // `all_reduce_perf all_reduce -b 8` (as -np re-runs itself) too.
        match args.first() {
            Some(a) if Bench::from_name(a) == Some(b) => (b, &args[1..]),
            _ => (b, args),
        }
    } else {
        let Some(first) = args.first() else {
            return Ok(Command::Help(help_text()));
        };
        match first.as_str() {
            "-h" | "--help" | "help" => return Ok(Command::Help(help_text())),
            "-V" | "--version" => return Ok(Command::Version),
            "plot" => return parse_plot(&args[1..]),
            "import-mpi" => return parse_import(&args[1..]),
            s => match Bench::from_name(s) {
                Some(b) => (b, &args[1..]),
                None => {
                    return usage(format!(
                        "unknown benchmark '{s}': use one of {} (or plot, import-mpi); see --help",
                        Bench::ALL.map(|b| b.name()).join(", ")
                    ))
                }
            },
        }
    };
    parse_bench(bench, rest)
}

fn parse_bench(bench: Bench, args: &[String]) -> Result<Command, UsageError> {
    let mut o = Opts::new(bench);
    o.raw_args = args.to_vec();
    let mut factor: Option<u64> = None;
    let mut step_bytes: Option<u64> = None;
    let (mut crank, mut cn, mut cid) = (None, None, None);
    for (name, val) in tokenize(args)? {
        let v = val.unwrap_or_default();
        let flag = format!("--{name}");
        match name {
            "help" => return Ok(Command::Help(help_text())),
            "minbytes" => o.min_bytes = parse_size(&v)?,
            "maxbytes" => o.max_bytes = parse_size(&v)?,
            "stepfactor" => factor = Some(parse_num(&flag, &v, "an integer factor")?),
            "stepbytes" => step_bytes = Some(parse_size(&v)?),
            "iters" => o.iters = parse_num(&flag, &v, "a number of iterations")?,
            "duration" => {
                let d: f64 = parse_num(&flag, &v, "seconds")?;
                if !(d.is_finite() && d > 0.0 && d <= MAX_DURATION_S) {
                    return usage(format!(
                        "{flag} '{v}': expected a positive number of seconds up to {MAX_DURATION_S}"
                    ));
                }
                o.duration = Some(d);
            }
            "warmup_iters" => o.warmup = parse_num(&flag, &v, "a number of iterations")?,
            "agg_iters" => o.agg = parse_num(&flag, &v, "a number of operations")?,
            "run_cycles" => o.cycles = parse_num(&flag, &v, "a number of cycles (0 = forever)")?,
            "check" => o.check = parse_num(&flag, &v, "a number of check iterations (0 = off)")?,
            "datatype" => {
                o.dtypes = if v.eq_ignore_ascii_case("all") {
                    DataType::ALL.to_vec()
                } else {
                    vec![v.parse::<DataType>().map_err(UsageError)?]
                }
            }
            "op" => {
                o.ops = if v.eq_ignore_ascii_case("all") {
                    RedOp::ALL.to_vec()
                } else {
                    vec![v.parse::<RedOp>().map_err(UsageError)?]
                }
            }
            "root" => {
                o.root = if v.eq_ignore_ascii_case("all") {
                    RootSel::All
                } else {
                    RootSel::One(parse_num(&flag, &v, "a rank or 'all'")?)
                }
            }
            "blocking" => {
                o.timing = match v.trim() {
                    "0" => Timing::Stream,
                    "1" => Timing::Blocking,
                    "2" => Timing::Alone,
                    _ => return usage(format!("{flag} '{v}': expected 0, 1 or 2")),
                }
            }
            "hugepages" => o.hugepages = parse_bool(&flag, &v)?,
            "local_register" => {
                o.register = match v.trim() {
                    "0" => false,
                    "1" => true,
                    "2" => {
                        return usage(format!(
                            "{flag} 2: symmetric registration is NCCL's (device windows); braid-perf has 0 and 1"
                        ))
                    }
                    _ => return usage(format!("{flag} '{v}': expected 0 or 1")),
                }
            }
            "device" => {
                o.cuda = match v.trim().to_ascii_lowercase().as_str() {
                    "cuda" | "gpu" => true,
                    "host" | "cpu" => false,
                    _ => return usage(format!("{flag} '{v}': expected cuda or host")),
                }
            }
            "average" => {
                o.average = match v.trim() {
                    "0" => Average::Rank0,
                    "1" => Average::Avg,
                    "2" => Average::Min,
                    "3" => Average::Max,
                    _ => {
                        return usage(format!(
                            "{flag} '{v}': expected 0 (rank 0), 1 (avg), 2 (min) or 3 (max)"
                        ))
                    }
                }
            }
            "timeout" => {
                let t: f64 = parse_num(&flag, &v, "seconds")?;
                if !(t.is_finite() && (MIN_TIMEOUT_S..=MAX_TIMEOUT_S).contains(&t)) {
                    return usage(format!(
                        "{flag} '{v}': expected a positive number of seconds from \
                         {MIN_TIMEOUT_S} to {MAX_TIMEOUT_S} (a year), as BRAID_TIMEOUT"
                    ));
                }
                o.timeout = Some(t);
            }
            "output_file" => o.json = Some(PathBuf::from(v)),
            "plot" => o.plot = Some(PathBuf::from(v)),
            "label" => o.label = Some(v),
            "bind" => {
                o.bind = match v.as_str() {
                    "core" => true,
                    "none" => false,
                    _ => {
                        return usage(format!(
                            "--bind {v}: expected core (one core per rank, the default) or none"
                        ))
                    }
                }
            }
            "np" => {
                let n: u32 = parse_num("-np", &v, "a number of ranks")?;
                if n == 0 {
                    return usage("-np must be at least 1");
                }
                o.np = Some(n);
            }
            "nthreads" | "ngpus" => {
                let n: u32 = parse_num(&flag, &v, "1")?;
                if n != 1 {
                    return usage(format!(
                        "{flag} {n}: braid-perf runs one rank per process; use -np N (or a launcher) for more ranks"
                    ));
                }
            }
            "child-rank" => crank = Some(parse_num(&flag, &v, "a rank")?),
            "child-nranks" => cn = Some(parse_num(&flag, &v, "a number of ranks")?),
            "child-id" => {
                cid = Some(
                    v.parse::<UniqueId>()
                        .map_err(|e| UsageError(format!("--child-id: {e}")))?,
                )
            }
            other => return usage(format!("option --{other} does not apply to a benchmark")),
        }
    }
    o.step = match (factor, step_bytes) {
        (Some(f), _) if f > 1 => Step::Factor(f),
        (Some(0), _) => return usage("-f 0: the step factor must be at least 2 (or use -i)"),
        (_, Some(0)) => return usage("-i 0: the step must be at least 1 byte (or use -f)"),
        (_, Some(b)) => Step::Bytes(b),
        _ => Step::Bytes(1 << 20),
    };
    if o.iters == 0 {
        return usage("-n 0: time at least one iteration");
    }
    if o.agg == 0 {
        return usage("-m 0: aggregate at least one operation per iteration");
    }
    if o.register && o.cuda {
        return usage("-R 1 registers host buffers; with --device cuda the buffers are on the GPU");
    }
    // Validate the sweep now, so that no rank starts on bad sizes.
    size_sequence(o.min_bytes, o.max_bytes, o.step)?;
    match (crank, cn, cid) {
        (None, None, None) => {}
        (Some(rank), Some(nranks), Some(id)) => {
            if rank >= nranks {
                return usage(format!(
                    "--child-rank {rank} out of range for {nranks} ranks"
                ));
            }
            o.child = Some(Child { rank, nranks, id });
        }
        _ => return usage("--child-rank, --child-nranks and --child-id go together (set by -np)"),
    }
    if o.child.is_some() && o.np.is_some() {
        return usage("-np cannot be combined with --child-*");
    }
    if let (RootSel::One(r), Some(n)) = (o.root, o.np) {
        if bench.rooted() && r >= n {
            return usage(format!(
                "-r {r}: root out of range for -np {n} (ranks 0..{})",
                n - 1
            ));
        }
    }
    Ok(Command::Bench(Box::new(o)))
}

fn parse_plot(args: &[String]) -> Result<Command, UsageError> {
    let mut inputs = Vec::new();
    let (mut out, mut title, mut in_place, mut coll) = (None, None, false, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |what: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| UsageError(format!("{a} needs {what}; see braid-perf --help")))
        };
        match a.as_str() {
            "-o" | "--output" => out = Some(PathBuf::from(val("a file name")?)),
            "--title" => title = Some(val("a title")?),
            "--coll" => coll = Some(val("a benchmark name")?),
            "--in-place" => in_place = true,
            "-h" | "--help" => return Ok(Command::Help(help_text())),
            s if s.starts_with('-') => {
                return usage(format!(
                    "plot: unknown option '{s}'; usage: braid-perf plot A.json [B.json ...] -o OUT.png [--title T] [--coll NAME] [--in-place]"
                ))
            }
            s => inputs.push(PathBuf::from(s)),
        }
    }
    if inputs.is_empty() {
        return usage("plot: give at least one JSON file (from braid-perf -J or import-mpi)");
    }
    let Some(out) = out else {
        return usage("plot: give the output image with -o OUT.png");
    };
    Ok(Command::Plot(PlotOpts {
        inputs,
        out,
        title,
        in_place,
        coll,
    }))
}

fn parse_import(args: &[String]) -> Result<Command, UsageError> {
    let (mut input, mut out, mut label) = (None, None, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |what: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| UsageError(format!("{a} needs {what}; see braid-perf --help")))
        };
        match a.as_str() {
            "-o" | "--output" => out = Some(PathBuf::from(val("a file name")?)),
            "--label" => label = Some(val("a label")?),
            "-h" | "--help" => return Ok(Command::Help(help_text())),
            s if s.starts_with('-') => {
                return usage(format!(
                    "import-mpi: unknown option '{s}'; usage: braid-perf import-mpi FILE.csv [--label L] -o OUT.json"
                ))
            }
            s if input.is_none() => input = Some(PathBuf::from(s)),
            s => return usage(format!("import-mpi: one CSV file at a time (extra '{s}')")),
        }
    }
    let Some(input) = input else {
        return usage("import-mpi: give the CSV written by mpi-best.sh (OUTDIR/mpi.csv)");
    };
    let Some(out) = out else {
        return usage("import-mpi: give the output with -o OUT.json");
    };
    Ok(Command::ImportMpi(ImportOpts { input, out, label }))
}

/// The `--help` text.
pub fn help_text() -> String {
    format!(
        "braid-perf {ver}: nccl-tests-compatible benchmark of braid collectives

USAGE:
  braid-perf BENCH [OPTIONS]            one benchmark (like nccl-tests' BENCH_perf)
  braid-perf plot A.json [B.json ...] -o OUT.png [--title T] [--coll BENCH] [--in-place]
  braid-perf import-mpi mpi.csv [--label openmpi] -o OUT.json

BENCH: all_reduce all_gather reduce_scatter broadcast reduce alltoall sendrecv
  (sendrecv: rank r sends to r+1 and receives from r-1 in one group)

RANKS:
  -np N                     start N local ranks (processes) of this program; this
                            process hosts the rendezvous on 127.0.0.1 and waits
      --bind core|none      with -np: bind rank r to the r-th core this process may
                            use (default core, as mpirun binds two ranks; no
                            binding when there are more ranks than cores), or
                            leave placement to the scheduler
  (no -np)                  join through the launcher's environment: braid-run,
                            torchrun, srun or mpirun (Communicator::from_env)

OPTIONS (nccl-tests' names and defaults):
  -b, --minbytes SIZE       smallest size, K/M/G suffixes (default 32M)
  -e, --maxbytes SIZE       largest size (default 32M)
  -f, --stepfactor F        multiply the size by F each step
  -i, --stepbytes SIZE      add SIZE each step (default 1M; -f wins when > 1)
  -n, --iters N             timed iterations per size (default 20)
  -D, --duration SECS       time each size for about SECS instead: N iterations
                            are timed first, and from them the slowest rank's
                            estimate sets the count of a second, reported run
                            (at least N; what an MPI benchmark's time limit
                            does: a few iterations of a fast call time its
                            warm-up, and on busy CPUs a slice or none)
  -w, --warmup_iters N      warm-up iterations at the largest and the smallest
                            size before each sweep (default 1)
  -m, --agg_iters M         operations per timed iteration (default 1). braid has
                            no collective groups: the M operations run back to
                            back inside the iteration, and time is divided by N*M
  -N, --run_cycles N        repeat the sweep N times, 0 = forever (default 1)
  -c, --check N             correctness-check iterations per size, 0 = off and
                            #wrong prints N/A (default 1)
  -d, --datatype T          int8 uint8 int32 uint32 int64 uint64 half bfloat16
                            float double, or all (default float)
  -o, --op OP               sum prod min max avg, or all (default sum)
  -r, --root R              root rank of broadcast/reduce, or all (default 0)
  -z, --blocking 0|1|2      1: barrier after every operation, inside the timing;
                            2: every operation alone, after an untimed barrier,
                            timed by itself (the time of one call; use -a 3 for
                            the last rank's) (default 0: operations back to
                            back; braid's host engine runs each one on the
                            calling thread)
  -a, --average 0|1|2|3     time across ranks: rank 0, avg, min, max (default 1)
  -T, --timeout SECS        bound on any wait without progress (BRAID_TIMEOUT)
  -J, --output_file F.json  write every row as JSON
  -H, --hugepages 0|1       madvise(MADV_HUGEPAGE) the buffers before first touch
  -R, --local_register 0|1  1: buffers from braid::HostBuffer, registered host
                            memory that ranks on this host map and copy from
                            without process_vm_readv; -H does not apply
                            (default 0: the system allocator, like any
                            application buffer)
      --device cuda|host    cuda: buffers on this rank's GPU, collectives on a
                            CUDA stream over nvlink/pcie links; prints the
                            device-to-device copy bandwidth (default host)
      --plot F.png          draw busbw and latency against size
      --label TEXT          name of this run in JSON and plots (default: braid)
  -h, --help                this text

OUTPUT: nccl-tests' table: size (B) and count (elements), type, redop, root,
then time (us), algbw, busbw (GB/s) and #wrong for out-of-place and in-place.
size is the whole array for all_gather, reduce_scatter and alltoall (count is
per rank, rounded down to 16 bytes), algbw = size/time, busbw = algbw x factor:
all_reduce 2(n-1)/n; all_gather, reduce_scatter, alltoall (n-1)/n; broadcast,
reduce, sendrecv 1. In-place alltoall and sendrecv print N/A (braid has none).
Inputs are exact under any reduction order, so #wrong counts elements that
differ from the reference (0 ulp; rounding of the final division for float
avg), summed over ranks. Exit status: 0 ok, 1 wrong results or a failure,
2 usage errors.
",
        ver = env!("CARGO_PKG_VERSION")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    fn bench(args: &[&str]) -> Result<Opts, UsageError> {
        match parse("braid-perf", &s(args))? {
            Command::Bench(o) => Ok(*o),
            other => panic!("not a bench: {other:?}"),
        }
    }

    #[test]
    fn device_flag() {
        assert!(!bench(&["all_reduce"]).unwrap().register);
        assert!(bench(&["all_reduce", "-R", "1"]).unwrap().register);
        assert!(
            !bench(&["all_reduce", "--local_register=0"])
                .unwrap()
                .register
        );
        for bad in [
            &["-R", "2"][..],
            &["-R", "x"],
            &["-R", "1", "--device", "cuda"],
        ] {
            let mut a = vec!["all_reduce"];
            a.extend_from_slice(bad);
            assert!(bench(&a).is_err(), "{bad:?}");
        }
        assert!(!bench(&["all_reduce"]).unwrap().cuda);
        assert!(bench(&["all_reduce", "--device", "cuda"]).unwrap().cuda);
        assert!(bench(&["all_reduce", "--device=gpu"]).unwrap().cuda);
        assert!(!bench(&["all_reduce", "--device", "host"]).unwrap().cuda);
        let e = bench(&["all_reduce", "--device", "tpu"]).unwrap_err();
        assert!(e.0.contains("expected cuda or host"), "{}", e.0);
        assert!(help_text().contains("--device cuda|host"));
    }

    #[test]
    fn bind_flag() {
        assert!(bench(&["all_reduce", "-np", "2"]).unwrap().bind);
        assert!(bench(&["all_reduce", "--bind", "core"]).unwrap().bind);
        assert!(
            !bench(&["all_reduce", "-np", "2", "--bind=none"])
                .unwrap()
                .bind
        );
        let e = bench(&["all_reduce", "--bind", "socket"]).unwrap_err();
        assert!(e.0.contains("expected core"), "{}", e.0);
        assert!(help_text().contains("--bind core|none"));
    }

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("64K").unwrap(), 64 << 10);
        assert_eq!(parse_size("64k").unwrap(), 64 << 10);
        assert_eq!(parse_size("32M").unwrap(), 32 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("0").unwrap(), 0);
        for bad in ["", "K", "1.5M", "-8", "8X", "99999999999999999999", "1T"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        assert!(parse_size("99999999999G").is_err());
    }

    #[test]
    fn size_sequences_follow_nccl_tests() {
        assert_eq!(
            size_sequence(8, 64 << 10, Step::Factor(4)).unwrap(),
            vec![8, 32, 128, 512, 2048, 8192, 32768]
        );
        assert_eq!(size_sequence(8, 8, Step::Factor(2)).unwrap(), vec![8]);
        assert_eq!(
            size_sequence(1 << 20, 4 << 20, Step::Bytes(1 << 20)).unwrap(),
            vec![1 << 20, 2 << 20, 3 << 20, 4 << 20]
        );
        assert_eq!(
            size_sequence(10, 25, Step::Bytes(10)).unwrap(),
            vec![10, 20]
        );
        assert!(size_sequence(9, 8, Step::Factor(2)).is_err());
        assert!(size_sequence(0, 8, Step::Factor(2)).is_err());
        assert_eq!(size_sequence(0, 0, Step::Factor(2)).unwrap(), vec![0]);
        assert!(size_sequence(1, 1 << 40, Step::Bytes(1)).is_err());
    }

    #[test]
    fn defaults_are_nccl_tests_defaults() {
        let o = bench(&["all_reduce"]).unwrap();
        assert_eq!((o.min_bytes, o.max_bytes), (32 << 20, 32 << 20));
        assert_eq!(
            (o.iters, o.warmup, o.agg, o.cycles, o.check),
            (20, 1, 1, 1, 1)
        );
        assert_eq!(o.dtypes, vec![DataType::F32]);
        assert_eq!(o.ops, vec![RedOp::Sum]);
        assert_eq!(o.root, RootSel::One(0));
        assert_eq!(o.average, Average::Avg);
        assert_eq!(o.step, Step::Bytes(1 << 20));
        assert_eq!(o.timing, Timing::Stream);
    }

    #[test]
    fn z2_times_every_call_alone() {
        let o = bench(&["broadcast", "-z", "2"]).unwrap();
        assert_eq!(o.timing, Timing::Alone);
        let o = bench(&["broadcast", "--blocking=1"]).unwrap();
        assert_eq!(o.timing, Timing::Blocking);
        assert!(bench(&["broadcast", "-z", "3"]).is_err());
    }

    #[test]
    fn flags_in_every_spelling() {
        let o = bench(&[
            "all_gather",
            "-b",
            "8",
            "-e64K",
            "--stepfactor=4",
            "--iters",
            "3",
            "-w",
            "1",
            "-d",
            "all",
            "-o",
            "all",
            "-r",
            "all",
            "-z",
            "1",
            "-a",
            "3",
            "-np",
            "3",
            "-J",
            "x.json",
            "--plot",
            "x.png",
            "--label",
            "shm",
            "-T",
            "2.5",
            "-c",
            "0",
            "-m",
            "2",
            "-N",
            "2",
        ])
        .unwrap();
        assert_eq!(o.bench, Bench::AllGather);
        assert_eq!(
            (o.min_bytes, o.max_bytes, o.step),
            (8, 64 << 10, Step::Factor(4))
        );
        assert_eq!(
            (o.iters, o.warmup, o.check, o.agg, o.cycles),
            (3, 1, 0, 2, 2)
        );
        assert_eq!(o.dtypes.len(), 10);
        assert_eq!(o.ops.len(), 5);
        assert_eq!(o.root, RootSel::All);
        assert_eq!(o.timing, Timing::Blocking);
        assert_eq!(o.average, Average::Max);
        assert_eq!(o.np, Some(3));
        assert_eq!(o.timeout, Some(2.5));
        assert_eq!(o.duration, None);
        assert_eq!(o.label.as_deref(), Some("shm"));
        assert_eq!(o.effective_ops(), vec![RedOp::Sum]);
        // A nccl-tests binary name as argv[0].
        match parse("/x/reduce_scatter_perf", &s(&["-b", "1K"])).unwrap() {
            Command::Bench(o) => assert_eq!(o.bench, Bench::ReduceScatter),
            _ => panic!(),
        }
    }

    #[test]
    fn bad_input_is_a_usage_error_not_a_panic() {
        for args in [
            &["nope"][..],
            &["all_reduce", "-b"],
            &["all_reduce", "-b", "x"],
            &["all_reduce", "-d", "complex"],
            &["all_reduce", "-o", "xor"],
            &["all_reduce", "-z", "3"],
            &["all_reduce", "-a", "7"],
            &["all_reduce", "-n", "0"],
            &["all_reduce", "-b", "64", "-e", "8"],
            &["all_reduce", "-np", "0"],
            &["all_reduce", "-T", "-1"],
            &["all_reduce", "-T", "1e20"],
            &["all_reduce", "-T", "1e-12"],
            &["all_reduce", "-T", "inf"],
            &["all_reduce", "--bogus"],
            &["all_reduce", "-q"],
            &["all_reduce", "stray"],
            &["all_reduce", "-g", "2"],
            &["broadcast", "-r", "5", "-np", "2"],
            &["all_reduce", "--child-rank", "0"],
            &["plot"],
            &["plot", "a.json"],
            &["import-mpi", "-o", "x.json"],
        ] {
            assert!(parse("braid-perf", &s(args)).is_err(), "{args:?}");
        }
    }

    /// `-T` accepts what BRAID_TIMEOUT accepts and never panics when
    /// turned into a duration.
    #[test]
    fn timeouts_in_range_and_never_a_panic() {
        let e = parse("braid-perf", &s(&["all_reduce", "-np", "2", "-T", "1e20"])).unwrap_err();
        assert!(e.0.contains("31536000") && e.0.contains("timeout"), "{e}");
        match parse("braid-perf", &s(&["all_reduce", "-T", "31536000"])).unwrap() {
            Command::Bench(o) => assert_eq!(o.timeout, Some(MAX_TIMEOUT_S)),
            _ => panic!(),
        }
        for t in [1e20, f64::INFINITY, f64::NAN, -1.0, 0.0, 1e-12, 2.5] {
            let d = timeout_duration(t);
            assert!(d >= std::time::Duration::from_millis(1), "{t}");
            assert!(d <= std::time::Duration::from_secs(365 * 24 * 3600), "{t}");
        }
        assert_eq!(
            timeout_duration(2.5),
            std::time::Duration::from_millis(2500)
        );
    }

    #[test]
    fn durations_are_positive_and_bounded() {
        match parse("braid-perf", &s(&["all_reduce", "-D", "0.25"])).unwrap() {
            Command::Bench(o) => assert_eq!(o.duration, Some(0.25)),
            _ => panic!(),
        }
        for bad in ["0", "-1", "nan", "inf", "3601", "x"] {
            let e = parse("braid-perf", &s(&["all_reduce", "--duration", bad])).unwrap_err();
            assert!(e.0.contains("--duration"), "{bad}: {e}");
        }
    }

    #[test]
    fn bus_factors_are_nccl_tests() {
        assert_eq!(Bench::AllReduce.bus_factor(4), 1.5);
        assert_eq!(Bench::AllGather.bus_factor(4), 0.75);
        assert_eq!(Bench::ReduceScatter.bus_factor(2), 0.5);
        assert_eq!(Bench::AllToAll.bus_factor(8), 0.875);
        assert_eq!(Bench::Broadcast.bus_factor(8), 1.0);
        assert_eq!(Bench::Reduce.bus_factor(8), 1.0);
        assert_eq!(Bench::SendRecv.bus_factor(8), 1.0);
        assert_eq!(Bench::AllReduce.bus_factor(1), 0.0);
    }
}
