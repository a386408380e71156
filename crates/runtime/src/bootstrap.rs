//! Bootstrap: the rendezvous of all ranks through a root over TCP.
//!
//! A [`UniqueId`] is the root's address plus a random 128-bit secret. One
//! process (usually rank 0) hosts a [`RootServer`]; every rank, rank 0
//! included, calls [`Bootstrap::connect`] with the same id, its rank, the
//! number of ranks and a payload (typically its connect-info blob). The root
//! waits until all ranks arrived and sends every rank all payloads in rank
//! order. Later rounds ([`Bootstrap::allgather`], [`Bootstrap::barrier`]) go
//! through the root as well (a star).
//!
//! # Protocol
//!
//! Every message is a frame: a big-endian `u32` length `n` (at most
//! [`MAX_FRAME`]), then `n` bytes: one kind byte and the body.
//!
//! 1. root → client `CHALLENGE`: magic, protocol version, 32-byte nonce.
//! 2. client → root `HELLO`: magic, version, rank, nranks, the client's
//!    nonce, `SHA-256("braid-bootstrap-client" ‖ secret ‖ root nonce ‖
//!    client nonce ‖ rank ‖ nranks)`, payload. The secret itself never
//!    travels.
//! 3. root → client `ACCEPT` with `SHA-256("braid-bootstrap-root" ‖ secret ‖
//!    client nonce ‖ root nonce ‖ rank)`, so the client knows the root holds
//!    the secret too; or `ERROR` with a message.
//! 4. root → client: `nranks` `DATA` frames (round, rank, bytes) in rank
//!    order, once all ranks joined (round 0) and after every later round.
//! 5. client → root `CONTRIB` (round, bytes) for rounds 1, 2, ...
//!
//! The root sends an `ERROR` frame to every connected rank before it gives
//! up (ranks that disagree on nranks, a rank that joined twice, ranks missing
//! at the deadline, a rank that left), so no rank waits for nothing.
//! Connections that fail the handshake (garbage, oversized frames, a wrong
//! secret) are dropped and logged; they never count as ranks.
//!
//! Every wait has a deadline: the `timeout` given to [`RootServer::spawn`]
//! and [`Bootstrap::connect`]. Between rounds the root waits without a
//! deadline (the ranks may compute for as long as they like); it ends as
//! soon as a rank disconnects.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Largest payload one rank may contribute to one round (16 MiB).
pub const MAX_PAYLOAD: usize = 16 << 20;
/// Largest frame on the wire: a payload plus its headers.
pub const MAX_FRAME: usize = MAX_PAYLOAD + 256;
/// Largest number of ranks a bootstrap accepts.
pub const MAX_RANKS: u32 = 1 << 22;

const MAGIC: [u8; 8] = *b"BRAIDBS\x01";
const VERSION: u32 = 1;
const NONCE_LEN: usize = 32;
const MAC_LEN: usize = 32;
const MAX_PENDING: usize = 1024;
const READ_CHUNK: usize = 256 << 10;

/// Timeouts are capped at a year so that deadlines never overflow.
const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

const K_CHALLENGE: u8 = 1;
const K_HELLO: u8 = 2;
const K_ACCEPT: u8 = 3;
const K_ERROR: u8 = 4;
const K_DATA: u8 = 5;
const K_CONTRIB: u8 = 6;

// ---------------------------------------------------------------------------
// UniqueId

/// Where the bootstrap root listens and the secret every rank must prove.
///
/// Text form (`Display`/`FromStr`): `<socketaddr>/<32 lowercase hex>`, e.g.
/// `127.0.0.1:29500/00112233445566778899aabbccddeeff` or
/// `[::1]:29500/00112233445566778899aabbccddeeff`.
///
/// `Debug` does not print the secret.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId {
    /// The root's address.
    pub addr: SocketAddr,
    /// The shared secret.
    pub secret: [u8; 16],
}

impl UniqueId {
    /// A new id for a root at `addr` with a random secret from the OS.
    pub fn generate(addr: SocketAddr) -> Result<UniqueId> {
        Ok(UniqueId {
            addr,
            secret: random_bytes()?,
        })
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UniqueId")
            .field("addr", &self.addr)
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, to_hex(&self.secret))
    }
}

impl FromStr for UniqueId {
    type Err = Error;

    fn from_str(s: &str) -> Result<UniqueId> {
        let bad = |why: &str| {
            Error::InvalidArgument(format!(
                "invalid unique id {s:?}: {why}; expected <ip>:<port>/<32 hex digits>, \
                 e.g. 127.0.0.1:29500/00112233445566778899aabbccddeeff or \
                 [::1]:29500/00112233445566778899aabbccddeeff"
            ))
        };
        let s_trim = s.trim();
        let (addr, secret) = s_trim
            .rsplit_once('/')
            .ok_or_else(|| bad("no '/' between address and secret"))?;
        let addr: SocketAddr = addr
            .parse()
            .map_err(|_| bad("the address is not <ip>:<port>"))?;
        let secret =
            parse_secret_hex(secret).ok_or_else(|| bad("the secret is not 32 hex digits"))?;
        Ok(UniqueId { addr, secret })
    }
}

/// Parses exactly 32 hex digits into a 16-byte secret.
pub(crate) fn parse_secret_hex(s: &str) -> Option<[u8; 16]> {
    let b = s.as_bytes();
    if b.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let hi = hex_val(b[2 * i])?;
        let lo = hex_val(b[2 * i + 1])?;
        *o = (hi << 4) | lo;
    }
    Some(out)
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

pub(crate) fn to_hex(b: &[u8]) -> String {
    const H: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(H[(x >> 4) as usize] as char);
        s.push(H[(x & 15) as usize] as char);
    }
    s
}

fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b)
        .map_err(|e| Error::Bootstrap(format!("cannot get random bytes from the OS: {e}")))?;
    Ok(b)
}

// ---------------------------------------------------------------------------
// Small helpers

/// Formats a duration for messages: `5s`, `2.5s`, `300ms`.
pub(crate) fn fmt_dur(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d < Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else {
        let s = format!("{:.3}", d.as_secs_f64());
        format!("{}s", s.trim_end_matches('0').trim_end_matches('.'))
    }
}

/// `rank 3`, `ranks 1, 3`, `ranks 0-7, 9` (runs of three or more collapse).
fn fmt_ranks(ranks: &[u32]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        if j >= i + 2 {
            parts.push(format!("{}-{}", ranks[i], ranks[j]));
        } else {
            for r in &ranks[i..=j] {
                parts.push(r.to_string());
            }
        }
        i = j + 1;
    }
    let word = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{word} {}", parts.join(", "))
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn client_mac(
    secret: &[u8; 16],
    root_nonce: &[u8],
    client_nonce: &[u8],
    rank: u32,
    nranks: u32,
) -> [u8; MAC_LEN] {
    let mut h = Sha256::new();
    h.update(b"braid-bootstrap-client");
    h.update(secret);
    h.update(root_nonce);
    h.update(client_nonce);
    h.update(rank.to_be_bytes());
    h.update(nranks.to_be_bytes());
    h.finalize().into()
}

fn root_mac(secret: &[u8; 16], client_nonce: &[u8], root_nonce: &[u8], rank: u32) -> [u8; MAC_LEN] {
    let mut h = Sha256::new();
    h.update(b"braid-bootstrap-root");
    h.update(secret);
    h.update(client_nonce);
    h.update(root_nonce);
    h.update(rank.to_be_bytes());
    h.finalize().into()
}

fn frame_header(kind: u8, body_len: usize) -> [u8; 5] {
    // body_len is bounded by MAX_FRAME at every call site.
    let n = (body_len + 1) as u32;
    let b = n.to_be_bytes();
    [b[0], b[1], b[2], b[3], kind]
}

fn be_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn be_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn remaining(deadline: Instant) -> Option<Duration> {
    let r = deadline.saturating_duration_since(Instant::now());
    (!r.is_zero()).then_some(r)
}

fn poll_ms(d: Duration) -> PollTimeout {
    let ms = d.as_millis().saturating_add(1).min(i32::MAX as u128) as i32;
    PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
}

/// Extra time a client waits for the root's verdict beyond its own timeout,
/// so that the root's message (which names the ranks concerned) arrives
/// before the client gives up with a vaguer one.
fn grace(timeout: Duration) -> Duration {
    (timeout / 10).clamp(Duration::from_millis(50), Duration::from_secs(2))
}

// ---------------------------------------------------------------------------
// Nonblocking I/O for the root

/// Writes all of `bufs` to a nonblocking stream, polling for writability
/// until `deadline`.
fn write_all_nb(stream: &TcpStream, bufs: &[&[u8]], deadline: Instant) -> io::Result<()> {
    let mut s = stream;
    for buf in bufs {
        let mut off = 0;
        while off < buf.len() {
            match s.write(&buf[off..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => off += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let Some(left) = remaining(deadline) else {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "timed out writing to the peer",
                        ));
                    };
                    let mut fds = [PollFd::new(stream.as_fd(), PollFlags::POLLOUT)];
                    match nix::poll::poll(&mut fds, poll_ms(left)) {
                        Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// Accumulates bytes of one connection and cuts them into frames.
#[derive(Debug, Default)]
struct FrameBuf {
    buf: Vec<u8>,
}

enum Fill {
    Data,
    Nothing,
    Eof,
}

impl FrameBuf {
    /// One nonblocking read of at most `READ_CHUNK` bytes.
    fn fill(&mut self, stream: &TcpStream, chunk: &mut [u8]) -> io::Result<Fill> {
        let mut s = stream;
        loop {
            match s.read(chunk) {
                Ok(0) => return Ok(Fill::Eof),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return Ok(Fill::Data);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Fill::Nothing),
                Err(e) => return Err(e),
            }
        }
    }

    /// The next complete frame `(kind, body)`, or an error for a malformed
    /// length.
    fn next_frame(&mut self) -> std::result::Result<Option<(u8, Vec<u8>)>, String> {
        let Some(n) = be_u32(&self.buf, 0) else {
            return Ok(None);
        };
        let n = n as usize;
        if n == 0 {
            return Err("empty frame".into());
        }
        if n > MAX_FRAME {
            return Err(format!(
                "frame of {n} bytes exceeds the limit of {MAX_FRAME} bytes"
            ));
        }
        if self.buf.len() < 4 + n {
            return Ok(None);
        }
        let kind = self.buf[4];
        let body = self.buf[5..4 + n].to_vec();
        self.buf.drain(..4 + n);
        Ok(Some((kind, body)))
    }
}

/// Reads whatever is pending (so that closing sends FIN rather than RST and
/// the peer can still read our last frame), then closes.
fn close_gently(stream: TcpStream) {
    let _ = stream.set_nonblocking(true);
    let _ = stream.shutdown(Shutdown::Write);
    let mut s = &stream;
    let mut sink = [0u8; 4096];
    for _ in 0..256 {
        match s.read(&mut sink) {
            Ok(n) if n > 0 => {}
            _ => break,
        }
    }
}

/// The root's `CHALLENGE` frame.
fn challenge_frame(nonce: &[u8; NONCE_LEN]) -> Vec<u8> {
    let mut v = frame_header(K_CHALLENGE, 8 + 4 + NONCE_LEN).to_vec();
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&VERSION.to_be_bytes());
    v.extend_from_slice(nonce);
    v
}

/// The root's `ACCEPT` frame with its proof.
fn accept_frame(proof: &[u8; MAC_LEN]) -> Vec<u8> {
    let mut v = frame_header(K_ACCEPT, MAC_LEN).to_vec();
    v.extend_from_slice(proof);
    v
}

/// Frame header and fixed fields of a `DATA` frame; `len` bytes of data follow.
fn data_header(round: u64, src: u32, len: usize) -> Vec<u8> {
    let mut v = frame_header(K_DATA, 12 + len).to_vec();
    v.extend_from_slice(&round.to_be_bytes());
    v.extend_from_slice(&src.to_be_bytes());
    v
}

/// Frame header and round of a `CONTRIB` frame; `len` bytes of data follow.
fn contrib_header(round: u64, len: usize) -> Vec<u8> {
    let mut v = frame_header(K_CONTRIB, 8 + len).to_vec();
    v.extend_from_slice(&round.to_be_bytes());
    v
}

/// Frame header of a `HELLO` frame whose payload has `payload_len` bytes;
/// the fixed part ([`HelloFixed::encode`]) and the payload follow.
fn hello_header(payload_len: usize) -> [u8; 5] {
    frame_header(K_HELLO, HELLO_FIXED + payload_len)
}

fn error_frame_bytes(msg: &str) -> Vec<u8> {
    let mut m = msg.as_bytes();
    if m.len() > 64 << 10 {
        m = &m[..64 << 10];
    }
    let mut v = frame_header(K_ERROR, m.len()).to_vec();
    v.extend_from_slice(m);
    v
}

// ---------------------------------------------------------------------------
// Message decoders (pure: the root and the client call them on what arrived,
// and the fuzz targets call them on anything)

/// Bytes of a hello's fixed part: magic, version, rank, nranks, the client's
/// nonce and its MAC. The payload follows.
const HELLO_FIXED: usize = 8 + 4 + 4 + 4 + NONCE_LEN + MAC_LEN;
/// Bytes of a connection's first frame the root reads before it has checked
/// the proof of the secret: length, kind and the hello's fixed part. A
/// stranger cannot make the root buffer more than this.
const HELLO_PREFIX: usize = 5 + HELLO_FIXED;

/// Why a hello was refused before its proof was checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum HelloError {
    /// A frame length of 0 or over [`MAX_FRAME`].
    Length(usize),
    /// Another kind of frame, or too short to be one.
    NotHello,
    /// The magic is not braid's.
    Magic,
    /// Another protocol version (the rank should be told).
    Version(u32),
    /// Shorter than a hello's fixed part.
    Truncated,
}

/// The fixed part of a hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HelloFixed {
    pub rank: u32,
    pub nranks: u32,
    pub cnonce: [u8; NONCE_LEN],
    pub mac: [u8; MAC_LEN],
}

impl HelloFixed {
    /// Whether the MAC proves the secret for the root's `nonce`.
    pub fn proves(&self, secret: &[u8; 16], root_nonce: &[u8; NONCE_LEN]) -> bool {
        let expect = client_mac(secret, root_nonce, &self.cnonce, self.rank, self.nranks);
        ct_eq(&self.mac, &expect)
    }

    /// The hello's fixed part on the wire (the payload follows it).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(HELLO_FIXED);
        v.extend_from_slice(&MAGIC);
        v.extend_from_slice(&VERSION.to_be_bytes());
        v.extend_from_slice(&self.rank.to_be_bytes());
        v.extend_from_slice(&self.nranks.to_be_bytes());
        v.extend_from_slice(&self.cnonce);
        v.extend_from_slice(&self.mac);
        v
    }
}

/// Decodes what is known of a hello: `kind` and the announced body length
/// `body_len` of its frame and the first bytes of its body, `avail` (at most
/// `body_len`). `Ok(None)`: not enough bytes yet to decide. Checks go in the
/// order in which their bytes arrive, so a prefix is refused exactly when
/// the whole frame would be.
fn hello_fixed(
    kind: u8,
    body_len: usize,
    avail: &[u8],
) -> std::result::Result<Option<HelloFixed>, HelloError> {
    if kind != K_HELLO || body_len < 12 {
        return Err(HelloError::NotHello);
    }
    let Some(head) = avail.get(..12) else {
        return Ok(None);
    };
    if head[..8] != MAGIC {
        return Err(HelloError::Magic);
    }
    let version = be_u32(head, 8).unwrap_or(0);
    if version != VERSION {
        return Err(HelloError::Version(version));
    }
    if body_len < HELLO_FIXED {
        return Err(HelloError::Truncated);
    }
    let Some(b) = avail.get(..HELLO_FIXED) else {
        return Ok(None);
    };
    let (Some(rank), Some(nranks)) = (be_u32(b, 12), be_u32(b, 16)) else {
        return Err(HelloError::Truncated);
    };
    let mut cnonce = [0u8; NONCE_LEN];
    cnonce.copy_from_slice(&b[20..20 + NONCE_LEN]);
    let mut mac = [0u8; MAC_LEN];
    mac.copy_from_slice(&b[20 + NONCE_LEN..HELLO_FIXED]);
    Ok(Some(HelloFixed {
        rank,
        nranks,
        cnonce,
        mac,
    }))
}

/// Decodes the start of a connection's byte stream as a hello frame, as far
/// as the bytes go (at most [`HELLO_PREFIX`] of them matter).
pub(crate) fn hello_prefix(buf: &[u8]) -> std::result::Result<Option<HelloFixed>, HelloError> {
    let Some(n) = be_u32(buf, 0) else {
        return Ok(None);
    };
    let n = n as usize;
    if n == 0 || n > MAX_FRAME {
        return Err(HelloError::Length(n));
    }
    let Some(&kind) = buf.get(4) else {
        return Ok(None);
    };
    let end = buf.len().min(4 + n);
    hello_fixed(kind, n - 1, &buf[5..end])
}

/// Decodes a complete hello frame: its fixed part and the payload.
pub(crate) fn parse_hello(
    kind: u8,
    body: &[u8],
) -> std::result::Result<(HelloFixed, &[u8]), HelloError> {
    match hello_fixed(kind, body.len(), body)? {
        Some(h) => Ok((h, &body[HELLO_FIXED..])),
        // Unreachable: all `body.len()` bytes are there.
        None => Err(HelloError::Truncated),
    }
}

/// Decodes a `CONTRIB` body: `(round, data)`.
pub(crate) fn parse_contrib(body: &[u8]) -> Option<(u64, &[u8])> {
    Some((be_u64(body, 0)?, body.get(8..)?))
}

/// Why the root's challenge was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ChallengeError {
    /// Not a braid challenge.
    NotBraid,
    /// A braid root of another protocol version.
    Version(u32),
}

/// Decodes the root's challenge: its nonce.
pub(crate) fn parse_challenge(
    kind: u8,
    body: &[u8],
) -> std::result::Result<[u8; NONCE_LEN], ChallengeError> {
    if kind != K_CHALLENGE || body.len() != 8 + 4 + NONCE_LEN || body[..8] != MAGIC {
        return Err(ChallengeError::NotBraid);
    }
    let version = be_u32(body, 8).unwrap_or(0);
    if version != VERSION {
        return Err(ChallengeError::Version(version));
    }
    let mut nonce = [0u8; NONCE_LEN];
    nonce.copy_from_slice(&body[12..]);
    Ok(nonce)
}

/// Checks one `DATA` frame of round `round` that must come from rank `want`;
/// returns its data, or what arrived instead.
pub(crate) fn parse_data(
    kind: u8,
    body: &[u8],
    round: u64,
    want: u32,
) -> std::result::Result<&[u8], String> {
    let (Some(r), Some(src)) = (be_u64(body, 0), be_u32(body, 8)) else {
        return Err("a truncated data message".into());
    };
    if kind != K_DATA || r != round || src != want {
        return Err(format!(
            "kind {kind} round {r} rank {src}, expected round {round} rank {want}"
        ));
    }
    Ok(&body[12..])
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(crate) enum FrameError {
    /// The stream failed (or ended).
    Io(io::Error),
    /// A length of 0 or over [`MAX_FRAME`].
    Length(usize),
}

/// Reads one frame `(kind, body)` with `read_exact`. The length is checked
/// before anything is allocated, and the body is read in chunks of at most
/// [`READ_CHUNK`], so a peer that announces a large frame and sends less
/// costs at most what it sent.
pub(crate) fn read_frame_with(
    mut read_exact: impl FnMut(&mut [u8]) -> io::Result<()>,
) -> std::result::Result<(u8, Vec<u8>), FrameError> {
    let mut len = [0u8; 4];
    read_exact(&mut len).map_err(FrameError::Io)?;
    let n = u32::from_be_bytes(len) as usize;
    if n == 0 || n > MAX_FRAME {
        return Err(FrameError::Length(n));
    }
    let mut kind = [0u8; 1];
    read_exact(&mut kind).map_err(FrameError::Io)?;
    let n = n - 1;
    let mut body = Vec::with_capacity(n.min(READ_CHUNK));
    let mut chunk = vec![0u8; n.min(READ_CHUNK)];
    while body.len() < n {
        let k = (n - body.len()).min(chunk.len());
        read_exact(&mut chunk[..k]).map_err(FrameError::Io)?;
        body.extend_from_slice(&chunk[..k]);
    }
    Ok((kind[0], body))
}

// ---------------------------------------------------------------------------
// Root

/// A running bootstrap root (the rendezvous service), on a background thread
/// named `braid-bootstrap-root`.
///
/// The thread ends by itself when all ranks have left, after an error, or at
/// its deadline. Dropping a `RootServer` detaches the thread (the job keeps
/// its root); [`RootServer::shutdown`] stops it, [`RootServer::join`] waits
/// for it.
#[derive(Debug)]
pub struct RootServer {
    addr: SocketAddr,
    wake: Option<UnixStream>,
    handle: Option<JoinHandle<Result<()>>>,
}

impl RootServer {
    /// Runs a root on an already bound `listener`. Ranks must all join
    /// within `timeout` of this call; every later round must complete within
    /// `timeout` of its first contribution.
    pub fn spawn(listener: TcpListener, secret: [u8; 16], timeout: Duration) -> Result<RootServer> {
        if timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "the bootstrap timeout must be greater than zero".into(),
            ));
        }
        let timeout = timeout.min(MAX_TIMEOUT);
        let io_err = |what: &str, source| Error::BootstrapIo {
            what: what.to_string(),
            source,
        };
        let addr = listener
            .local_addr()
            .map_err(|e| io_err("cannot read the root listener's address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err("cannot make the root listener nonblocking", e))?;
        let (wake_tx, wake_rx) =
            UnixStream::pair().map_err(|e| io_err("cannot create the root's wake-up socket", e))?;
        wake_rx
            .set_nonblocking(true)
            .map_err(|e| io_err("cannot make the root's wake-up socket nonblocking", e))?;
        let root = Root {
            listener,
            addr,
            secret,
            timeout,
            wake: Some(wake_rx),
            pending: Vec::new(),
            ranks: BTreeMap::new(),
            nranks: None,
            rendezvous_deadline: Instant::now() + timeout,
            round: 0,
            contribs: BTreeMap::new(),
            round_deadline: None,
            chunk: vec![0u8; READ_CHUNK],
        };
        let handle = std::thread::Builder::new()
            .name("braid-bootstrap-root".into())
            .spawn(move || {
                let out = root.run();
                match &out {
                    Ok(()) => tracing::debug!(root = %addr, "bootstrap root finished"),
                    Err(e) => tracing::warn!(root = %addr, "bootstrap root gave up: {e}"),
                }
                out
            })
            .map_err(|e| io_err("cannot start the bootstrap root thread", e))?;
        tracing::debug!(root = %addr, "bootstrap root listening");
        Ok(RootServer {
            addr,
            wake: Some(wake_tx),
            handle: Some(handle),
        })
    }

    /// Binds `id.addr` and runs a root there with `id.secret`.
    pub fn bind(id: &UniqueId, timeout: Duration) -> Result<RootServer> {
        RootServer::listen(id.addr, id.secret, timeout)
    }

    /// Binds `bind` (port 0 picks a free port) and runs a root there.
    pub fn listen(bind: SocketAddr, secret: [u8; 16], timeout: Duration) -> Result<RootServer> {
        RootServer::spawn(bind_listener(bind)?, secret, timeout)
    }

    /// The address the root listens on (the real port when bound to port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether the root thread has ended.
    pub fn is_finished(&self) -> bool {
        match &self.handle {
            None => true,
            Some(h) => h.is_finished(),
        }
    }

    /// Waits for the root thread to end and returns its outcome: `Ok` when
    /// the ranks completed and left, the error it sent to the ranks otherwise.
    pub fn join(mut self) -> Result<()> {
        self.join_inner()
    }

    /// Stops the root (connected ranks get an error) and waits for it.
    pub fn shutdown(mut self) -> Result<()> {
        if let Some(mut w) = self.wake.take() {
            let _ = w.write_all(b"x");
        }
        self.join_inner()
    }

    fn join_inner(&mut self) -> Result<()> {
        match self.handle.take() {
            None => Ok(()),
            Some(h) => h.join().unwrap_or_else(|_| {
                Err(Error::Bootstrap(
                    "the bootstrap root thread panicked".into(),
                ))
            }),
        }
    }
}

/// Binds a TCP listener with errors that say what to do.
pub fn bind_listener(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr).map_err(|e| {
        let what = match e.kind() {
            io::ErrorKind::AddrInUse => format!(
                "cannot host the bootstrap root on {addr}: address in use (another process, \
                 perhaps an earlier job, holds port {}); choose another port (BRAID_PORT) or a \
                 new unique id",
                addr.port()
            ),
            io::ErrorKind::AddrNotAvailable => format!(
                "cannot host the bootstrap root on {addr}: {} is not an address of this host; \
                 the root must run on the host named in the unique id (set BRAID_ROOT_ADDR)",
                addr.ip()
            ),
            _ => format!("cannot host the bootstrap root on {addr}"),
        };
        Error::BootstrapIo { what, source: e }
    })
}

/// Binds `addr` (port 0 picks a free port), generates a secret and runs a
/// root there, like `ncclGetUniqueId`. The timeout comes from
/// `BRAID_TIMEOUT` (120 s by default).
pub fn create_unique_id(addr: SocketAddr) -> Result<(UniqueId, RootServer)> {
    create_unique_id_with_timeout(addr, crate::launch::timeout_from_env()?)
}

/// [`create_unique_id`] with an explicit timeout.
pub fn create_unique_id_with_timeout(
    addr: SocketAddr,
    timeout: Duration,
) -> Result<(UniqueId, RootServer)> {
    let secret = random_bytes()?;
    let server = RootServer::listen(addr, secret, timeout)?;
    Ok((
        UniqueId {
            addr: server.addr(),
            secret,
        },
        server,
    ))
}

/// The root thread ends with this: its outcome.
struct Finish(Result<()>);

type Step = std::result::Result<(), Finish>;

struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    nonce: [u8; NONCE_LEN],
    deadline: Instant,
    rbuf: FrameBuf,
    /// The hello's fixed part proved the secret. Until then the root reads
    /// no more than [`HELLO_PREFIX`] bytes from the connection.
    proven: bool,
}

struct RankConn {
    stream: TcpStream,
    peer: SocketAddr,
    rbuf: FrameBuf,
}

struct Root {
    listener: TcpListener,
    addr: SocketAddr,
    secret: [u8; 16],
    timeout: Duration,
    wake: Option<UnixStream>,
    pending: Vec<Pending>,
    ranks: BTreeMap<u32, RankConn>,
    /// (nranks, the rank that first said so)
    nranks: Option<(u32, u32)>,
    rendezvous_deadline: Instant,
    /// 0 during the rendezvous, then the round being collected.
    round: u64,
    contribs: BTreeMap<u32, Vec<u8>>,
    round_deadline: Option<Instant>,
    chunk: Vec<u8>,
}

impl Root {
    fn run(mut self) -> Result<()> {
        match self.run_loop() {
            Ok(()) => Ok(()),
            Err(Finish(r)) => r,
        }
    }

    fn run_loop(&mut self) -> Step {
        loop {
            self.check_deadlines()?;
            let next = self.next_deadline();
            let wait = match next {
                Some(d) => poll_ms(d.saturating_duration_since(Instant::now())),
                None => PollTimeout::NONE,
            };

            let (ready_listener, ready_wake, ready_pending, ready_ranks) = {
                let mut fds = Vec::with_capacity(2 + self.pending.len() + self.ranks.len());
                fds.push(PollFd::new(self.listener.as_fd(), PollFlags::POLLIN));
                let has_wake = self.wake.is_some();
                if let Some(w) = &self.wake {
                    fds.push(PollFd::new(w.as_fd(), PollFlags::POLLIN));
                }
                for p in &self.pending {
                    fds.push(PollFd::new(p.stream.as_fd(), PollFlags::POLLIN));
                }
                let rank_ids: Vec<u32> = self.ranks.keys().copied().collect();
                for c in self.ranks.values() {
                    fds.push(PollFd::new(c.stream.as_fd(), PollFlags::POLLIN));
                }
                match nix::poll::poll(&mut fds, wait) {
                    Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                    Err(e) => {
                        return Err(
                            self.abort(format!("the bootstrap root cannot poll its sockets: {e}"))
                        );
                    }
                }
                let ready = |f: &PollFd| !matches!(f.revents(), Some(r) if r.is_empty());
                let base = 1 + usize::from(has_wake);
                let rl = ready(&fds[0]);
                let rw = has_wake && ready(&fds[1]);
                let rp: Vec<usize> = (0..self.pending.len())
                    .filter(|&i| ready(&fds[base + i]))
                    .collect();
                let rr: Vec<u32> = rank_ids
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| ready(&fds[base + self.pending.len() + i]))
                    .map(|(_, &r)| r)
                    .collect();
                (rl, rw, rp, rr)
            };

            if ready_wake {
                self.check_wake()?;
            }
            for r in ready_ranks {
                self.service_rank(r)?;
            }
            if !ready_pending.is_empty() {
                self.service_pending(&ready_pending)?;
            }
            if ready_listener {
                self.accept_new();
            }
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let mut d = if self.round == 0 {
            Some(self.rendezvous_deadline)
        } else {
            self.round_deadline
        };
        for p in &self.pending {
            d = Some(d.map_or(p.deadline, |x| x.min(p.deadline)));
        }
        d
    }

    fn check_deadlines(&mut self) -> Step {
        let now = Instant::now();
        let before = self.pending.len();
        let addr = self.addr;
        let t = self.timeout;
        self.pending.retain(|p| {
            let keep = p.deadline > now;
            if !keep {
                tracing::warn!(root = %addr, peer = %p.peer,
                    "connection did not complete the bootstrap handshake within {}; dropped", fmt_dur(t));
            }
            keep
        });
        if before != self.pending.len() {
            tracing::debug!(root = %addr, "dropped {} stale connections", before - self.pending.len());
        }
        let t = fmt_dur(self.timeout);
        if self.round == 0 && now >= self.rendezvous_deadline {
            return Err(match self.nranks {
                None => {
                    let msg = format!("no rank joined the bootstrap root at {addr} within {t}");
                    self.abort(msg)
                }
                Some((n, _)) => {
                    let missing: Vec<u32> =
                        (0..n).filter(|r| !self.ranks.contains_key(r)).collect();
                    let msg = format!(
                        "{} did not join within {t} ({} of {n} joined)",
                        fmt_ranks(&missing),
                        self.ranks.len()
                    );
                    self.abort(msg)
                }
            });
        }
        if let Some(d) = self.round_deadline {
            if now >= d {
                let n = self.ranks.len() as u32;
                let missing: Vec<u32> = (0..n).filter(|r| !self.contribs.contains_key(r)).collect();
                let msg = format!(
                    "{} did not reach bootstrap round {} within {t} (the other ranks did)",
                    fmt_ranks(&missing),
                    self.round
                );
                return Err(self.abort(msg));
            }
        }
        Ok(())
    }

    fn check_wake(&mut self) -> Step {
        let mut b = [0u8; 16];
        let got = match &self.wake {
            Some(w) => {
                let mut w = w;
                w.read(&mut b)
            }
            None => return Ok(()),
        };
        match got {
            Ok(n) if n > 0 => {
                let msg = format!("the bootstrap root at {} was shut down", self.addr);
                let Finish(_) = self.abort(msg);
                Err(Finish(Ok(())))
            }
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted =>
            {
                Ok(())
            }
            // The RootServer was dropped (detached): keep serving.
            _ => {
                self.wake = None;
                Ok(())
            }
        }
    }

    fn accept_new(&mut self) {
        for _ in 0..64 {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    if self.pending.len() >= MAX_PENDING {
                        tracing::warn!(root = %self.addr, %peer,
                            "too many connections in the bootstrap handshake; dropped");
                        continue;
                    }
                    if let Err(e) = self.start_handshake(stream, peer) {
                        tracing::warn!(root = %self.addr, %peer, "bootstrap handshake failed: {e}");
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // ECONNABORTED, EMFILE, ...: log and try again later.
                    tracing::warn!(root = %self.addr, "bootstrap root accept failed: {e}");
                    return;
                }
            }
        }
    }

    fn start_handshake(&mut self, stream: TcpStream, peer: SocketAddr) -> io::Result<()> {
        stream.set_nonblocking(true)?;
        stream.set_nodelay(true)?;
        let nonce: [u8; NONCE_LEN] = random_bytes().map_err(io::Error::other)?;
        let frame = challenge_frame(&nonce);
        write_all_nb(&stream, &[&frame], Instant::now() + self.timeout)?;
        self.pending.push(Pending {
            stream,
            peer,
            nonce,
            deadline: Instant::now() + self.timeout,
            rbuf: FrameBuf::default(),
            proven: false,
        });
        Ok(())
    }

    fn service_pending(&mut self, ready: &[usize]) -> Step {
        let mut all = std::mem::take(&mut self.pending);
        // Take the ready ones out (highest index first keeps indices valid).
        let mut taken = Vec::with_capacity(ready.len());
        for &i in ready.iter().rev() {
            if i < all.len() {
                taken.push(all.swap_remove(i));
            }
        }
        self.pending = all;
        for mut p in taken {
            // Before the proof of the secret, read only up to the end of the
            // hello's fixed part: a stranger costs the root a few bytes, not
            // a frame of up to MAX_FRAME.
            let limit = if p.proven {
                self.chunk.len()
            } else {
                HELLO_PREFIX.saturating_sub(p.rbuf.buf.len()).max(1)
            };
            match p.rbuf.fill(&p.stream, &mut self.chunk[..limit]) {
                Ok(Fill::Data) => {}
                Ok(Fill::Nothing) => {
                    self.pending.push(p);
                    continue;
                }
                Ok(Fill::Eof) => {
                    tracing::debug!(root = %self.addr, peer = %p.peer, "connection closed during the bootstrap handshake");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(root = %self.addr, peer = %p.peer, "bootstrap handshake read failed: {e}");
                    continue;
                }
            }
            if !p.proven {
                match hello_prefix(&p.rbuf.buf) {
                    Ok(None) => {
                        self.pending.push(p);
                        continue;
                    }
                    Ok(Some(h)) if h.proves(&self.secret, &p.nonce) => p.proven = true,
                    Ok(Some(h)) => {
                        self.reject_wrong_secret(p, h.rank);
                        continue;
                    }
                    Err(e) => {
                        self.reject_hello(p, e);
                        continue;
                    }
                }
            }
            match p.rbuf.next_frame() {
                Ok(None) => self.pending.push(p),
                Ok(Some((kind, body))) => {
                    if !p.rbuf.buf.is_empty() {
                        self.reject(p, "sent data after its hello", None);
                        continue;
                    }
                    self.handle_hello(p, kind, body)?;
                }
                Err(why) => self.reject(p, &why, None),
            }
        }
        Ok(())
    }

    /// Drops a connection that failed the handshake; it never counts as a rank.
    fn reject(&self, p: Pending, why: &str, tell: Option<&str>) {
        tracing::warn!(root = %self.addr, peer = %p.peer,
            "rejected a bootstrap connection: {why}");
        if let Some(msg) = tell {
            let f = error_frame_bytes(msg);
            let _ = write_all_nb(
                &p.stream,
                &[&f],
                Instant::now() + self.timeout.min(Duration::from_secs(1)),
            );
        }
        close_gently(p.stream);
    }

    /// Drops a connection whose hello was not a braid hello of this version.
    fn reject_hello(&self, p: Pending, e: HelloError) {
        match e {
            HelloError::Length(n) => self.reject(
                p,
                &format!("frame of {n} bytes (the limit is {MAX_FRAME} bytes)"),
                None,
            ),
            HelloError::NotHello => self.reject(p, "not a braid bootstrap hello", None),
            HelloError::Magic => self.reject(p, "wrong magic (not a braid bootstrap client)", None),
            HelloError::Version(version) => {
                let msg = format!(
                    "bootstrap protocol version mismatch: the root at {} speaks v{VERSION}, this rank v{version}; \
                     all ranks must run the same braid version",
                    self.addr
                );
                self.reject(p, &msg, Some(&msg));
            }
            HelloError::Truncated => self.reject(p, "truncated hello", None),
        }
    }

    /// Drops a connection that did not prove the secret, telling it why.
    fn reject_wrong_secret(&self, p: Pending, rank: u32) {
        let why = format!("a client claiming rank {rank} did not prove the secret");
        let tell = format!(
            "the secret did not match: the bootstrap root at {} does not accept this rank's \
             secret; check that every rank uses the same UniqueId (BRAID_UNIQUE_ID or BRAID_SECRET)",
            self.addr
        );
        self.reject(p, &why, Some(&tell));
    }

    fn handle_hello(&mut self, p: Pending, kind: u8, body: Vec<u8>) -> Step {
        let (fixed, payload) = match parse_hello(kind, &body) {
            Ok(h) => h,
            Err(e) => {
                self.reject_hello(p, e);
                return Ok(());
            }
        };
        if !fixed.proves(&self.secret, &p.nonce) {
            self.reject_wrong_secret(p, fixed.rank);
            return Ok(());
        }
        let HelloFixed {
            rank,
            nranks,
            cnonce,
            ..
        } = fixed;
        let payload = payload.to_vec();

        if self.round > 0 {
            let msg = format!(
                "rank {rank} tried to join after all {} ranks had joined (a duplicate rank or a restarted process?)",
                self.ranks.len()
            );
            self.reject(p, &msg, Some(&msg));
            return Ok(());
        }
        if nranks == 0 || nranks > MAX_RANKS {
            let msg = format!(
                "rank {rank} says nranks={nranks}, which is out of range (1..={MAX_RANKS})"
            );
            return Err(self.abort_with(msg, Some(p.stream)));
        }
        if let Some((n0, r0)) = self.nranks {
            if n0 != nranks {
                let msg = format!("rank {rank} says nranks={nranks}, rank {r0} says {n0}");
                return Err(self.abort_with(msg, Some(p.stream)));
            }
        }
        if rank >= nranks {
            let msg = format!(
                "rank {rank} is out of range: nranks={nranks}, so ranks are 0..={}",
                nranks - 1
            );
            return Err(self.abort_with(msg, Some(p.stream)));
        }
        if let Some(first) = self.ranks.get(&rank) {
            let msg = format!(
                "rank {rank} joined twice (from {} and from {})",
                first.peer, p.peer
            );
            return Err(self.abort_with(msg, Some(p.stream)));
        }

        let accept = accept_frame(&root_mac(&self.secret, &cnonce, &p.nonce, rank));
        if let Err(e) = write_all_nb(&p.stream, &[&accept], Instant::now() + self.timeout) {
            tracing::warn!(root = %self.addr, peer = %p.peer, "rank {rank} vanished during its handshake: {e}");
            return Ok(());
        }
        tracing::debug!(root = %self.addr, peer = %p.peer, "rank {rank}/{nranks} joined");
        if self.nranks.is_none() {
            self.nranks = Some((nranks, rank));
        }
        self.ranks.insert(
            rank,
            RankConn {
                stream: p.stream,
                peer: p.peer,
                rbuf: p.rbuf,
            },
        );
        self.contribs.insert(rank, payload);
        if self.ranks.len() == nranks as usize {
            self.complete_round()?;
        }
        Ok(())
    }

    fn service_rank(&mut self, rank: u32) -> Step {
        let Some(conn) = self.ranks.get_mut(&rank) else {
            return Ok(());
        };
        let got = conn.rbuf.fill(&conn.stream, &mut self.chunk);
        match got {
            Ok(Fill::Data) => {}
            Ok(Fill::Nothing) => return Ok(()),
            Ok(Fill::Eof) => return Err(self.departed(rank, None)),
            Err(e) => return Err(self.departed(rank, Some(e))),
        }
        loop {
            let Some(conn) = self.ranks.get_mut(&rank) else {
                return Ok(());
            };
            let frame = match conn.rbuf.next_frame() {
                Ok(Some(f)) => f,
                Ok(None) => return Ok(()),
                Err(why) => {
                    let msg = format!("rank {rank} sent a malformed bootstrap message ({why})");
                    return Err(self.abort(msg));
                }
            };
            self.handle_rank_frame(rank, frame)?;
        }
    }

    fn handle_rank_frame(&mut self, rank: u32, (kind, body): (u8, Vec<u8>)) -> Step {
        if kind != K_CONTRIB || self.round == 0 {
            let msg = format!("rank {rank} sent an unexpected bootstrap message (kind {kind})");
            return Err(self.abort(msg));
        }
        let Some((round, data)) = parse_contrib(&body) else {
            let msg = format!("rank {rank} sent a truncated bootstrap contribution");
            return Err(self.abort(msg));
        };
        if round != self.round {
            let msg = format!(
                "rank {rank} is at bootstrap round {round} but the others are at round {}",
                self.round
            );
            return Err(self.abort(msg));
        }
        if self.contribs.contains_key(&rank) {
            let msg = format!("rank {rank} contributed twice to bootstrap round {round}");
            return Err(self.abort(msg));
        }
        if self.contribs.is_empty() {
            self.round_deadline = Some(Instant::now() + self.timeout);
        }
        self.contribs.insert(rank, data.to_vec());
        if self.contribs.len() == self.ranks.len() {
            self.complete_round()?;
        }
        Ok(())
    }

    /// Sends every rank all contributions of the current round in rank order.
    fn complete_round(&mut self) -> Step {
        let round = self.round;
        let contribs = std::mem::take(&mut self.contribs);
        let mut failed = None;
        for (&r, conn) in &self.ranks {
            let deadline = Instant::now() + self.timeout;
            for (&src, data) in &contribs {
                let hdr = data_header(round, src, data.len());
                if let Err(e) = write_all_nb(&conn.stream, &[&hdr, data], deadline) {
                    failed = Some((r, e));
                    break;
                }
            }
            if failed.is_some() {
                break;
            }
        }
        if let Some((r, e)) = failed {
            return Err(self.departed(r, Some(e)));
        }
        tracing::debug!(root = %self.addr, "bootstrap round {round} complete");
        self.round += 1;
        self.round_deadline = None;
        Ok(())
    }

    fn departed(&mut self, rank: u32, err: Option<io::Error>) -> Finish {
        let why = err.map(|e| format!(" ({e})")).unwrap_or_default();
        if self.round == 0 {
            let msg = format!("rank {rank} left the bootstrap before all ranks joined{why}");
            return self.abort(msg);
        }
        let mid_round = !self.contribs.is_empty();
        let msg = format!("rank {rank} left the bootstrap{why}");
        let Finish(r) = self.abort_with(msg, None);
        if mid_round {
            Finish(r)
        } else {
            // Ranks leave one by one at the end of a job: not an error.
            tracing::debug!(root = %self.addr, "rank {rank} left; the bootstrap root ends");
            Finish(Ok(()))
        }
    }

    fn abort(&mut self, msg: String) -> Finish {
        self.abort_with(msg, None)
    }

    /// Sends `msg` to every connected rank (and `extra`), closes everything
    /// and returns the error outcome.
    fn abort_with(&mut self, msg: String, extra: Option<TcpStream>) -> Finish {
        tracing::warn!(root = %self.addr, "bootstrap failed: {msg}");
        let frame = error_frame_bytes(&msg);
        let deadline = Instant::now() + self.timeout.min(Duration::from_secs(2));
        let ranks = std::mem::take(&mut self.ranks);
        let streams = ranks.into_values().map(|c| c.stream).chain(extra);
        for s in streams {
            let _ = write_all_nb(&s, &[&frame], deadline);
            close_gently(s);
        }
        for p in std::mem::take(&mut self.pending) {
            close_gently(p.stream);
        }
        Finish(Err(Error::Bootstrap(msg)))
    }
}

// ---------------------------------------------------------------------------
// Client

/// A rank's connection to the bootstrap root.
#[derive(Debug)]
pub struct Bootstrap {
    rank: u32,
    nranks: u32,
    root: SocketAddr,
    timeout: Duration,
    abort: Option<Arc<AtomicBool>>,
    state: Mutex<ClientState>,
}

#[derive(Debug)]
struct ClientState {
    stream: TcpStream,
    round: u64,
    broken: Option<String>,
}

/// Blocking frame I/O with deadlines and messages that name the root.
struct Wire<'a> {
    stream: &'a mut TcpStream,
    root: SocketAddr,
    timeout: Duration,
    /// Set from another thread to give up (init abort); polled every 50 ms.
    abort: Option<&'a AtomicBool>,
}

/// How often a blocked read looks at the abort flag.
const ABORT_POLL: Duration = Duration::from_millis(50);

fn aborted_error() -> io::Error {
    io::Error::other("aborted by the caller")
}

impl Wire<'_> {
    fn io_error(&self, e: io::Error, what: &str) -> Error {
        if self.abort.is_some_and(|a| a.load(Ordering::Relaxed)) {
            return Error::Unusable(format!("aborted by the caller while {what}"));
        }
        match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Error::Bootstrap(format!(
                "no answer from the bootstrap root at {} within {} while {what}",
                self.root,
                fmt_dur(self.timeout)
            )),
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => Error::Bootstrap(format!(
                "the bootstrap root at {} closed the connection while {what} (did the root process exit?)",
                self.root
            )),
            _ => Error::BootstrapIo {
                what: format!("{what} (bootstrap root at {})", self.root),
                source: e,
            },
        }
    }

    fn read_exact(&mut self, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
        let mut off = 0;
        while off < buf.len() {
            let Some(left) = remaining(deadline) else {
                return Err(io::ErrorKind::TimedOut.into());
            };
            if self.abort.is_some_and(|a| a.load(Ordering::Relaxed)) {
                return Err(aborted_error());
            }
            let slice = if self.abort.is_some() {
                left.min(ABORT_POLL)
            } else {
                left
            };
            self.stream.set_read_timeout(Some(slice))?;
            match self.stream.read(&mut buf[off..]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => off += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted
                            | io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn write_all(&mut self, bufs: &[&[u8]], deadline: Instant, what: &str) -> Result<()> {
        for buf in bufs {
            let mut off = 0;
            while off < buf.len() {
                let Some(left) = remaining(deadline) else {
                    return Err(self.io_error(io::ErrorKind::TimedOut.into(), what));
                };
                if let Err(e) = self.stream.set_write_timeout(Some(left)) {
                    return Err(self.io_error(e, what));
                }
                match self.stream.write(&buf[off..]) {
                    Ok(0) => return Err(self.io_error(io::ErrorKind::WriteZero.into(), what)),
                    Ok(n) => off += n,
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::Interrupted
                                | io::ErrorKind::WouldBlock
                                | io::ErrorKind::TimedOut
                        ) => {}
                    Err(e) => return Err(self.io_error(e, what)),
                }
            }
        }
        Ok(())
    }

    /// Reads one frame; an `ERROR` frame becomes `Err` with the root's message.
    fn read_frame(&mut self, deadline: Instant, what: &str) -> Result<(u8, Vec<u8>)> {
        let (kind, body) = self.read_raw_frame(deadline, what)?;
        if kind == K_ERROR {
            return Err(self.root_error(&body));
        }
        Ok((kind, body))
    }

    fn root_error(&self, body: &[u8]) -> Error {
        let msg = String::from_utf8_lossy(body);
        Error::Bootstrap(format!(
            "{msg} (reported by the bootstrap root at {})",
            self.root
        ))
    }

    /// After a failed write: the root may have said why it closed the
    /// connection. Returns its message if one is waiting.
    fn pending_root_error(&mut self) -> Option<Error> {
        let deadline = Instant::now() + self.timeout.min(Duration::from_millis(500));
        match self.read_raw_frame(deadline, "reading the root's last message") {
            Ok((K_ERROR, body)) => Some(self.root_error(&body)),
            _ => None,
        }
    }

    /// Writes a message; if that fails, prefers the root's explanation.
    fn send(&mut self, bufs: &[&[u8]], deadline: Instant, what: &str) -> Result<()> {
        self.write_all(bufs, deadline, what)
            .map_err(|e| self.pending_root_error().unwrap_or(e))
    }

    fn read_raw_frame(&mut self, deadline: Instant, what: &str) -> Result<(u8, Vec<u8>)> {
        match read_frame_with(|b| self.read_exact(b, deadline)) {
            Ok(f) => Ok(f),
            Err(FrameError::Io(e)) => Err(self.io_error(e, what)),
            Err(FrameError::Length(n)) => Err(Error::Bootstrap(format!(
                "the peer at {} does not speak the braid bootstrap protocol (frame length {n}) \
                 while {what}; is the unique id's address really a braid root?",
                self.root
            ))),
        }
    }

    /// Reads the `nranks` DATA frames of `round`.
    fn read_round(
        &mut self,
        round: u64,
        nranks: u32,
        deadline: Instant,
        what: &str,
    ) -> Result<Vec<Vec<u8>>> {
        let mut out = Vec::with_capacity(nranks.min(1 << 16) as usize);
        for want in 0..nranks {
            let (kind, body) = self.read_frame(deadline, what)?;
            let data =
                parse_data(kind, &body, round, want).map_err(|got| self.protocol(what, &got))?;
            out.push(data.to_vec());
        }
        Ok(out)
    }

    fn protocol(&self, what: &str, got: &str) -> Error {
        Error::Bootstrap(format!(
            "the bootstrap root at {} sent {got} while {what} (protocol error)",
            self.root
        ))
    }
}

fn connect_retry(
    addr: SocketAddr,
    timeout: Duration,
    deadline: Instant,
    abort: Option<&AtomicBool>,
) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(10);
    loop {
        if abort.is_some_and(|a| a.load(Ordering::Relaxed)) {
            return Err(Error::Unusable(
                "communicator creation aborted by the caller".into(),
            ));
        }
        let left = remaining(deadline).unwrap_or(Duration::ZERO);
        let err = if left.is_zero() {
            io::Error::new(io::ErrorKind::TimedOut, "deadline reached")
        } else {
            match TcpStream::connect_timeout(&addr, left) {
                Ok(s) => return Ok(s),
                Err(e) => e,
            }
        };
        let Some(left) = remaining(deadline) else {
            return Err(Error::BootstrapIo {
                what: format!(
                    "could not reach the bootstrap root at {addr} within {} (is rank 0 / the root \
                     running, and is the address in the unique id reachable from this host?)",
                    fmt_dur(timeout)
                ),
                source: err,
            });
        };
        tracing::trace!(root = %addr, "bootstrap connect failed ({err}); retrying");
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

impl Bootstrap {
    /// Joins the bootstrap at `id`: connects to the root (retrying while it
    /// is not up yet), proves the secret, and waits until all `nranks` ranks
    /// have joined. Returns every rank's `payload` in rank order.
    ///
    /// Fails within about `timeout` with an error naming the root or the
    /// ranks concerned.
    pub fn connect(
        id: &UniqueId,
        rank: u32,
        nranks: u32,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(Bootstrap, Vec<Vec<u8>>)> {
        Self::connect_abortable(id, rank, nranks, payload, timeout, None)
    }

    /// [`Bootstrap::connect`] that gives up within about 50 ms once `abort`
    /// is set (from any thread), here and in every later round.
    pub fn connect_abortable(
        id: &UniqueId,
        rank: u32,
        nranks: u32,
        payload: &[u8],
        timeout: Duration,
        abort: Option<Arc<AtomicBool>>,
    ) -> Result<(Bootstrap, Vec<Vec<u8>>)> {
        if nranks == 0 || nranks > MAX_RANKS {
            return Err(Error::InvalidArgument(format!(
                "nranks={nranks} is out of range (1..={MAX_RANKS})"
            )));
        }
        if rank >= nranks {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is out of range for nranks={nranks} (ranks are 0..={})",
                nranks - 1
            )));
        }
        check_payload(payload)?;
        if timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "the bootstrap timeout must be greater than zero".into(),
            ));
        }
        let timeout = timeout.min(MAX_TIMEOUT);
        let start = Instant::now();
        let deadline = start + timeout;
        let root = id.addr;
        let mut stream = connect_retry(root, timeout, deadline, abort.as_deref())?;
        stream.set_nodelay(true).map_err(|e| Error::BootstrapIo {
            what: format!(
                "cannot set TCP_NODELAY on the connection to the bootstrap root at {root}"
            ),
            source: e,
        })?;
        let mut wire = Wire {
            stream: &mut stream,
            root,
            timeout,
            abort: abort.as_deref(),
        };

        // 1. challenge
        let what = "waiting for the root's challenge";
        let (kind, body) = wire.read_frame(deadline, what)?;
        let rnonce = match parse_challenge(kind, &body) {
            Ok(n) => n,
            Err(ChallengeError::NotBraid) => {
                return Err(Error::Bootstrap(format!(
                    "the peer at {root} does not speak the braid bootstrap protocol; is the \
                     unique id's address really a braid root?"
                )))
            }
            Err(ChallengeError::Version(version)) => {
                return Err(Error::Bootstrap(format!(
                    "bootstrap protocol version mismatch: the root at {root} speaks v{version}, \
                     this rank v{VERSION}; all ranks must run the same braid version"
                )))
            }
        };

        // 2. hello
        let cnonce: [u8; NONCE_LEN] = random_bytes()?;
        let hello = HelloFixed {
            rank,
            nranks,
            cnonce,
            mac: client_mac(&id.secret, &rnonce, &cnonce, rank, nranks),
        }
        .encode();
        let hdr = hello_header(payload.len());
        wire.send(&[&hdr, &hello, payload], deadline, "sending hello")?;

        // 3. accept, with the root's proof
        let (kind, proof) =
            wire.read_frame(deadline, "waiting for the root to accept this rank")?;
        if kind != K_ACCEPT || !ct_eq(&proof, &root_mac(&id.secret, &cnonce, &rnonce, rank)) {
            return Err(Error::Bootstrap(format!(
                "the bootstrap root at {root} could not prove that it knows the secret: check \
                 that every rank uses the same UniqueId"
            )));
        }

        // 4. everyone's payloads
        let what = format!("waiting for all {nranks} ranks to join (this is rank {rank})");
        let all = wire.read_round(0, nranks, deadline + grace(timeout), &what)?;
        tracing::debug!(root = %root, "rank {rank}/{nranks} bootstrapped in {:?}", start.elapsed());
        Ok((
            Bootstrap {
                rank,
                nranks,
                root,
                timeout,
                abort,
                state: Mutex::new(ClientState {
                    stream,
                    round: 0,
                    broken: None,
                }),
            },
            all,
        ))
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The number of ranks.
    pub fn nranks(&self) -> u32 {
        self.nranks
    }

    /// The root's address.
    pub fn root_addr(&self) -> SocketAddr {
        self.root
    }

    /// The timeout of every round.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The local address of this rank's connection to the root: an address
    /// the other ranks can reach this host at, as they reach the root.
    pub fn local_ip(&self) -> Option<IpAddr> {
        let st = self.state.lock().ok()?;
        st.stream.local_addr().ok().map(|a| a.ip())
    }

    /// Every rank contributes `data`; all get all contributions in rank order.
    /// All ranks must call this the same number of times. After an error the
    /// bootstrap is unusable.
    pub fn allgather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        check_payload(data)?;
        let mut st = self
            .state
            .lock()
            .map_err(|_| Error::Unusable("a bootstrap round panicked on another thread".into()))?;
        if let Some(why) = &st.broken {
            return Err(Error::Unusable(format!(
                "an earlier bootstrap round failed: {why}"
            )));
        }
        let round = st.round + 1;
        let res = {
            let mut wire = Wire {
                stream: &mut st.stream,
                root: self.root,
                timeout: self.timeout,
                abort: self.abort.as_deref(),
            };
            let deadline = Instant::now() + self.timeout;
            let what = format!(
                "in bootstrap round {round} (rank {} of {})",
                self.rank, self.nranks
            );
            let hdr = contrib_header(round, data.len());
            wire.send(&[&hdr, data], deadline, &what).and_then(|()| {
                wire.read_round(round, self.nranks, deadline + grace(self.timeout), &what)
            })
        };
        match res {
            Ok(v) => {
                st.round = round;
                Ok(v)
            }
            Err(e) => {
                st.broken = Some(e.to_string());
                let _ = st.stream.shutdown(Shutdown::Both);
                Err(e)
            }
        }
    }

    /// Waits until every rank has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        self.allgather(&[]).map(|_| ())
    }
}

fn check_payload(p: &[u8]) -> Result<()> {
    if p.len() > MAX_PAYLOAD {
        return Err(Error::InvalidArgument(format!(
            "bootstrap payload of {} bytes exceeds the limit of {MAX_PAYLOAD} bytes",
            p.len()
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Fuzzing entry points

/// The bootstrap's decoders and encoders over plain bytes, for the fuzz
/// targets in `fuzz/` and their seed corpus. Not part of the API: the
/// signatures follow the wire format and change with it.
#[doc(hidden)]
pub mod fuzzing {
    use super::*;

    use std::result::Result;

    /// Bytes of a hello's fixed part.
    pub const HELLO_FIXED: usize = super::HELLO_FIXED;
    /// Bytes the root reads from a connection before the proof.
    pub const HELLO_PREFIX: usize = super::HELLO_PREFIX;
    /// Bytes of a nonce.
    pub const NONCE_LEN: usize = super::NONCE_LEN;
    /// Bytes of a MAC.
    pub const MAC_LEN: usize = super::MAC_LEN;
    /// Frame kinds.
    pub const KINDS: [(u8, &str); 6] = [
        (K_CHALLENGE, "challenge"),
        (K_HELLO, "hello"),
        (K_ACCEPT, "accept"),
        (K_ERROR, "error"),
        (K_DATA, "data"),
        (K_CONTRIB, "contrib"),
    ];

    /// A hello's fixed part: `(rank, nranks, client nonce, mac)`.
    pub type Hello = (u32, u32, [u8; NONCE_LEN], [u8; MAC_LEN]);

    fn hello_tuple(h: HelloFixed) -> Hello {
        (h.rank, h.nranks, h.cnonce, h.mac)
    }

    fn hello_error(e: HelloError) -> String {
        format!("{e:?}")
    }

    /// Feeds `stream` to the root's frame cutter in pieces of the sizes in
    /// `pieces` (cycled; a 0 stands for 1), as nonblocking reads would
    /// deliver it, taking every frame as soon as it is complete. Returns the
    /// frames and the error that stopped the cutter, if any.
    pub fn root_frames(stream: &[u8], pieces: &[usize]) -> (Vec<(u8, Vec<u8>)>, Option<String>) {
        let mut fb = FrameBuf::default();
        let mut frames = Vec::new();
        let mut at = 0;
        let mut i = 0;
        while at < stream.len() {
            let k = pieces
                .get(i % pieces.len().max(1))
                .copied()
                .unwrap_or(READ_CHUNK);
            let k = k.clamp(1, READ_CHUNK).min(stream.len() - at);
            fb.buf.extend_from_slice(&stream[at..at + k]);
            at += k;
            i += 1;
            loop {
                match fb.next_frame() {
                    Ok(Some(f)) => frames.push(f),
                    Ok(None) => break,
                    Err(e) => return (frames, Some(e)),
                }
            }
            // What the root holds for one connection: at most one frame.
            assert!(fb.buf.len() < 4 + MAX_FRAME + READ_CHUNK);
        }
        (frames, None)
    }

    /// Reads frames from `stream` as a client does, until it ends or a
    /// frame is refused. The error is `"length N"` or the I/O error kind.
    pub fn client_frames(stream: &[u8]) -> (Vec<(u8, Vec<u8>)>, Option<String>) {
        let mut r = io::Cursor::new(stream);
        let mut frames = Vec::new();
        while (r.position() as usize) < stream.len() {
            match read_frame_with(|b| r.read_exact(b)) {
                Ok(f) => frames.push(f),
                Err(FrameError::Length(n)) => return (frames, Some(format!("length {n}"))),
                Err(FrameError::Io(e)) => return (frames, Some(format!("{:?}", e.kind()))),
            }
        }
        (frames, None)
    }

    /// The root's early check of a connection's first bytes.
    pub fn hello_prefix(buf: &[u8]) -> Result<Option<Hello>, String> {
        super::hello_prefix(buf)
            .map(|h| h.map(hello_tuple))
            .map_err(hello_error)
    }

    /// The root's decoder of a complete hello frame: fixed part and payload.
    pub fn parse_hello(kind: u8, body: &[u8]) -> Result<(Hello, Vec<u8>), String> {
        super::parse_hello(kind, body)
            .map(|(h, p)| (hello_tuple(h), p.to_vec()))
            .map_err(hello_error)
    }

    /// Whether `hello` proves `secret` for the root nonce `root_nonce`.
    pub fn hello_proves(hello: &Hello, secret: &[u8; 16], root_nonce: &[u8; NONCE_LEN]) -> bool {
        let (rank, nranks, cnonce, mac) = *hello;
        HelloFixed {
            rank,
            nranks,
            cnonce,
            mac,
        }
        .proves(secret, root_nonce)
    }

    /// A complete hello frame as a client sends it, with a valid proof.
    pub fn hello_frame(
        secret: &[u8; 16],
        root_nonce: &[u8; NONCE_LEN],
        cnonce: &[u8; NONCE_LEN],
        rank: u32,
        nranks: u32,
        payload: &[u8],
    ) -> Vec<u8> {
        let h = HelloFixed {
            rank,
            nranks,
            cnonce: *cnonce,
            mac: client_mac(secret, root_nonce, cnonce, rank, nranks),
        };
        let mut v = hello_header(payload.len()).to_vec();
        v.extend_from_slice(&h.encode());
        v.extend_from_slice(payload);
        v
    }

    /// The hello's fixed part on the wire.
    pub fn encode_hello(h: &Hello) -> Vec<u8> {
        let (rank, nranks, cnonce, mac) = *h;
        HelloFixed {
            rank,
            nranks,
            cnonce,
            mac,
        }
        .encode()
    }

    /// The root's decoder of a contribution: `(round, data)`.
    pub fn parse_contrib(body: &[u8]) -> Option<(u64, Vec<u8>)> {
        super::parse_contrib(body).map(|(r, d)| (r, d.to_vec()))
    }

    /// A complete `CONTRIB` frame.
    pub fn contrib_frame(round: u64, data: &[u8]) -> Vec<u8> {
        let mut v = contrib_header(round, data.len());
        v.extend_from_slice(data);
        v
    }

    /// The client's decoder of the challenge: the root's nonce.
    pub fn parse_challenge(kind: u8, body: &[u8]) -> Result<[u8; NONCE_LEN], String> {
        super::parse_challenge(kind, body).map_err(|e| format!("{e:?}"))
    }

    /// A complete `CHALLENGE` frame.
    pub fn challenge_frame(nonce: &[u8; NONCE_LEN]) -> Vec<u8> {
        super::challenge_frame(nonce)
    }

    /// A complete `ACCEPT` frame proving `secret` to the client.
    pub fn accept_frame(
        secret: &[u8; 16],
        cnonce: &[u8; NONCE_LEN],
        root_nonce: &[u8; NONCE_LEN],
        rank: u32,
    ) -> Vec<u8> {
        super::accept_frame(&root_mac(secret, cnonce, root_nonce, rank))
    }

    /// Whether an `ACCEPT` frame's body is the root's proof, as the client
    /// checks it.
    pub fn accept_proves(
        kind: u8,
        body: &[u8],
        secret: &[u8; 16],
        cnonce: &[u8; NONCE_LEN],
        root_nonce: &[u8; NONCE_LEN],
        rank: u32,
    ) -> bool {
        kind == K_ACCEPT && ct_eq(body, &root_mac(secret, cnonce, root_nonce, rank))
    }

    /// The client's decoder of a `DATA` frame expected from rank `want` in
    /// round `round`.
    pub fn parse_data(kind: u8, body: &[u8], round: u64, want: u32) -> Result<Vec<u8>, String> {
        super::parse_data(kind, body, round, want).map(<[u8]>::to_vec)
    }

    /// A complete `DATA` frame.
    pub fn data_frame(round: u64, src: u32, data: &[u8]) -> Vec<u8> {
        let mut v = data_header(round, src, data.len());
        v.extend_from_slice(data);
        v
    }

    /// A complete `ERROR` frame (the message is cut at 64 KiB).
    pub fn error_frame(msg: &str) -> Vec<u8> {
        error_frame_bytes(msg)
    }
}

// ---------------------------------------------------------------------------
// Tests

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    use std::sync::Arc;
    use std::sync::Barrier as StdBarrier;

    const LOCAL4: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);

    fn payload_for(rank: u32) -> Vec<u8> {
        match rank {
            0 => Vec::new(),
            1 => (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect(),
            r => format!("rank-{r}").into_bytes(),
        }
    }

    fn root(timeout: Duration) -> (UniqueId, RootServer) {
        create_unique_id_with_timeout(LOCAL4, timeout).expect("root")
    }

    type Joined = Result<(Bootstrap, Vec<Vec<u8>>)>;

    fn spawn_rank(
        id: UniqueId,
        rank: u32,
        nranks: u32,
        payload: Vec<u8>,
        t: Duration,
    ) -> std::thread::JoinHandle<Joined> {
        std::thread::spawn(move || Bootstrap::connect(&id, rank, nranks, &payload, t))
    }

    fn err_text<T: fmt::Debug>(r: Result<T>) -> String {
        match r {
            Ok(v) => panic!("expected an error, got {v:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn unique_id_text_roundtrip() {
        let id = UniqueId {
            addr: "127.0.0.1:4000".parse().unwrap(),
            secret: [0xab; 16],
        };
        assert_eq!(
            id.to_string(),
            "127.0.0.1:4000/abababababababababababababababab"
        );
        assert_eq!(id.to_string().parse::<UniqueId>().unwrap(), id);
        let id6: UniqueId = "[::1]:4000/00112233445566778899aabbccddeeff"
            .parse()
            .unwrap();
        assert_eq!(id6.addr, "[::1]:4000".parse::<SocketAddr>().unwrap());
        assert_eq!(id6.secret[1], 0x11);
        assert_eq!(
            id6.to_string(),
            "[::1]:4000/00112233445566778899aabbccddeeff"
        );
        assert!(
            !format!("{id:?}").contains("abab"),
            "Debug must not leak the secret"
        );
        for bad in [
            "",
            "127.0.0.1:4000",
            "127.0.0.1/00112233445566778899aabbccddeeff",
            "127.0.0.1:4000/0011",
            "127.0.0.1:4000/00112233445566778899aabbccddeefg",
            "host:4000/00112233445566778899aabbccddeeff",
        ] {
            let e = bad.parse::<UniqueId>().unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e}");
            assert!(e.to_string().contains("<ip>:<port>/<32 hex digits>"), "{e}");
        }
        let g1 = UniqueId::generate(LOCAL4).unwrap();
        let g2 = UniqueId::generate(LOCAL4).unwrap();
        assert_ne!(g1.secret, g2.secret);
    }

    #[test]
    fn formatting_helpers() {
        assert_eq!(fmt_ranks(&[3]), "rank 3");
        assert_eq!(fmt_ranks(&[1, 3]), "ranks 1, 3");
        assert_eq!(fmt_ranks(&[0, 1, 2, 3, 5, 6, 9]), "ranks 0-3, 5, 6, 9");
        assert_eq!(fmt_dur(Duration::from_secs(5)), "5s");
        assert_eq!(fmt_dur(Duration::from_millis(2500)), "2.5s");
        assert_eq!(fmt_dur(Duration::from_millis(300)), "300ms");
    }

    fn four_ranks_roundtrip(bind: SocketAddr) {
        let t = Duration::from_secs(10);
        let (id, server) = create_unique_id_with_timeout(bind, t).expect("root");
        assert_ne!(id.addr.port(), 0);
        let n = 4;
        let handles: Vec<_> = (0..n)
            .map(|r| {
                std::thread::spawn(move || -> Result<()> {
                    let (b, all) = Bootstrap::connect(&id, r, n, &payload_for(r), t)?;
                    assert_eq!(b.rank(), r);
                    assert_eq!(b.nranks(), n);
                    let want: Vec<Vec<u8>> = (0..n).map(payload_for).collect();
                    assert_eq!(all, want);
                    for round in 0..5u32 {
                        let mine = format!("r{r}x{round}").into_bytes();
                        let got = b.allgather(&mine)?;
                        let want: Vec<Vec<u8>> = (0..n)
                            .map(|s| format!("r{s}x{round}").into_bytes())
                            .collect();
                        assert_eq!(got, want);
                        b.barrier()?;
                    }
                    // a big round: 1 MiB from everyone
                    let big = vec![r as u8; 1 << 20];
                    let got = b.allgather(&big)?;
                    for (s, g) in got.iter().enumerate() {
                        assert_eq!(g.len(), 1 << 20);
                        assert!(g.iter().all(|&x| x == s as u8));
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().expect("rank thread").expect("rank");
        }
        // All ranks left after finishing: the root ends cleanly.
        server.join().expect("root outcome");
    }

    #[test]
    fn four_ranks_allgather_ipv4() {
        four_ranks_roundtrip(LOCAL4);
    }

    #[test]
    fn four_ranks_allgather_ipv6() {
        let a6 = SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 0);
        if TcpListener::bind(a6).is_err() {
            println!("skipping: cannot bind [::1]");
            return;
        }
        four_ranks_roundtrip(a6);
    }

    #[test]
    fn single_rank() {
        let t = Duration::from_secs(5);
        let (id, server) = root(t);
        let (b, all) = Bootstrap::connect(&id, 0, 1, b"solo", t).unwrap();
        assert_eq!(all, vec![b"solo".to_vec()]);
        assert_eq!(b.allgather(b"x").unwrap(), vec![b"x".to_vec()]);
        let max = vec![7u8; MAX_PAYLOAD];
        assert_eq!(b.allgather(&max).unwrap(), vec![max.clone()]);
        drop(b);
        server.join().unwrap();
        // The largest payload also fits in the hello.
        let (id, server) = root(t);
        let (b, all) = Bootstrap::connect(&id, 0, 1, &max, t).unwrap();
        assert_eq!(all, vec![max]);
        drop(b);
        server.join().unwrap();
    }

    #[test]
    fn root_started_after_clients() {
        let t = Duration::from_secs(10);
        let listener = TcpListener::bind(LOCAL4).unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener); // free the port; the root binds it later
        let id = UniqueId::generate(addr).unwrap();
        let hs: Vec<_> = (0..3)
            .map(|r| spawn_rank(id, r, 3, vec![r as u8], t))
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let server = RootServer::bind(&id, t).unwrap();
        for h in hs {
            let (_, all) = h.join().unwrap().unwrap();
            assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
        }
        server.join().unwrap();
    }

    #[test]
    fn wrong_secret_rejected_others_succeed() {
        let t = Duration::from_secs(10);
        let (id, server) = root(t);
        let mut bad = id;
        bad.secret[0] ^= 1;
        // The impostor claims rank 1 and arrives first.
        let e = err_text(Bootstrap::connect(&bad, 1, 3, b"evil", t));
        assert!(e.contains("secret did not match"), "{e}");
        assert!(e.contains("UniqueId"), "{e}");
        let hs: Vec<_> = (0..3)
            .map(|r| spawn_rank(id, r, 3, vec![r as u8], t))
            .collect();
        for h in hs {
            let (b, all) = h.join().unwrap().unwrap();
            assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
            drop(b);
        }
        server.join().unwrap();
    }

    #[test]
    fn disagreeing_nranks_reported_to_all() {
        let t = Duration::from_secs(5);
        let (id, server) = root(t);
        let start = Instant::now();
        let r0 = spawn_rank(id, 0, 4, vec![], t);
        let r1 = spawn_rank(id, 1, 4, vec![], t);
        std::thread::sleep(Duration::from_millis(300));
        let r3 = spawn_rank(id, 3, 5, vec![], t);
        for h in [r0, r1, r3] {
            let e = err_text(h.join().unwrap());
            assert!(e.contains("rank 3 says nranks=5"), "{e}");
            assert!(e.contains("says 4"), "{e}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
        let e = err_text(server.join());
        assert!(e.contains("rank 3 says nranks=5"), "{e}");
    }

    #[test]
    fn duplicate_rank_reported() {
        let t = Duration::from_secs(5);
        let (id, server) = root(t);
        let a = spawn_rank(id, 2, 3, vec![], t);
        let b0 = spawn_rank(id, 0, 3, vec![], t);
        std::thread::sleep(Duration::from_millis(300));
        let b = spawn_rank(id, 2, 3, vec![], t);
        for h in [a, b0, b] {
            let e = err_text(h.join().unwrap());
            assert!(e.contains("rank 2 joined twice"), "{e}");
        }
        assert!(err_text(server.join()).contains("rank 2 joined twice"));
    }

    #[test]
    fn out_of_range_rank_rejected_locally() {
        let id = UniqueId::generate(LOCAL4).unwrap();
        let e = Bootstrap::connect(&id, 4, 4, b"", Duration::from_secs(1)).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)));
        assert!(e.to_string().contains("rank 4 is out of range"), "{e}");
        let e = Bootstrap::connect(&id, 0, 0, b"", Duration::from_secs(1)).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }

    /// A misbehaving client that passes the handshake with a rank >= nranks.
    #[test]
    fn out_of_range_rank_reported_by_root() {
        let t = Duration::from_secs(5);
        let (id, server) = root(t);
        let r0 = spawn_rank(id, 0, 2, vec![], t);
        std::thread::sleep(Duration::from_millis(200));
        let mut s = TcpStream::connect(id.addr).unwrap();
        let mut w = Wire {
            stream: &mut s,
            root: id.addr,
            timeout: t,
            abort: None,
        };
        let dl = Instant::now() + t;
        let (_, body) = w.read_frame(dl, "test").unwrap();
        let rnonce = &body[12..];
        let cnonce = [7u8; NONCE_LEN];
        let (rank, nranks) = (5u32, 2u32);
        let mut hello = Vec::new();
        hello.extend_from_slice(&MAGIC);
        hello.extend_from_slice(&VERSION.to_be_bytes());
        hello.extend_from_slice(&rank.to_be_bytes());
        hello.extend_from_slice(&nranks.to_be_bytes());
        hello.extend_from_slice(&cnonce);
        hello.extend_from_slice(&client_mac(&id.secret, rnonce, &cnonce, rank, nranks));
        let hdr = frame_header(K_HELLO, hello.len());
        w.write_all(&[&hdr, &hello], dl, "test").unwrap();
        let e = err_text(w.read_frame(dl, "test"));
        assert!(e.contains("rank 5 is out of range"), "{e}");
        let e = err_text(r0.join().unwrap());
        assert!(e.contains("rank 5 is out of range"), "{e}");
        drop(server);
    }

    #[test]
    fn missing_ranks_named_within_timeout() {
        let t = Duration::from_millis(1500);
        let (id, server) = root(t);
        let start = Instant::now();
        let hs: Vec<_> = [0u32, 2]
            .iter()
            .map(|&r| spawn_rank(id, r, 4, vec![], t))
            .collect();
        for h in hs {
            let e = err_text(h.join().unwrap());
            assert!(e.contains("ranks 1, 3 did not join within 1.5s"), "{e}");
        }
        let el = start.elapsed();
        assert!(
            el >= Duration::from_millis(1400) && el < Duration::from_millis(2500),
            "{el:?}"
        );
        assert!(err_text(server.join()).contains("ranks 1, 3 did not join"));
    }

    #[test]
    fn client_without_root_times_out_naming_root() {
        let listener = TcpListener::bind(LOCAL4).unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let id = UniqueId::generate(addr).unwrap();
        let start = Instant::now();
        let e = err_text(Bootstrap::connect(
            &id,
            0,
            2,
            b"",
            Duration::from_millis(700),
        ));
        assert!(e.contains(&addr.to_string()), "{e}");
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn root_that_vanishes_is_reported() {
        // A "root" that accepts and then says nothing.
        let listener = TcpListener::bind(LOCAL4).unwrap();
        let addr = listener.local_addr().unwrap();
        let id = UniqueId::generate(addr).unwrap();
        let silent = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            std::thread::sleep(Duration::from_millis(1500));
            drop(s);
        });
        let start = Instant::now();
        let e = err_text(Bootstrap::connect(
            &id,
            0,
            2,
            b"",
            Duration::from_millis(800),
        ));
        assert!(
            e.contains(&addr.to_string()) && e.contains("no answer"),
            "{e}"
        );
        assert!(start.elapsed() < Duration::from_millis(1400));
        silent.join().unwrap();
    }

    #[test]
    fn garbage_and_oversized_frames_do_not_break_root() {
        let t = Duration::from_secs(10);
        let (id, server) = root(t);
        let addr = id.addr;
        // Strangers: HTTP, an oversized length, a truncated frame, a wrong magic,
        // a silent connection.
        let mut strangers = Vec::new();
        for junk in [
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
            {
                let mut v = u32::MAX.to_be_bytes().to_vec();
                v.extend_from_slice(&[K_HELLO; 100]);
                v
            },
            {
                let mut v = 1000u32.to_be_bytes().to_vec();
                v.extend_from_slice(&[K_HELLO; 10]);
                v
            },
            {
                let mut v = frame_header(K_HELLO, 100).to_vec();
                v.extend_from_slice(&[0x55; 100]);
                v
            },
            Vec::new(),
        ] {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&junk).unwrap();
            strangers.push(s);
        }
        let hs: Vec<_> = (0..4u32)
            .map(|r| {
                std::thread::spawn(move || -> Result<Vec<Vec<u8>>> {
                    let (b, _) = Bootstrap::connect(&id, r, 4, &[r as u8], t)?;
                    b.allgather(&[r as u8 + 10])
                })
            })
            .collect();
        for h in hs {
            let got = h.join().unwrap().unwrap();
            assert_eq!(got, vec![vec![10], vec![11], vec![12], vec![13]]);
        }
        // The oversized-length stranger was dropped by the root: its read sees EOF.
        let mut s = &strangers[1];
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = vec![0u8; 4096];
        let mut total = 0;
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => total += n,
                Err(e) => panic!("expected EOF from the root, got {e}"),
            }
        }
        assert!(
            total > 0 && total < 200,
            "challenge only, got {total} bytes"
        );
        server.join().unwrap();
    }

    /// A stranger that connects and reads the root's challenge.
    fn stranger(id: &UniqueId, t: Duration) -> (TcpStream, [u8; NONCE_LEN]) {
        let mut s = TcpStream::connect(id.addr).unwrap();
        let mut w = Wire {
            stream: &mut s,
            root: id.addr,
            timeout: t,
            abort: None,
        };
        let (kind, body) = w.read_frame(Instant::now() + t, "test").unwrap();
        let nonce = parse_challenge(kind, &body).unwrap();
        (s, nonce)
    }

    /// Reads what the root says to a stranger: its error message, or
    /// "EOF" when it closes without one. Fails if nothing comes within `t`.
    fn root_verdict(s: &mut TcpStream, id: &UniqueId, t: Duration) -> String {
        let mut w = Wire {
            stream: s,
            root: id.addr,
            timeout: t,
            abort: None,
        };
        match w.read_raw_frame(Instant::now() + t, "test") {
            Ok((K_ERROR, body)) => String::from_utf8_lossy(&body).into_owned(),
            Ok((kind, _)) => panic!("the root answered a stranger with a frame of kind {kind}"),
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains("closed the connection"), "{e}");
                "EOF".into()
            }
        }
    }

    #[test]
    fn strangers_are_refused_early_and_ranks_still_join() {
        let t = Duration::from_secs(10);
        let (id, server) = root(t);
        let quick = Duration::from_secs(3);

        // A wrong secret in a hello that announces the largest frame: the
        // root answers after the hello's fixed part, without waiting for
        // (or buffering) the 16 MiB it announced.
        let (mut a, _) = stranger(&id, t);
        let fixed = HelloFixed {
            rank: 0,
            nranks: 3,
            cnonce: [7; NONCE_LEN],
            mac: [0; MAC_LEN],
        };
        a.write_all(&hello_header(MAX_PAYLOAD)).unwrap();
        a.write_all(&fixed.encode()).unwrap();
        let start = Instant::now();
        let v = root_verdict(&mut a, &id, quick);
        assert!(v.contains("secret did not match"), "{v}");
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );

        // The right secret, but the hello is cut short and the stranger
        // leaves: it never counts as rank 1.
        let (mut b, nonce) = stranger(&id, t);
        let hello = fuzzing::hello_frame(&id.secret, &nonce, &[9; NONCE_LEN], 1, 3, &[1; 100]);
        b.write_all(&hello[..hello.len() - 10]).unwrap();
        b.shutdown(Shutdown::Write).unwrap();
        assert_eq!(root_verdict(&mut b, &id, quick), "EOF");

        // Another protocol version is told so.
        let (mut c, _) = stranger(&id, t);
        let mut v2 = hello_header(0).to_vec();
        v2.extend_from_slice(&fixed.encode());
        v2[5 + 11] = 2;
        c.write_all(&v2).unwrap();
        let v = root_verdict(&mut c, &id, quick);
        assert!(
            v.contains("version mismatch") && v.contains("this rank v2"),
            "{v}"
        );

        // An empty frame, a frame of another kind, a hello too short to be
        // one: dropped without an answer.
        for junk in [
            vec![0, 0, 0, 0],
            frame_header(K_DATA, 3)
                .iter()
                .chain(&[1, 2, 3])
                .copied()
                .collect(),
            {
                let mut v = frame_header(K_HELLO, 40).to_vec();
                v.extend_from_slice(&fixed.encode()[..40]);
                v
            },
        ] {
            let (mut d, _) = stranger(&id, t);
            d.write_all(&junk).unwrap();
            assert_eq!(root_verdict(&mut d, &id, quick), "EOF", "{junk:?}");
        }

        // The real ranks, rank 1 included, still join and work.
        let hs: Vec<_> = (0..3u32)
            .map(|r| {
                std::thread::spawn(move || -> Result<Vec<Vec<u8>>> {
                    let (b, all) = Bootstrap::connect(&id, r, 3, &[r as u8], t)?;
                    assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
                    b.allgather(&[r as u8 + 10])
                })
            })
            .collect();
        for h in hs {
            assert_eq!(
                h.join().unwrap().unwrap(),
                vec![vec![10], vec![11], vec![12]]
            );
        }
        server.join().unwrap();
    }

    /// The root's early check agrees with the check of the complete hello
    /// on every prefix of valid and broken hellos.
    #[test]
    fn hello_prefix_agrees_with_the_complete_hello() {
        let secret = [3u8; 16];
        let rnonce = [4u8; NONCE_LEN];
        let good = fuzzing::hello_frame(&secret, &rnonce, &[5; NONCE_LEN], 2, 4, b"payload");
        let mut bad_magic = good.clone();
        bad_magic[5] ^= 1;
        let mut v9 = good.clone();
        v9[5 + 11] = 9;
        for (frame, want) in [
            (&good, None),
            (&bad_magic, Some(HelloError::Magic)),
            (&v9, Some(HelloError::Version(9))),
        ] {
            for k in 0..frame.len() {
                match hello_prefix(&frame[..k]) {
                    Ok(None) => assert!(k < HELLO_PREFIX, "undecided at {k}"),
                    Ok(Some(h)) => {
                        assert!(want.is_none() && k >= HELLO_PREFIX);
                        assert!(h.proves(&secret, &rnonce));
                        assert!(!h.proves(&[0; 16], &rnonce));
                    }
                    Err(e) => assert_eq!(Some(e), want, "at {k}"),
                }
            }
            let full = parse_hello(frame[4], &frame[5..]);
            match &want {
                None => assert_eq!(full.unwrap().1, b"payload"),
                Some(e) => assert_eq!(full.unwrap_err(), *e),
            }
        }
        let mut huge = good.clone();
        huge[..4].copy_from_slice(&((MAX_FRAME + 1) as u32).to_be_bytes());
        assert_eq!(
            hello_prefix(&huge[..4]),
            Err(HelloError::Length(MAX_FRAME + 1))
        );
    }

    #[test]
    fn rank_leaving_mid_allgather_is_named() {
        let t = Duration::from_secs(5);
        let (id, server) = root(t);
        let sync = Arc::new(StdBarrier::new(4));
        let hs: Vec<_> = (0..4u32)
            .map(|r| {
                let sync = sync.clone();
                std::thread::spawn(move || -> Result<()> {
                    let (b, _) = Bootstrap::connect(&id, r, 4, &[], t)?;
                    b.allgather(b"one")?;
                    sync.wait();
                    if r == 2 {
                        drop(b);
                        return Ok(());
                    }
                    // Make sure the others are mid-round when rank 2 leaves.
                    b.allgather(b"two").map(|_| ())
                })
            })
            .collect();
        let start = Instant::now();
        for (r, h) in hs.into_iter().enumerate() {
            let out = h.join().unwrap();
            if r == 2 {
                out.unwrap();
            } else {
                let e = err_text(out);
                assert!(e.contains("rank 2 left the bootstrap"), "rank {r}: {e}");
            }
        }
        assert!(start.elapsed() < Duration::from_secs(4));
        // The root may see rank 2 leave before or after the others' contributions.
        let _ = server.join();
    }

    #[test]
    fn round_timeout_names_the_missing_rank() {
        let t = Duration::from_millis(1000);
        let (id, server) = root(t);
        let sync = Arc::new(StdBarrier::new(3));
        let hs: Vec<_> = (0..3u32)
            .map(|r| {
                let sync = sync.clone();
                std::thread::spawn(move || -> Result<()> {
                    let (b, _) = Bootstrap::connect(&id, r, 3, &[], t)?;
                    sync.wait();
                    if r == 1 {
                        // Rank 1 stays connected but never contributes in time.
                        std::thread::sleep(Duration::from_millis(2000));
                        return Ok(());
                    }
                    b.allgather(b"x").map(|_| ())
                })
            })
            .collect();
        let start = Instant::now();
        for (r, h) in hs.into_iter().enumerate() {
            let out = h.join().unwrap();
            if r != 1 {
                let e = err_text(out);
                assert!(e.contains("rank 1 did not reach bootstrap round 1"), "{e}");
            }
        }
        assert!(start.elapsed() < Duration::from_millis(2600));
        assert!(err_text(server.join()).contains("rank 1 did not reach"));
    }

    #[test]
    fn bind_address_in_use_says_so() {
        let l = TcpListener::bind(LOCAL4).unwrap();
        let id = UniqueId::generate(l.local_addr().unwrap()).unwrap();
        let e = RootServer::bind(&id, Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("address in use"), "{e}");
    }

    #[test]
    fn huge_timeouts_do_not_overflow() {
        let (id, server) = root(Duration::MAX);
        let (b, _) = Bootstrap::connect(&id, 0, 1, b"", Duration::MAX).unwrap();
        b.barrier().unwrap();
        drop(b);
        server.join().unwrap();
    }

    #[test]
    fn shutdown_and_drop_do_not_hang() {
        let t = Duration::from_secs(60);
        let (_id, server) = root(t);
        let start = Instant::now();
        server.shutdown().unwrap();
        assert!(start.elapsed() < Duration::from_secs(2));
        let (_id, server) = root(t);
        drop(server);
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn oversized_payload_rejected() {
        let id = UniqueId::generate(LOCAL4).unwrap();
        let big = vec![0u8; MAX_PAYLOAD + 1];
        let e = Bootstrap::connect(&id, 0, 1, &big, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
}
