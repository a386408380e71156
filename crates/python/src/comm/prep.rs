//! Checking a call's arguments and building its [`Job`]: every buffer
//! exported and checked (contiguous, writable where braid writes, one
//! datatype, lengths that fit the collective) before anything is sent; and
//! launching the job on the calling thread or the worker.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use braid::{Collective, Communicator, DataType, RedOp, Stream};
use pyo3::prelude::*;

use crate::errors::{invalid, py_err, ErrInfo, Kind};
use crate::views::{Raw, View};
use crate::work::{Completion, Exec, Handle, Job, P2pOp, Queued};

use super::PyComm;

/// One operation, checked, with the buffers it uses.
pub(crate) struct Prepared {
    pub(super) job: Job,
    pub(super) keep: Vec<View>,
    pub(super) keep_obj: Option<Py<PyAny>>,
}

impl Prepared {
    pub(super) fn new(job: Job, keep: Vec<View>) -> Prepared {
        Prepared {
            job,
            keep,
            keep_obj: None,
        }
    }

    /// `coll` in place on `v`.
    pub(super) fn in_place(coll: Collective, v: View) -> Prepared {
        let (dt, buf) = (v.dtype, v.raw);
        Prepared::new(Job::InPlace { coll, dt, buf }, vec![v])
    }
}

pub(super) fn view(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    what: &str,
    write: bool,
) -> PyResult<View> {
    View::new(obj, what, write).map_err(|e| e.to_py(py))
}

pub(super) fn opt_view(
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

pub(super) fn same_dtype(py: Python<'_>, op: &str, s: &View, r: &View) -> PyResult<()> {
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

pub(super) fn no_overlap(py: Python<'_>, op: &str, a: &Raw, b: &Raw) -> PyResult<()> {
    if a.overlaps(b) {
        return Err(invalid(
            py,
            format!("{op}: sendbuf and recvbuf overlap; pass separate buffers, or recvbuf=None for the in-place form"),
        ));
    }
    Ok(())
}

pub(super) fn check_root(py: Python<'_>, op: &str, root: i64, n: u32) -> PyResult<u32> {
    match u32::try_from(root) {
        Ok(r) if r < n => Ok(r),
        _ => Err(invalid(
            py,
            format!("{op}: root {root} is not a rank of this communicator (0..{n})"),
        )),
    }
}

pub(super) fn check_peer(py: Python<'_>, op: &str, peer: i64, n: u32, me: u32) -> PyResult<u32> {
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
    pub(super) fn wrap(comm: Communicator) -> PyComm {
        PyComm {
            comm,
            worker: Mutex::new(None),
            pending: Arc::new(AtomicUsize::new(0)),
            exec: Arc::new(Exec::default()),
            closed: AtomicBool::new(false),
            cuda: Mutex::new(None),
            mailbox: None,
        }
    }

    pub(super) fn p(&self) -> u32 {
        self.comm.nranks()
    }

    pub(super) fn me(&self) -> u32 {
        self.comm.rank()
    }

    pub(super) fn check_open(&self, py: Python<'_>) -> PyResult<()> {
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
    pub(super) fn launch(
        &self,
        py: Python<'_>,
        prep: Prepared,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
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
        let q = self.submit(py, job, done.clone())?;
        let h = Handle::new(done, keep, keep_obj, Some(q));
        if async_op {
            Ok(Some(h))
        } else {
            h.wait_inner(py, None)?;
            Ok(None)
        }
    }

    /// Queue `job` on the worker (started on first use); its outcome lands
    /// in `done`.
    pub(super) fn submit(
        &self,
        py: Python<'_>,
        job: Job,
        done: Arc<Completion>,
    ) -> PyResult<Arc<Queued>> {
        let mut w = self
            .worker
            .lock()
            .map_err(|_| ErrInfo::new(Kind::Unusable, "the worker lock is poisoned").to_py(py))?;
        if w.is_none() {
            *w = Some(Stream::new(&self.comm).map_err(|e| py_err(py, &e))?);
        }
        let q = Arc::new(Queued::new(
            job,
            self.comm.clone(),
            done,
            self.pending.clone(),
            self.exec.clone(),
        ));
        if let Some(stream) = w.as_ref() {
            // The handle returned by the stream is not needed: the outcome
            // lands in `done`.
            let on_worker = q.clone();
            let _ = stream.submit(move |_| {
                on_worker.run_on_worker();
                Ok(())
            });
        }
        Ok(q)
    }

    // ---- builders: checks and jobs -------------------------------------

    pub(super) fn prep_all_reduce(
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
            None => Prepared::in_place(coll, s),
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
    pub(super) fn pair(
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

    pub(super) fn blocks(&self, py: Python<'_>, op: &str, what: &str, n: usize) -> PyResult<usize> {
        let p = self.p() as usize;
        if !n.is_multiple_of(p) {
            return Err(invalid(
                py,
                format!("{op}: {what} holds {n} elements, which do not split into {p} equal blocks (one per rank)"),
            ));
        }
        Ok(n / p)
    }

    /// `whole` must hold one block of `block`'s size per rank (the
    /// AllGather's recvbuf, the ReduceScatter's sendbuf); each is (its
    /// name, its view).
    pub(super) fn block_per_rank(
        &self,
        py: Python<'_>,
        op: &str,
        (bname, block): (&str, &View),
        (wname, whole): (&str, &View),
    ) -> PyResult<()> {
        let p = self.p() as usize;
        let (b, w) = (block.count(), whole.count());
        if w != b * p {
            return Err(invalid(
                py,
                format!(
                    "{op}: {bname} holds {b} elements, so {wname} must hold {} ({p} ranks x {b}), not {w}",
                    b * p
                ),
            ));
        }
        Ok(())
    }

    /// A send of `buf` to `peer` (`send`), or a receive into it, alone.
    pub(super) fn prep_p2p(
        &self,
        py: Python<'_>,
        send: bool,
        buf: &Bound<'_, PyAny>,
        peer: i64,
    ) -> PyResult<Prepared> {
        let op = if send { "send" } else { "recv" };
        let peer = check_peer(py, op, peer, self.p(), self.me())?;
        let v = view(py, buf, "buf", !send)?;
        let ops = vec![P2pOp {
            send,
            peer,
            buf: v.raw,
        }];
        Ok(Prepared::new(Job::Group(ops), vec![v]))
    }

    pub(super) fn prep_reduce_scatter(
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
                Ok(Prepared::in_place(
                    Collective::ReduceScatter { recv_count, op },
                    s,
                ))
            }
            Some(r) => {
                same_dtype(py, "reduce_scatter", &s, &r)?;
                self.block_per_rank(py, "reduce_scatter", ("recvbuf", &r), ("sendbuf", &s))?;
                let coll = Collective::ReduceScatter {
                    recv_count: r.count(),
                    op,
                };
                no_overlap(py, "reduce_scatter", &s.raw, &r.raw)?;
                self.pair(py, "reduce_scatter", coll, s, r)
            }
        }
    }

    pub(super) fn prep_all_gather(
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
                Ok(Prepared::in_place(Collective::AllGather { send_count }, s))
            }
            Some(r) => {
                same_dtype(py, "all_gather", &s, &r)?;
                self.block_per_rank(py, "all_gather", ("sendbuf", &s), ("recvbuf", &r))?;
                let coll = Collective::AllGather {
                    send_count: s.count(),
                };
                no_overlap(py, "all_gather", &s.raw, &r.raw)?;
                self.pair(py, "all_gather", coll, s, r)
            }
        }
    }

    pub(super) fn prep_broadcast(
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
            (Some(s), None) => Ok(Prepared::in_place(
                Collective::Broadcast {
                    count: s.count(),
                    root,
                },
                s,
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

    pub(super) fn prep_reduce(
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
            None => Ok(Prepared::in_place(coll, s)),
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

    pub(super) fn prep_all_to_all(
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
            None => Ok(Prepared::in_place(coll, s)),
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
                self.pair(py, "all_to_all", coll, s, r)
            }
        }
    }

    /// Counts and displacements (elements) as byte ranges of `buf`.
    pub(super) fn ranges(
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
    pub(super) fn prep_all_to_allv(
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
        let job = Job::AllToAllv {
            dt: s.dtype,
            sends: sr,
            recvs: rr,
        };
        Ok(Prepared::new(job, vec![s, r]))
    }

    pub(super) fn prep_gather(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        root: i64,
    ) -> PyResult<Prepared> {
        let root = check_root(py, "gather", root, self.p())?;
        let s = view(py, send, "sendbuf", false)?;
        self.rooted_blocks(py, Rooted::Gather, root, s, || {
            opt_view(py, recv, "recvbuf", true)
        })
    }

    pub(super) fn prep_scatter(
        &self,
        py: Python<'_>,
        send: Option<&Bound<'_, PyAny>>,
        recv: &Bound<'_, PyAny>,
        root: i64,
    ) -> PyResult<Prepared> {
        let root = check_root(py, "scatter", root, self.p())?;
        let r = view(py, recv, "recvbuf", true)?;
        self.rooted_blocks(py, Rooted::Scatter, root, r, || {
            opt_view(py, send, "sendbuf", false)
        })
    }

    /// Gather and Scatter: `mine` is every rank's block (Gather's sendbuf,
    /// Scatter's recvbuf); the root also passes `whole` (one block per
    /// rank).
    fn rooted_blocks(
        &self,
        py: Python<'_>,
        kind: Rooted,
        root: u32,
        mine: View,
        whole: impl FnOnce() -> PyResult<Option<View>>,
    ) -> PyResult<Prepared> {
        let (op, gather) = match kind {
            Rooted::Gather => ("gather", true),
            Rooted::Scatter => ("scatter", false),
        };
        let (mine_name, whole_name) = if gather {
            ("sendbuf", "recvbuf")
        } else {
            ("recvbuf", "sendbuf")
        };
        let dt = mine.dtype;
        if root != self.me() {
            let job = rooted_job(gather, dt, mine.raw, vec![], root);
            return Ok(Prepared::new(job, vec![mine]));
        }
        let Some(w) = whole()? else {
            return Err(invalid(
                py,
                format!("{op}: the root must pass a {whole_name}"),
            ));
        };
        if gather {
            same_dtype(py, op, &mine, &w)?;
        } else {
            same_dtype(py, op, &w, &mine)?;
        }
        let p = self.p() as usize;
        if w.count() != mine.count() * p {
            return Err(invalid(
                py,
                format!(
                    "{op}: {mine_name} holds {} elements, so the root's {whole_name} must hold {} ({p} ranks x {}), not {}",
                    mine.count(),
                    mine.count() * p,
                    mine.count(),
                    w.count()
                ),
            ));
        }
        no_overlap(py, op, &mine.raw, &w.raw)?;
        let job = rooted_job(gather, dt, mine.raw, split(w.raw, mine.raw.len, p), root);
        let keep = if gather { vec![mine, w] } else { vec![w, mine] };
        Ok(Prepared::new(job, keep))
    }

    /// A raw byte range from the torch backend.
    pub(super) fn raw_range(py: Python<'_>, addr: usize, len: usize) -> PyResult<Raw> {
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
    pub(super) fn raw_job(
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
                in_place_or(Collective::AllToAll { count: sn / p }, send == recv)
            }
            "gather" | "scatter" => {
                let root = check_root(py, kind, root, self.p())?;
                let gather = kind == "gather";
                // This rank's block, and the root's whole buffer.
                let (mine, whole) = if gather { (send, recv) } else { (recv, send) };
                if root as usize != me {
                    return Ok(rooted_job(gather, dt, mine, vec![], root));
                }
                let (mn, wn) = (mine.len / es, whole.len / es);
                if wn != mn * p {
                    return Err(bad(format!(
                        "{mn} elements per rank, so {} on the root, not {wn}",
                        mn * p
                    )));
                }
                let blocks = split(whole, mine.len, p);
                let (sends, recvs) = if gather {
                    (vec![mine], blocks.clone())
                } else {
                    (blocks.clone(), vec![mine])
                };
                check_apart(py, kind, &sends, &recvs, Some(if gather { (0, me) } else { (me, 0) }))?;
                Ok(rooted_job(gather, dt, mine, blocks, root))
            }
            _ => Err(bad(
                "unknown collective: one of all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all, gather, scatter".into(),
            )),
        }
    }
}

/// The job of a Gather (`gather`: `mine` is the send block, `blocks` the
/// root's receive blocks) or a Scatter (the other way round); `blocks` is
/// empty off the root.
pub(super) fn rooted_job(
    gather: bool,
    dt: DataType,
    mine: Raw,
    blocks: Vec<Raw>,
    root: u32,
) -> Job {
    if gather {
        Job::Gather {
            dt,
            send: mine,
            recvs: blocks,
            root,
        }
    } else {
        Job::Scatter {
            dt,
            sends: blocks,
            recv: mine,
            root,
        }
    }
}

/// `whole` as `p` blocks of `block` bytes, back to back.
pub(super) fn split(whole: Raw, block: usize, p: usize) -> Vec<Raw> {
    (0..p)
        .map(|q| Raw {
            addr: whole.addr + q * block,
            len: block,
        })
        .collect()
}

/// No output block shares a byte with another block of the call (inputs
/// may overlap each other), except an input that is the very range of this
/// rank's own output (`own`: input index, output index), which the job
/// reads from a copy.
pub(super) fn check_apart(
    py: Python<'_>,
    op: &str,
    sends: &[Raw],
    recvs: &[Raw],
    own: Option<(usize, usize)>,
) -> PyResult<()> {
    let skip = own
        .filter(|&(s, r)| sends.get(s).is_some_and(|x| recvs.get(r) == Some(x)))
        .map(|(s, _)| s);
    let mut all: Vec<(Raw, bool)> = sends
        .iter()
        .enumerate()
        .filter(|&(i, _)| Some(i) != skip)
        .map(|(_, b)| (*b, false))
        .chain(recvs.iter().map(|b| (*b, true)))
        .filter(|(b, _)| b.len > 0)
        .collect();
    all.sort_by_key(|(b, _)| b.addr);
    let (mut end_any, mut end_out) = (0usize, 0usize);
    for (b, out) in all {
        if b.addr < end_out || (out && b.addr < end_any) {
            return Err(invalid(
                py,
                format!("{op}: an output overlaps another buffer of the call; each output needs memory of its own"),
            ));
        }
        end_any = end_any.max(b.end());
        if out {
            end_out = end_out.max(b.end());
        }
    }
    Ok(())
}

/// Which rooted collective [`PyComm::rooted_blocks`] builds.
#[derive(Clone, Copy)]
enum Rooted {
    Gather,
    Scatter,
}
