//! The [`Transport`] implementation: interface choice at creation, the
//! listener and the blobs of phase 1, and phase 2 (the sender dials and
//! writes a hello on every socket; the receiver accepts, checks the hellos
//! and starts its end).

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use braid_core::error::{CoreError, Result};
use braid_core::transport::{
    PeerDesc, PendingRecv, PendingSend, RecvChannel, SendChannel, Transport,
};
use braid_core::types::MemKind;

use crate::info::{Hello, RecvInfo, SendInfo, KIND_CTRL, KIND_DATA};
use crate::link::{SocketRecv, SocketSend};
use crate::{probe, SocketConfig, NAME};

/// How long a refused connection is retried.
const REFUSED_RETRY: Duration = Duration::from_secs(1);

/// The TCP socket transport.
#[derive(Clone, Debug)]
pub struct SocketTransport {
    cfg: SocketConfig,
    local: SocketAddr,
    ifname: String,
}

impl SocketTransport {
    /// Validates `cfg` and chooses the local address to listen on;
    /// [`CoreError::Unavailable`] if no interface fits.
    pub fn new(cfg: SocketConfig) -> Result<SocketTransport> {
        cfg.validate()
            .map_err(|e| CoreError::InvalidArgument(format!("socket transport: {e}")))?;
        let unavailable = |reason: String| CoreError::Unavailable {
            transport: NAME,
            reason,
        };
        let (local, ifname) = match cfg.addr {
            Some(ip) => (SocketAddr::new(ip, 0), String::from("(given address)")),
            None => {
                let ifaces = probe::list().map_err(unavailable)?;
                let route = cfg.root.and_then(probe::route_source);
                let a = probe::choose(&ifaces, cfg.ifname.as_ref(), cfg.family, cfg.root, route)
                    .map_err(unavailable)?;
                (a.socket_addr(), a.name)
            }
        };
        tracing::debug!("socket transport: listening on {ifname} {}", local.ip());
        Ok(SocketTransport { cfg, local, ifname })
    }

    /// [`SocketConfig::from_env`] of the process environment, then
    /// [`SocketTransport::new`].
    pub fn from_env() -> Result<SocketTransport> {
        let cfg = SocketConfig::from_env(&braid_core::config::process_env)
            .map_err(|e| CoreError::InvalidArgument(format!("socket transport: {e}")))?;
        SocketTransport::new(cfg)
    }

    /// The local address (port 0) listeners bind to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The interface it belongs to.
    pub fn interface(&self) -> &str {
        &self.ifname
    }

    /// The configuration.
    pub fn config(&self) -> &SocketConfig {
        &self.cfg
    }
}

fn random16() -> Result<[u8; 16]> {
    let mut b = [0u8; 16];
    while b == [0; 16] {
        getrandom::getrandom(&mut b).map_err(|e| CoreError::Unavailable {
            transport: NAME,
            reason: format!("no randomness for the connection token: {e}"),
        })?;
    }
    Ok(b)
}

fn peer_io(peer: u32, what: String, e: std::io::Error) -> CoreError {
    CoreError::Peer {
        transport: NAME,
        peer,
        what: format!("{what}: {e}"),
        source: Some(Box::new(e)),
    }
}

fn bad_info(peer: u32, which: &str, e: String) -> CoreError {
    CoreError::Protocol {
        peer,
        detail: format!("invalid socket connect-info from the {which}: {e}"),
    }
}

impl Transport for SocketTransport {
    fn kind(&self) -> braid_core::transport::TransportKind {
        braid_core::transport::TransportKind::Socket
    }

    fn mem_kind(&self) -> MemKind {
        MemKind::Host
    }

    fn recv_slot_bytes(&self) -> Option<usize> {
        Some(self.cfg.slot_bytes)
    }

    fn can_connect(&self, _me: &PeerDesc, _peer: &PeerDesc) -> bool {
        true
    }

    fn listen(&self, me: &PeerDesc, peer: &PeerDesc) -> Result<(Box<dyn PendingRecv>, Vec<u8>)> {
        let listener = TcpListener::bind(self.local).map_err(|e| CoreError::Unavailable {
            transport: NAME,
            reason: format!("cannot listen on {} ({}): {e}", self.local, self.ifname),
        })?;
        let addr = listener.local_addr().map_err(|e| CoreError::Unavailable {
            transport: NAME,
            reason: format!("getsockname on a listener: {e}"),
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| peer_io(peer.rank, "listener".into(), e))?;
        let token = random16()?;
        let info = RecvInfo {
            from: peer.rank,
            to: me.rank,
            addr,
            token,
            slot_bytes: self.cfg.slot_bytes,
            slots: self.cfg.slots,
            nsocks: self.cfg.nsocks,
        };
        let blob = info.encode();
        Ok((Box::new(PendingSocketRecv { listener, info }), blob))
    }

    fn prepare_send(
        &self,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> Result<(Box<dyn PendingSend>, Vec<u8>)> {
        let info = SendInfo {
            from: me.rank,
            to: peer.rank,
            nonce: random16()?,
        };
        let blob = info.encode();
        Ok((
            Box::new(PendingSocketSend {
                info,
                direct: self.cfg.direct,
            }),
            blob,
        ))
    }
}

/// A sending end before `connect`.
#[derive(Debug)]
struct PendingSocketSend {
    info: SendInfo,
    /// Offer direct (zero-copy) sends.
    direct: bool,
}

/// Connects to `addr`; a refusal is retried until `refused_until`.
fn dial(
    addr: SocketAddr,
    deadline: Instant,
    refused_until: Instant,
    peer: u32,
) -> Result<TcpStream> {
    let start = Instant::now();
    loop {
        let now = Instant::now();
        let left = deadline.saturating_duration_since(now);
        if left.is_zero() {
            return Err(CoreError::Timeout {
                transport: NAME,
                peer,
                waiting_for: "a TCP connection to the receiver",
                after: now - start,
            });
        }
        match TcpStream::connect_timeout(&addr, left) {
            Ok(s) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused && now < refused_until => {
                std::thread::sleep(Duration::from_millis(20).min(left));
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                return Err(CoreError::Timeout {
                    transport: NAME,
                    peer,
                    waiting_for: "a TCP connection to the receiver",
                    after: Instant::now() - start,
                })
            }
            Err(e) => return Err(peer_io(peer, format!("cannot connect to {addr}"), e)),
        }
    }
}

impl PendingSend for PendingSocketSend {
    fn connect(
        self: Box<Self>,
        receiver_info: &[u8],
        deadline: Instant,
    ) -> Result<Box<dyn SendChannel>> {
        let me = self.info;
        let peer = me.to;
        let ri = RecvInfo::decode(receiver_info).map_err(|e| bad_info(peer, "receiver", e))?;
        if ri.from != me.from || ri.to != me.to {
            return Err(bad_info(
                peer,
                "receiver",
                format!(
                    "it describes link {} -> {}, this is {} -> {}",
                    ri.from, ri.to, me.from, me.to
                ),
            ));
        }
        let mut data = Vec::with_capacity(ri.nsocks);
        let mut ctrl = None;
        let refused_until = Instant::now() + REFUSED_RETRY;
        for i in 0..=ri.nsocks {
            let s = dial(ri.addr, deadline, refused_until, peer)?;
            let io = |what: &str, e| peer_io(peer, format!("{what} ({})", ri.addr), e);
            s.set_nodelay(true).map_err(|e| io("TCP_NODELAY", e))?;
            let is_ctrl = i == ri.nsocks;
            let hello = Hello {
                kind: if is_ctrl { KIND_CTRL } else { KIND_DATA },
                index: if is_ctrl { 0 } else { i as u8 },
                from: me.from,
                to: me.to,
                token: ri.token,
                nonce: me.nonce,
            };
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(10));
            s.set_write_timeout(Some(left))
                .map_err(|e| io("set timeout", e))?;
            (&s).write_all(&hello.encode())
                .map_err(|e| io("sending the hello", e))?;
            s.set_write_timeout(None)
                .map_err(|e| io("set timeout", e))?;
            if is_ctrl {
                ctrl = Some(s);
            } else {
                data.push(s);
            }
        }
        let ctrl = ctrl.ok_or_else(|| CoreError::Protocol {
            peer,
            detail: "no control socket".into(),
        })?;
        let ch = SocketSend::start(peer, ri.slot_bytes, ri.slots, data, ctrl, self.direct)?;
        Ok(Box::new(ch))
    }
}

/// A receiving end before `connect`.
#[derive(Debug)]
struct PendingSocketRecv {
    listener: TcpListener,
    info: RecvInfo,
}

/// An accepted socket whose hello is still arriving.
struct Arrival {
    sock: TcpStream,
    buf: [u8; Hello::LEN],
    got: usize,
}

impl PendingRecv for PendingSocketRecv {
    fn connect(
        self: Box<Self>,
        sender_info: &[u8],
        deadline: Instant,
    ) -> Result<Box<dyn RecvChannel>> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        use std::io::Read;

        let start = Instant::now();
        let ri = self.info;
        let peer = ri.from;
        let si = SendInfo::decode(sender_info).map_err(|e| bad_info(peer, "sender", e))?;
        if si.from != ri.from || si.to != ri.to {
            return Err(bad_info(
                peer,
                "sender",
                format!(
                    "it describes link {} -> {}, this is {} -> {}",
                    si.from, si.to, ri.from, ri.to
                ),
            ));
        }
        let n = ri.nsocks;
        let mut data: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        let mut ctrl: Option<TcpStream> = None;
        let mut pending: Vec<Arrival> = Vec::new();
        loop {
            if ctrl.is_some() && data.iter().all(Option::is_some) {
                break;
            }
            let now = Instant::now();
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() {
                let got = data.iter().filter(|d| d.is_some()).count() + usize::from(ctrl.is_some());
                tracing::debug!(
                    peer,
                    "socket connect: {got} of {} sockets arrived by the deadline",
                    n + 1
                );
                return Err(CoreError::Timeout {
                    transport: NAME,
                    peer,
                    waiting_for: "the sender's sockets to connect",
                    after: now - start,
                });
            }
            // Wait for a connection or hello bytes, at most 100 ms.
            let wait_ms = left
                .min(Duration::from_millis(100))
                .as_micros()
                .div_ceil(1000) as u16;
            {
                let mut fds = Vec::with_capacity(1 + pending.len());
                fds.push(PollFd::new(self.listener.as_fd(), PollFlags::POLLIN));
                for p in &pending {
                    fds.push(PollFd::new(p.sock.as_fd(), PollFlags::POLLIN));
                }
                match poll(&mut fds, PollTimeout::from(wait_ms)) {
                    Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                    Err(e) => {
                        return Err(peer_io(peer, "poll".into(), std::io::Error::from(e)));
                    }
                }
            }
            // Accept whatever is queued.
            loop {
                match self.listener.accept() {
                    Ok((sock, _)) => {
                        if sock.set_nonblocking(true).is_ok() {
                            if pending.len() >= 64 {
                                pending.remove(0);
                            }
                            pending.push(Arrival {
                                sock,
                                buf: [0; Hello::LEN],
                                got: 0,
                            });
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        // ECONNABORTED and friends: that connection is gone.
                        tracing::debug!(peer, "accept: {e}");
                        break;
                    }
                }
            }
            // Read hellos.
            let mut i = 0;
            while i < pending.len() {
                let p = &mut pending[i];
                let keep = match p.sock.read(&mut p.buf[p.got..]) {
                    Ok(0) => false,
                    Ok(k) => {
                        p.got += k;
                        true
                    }
                    Err(e) => matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    ),
                };
                if !keep {
                    pending.swap_remove(i);
                    continue;
                }
                if p.got < Hello::LEN {
                    i += 1;
                    continue;
                }
                let p = pending.swap_remove(i);
                match check_hello(&p.buf, &ri, &si, &data, ctrl.is_some()) {
                    Ok((kind, idx)) => {
                        if kind == KIND_CTRL {
                            ctrl = Some(p.sock);
                        } else {
                            data[idx] = Some(p.sock);
                        }
                    }
                    Err(why) => {
                        tracing::warn!(
                            peer,
                            "socket transport: rejected a connection from {:?}: {why}",
                            p.sock.peer_addr().ok()
                        );
                    }
                }
            }
        }
        let socks: Vec<TcpStream> = data.into_iter().flatten().collect();
        let ctrl = ctrl.ok_or_else(|| CoreError::Protocol {
            peer,
            detail: "no control socket".into(),
        })?;
        for s in socks.iter().chain(std::iter::once(&ctrl)) {
            s.set_nonblocking(false)
                .and_then(|()| s.set_nodelay(true))
                .map_err(|e| peer_io(peer, "socket options".into(), e))?;
        }
        drop(self.listener);
        let ch = SocketRecv::start(peer, ri.slot_bytes, ri.slots, socks, ctrl)?;
        Ok(Box::new(ch))
    }
}

/// Checks a hello against what this receiver expects: `(kind, index)`.
pub(crate) fn check_hello<T>(
    buf: &[u8; Hello::LEN],
    ri: &RecvInfo,
    si: &SendInfo,
    data: &[Option<T>],
    have_ctrl: bool,
) -> std::result::Result<(u8, usize), String> {
    let h = Hello::decode(buf)?;
    if h.token != ri.token {
        return Err("wrong token (a stray or foreign connection)".into());
    }
    if h.nonce != si.nonce || h.from != si.from || h.to != si.to {
        return Err(format!(
            "hello for link {} -> {} from another sender attempt",
            h.from, h.to
        ));
    }
    let idx = h.index as usize;
    match h.kind {
        KIND_CTRL if idx == 0 && !have_ctrl => Ok((KIND_CTRL, 0)),
        KIND_DATA if idx < data.len() && data[idx].is_none() => Ok((KIND_DATA, idx)),
        k => Err(format!(
            "unexpected or duplicate socket kind {k} index {idx}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{info, link};
    use braid_conformance::desc;
    use braid_core::transport::Incoming;

    fn lo() -> SocketTransport {
        SocketTransport::new(
            SocketConfig::default()
                .with_addr("127.0.0.1".parse().unwrap())
                .with_geometry(65536, 4)
                .with_nsocks(2),
        )
        .unwrap()
    }

    fn raw_hello(ri: &RecvInfo, si: &SendInfo, kind: u8, index: u8) -> TcpStream {
        let mut s = TcpStream::connect(ri.addr).unwrap();
        let h = Hello {
            kind,
            index,
            from: si.from,
            to: si.to,
            token: ri.token,
            nonce: si.nonce,
        };
        s.write_all(&h.encode()).unwrap();
        s
    }

    /// Polls `f` until it gives something (10 s at most).
    fn wait<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(v) = f() {
                return v;
            }
            assert!(Instant::now() < end, "waited 10 s for {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn wait_err(mut f: impl FnMut() -> Result<()>) -> CoreError {
        wait("an error", || f().err())
    }

    /// Strangers (wrong token, garbage, silence, a duplicate index) are
    /// dropped; the real sender still gets through.
    /// The threads of this process named `braid-sock*`.
    fn socket_threads() -> Vec<String> {
        let mut v = Vec::new();
        for e in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            if comm.starts_with("braid-sock") {
                v.push(comm.trim().to_string());
            }
        }
        v
    }

    /// However many links and sockets, one progress thread drives them all.
    #[test]
    fn one_progress_thread_for_every_link() {
        let t = lo();
        let mut links = Vec::new();
        for q in 1..=6u32 {
            let (prx, rblob) = t.listen(&desc(0), &desc(q)).unwrap();
            let (ptx, sblob) = t.prepare_send(&desc(q), &desc(0)).unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            let tx = ptx.connect(&rblob, deadline).unwrap();
            let rx = prx.connect(&sblob, deadline).unwrap();
            links.push((tx, rx));
        }
        // 6 links x 2 ends x (2 data sockets + 1 control socket). A new
        // thread names itself once it runs (under load, a moment later).
        let named = wait("the progress thread's name", || {
            let v = socket_threads();
            (!v.is_empty()).then_some(v)
        });
        std::thread::sleep(Duration::from_millis(50));
        let threads = socket_threads();
        assert_eq!(named, ["braid-sock-poll"], "{named:?}");
        assert_eq!(threads, ["braid-sock-poll"], "{threads:?}");
        // They all work.
        for (tx, rx) in links.iter_mut() {
            let slot = tx.poll_acquire().unwrap().unwrap();
            // SAFETY: a slot of at least one byte, ours until commit.
            unsafe { slot.ptr.write(7) };
            tx.commit(1).unwrap();
            let (buf, len) = wait("a message", || rx.poll_peek().unwrap());
            assert_eq!(len, 1);
            // SAFETY: the slot holds the byte until release.
            assert_eq!(unsafe { buf.ptr.read() }, 7);
            rx.release().unwrap();
        }
    }

    #[test]
    fn strangers_are_rejected() {
        let t = lo();
        let (prx, rblob) = t.listen(&desc(1), &desc(0)).unwrap();
        let ri = RecvInfo::decode(&rblob).unwrap();
        let (ptx, sblob) = t.prepare_send(&desc(0), &desc(1)).unwrap();
        let si = SendInfo::decode(&sblob).unwrap();
        let mut wrong = ri.clone();
        wrong.token[0] ^= 1;
        let _a = raw_hello(&wrong, &si, KIND_DATA, 0);
        let mut b = TcpStream::connect(ri.addr).unwrap();
        b.write_all(&[0x55; Hello::LEN]).unwrap();
        let _silent = TcpStream::connect(ri.addr).unwrap();
        let mut other = si.clone();
        other.nonce[3] ^= 1;
        let _c = raw_hello(&ri, &other, KIND_DATA, 1);
        let _d = raw_hello(&ri, &si, KIND_DATA, 7);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut tx = ptx.connect(&rblob, deadline).unwrap();
        let mut rx = prx.connect(&sblob, deadline).unwrap();
        let slot = tx.poll_acquire().unwrap().unwrap();
        // SAFETY: a host slot of at least one byte.
        unsafe { slot.ptr.write(9) };
        tx.commit(1).unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        let (buf, len) = loop {
            if let Some(x) = rx.poll_peek().unwrap() {
                break x;
            }
            assert!(Instant::now() < end);
        };
        assert_eq!(len, 1);
        // SAFETY: the peeked slot holds one byte.
        assert_eq!(unsafe { buf.ptr.read() }, 9);
        rx.release().unwrap();
    }

    /// The receiver's timeout names the peer and what was missing.
    #[test]
    fn timeout_names_the_peer() {
        let t = lo();
        let (prx, rblob) = t.listen(&desc(1), &desc(5)).unwrap();
        let ri = RecvInfo::decode(&rblob).unwrap();
        let (_ptx, sblob) = t.prepare_send(&desc(5), &desc(1)).unwrap();
        let si = SendInfo::decode(&sblob).unwrap();
        // Only some sockets arrive.
        let _s = raw_hello(&ri, &si, KIND_DATA, 0);
        let e = prx
            .connect(&sblob, Instant::now() + Duration::from_millis(200))
            .err()
            .unwrap();
        assert!(matches!(e, CoreError::Timeout { peer: 5, .. }), "{e:?}");
        assert!(e.to_string().contains("rank 5"), "{e}");
    }

    /// A sender that vanishes without a goodbye (a crash) is "connection
    /// lost" at the receiver.
    #[test]
    fn crashed_sender_is_connection_lost() {
        let t = lo();
        let (prx, rblob) = t.listen(&desc(1), &desc(0)).unwrap();
        let ri = RecvInfo::decode(&rblob).unwrap();
        let (_ptx, sblob) = t.prepare_send(&desc(0), &desc(1)).unwrap();
        let si = SendInfo::decode(&sblob).unwrap();
        let socks: Vec<TcpStream> = (0..ri.nsocks)
            .map(|i| raw_hello(&ri, &si, KIND_DATA, i as u8))
            .chain(std::iter::once(raw_hello(&ri, &si, KIND_CTRL, 0)))
            .collect();
        let mut rx = prx
            .connect(&sblob, Instant::now() + Duration::from_secs(10))
            .unwrap();
        rx.check_peer().unwrap();
        drop(socks);
        let e = wait_err(|| rx.check_peer());
        assert!(
            matches!(&e, CoreError::Peer { peer: 0, what, .. } if what.contains("connection lost")),
            "{e:?}"
        );
        assert!(rx.poll_peek().is_err());
    }

    /// A receiver that vanishes without a goodbye is "connection lost" at
    /// the sender; a frame that breaks the striping rule is a protocol
    /// error at the receiver.
    #[test]
    fn crashed_receiver_and_bad_frames() {
        let t = lo();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let ri = RecvInfo {
            from: 0,
            to: 1,
            addr: listener.local_addr().unwrap(),
            token: [3; 16],
            slot_bytes: 65536,
            slots: 2,
            nsocks: 1,
        };
        let (ptx, _) = t.prepare_send(&desc(0), &desc(1)).unwrap();
        let mut tx = ptx
            .connect(&ri.encode(), Instant::now() + Duration::from_secs(10))
            .unwrap();
        let a = listener.accept().unwrap();
        let b = listener.accept().unwrap();
        tx.check_peer().unwrap();
        drop((a, b));
        let e = wait_err(|| tx.check_peer());
        assert!(
            matches!(&e, CoreError::Peer { peer: 1, what, .. } if what.contains("connection lost")),
            "{e:?}"
        );

        // A piece at the wrong offset.
        let (prx, rblob) = t.listen(&desc(1), &desc(0)).unwrap();
        let ri = RecvInfo::decode(&rblob).unwrap();
        let (_p, sblob) = t.prepare_send(&desc(0), &desc(1)).unwrap();
        let si = SendInfo::decode(&sblob).unwrap();
        let mut socks: Vec<TcpStream> = (0..ri.nsocks)
            .map(|i| raw_hello(&ri, &si, KIND_DATA, i as u8))
            .chain(std::iter::once(raw_hello(&ri, &si, KIND_CTRL, 0)))
            .collect();
        let mut rx = prx
            .connect(&sblob, Instant::now() + Duration::from_secs(10))
            .unwrap();
        let h = info::FrameHeader {
            seq: 0,
            total: 10,
            offset: 5,
            len: 5,
            direct: false,
        };
        socks[0].write_all(&h.encode()).unwrap();
        socks[0].write_all(&[0; 5]).unwrap();
        let e = wait_err(|| rx.check_peer());
        assert!(matches!(e, CoreError::Protocol { peer: 0, .. }), "{e:?}");
    }
    /// A receiver fed by raw sockets (a hand-made sender): `(receiver,
    /// data sockets, control socket)`.
    fn raw_link(t: &SocketTransport) -> (Box<dyn RecvChannel>, Vec<TcpStream>, TcpStream) {
        let (prx, rblob) = t.listen(&desc(1), &desc(0)).unwrap();
        let ri = RecvInfo::decode(&rblob).unwrap();
        let (_ptx, sblob) = t.prepare_send(&desc(0), &desc(1)).unwrap();
        let si = SendInfo::decode(&sblob).unwrap();
        let data: Vec<TcpStream> = (0..ri.nsocks)
            .map(|i| raw_hello(&ri, &si, KIND_DATA, i as u8))
            .collect();
        let ctrl = raw_hello(&ri, &si, KIND_CTRL, 0);
        let rx = prx
            .connect(&sblob, Instant::now() + Duration::from_secs(10))
            .unwrap();
        (rx, data, ctrl)
    }

    /// Writes the start of direct message 0 of `total` bytes (2 sockets):
    /// all of piece 0 and `part` bytes of piece 1. Returns the message.
    fn half_direct(data: &mut [TcpStream], total: usize, part: usize) -> Vec<u8> {
        let msg: Vec<u8> = (0..total).map(|i| (i * 13 + 1) as u8).collect();
        let pieces: Vec<_> = link::stripes(0, total, data.len()).collect();
        assert_eq!(pieces.len(), 2);
        for (j, &(s, off, len)) in pieces.iter().enumerate() {
            let h = info::FrameHeader {
                seq: 0,
                total: total as u32,
                offset: off as u32,
                len: len as u32,
                direct: true,
            };
            data[s].write_all(&h.encode()).unwrap();
            let n = if j == 0 { len } else { part };
            data[s].write_all(&msg[off..off + n]).unwrap();
        }
        msg
    }

    /// Reads the direct message at the head as far as it has arrived:
    /// `(done, bytes of out that match msg from the start of each piece)`.
    fn read_partly(rx: &mut dyn RecvChannel, out: &mut [u8]) -> Result<bool> {
        let inc = wait_for_incoming(rx);
        assert!(
            matches!(inc, Incoming::Remote(l) if l == out.len()),
            "{inc:?}"
        );
        let mut done = false;
        for _ in 0..50 {
            // SAFETY: `out` is valid for its length of writes.
            done = unsafe {
                rx.direct()
                    .unwrap()
                    .poll_read_remote(out.as_mut_ptr(), out.len())
            }?;
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(done)
    }

    fn wait_for_incoming(rx: &mut dyn RecvChannel) -> Incoming {
        wait("a message", || rx.poll_peek_any().unwrap())
    }

    /// A sender that dies in the middle of a direct payload: the bytes that
    /// came are in place, the read does not finish, and then the receiver
    /// reports "connection lost" naming the rank.
    #[test]
    fn sender_death_during_a_direct_payload() {
        let t = lo();
        let (mut rx, mut data, ctrl) = raw_link(&t);
        let total = 200_000;
        let msg = half_direct(&mut data, total, 1000);
        let mut out = vec![0u8; total];
        assert!(
            !read_partly(&mut *rx, &mut out).unwrap(),
            "finished without the bytes"
        );
        let pieces: Vec<_> = link::stripes(0, total, 2).collect();
        let (_, off1, _) = pieces[1];
        assert!(out[..off1] == msg[..off1], "piece 0 corrupted");
        assert!(
            out[off1..off1 + 1000] == msg[off1..off1 + 1000],
            "piece 1 corrupted"
        );
        assert!(rx.release().is_err(), "released a half-read direct slot");
        drop((data, ctrl));
        let e = wait_err(|| {
            let d = rx.direct().unwrap();
            // SAFETY: `out` is valid for `total` writes.
            unsafe { d.poll_read_remote(out.as_mut_ptr(), total) }.map(|_| ())
        });
        assert!(
            matches!(&e, CoreError::Peer { peer: 0, what, .. } if what.contains("connection lost")),
            "{e:?}"
        );
        assert!(rx.check_peer().is_err());
    }

    /// A sender that aborts in the middle of a direct payload: the receiver
    /// gets its reason, not "connection lost".
    #[test]
    fn sender_abort_during_a_direct_payload() {
        let t = lo();
        let (mut rx, mut data, mut ctrl) = raw_link(&t);
        let total = 300_000;
        let _ = half_direct(&mut data, total, 4096);
        let mut out = vec![0u8; total];
        assert!(!read_partly(&mut *rx, &mut out).unwrap());
        ctrl.write_all(&info::ctrl_frame(
            info::CtrlKind::Abort,
            0,
            b"rank 0 hit NaNs",
        ))
        .unwrap();
        drop((data, ctrl));
        let e = wait_err(|| {
            let d = rx.direct().unwrap();
            // SAFETY: `out` is valid for `total` writes.
            unsafe { d.poll_read_remote(out.as_mut_ptr(), total) }.map(|_| ())
        });
        assert!(
            matches!(&e, CoreError::PeerAborted { peer: 0, reason, .. } if reason.contains("NaNs")),
            "{e:?}"
        );
    }

    /// A receiver that aborts (or is dropped) in the middle of a direct
    /// payload stops promptly; its helpers waiting for the engine exit.
    #[test]
    fn receiver_abort_during_a_direct_payload() {
        let t = lo();
        let (mut rx, mut data, _ctrl) = raw_link(&t);
        let total = 200_000;
        let _ = half_direct(&mut data, total, 10);
        let mut out = vec![0u8; total];
        assert!(!read_partly(&mut *rx, &mut out).unwrap());
        rx.abort("enough");
        // SAFETY: `out` is valid for `total` writes.
        let r = unsafe {
            rx.direct()
                .unwrap()
                .poll_read_remote(out.as_mut_ptr(), total)
        };
        assert!(matches!(r, Err(CoreError::Aborted(_))), "{r:?}");
        let start = Instant::now();
        drop(rx);
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "drop took {:?}",
            start.elapsed()
        );

        let (mut rx, mut data, _ctrl) = raw_link(&t);
        let _ = half_direct(&mut data, total, 10);
        assert!(!read_partly(&mut *rx, &mut out).unwrap());
        let start = Instant::now();
        drop(rx);
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "drop took {:?}",
            start.elapsed()
        );
    }
}
