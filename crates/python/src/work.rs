//! What an operation is once its arguments are checked ([`Job`]), and the
//! handle of an asynchronous one ([`Handle`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use braid::{Collective, Communicator, DataType};
use pyo3::prelude::*;

use crate::errors::{ErrInfo, Kind};
use crate::views::{Raw, View};

/// One checked operation on raw byte ranges. Plain data, so it can run on
/// the calling thread (GIL released) or on the communicator's stream.
#[derive(Debug)]
pub(crate) enum Job {
    /// `run_bytes` (out of place).
    Coll {
        coll: Collective,
        dt: DataType,
        send: Raw,
        recv: Raw,
    },
    /// `run_bytes_in_place`.
    InPlace {
        coll: Collective,
        dt: DataType,
        buf: Raw,
    },
    Barrier,
    /// Gather to `root` (`gather_bytes`): `recvs` holds one block per rank
    /// on the root and nothing elsewhere.
    Gather {
        dt: DataType,
        send: Raw,
        recvs: Vec<Raw>,
        root: u32,
    },
    /// Scatter from `root` (`scatter_bytes`): `sends` holds one block per
    /// rank on the root and nothing elsewhere.
    Scatter {
        dt: DataType,
        sends: Vec<Raw>,
        recv: Raw,
        root: u32,
    },
    /// AllToAllv (`all_to_all_v_bytes`): one block per rank each way.
    AllToAllv {
        dt: DataType,
        sends: Vec<Raw>,
        recvs: Vec<Raw>,
    },
    /// Point-to-point operations issued together.
    Group(Vec<P2pOp>),
    /// Several operations, one after the other (coalesced calls); the first
    /// failure ends it.
    Seq(Vec<Job>),
    /// Tagged sends and receives run together on a mailbox (the torch
    /// backend's point to point); each receive's sender lands in `sources`
    /// (in the order of the receives).
    Tagged {
        mb: braid::Mailbox,
        ops: Vec<TaggedOp>,
        sources: Arc<Mutex<Vec<i64>>>,
    },
}

/// One tagged send (`send: true`) or receive; a receive without a peer
/// takes a message from any rank.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TaggedOp {
    pub send: bool,
    pub peer: Option<u32>,
    pub tag: u64,
    pub buf: Raw,
}

/// One send (`send: true`) or receive of a group, in bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct P2pOp {
    pub send: bool,
    pub peer: u32,
    pub buf: Raw,
}

impl Job {
    /// Run on `comm`, on this thread.
    pub(crate) fn run(&self, comm: &Communicator) -> braid::Result<()> {
        // Every slice below: the caller keeps the buffers exported (views,
        // tensors held by the handle or the Python frame) until the job is
        // done, and the argument checks rejected overlapping buffers other
        // than the in-place forms, which use one slice, and a rank's own
        // block passed as both input and output, read from a copy
        // (`own_send`).
        match self {
            Job::Coll {
                coll,
                dt,
                send,
                recv,
            } => {
                // SAFETY: see above; `send` and `recv` do not overlap.
                let (s, r) = unsafe { (send.slice(), recv.slice_mut()) };
                comm.run_bytes(coll, *dt, s, r)
            }
            Job::InPlace { coll, dt, buf } => {
                // SAFETY: see above.
                comm.run_bytes_in_place(coll, *dt, unsafe { buf.slice_mut() })
            }
            Job::Barrier => comm.barrier(),
            Job::Gather {
                dt,
                send,
                recvs,
                root,
            } => {
                let mut copy = Vec::new();
                let s = own_send(*send, recvs.get(*root as usize), &mut copy);
                // SAFETY: see above.
                let mut r: Vec<&mut [u8]> =
                    recvs.iter().map(|b| unsafe { b.slice_mut() }).collect();
                comm.gather_bytes(*dt, s, &mut r, *root)
            }
            Job::Scatter {
                dt,
                sends,
                recv,
                root,
            } => {
                let mut copy = Vec::new();
                let s = send_blocks(sends, *root as usize, Some(recv), &mut copy);
                // SAFETY: see above.
                comm.scatter_bytes(*dt, &s, unsafe { recv.slice_mut() }, *root)
            }
            Job::AllToAllv { dt, sends, recvs } => {
                let me = comm.rank() as usize;
                let mut copy = Vec::new();
                let s = send_blocks(sends, me, recvs.get(me), &mut copy);
                // SAFETY: see above.
                let mut r: Vec<&mut [u8]> =
                    recvs.iter().map(|b| unsafe { b.slice_mut() }).collect();
                comm.all_to_all_v_bytes(*dt, &s, &mut r)
            }
            Job::Group(ops) => {
                let mut g = comm.group();
                for op in ops.iter().filter(|o| o.buf.len > 0) {
                    if op.send {
                        // SAFETY: as above.
                        g.send::<u8>(unsafe { op.buf.slice() }, op.peer);
                    } else {
                        // SAFETY: as above.
                        g.recv::<u8>(unsafe { op.buf.slice_mut() }, op.peer);
                    }
                }
                g.run()
            }
            Job::Seq(jobs) => jobs.iter().try_for_each(|j| j.run(comm)),
            Job::Tagged { mb, ops, sources } => {
                let mut b = mb.batch();
                for op in ops {
                    if op.send {
                        // SAFETY: as above.
                        b.send::<u8>(
                            unsafe { op.buf.slice() },
                            op.peer.unwrap_or(u32::MAX),
                            op.tag,
                        );
                    } else {
                        // SAFETY: as above; receive buffers overlap no other
                        // buffer of the batch (checked when it was built).
                        b.recv::<u8>(unsafe { op.buf.slice_mut() }, op.peer, op.tag);
                    }
                }
                let got = b.run()?;
                if let Ok(mut s) = sources.lock() {
                    *s = got.into_iter().map(i64::from).collect();
                }
                Ok(())
            }
        }
    }
}

/// The bytes of a rank's own send block: `send` itself, or a copy of it
/// (in `copy`, 8-byte aligned as every datatype needs) when it is the very
/// range `own_recv`, the block it lands in (a torch caller may pass one
/// tensor as both).
fn own_send<'a>(send: Raw, own_recv: Option<&Raw>, copy: &'a mut Vec<u64>) -> &'a [u8] {
    if own_recv != Some(&send) || send.len == 0 {
        // SAFETY: see `Job::run`: the range is live for the job and no
        // writable slice overlaps it.
        return unsafe { send.slice() };
    }
    copy.resize(send.len.div_ceil(8), 0);
    // SAFETY: `copy` holds at least `send.len` bytes, owned here; u64 has
    // no invalid bit patterns for bytes written through a u8 view.
    let bytes = unsafe { std::slice::from_raw_parts_mut(copy.as_mut_ptr().cast::<u8>(), send.len) };
    // SAFETY: see `Job::run`; read before the operation writes the block.
    bytes.copy_from_slice(unsafe { send.slice() });
    bytes
}

/// The bytes of send blocks, this rank's own (`own`) through [`own_send`].
fn send_blocks<'a>(
    sends: &'a [Raw],
    own: usize,
    own_recv: Option<&Raw>,
    copy: &'a mut Vec<u64>,
) -> Vec<&'a [u8]> {
    let mine = sends.get(own).map(|&b| own_send(b, own_recv, copy));
    sends
        .iter()
        .enumerate()
        .map(|(q, b)| match mine {
            Some(m) if q == own => m,
            // SAFETY: see `Job::run`: the range is live for the job and no
            // writable slice overlaps it.
            _ => unsafe { b.slice() },
        })
        .collect()
}

/// Held by whichever thread runs one of a communicator's queued
/// operations, until its callbacks ran.
#[derive(Debug, Default)]
pub(crate) struct Exec {
    lock: Mutex<()>,
}

/// An asynchronous operation queued on a communicator's worker thread. It
/// runs once: on the worker, or on the thread that waits for it when that
/// thread gets there first, every operation issued before it finished and
/// nothing runs (then two thread wake-ups are saved: ~45 µs of a small call
/// waited at once, where running it takes a microsecond). Either way it
/// holds the `Exec` lock while it runs and while its callbacks run, so
/// operations on one communicator never overlap, run in issue order, and
/// each starts after the callbacks of those before it.
pub(crate) struct Queued {
    /// The job and its communicator until it runs (a handle kept after
    /// that does not keep the communicator alive).
    job: Mutex<Option<(Job, Communicator)>>,
    done: Arc<Completion>,
    /// The communicator's operations issued and not yet finished (this one
    /// included): what its blocking calls check.
    pending: Arc<AtomicUsize>,
    exec: Arc<Exec>,
}

impl Queued {
    pub(crate) fn new(
        job: Job,
        comm: Communicator,
        done: Arc<Completion>,
        pending: Arc<AtomicUsize>,
        exec: Arc<Exec>,
    ) -> Queued {
        pending.fetch_add(1, Ordering::AcqRel);
        Queued {
            job: Mutex::new(Some((job, comm))),
            done,
            pending,
            exec,
        }
    }

    /// The worker's turn: run the job unless a waiter took it (a taken one
    /// still waits here until it finished, keeping later ones behind it).
    pub(crate) fn run_on_worker(&self) {
        let guard = self.exec.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.run_locked(guard);
    }

    /// The waiter's turn: run the job here if every earlier one finished
    /// and nothing runs (else the worker runs it).
    pub(crate) fn run_here(&self) {
        if self.pending.load(Ordering::Acquire) != 1 {
            return;
        }
        if let Ok(guard) = self.exec.lock.try_lock() {
            self.run_locked(guard);
        }
    }

    fn run_locked(&self, guard: std::sync::MutexGuard<'_, ()>) {
        let job = self.job.lock().ok().and_then(|mut j| j.take());
        let Some((job, comm)) = job else {
            return;
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.run(&comm)));
        drop((job, comm));
        // Not pending before the callbacks run: one may issue a blocking
        // call, which then runs on its thread instead of queueing behind.
        self.pending.fetch_sub(1, Ordering::AcqRel);
        self.done.complete(match r {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ErrInfo::from_braid(&e)),
            Err(_) => Err(ErrInfo::new(
                Kind::Unusable,
                "braid panicked while running the operation (a bug: please report it)",
            )),
        });
        drop(guard);
    }
}

/// Behind every operation queued so far, and any a waiter runs.
pub(crate) fn drain(exec: &Exec) {
    drop(exec.lock.lock());
}

/// Where an asynchronous operation's outcome lands.
///
/// The operation is *done* once its outcome is recorded and every callback
/// registered before that ran (callbacks copy results out, complete torch
/// futures): `wait` and `is_done` see it only then.
#[derive(Debug, Default)]
pub(crate) struct Completion {
    state: Mutex<CState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct CState {
    result: Option<Result<(), ErrInfo>>,
    callbacks: Vec<Py<PyAny>>,
    finished: bool,
}

impl Completion {
    pub(crate) fn is_done(&self) -> bool {
        self.state.lock().map(|s| s.finished).unwrap_or(true)
    }

    /// Record the outcome (once), run the callbacks, then wake waiters.
    pub(crate) fn complete(&self, r: Result<(), ErrInfo>) {
        match self.state.lock() {
            Ok(mut s) => {
                if s.result.is_some() {
                    return;
                }
                s.result = Some(r.clone());
            }
            Err(_) => return,
        }
        loop {
            let callbacks = match self.state.lock() {
                Ok(mut s) => {
                    if s.callbacks.is_empty() {
                        s.finished = true;
                        break;
                    }
                    std::mem::take(&mut s.callbacks)
                }
                Err(_) => break,
            };
            // At interpreter shutdown the callbacks are dropped unrun.
            let ran = Python::try_attach(|py| {
                for cb in &callbacks {
                    run_callback(py, cb, &r);
                }
            });
            if ran.is_none() {
                if let Ok(mut s) = self.state.lock() {
                    s.finished = true;
                }
                break;
            }
        }
        self.cv.notify_all();
    }

    /// Wait until done or `timeout` passes; whether it is done.
    pub(crate) fn wait(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let Ok(mut s) = self.state.lock() else {
            return true;
        };
        while !s.finished {
            s = match deadline {
                None => match self.cv.wait(s) {
                    Ok(s) => s,
                    Err(_) => return true,
                },
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return false;
                    }
                    match self.cv.wait_timeout(s, d - now) {
                        Ok((s, _)) => s,
                        Err(_) => return true,
                    }
                }
            };
        }
        true
    }

    /// The outcome, once done.
    pub(crate) fn result(&self) -> Option<Result<(), ErrInfo>> {
        match self.state.lock() {
            Ok(s) if s.finished => s.result.clone(),
            Ok(_) => None,
            Err(_) => Some(Err(ErrInfo::new(
                Kind::Unusable,
                "a thread panicked while completing an operation",
            ))),
        }
    }

    /// Run `cb(error or None)` when done (now, if it is).
    pub(crate) fn add_callback(&self, py: Python<'_>, cb: Py<PyAny>) {
        let done = match self.state.lock() {
            Ok(mut s) => {
                if s.finished {
                    s.result.clone()
                } else {
                    s.callbacks.push(cb.clone_ref(py));
                    None
                }
            }
            Err(_) => None,
        };
        if let Some(r) = done {
            run_callback(py, &cb, &r);
        }
    }
}

fn run_callback(py: Python<'_>, cb: &Py<PyAny>, r: &Result<(), ErrInfo>) {
    let arg: Py<PyAny> = match r {
        Ok(()) => py.None(),
        Err(e) => e.to_py(py).into_value(py).into_any(),
    };
    if let Err(e) = cb.call1(py, (arg,)) {
        e.write_unraisable(py, Some(cb.bind(py)));
    }
}

/// The handle of an asynchronous operation (``async_op=True``).
/// Operations on one communicator run in the order they were issued, like
/// a Rust ``braid::Stream``; the buffers stay in use until the operation is
/// done (dropping an unfinished handle waits for it).
#[pyclass(module = "braid._braid", name = "Handle", frozen)]
pub(crate) struct Handle {
    pub(crate) done: Arc<Completion>,
    /// The buffers the operation uses (exports, and objects that own the
    /// memory of a raw-pointer operation), held until it is done.
    keep: Mutex<Option<Kept>>,
    /// The sender of each receive of a tagged batch (`_raw_tagged`).
    sources: OnceLock<Arc<Mutex<Vec<i64>>>>,
    /// The queued operation, which `wait` may run itself.
    queued: Option<Arc<Queued>>,
}

/// Buffer exports and memory owners an operation uses.
type Kept = (Vec<View>, Option<Py<PyAny>>);

impl Handle {
    pub(crate) fn new(
        done: Arc<Completion>,
        keep: Vec<View>,
        keep_obj: Option<Py<PyAny>>,
        queued: Option<Arc<Queued>>,
    ) -> Handle {
        Handle {
            done,
            keep: Mutex::new(Some((keep, keep_obj))),
            sources: OnceLock::new(),
            queued,
        }
    }

    /// Where a tagged batch puts the sender of each receive.
    pub(crate) fn set_sources(&self, s: Arc<Mutex<Vec<i64>>>) {
        let _ = self.sources.set(s);
    }

    fn release(&self) {
        let k = self.keep.lock().ok().and_then(|mut k| k.take());
        drop(k);
    }

    /// Wait (GIL released) at most `timeout`, then raise the operation's
    /// error if it failed; the buffers are released once it is done.
    pub(crate) fn wait_inner(&self, py: Python<'_>, t: Option<Duration>) -> PyResult<()> {
        let d = self.done.clone();
        // A wait without a limit runs the operation itself if it can (a
        // wait with one must be able to give up).
        if let (None, Some(q)) = (t, &self.queued) {
            if !d.is_done() {
                py.detach(|| q.run_here());
            }
        }
        if !d.is_done() && !py.detach(move || d.wait(t)) {
            return Err(ErrInfo::new(
                Kind::Timeout,
                format!(
                    "the operation is still running after {:.3}s (wait() gave up; the handle stays valid)",
                    t.map(|t| t.as_secs_f64()).unwrap_or_default()
                ),
            )
            .to_py(py));
        }
        self.release();
        match self.done.result() {
            Some(Err(e)) => Err(e.to_py(py)),
            _ => Ok(()),
        }
    }
}

#[pymethods]
impl Handle {
    /// Block until the operation is done (at most ``timeout`` seconds, if
    /// given; the communicator's own deadline bounds it anyway) and raise
    /// its error if it failed. A wait that gives up raises
    /// ``braid.TimeoutError`` and leaves the handle valid.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let t = match timeout {
            Some(t) if t.is_finite() && t >= 0.0 => Some(Duration::from_secs_f64(t.min(1e9))),
            Some(t) => {
                return Err(crate::errors::invalid(
                    py,
                    format!("timeout must be a non-negative number of seconds, not {t}"),
                ))
            }
            None => None,
        };
        self.wait_inner(py, t)
    }

    /// Private (torch backend): the sender of each receive of a tagged
    /// batch, once it succeeded; None before, and for other operations.
    fn _sources(&self) -> Option<Vec<i64>> {
        if !matches!(self.done.result(), Some(Ok(()))) {
            return None;
        }
        self.sources
            .get()
            .and_then(|s| s.lock().ok().map(|v| v.clone()))
    }

    /// Whether the operation finished (successfully or not).
    fn done(&self) -> bool {
        self.done.is_done()
    }

    /// Whether the operation finished (torch.distributed's name).
    fn is_completed(&self) -> bool {
        self.done.is_done()
    }

    /// The exception the operation raised, None if it succeeded or is
    /// still running.
    fn exception(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        match self.done.result() {
            Some(Err(e)) => Some(e.to_py(py).into_value(py).into_any()),
            _ => None,
        }
    }

    /// Call ``fn(error)`` once the operation is done (``error`` is None on
    /// success): on the thread that completes it, or at once if it is done.
    fn add_done_callback(&self, py: Python<'_>, f: Py<PyAny>) {
        self.done.add_callback(py, f);
    }

    fn __repr__(&self) -> String {
        let state = match self.done.result() {
            None => "running",
            Some(Ok(())) => "done",
            Some(Err(_)) => "failed",
        };
        format!("<braid.Handle {state}>")
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // The buffers must outlive the operation: a handle dropped early
        // waits (every operation is bounded by the communicator's timeout).
        let holds = self.keep.get_mut().map(|k| k.is_some()).unwrap_or(false);
        if holds && !self.done.is_done() {
            let d = self.done.clone();
            let _ = Python::try_attach(|py| py.detach(move || d.wait(None)));
        }
    }
}
