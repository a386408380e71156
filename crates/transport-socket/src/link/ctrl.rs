//! The control socket: credits, abort and close frames written by the API
//! thread without blocking ([`CtrlOut`]), and the helper that reads them
//! ([`ctrl_reader`]).

use std::io::{self, BufReader, IoSlice, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{MsgFlags, SockaddrStorage};

use super::health::{Fail, Health};
use super::read_full;
use crate::info::{ctrl_decode, ctrl_frame, CtrlKind, CTRL_LEN};

fn is_retry(e: Errno) -> bool {
    e == Errno::EINTR
}

fn errno_io(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// Writes all of `parts` (resuming `skip` bytes in) with `sendmsg`;
/// `MSG_NOSIGNAL` so a closed peer is an error, never SIGPIPE. With
/// `dontwait`, returns how far it got when the socket buffer is full.
fn send_parts(
    sock: &TcpStream,
    parts: &[&[u8]],
    mut skip: usize,
    dontwait: bool,
) -> io::Result<usize> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut flags = MsgFlags::MSG_NOSIGNAL;
    if dontwait {
        flags |= MsgFlags::MSG_DONTWAIT;
    }
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
            Err(e) if is_retry(e) => {}
            Err(Errno::EAGAIN) if dontwait => return Ok(skip),
            Err(e) => return Err(errno_io(e)),
        }
    }
    Ok(skip)
}

/// Control-socket output of the API thread, written without blocking.
#[derive(Debug)]
pub(super) struct CtrlOut {
    pub(super) sock: TcpStream,
    pub(super) pending: Vec<u8>,
    /// A credit is owed but could not be queued yet (cumulative, so only the
    /// latest value matters).
    pub(super) credit_owed: Option<u64>,
}

impl CtrlOut {
    /// Sends what is pending; `Err` on a broken socket.
    pub(super) fn flush(&mut self) -> io::Result<()> {
        loop {
            if self.pending.is_empty() {
                match self.credit_owed.take() {
                    Some(v) => self.pending = ctrl_frame(CtrlKind::Credit, v, &[]),
                    None => return Ok(()),
                }
            }
            let n = send_parts(&self.sock, &[&self.pending], 0, true)?;
            self.pending.drain(..n);
            if !self.pending.is_empty() {
                return Ok(()); // socket buffer full; try again later
            }
        }
    }

    pub(super) fn credit(&mut self, released: u64) -> io::Result<()> {
        self.credit_owed = Some(released);
        self.flush()
    }

    /// Best effort: queue an abort or close frame behind what is pending and
    /// try to send it now; never blocks.
    pub(super) fn goodbye(&mut self, kind: CtrlKind, reason: &str) {
        let _ = self.flush();
        self.credit_owed = None;
        self.pending.extend(ctrl_frame(kind, 0, reason.as_bytes()));
        let _ = self.flush();
        if !self.pending.is_empty() {
            // Give a busy socket a moment, never long.
            let until = Instant::now() + Duration::from_millis(50);
            while !self.pending.is_empty() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
                if self.flush().is_err() {
                    break;
                }
            }
        }
    }
}

/// Handles a credit on the sender's control reader.
pub(super) type OnCredit = Box<dyn FnMut(u64) -> std::result::Result<(), String> + Send>;

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

/// Reads control frames until the peer aborts, closes, or the socket fails.
/// `on_credit` handles credits (the sender's end); on the receiver's end a
/// credit is a protocol error.
pub(super) fn ctrl_reader<R: Read>(
    sock: R,
    health: Arc<Health>,
    mut on_credit: Option<OnCredit>,
    closed_is_failure: bool,
) {
    let mut r = BufReader::with_capacity(4096, sock);
    loop {
        let mut hdr = [0u8; CTRL_LEN];
        let res = read_full(&mut r, &mut hdr).and_then(|more| {
            if !more {
                return Ok(None);
            }
            let (kind, len, value) =
                ctrl_decode(&hdr).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            let mut payload = vec![0u8; len];
            if len > 0 && !read_full(&mut r, &mut payload)? {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            Ok(Some((kind, value, payload)))
        });
        let closing = health.local_closing.load(Ordering::Acquire);
        match res {
            Ok(Some((CtrlKind::Credit, v, _))) => match on_credit.as_mut() {
                Some(f) => {
                    if let Err(e) = f(v) {
                        health.fail(Fail::Protocol(e));
                        break;
                    }
                }
                None => {
                    health.fail(Fail::Protocol("the sender sent a credit".into()));
                    break;
                }
            },
            Ok(Some((CtrlKind::Abort, _, reason))) => {
                let reason = String::from_utf8_lossy(&reason).into_owned();
                health.fail(Fail::PeerAborted(if reason.is_empty() {
                    "aborted (no reason given)".into()
                } else {
                    reason
                }));
                break;
            }
            Ok(Some((CtrlKind::Close, _, _))) => {
                health.peer_closed.store(true, Ordering::Release);
                if closed_is_failure {
                    health.fail(Fail::PeerAborted("the receiver closed its end".into()));
                }
                break;
            }
            Ok(None) => {
                if !closing && !health.peer_closed.load(Ordering::Acquire) {
                    health.fail(Fail::Lost {
                        what: "the control socket was closed (peer process exited?)".into(),
                        kind: io::ErrorKind::UnexpectedEof,
                        cause: "end of stream".into(),
                    });
                }
                break;
            }
            Err(e) => {
                if !closing && !health.peer_closed.load(Ordering::Acquire) {
                    if e.kind() == io::ErrorKind::InvalidData {
                        health.fail(Fail::Protocol(format!("control socket: {e}")));
                    } else {
                        health.lost("control socket", &e);
                    }
                }
                break;
            }
        }
    }
    health.ctrl_finished();
}
