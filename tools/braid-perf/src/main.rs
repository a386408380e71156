//! braid-perf: nccl-tests for braid. See `braid-perf --help`.

use std::process::ExitCode;

use braid::{Communicator, Config};
use braid_perf::bench::{self, BenchError, Runner};
use braid_perf::cli::{self, Command, Opts};
use braid_perf::plot::Placement;
use braid_perf::report::{self, Report};
use braid_perf::{launch, plot::plot_reports};

/// Exit status for usage errors.
const USAGE: u8 = 2;

fn main() -> ExitCode {
    let mut argv = std::env::args();
    let argv0 = argv.next().unwrap_or_default();
    let args: Vec<String> = argv.collect();
    let cmd = match cli::parse(&argv0, &args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{}", launch::error_line(&e.to_string()));
            return ExitCode::from(USAGE);
        }
    };
    match cmd {
        Command::Help(t) => {
            print!("{t}");
            ExitCode::SUCCESS
        }
        Command::Version => {
            println!("braid-perf {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Command::Plot(p) => {
            let reports: Result<Vec<Report>, String> =
                p.inputs.iter().map(|f| Report::load(f)).collect();
            let placement = if p.in_place {
                Placement::InPlace
            } else {
                Placement::OutOfPlace
            };
            match reports.and_then(|r| {
                plot_reports(&r, &p.out, p.title.as_deref(), placement, p.coll.as_deref())
            }) {
                Ok(()) => {
                    println!("braid-perf: wrote {}", p.out.display());
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e, 1),
            }
        }
        Command::ImportMpi(i) => {
            let res = std::fs::read_to_string(&i.input)
                .map_err(|e| format!("cannot read {}: {e}", i.input.display()))
                .and_then(|t| report::import_mpi_csv(&t, i.label.as_deref()))
                .and_then(|r| r.save(&i.out).map(|_| r.rows.len()));
            match res {
                Ok(n) => {
                    println!("braid-perf: {n} rows -> {}", i.out.display());
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e, 1),
            }
        }
        Command::Bench(o) => {
            if o.np.is_some() {
                match launch::launch(&o) {
                    Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
                    Err(e) => fail(&e, 1),
                }
            } else {
                rank_main(&o)
            }
        }
    }
}

fn fail(msg: &str, code: u8) -> ExitCode {
    eprintln!("{}", launch::error_line(msg));
    ExitCode::from(code)
}

/// One rank: join, run the sweep, write JSON and the plot (rank 0).
fn rank_main(o: &Opts) -> ExitCode {
    let comm = match &o.child {
        Some(c) => {
            launch::die_with_parent();
            let config = Config::from_env().map(|mut cfg| {
                if let Some(t) = o.timeout {
                    cfg.timeout = cli::timeout_duration(t);
                }
                cfg
            });
            config.and_then(|cfg| Communicator::init(&c.id, c.rank, c.nranks, &cfg))
        }
        None => {
            if let Some(t) = o.timeout {
                // Single-threaded still: nothing else reads the environment.
                std::env::set_var("BRAID_TIMEOUT", t.to_string());
            }
            Communicator::from_env()
        }
    };
    let comm = match comm {
        Ok(c) => c,
        Err(braid::Error::Env(m)) => {
            return fail(
                &format!("{m}\n  (or pass -np N to start N local ranks; see --help)"),
                USAGE,
            )
        }
        Err(e) => return fail(&format!("cannot join the communicator: {e}"), 1),
    };
    let rank = comm.rank();
    if bench::fault() == Some(bench::Fault::Exit(rank)) {
        eprintln!("braid-perf: rank {rank}: exiting on purpose (BRAID_PERF_FAULT)");
        std::process::exit(3);
    }
    let who = |m: &str| launch::for_rank(rank, m);
    let stdout = Box::new(std::io::stdout());
    let mut command = format!("braid-perf {}", o.bench.name());
    let mut it = launch::strip_np(&o.raw_args).into_iter();
    while let Some(a) = it.next() {
        if a.starts_with("--child-") {
            it.next();
            continue;
        }
        command = command + " " + &a;
    }
    if o.child.is_some() {
        command += &format!(" -np {}", comm.nranks());
    }
    let summary = Runner::new(&comm, o, stdout).and_then(|mut r| r.run(&command));
    let summary = match summary {
        Ok(s) => s,
        Err(BenchError::Usage(m)) => return fail(&who(&m), USAGE),
        Err(e) => {
            comm.abort();
            return fail(&who(&e.to_string()), 1);
        }
    };
    let mut code = 0u8;
    if rank == 0 {
        let rep = summary.report;
        if let Some(j) = &o.json {
            if let Err(e) = rep.save(j) {
                eprintln!("{}", launch::error_line(&e));
                code = 1;
            }
        }
        if let Some(p) = &o.plot {
            if let Err(e) = plot_reports(&[rep], p, None, Placement::Both, None) {
                eprintln!("{}", launch::error_line(&e));
                code = 1;
            }
        }
    }
    if summary.wrong_total > 0 {
        if rank == 0 {
            eprintln!(
                "braid-perf: {} wrong elements: results differ from the reference",
                summary.wrong_total
            );
        }
        code = 1;
    }
    ExitCode::from(code)
}
