//! CUDA tensors for the torch backend: collectives through braid's device
//! communicator (`braid::CudaComm`) on the caller's CUDA stream.
//!
//! The device communicator is created on first use (a collective: every
//! rank reaches it with the same operation). Tensors are not registered
//! with braid: each call copies the input into a braid device buffer on the
//! caller's stream, runs the collective there (stream order), and copies
//! the result out; the staging buffers are reused by later calls, which
//! stream order makes safe when every call uses the same stream.
//!
//! Not yet run on a GPU (none here); without CUDA the creation fails on
//! every rank with braid's "CUDA unavailable: ..." error.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use braid::cuda::{CudaStream, DeviceBuffer};
use braid::{CudaComm, DataType};

use crate::work::Job;

/// The device communicator of one communicator and its staging buffers.
pub(crate) struct CudaState {
    cc: CudaComm,
    send: Option<Arc<DeviceBuffer>>,
    recv: Option<Arc<DeviceBuffer>>,
}

impl std::fmt::Debug for CudaState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaState")
            .field("device", &self.cc.device().ordinal())
            .finish()
    }
}

fn staging(
    slot: &mut Option<Arc<DeviceBuffer>>,
    cc: &CudaComm,
    len: usize,
) -> braid::Result<Arc<DeviceBuffer>> {
    if let Some(b) = slot {
        if b.len() >= len {
            return Ok(b.clone());
        }
    }
    let b = Arc::new(DeviceBuffer::alloc(
        cc.device(),
        len.next_power_of_two().max(256),
    )?);
    *slot = Some(b.clone());
    Ok(b)
}

/// Run `job` (a collective on device addresses, as the raw host entry point
/// builds it) on `stream` of this rank's GPU, which must be GPU `device`;
/// returns the GPU's ordinal.
///
/// # Safety
///
/// The job's ranges must be device memory of this rank's GPU, valid until
/// `stream` has run the copies enqueued here, and `stream` a live stream of
/// that GPU's primary context (or null for the legacy default stream).
pub(crate) unsafe fn run(
    state: &Mutex<Option<CudaState>>,
    comm: &braid::Communicator,
    job: &Job,
    stream: usize,
    device: u32,
    is_root: bool,
) -> braid::Result<u32> {
    let mut guard = state
        .lock()
        .map_err(|_| braid::Error::Unusable("the CUDA state lock is poisoned".into()))?;
    if guard.is_none() {
        *guard = Some(CudaState {
            cc: CudaComm::new(comm)?,
            send: None,
            recv: None,
        });
    }
    let Some(st) = guard.as_mut() else {
        return Err(braid::Error::Unusable("no device communicator".into()));
    };
    let ordinal = st.cc.device().ordinal();
    if ordinal != device {
        return Err(braid::Error::InvalidArgument(format!(
            "rank {}: the tensor is on cuda:{device}, but braid's device communicator uses GPU {ordinal} (one GPU per local rank, in local-rank order); call torch.cuda.set_device({ordinal}) and allocate there",
            comm.rank()
        )));
    }
    let (coll, dt, send, recv, copy_back): (_, DataType, _, _, bool) = match job {
        Job::Coll {
            coll,
            dt,
            send,
            recv,
        } => (
            coll,
            *dt,
            *send,
            *recv,
            !matches!(coll, braid::Collective::Reduce { .. }) || is_root,
        ),
        Job::InPlace { coll, dt, buf } => match coll {
            // The contribution is this rank's block of the buffer.
            braid::Collective::AllGather { send_count } => {
                let b = send_count * dt.size();
                let own = crate::views::Raw {
                    addr: buf.addr + comm.rank() as usize * b,
                    len: b,
                };
                (coll, *dt, own, *buf, true)
            }
            braid::Collective::ReduceScatter { recv_count, .. } => {
                let b = recv_count * dt.size();
                let own = crate::views::Raw {
                    addr: buf.addr + comm.rank() as usize * b,
                    len: b,
                };
                (coll, *dt, *buf, own, true)
            }
            braid::Collective::Reduce { .. } => (coll, *dt, *buf, *buf, is_root),
            _ => (coll, *dt, *buf, *buf, true),
        },
        _ => return Err(braid::Error::InvalidArgument(
            "this operation has no device form; the torch backend stages it through host memory"
                .into(),
        )),
    };
    let sb = staging(&mut st.send, &st.cc, send.len)?;
    let rb = staging(&mut st.recv, &st.cc, recv.len)?;
    // SAFETY: the caller guarantees `stream` is a live stream of this GPU.
    let s = unsafe { CudaStream::borrowed(st.cc.device(), stream as *mut c_void) };
    // SAFETY: the staging buffers hold at least the lengths copied; the
    // caller guarantees the tensors' ranges; stream order sequences the
    // copies with the collective.
    unsafe { s.copy_dtod(sb.ptr(), send.addr as u64, send.len)? };
    st.cc.run(coll, dt, &sb, &rb, &s)?;
    if copy_back {
        // SAFETY: as above.
        unsafe { s.copy_dtod(recv.addr as u64, rb.ptr(), recv.len)? };
    }
    Ok(st.cc.device().ordinal())
}
