//! `braid.UniqueId`: the rendezvous address and secret a communicator is
//! created from (NCCL's `ncclUniqueId`).

use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::Duration;

use braid::{RootServer, UniqueId};
use pyo3::prelude::*;

use crate::errors::{invalid, py_err};

/// The rendezvous of one communicator: the root's address and a random
/// secret every rank must prove.
///
/// One process creates it with ``UniqueId.create()`` (which starts the
/// rendezvous root in that process), passes ``str(uid)`` to the other ranks
/// (it carries the secret: send it over a trusted channel), and every rank
/// calls ``Communicator.init(uid, rank, nranks)``.
#[pyclass(module = "braid._braid", name = "UniqueId", frozen)]
pub(crate) struct PyUniqueId {
    pub(crate) id: UniqueId,
    /// The root this process hosts, handed to the first `init` here.
    pub(crate) root: Mutex<Option<RootServer>>,
}

impl PyUniqueId {
    pub(crate) fn take_root(&self) -> Option<RootServer> {
        self.root.lock().ok().and_then(|mut r| r.take())
    }
}

pub(crate) fn timeout_arg(py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_finite() && t > 0.0 && t < 1e9 => Ok(Some(Duration::from_secs_f64(t))),
        Some(t) => Err(invalid(
            py,
            format!("timeout must be a positive number of seconds, not {t}"),
        )),
    }
}

/// `timeout` (seconds), or `BRAID_TIMEOUT`'s (default 120 s) when None.
fn timeout_or_env(py: Python<'_>, timeout: Option<f64>) -> PyResult<Duration> {
    match timeout_arg(py, timeout)? {
        Some(t) => Ok(t),
        None => Ok(braid::Config::from_env()
            .map_err(|e| py_err(py, &e))?
            .timeout),
    }
}

#[pymethods]
impl PyUniqueId {
    /// Parse the text form ``<ip>:<port>/<32 hex digits>`` (``str(uid)``).
    #[new]
    fn new(py: Python<'_>, text: &str) -> PyResult<Self> {
        let id: UniqueId = text.parse().map_err(|e| py_err(py, &e))?;
        Ok(PyUniqueId {
            id,
            root: Mutex::new(None),
        })
    }

    /// A new unique id with a random secret, and its rendezvous root
    /// running in this process on ``host`` (an IP address of this host that
    /// the other ranks can reach) and ``port`` (0: any free port). The root
    /// waits at most ``timeout`` seconds (default ``BRAID_TIMEOUT``, 120)
    /// for the ranks to join.
    #[staticmethod]
    #[pyo3(signature = (host = "127.0.0.1", port = 0, timeout = None))]
    fn create(py: Python<'_>, host: &str, port: u16, timeout: Option<f64>) -> PyResult<Self> {
        let ip: IpAddr = host.parse().map_err(|_| {
            invalid(
                py,
                format!("host {host:?} is not an IP address (e.g. 127.0.0.1 or 10.0.0.1)"),
            )
        })?;
        let timeout = timeout_or_env(py, timeout)?;
        let (id, root) = py
            .detach(move || -> braid::Result<(UniqueId, RootServer)> {
                // The secret comes from the OS; the address from the bound
                // listener (the real port when `port` is 0).
                let secret = UniqueId::generate(SocketAddr::new(ip, port))?.secret;
                let root = RootServer::listen(SocketAddr::new(ip, port), secret, timeout)?;
                Ok((
                    UniqueId {
                        addr: root.addr(),
                        secret,
                    },
                    root,
                ))
            })
            .map_err(|e| py_err(py, &e))?;
        Ok(PyUniqueId {
            id,
            root: Mutex::new(Some(root)),
        })
    }

    /// The root's address, ``"ip:port"``.
    #[getter]
    fn address(&self) -> String {
        self.id.addr.to_string()
    }

    /// Whether this process hosts the rendezvous root of this id (and has
    /// not yet handed it to a communicator).
    #[getter]
    fn hosts_root(&self) -> bool {
        self.root.lock().map(|r| r.is_some()).unwrap_or(false)
    }

    fn __str__(&self) -> String {
        self.id.to_string()
    }

    fn __repr__(&self) -> String {
        format!("<braid.UniqueId {} (secret not shown)>", self.id.addr)
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyUniqueId>()
            .map(|o| o.get().id == self.id)
            .unwrap_or(false)
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.id.hash(&mut h);
        h.finish()
    }

    /// Pickles as its text form (the root stays in the creating process).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<(Py<PyAny>, (String,))> {
        let cls = slf.get_type().into_any().unbind();
        Ok((cls, (slf.get().id.to_string(),)))
    }
}

/// A port reserved for a rendezvous root whose secret is not known yet
/// (torch's reconfigure: each process hands out where it would host, and
/// the group's first process hosts once the group is chosen). The listener
/// is bound now and kept, so the address stays this process's.
#[pyclass(module = "braid._braid", name = "RootSlot", frozen)]
pub(crate) struct PyRootSlot {
    listener: Mutex<Option<std::net::TcpListener>>,
    addr: SocketAddr,
}

#[pymethods]
impl PyRootSlot {
    /// Reserve a port on ``host`` (an IP address of this host the other
    /// ranks reach).
    #[new]
    #[pyo3(signature = (host = "127.0.0.1"))]
    fn new(py: Python<'_>, host: &str) -> PyResult<Self> {
        let ip: IpAddr = host.parse().map_err(|_| {
            invalid(
                py,
                format!("host {host:?} is not an IP address (e.g. 127.0.0.1 or 10.0.0.1)"),
            )
        })?;
        let listener = std::net::TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| {
            invalid(
                py,
                format!("cannot listen on {ip} for a rendezvous root: {e}"),
            )
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| invalid(py, format!("the reserved listener's address: {e}")))?;
        Ok(PyRootSlot {
            listener: Mutex::new(Some(listener)),
            addr,
        })
    }

    /// The reserved address, ``"ip:port"``.
    #[getter]
    fn address(&self) -> String {
        self.addr.to_string()
    }

    /// Start the root on the reserved port with ``secret`` (32 hex digits):
    /// the id to create the communicator with (``Communicator.init`` on
    /// this process takes the root). A slot starts one root.
    #[pyo3(signature = (secret, timeout = None))]
    fn start(&self, py: Python<'_>, secret: &str, timeout: Option<f64>) -> PyResult<PyUniqueId> {
        let id: UniqueId = format!("{}/{secret}", self.addr)
            .parse()
            .map_err(|e| py_err(py, &e))?;
        let timeout = timeout_or_env(py, timeout)?;
        let listener = self
            .listener
            .lock()
            .ok()
            .and_then(|mut l| l.take())
            .ok_or_else(|| invalid(py, "this root slot already started its root"))?;
        let root = py
            .detach(move || RootServer::spawn(listener, id.secret, timeout))
            .map_err(|e| py_err(py, &e))?;
        Ok(PyUniqueId {
            id,
            root: Mutex::new(Some(root)),
        })
    }
}
