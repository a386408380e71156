//! braid's errors as Python exceptions.
//!
//! The classes live in Python (`braid/errors.py`) so that they can also
//! derive from the built-in exceptions (`InvalidArgumentError` is a
//! `ValueError`, `TimeoutError` a built-in `TimeoutError`). An error is
//! classified here, without the GIL (operations complete on a stream's
//! thread), and becomes an exception once it reaches Python.

use braid::{Error, ErrorKind};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Which exception class an error becomes (the names in `braid.errors`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    InvalidArgument,
    Timeout,
    PeerFailed,
    Mismatch,
    Unusable,
    Revoked,
    Bootstrap,
    Config,
    Cuda,
    Other,
}

impl Kind {
    fn class_name(self) -> &'static str {
        match self {
            Kind::InvalidArgument => "InvalidArgumentError",
            Kind::Timeout => "TimeoutError",
            Kind::PeerFailed => "PeerFailedError",
            Kind::Mismatch => "MismatchError",
            Kind::Unusable => "UnusableError",
            Kind::Revoked => "RevokedError",
            Kind::Bootstrap => "BootstrapError",
            Kind::Config => "ConfigError",
            Kind::Cuda => "CudaError",
            Kind::Other => "Error",
        }
    }
}

/// An error, classified, with the facts the exception carries as
/// attributes (`peer`, `rank`, `op`, `seq`).
#[derive(Clone, Debug)]
pub(crate) struct ErrInfo {
    pub kind: Kind,
    pub msg: String,
    pub peer: Option<u32>,
    pub rank: Option<u32>,
    pub op: Option<String>,
    pub seq: Option<u64>,
}

impl ErrInfo {
    pub(crate) fn new(kind: Kind, msg: impl Into<String>) -> ErrInfo {
        ErrInfo {
            kind,
            msg: msg.into(),
            peer: None,
            rank: None,
            op: None,
            seq: None,
        }
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> ErrInfo {
        ErrInfo::new(Kind::InvalidArgument, msg)
    }

    /// Classify one of braid's errors (by its [`braid::ErrorKind`]).
    pub(crate) fn from_braid(e: &Error) -> ErrInfo {
        let kind = match e.kind() {
            ErrorKind::InvalidArgument => Kind::InvalidArgument,
            ErrorKind::Config => Kind::Config,
            ErrorKind::Bootstrap => Kind::Bootstrap,
            ErrorKind::Timeout => Kind::Timeout,
            ErrorKind::PeerFailed => Kind::PeerFailed,
            ErrorKind::Mismatch => Kind::Mismatch,
            ErrorKind::Unusable => Kind::Unusable,
            ErrorKind::Revoked => Kind::Revoked,
            ErrorKind::Cuda => Kind::Cuda,
            _ => Kind::Other,
        };
        let mut info = ErrInfo::new(kind, e.to_string());
        info.peer = e.peer();
        if let Error::Operation { rank, op, seq, .. } = e {
            info.rank = Some(*rank);
            info.op = Some(op.clone());
            info.seq = Some(*seq);
        }
        info
    }

    /// The Python exception.
    pub(crate) fn to_py(&self, py: Python<'_>) -> PyErr {
        match self.build(py) {
            Ok(e) => e,
            Err(e) => e,
        }
    }

    fn build(&self, py: Python<'_>) -> PyResult<PyErr> {
        let module = py.import("braid.errors")?;
        let class = module.getattr(self.kind.class_name())?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("peer", self.peer)?;
        kwargs.set_item("rank", self.rank)?;
        kwargs.set_item("op", self.op.as_deref())?;
        kwargs.set_item("seq", self.seq)?;
        let exc = class.call((self.msg.as_str(),), Some(&kwargs))?;
        Ok(PyErr::from_value(exc))
    }
}

/// A braid error as a Python exception.
pub(crate) fn py_err(py: Python<'_>, e: &Error) -> PyErr {
    ErrInfo::from_braid(e).to_py(py)
}

/// An `InvalidArgumentError` with this message.
pub(crate) fn invalid(py: Python<'_>, msg: impl Into<String>) -> PyErr {
    ErrInfo::invalid(msg).to_py(py)
}
