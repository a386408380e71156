//! The proxy engine: device collectives run by a host thread per device
//! communicator, op by op, like NCCL's proxy.
//!
//! The caller's thread only enqueues: it records an event on the caller's
//! stream and hands the planned program to the proxy thread ([`Job`]). The
//! proxy makes its own CUDA stream wait for that event, then runs the same
//! pure program as the host engine through the shared stage runner:
//! copies (`cuMemcpy*Async`, into IPC-mapped peer slots or out of its own,
//! or through host slots for links staged through shared memory) and the
//! NVRTC reduction kernels on its stream, synchronising that stream before
//! it publishes a slot to a peer or gives one back. Waits go through the
//! engines' [`Waiter`], so a blocked job is published for the hang dump and
//! warned about when it stalls, as host operations are. When the job is
//! done (or failed) the proxy writes its sequence number into a pinned
//! completion word that the caller's stream waits for, so the GPU never
//! hangs; a failure marks the communicator broken and tells the peers.

use std::ops::ControlFlow;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use braid_core::plan::{Op, Program, Region};
use braid_core::transport::SlotBuf;
use braid_core::types::MemKind;
use braid_core::{CoreError, DataType, RedOp};
use braid_cuda::{CudaStream, Device, DeviceBuffer, Event, HostFlag, Kernels};

use super::stream::DevBuf;
use super::{run_stages, Blocked, Channels, OpRunner, WaitPolicy, Waiter};
use crate::progress::Progress;

/// One device collective for the proxy thread.
pub(crate) struct Job {
    pub(crate) prog: Arc<Program>,
    pub(crate) name: &'static str,
    pub(crate) bufs: [DevBuf; 2],
    /// Keeps the caller's buffers allocated until the proxy is done.
    pub(crate) _keep: Vec<Arc<DeviceBuffer>>,
    pub(crate) start: Event,
    pub(crate) seq: u32,
}

/// The proxy engine of one device communicator: its thread runs the jobs
/// the caller's thread enqueues, one at a time, in order.
pub(crate) struct Proxy {
    pub(crate) rank: u32,
    pub(crate) dev: Arc<Device>,
    pub(crate) kernels: Arc<Kernels>,
    pub(crate) stream: CudaStream,
    pub(crate) scratch_in: DeviceBuffer,
    pub(crate) scratch_out: DeviceBuffer,
    pub(crate) chans: Channels,
    pub(crate) policy: WaitPolicy,
    pub(crate) abort: Arc<AtomicBool>,
    pub(crate) broken: Arc<Mutex<Option<String>>>,
    pub(crate) flag: Arc<HostFlag>,
    /// Where the running job and its waits are published (hang dump,
    /// stall warning), as the host engine publishes its operations.
    pub(crate) progress: Arc<Progress>,
}

impl Proxy {
    /// Run jobs until the sending side is dropped.
    pub(crate) fn run(&mut self, rx: mpsc::Receiver<Job>) {
        while let Ok(job) = rx.recv() {
            let already = self.broken.lock().map(|b| b.is_some()).unwrap_or(true);
            if !already {
                if let Err(e) = self.one(&job) {
                    let msg = format!("{} (device) failed on rank {}: {e}", job.name, self.rank);
                    tracing::error!("{msg}");
                    self.chans.abort_all(&msg);
                    if let Ok(mut b) = self.broken.lock() {
                        b.get_or_insert(msg);
                    }
                }
            }
            // Release the caller's stream whatever happened.
            self.flag.store(job.seq);
        }
    }

    fn one(&mut self, job: &Job) -> Result<(), CoreError> {
        self.dev.bind().map_err(CoreError::from)?;
        self.stream
            .wait_event(&job.start)
            .map_err(CoreError::from)?;
        let mut ex = DevExec {
            prog: &job.prog,
            bufs: &job.bufs,
            kernels: &self.kernels,
            stream: &self.stream,
            scratch_in: self.scratch_in.ptr(),
            scratch_out: self.scratch_out.ptr(),
            scratch_len: self.scratch_in.len(),
        };
        self.progress.start(
            job.name,
            u64::from(job.seq),
            job.prog.stage_ends.len(),
            true,
        );
        let mut waiter = Waiter::new(&self.policy, &self.abort, Some(&self.progress));
        let r = run_stages(&job.prog, &mut self.chans, &mut waiter, &mut ex);
        // Whatever happened, nothing of ours may still run on the buffers.
        let s = self.stream.synchronize().map_err(CoreError::from);
        let r = r.and(s);
        self.progress
            .finish(r.as_ref().err().map(|e| e.to_string()).as_deref());
        r
    }
}

/// One job on the proxy engine, driven op by op by [`run_stages`].
struct DevExec<'a> {
    prog: &'a Program,
    bufs: &'a [DevBuf; 2],
    kernels: &'a Kernels,
    stream: &'a CudaStream,
    scratch_in: u64,
    scratch_out: u64,
    scratch_len: usize,
}

fn region(ex: &DevExec<'_>, r: Region) -> Result<u64, CoreError> {
    let b = ex
        .bufs
        .get(r.buf as usize)
        .ok_or_else(|| CoreError::InvalidArgument(format!("program names buffer {}", r.buf)))?;
    match r.offset.checked_add(r.len) {
        Some(end) if end <= b.len => Ok(b.ptr + r.offset as u64),
        _ => Err(CoreError::InvalidArgument(format!(
            "region {}+{} outside device buffer {} of {} bytes",
            r.offset, r.len, r.buf, b.len
        ))),
    }
}

impl OpRunner for DevExec<'_> {
    fn try_op(&mut self, op: &Op, chans: &mut Channels) -> Result<Option<Blocked>, CoreError> {
        try_op(self, op, chans)
    }
}

/// A slot an op holds for the piece it receives or sends.
#[derive(Clone, Copy)]
struct Held {
    /// The peer at the other end of the link.
    peer: u32,
    slot: SlotBuf,
    /// Where the slot lives.
    mem: MemKind,
}

/// Try one op: `Ok(None)` when it ran, `Ok(Some(blocked))` when it must
/// wait. Everything it enqueues has completed when it returns `None` (the
/// stream is synchronised before slots are published or released).
fn try_op(
    ex: &mut DevExec<'_>,
    op: &Op,
    chans: &mut Channels,
) -> Result<Option<Blocked>, CoreError> {
    let len = op.wire_len();
    let input = match peek_input(op, chans, len)? {
        ControlFlow::Break(b) => return Ok(Some(b)),
        ControlFlow::Continue(i) => i,
    };
    let output = match acquire_output(op, chans, len)? {
        ControlFlow::Break(b) => return Ok(Some(b)),
        ControlFlow::Continue(o) => o,
    };
    if len > ex.scratch_len && (input.is_some() || output.is_some()) {
        return Err(CoreError::InvalidArgument(format!(
            "piece of {len} bytes exceeds the {}-byte device scratch",
            ex.scratch_len
        )));
    }
    let piece = Piece {
        ex,
        input,
        output,
        len,
    };
    piece.enqueue(op)?;
    // The piece must have landed (and the input been read) before the peer
    // learns about it or gets its slot back.
    ex.stream.synchronize().map_err(CoreError::from)?;
    if let Some(i) = input {
        chans.receiver(i.peer)?.release()?;
    }
    if let Some(o) = output {
        chans.sender(o.peer)?.commit(len)?;
    }
    Ok(None)
}

/// The incoming piece of `op` (of `len` bytes), if it receives one:
/// `Break` when it has not arrived; an error when its size is not `len`.
fn peek_input(
    op: &Op,
    chans: &mut Channels,
    len: usize,
) -> Result<ControlFlow<Blocked, Option<Held>>, CoreError> {
    let Some(from) = op.recv_peer() else {
        return Ok(ControlFlow::Continue(None));
    };
    let ch = chans.receiver(from)?;
    let Some((slot, got)) = ch.poll_peek()? else {
        return Ok(ControlFlow::Break(Blocked::data(from)));
    };
    if got != len {
        return Err(CoreError::Protocol {
            peer: from,
            detail: format!(
                "rank {from} sent a piece of {got} bytes where {len} were expected: the ranks called different device operations, counts or datatypes"
            ),
        });
    }
    Ok(ControlFlow::Continue(Some(Held {
        peer: from,
        slot,
        mem: ch.mem_kind(),
    })))
}

/// A free slot for the outgoing piece of `op` (of `len` bytes), if it sends
/// one: `Break` when the link has none; an error when `len` does not fit.
fn acquire_output(
    op: &Op,
    chans: &mut Channels,
    len: usize,
) -> Result<ControlFlow<Blocked, Option<Held>>, CoreError> {
    let Some(to) = op.send_peer() else {
        return Ok(ControlFlow::Continue(None));
    };
    let ch = chans.sender(to)?;
    let Some(slot) = ch.poll_acquire()? else {
        return Ok(ControlFlow::Break(Blocked::slot(to)));
    };
    if slot.cap < len {
        return Err(CoreError::InvalidArgument(format!(
            "piece of {len} bytes does not fit the {}-byte slots of the link to rank {to}",
            slot.cap
        )));
    }
    Ok(ControlFlow::Continue(Some(Held {
        peer: to,
        slot,
        mem: ch.mem_kind(),
    })))
}

/// One op's piece of `len` bytes with the slots it holds: enqueues its
/// copies and kernels on the job's stream.
struct Piece<'e, 'a> {
    ex: &'e DevExec<'a>,
    input: Option<Held>,
    output: Option<Held>,
    len: usize,
}

/// A CUDA error as the engines report it.
fn cuda(e: braid_cuda::CudaError) -> CoreError {
    CoreError::from(e)
}

impl Piece<'_, '_> {
    /// Enqueue `op`'s copies and reductions (nothing is synchronised).
    fn enqueue(&self, op: &Op) -> Result<(), CoreError> {
        let (ex, st, k, len) = (self.ex, self.ex.stream, self.ex.kernels, self.len);
        // SAFETY (for the kernel launches below): every address is a checked
        // region of a live caller buffer, a slot of `len` bytes we hold, or a
        // scratch buffer of at least `len` bytes; all are aligned for the
        // datatype (allocations are 256-byte aligned, offsets are whole
        // elements); `dst` equals an input or is disjoint from it.
        match *op {
            Op::Copy {
                src,
                dst,
                finalize: fin,
            } => {
                let (s, d) = (region(ex, src)?, region(ex, dst)?);
                // SAFETY: checked regions; the plans never partly overlap them.
                unsafe { st.copy_dtod(d, s, src.len) }.map_err(cuda)?;
                if fin {
                    self.finalize(d)?;
                }
            }
            Op::Send { src, .. } => self.emit(region(ex, src)?)?,
            Op::Recv { dst, .. } => self.fetch_into(region(ex, dst)?)?,
            Op::RecvReduceSend { src, .. } => {
                let (dt, rop) = self.dt_op()?;
                let i = self.in_dev()?;
                let s = region(ex, src)?;
                match self.output {
                    Some(Held {
                        slot,
                        mem: MemKind::Device(_),
                        ..
                    }) => {
                        // SAFETY: see above.
                        unsafe {
                            k.reduce(st, dt, rop, slot.ptr as usize as u64, i, s, len / dt.size())
                        }
                        .map_err(cuda)?
                    }
                    Some(Held {
                        slot,
                        mem: MemKind::Host,
                        ..
                    }) => {
                        // SAFETY: see above.
                        unsafe { k.reduce(st, dt, rop, ex.scratch_out, i, s, len / dt.size()) }
                            .map_err(cuda)?;
                        // SAFETY: the host slot holds `len` bytes and is ours.
                        unsafe { st.copy_dtoh(slot.ptr, ex.scratch_out, len) }.map_err(cuda)?;
                    }
                    None => {
                        return Err(CoreError::InvalidArgument(
                            "reduce-send without a slot".into(),
                        ))
                    }
                }
            }
            Op::RecvReduceCopy {
                src,
                dst,
                finalize: fin,
                ..
            } => {
                let (dt, rop) = self.dt_op()?;
                let i = self.in_dev()?;
                let d = region(ex, dst)?;
                // SAFETY: see above.
                unsafe { k.reduce(st, dt, rop, d, i, region(ex, src)?, len / dt.size()) }
                    .map_err(cuda)?;
                if fin {
                    self.finalize(d)?;
                }
            }
            Op::RecvCopySend { dst, .. } => {
                let d = region(ex, dst)?;
                self.fetch_into(d)?;
                self.emit(d)?;
            }
            Op::RecvReduceCopySend {
                src,
                dst,
                finalize: fin,
                ..
            } => {
                let (dt, rop) = self.dt_op()?;
                let i = self.in_dev()?;
                let d = region(ex, dst)?;
                // SAFETY: see above.
                unsafe { k.reduce(st, dt, rop, d, i, region(ex, src)?, len / dt.size()) }
                    .map_err(cuda)?;
                if fin {
                    self.finalize(d)?;
                }
                self.emit(d)?;
            }
        }
        Ok(())
    }

    /// Where the incoming piece is readable by a kernel (device address):
    /// its slot, or the input scratch it is copied to from a host slot.
    fn in_dev(&self) -> Result<u64, CoreError> {
        let (ex, len) = (self.ex, self.len);
        match self.input {
            Some(Held {
                slot,
                mem: MemKind::Device(_),
                ..
            }) => Ok(slot.ptr as usize as u64),
            Some(Held {
                slot,
                mem: MemKind::Host,
                ..
            }) => {
                // SAFETY: the host slot holds `len` committed bytes until we
                // release it (after the stream is synchronised); the scratch
                // holds at least `len` bytes (checked by `try_op`).
                unsafe {
                    ex.stream
                        .copy_htod(ex.scratch_in, slot.ptr as *const u8, len)
                }
                .map_err(cuda)?;
                Ok(ex.scratch_in)
            }
            None => Err(CoreError::InvalidArgument("op without input".into())),
        }
    }

    /// Copy the incoming piece to device address `d`.
    fn fetch_into(&self, d: u64) -> Result<(), CoreError> {
        let (st, len) = (self.ex.stream, self.len);
        match self.input {
            Some(Held {
                slot,
                mem: MemKind::Device(_),
                ..
            }) => {
                // SAFETY: the slot holds `len` bytes; `d` is a checked region
                // of a live caller buffer; slots and user buffers never overlap.
                unsafe { st.copy_dtod(d, slot.ptr as usize as u64, len) }.map_err(cuda)
            }
            Some(Held {
                slot,
                mem: MemKind::Host,
                ..
            }) => {
                // SAFETY: as above, from a host slot.
                unsafe { st.copy_htod(d, slot.ptr as *const u8, len) }.map_err(cuda)
            }
            None => Err(CoreError::InvalidArgument("op without input".into())),
        }
    }

    /// Send the `len` bytes at device address `s`.
    fn emit(&self, s: u64) -> Result<(), CoreError> {
        let (st, len) = (self.ex.stream, self.len);
        match self.output {
            Some(Held {
                slot,
                mem: MemKind::Device(_),
                ..
            }) => {
                // SAFETY: the acquired slot holds at least `len` bytes
                // (checked) and is ours until commit; `s` is a checked region.
                unsafe { st.copy_dtod(slot.ptr as usize as u64, s, len) }.map_err(cuda)
            }
            Some(Held {
                slot,
                mem: MemKind::Host,
                ..
            }) => {
                // SAFETY: as above, into a host slot.
                unsafe { st.copy_dtoh(slot.ptr, s, len) }.map_err(cuda)
            }
            None => Err(CoreError::InvalidArgument("op without output".into())),
        }
    }

    /// The program's datatype and operator, which a reducing op needs.
    fn dt_op(&self) -> Result<(DataType, RedOp), CoreError> {
        match (self.ex.prog.dtype, self.ex.prog.red_op) {
            (Some(d), Some(o)) => Ok((d, o)),
            _ => Err(CoreError::InvalidArgument(
                "a reducing op in a program without datatype and operator".into(),
            )),
        }
    }

    /// The last step of an average: divide the `len` bytes at `d` by the
    /// program's divisor (nothing for other operators).
    fn finalize(&self, d: u64) -> Result<(), CoreError> {
        let (ex, len) = (self.ex, self.len);
        match ex.prog.dtype {
            Some(dt) if ex.prog.divisor > 1 => {
                // SAFETY: `d` is a checked region of `len` bytes of `dt`.
                unsafe {
                    ex.kernels
                        .divide(ex.stream, dt, d, len / dt.size(), ex.prog.divisor)
                }
                .map_err(cuda)
            }
            _ => Ok(()),
        }
    }
}
