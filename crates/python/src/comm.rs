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
//! communicator's worker thread (a `braid::Stream`), and a blocking call
//! issued while asynchronous ones are pending queues behind them, so every
//! rank sees the same order.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use braid::{Collective, Communicator, Config, DataType, RedOp, Stream};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::errors::{invalid, py_err, ErrInfo, Kind};
use crate::uid::{timeout_arg, PyUniqueId};
use crate::views::{dtype_from_code, Raw, View};
use crate::work::{Completion, Handle, Job, P2pOp};

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
    closed: AtomicBool,
    /// The device communicator, once a CUDA tensor came (torch backend).
    cuda: Mutex<Option<crate::cuda::CudaState>>,
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

/// One operation, checked, with the buffers it uses.
pub(crate) struct Prepared {
    job: Job,
    keep: Vec<View>,
    keep_obj: Option<Py<PyAny>>,
}

impl Prepared {
    fn new(job: Job, keep: Vec<View>) -> Prepared {
        Prepared {
            job,
            keep,
            keep_obj: None,
        }
    }
}

fn view(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str, write: bool) -> PyResult<View> {
    View::new(obj, what, write).map_err(|e| e.to_py(py))
}

fn opt_view(
    py: Python<'_>,
    obj: Option<&Bound<'_, PyAny>>,
    what: &str,
    write: bool,
) -> PyResult<Option<View>> {
    match obj {
        Some(o) if !o.is_none() => view(py, o, what, write).map(Some),
        _ => Ok(None),
    }
}

/// The operator: a `braid.Op`, its integer value, or its name.
pub(crate) fn red_op(py: Python<'_>, op: &Bound<'_, PyAny>) -> PyResult<RedOp> {
    if let Ok(code) = op.extract::<i64>() {
        if let Some(o) = u8::try_from(code).ok().and_then(RedOp::from_u8) {
            return Ok(o);
        }
    } else if let Ok(name) = op.extract::<String>() {
        if let Some(o) = RedOp::ALL
            .iter()
            .find(|o| o.name().eq_ignore_ascii_case(name.trim()))
        {
            return Ok(*o);
        }
    }
    Err(invalid(
        py,
        format!(
            "op {} is not a braid operator: use braid.Op.SUM, PROD, MIN, MAX or AVG (or their names)",
            op.repr().map(|r| r.to_string()).unwrap_or_default()
        ),
    ))
}

fn same_dtype(py: Python<'_>, op: &str, s: &View, r: &View) -> PyResult<()> {
    if s.dtype != r.dtype {
        return Err(invalid(
            py,
            format!(
                "{op}: sendbuf holds {} and recvbuf {}; both must hold the same datatype",
                s.dtype, r.dtype
            ),
        ));
    }
    Ok(())
}

fn no_overlap(py: Python<'_>, op: &str, a: &Raw, b: &Raw) -> PyResult<()> {
    if a.overlaps(b) {
        return Err(invalid(
            py,
            format!("{op}: sendbuf and recvbuf overlap; pass separate buffers, or recvbuf=None for the in-place form"),
        ));
    }
    Ok(())
}

fn check_root(py: Python<'_>, op: &str, root: i64, n: u32) -> PyResult<u32> {
    match u32::try_from(root) {
        Ok(r) if r < n => Ok(r),
        _ => Err(invalid(
            py,
            format!("{op}: root {root} is not a rank of this communicator (0..{n})"),
        )),
    }
}

fn check_peer(py: Python<'_>, op: &str, peer: i64, n: u32, me: u32) -> PyResult<u32> {
    match u32::try_from(peer) {
        Ok(p) if p < n && p != me => Ok(p),
        Ok(p) if p == me => Err(invalid(
            py,
            format!("{op}: peer {peer} is this rank; send and receive need another rank"),
        )),
        _ => Err(invalid(
            py,
            format!("{op}: peer {peer} is not a rank of this communicator (0..{n})"),
        )),
    }
}

impl PyComm {
    fn wrap(comm: Communicator) -> PyComm {
        PyComm {
            comm,
            worker: Mutex::new(None),
            pending: Arc::new(AtomicUsize::new(0)),
            closed: AtomicBool::new(false),
            cuda: Mutex::new(None),
        }
    }

    fn p(&self) -> u32 {
        self.comm.nranks()
    }

    fn me(&self) -> u32 {
        self.comm.rank()
    }

    fn check_open(&self, py: Python<'_>) -> PyResult<()> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(ErrInfo::new(
                Kind::Unusable,
                "this communicator was closed; create a new one",
            )
            .to_py(py));
        }
        Ok(())
    }

    /// Run `prep` now (blocking) or queue it (asynchronous).
    fn launch(&self, py: Python<'_>, prep: Prepared, async_op: bool) -> PyResult<Option<Handle>> {
        self.check_open(py)?;
        if !async_op && self.pending.load(Ordering::Acquire) == 0 {
            let comm = &self.comm;
            let job = &prep.job;
            let r = py.detach(|| job.run(comm).map_err(|e| ErrInfo::from_braid(&e)));
            drop(prep);
            return r.map(|_| None).map_err(|e| e.to_py(py));
        }
        let done = Arc::new(Completion::default());
        let Prepared {
            job,
            keep,
            keep_obj,
        } = prep;
        self.submit(py, job, done.clone())?;
        let h = Handle::new(done, keep, keep_obj);
        if async_op {
            Ok(Some(h))
        } else {
            h.wait_inner(py, None)?;
            Ok(None)
        }
    }

    fn submit(&self, py: Python<'_>, job: Job, done: Arc<Completion>) -> PyResult<()> {
        let mut w = self
            .worker
            .lock()
            .map_err(|_| ErrInfo::new(Kind::Unusable, "the worker lock is poisoned").to_py(py))?;
        if w.is_none() {
            *w = Some(Stream::new(&self.comm).map_err(|e| py_err(py, &e))?);
        }
        let pending = self.pending.clone();
        pending.fetch_add(1, Ordering::AcqRel);
        if let Some(stream) = w.as_ref() {
            // The handle returned by the stream is not needed: the outcome
            // lands in `done`.
            let _ = stream.submit(move |c| {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.run(c)));
                pending.fetch_sub(1, Ordering::AcqRel);
                done.complete(match r {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(ErrInfo::from_braid(&e)),
                    Err(_) => Err(ErrInfo::new(
                        Kind::Unusable,
                        "braid panicked while running the operation (a bug: please report it)",
                    )),
                });
                Ok(())
            });
        }
        Ok(())
    }

    // ---- builders: checks and jobs -------------------------------------

    fn prep_all_reduce(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        op: RedOp,
    ) -> PyResult<Prepared> {
        let r = opt_view(py, recv, "recvbuf", true)?;
        let s = view(py, send, "sendbuf", r.is_none())?;
        let coll = Collective::AllReduce {
            count: s.count(),
            op,
        };
        Ok(match r {
            None => Prepared::new(
                Job::InPlace {
                    coll,
                    dt: s.dtype,
                    buf: s.raw,
                },
                vec![s],
            ),
            Some(r) => {
                same_dtype(py, "all_reduce", &s, &r)?;
                if r.count() != s.count() {
                    return Err(invalid(
                        py,
                        format!(
                        "all_reduce: sendbuf holds {} elements and recvbuf {}; they must be equal",
                        s.count(),
                        r.count()
                    ),
                    ));
                }
                self.pair(py, "all_reduce", coll, s, r)?
            }
        })
    }

    /// An out-of-place job, or the in-place one when both are the same
    /// memory.
    fn pair(
        &self,
        py: Python<'_>,
        op: &str,
        coll: Collective,
        s: View,
        r: View,
    ) -> PyResult<Prepared> {
        let dt = s.dtype;
        if s.raw == r.raw && s.raw.len > 0 {
            return Ok(Prepared::new(
                Job::InPlace {
                    coll,
                    dt,
                    buf: r.raw,
                },
                vec![s, r],
            ));
        }
        no_overlap(py, op, &s.raw, &r.raw)?;
        Ok(Prepared::new(
            Job::Coll {
                coll,
                dt,
                send: s.raw,
                recv: r.raw,
            },
            vec![s, r],
        ))
    }

    fn blocks(&self, py: Python<'_>, op: &str, what: &str, n: usize) -> PyResult<usize> {
        let p = self.p() as usize;
        if !n.is_multiple_of(p) {
            return Err(invalid(
                py,
                format!("{op}: {what} holds {n} elements, which do not split into {p} equal blocks (one per rank)"),
            ));
        }
        Ok(n / p)
    }

    fn prep_reduce_scatter(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        op: RedOp,
    ) -> PyResult<Prepared> {
        let r = opt_view(py, recv, "recvbuf", true)?;
        let s = view(py, send, "sendbuf", r.is_none())?;
        match r {
            None => {
                let recv_count = self.blocks(py, "reduce_scatter", "the buffer", s.count())?;
                Ok(Prepared::new(
                    Job::InPlace {
                        coll: Collective::ReduceScatter { recv_count, op },
                        dt: s.dtype,
                        buf: s.raw,
                    },
                    vec![s],
                ))
            }
            Some(r) => {
                same_dtype(py, "reduce_scatter", &s, &r)?;
                let p = self.p() as usize;
                if s.count() != r.count() * p {
                    return Err(invalid(py, format!(
                        "reduce_scatter: recvbuf holds {} elements, so sendbuf must hold {} ({} ranks x {}), not {}",
                        r.count(),
                        r.count() * p,
                        p,
                        r.count(),
                        s.count()
                    )));
                }
                let coll = Collective::ReduceScatter {
                    recv_count: r.count(),
                    op,
                };
                no_overlap(py, "reduce_scatter", &s.raw, &r.raw)?;
                self.pair(py, "reduce_scatter", coll, s, r)
            }
        }
    }

    fn prep_all_gather(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Prepared> {
        let r = opt_view(py, recv, "recvbuf", true)?;
        let s = view(py, send, "sendbuf", r.is_none())?;
        match r {
            None => {
                let send_count = self.blocks(py, "all_gather", "the buffer", s.count())?;
                Ok(Prepared::new(
                    Job::InPlace {
                        coll: Collective::AllGather { send_count },
                        dt: s.dtype,
                        buf: s.raw,
                    },
                    vec![s],
                ))
            }
            Some(r) => {
                same_dtype(py, "all_gather", &s, &r)?;
                let p = self.p() as usize;
                if r.count() != s.count() * p {
                    return Err(invalid(py, format!(
                        "all_gather: sendbuf holds {} elements, so recvbuf must hold {} ({} ranks x {}), not {}",
                        s.count(),
                        s.count() * p,
                        p,
                        s.count(),
                        r.count()
                    )));
                }
                let coll = Collective::AllGather {
                    send_count: s.count(),
                };
                no_overlap(py, "all_gather", &s.raw, &r.raw)?;
                self.pair(py, "all_gather", coll, s, r)
            }
        }
    }

    fn prep_broadcast(
        &self,
        py: Python<'_>,
        send: Option<&Bound<'_, PyAny>>,
        recv: Option<&Bound<'_, PyAny>>,
        root: i64,
    ) -> PyResult<Prepared> {
        let root = check_root(py, "broadcast", root, self.p())?;
        let is_root = root == self.me();
        let r = opt_view(py, recv, "recvbuf", true)?;
        let s = if r.is_none() || is_root {
            opt_view(py, send, "sendbuf", r.is_none())?
        } else {
            None
        };
        match (s, r) {
            (None, None) => Err(invalid(
                py,
                "broadcast: pass the buffer (in place) or a recvbuf",
            )),
            (Some(s), None) => Ok(Prepared::new(
                Job::InPlace {
                    coll: Collective::Broadcast {
                        count: s.count(),
                        root,
                    },
                    dt: s.dtype,
                    buf: s.raw,
                },
                vec![s],
            )),
            (None, Some(r)) if is_root => {
                let _ = r;
                Err(invalid(
                    py,
                    "broadcast: the root must pass the data to send (sendbuf)",
                ))
            }
            (None, Some(r)) => {
                // A non-root's send buffer is not used.
                let coll = Collective::Broadcast {
                    count: r.count(),
                    root,
                };
                Ok(Prepared::new(
                    Job::Coll {
                        coll,
                        dt: r.dtype,
                        send: Raw { addr: 0, len: 0 },
                        recv: r.raw,
                    },
                    vec![r],
                ))
            }
            (Some(s), Some(r)) => {
                same_dtype(py, "broadcast", &s, &r)?;
                if s.count() != r.count() {
                    return Err(invalid(
                        py,
                        format!(
                            "broadcast: sendbuf holds {} elements and recvbuf {}; they must be equal",
                            s.count(),
                            r.count()
                        ),
                    ));
                }
                let coll = Collective::Broadcast {
                    count: r.count(),
                    root,
                };
                self.pair(py, "broadcast", coll, s, r)
            }
        }
    }

    fn prep_reduce(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        op: RedOp,
        root: i64,
    ) -> PyResult<Prepared> {
        let root = check_root(py, "reduce", root, self.p())?;
        let is_root = root == self.me();
        let r = opt_view(py, recv, "recvbuf", true)?;
        let s = view(py, send, "sendbuf", r.is_none())?;
        let coll = Collective::Reduce {
            count: s.count(),
            op,
            root,
        };
        match r {
            None => Ok(Prepared::new(
                Job::InPlace {
                    coll,
                    dt: s.dtype,
                    buf: s.raw,
                },
                vec![s],
            )),
            Some(r) => {
                same_dtype(py, "reduce", &s, &r)?;
                if is_root && r.count() != s.count() {
                    return Err(invalid(
                        py,
                        format!(
                            "reduce: sendbuf holds {} elements and the root's recvbuf {}; they must be equal",
                            s.count(),
                            r.count()
                        ),
                    ));
                }
                if !is_root {
                    // Not used off the root.
                    no_overlap(py, "reduce", &s.raw, &r.raw)?;
                    let dt = s.dtype;
                    return Ok(Prepared::new(
                        Job::Coll {
                            coll,
                            dt,
                            send: s.raw,
                            recv: Raw { addr: 0, len: 0 },
                        },
                        vec![s, r],
                    ));
                }
                self.pair(py, "reduce", coll, s, r)
            }
        }
    }

    fn prep_all_to_all(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Prepared> {
        let r = opt_view(py, recv, "recvbuf", true)?;
        let s = view(py, send, "sendbuf", r.is_none())?;
        let count = self.blocks(py, "all_to_all", "sendbuf", s.count())?;
        let coll = Collective::AllToAll { count };
        match r {
            None => Ok(Prepared::new(
                Job::AllToAllInPlace {
                    coll,
                    dt: s.dtype,
                    buf: s.raw,
                },
                vec![s],
            )),
            Some(r) => {
                same_dtype(py, "all_to_all", &s, &r)?;
                if r.count() != s.count() {
                    return Err(invalid(
                        py,
                        format!(
                            "all_to_all: sendbuf holds {} elements and recvbuf {}; they must be equal",
                            s.count(),
                            r.count()
                        ),
                    ));
                }
                if s.raw == r.raw {
                    let dt = s.dtype;
                    let buf = s.raw;
                    return Ok(Prepared::new(
                        Job::AllToAllInPlace { coll, dt, buf },
                        vec![s, r],
                    ));
                }
                no_overlap(py, "all_to_all", &s.raw, &r.raw)?;
                self.pair(py, "all_to_all", coll, s, r)
            }
        }
    }

    /// Counts and displacements (elements) as byte ranges of `buf`.
    fn ranges(
        &self,
        py: Python<'_>,
        what: &str,
        buf: &View,
        counts: &[i64],
        displs: Option<&[i64]>,
    ) -> PyResult<Vec<Raw>> {
        let p = self.p() as usize;
        if counts.len() != p {
            return Err(invalid(
                py,
                format!(
                    "all_to_allv: {what}counts has {} entries; it needs one per rank ({p})",
                    counts.len()
                ),
            ));
        }
        if let Some(d) = displs {
            if d.len() != p {
                return Err(invalid(
                    py,
                    format!(
                        "all_to_allv: {what}displs has {} entries; it needs one per rank ({p})",
                        d.len()
                    ),
                ));
            }
        }
        let es = buf.dtype.size();
        let mut out = Vec::with_capacity(p);
        let mut next: usize = 0;
        for q in 0..p {
            let c = usize::try_from(counts[q]).map_err(|_| {
                invalid(
                    py,
                    format!("all_to_allv: {what}counts[{q}] = {} is negative", counts[q]),
                )
            })?;
            let d = match displs {
                Some(d) => usize::try_from(d[q]).map_err(|_| {
                    invalid(
                        py,
                        format!("all_to_allv: {what}displs[{q}] = {} is negative", d[q]),
                    )
                })?,
                None => next,
            };
            next = d.saturating_add(c);
            if next > buf.count() {
                return Err(invalid(
                    py,
                    format!(
                        "all_to_allv: block {q} of {what}buf (elements {d}..{next}) lies past its end ({} elements)",
                        buf.count()
                    ),
                ));
            }
            out.push(Raw {
                addr: buf.raw.addr + d * es,
                len: c * es,
            });
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn prep_all_to_allv(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        sendcounts: Vec<i64>,
        recv: &Bound<'_, PyAny>,
        recvcounts: Vec<i64>,
        sdispls: Option<Vec<i64>>,
        rdispls: Option<Vec<i64>>,
    ) -> PyResult<Prepared> {
        let s = view(py, send, "sendbuf", false)?;
        let r = view(py, recv, "recvbuf", true)?;
        same_dtype(py, "all_to_allv", &s, &r)?;
        no_overlap(py, "all_to_allv", &s.raw, &r.raw)?;
        let sr = self.ranges(py, "send", &s, &sendcounts, sdispls.as_deref())?;
        let rr = self.ranges(py, "recv", &r, &recvcounts, rdispls.as_deref())?;
        let mut sorted: Vec<Raw> = rr.iter().copied().filter(|x| x.len > 0).collect();
        sorted.sort_by_key(|x| x.addr);
        if sorted.windows(2).any(|w| w[0].overlaps(&w[1])) {
            return Err(invalid(
                py,
                "all_to_allv: the blocks of recvbuf overlap; give each rank its own block",
            ));
        }
        let me = self.me() as usize;
        if sr[me].len != rr[me].len {
            return Err(invalid(
                py,
                format!(
                    "all_to_allv: this rank sends itself {} elements (sendcounts[{me}]) but expects {} (recvcounts[{me}])",
                    sendcounts[me], recvcounts[me]
                ),
            ));
        }
        let mut ops = Vec::new();
        for q in 0..self.p() as usize {
            if q == me {
                continue;
            }
            ops.push(P2pOp {
                send: true,
                peer: q as u32,
                buf: sr[q],
            });
            ops.push(P2pOp {
                send: false,
                peer: q as u32,
                buf: rr[q],
            });
        }
        let copies = if sr[me].len > 0 {
            vec![(sr[me], rr[me])]
        } else {
            vec![]
        };
        Ok(Prepared::new(Job::Group { ops, copies }, vec![s, r]))
    }

    fn prep_gather(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        root: i64,
    ) -> PyResult<Prepared> {
        let root = check_root(py, "gather", root, self.p())?;
        let s = view(py, send, "sendbuf", false)?;
        if root != self.me() {
            let ops = vec![P2pOp {
                send: true,
                peer: root,
                buf: s.raw,
            }];
            return Ok(Prepared::new(
                Job::Group {
                    ops,
                    copies: vec![],
                },
                vec![s],
            ));
        }
        let Some(r) = opt_view(py, recv, "recvbuf", true)? else {
            return Err(invalid(py, "gather: the root must pass a recvbuf"));
        };
        same_dtype(py, "gather", &s, &r)?;
        let p = self.p() as usize;
        if r.count() != s.count() * p {
            return Err(invalid(
                py,
                format!(
                    "gather: sendbuf holds {} elements, so the root's recvbuf must hold {} ({p} ranks x {}), not {}",
                    s.count(),
                    s.count() * p,
                    s.count(),
                    r.count()
                ),
            ));
        }
        no_overlap(py, "gather", &s.raw, &r.raw)?;
        let block = |q: usize| Raw {
            addr: r.raw.addr + q * s.raw.len,
            len: s.raw.len,
        };
        let ops = (0..p)
            .filter(|&q| q != root as usize)
            .map(|q| P2pOp {
                send: false,
                peer: q as u32,
                buf: block(q),
            })
            .collect();
        let copies = vec![(s.raw, block(root as usize))];
        Ok(Prepared::new(Job::Group { ops, copies }, vec![s, r]))
    }

    fn prep_scatter(
        &self,
        py: Python<'_>,
        send: Option<&Bound<'_, PyAny>>,
        recv: &Bound<'_, PyAny>,
        root: i64,
    ) -> PyResult<Prepared> {
        let root = check_root(py, "scatter", root, self.p())?;
        let r = view(py, recv, "recvbuf", true)?;
        if root != self.me() {
            let ops = vec![P2pOp {
                send: false,
                peer: root,
                buf: r.raw,
            }];
            return Ok(Prepared::new(
                Job::Group {
                    ops,
                    copies: vec![],
                },
                vec![r],
            ));
        }
        let Some(s) = opt_view(py, send, "sendbuf", false)? else {
            return Err(invalid(py, "scatter: the root must pass a sendbuf"));
        };
        same_dtype(py, "scatter", &s, &r)?;
        let p = self.p() as usize;
        if s.count() != r.count() * p {
            return Err(invalid(
                py,
                format!(
                    "scatter: recvbuf holds {} elements, so the root's sendbuf must hold {} ({p} ranks x {}), not {}",
                    r.count(),
                    r.count() * p,
                    r.count(),
                    s.count()
                ),
            ));
        }
        no_overlap(py, "scatter", &s.raw, &r.raw)?;
        let block = |q: usize| Raw {
            addr: s.raw.addr + q * r.raw.len,
            len: r.raw.len,
        };
        let ops = (0..p)
            .filter(|&q| q != root as usize)
            .map(|q| P2pOp {
                send: true,
                peer: q as u32,
                buf: block(q),
            })
            .collect();
        let copies = vec![(block(root as usize), r.raw)];
        Ok(Prepared::new(Job::Group { ops, copies }, vec![s, r]))
    }

    /// A raw byte range from the torch backend.
    fn raw_range(py: Python<'_>, addr: usize, len: usize) -> PyResult<Raw> {
        if len > 0 && addr == 0 {
            return Err(invalid(py, "a null buffer with a non-zero length"));
        }
        if addr.checked_add(len).is_none() {
            return Err(invalid(py, "a buffer that wraps around the address space"));
        }
        Ok(Raw { addr, len })
    }

    /// The job of one raw collective (see `_raw`).
    #[allow(clippy::too_many_arguments)]
    fn raw_job(
        &self,
        py: Python<'_>,
        kind: &str,
        dt: DataType,
        send: Raw,
        recv: Raw,
        op: RedOp,
        root: i64,
    ) -> PyResult<Job> {
        let es = dt.size();
        let p = self.p() as usize;
        let me = self.me() as usize;
        let bad = |m: String| invalid(py, format!("{kind}: {m}"));
        if !send.len.is_multiple_of(es) || !recv.len.is_multiple_of(es) {
            return Err(bad(format!(
                "buffer lengths must be multiples of {es} bytes"
            )));
        }
        let (sn, rn) = (send.len / es, recv.len / es);
        let in_place_or = |coll: Collective, in_place: bool| -> PyResult<Job> {
            if in_place {
                Ok(Job::InPlace {
                    coll,
                    dt,
                    buf: recv,
                })
            } else if send.overlaps(&recv) {
                Err(bad("send and receive buffers overlap".into()))
            } else {
                Ok(Job::Coll {
                    coll,
                    dt,
                    send,
                    recv,
                })
            }
        };
        match kind {
            "all_reduce" => {
                if sn != rn {
                    return Err(bad(format!("{sn} elements in, {rn} out")));
                }
                in_place_or(Collective::AllReduce { count: sn, op }, send == recv)
            }
            "broadcast" => {
                let root = check_root(py, kind, root, self.p())?;
                if root as usize == me && sn != rn {
                    return Err(bad(format!("{sn} elements in, {rn} out")));
                }
                in_place_or(
                    Collective::Broadcast { count: rn, root },
                    send == recv || root as usize != me,
                )
            }
            "reduce" => {
                let root = check_root(py, kind, root, self.p())?;
                if sn != rn {
                    return Err(bad(format!("{sn} elements in, {rn} out")));
                }
                in_place_or(Collective::Reduce { count: sn, op, root }, send == recv)
            }
            "all_gather" => {
                if rn != sn * p {
                    return Err(bad(format!("{sn} elements in, so {} out, not {rn}", sn * p)));
                }
                let own = Raw {
                    addr: recv.addr + me * send.len,
                    len: send.len,
                };
                let coll = Collective::AllGather { send_count: sn };
                if send == own && sn > 0 {
                    return Ok(Job::InPlace { coll, dt, buf: recv });
                }
                in_place_or(coll, false)
            }
            "reduce_scatter" => {
                if sn != rn * p {
                    return Err(bad(format!("{rn} elements out, so {} in, not {sn}", rn * p)));
                }
                let own = Raw {
                    addr: send.addr + me * recv.len,
                    len: recv.len,
                };
                let coll = Collective::ReduceScatter { recv_count: rn, op };
                if recv == own && rn > 0 {
                    return Ok(Job::InPlace { coll, dt, buf: send });
                }
                in_place_or(coll, false)
            }
            "all_to_all" => {
                if sn != rn || !sn.is_multiple_of(p) {
                    return Err(bad(format!(
                        "{sn} elements in and {rn} out: both must be equal and split into {p} blocks"
                    )));
                }
                let coll = Collective::AllToAll { count: sn / p };
                if send == recv {
                    return Ok(Job::AllToAllInPlace { coll, dt, buf: recv });
                }
                in_place_or(coll, false)
            }
            _ => Err(bad(
                "unknown collective: one of all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all".into(),
            )),
        }
    }
}

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
        let op = match op {
            Some(o) => red_op(py, o)?,
            None => RedOp::Sum,
        };
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
        let op = match op {
            Some(o) => red_op(py, o)?,
            None => RedOp::Sum,
        };
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
        let op = match op {
            Some(o) => red_op(py, o)?,
            None => RedOp::Sum,
        };
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
        let peer = check_peer(py, "send", peer, self.p(), self.me())?;
        let v = view(py, buf, "buf", false)?;
        let ops = vec![P2pOp {
            send: true,
            peer,
            buf: v.raw,
        }];
        let prep = Prepared::new(
            Job::Group {
                ops,
                copies: vec![],
            },
            vec![v],
        );
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
        let peer = check_peer(py, "recv", peer, self.p(), self.me())?;
        let v = view(py, buf, "buf", true)?;
        let ops = vec![P2pOp {
            send: false,
            peer,
            buf: v.raw,
        }];
        let prep = Prepared::new(
            Job::Group {
                ops,
                copies: vec![],
            },
            vec![v],
        );
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
        let h = stream.submit(|_| Ok(()));
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
    /// all_to_all; ``dt`` a code from ``datatypes()``; in place when the
    /// ranges are the same (or this rank's block of the other).
    #[pyo3(signature = (kind, dt, send_addr, send_len, recv_addr, recv_len, op = 0, root = 0, async_op = false, keep = None))]
    #[allow(clippy::too_many_arguments)]
    fn _raw(
        &self,
        py: Python<'_>,
        kind: &str,
        dt: u8,
        send_addr: usize,
        send_len: usize,
        recv_addr: usize,
        recv_len: usize,
        op: u8,
        root: i64,
        async_op: bool,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Handle>> {
        let dt = dtype_from_code(dt)
            .ok_or_else(|| invalid(py, format!("datatype code {dt} is not a braid datatype")))?;
        let op = RedOp::from_u8(op)
            .ok_or_else(|| invalid(py, format!("operator code {op} is not a braid operator")))?;
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
    #[pyo3(signature = (kind, dt, send_addr, send_len, recv_addr, recv_len, op = 0, root = 0, stream = 0, device = 0))]
    #[allow(clippy::too_many_arguments)]
    fn _cuda(
        &self,
        py: Python<'_>,
        kind: &str,
        dt: u8,
        send_addr: usize,
        send_len: usize,
        recv_addr: usize,
        recv_len: usize,
        op: u8,
        root: i64,
        stream: usize,
        device: u32,
    ) -> PyResult<u32> {
        self.check_open(py)?;
        let dt = dtype_from_code(dt)
            .ok_or_else(|| invalid(py, format!("datatype code {dt} is not a braid datatype")))?;
        let op = RedOp::from_u8(op)
            .ok_or_else(|| invalid(py, format!("operator code {op} is not a braid operator")))?;
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
                u8,
                usize,
                usize,
                usize,
                usize,
                u8,
                i64,
            ) = c.extract()?;
            let dt = dtype_from_code(dt).ok_or_else(|| {
                invalid(py, format!("datatype code {dt} is not a braid datatype"))
            })?;
            let op = RedOp::from_u8(op).ok_or_else(|| {
                invalid(py, format!("operator code {op} is not a braid operator"))
            })?;
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

    /// Private (torch backend): point-to-point operations on raw host
    /// addresses issued together, after local copies. ``ops`` holds
    /// ``(is_send, peer, addr, len)``, ``copies`` ``(src, dst, len)``.
    #[pyo3(signature = (ops, copies, async_op = false, keep = None))]
    fn _raw_group(
        &self,
        py: Python<'_>,
        ops: Vec<(bool, i64, usize, usize)>,
        copies: Vec<(usize, usize, usize)>,
        async_op: bool,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Option<Handle>> {
        let (p, me) = (self.p(), self.me());
        let mut out = Vec::with_capacity(ops.len());
        for (is_send, peer, addr, len) in ops {
            let what = if is_send { "send" } else { "recv" };
            out.push(P2pOp {
                send: is_send,
                peer: check_peer(py, what, peer, p, me)?,
                buf: Self::raw_range(py, addr, len)?,
            });
        }
        let mut cps = Vec::with_capacity(copies.len());
        for (src, dst, len) in copies {
            let (s, d) = (
                Self::raw_range(py, src, len)?,
                Self::raw_range(py, dst, len)?,
            );
            if s.overlaps(&d) && s != d {
                return Err(invalid(py, "a local copy between overlapping ranges"));
            }
            if s != d {
                cps.push((s, d));
            }
        }
        let prep = Prepared {
            job: Job::Group {
                ops: out,
                copies: cps,
            },
            keep: vec![],
            keep_obj: keep,
        };
        self.launch(py, prep, async_op)
    }
}

/// Point-to-point operations of one group (``Communicator.group()``): add
/// them with ``send``/``recv``; they run together when the ``with`` block
/// ends (or on ``run()``).
#[pyclass(module = "braid._braid", name = "Group")]
pub(crate) struct PyGroup {
    comm: Py<PyComm>,
    ops: Vec<P2pOp>,
    keep: Vec<View>,
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
        let prep = Prepared::new(
            Job::Group {
                ops,
                copies: vec![],
            },
            keep,
        );
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
