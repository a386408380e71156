//! The control socket: credits, abort and close frames written without
//! blocking ([`CtrlOut`]), and read as they arrive ([`CtrlIn`], fed by the
//! progress thread or by the engine inline).

use std::io::{self, IoSlice};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{MsgFlags, SockaddrStorage};

use super::health::{Fail, Health};
use crate::info::{ctrl_decode, ctrl_frame, CtrlKind, CTRL_LEN};

fn errno_io(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// Writes all of `parts` (resuming `skip` bytes in) with `sendmsg`;
/// `MSG_NOSIGNAL` so a closed peer is an error, never SIGPIPE; never
/// blocks: returns how far it got when the socket buffer is full.
fn send_parts(sock: &TcpStream, parts: &[&[u8]], mut skip: usize) -> io::Result<usize> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let flags = MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT;
    while skip < total {
        let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(parts.len());
        let mut s = skip;
        for p in parts {
            if s >= p.len() {
                s -= p.len();
            } else {
                iov.push(IoSlice::new(&p[s..]));
                s = 0;
            }
        }
        match nix::sys::socket::sendmsg::<SockaddrStorage>(sock.as_raw_fd(), &iov, &[], flags, None)
        {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "socket accepted no bytes",
                ))
            }
            Ok(n) => skip += n,
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN) => return Ok(skip),
            Err(e) => return Err(errno_io(e)),
        }
    }
    Ok(skip)
}

/// Control-socket output, written without blocking.
#[derive(Debug)]
pub(super) struct CtrlOut {
    pub(super) pending: Vec<u8>,
    /// A credit is owed but could not be queued yet (cumulative, so only the
    /// latest value matters).
    pub(super) credit_owed: Option<u64>,
}

impl CtrlOut {
    pub(super) fn new() -> CtrlOut {
        CtrlOut {
            pending: Vec::new(),
            credit_owed: None,
        }
    }

    /// Sends what is pending on `sock`; `Err` on a broken socket.
    pub(super) fn flush(&mut self, sock: &TcpStream) -> io::Result<()> {
        loop {
            if self.pending.is_empty() {
                match self.credit_owed.take() {
                    Some(v) => self.pending = ctrl_frame(CtrlKind::Credit, v, &[]),
                    None => return Ok(()),
                }
            }
            let n = send_parts(sock, &[&self.pending], 0)?;
            self.pending.drain(..n);
            if !self.pending.is_empty() {
                // The socket buffer is full: the next writable edge (the
                // progress thread) or call sends the rest.
                return Ok(());
            }
        }
    }

    pub(super) fn credit(&mut self, sock: &TcpStream, released: u64) -> io::Result<()> {
        self.credit_owed = Some(released);
        self.flush(sock)
    }

    /// Best effort: queue an abort or close frame behind what is pending and
    /// try to send it now; never blocks for long (50 ms at most).
    pub(super) fn goodbye(&mut self, sock: &TcpStream, kind: CtrlKind, reason: &str) {
        let _ = self.flush(sock);
        self.credit_owed = None;
        self.pending.extend(ctrl_frame(kind, 0, reason.as_bytes()));
        let _ = self.flush(sock);
        if !self.pending.is_empty() {
            // Give a busy socket a moment, never long.
            let until = Instant::now() + Duration::from_millis(50);
            while !self.pending.is_empty() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
                if self.flush(sock).is_err() {
                    break;
                }
            }
        }
    }
}

/// Checks a credit (cumulative slots released) against what this end
/// committed and what was released before.
pub(super) fn check_credit(v: u64, old: u64, committed: u64) -> std::result::Result<(), String> {
    if v < old || v > committed {
        return Err(format!(
            "credit for {v} slots released, but {committed} were committed and {old} already released"
        ));
    }
    Ok(())
}

/// Control frames as they arrive: fed whatever the socket has, handles the
/// complete ones, and finishes at the peer's abort or close, the end of the
/// stream, or a failure (then it tells `health`: [`Health::ctrl_finished`]).
#[derive(Debug, Default)]
pub(super) struct CtrlIn {
    buf: Vec<u8>,
    done: bool,
    /// A resume waits for the peer's [`CtrlKind::Resync`]: the frames
    /// before it (credits, an abort, from the old link) are skipped.
    seeking: bool,
    /// The peer's resync once it came: its value and payload.
    resynced: Option<(u64, Vec<u8>)>,
    /// The peer's resync came before this end resumed: what follows it is
    /// the new link's, read only once this end resumes too.
    held: bool,
}

impl CtrlIn {
    /// Whether nothing more is read (for now: a resync that came early
    /// holds the rest until this end resumes).
    pub(super) fn done(&self) -> bool {
        self.done || self.held
    }

    /// Starts reading again for a resume after an abort (the peer's abort
    /// stopped the reading, its later bytes kept), skipping every frame up
    /// to the peer's resync, unless it came already.
    pub(super) fn seek_resync(&mut self) {
        self.done = false;
        if self.held {
            self.held = false;
            self.seeking = false;
        } else {
            self.resynced = None;
            self.seeking = true;
        }
    }

    /// The peer's resync (value and payload), once it came; taken.
    pub(super) fn take_resynced(&mut self) -> Option<(u64, Vec<u8>)> {
        if self.seeking {
            return None;
        }
        self.resynced.take()
    }

    /// Reads with `read` until it would block (or the stream ends) and
    /// handles every complete frame: credits through `on_credit` (the
    /// sender's end; on the receiver's end a credit is a protocol error),
    /// aborts and closes into `health`. `closed_is_failure`: a close from
    /// the peer fails the link (the sender's end: a receiver that closed
    /// takes no more data).
    pub(super) fn pump(
        &mut self,
        read: &mut dyn FnMut(&mut [u8]) -> io::Result<usize>,
        health: &Health,
        mut on_credit: Option<&mut dyn FnMut(u64) -> std::result::Result<(), String>>,
        closed_is_failure: bool,
    ) {
        let mut chunk = [0u8; 1024];
        while !self.done() {
            // Handle complete frames first.
            while self.buf.len() >= CTRL_LEN && !self.done() {
                let mut hdr = [0u8; CTRL_LEN];
                hdr.copy_from_slice(&self.buf[..CTRL_LEN]);
                let (kind, len, value) = match ctrl_decode(&hdr) {
                    Ok(x) => x,
                    Err(e) => {
                        if !health.local_closing.load(Ordering::Acquire) {
                            health.fail(Fail::Protocol(format!("control socket: {e}")));
                        }
                        return self.finish(health);
                    }
                };
                if self.buf.len() < CTRL_LEN + len {
                    break;
                }
                let payload: Vec<u8> = self.buf[CTRL_LEN..CTRL_LEN + len].to_vec();
                self.buf.drain(..CTRL_LEN + len);
                if self.seeking {
                    match kind {
                        CtrlKind::Resync => {
                            self.seeking = false;
                            self.resynced = Some((value, payload));
                            health.ring();
                        }
                        CtrlKind::Close => {
                            health.fail(Fail::PeerAborted(
                                "the peer closed its end instead of resuming the link".into(),
                            ));
                            return self.finish(health);
                        }
                        // The old link's credits and abort.
                        CtrlKind::Credit | CtrlKind::Abort => {}
                    }
                    continue;
                }
                match kind {
                    CtrlKind::Credit => match on_credit.as_mut() {
                        Some(f) => {
                            if let Err(e) = f(value) {
                                health.fail(Fail::Protocol(e));
                                return self.finish(health);
                            }
                        }
                        None => {
                            health.fail(Fail::Protocol("the sender sent a credit".into()));
                            return self.finish(health);
                        }
                    },
                    CtrlKind::Abort => {
                        let reason = String::from_utf8_lossy(&payload).into_owned();
                        health.fail(Fail::PeerAborted(if reason.is_empty() {
                            "aborted (no reason given)".into()
                        } else {
                            reason
                        }));
                        // What follows stays for a resume ([`CtrlIn::seek_resync`]).
                        self.done = true;
                        health.ctrl_finished();
                        return;
                    }
                    CtrlKind::Resync => {
                        // The peer resumed first: the rest waits for ours.
                        self.resynced = Some((value, payload));
                        self.held = true;
                        return;
                    }
                    CtrlKind::Close => {
                        health.peer_closed.store(true, Ordering::Release);
                        if closed_is_failure {
                            health.fail(Fail::PeerAborted("the receiver closed its end".into()));
                        }
                        return self.finish(health);
                    }
                }
            }
            if self.done() {
                break;
            }
            let closing = health.local_closing.load(Ordering::Acquire)
                || health.peer_closed.load(Ordering::Acquire);
            match read(&mut chunk) {
                Ok(0) => {
                    if !closing {
                        if self.buf.is_empty() {
                            health.fail(Fail::Lost {
                                what: "the control socket was closed (peer process exited?)".into(),
                                kind: io::ErrorKind::UnexpectedEof,
                                cause: "end of stream".into(),
                            });
                        } else {
                            health.fail(Fail::Lost {
                                what: "control socket".into(),
                                kind: io::ErrorKind::UnexpectedEof,
                                cause: "the peer closed the socket in the middle of a frame".into(),
                            });
                        }
                    }
                    return self.finish(health);
                }
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    if !closing {
                        health.lost("control socket", &e);
                    }
                    return self.finish(health);
                }
            }
        }
    }

    fn finish(&mut self, health: &Health) {
        self.done = true;
        self.held = false;
        self.buf = Vec::new();
        health.ctrl_finished();
    }
}
