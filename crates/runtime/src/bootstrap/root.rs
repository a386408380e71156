//! [`RootServer`]: the rendezvous service on a thread of its own, and the
//! ways to start one.

use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::id::{random_bytes, UniqueId};
use super::io::{Driver, Shared};
use super::rendezvous::{Rendezvous, Settings};
use super::MAX_TIMEOUT;
use crate::error::{Error, Result};

/// A running bootstrap root (the rendezvous service), on a background thread
/// named `braid-bootstrap-root`.
///
/// The thread ends by itself when all ranks have left, after an error, or at
/// its deadline. Dropping a `RootServer` detaches the thread (the job keeps
/// its root), except that while the root is delivering its last messages
/// (after an error, so that every rank learns why) the drop waits for them,
/// for at most about 2 s. [`RootServer::shutdown`] stops it,
/// [`RootServer::join`] waits for it.
#[derive(Debug)]
pub struct RootServer {
    addr: SocketAddr,
    wake: Option<UnixStream>,
    handle: Option<JoinHandle<Result<()>>>,
    shared: Arc<Shared>,
}

impl RootServer {
    /// Binds `addr` (port 0 picks a free port), generates a secret and runs
    /// a root there, like `ncclGetUniqueId`: returns the id to hand to every
    /// rank (its text form, say) and the root, to keep alive until the
    /// ranks have joined (or to pass to
    /// [`crate::Communicator::init_hosting`]). All ranks must join within
    /// `timeout`, and every later bootstrap round complete within `timeout`
    /// of its first contribution.
    pub fn create(addr: SocketAddr, timeout: Duration) -> Result<(UniqueId, RootServer)> {
        let secret = random_bytes()?;
        let server = RootServer::listen(addr, secret, timeout)?;
        Ok((
            UniqueId {
                addr: server.addr(),
                secret,
            },
            server,
        ))
    }

    /// Runs a root on an already bound `listener`. Ranks must all join
    /// within `timeout` of this call; every later round must complete within
    /// `timeout` of its first contribution.
    pub fn spawn(listener: TcpListener, secret: [u8; 16], timeout: Duration) -> Result<RootServer> {
        if timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "the bootstrap timeout must be greater than zero".into(),
            ));
        }
        let timeout = timeout.min(MAX_TIMEOUT);
        let io_err = |what: &str, source| Error::BootstrapIo {
            what: what.to_string(),
            source,
        };
        let addr = listener
            .local_addr()
            .map_err(|e| io_err("cannot read the root listener's address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err("cannot make the root listener nonblocking", e))?;
        let (wake_tx, wake_rx) =
            UnixStream::pair().map_err(|e| io_err("cannot create the root's wake-up socket", e))?;
        wake_rx
            .set_nonblocking(true)
            .map_err(|e| io_err("cannot make the root's wake-up socket nonblocking", e))?;
        let shared = Shared::new();
        let limit = super::fd_limit();
        let mut cfg = Settings::new(addr, secret, timeout);
        cfg.max_pending = super::pending_cap(limit);
        let machine = Rendezvous::new(cfg, Instant::now());
        let mut driver = Driver::new(listener, addr, wake_rx, machine, shared.clone(), timeout);
        driver.set_fd_limit(limit);
        let handle = std::thread::Builder::new()
            .name("braid-bootstrap-root".into())
            .spawn(move || {
                let out = driver.run();
                match &out {
                    Ok(()) => tracing::debug!(root = %addr, "bootstrap root finished"),
                    Err(e) => tracing::debug!(root = %addr, "bootstrap root gave up: {e}"),
                }
                out
            })
            .map_err(|e| io_err("cannot start the bootstrap root thread", e))?;
        tracing::debug!(root = %addr, "bootstrap root listening");
        Ok(RootServer {
            addr,
            wake: Some(wake_tx),
            handle: Some(handle),
            shared,
        })
    }

    /// Binds `id.addr` and runs a root there with `id.secret`.
    pub fn bind(id: &UniqueId, timeout: Duration) -> Result<RootServer> {
        RootServer::listen(id.addr, id.secret, timeout)
    }

    /// Binds `bind` (port 0 picks a free port) and runs a root there.
    pub fn listen(bind: SocketAddr, secret: [u8; 16], timeout: Duration) -> Result<RootServer> {
        RootServer::spawn(bind_listener(bind)?, secret, timeout)
    }

    /// The address the root listens on (the real port when bound to port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether the root thread has ended (its last messages delivered).
    pub fn is_finished(&self) -> bool {
        match &self.handle {
            None => true,
            Some(h) => h.is_finished(),
        }
    }

    /// Waits for the root thread to end and returns its outcome: `Ok` when
    /// the ranks completed and left, the error it sent to the ranks otherwise.
    pub fn join(mut self) -> Result<()> {
        self.join_inner()
    }

    /// Stops the root (connected ranks get an error) and waits for it.
    pub fn shutdown(mut self) -> Result<()> {
        if let Some(mut w) = self.wake.take() {
            let _ = w.write_all(b"x");
        }
        self.join_inner()
    }

    fn join_inner(&mut self) -> Result<()> {
        match self.handle.take() {
            None => Ok(()),
            Some(h) => h.join().unwrap_or_else(|_| {
                Err(Error::Bootstrap(
                    "the bootstrap root thread panicked".into(),
                ))
            }),
        }
    }
}

impl Drop for RootServer {
    /// An owner that drops its root as soon as its own rank got the root's
    /// error (and then exits) must not cut off the other ranks' copies.
    fn drop(&mut self) {
        self.shared.wait_delivered();
    }
}

/// Binds a TCP listener with errors that say what to do.
pub(crate) fn bind_listener(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr).map_err(|e| {
        let what = match e.kind() {
            io::ErrorKind::AddrInUse => format!(
                "cannot host the bootstrap root on {addr}: address in use (another process, \
                 perhaps an earlier job, holds port {}); choose another port (BRAID_PORT) or a \
                 new unique id",
                addr.port()
            ),
            io::ErrorKind::AddrNotAvailable => format!(
                "cannot host the bootstrap root on {addr}: {} is not an address of this host; \
                 the root must run on the host named in the unique id (set BRAID_ROOT_ADDR)",
                addr.ip()
            ),
            _ => format!("cannot host the bootstrap root on {addr}"),
        };
        Error::BootstrapIo { what, source: e }
    })
}

/// [`RootServer::create`] with the timeout from `BRAID_TIMEOUT`
/// ([`crate::launch::timeout_from_env`]).
pub(crate) fn create_unique_id(addr: SocketAddr) -> Result<(UniqueId, RootServer)> {
    RootServer::create(addr, crate::launch::timeout_from_env()?)
}

/// [`RootServer::create`].
pub(crate) fn create_unique_id_with_timeout(
    addr: SocketAddr,
    timeout: Duration,
) -> Result<(UniqueId, RootServer)> {
    RootServer::create(addr, timeout)
}
