//! `braid.Communicator`: every collective on Python buffers, blocking or
//! asynchronous, and the private raw-pointer entry points of the torch
//! backend.
//!
//! Every call checks its arguments completely (buffers exported,
//! contiguous, writable where braid writes, one datatype, lengths that fit
//! the collective) and builds a [`Job`] of plain byte ranges before
//! anything is sent, so a bad call raises `InvalidArgumentError` and leaves
//! the communicator usable. Blocking calls run on the calling thread with
//! the GIL released; asynchronous ones run in issue order on the
//! communicator's worker thread (a `braid::Stream`), or on the thread that
//! waits for one before the worker started it once all before it finished
//! (`work::Queued`), and a blocking call issued while asynchronous ones are
//! pending queues behind them, so every rank sees the same order.
//!
//! `prep` checks each call's arguments and builds its job; `group` is
//! `braid.Group`; this file holds the class and its Python methods.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use braid::{Communicator, Config, Stream};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::errors::{invalid, py_err, ErrInfo, Kind};
use crate::names::{data_type, opt_op, red_op};
use crate::uid::{timeout_arg, PyUniqueId};
use crate::work::{Handle, Job, TaggedOp};

/// A communicator: a group of ranks that run collectives together.
///
/// Create one with ``Communicator.from_env()`` under a launcher (braid-run,
/// torchrun, srun, mpirun) or with ``Communicator.init(uid, rank, nranks)``.
/// Buffers are any contiguous buffer-protocol object (numpy arrays,
/// bytearray, memoryview, array.array) or DLPack producer in host memory
/// (torch CPU tensors); the datatype comes from the buffer.
///
/// Every rank must issue the same operations in the same order. Every
/// operation takes ``async_op=True`` to return a ``Handle`` at once; such
/// operations run in issue order on one worker thread.
#[pyclass(module = "braid._braid", name = "Communicator", frozen)]
pub(crate) struct PyComm {
    comm: Communicator,
    worker: Mutex<Option<Stream>>,
    /// Asynchronous operations issued and not yet finished.
    pending: Arc<AtomicUsize>,
    /// Held while a queued operation runs (on the worker, or on a thread
    /// waiting for it: `work::Queued`).
    exec: Arc<crate::work::Exec>,
    closed: AtomicBool,
    /// The device communicator, once a CUDA tensor came (torch backend).
    cuda: Mutex<Option<crate::cuda::CudaState>>,
    /// Set on the communicator `_mailbox` returns: tagged messages
    /// (`_raw_tagged`) travel on it.
    mailbox: Option<braid::Mailbox>,
}

impl Drop for PyComm {
    fn drop(&mut self) {
        // The worker finishes what was queued (bounded by the timeout); its
        // completions may need the GIL, so wait without it.
        let worker = self.worker.get_mut().ok().and_then(|w| w.take());
        if let Some(w) = worker {
            let _ = Python::try_attach(|py| py.detach(move || drop(w)));
        }
    }
}

mod group;
mod prep;

pub(crate) use group::PyGroup;
use prep::*;

#[pymethods]
impl PyComm {
    /// Create the communicator from the launcher's environment: braid-run
    /// (``BRAID_*``), torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    /// ``MASTER_PORT``: the root listens on port ``MASTER_PORT + 1``), Slurm
    /// (srun) or Open MPI (mpirun). Every rank calls it.
    #[staticmethod]
    fn from_env(py: Python<'_>) -> PyResult<PyComm> {
        let c = py
            .detach(Communicator::from_env)
            .map_err(|e| py_err(py, &e))?;
        Ok(PyComm::wrap(c))
    }

    /// Join the communicator of ``uid`` (a ``UniqueId`` or its text form)
    /// as ``rank`` of ``nranks``; every rank calls it. ``timeout`` (seconds)
    /// bounds every wait of this communicator, creation included (default
    /// ``BRAID_TIMEOUT``, 120). The process that created ``uid`` hosts the
    /// rendezvous and must call it too.
    #[staticmethod]
    #[pyo3(signature = (uid, rank, nranks, timeout = None))]
    fn init(
        py: Python<'_>,
        uid: &Bound<'_, PyAny>,
        rank: i64,
        nranks: i64,
        timeout: Option<f64>,
    ) -> PyResult<PyComm> {
        let (id, root) = if let Ok(u) = uid.cast::<PyUniqueId>() {
            (u.get().id, u.get().take_root())
        } else if let Ok(text) = uid.extract::<String>() {
            let id: braid::UniqueId = text.parse().map_err(|e| py_err(py, &e))?;
            (id, None)
        } else {
            return Err(invalid(
                py,
                "uid must be a braid.UniqueId or its text form (str(uid))",
            ));
        };
        let (Ok(rank), Ok(nranks)) = (u32::try_from(rank), u32::try_from(nranks)) else {
            return Err(invalid(
                py,
                format!("rank {rank} of {nranks}: both must be non-negative integers"),
            ));
        };
        let mut config = Config::from_env().map_err(|e| py_err(py, &e))?;
        if let Some(t) = timeout_arg(py, timeout)? {
            config.timeout = t;
        }
        let c = py
            .detach(move || match root {
                Some(root) => Communicator::init_hosting(&id, root, rank, nranks, &config),
                None => Communicator::init(&id, rank, nranks, &config),
            })
            .map_err(|e| py_err(py, &e))?;
        Ok(PyComm::wrap(c))
    }

    /// This rank, ``0 .. size-1``.
    #[getter]
    fn rank(&self) -> u32 {
        self.comm.rank()
    }

    /// The number of ranks.
    #[getter]
    fn size(&self) -> u32 {
        self.comm.nranks()
    }

    /// The transport to each rank (``"shm"``, ``"socket"``, ``"ib"``;
    /// ``"self"`` for this rank).
    #[getter]
    fn transports(&self) -> Vec<&'static str> {
        self.comm.transports().to_vec()
    }

    /// ``(ranks, cpus)``: the ranks of this host that may run on this
    /// rank's CPUs (itself included) and how many CPUs they have together.
    /// More threads per rank than ``cpus / ranks`` (torch's intra-op
    /// threads, OpenMP) oversubscribe them.
    #[getter]
    fn cpu_share(&self) -> (u32, u32) {
        self.comm.cpu_share()
    }

    /// Asynchronous operations issued and not yet finished.
    #[getter]
    fn pending(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }

    /// AllReduce: ``recvbuf[i] = op over ranks of sendbuf[i]``. With
    /// ``recvbuf=None`` in place on ``sendbuf``.
    #[pyo3(signature = (sendbuf, recvbuf = None, op = None, *, async_op = false))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        sendbuf: &Bound<'_, PyAny>,
        recvbuf: Option<&Bound<'_, PyAny>>,
        op: Option<&Bound<'_, PyAny>>,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let op = opt_op(py, op)?;
        let prep = self.prep_all_reduce(py, sendbuf, recvbuf, op)?;
        self.launch(py, prep, async_op)
    }

    /// ReduceScatter: ``sendbuf`` holds ``size * n`` elements; ``recvbuf``
    /// (``n``) receives block ``rank`` of the reduction. With
    /// ``recvbuf=None`` the result lands in block ``rank`` of ``sendbuf``.
    #[pyo3(signature = (sendbuf, recvbuf = None, op = None, *, async_op = false))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        sendbuf: &Bound<'_, PyAny>,
        recvbuf: Option<&Bound<'_, PyAny>>,
        op: Option<&Bound<'_, PyAny>>,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let op = opt_op(py, op)?;
        let prep = self.prep_reduce_scatter(py, sendbuf, recvbuf, op)?;
        self.launch(py, prep, async_op)
    }

    /// AllGather: ``recvbuf`` (``size * n``) receives every rank's
    /// ``sendbuf`` (``n``) in rank order. With ``recvbuf=None``,
    /// ``sendbuf`` is the whole buffer and this rank's block ``rank`` of it
    /// is its contribution.
    #[pyo3(signature = (sendbuf, recvbuf = None, *, async_op = false))]
    fn all_gather(
        &self,
        py: Python<'_>,
        sendbuf: &Bound<'_, PyAny>,
        recvbuf: Option<&Bound<'_, PyAny>>,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let prep = self.prep_all_gather(py, sendbuf, recvbuf)?;
        self.launch(py, prep, async_op)
    }

    /// Broadcast from ``root``: in place on ``sendbuf`` with
    /// ``recvbuf=None``; otherwise the root's ``sendbuf`` lands in every
    /// ``recvbuf`` (other ranks may pass ``sendbuf=None``).
    #[pyo3(signature = (sendbuf, recvbuf = None, root = 0, *, async_op = false))]
    fn broadcast(
        &self,
        py: Python<'_>,
        sendbuf: Option<&Bound<'_, PyAny>>,
        recvbuf: Option<&Bound<'_, PyAny>>,
        root: i64,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let prep = self.prep_broadcast(py, sendbuf, recvbuf, root)?;
        self.launch(py, prep, async_op)
    }

    /// Reduce to ``root``: the root's ``recvbuf`` receives the reduction
    /// of every rank's ``sendbuf`` (``recvbuf=None``: in place on the
    /// root's ``sendbuf``); other ranks' ``recvbuf`` is not used.
    #[pyo3(signature = (sendbuf, recvbuf = None, op = None, root = 0, *, async_op = false))]
    fn reduce(
        &self,
        py: Python<'_>,
        sendbuf: &Bound<'_, PyAny>,
        recvbuf: Option<&Bound<'_, PyAny>>,
        op: Option<&Bound<'_, PyAny>>,
        root: i64,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let op = opt_op(py, op)?;
        let prep = self.prep_reduce(py, sendbuf, recvbuf, op, root)?;
        self.launch(py, prep, async_op)
    }

    /// AllToAll: block ``j`` of ``sendbuf`` (``size`` equal blocks) goes to
    /// rank ``j`` and lands in block ``rank`` of its ``recvbuf``. With
    /// ``recvbuf=None`` in place (braid copies ``sendbuf`` first).
    #[pyo3(signature = (sendbuf, recvbuf = None, *, async_op = false))]
    fn all_to_all(
        &self,
        py: Python<'_>,
        sendbuf: &Bound<'_, PyAny>,
        recvbuf: Option<&Bound<'_, PyAny>>,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let prep = self.prep_all_to_all(py, sendbuf, recvbuf)?;
        self.launch(py, prep, async_op)
    }

    /// AllToAllv: ``sendcounts[j]`` elements from ``sendbuf`` at
    /// ``sdispls[j]`` go to rank ``j``; ``recvcounts[i]`` elements from rank
    /// ``i`` land in ``recvbuf`` at ``rdispls[i]``. Displacements (in
    /// elements) default to the running sums of the counts.
    #[pyo3(signature = (sendbuf, sendcounts, recvbuf, recvcounts, sdispls = None, rdispls = None, *, async_op = false))]
    #[allow(clippy::too_many_arguments)]
    fn all_to_allv(
        &self,
        py: Python<'_>,
        sendbuf: &Bound<'_, PyAny>,
        sendcounts: Vec<i64>,
        recvbuf: &Bound<'_, PyAny>,
        recvcounts: Vec<i64>,
        sdispls: Option<Vec<i64>>,
        rdispls: Option<Vec<i64>>,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let prep = self.prep_all_to_allv(
            py, sendbuf, sendcounts, recvbuf, recvcounts, sdispls, rdispls,
        )?;
        self.launch(py, prep, async_op)
    }

    /// Gather to ``root``: the root's ``recvbuf`` (``size * n``) receives
    /// every rank's ``sendbuf`` (``n``) in rank order; others pass
    /// ``recvbuf=None``.
    #[pyo3(signature = (sendbuf, recvbuf = None, root = 0, *, async_op = false))]
    fn gather(
        &self,
        py: Python<'_>,
        sendbuf: &Bound<'_, PyAny>,
        recvbuf: Option<&Bound<'_, PyAny>>,
        root: i64,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let prep = self.prep_gather(py, sendbuf, recvbuf, root)?;
        self.launch(py, prep, async_op)
    }

    /// Scatter from ``root``: block ``j`` of the root's ``sendbuf``
    /// (``size * n``) lands in rank ``j``'s ``recvbuf`` (``n``); others pass
    /// ``sendbuf=None``.
    #[pyo3(signature = (sendbuf, recvbuf, root = 0, *, async_op = false))]
    fn scatter(
        &self,
        py: Python<'_>,
        sendbuf: Option<&Bound<'_, PyAny>>,
        recvbuf: &Bound<'_, PyAny>,
        root: i64,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let prep = self.prep_scatter(py, sendbuf, recvbuf, root)?;
        self.launch(py, prep, async_op)
    }

    /// Send ``buf`` to ``peer``, which calls ``recv`` with as many bytes.
    /// Two ranks that send to each other must use ``group()``.
    #[pyo3(signature = (buf, peer, *, async_op = false))]
    fn send(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        peer: i64,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let prep = self.prep_p2p(py, true, buf, peer)?;
        self.launch(py, prep, async_op)
    }

    /// Receive into ``buf`` from ``peer``.
    #[pyo3(signature = (buf, peer, *, async_op = false))]
    fn recv(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        peer: i64,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let prep = self.prep_p2p(py, false, buf, peer)?;
        self.launch(py, prep, async_op)
    }

    /// Point-to-point operations issued together: ``with comm.group() as
    /// g: g.send(a, 1); g.recv(b, 1)`` runs them all when the block ends
    /// (AllToAllv, halo exchanges, ring shifts).
    fn group(slf: &Bound<'_, Self>) -> PyGroup {
        PyGroup {
            comm: slf.clone().unbind(),
            ops: Vec::new(),
            keep: Vec::new(),
        }
    }

    /// Return once every rank called ``barrier``.
    #[pyo3(signature = (*, async_op = false))]
    fn barrier(&self, py: Python<'_>, async_op: bool) -> PyResult<Option<Handle>> {
        self.launch(py, Prepared::new(Job::Barrier, vec![]), async_op)
    }

    /// Block until every asynchronous operation issued so far is done;
    /// raises the error of the communicator if one failed.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let worker = self
            .worker
            .lock()
            .map_err(|_| ErrInfo::new(Kind::Unusable, "the worker lock is poisoned").to_py(py))?;
        let Some(stream) = worker.as_ref() else {
            return Ok(());
        };
        // Behind every queued operation, and any a waiter runs (`exec`).
        let exec = self.exec.clone();
        let h = stream.submit(move |_| {
            crate::work::drain(&exec);
            Ok(())
        });
        drop(worker);
        py.detach(move || h.wait()).map_err(|e| py_err(py, &e))?;
        match self.comm.async_error() {
            Some(e) => Err(ErrInfo::new(Kind::Unusable, e).to_py(py)),
            None => Ok(()),
        }
    }

    /// Split like ``MPI_Comm_split``: every rank calls it; ranks with the
    /// same ``color`` form a new communicator ordered by ``key`` (then by
    /// rank here); ``color=None`` (or negative) takes no part and gets None.
    #[pyo3(signature = (color, key = 0))]
    fn split(&self, py: Python<'_>, color: Option<i64>, key: i64) -> PyResult<Option<PyComm>> {
        self.check_open(py)?;
        let color = match color {
            Some(c) if c >= 0 => Some(
                u32::try_from(c)
                    .map_err(|_| invalid(py, format!("color {c} does not fit in 32 bits")))?,
            ),
            _ => None,
        };
        let key = u32::try_from(key).map_err(|_| {
            invalid(
                py,
                format!("key {key} must be a non-negative 32-bit integer"),
            )
        })?;
        if self.pending.load(Ordering::Acquire) > 0 {
            self.synchronize(py)?;
        }
        let comm = &self.comm;
        let c = py
            .detach(|| comm.split(color, key))
            .map_err(|e| py_err(py, &e))?;
        Ok(c.map(PyComm::wrap))
    }

    /// Drop the ranks ``exclude`` (a sequence of ranks) and go on with the
    /// others (``ncclCommShrink``, ULFM's ``MPIX_Comm_shrink``): every rank
    /// that stays calls it with the same list and gets a new communicator
    /// of the ranks that stay, in their old order. Works after a peer died
    /// or stalled in an operation, after ``abort()`` and ``revoke()``.
    fn shrink(&self, py: Python<'_>, exclude: Vec<i64>) -> PyResult<PyComm> {
        self.check_open(py)?;
        let exclude = exclude
            .iter()
            .map(|&r| {
                u32::try_from(r).map_err(|_| {
                    invalid(py, format!("shrink: rank {r} is not a non-negative rank"))
                })
            })
            .collect::<PyResult<Vec<u32>>>()?;
        if self.pending.load(Ordering::Acquire) > 0 {
            // The pending operations end (most with the failure that calls
            // for the shrink); their errors are theirs, not shrink's.
            let _ = self.synchronize(py);
        }
        let comm = &self.comm;
        let c = py
            .detach(|| comm.shrink(&exclude))
            .map_err(|e| py_err(py, &e))?;
        Ok(PyComm::wrap(c))
    }

    /// Revoke this communicator on every rank (``ncclCommRevoke``, ULFM's
    /// ``MPIX_Comm_revoke``): every pending and later operation, here and
    /// on the other ranks, raises ``RevokedError`` naming this rank. Any
    /// thread, not collective.
    fn revoke(&self, py: Python<'_>) {
        let comm = &self.comm;
        py.detach(|| comm.revoke());
    }

    /// Whether this communicator was revoked, here or by another rank.
    fn is_revoked(&self) -> bool {
        self.comm.is_revoked()
    }

    /// The ranks whose process is gone (ULFM's ``MPIX_Comm_get_failed``),
    /// for ``shrink``. A stopped or stuck process is not gone.
    fn gone_ranks(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let comm = &self.comm;
        py.detach(|| comm.gone_ranks()).map_err(|e| py_err(py, &e))
    }

    /// On rank 0: the id new processes join with
    /// (``Communicator.init(uid, rank, new_size)``, ranks ``size..``) while
    /// every rank here calls ``grow(new_size)`` (``ncclCommGetUniqueId``).
    fn grow_id(&self, py: Python<'_>) -> PyResult<PyUniqueId> {
        self.check_open(py)?;
        let comm = &self.comm;
        let id = py.detach(|| comm.grow_id()).map_err(|e| py_err(py, &e))?;
        Ok(PyUniqueId {
            id,
            root: std::sync::Mutex::new(None),
        })
    }

    /// Add ranks (``ncclCommGrow``): every rank here calls it with the new
    /// size, rank 0 after ``grow_id()``; the new processes join with that
    /// id. The result has the ranks here first, with their ranks.
    fn grow(&self, py: Python<'_>, nranks: i64) -> PyResult<PyComm> {
        self.check_open(py)?;
        let nranks = u32::try_from(nranks)
            .map_err(|_| invalid(py, format!("grow: {nranks} is not a number of ranks")))?;
        if self.pending.load(Ordering::Acquire) > 0 {
            self.synchronize(py)?;
        }
        let comm = &self.comm;
        let c = py
            .detach(|| comm.grow(nranks))
            .map_err(|e| py_err(py, &e))?;
        Ok(PyComm::wrap(c))
    }

    /// Make every pending and later operation fail promptly (callable from
    /// any thread); the peers see an error naming this rank.
    fn abort(&self) {
        self.comm.abort();
    }

    /// The error that broke this communicator, or None (like
    /// ``ncclCommGetAsyncError``).
    fn async_error(&self) -> Option<String> {
        self.comm.async_error()
    }

    /// Finish the pending asynchronous operations and refuse new ones.
    /// The connections are released when the object is garbage collected.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.closed.store(true, Ordering::Relaxed);
        let worker = self.worker.lock().ok().and_then(|mut w| w.take());
        if let Some(w) = worker {
            py.detach(move || drop(w));
        }
        Ok(())
    }

    /// Whether ``close()`` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "<braid.Communicator rank {} of {}{}>",
            self.comm.rank(),
            self.comm.nranks(),
            if self.closed.load(Ordering::Relaxed) {
                ", closed"
            } else {
                ""
            }
        )
    }

    // ---- private entry points of the torch backend ---------------------

    /// Private (torch backend): a collective on raw host addresses the
    /// caller keeps alive (``keep``, held by the handle when asynchronous)
    /// and has checked (contiguous CPU tensors). ``kind`` is one of
    /// all_reduce, broadcast, reduce, all_gather, reduce_scatter,
    /// all_to_all, gather (the root's receive range holds one block per
    /// rank), scatter (the root's send range does); ``dt`` a datatype's name
    /// (or code) and ``op`` an operator's, as ``datatypes()`` and
    /// ``braid.Op`` name them; in place when the ranges are the same (or
    /// this rank's block of the other).
    #[pyo3(signature = (kind, dt, send_addr, send_len, recv_addr, recv_len, op = None, root = 0, async_op = false, keep = None))]
    #[allow(clippy::too_many_arguments)]
    fn _raw(
        &self,
        py: Python<'_>,
        kind: &str,
        dt: &Bound<'_, PyAny>,
        send_addr: usize,
        send_len: usize,
        recv_addr: usize,
        recv_len: usize,
        op: Option<&Bound<'_, PyAny>>,
        root: i64,
        async_op: bool,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Handle>> {
        let (dt, op) = (data_type(py, dt)?, opt_op(py, op)?);
        let send = Self::raw_range(py, send_addr, send_len)?;
        let recv = Self::raw_range(py, recv_addr, recv_len)?;
        let job = self.raw_job(py, kind, dt, send, recv, op, root)?;
        let prep = Prepared {
            job,
            keep: vec![],
            keep_obj: keep,
        };
        self.launch(py, prep, async_op)
    }

    /// Private (torch backend): a collective on CUDA device addresses (as
    /// ``_raw``), enqueued on the CUDA stream ``stream`` (a ``cudaStream_t``
    /// as an integer) of this rank's GPU through braid's device
    /// communicator, created on first use (every rank must get here).
    /// Returns the GPU's ordinal. Not yet run on a GPU.
    #[pyo3(signature = (kind, dt, send_addr, send_len, recv_addr, recv_len, op = None, root = 0, stream = 0, device = 0))]
    #[allow(clippy::too_many_arguments)]
    fn _cuda(
        &self,
        py: Python<'_>,
        kind: &str,
        dt: &Bound<'_, PyAny>,
        send_addr: usize,
        send_len: usize,
        recv_addr: usize,
        recv_len: usize,
        op: Option<&Bound<'_, PyAny>>,
        root: i64,
        stream: usize,
        device: u32,
    ) -> PyResult<u32> {
        self.check_open(py)?;
        let (dt, op) = (data_type(py, dt)?, opt_op(py, op)?);
        let send = Self::raw_range(py, send_addr, send_len)?;
        let recv = Self::raw_range(py, recv_addr, recv_len)?;
        let job = self.raw_job(py, kind, dt, send, recv, op, root)?;
        if self.pending.load(Ordering::Acquire) > 0 {
            self.synchronize(py)?;
        }
        let is_root = u32::try_from(root).is_ok_and(|r| r == self.me());
        let (state, comm) = (&self.cuda, &self.comm);
        // SAFETY: the torch backend passes device addresses of live CUDA
        // tensors it keeps until the stream ran the operation, and the
        // current stream of their device.
        py.detach(|| unsafe { crate::cuda::run(state, comm, &job, stream, device, is_root) })
            .map_err(|e| py_err(py, &e))
    }

    /// Private (torch backend): several raw collectives run one after the
    /// other as one operation; ``calls`` holds tuples ``(kind, dt,
    /// send_addr, send_len, recv_addr, recv_len, op, root)``.
    #[pyo3(signature = (calls, async_op = false, keep = None))]
    fn _raw_seq(
        &self,
        py: Python<'_>,
        calls: &Bound<'_, PyList>,
        async_op: bool,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Handle>> {
        let mut jobs = Vec::with_capacity(calls.len());
        for c in calls.iter() {
            let (kind, dt, sa, sl, ra, rl, op, root): (
                String,
                Bound<'_, PyAny>,
                usize,
                usize,
                usize,
                usize,
                Bound<'_, PyAny>,
                i64,
            ) = c.extract()?;
            let (dt, op) = (data_type(py, &dt)?, red_op(py, &op)?);
            let send = Self::raw_range(py, sa, sl)?;
            let recv = Self::raw_range(py, ra, rl)?;
            jobs.push(self.raw_job(py, &kind, dt, send, recv, op, root)?);
        }
        let prep = Prepared {
            job: Job::Seq(jobs),
            keep: vec![],
            keep_obj: keep,
        };
        self.launch(py, prep, async_op)
    }

    /// Private (torch backend): a collective on blocks of raw host
    /// addresses that live apart (lists of tensors), each ``(addr, len)``:
    /// ``kind`` ``gather`` (one send block; on the root one receive block
    /// per rank, elsewhere none), ``scatter`` (the other way round) or
    /// ``all_to_all_v`` (one block per rank each way, of any length); ``dt``
    /// as for ``_raw``. The blocks' sizes are braid's to check; an output
    /// may overlap no other block, but a rank's own input may be its own
    /// output.
    #[pyo3(signature = (kind, dt, sends, recvs, root = 0, async_op = false, keep = None))]
    #[allow(clippy::too_many_arguments)]
    fn _raw_blocks(
        &self,
        py: Python<'_>,
        kind: &str,
        dt: &Bound<'_, PyAny>,
        sends: Vec<(usize, usize)>,
        recvs: Vec<(usize, usize)>,
        root: i64,
        async_op: bool,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Handle>> {
        let dt = data_type(py, dt)?;
        let ranges = |v: Vec<(usize, usize)>| -> PyResult<Vec<_>> {
            v.into_iter()
                .map(|(a, n)| Self::raw_range(py, a, n))
                .collect()
        };
        let (sends, recvs) = (ranges(sends)?, ranges(recvs)?);
        let me = self.me() as usize;
        let job = match kind {
            "gather" | "scatter" => {
                let gather = kind == "gather";
                let root = check_root(py, kind, root, self.p())?;
                let (mine, blocks) = if gather {
                    (&sends, &recvs)
                } else {
                    (&recvs, &sends)
                };
                let [mine] = mine[..] else {
                    return Err(invalid(
                        py,
                        format!("{kind}: {} blocks for this rank; it takes one", mine.len()),
                    ));
                };
                let own = if gather { (0, me) } else { (me, 0) };
                check_apart(py, kind, &sends, &recvs, Some(own))?;
                rooted_job(gather, dt, mine, blocks.clone(), root)
            }
            "all_to_all_v" => {
                check_apart(py, kind, &sends, &recvs, Some((me, me)))?;
                Job::AllToAllv { dt, sends, recvs }
            }
            _ => {
                return Err(invalid(
                    py,
                    format!("{kind}: unknown collective: one of gather, scatter, all_to_all_v"),
                ))
            }
        };
        let prep = Prepared {
            job,
            keep: vec![],
            keep_obj: keep,
        };
        self.launch(py, prep, async_op)
    }

    /// Private (torch backend): this group's mailbox for tagged
    /// point-to-point messages (``braid::Mailbox``), returned as the
    /// communicator it owns (every rank calls it; a collective). Its
    /// operations run on a worker of their own, apart from the collectives.
    fn _mailbox(&self, py: Python<'_>) -> PyResult<PyComm> {
        self.check_open(py)?;
        let comm = &self.comm;
        let mb = py.detach(|| comm.mailbox()).map_err(|e| py_err(py, &e))?;
        let mut c = PyComm::wrap(mb.communicator().clone());
        c.mailbox = Some(mb);
        Ok(c)
    }

    /// Private (torch backend): tagged sends and receives on raw host
    /// addresses, run together on a ``_mailbox()`` communicator. ``ops``
    /// holds ``(is_send, peer, tag, addr, len)``; a receive's peer of -1
    /// takes a message from any rank. The handle's ``_sources()`` gives
    /// each receive's sender once done.
    #[pyo3(signature = (ops, keep = None))]
    fn _raw_tagged(
        &self,
        py: Python<'_>,
        ops: Vec<(bool, i64, i64, usize, usize)>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Handle> {
        let Some(mb) = self.mailbox.clone() else {
            return Err(invalid(
                py,
                "_raw_tagged needs the communicator _mailbox() returns",
            ));
        };
        let (p, me) = (self.p(), self.me());
        let mut out: Vec<TaggedOp> = Vec::with_capacity(ops.len());
        for (is_send, peer, tag, addr, len) in ops {
            let what = if is_send { "send" } else { "recv" };
            let peer = if !is_send && peer == -1 {
                None
            } else {
                Some(check_peer(py, what, peer, p, me)?)
            };
            let tag = u64::try_from(tag).map_err(|_| {
                invalid(
                    py,
                    format!("{what}: tag {tag} is negative; tags are integers from 0"),
                )
            })?;
            let buf = Self::raw_range(py, addr, len)?;
            // A receive writes its buffer: no other buffer of the batch may
            // share its bytes.
            let clash = out
                .iter()
                .any(|o| (!is_send || !o.send) && o.buf.overlaps(&buf));
            if clash {
                return Err(invalid(
                    py,
                    format!("{what}: this buffer overlaps another buffer of the batch; a receive needs memory of its own"),
                ));
            }
            out.push(TaggedOp {
                send: is_send,
                peer,
                tag,
                buf,
            });
        }
        let sources = Arc::new(Mutex::new(Vec::new()));
        let prep = Prepared {
            job: Job::Tagged {
                mb,
                ops: out,
                sources: sources.clone(),
            },
            keep: vec![],
            keep_obj: keep,
        };
        let h = self
            .launch(py, prep, true)?
            .ok_or_else(|| invalid(py, "_raw_tagged: no handle"))?;
        h.set_sources(sources);
        Ok(h)
    }
}
