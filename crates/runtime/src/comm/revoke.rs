//! Revocation across ranks ([`Communicator::revoke`]).
//!
//! Every communicator listens on a socket of its own (its *door*, on the
//! address the other ranks reach its bootstrap at) for one kind of message:
//! "rank R revoked this communicator". One thread per process watches every
//! door, blocked in `poll` (no CPU while nothing arrives). A notice proven
//! with the communicator's secret sets the communicator's abort flag with
//! the reason, so every pending wait fails within its next check (at most a
//! few milliseconds) and every later operation fails at once: ranks that
//! are idle, or waiting on a rank other than the revoker, learn it too,
//! which the links' abort markers alone would not tell them.
//!
//! A notice is one frame on its own connection: magic `BRVK`, the sender's
//! rank, the reason's length (`u16`) and the reason, then
//! `SHA-256("braid-revoke" ‖ secret ‖ rank ‖ reason)`. Anything else, or a
//! connection that says nothing within [`READ_WINDOW`], is closed.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use sha2::{Digest, Sha256};

use super::Shared;

const MAGIC: &[u8; 4] = b"BRVK";
const LABEL: &[u8] = b"braid-revoke";
/// The longest reason a notice carries.
const MAX_REASON: usize = 1024;
/// A connection must deliver its notice within this.
const READ_WINDOW: Duration = Duration::from_secs(2);
/// Connections being read at once, at most (more are closed at once).
const MAX_OPEN: usize = 256;
/// How long a sender tries to reach one rank.
const SEND_WINDOW: Duration = Duration::from_millis(1500);

/// A communicator's door: registered with the watcher while it lives.
#[derive(Debug)]
pub(super) struct Door {
    id: u64,
    /// Where the other ranks send notices.
    pub addr: SocketAddr,
}

impl Door {
    /// Opens a door on `ip` (port 0) for the communicator `target`, whose
    /// notices are proven with `secret`.
    pub(super) fn open(
        ip: IpAddr,
        secret: [u8; 16],
        target: Weak<Shared>,
    ) -> std::io::Result<Door> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let w = watcher()?;
        let mut g = w
            .lock()
            .map_err(|_| std::io::Error::other("revoke watcher poisoned"))?;
        g.next_id += 1;
        let id = g.next_id;
        g.tx.send(Cmd::Add(Entry {
            id,
            listener,
            secret,
            target,
        }))
        .map_err(|_| std::io::Error::other("the revoke watcher thread is gone"))?;
        let _ = (&g.wake).write(&[1]);
        Ok(Door { id, addr })
    }
}

impl Drop for Door {
    fn drop(&mut self) {
        if let Some(Ok(g)) = WATCHER.get().map(|w| w.lock()) {
            if g.tx.send(Cmd::Remove(self.id)).is_ok() {
                let _ = (&g.wake).write(&[1]);
            }
        }
    }
}

/// The notice `from` sends: the frame described in the module docs.
pub(super) fn notice(secret: &[u8; 16], from: u32, reason: &str) -> Vec<u8> {
    let mut r = reason.as_bytes();
    if r.len() > MAX_REASON {
        let mut end = MAX_REASON;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        r = &r[..end];
    }
    let mut v = Vec::with_capacity(4 + 4 + 2 + r.len() + 32);
    v.extend_from_slice(MAGIC);
    v.extend_from_slice(&from.to_le_bytes());
    v.extend_from_slice(&(r.len() as u16).to_le_bytes());
    v.extend_from_slice(r);
    v.extend_from_slice(&mac(secret, from, r));
    v
}

fn mac(secret: &[u8; 16], from: u32, reason: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(LABEL);
    h.update(secret);
    h.update(from.to_le_bytes());
    h.update(reason);
    h.finalize().into()
}

/// What a notice says, once complete: `Ok(None)` while bytes are missing,
/// `Err` for anything that is not a proven notice.
pub(super) fn parse(buf: &[u8], secret: &[u8; 16]) -> Result<Option<(u32, String)>, ()> {
    if buf.len() < 10 {
        return if MAGIC.starts_with(&buf[..buf.len().min(4)]) {
            Ok(None)
        } else {
            Err(())
        };
    }
    if &buf[..4] != MAGIC {
        return Err(());
    }
    let from = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
    let n = u16::from_le_bytes([buf[8], buf[9]]) as usize;
    if n > MAX_REASON {
        return Err(());
    }
    let total = 10 + n + 32;
    if buf.len() < total {
        return Ok(None);
    }
    if buf.len() > total {
        return Err(());
    }
    let reason = &buf[10..10 + n];
    if !crate::bootstrap::ct_eq(&mac(secret, from, reason), &buf[10 + n..total]) {
        return Err(());
    }
    let text = String::from_utf8_lossy(reason).into_owned();
    Ok(Some((from, text)))
}

/// Sends `frame` to every address of `addrs`, several at a time, each
/// within [`SEND_WINDOW`]; the ranks it could not reach.
pub(super) fn send_all(addrs: &[(u32, SocketAddr)], frame: &[u8]) -> Vec<u32> {
    let failed = Mutex::new(Vec::new());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let workers = addrs.len().clamp(1, 16);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&(rank, addr)) = addrs.get(i) else {
                    break;
                };
                if send_one(addr, frame).is_err() {
                    if let Ok(mut f) = failed.lock() {
                        f.push(rank);
                    }
                }
            });
        }
    });
    let mut f = failed.into_inner().unwrap_or_default();
    f.sort_unstable();
    f
}

fn send_one(addr: SocketAddr, frame: &[u8]) -> std::io::Result<()> {
    let mut s = TcpStream::connect_timeout(&addr, SEND_WINDOW)?;
    s.set_write_timeout(Some(SEND_WINDOW))?;
    s.write_all(frame)?;
    s.flush()
}

enum Cmd {
    Add(Entry),
    Remove(u64),
}

struct Entry {
    id: u64,
    listener: TcpListener,
    secret: [u8; 16],
    target: Weak<Shared>,
}

/// A connection whose notice is arriving.
struct Arrival {
    door: u64,
    sock: TcpStream,
    buf: Vec<u8>,
    until: Instant,
}

struct Handle {
    tx: Sender<Cmd>,
    wake: UnixStream,
    next_id: u64,
}

static WATCHER: OnceLock<Mutex<Handle>> = OnceLock::new();

/// The process's watcher, started on first use.
fn watcher() -> std::io::Result<&'static Mutex<Handle>> {
    if let Some(w) = WATCHER.get() {
        return Ok(w);
    }
    let (wake, woken) = UnixStream::pair()?;
    wake.set_nonblocking(true)?;
    woken.set_nonblocking(true)?;
    let (tx, rx) = channel();
    let handle = Mutex::new(Handle {
        tx,
        wake,
        next_id: 0,
    });
    // A race with another first user: only one handle is kept, and the
    // other's thread ends when its channel's sender is dropped.
    if WATCHER.set(handle).is_ok() {
        std::thread::Builder::new()
            .name("braid-revoke".into())
            .spawn(move || watch(rx, woken))?;
    }
    WATCHER
        .get()
        .ok_or_else(|| std::io::Error::other("revoke watcher not set"))
}

/// The watcher's loop: doors and arriving notices, until every sender of
/// commands is gone.
fn watch(rx: Receiver<Cmd>, mut woken: UnixStream) {
    let mut doors: Vec<Entry> = Vec::new();
    let mut arrivals: Vec<Arrival> = Vec::new();
    loop {
        // Commands first (the wake byte says some may be waiting).
        let mut sink = [0u8; 64];
        while matches!(woken.read(&mut sink), Ok(n) if n > 0) {}
        loop {
            match rx.try_recv() {
                Ok(Cmd::Add(e)) => doors.push(e),
                Ok(Cmd::Remove(id)) => {
                    doors.retain(|d| d.id != id);
                    arrivals.retain(|a| a.door != id);
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
            }
        }
        let now = Instant::now();
        arrivals.retain(|a| a.until > now);
        let wait = arrivals
            .iter()
            .map(|a| a.until.saturating_duration_since(now))
            .min();
        let mut ready_doors = vec![false; doors.len()];
        let mut ready_arrivals = vec![false; arrivals.len()];
        {
            let mut fds = Vec::with_capacity(1 + doors.len() + arrivals.len());
            fds.push(PollFd::new(woken.as_fd(), PollFlags::POLLIN));
            fds.extend(
                doors
                    .iter()
                    .map(|d| PollFd::new(d.listener.as_fd(), PollFlags::POLLIN)),
            );
            fds.extend(
                arrivals
                    .iter()
                    .map(|a| PollFd::new(a.sock.as_fd(), PollFlags::POLLIN)),
            );
            let timeout = match wait {
                None => PollTimeout::NONE,
                Some(w) => crate::bootstrap::poll_ms(w),
            };
            match nix::poll::poll(&mut fds, timeout) {
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    // Not expected (the descriptors are ours); never spin.
                    tracing::warn!("braid: revoke watcher: poll failed ({e}); retrying in 100 ms");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            }
            let ready = |f: &PollFd<'_>| f.revents().is_some_and(|r| !r.is_empty());
            for (i, f) in fds[1..1 + doors.len()].iter().enumerate() {
                ready_doors[i] = ready(f);
            }
            for (i, f) in fds[1 + doors.len()..].iter().enumerate() {
                ready_arrivals[i] = ready(f);
            }
        }
        for (d, _) in doors.iter().zip(&ready_doors).filter(|(_, r)| **r) {
            while let Ok((sock, _)) = d.listener.accept() {
                if arrivals.len() >= MAX_OPEN || sock.set_nonblocking(true).is_err() {
                    continue;
                }
                arrivals.push(Arrival {
                    door: d.id,
                    sock,
                    buf: Vec::new(),
                    until: Instant::now() + READ_WINDOW,
                });
            }
        }
        let mut keep = Vec::with_capacity(arrivals.len());
        let old = std::mem::take(&mut arrivals);
        let n_old = ready_arrivals.len();
        for (i, mut a) in old.into_iter().enumerate() {
            // Arrivals accepted just now were not polled: read them too.
            if i < n_old && !ready_arrivals[i] {
                keep.push(a);
                continue;
            }
            let closed = match read_some(&mut a) {
                Got::Closed => true,
                Got::More => false,
                Got::Bad => continue,
            };
            let Some(door) = doors.iter().find(|d| d.id == a.door) else {
                continue;
            };
            match parse(&a.buf, &door.secret) {
                Ok(Some((from, reason))) => {
                    if let Some(sh) = door.target.upgrade() {
                        sh.revoked_by(from, &reason);
                    }
                }
                Ok(None) if !closed => keep.push(a),
                Ok(None) | Err(()) => {
                    tracing::debug!(
                        "braid: revoke door: closed a connection that sent no valid notice"
                    );
                }
            }
        }
        arrivals = keep;
    }
}

enum Got {
    /// The peer closed its end: what arrived is all there is.
    Closed,
    /// More may come.
    More,
    /// A socket error, or more bytes than any notice has.
    Bad,
}

/// Reads what has arrived without blocking.
fn read_some(a: &mut Arrival) -> Got {
    let mut b = [0u8; 2048];
    loop {
        match a.sock.read(&mut b) {
            Ok(0) => return Got::Closed,
            Ok(n) => {
                a.buf.extend_from_slice(&b[..n]);
                if a.buf.len() > 10 + MAX_REASON + 32 {
                    return Got::Bad;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Got::More,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return Got::Bad,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_parse_only_with_the_secret() {
        let s = [7u8; 16];
        let f = notice(&s, 3, "stop");
        assert_eq!(parse(&f, &s), Ok(Some((3, "stop".to_string()))));
        assert_eq!(parse(&f, &[8u8; 16]), Err(()));
        for cut in 0..f.len() {
            assert_eq!(parse(&f[..cut], &s), Ok(None), "prefix of {cut} bytes");
        }
        let mut longer = f.clone();
        longer.push(0);
        assert_eq!(parse(&longer, &s), Err(()));
        let mut flipped = f.clone();
        flipped[11] ^= 1;
        assert_eq!(parse(&flipped, &s), Err(()));
        assert_eq!(parse(b"GET / HTTP/1.1\r\n", &s), Err(()));
        let long = "x".repeat(5000);
        let f = notice(&s, 1, &long);
        assert_eq!(parse(&f, &s), Ok(Some((1, "x".repeat(MAX_REASON)))));
    }
}
