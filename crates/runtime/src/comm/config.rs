//! The options of communicator creation.

use super::*;

/// Options for creating a communicator.
#[derive(Clone, Debug)]
pub struct Config {
    /// Bound on every wait without progress (bootstrap, connection set-up,
    /// operations). Default: `BRAID_TIMEOUT` or 120 s.
    pub timeout: Duration,
    /// Abort flag: setting it (from any thread) makes communicator creation
    /// give up within about 50 ms while it waits in the rendezvous or a
    /// bootstrap round (link set-up waits stay bounded by `timeout`), and,
    /// once created, works as [`Communicator::abort`]. Communicators created
    /// with one flag share it: setting it aborts all of them (the threads of
    /// [`Communicator::init_threads`], say). `None`: a flag of its own.
    pub abort: Option<Arc<AtomicBool>>,
}

impl Config {
    /// Defaults, overridden by the environment (`BRAID_TIMEOUT`).
    pub fn from_env() -> Result<Config> {
        Ok(Config {
            timeout: timeout_from_env()?,
            abort: None,
        })
    }

    /// This configuration with an abort flag (see [`Config::abort`]).
    pub fn with_abort(mut self, flag: Arc<AtomicBool>) -> Config {
        self.abort = Some(flag);
        self
    }
}
