//! braid-perf: the nccl-tests-compatible benchmark of braid's collectives.
//!
//! The binary (`src/main.rs`) parses the command line ([`cli`]), starts
//! local ranks for `-np` ([`launch`]) or joins the launcher's communicator,
//! runs the sweep ([`bench`](mod@bench)), prints nccl-tests' table ([`format`](mod@format)), and
//! writes JSON ([`report`]) and plots ([`plot`]).

pub mod bench;
pub mod cli;
pub mod format;
pub mod launch;
pub mod plot;
pub mod report;
