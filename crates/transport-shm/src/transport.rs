//! The [`Transport`] implementation: segment creation at `listen`, and the
//! pending ends that attach (sender) and wait for the sender to attach,
//! prove single-copy access and unlink the name (receiver).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use braid_core::config;
use braid_core::error::{CoreError, Result};
use braid_core::transport::{
    PeerDesc, PendingRecv, PendingSend, RecvChannel, SendChannel, Transport,
};
use braid_core::types::MemKind;

use crate::info::{RecvInfo, SendInfo};
use crate::link::{check_abort_and_process, protocol, seg_err, ShmRecv, ShmSend};
use crate::probe;
use crate::segment::{Layout, Segment};
use crate::{ShmConfig, NAME};

/// The shared-memory transport. Cheap to clone; holds only its
/// configuration.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ShmTransport {
    cfg: ShmConfig,
}

impl ShmTransport {
    /// A transport with this configuration (checked again here, since a
    /// configuration built in code need not come from
    /// [`ShmConfig::from_env`]).
    pub fn new(cfg: ShmConfig) -> Result<Self> {
        cfg.validate()
            .map_err(|e| CoreError::InvalidArgument(format!("shm transport: {e}")))?;
        Ok(ShmTransport { cfg })
    }

    /// [`ShmConfig::from_env`] of the process environment, then
    /// [`ShmTransport::new`].
    pub fn from_env() -> Result<Self> {
        let cfg = ShmConfig::from_env(&config::process_env)
            .map_err(|e| CoreError::InvalidArgument(format!("shm transport: {e}")))?;
        Self::new(cfg)
    }

    /// Explicit slot geometry (`slot_bytes` a multiple of 64, 4096 to
    /// 1 GiB; `slots` 2 to 1024), for links that braid sizes itself (the
    /// GPU transports' staging and control links); the single-copy settings
    /// come from the process environment (`BRAID_SHM_DIRECT`,
    /// `BRAID_SHM_HELP`, `BRAID_SHM_HELP_CHUNK`), as for the runtime's shm
    /// links.
    pub fn with_params(slot_bytes: usize, slots: usize) -> Result<Self> {
        let cfg = ShmConfig::default()
            .with_geometry(slot_bytes, slots)
            .copy_from_env(&config::process_env)
            .map_err(|e| CoreError::InvalidArgument(format!("shm transport: {e}")))?;
        Self::new(cfg)
    }

    /// Bytes per slot of the connections this transport listens for.
    pub fn slot_bytes(&self) -> usize {
        self.cfg.slot_bytes()
    }

    /// Slots per connection this transport listens for.
    pub fn slots(&self) -> usize {
        self.cfg.slots()
    }

    /// The configuration.
    pub fn config(&self) -> &ShmConfig {
        &self.cfg
    }
}

fn random_u64() -> Result<u64> {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).map_err(|e| CoreError::Unavailable {
        transport: NAME,
        reason: format!("no randomness for segment names: {e}"),
    })?;
    Ok(u64::from_le_bytes(b))
}

impl Transport for ShmTransport {
    fn kind(&self) -> braid_core::transport::TransportKind {
        braid_core::transport::TransportKind::Shm
    }

    fn mem_kind(&self) -> MemKind {
        MemKind::Host
    }

    fn recv_slot_bytes(&self) -> Option<usize> {
        Some(self.cfg.slot_bytes())
    }

    fn can_connect(&self, me: &PeerDesc, peer: &PeerDesc) -> bool {
        me.host_id == peer.host_id
    }

    fn listen(&self, me: &PeerDesc, peer: &PeerDesc) -> Result<(Box<dyn PendingRecv>, Vec<u8>)> {
        let layout = Layout::new(self.cfg.slot_bytes(), self.cfg.slots())
            .ok_or_else(|| CoreError::InvalidArgument("invalid shm geometry".into()))?;
        let pid = std::process::id();
        let nonce = random_u64()?;
        let name = format!(
            "/braid-{pid}-{:016x}-{}-{}",
            random_u64()?,
            peer.rank,
            me.rank
        );
        let seg = Segment::create(&name, layout, nonce, pid).map_err(|e| {
            seg_err(
                peer.rank,
                &format!(
                    "creating shared memory {name} ({} bytes; is /dev/shm full?)",
                    layout.total
                ),
                e,
            )
        })?;
        tracing::debug!(segment = %name, from = peer.rank, to = me.rank, "shm listen");
        let blob = RecvInfo {
            pid,
            from: peer.rank,
            to: me.rank,
            slots: layout.slots as u32,
            slot_bytes: layout.slot_bytes as u64,
            nonce,
            name,
        }
        .encode();
        let pending = ShmPendingRecv {
            seg: Some(seg),
            me: me.rank,
            peer: peer.rank,
            direct: self.cfg.direct(),
            help_chunk: self.cfg.help_chunk(),
        };
        Ok((Box::new(pending), blob))
    }

    fn prepare_send(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> Result<(Box<dyn PendingSend>, Vec<u8>)> {
        let blob = SendInfo {
            pid: std::process::id(),
            from: me.rank,
            to: peer.rank,
        }
        .encode();
        Ok((
            Box::new(ShmPendingSend {
                me: me.rank,
                peer: peer.rank,
            }),
            blob,
        ))
    }
}

/// A receiving end between `listen` and `connect`.
#[derive(Debug)]
struct ShmPendingRecv {
    /// `Some` until connect takes it; dropping it unlinks the name.
    seg: Option<Segment>,
    me: u32,
    peer: u32,
    /// Offer direct transfers where the sender's memory is readable.
    direct: bool,
    /// Smallest chunk of a direct transfer shared with the sender.
    help_chunk: Option<usize>,
}

impl Drop for ShmPendingRecv {
    fn drop(&mut self) {
        if let Some(seg) = &self.seg {
            // Tell a sender that may have attached that nobody will read.
            seg.header().receiver.0.closed.store(1, Ordering::Release);
        }
        // Segment's drop unmaps and (still owning the name) unlinks.
    }
}

impl PendingRecv for ShmPendingRecv {
    fn connect(
        mut self: Box<Self>,
        sender_info: &[u8],
        deadline: Instant,
    ) -> Result<Box<dyn RecvChannel>> {
        let peer = self.peer;
        let start = Instant::now();
        let info = SendInfo::decode(sender_info)
            .map_err(|e| protocol(peer, format!("shm sender connect-info: {e}")))?;
        if info.from != peer || info.to != self.me {
            return Err(protocol(
                peer,
                format!(
                    "shm sender connect-info is for {} -> {}, expected {} -> {}",
                    info.from, info.to, peer, self.me
                ),
            ));
        }
        let seg = self.seg.as_ref().expect("pending receiver used twice");
        let hdr = seg.header();
        let sender = &hdr.sender.0;
        let mut spins = 0u32;
        let mut last_pid_check = start;
        // Acquire: pairs with the sender's Release store of `attached`, so
        // its pid store is visible below.
        while sender.attached.load(Ordering::Acquire) == 0 {
            let now = Instant::now();
            if now >= deadline {
                return Err(CoreError::Timeout {
                    transport: NAME,
                    peer,
                    waiting_for: "the sender to attach to the shared-memory segment",
                    after: now - start,
                });
            }
            if now - last_pid_check >= Duration::from_millis(50) {
                last_pid_check = now;
                check_abort_and_process(sender, peer, info.pid)?;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else if spins < 256 {
                std::thread::yield_now();
            } else {
                let nap = Duration::from_micros(if spins < 1024 { 50 } else { 1000 });
                std::thread::sleep(nap.min(deadline.saturating_duration_since(now)));
            }
        }
        let attached_pid = sender.pid.load(Ordering::Relaxed);
        if attached_pid != info.pid {
            return Err(protocol(
                peer,
                format!(
                    "shm segment {} was attached by process {attached_pid}, but rank {peer} is process {}",
                    seg.name(),
                    info.pid
                ),
            ));
        }
        // Single-copy transfers need this process to read the sender's
        // memory (same user, ptrace not forbidden by Yama or seccomp):
        // prove it on the word the sender advertised before enabling them.
        let readable = self.direct
            && probe::can_read_process(info.pid, sender.probe_addr.load(Ordering::Relaxed));
        if readable {
            // Release: pairs with the sender's Acquire in can_send_direct.
            hdr.receiver.0.direct_ok.store(1, Ordering::Release);
        }
        tracing::debug!(peer, direct = readable, "shm single-copy probe");
        let mut seg = self.seg.take().expect("checked above");
        // Both processes have it mapped: the name is no longer needed.
        seg.unlink()
            .map_err(|e| seg_err(peer, "unlinking the shm segment", e))?;
        tracing::debug!(segment = %seg.name(), peer, "shm receiver connected");
        Ok(Box::new(ShmRecv::new(seg, peer, info.pid, self.help_chunk)))
    }
}

/// A sending end between `prepare_send` and `connect` (holds no resources).
#[derive(Debug)]
struct ShmPendingSend {
    me: u32,
    peer: u32,
}

impl PendingSend for ShmPendingSend {
    fn connect(
        self: Box<Self>,
        receiver_info: &[u8],
        _deadline: Instant,
    ) -> Result<Box<dyn SendChannel>> {
        let peer = self.peer;
        let (info, layout) = RecvInfo::decode(receiver_info)
            .map_err(|e| protocol(peer, format!("shm receiver connect-info: {e}")))?;
        if info.from != self.me || info.to != peer {
            return Err(protocol(
                peer,
                format!(
                    "shm receiver connect-info is for {} -> {}, expected {} -> {}",
                    info.from, info.to, self.me, peer
                ),
            ));
        }
        let mut seg = Segment::open(&info.name, layout, info.nonce)
            .map_err(|e| seg_err(peer, "attaching to the receiver's shm segment", e))?;
        let hdr = seg.header();
        check_abort_and_process(&hdr.receiver.0, peer, info.pid)?;
        if hdr.receiver.0.closed.load(Ordering::Acquire) != 0 {
            return Err(CoreError::PeerAborted {
                transport: NAME,
                peer,
                reason: "the receiver gave up before the sender attached".into(),
            });
        }
        let me = &hdr.sender.0;
        me.pid.store(std::process::id(), Ordering::Relaxed);
        // Our address of the header's magic word: the receiver's probe.
        me.probe_addr
            .store(&hdr.magic as *const _ as u64, Ordering::Relaxed);
        // Release: the receiver that sees `attached` (Acquire) sees our pid.
        if me
            .attached
            .compare_exchange(0, 1, Ordering::Release, Ordering::Relaxed)
            .is_err()
        {
            return Err(protocol(
                peer,
                format!("shm segment {} already has a sender attached", info.name),
            ));
        }
        // Best effort: both sides have it mapped now; the receiver unlinks
        // too and ignores ENOENT.
        let _ = seg.unlink();
        tracing::debug!(segment = %info.name, peer, "shm sender connected");
        Ok(Box::new(ShmSend::new(seg, peer, info.pid)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params() {
        assert!(ShmTransport::with_params(4096, 2).is_ok());
        assert!(ShmTransport::with_params(4096 + 64, 3).is_ok());
        assert!(ShmTransport::with_params(4000, 8).is_err());
        assert!(ShmTransport::with_params(4096, 1).is_err());
        let d = ShmTransport::default();
        assert_eq!((d.slot_bytes(), d.slots()), (128 * 1024, 16));
        let e = ShmTransport::new(ShmConfig::default().with_geometry(4096, 1)).unwrap_err();
        assert!(e.to_string().contains("BRAID_SHM_SLOTS=\"1\""), "{e}");
    }
}
