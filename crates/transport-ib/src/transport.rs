//! The [`Transport`] implementation: device choice at creation, phase 1
//! (queue pairs in INIT, receives posted, memory registered) and phase 2
//! (RTR/RTS, the READY handshake).

use std::sync::Arc;
use std::time::Instant;

use braid_core::error::{CoreError, Result};
use braid_core::transport::{
    PeerDesc, PendingRecv, PendingSend, RecvChannel, SendChannel, Transport,
};
use braid_core::types::MemKind;

use crate::info::{Endpoint, RecvInfo, SendInfo};
use crate::link::{IbRecv, IbSend, Parts, RecvStart, RemoteFifo, CTRL_BYTES};
use crate::probe::{self, Chosen, HcaSpec, PortDesc};
use crate::verbs::{Cq, Device, Mr, Qp, QpParams};
use crate::{IbConfig, NAME};

/// Every port the verbs library shows ([`CoreError::Unavailable`] with the
/// reason when it shows nothing at all). A host whose kernel lists no RDMA
/// device is answered without loading libibverbs.
pub fn ports() -> Result<Vec<PortDesc>> {
    ports_under(std::path::Path::new(probe::SYSFS_CLASS))
}

fn ports_under(class: &std::path::Path) -> Result<Vec<PortDesc>> {
    let unavailable = |reason: String| CoreError::Unavailable {
        transport: NAME,
        reason,
    };
    let devs = probe::sysfs_devices(class);
    if devs.is_empty() {
        return Err(unavailable(format!(
            "no RDMA devices on this host ({} is empty or absent)",
            class.display()
        )));
    }
    if let Some(why) = library_missing(&devs) {
        return Err(unavailable(why));
    }
    crate::verbs::list_ports().map_err(|e| {
        unavailable(format!(
            "the verbs library finds no RDMA support on this machine ({e})"
        ))
    })
}

/// When this host has RDMA devices but libibverbs cannot be loaded: what to
/// tell the user (the runtime says it once as a warning, since TCP then
/// carries what the devices could).
pub fn library_missing(devices: &[String]) -> Option<String> {
    let e = crate::verbs::library().err()?;
    Some(format!(
        "this host has RDMA devices ({}) but {} cannot be loaded ({e}); install rdma-core's libibverbs and its providers (Debian: libibverbs1 ibverbs-providers) to use them",
        devices.join(", "),
        crate::verbs::LIBRARY,
    ))
}

/// The InfiniBand / RoCE transport.
#[derive(Clone, Debug)]
pub struct IbTransport {
    cfg: IbConfig,
    chosen: Chosen,
    dev: Arc<Device>,
}

impl IbTransport {
    /// Chooses the port and opens the device; [`CoreError::Unavailable`]
    /// ("IB unavailable: ...") when there is none that fits.
    pub fn new(cfg: IbConfig) -> Result<IbTransport> {
        cfg.validate()?;
        let all = ports()?;
        let spec = match &cfg.hca {
            Some(h) => Some(HcaSpec::parse(h).map_err(CoreError::InvalidArgument)?),
            None => None,
        };
        let near = probe::local_numa_nodes();
        let chosen = probe::choose(&all, spec.as_ref(), cfg.gid_index, &near, &cfg.nearest)
            .map_err(|e| CoreError::Unavailable {
                transport: NAME,
                reason: e,
            })?;
        let dev = Device::open(&chosen.device).map_err(|e| CoreError::Unavailable {
            transport: NAME,
            reason: format!("opening {}: {e}", chosen.device),
        })?;
        tracing::debug!(
            "IB transport: {}:{} gid {} fabric {}",
            chosen.device,
            chosen.port,
            chosen.gid_index,
            chosen.fabric
        );
        Ok(IbTransport { cfg, chosen, dev })
    }

    /// [`IbConfig::from_env`] then [`IbTransport::new`].
    pub fn from_env() -> Result<IbTransport> {
        IbTransport::new(IbConfig::from_env()?)
    }

    /// The port in use.
    pub fn chosen(&self) -> &Chosen {
        &self.chosen
    }

    /// The configuration.
    pub fn config(&self) -> &IbConfig {
        &self.cfg
    }

    fn params(&self) -> QpParams {
        QpParams {
            port: self.chosen.port,
            gid_index: self.chosen.gid_index as u8,
            roce: self.chosen.addr.roce,
            mtu: self.chosen.addr.mtu,
            timeout: self.cfg.timeout,
            retry_cnt: self.cfg.retry_cnt,
            sl: self.cfg.sl,
            tclass: self.cfg.tc,
        }
    }

    fn unavailable(&self, what: &str, e: std::io::Error) -> CoreError {
        CoreError::Unavailable {
            transport: NAME,
            reason: format!("{what} on {}: {e}", self.chosen.device),
        }
    }

    /// Phase 1 common to both ends: CQ, QPs in INIT with receives posted,
    /// the control buffer.
    fn phase1(&self, slots: usize) -> Result<(Parts, u32)> {
        let nq = self.cfg.qps;
        let max_send = (4 * slots + 16) as u32;
        let max_recv = (slots + 8) as u32;
        let cq = Cq::new(&self.dev, nq * (max_send + max_recv) as usize + 16)
            .map_err(|e| self.unavailable("creating a completion queue", e))?;
        let mut qps = Vec::with_capacity(nq);
        for q in 0..nq {
            let qp = Qp::new(&self.dev, &cq, max_send, max_recv)
                .map_err(|e| self.unavailable("creating a queue pair", e))?;
            qp.init(self.chosen.port)
                .map_err(|e| self.unavailable("initialising a queue pair", e))?;
            for _ in 0..max_recv {
                qp.post_recv((1u64 << 56) | ((q as u64) << 48))
                    .map_err(|e| self.unavailable("posting receives", e))?;
            }
            qps.push(qp);
        }
        let ctrl = Mr::alloc(&self.dev, CTRL_BYTES, true)
            .map_err(|e| self.unavailable("registering the control buffer", e))?;
        let mut r = [0u8; 4];
        getrandom::getrandom(&mut r).map_err(|e| CoreError::Unavailable {
            transport: NAME,
            reason: format!("no randomness for the PSN: {e}"),
        })?;
        let psn = u32::from_le_bytes(r) & 0x00ff_ffff;
        Ok((
            Parts {
                qps,
                cq,
                ctrl,
                max_send,
            },
            psn,
        ))
    }

    fn endpoint(&self, parts: &Parts, from: u32, to: u32, psn: u32) -> Endpoint {
        Endpoint {
            from,
            to,
            addr: self.chosen.addr,
            psn,
            qpns: parts.qps.iter().map(Qp::qpn).collect(),
            ctrl_addr: parts.ctrl.addr(),
            ctrl_rkey: parts.ctrl.rkey(),
        }
    }
}

fn bad_info(peer: u32, which: &str, e: String) -> CoreError {
    CoreError::Protocol {
        peer,
        detail: format!("invalid IB connect-info from the {which}: {e}"),
    }
}

/// Checks that the remote endpoint describes this link and matches the
/// local QP count.
fn check_remote(local: &Endpoint, remote: &Endpoint, peer: u32, which: &str) -> Result<()> {
    if remote.from != local.from || remote.to != local.to {
        return Err(bad_info(
            peer,
            which,
            format!(
                "it describes link {} -> {}, this is {} -> {}",
                remote.from, remote.to, local.from, local.to
            ),
        ));
    }
    if remote.qpns.len() != local.qpns.len() {
        return Err(bad_info(
            peer,
            which,
            format!(
                "{} queue pairs there, {} here: set {} alike on every rank",
                remote.qpns.len(),
                local.qpns.len(),
                crate::ENV_QPS
            ),
        ));
    }
    if remote.addr.roce != local.addr.roce {
        return Err(bad_info(
            peer,
            which,
            "one end is on InfiniBand, the other on RoCE".into(),
        ));
    }
    Ok(())
}

fn connect_qps(
    t: &IbTransport,
    parts: &Parts,
    local: &Endpoint,
    remote: &Endpoint,
    peer: u32,
) -> Result<()> {
    let p = t.params();
    for (qp, &rq) in parts.qps.iter().zip(&remote.qpns) {
        qp.connect(&p, &remote.addr, rq, remote.psn, local.psn)
            .map_err(|e| CoreError::Peer {
                transport: NAME,
                peer,
                what: format!(
                    "connecting a queue pair on {}:{} to QP {rq:#x}: {e}",
                    t.chosen.device, t.chosen.port
                ),
                source: Some(Box::new(e)),
            })?;
    }
    Ok(())
}

impl Transport for IbTransport {
    fn kind(&self) -> braid_core::transport::TransportKind {
        braid_core::transport::TransportKind::Ib
    }

    fn mem_kind(&self) -> MemKind {
        MemKind::Host
    }

    fn fabric(&self) -> Option<String> {
        Some(self.chosen.fabric.clone())
    }

    fn recv_slot_bytes(&self) -> Option<usize> {
        Some(self.cfg.slot_bytes)
    }

    fn can_connect(&self, _me: &PeerDesc, peer: &PeerDesc) -> bool {
        peer.fabric(NAME)
            .is_some_and(|f| probe::same_fabric(f, &self.chosen.fabric))
    }

    fn listen(&self, me: &PeerDesc, peer: &PeerDesc) -> Result<(Box<dyn PendingRecv>, Vec<u8>)> {
        let (parts, psn) = self.phase1(self.cfg.slots)?;
        let fifo = Mr::alloc(&self.dev, self.cfg.slots * self.cfg.slot_bytes, true)
            .map_err(|e| self.unavailable("registering the slot FIFO", e))?;
        let info = RecvInfo {
            ep: self.endpoint(&parts, peer.rank, me.rank, psn),
            fifo_addr: fifo.addr(),
            fifo_rkey: fifo.rkey(),
            slot_bytes: self.cfg.slot_bytes,
            slots: self.cfg.slots,
        };
        let blob = info.encode();
        Ok((
            Box::new(PendingIbRecv {
                t: self.clone(),
                parts,
                fifo,
                info,
            }),
            blob,
        ))
    }

    fn prepare_send(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> Result<(Box<dyn PendingSend>, Vec<u8>)> {
        // The receiver's geometry is the link's, unknown yet: size the
        // queues for at least 64 slots (more only throttles, see `has_room`).
        let (parts, psn) = self.phase1(self.cfg.slots.max(64))?;
        let info = SendInfo {
            ep: self.endpoint(&parts, me.rank, peer.rank, psn),
        };
        let blob = info.encode();
        Ok((
            Box::new(PendingIbSend {
                t: self.clone(),
                parts,
                info,
            }),
            blob,
        ))
    }
}

struct PendingIbSend {
    t: IbTransport,
    parts: Parts,
    info: SendInfo,
}

impl PendingSend for PendingIbSend {
    fn connect(
        self: Box<Self>,
        receiver_info: &[u8],
        _deadline: Instant,
    ) -> Result<Box<dyn SendChannel>> {
        let peer = self.info.ep.to;
        let ri = RecvInfo::decode(receiver_info).map_err(|e| bad_info(peer, "receiver", e))?;
        check_remote(&self.info.ep, &ri.ep, peer, "receiver")?;
        let staging = Mr::alloc(&self.t.dev, ri.slots * ri.slot_bytes, false)
            .map_err(|e| self.t.unavailable("registering the staging slots", e))?;
        connect_qps(&self.t, &self.parts, &self.info.ep, &ri.ep, peer)?;
        let ch = IbSend::start(
            self.parts,
            peer,
            (ri.ep.ctrl_addr, ri.ep.ctrl_rkey),
            staging,
            RemoteFifo {
                addr: ri.fifo_addr,
                rkey: ri.fifo_rkey,
                slot_bytes: ri.slot_bytes,
                slots: ri.slots,
            },
        )?;
        Ok(Box::new(ch))
    }
}

struct PendingIbRecv {
    t: IbTransport,
    parts: Parts,
    fifo: Arc<Mr>,
    info: RecvInfo,
}

impl PendingRecv for PendingIbRecv {
    fn connect(
        self: Box<Self>,
        sender_info: &[u8],
        deadline: Instant,
    ) -> Result<Box<dyn RecvChannel>> {
        let start = Instant::now();
        let peer = self.info.ep.from;
        let si = SendInfo::decode(sender_info).map_err(|e| bad_info(peer, "sender", e))?;
        check_remote(&self.info.ep, &si.ep, peer, "sender")?;
        connect_qps(&self.t, &self.parts, &self.info.ep, &si.ep, peer)?;
        match IbRecv::start(
            self.parts,
            peer,
            (si.ep.ctrl_addr, si.ep.ctrl_rkey),
            self.fifo,
            self.info.slot_bytes,
            self.info.slots,
            deadline,
        ) {
            RecvStart::Ready(ch) => Ok(ch),
            RecvStart::NoSender(why) => {
                if let Some(why) = why {
                    tracing::debug!(peer, "IB connect: the sender's QPs did not answer: {why}");
                }
                Err(CoreError::Timeout {
                    transport: NAME,
                    peer,
                    waiting_for: "the sender's queue pairs to answer the connect handshake",
                    after: start.elapsed(),
                })
            }
            RecvStart::Failed(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No device in the kernel's list: unavailable, said plainly, and the
    /// library is not even loaded (a temporary empty class folder stands
    /// for /sys/class/infiniband).
    #[test]
    fn a_host_without_rdma_devices_says_so() {
        let d = std::env::temp_dir().join(format!("braid-ib-class-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let e = ports_under(&d).unwrap_err().to_string();
        std::fs::remove_dir_all(&d).unwrap();
        assert!(e.contains("no RDMA devices on this host"), "{e}");
        assert!(e.contains("ib"), "{e}");
    }
}
