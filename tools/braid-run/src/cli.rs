//! Command-line parsing for `braid-run` (pure: no I/O, unit-tested).

use std::ffi::OsString;
use std::time::Duration;

/// Most ranks one `braid-run` will start (each costs a process and two
/// output threads); a guard against typos such as `-n 40000`.
pub(crate) const MAX_RANKS: usize = 4096;

/// Default time between SIGTERM and SIGKILL when stopping ranks.
pub(crate) const DEFAULT_GRACE: Duration = Duration::from_secs(2);

/// What the user asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    /// `-h` / `--help`: print [`usage`] and exit 0.
    Help,
    /// `--version`: print the version and exit 0.
    Version,
    /// Start a job.
    Run(Config),
}

/// A job to launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Config {
    /// Number of ranks (>= 1).
    pub nranks: usize,
    /// Kill everything and fail if the job runs longer than this.
    pub timeout: Option<Duration>,
    /// Prefix each output line with `[rank] `.
    pub prefix: bool,
    /// Time between SIGTERM and SIGKILL when stopping ranks.
    pub grace: Duration,
    /// The program to run, then its arguments (never empty).
    pub command: Vec<OsString>,
}

/// A usage error: the message says what was wrong and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The `--help` text.
pub(crate) fn usage() -> &'static str {
    "\
Usage: braid-run -n N [options] [--] CMD [ARGS...]

Start N local braid ranks, each running CMD ARGS, and wait for them.

Each rank gets in its environment:
  BRAID_UNIQUE_ID    <addr>:<port>/<32 hex digits>, the same for all ranks; a
                     fresh one is generated for every run (a BRAID_UNIQUE_ID
                     already in braid-run's environment is replaced). The port
                     is a free TCP port on 127.0.0.1 that rank 0 binds as the
                     bootstrap root.
  BRAID_RANK         0..N-1
  BRAID_NRANKS       N
  BRAID_LOCAL_RANK   same as BRAID_RANK
  BRAID_LOCAL_SIZE   N

Options:
  -n, --np N         number of ranks to start (required, 1..=4096)
      --timeout SECS stop all ranks and fail (exit 124) if the job runs longer
      --grace SECS   time between SIGTERM and SIGKILL when stopping ranks
                     (default 2)
      --no-prefix    do not prefix output lines with \"[rank] \"
  -h, --help         print this help
      --version      print the version

Each line a rank writes to stdout (stderr) is written to braid-run's stdout
(stderr) as a whole line, prefixed with \"[rank] \". Ranks read stdin from
/dev/null. Each rank runs in its own process group.

If a rank exits with a non-zero status or is killed by a signal, braid-run
sends SIGTERM to every rank's process group, SIGKILL after the grace period,
and exits with that rank's status (128+signal if it was killed). SIGINT and
SIGTERM sent to braid-run are forwarded to the ranks, which are then stopped
the same way; braid-run then exits with 128+signal.

Exit status: 0 if all ranks succeeded; 2 on usage errors; 124 on timeout;
126/127 if CMD cannot be started; otherwise as above.
"
}

fn err<T>(msg: impl Into<String>) -> Result<T, UsageError> {
    Err(UsageError(msg.into()))
}

fn parse_nranks(v: &str) -> Result<usize, UsageError> {
    match v.trim().parse::<usize>() {
        Ok(0) => err("-n/--np must be at least 1"),
        Ok(n) if n > MAX_RANKS => err(format!(
            "-n/--np {n} is more than the {MAX_RANKS} ranks braid-run starts on one host"
        )),
        Ok(n) => Ok(n),
        Err(_) => err(format!(
            "invalid number of ranks {v:?} for -n/--np: expected a positive integer, e.g. -n 4"
        )),
    }
}

fn parse_secs(opt: &str, v: &str, allow_zero: bool) -> Result<Duration, UsageError> {
    let bad = || {
        err(format!(
            "invalid value {v:?} for {opt}: expected a number of seconds{}, e.g. {opt} 30",
            if allow_zero { "" } else { " greater than 0" }
        ))
    };
    let secs: f64 = match v.trim().parse() {
        Ok(s) => s,
        Err(_) => return bad(),
    };
    if !secs.is_finite() || secs < 0.0 || (!allow_zero && secs == 0.0) {
        return bad();
    }
    match Duration::try_from_secs_f64(secs) {
        Ok(d) => Ok(d),
        Err(_) => bad(),
    }
}

/// Parses the arguments after the program name.
///
/// Options come first; the first argument that is not an option (or
/// everything after `--`) is the command, and all that follows belongs to it.
pub(crate) fn parse_args<I>(args: I) -> Result<Action, UsageError>
where
    I: IntoIterator<Item = OsString>,
{
    let mut args = args.into_iter();
    let mut nranks = None;
    let mut timeout = None;
    let mut grace = DEFAULT_GRACE;
    let mut prefix = true;
    let mut command = Vec::new();

    while let Some(arg) = args.next() {
        let Some(s) = arg.to_str() else {
            if arg.as_encoded_bytes().starts_with(b"-") {
                return err(format!("option {arg:?} is not valid UTF-8"));
            }
            command.push(arg);
            break;
        };
        if s == "--" {
            break;
        }
        if !s.starts_with('-') || s == "-" {
            command.push(arg);
            break;
        }
        // Split `--opt=value` and `-nVALUE`.
        let (name, inline): (&str, Option<&str>) = if let Some(rest) = s.strip_prefix("--") {
            match rest.split_once('=') {
                Some((n, v)) => (&s[..n.len() + 2], Some(v)),
                None => (s, None),
            }
        } else if s.len() > 2 && s.starts_with("-n") {
            ("-n", Some(&s[2..]))
        } else {
            (s, None)
        };
        let takes_value = matches!(name, "-n" | "--np" | "--timeout" | "--grace");
        if !takes_value && inline.is_some() {
            return err(format!("option {name} does not take a value"));
        }
        let mut value = || -> Result<String, UsageError> {
            if let Some(v) = inline {
                return Ok(v.to_owned());
            }
            match args.next() {
                None => err(format!("option {name} needs a value")),
                Some(v) => match v.into_string() {
                    Ok(v) => Ok(v),
                    Err(v) => err(format!("value {v:?} for {name} is not valid UTF-8")),
                },
            }
        };
        match name {
            "-h" | "--help" => return Ok(Action::Help),
            "--version" => return Ok(Action::Version),
            "-n" | "--np" => nranks = Some(parse_nranks(&value()?)?),
            "--timeout" => timeout = Some(parse_secs("--timeout", &value()?, false)?),
            "--grace" => grace = parse_secs("--grace", &value()?, true)?,
            "--no-prefix" => prefix = false,
            _ => {
                return err(format!(
                    "unknown option {name:?} (put `--` before the command if it is the command's)"
                ))
            }
        }
    }
    command.extend(args);

    let Some(nranks) = nranks else {
        return err("the number of ranks is required: use -n N, e.g. braid-run -n 4 ./my_program");
    };
    if command.is_empty() {
        return err("no command given: put the program to run after the options, e.g. braid-run -n 4 ./my_program");
    }
    Ok(Action::Run(Config {
        nranks,
        timeout,
        prefix,
        grace,
        command,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Action, UsageError> {
        parse_args(args.iter().map(OsString::from))
    }

    fn run(args: &[&str]) -> Config {
        match parse(args) {
            Ok(Action::Run(c)) => c,
            other => panic!("expected a Run for {args:?}, got {other:?}"),
        }
    }

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn basic_forms() {
        let c = run(&["-n", "4", "prog", "a", "-n", "--x"]);
        assert_eq!(c.nranks, 4);
        assert_eq!(c.command, os(&["prog", "a", "-n", "--x"]));
        assert!(c.prefix);
        assert_eq!(c.grace, DEFAULT_GRACE);
        assert_eq!(c.timeout, None);

        assert_eq!(run(&["-n3", "p"]).nranks, 3);
        assert_eq!(run(&["--np", "5", "p"]).nranks, 5);
        assert_eq!(run(&["--np=6", "p"]).nranks, 6);
        let c = run(&[
            "--timeout",
            "1.5",
            "--grace=0",
            "--no-prefix",
            "-n",
            "2",
            "--",
            "-weird",
        ]);
        assert_eq!(c.timeout, Some(Duration::from_millis(1500)));
        assert_eq!(c.grace, Duration::ZERO);
        assert!(!c.prefix);
        assert_eq!(c.command, os(&["-weird"]));
        // `--` stops option parsing even if options would follow.
        assert_eq!(run(&["-n", "1", "--", "--help"]).command, os(&["--help"]));
    }

    #[test]
    fn help_and_version() {
        assert_eq!(parse(&["-h"]), Ok(Action::Help));
        assert_eq!(parse(&["-n", "2", "--help"]), Ok(Action::Help));
        assert_eq!(parse(&["--version"]), Ok(Action::Version));
        // After the command, --help belongs to the command.
        assert!(matches!(
            parse(&["-n", "2", "p", "--help"]),
            Ok(Action::Run(_))
        ));
        assert!(usage().contains("-n, --np N"));
    }

    #[test]
    fn usage_errors() {
        let cases: &[(&[&str], &str)] = &[
            (&[], "number of ranks is required"),
            (&["prog"], "number of ranks is required"),
            (&["-n", "2"], "no command"),
            (&["-n", "2", "--"], "no command"),
            (&["-n"], "needs a value"),
            (&["-n", "0", "p"], "at least 1"),
            (&["-n", "-1", "p"], "invalid number of ranks"),
            (&["-n", "abc", "p"], "invalid number of ranks"),
            (&["-n", "99999", "p"], "more than the"),
            (&["--timeout", "0", "-n", "1", "p"], "greater than 0"),
            (&["--timeout", "nan", "-n", "1", "p"], "--timeout"),
            (&["--timeout", "inf", "-n", "1", "p"], "--timeout"),
            (&["--timeout", "1e300", "-n", "1", "p"], "--timeout"),
            (&["--grace", "-1", "-n", "1", "p"], "--grace"),
            (&["--bogus", "-n", "1", "p"], "unknown option \"--bogus\""),
            (&["--no-prefix=1", "-n", "1", "p"], "does not take a value"),
        ];
        for (args, want) in cases {
            match parse(args) {
                Err(UsageError(msg)) => {
                    assert!(msg.contains(want), "{args:?}: {msg:?} lacks {want:?}")
                }
                Ok(a) => panic!("{args:?} parsed as {a:?}, expected an error"),
            }
        }
    }

    #[test]
    fn non_utf8_command_is_kept() {
        use std::os::unix::ffi::OsStringExt;
        let bad = OsString::from_vec(vec![b'p', 0xff]);
        let args = vec![OsString::from("-n"), OsString::from("1"), bad.clone()];
        match parse_args(args) {
            Ok(Action::Run(c)) => assert_eq!(c.command, vec![bad]),
            other => panic!("{other:?}"),
        }
        let opt = OsString::from_vec(vec![b'-', 0xff]);
        assert!(parse_args(vec![opt]).is_err());
    }
}
