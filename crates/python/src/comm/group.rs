//! `braid.Group`: point-to-point operations collected and run together.

use pyo3::prelude::*;

use crate::errors::invalid;
use crate::views::View;
use crate::work::{Handle, Job, P2pOp};

use super::prep::{check_peer, view, Prepared};
use super::PyComm;

/// Point-to-point operations of one group (``Communicator.group()``): add
/// them with ``send``/``recv``; they run together when the ``with`` block
/// ends (or on ``run()``).
#[pyclass(module = "braid._braid", name = "Group")]
pub(crate) struct PyGroup {
    pub(super) comm: Py<PyComm>,
    pub(super) ops: Vec<P2pOp>,
    pub(super) keep: Vec<View>,
}

#[pymethods]
impl PyGroup {
    /// Add a send of ``buf`` to ``peer``.
    fn send(&mut self, py: Python<'_>, buf: &Bound<'_, PyAny>, peer: i64) -> PyResult<()> {
        let c = self.comm.get();
        let peer = check_peer(py, "send", peer, c.p(), c.me())?;
        let v = view(py, buf, "buf", false)?;
        if self.ops.iter().any(|o| !o.send && o.buf.overlaps(&v.raw)) {
            return Err(invalid(
                py,
                "send: this buffer overlaps a receive buffer of the group",
            ));
        }
        self.ops.push(P2pOp {
            send: true,
            peer,
            buf: v.raw,
        });
        self.keep.push(v);
        Ok(())
    }

    /// Add a receive into ``buf`` from ``peer``.
    fn recv(&mut self, py: Python<'_>, buf: &Bound<'_, PyAny>, peer: i64) -> PyResult<()> {
        let c = self.comm.get();
        let peer = check_peer(py, "recv", peer, c.p(), c.me())?;
        let v = view(py, buf, "buf", true)?;
        if self.ops.iter().any(|o| o.buf.overlaps(&v.raw)) {
            return Err(invalid(
                py,
                "recv: this buffer overlaps another buffer of the group; a receive needs memory of its own",
            ));
        }
        self.ops.push(P2pOp {
            send: false,
            peer,
            buf: v.raw,
        });
        self.keep.push(v);
        Ok(())
    }

    /// Run the operations added so far (all ranks involved run theirs);
    /// returns a ``Handle`` with ``async_op=True``.
    #[pyo3(signature = (*, async_op = false))]
    fn run(&mut self, py: Python<'_>, async_op: bool) -> PyResult<Option<Handle>> {
        let ops = std::mem::take(&mut self.ops);
        let keep = std::mem::take(&mut self.keep);
        let prep = Prepared::new(Job::Group(ops), keep);
        self.comm.get().launch(py, prep, async_op)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (exc_type, _exc = None, _tb = None))]
    fn __exit__(
        &mut self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if exc_type.is_some_and(|t| !t.is_none()) {
            // The block raised: nothing is sent.
            self.ops.clear();
            self.keep.clear();
            return Ok(false);
        }
        self.run(py, false)?;
        Ok(false)
    }
}
