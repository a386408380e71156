//! `braid-run`: start N local braid ranks with their environment set.
//!
//! See `braid-run --help` (text in [`cli::usage`]).

mod cli;
mod launch;
mod output;

use std::process::ExitCode;

/// Exit code for usage errors.
const EXIT_USAGE: u8 = 2;

fn main() -> ExitCode {
    let action = match cli::parse_args(std::env::args_os().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("braid-run: error: {e}");
            eprintln!("Run 'braid-run --help' for usage.");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match action {
        cli::Action::Help => {
            print!("{}", cli::usage());
            ExitCode::SUCCESS
        }
        cli::Action::Version => {
            println!("braid-run {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        cli::Action::Run(cfg) => {
            let code = launch::run(&cfg);
            ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
    }
}
