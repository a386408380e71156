//! The bootstrap's wire format: frames, their encoders and decoders, and the
//! proofs (MACs) of the secret. Pure: the root's state machine and the
//! client call these on what arrived, and the fuzz targets on anything.
//!
//! Every message is a frame: a little-endian `u32` length `n` (at most
//! [`MAX_FRAME`]), then `n` bytes: one kind byte and the body. Integers in
//! bodies are little-endian too and are read with [`braid_core::wire::Reader`].
//! A peer of another protocol version that frames the same way (v2 and
//! later) is told the versions ([`HelloError::Version`],
//! [`ChallengeError::Version`]); v1's big-endian framing, never released, is
//! refused as a bad frame length like any other stranger.

use std::io;

use braid_core::wire::Reader;
use sha2::{Digest, Sha256};

/// Largest payload one rank may contribute to one round (16 MiB).
pub(super) const MAX_PAYLOAD: usize = 16 << 20;
/// Largest frame on the wire: a payload plus its headers.
pub(super) const MAX_FRAME: usize = MAX_PAYLOAD + 256;
/// Largest number of ranks a bootstrap accepts.
pub(super) const MAX_RANKS: u32 = 1 << 22;

pub(crate) const MAGIC: [u8; 8] = *b"BRAIDBS\x01";
/// Protocol version: 2 is v1 (big-endian) made little-endian; 3 moves the
/// all-gathers from the root onto a ring among the ranks (the root hands
/// each rank its successor's address and afterwards only counts rounds).
pub(crate) const VERSION: u32 = 3;
pub(crate) const NONCE_LEN: usize = 32;
pub(crate) const MAC_LEN: usize = 32;
/// Bytes the root reads from a connection at a time.
pub(crate) const READ_CHUNK: usize = 256 << 10;
/// Longest error message sent in one frame.
const MAX_ERROR_MSG: usize = 64 << 10;

pub(crate) const K_CHALLENGE: u8 = 1;
pub(crate) const K_HELLO: u8 = 2;
pub(crate) const K_ACCEPT: u8 = 3;
pub(crate) const K_ERROR: u8 = 4;
pub(crate) const K_DATA: u8 = 5;
pub(crate) const K_CONTRIB: u8 = 6;
/// Root → rank, once all joined: the successor's hello payload (its
/// listening address).
pub(crate) const K_RING: u8 = 7;
/// Rank → rank: the first frame on the ring connection to the successor.
pub(crate) const K_RING_HELLO: u8 = 8;
/// Rank → rank: a point-to-point exchange request (lower rank to higher).
pub(crate) const K_XCHG: u8 = 9;
/// Rank → rank: the answer to [`K_XCHG`], on the same connection.
pub(crate) const K_XREPLY: u8 = 10;
/// Rank → rank: "are you there?" (connection attempts that test whether a
/// rank's listener is still open); no body, never answered.
pub(crate) const K_PROBE: u8 = 11;
/// Root → rank: a rank left after the last round it started (the end of a
/// job, or the root shut down); the body says which. Unlike [`K_ERROR`] it
/// does not fail a round under way: the ranks still on the ring finish it
/// (the one that left forwarded all it had to); the next round fails with it.
pub(crate) const K_LEFT: u8 = 12;

/// Largest first frame a rank reads from a connection to its listener (a
/// ring hello, an exchange request or a probe).
pub(crate) const MAX_PEER_FRAME: usize = 1 << 20;

/// Bytes of a hello's fixed part: magic, version, rank, nranks, the client's
/// nonce and its MAC. The payload follows.
pub(crate) const HELLO_FIXED: usize = 8 + 4 + 4 + 4 + NONCE_LEN + MAC_LEN;
/// Bytes of a connection's first frame the root reads before it has checked
/// the proof of the secret: length, kind and the hello's fixed part. A
/// stranger cannot make the root buffer more than this.
pub(crate) const HELLO_PREFIX: usize = 5 + HELLO_FIXED;

// ---------------------------------------------------------------------------
// Proofs of the secret

pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The client's proof: `SHA-256("braid-bootstrap-client" ‖ secret ‖ root
/// nonce ‖ client nonce ‖ rank ‖ nranks)`.
pub(crate) fn client_mac(
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
    h.update(rank.to_le_bytes());
    h.update(nranks.to_le_bytes());
    h.finalize().into()
}

/// The root's proof: `SHA-256("braid-bootstrap-root" ‖ secret ‖ client
/// nonce ‖ root nonce ‖ rank)`.
pub(crate) fn root_mac(
    secret: &[u8; 16],
    client_nonce: &[u8],
    root_nonce: &[u8],
    rank: u32,
) -> [u8; MAC_LEN] {
    let mut h = Sha256::new();
    h.update(b"braid-bootstrap-root");
    h.update(secret);
    h.update(client_nonce);
    h.update(root_nonce);
    h.update(rank.to_le_bytes());
    h.finalize().into()
}

// ---------------------------------------------------------------------------
// Encoders

pub(crate) fn frame_header(kind: u8, body_len: usize) -> [u8; 5] {
    // body_len is bounded by MAX_FRAME at every call site.
    let n = (body_len + 1) as u32;
    let b = n.to_le_bytes();
    [b[0], b[1], b[2], b[3], kind]
}

/// The root's `CHALLENGE` frame.
pub(crate) fn challenge_frame(nonce: &[u8; NONCE_LEN]) -> Vec<u8> {
    let mut v = frame_header(K_CHALLENGE, 8 + 4 + NONCE_LEN).to_vec();
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&VERSION.to_le_bytes());
    v.extend_from_slice(nonce);
    v
}

/// The root's `ACCEPT` frame with its proof.
pub(crate) fn accept_frame(proof: &[u8; MAC_LEN]) -> Vec<u8> {
    let mut v = frame_header(K_ACCEPT, MAC_LEN).to_vec();
    v.extend_from_slice(proof);
    v
}

/// Frame header and fixed fields of a `DATA` frame; `len` bytes of data follow.
pub(crate) fn data_header(round: u64, src: u32, len: usize) -> Vec<u8> {
    let mut v = frame_header(K_DATA, 12 + len).to_vec();
    v.extend_from_slice(&round.to_le_bytes());
    v.extend_from_slice(&src.to_le_bytes());
    v
}

/// Frame header and round of a `CONTRIB` frame; `len` bytes of data follow.
pub(crate) fn contrib_header(round: u64, len: usize) -> Vec<u8> {
    let mut v = frame_header(K_CONTRIB, 8 + len).to_vec();
    v.extend_from_slice(&round.to_le_bytes());
    v
}

/// Frame header of a `HELLO` frame whose payload has `payload_len` bytes;
/// the fixed part ([`HelloFixed::encode`]) and the payload follow.
pub(crate) fn hello_header(payload_len: usize) -> [u8; 5] {
    frame_header(K_HELLO, HELLO_FIXED + payload_len)
}

fn cut_message(msg: &str) -> &[u8] {
    let m = msg.as_bytes();
    &m[..m.len().min(MAX_ERROR_MSG)]
}

/// An `ERROR` frame (the message is cut at 64 KiB).
pub(crate) fn error_frame(msg: &str) -> Vec<u8> {
    let m = cut_message(msg);
    let mut v = frame_header(K_ERROR, m.len()).to_vec();
    v.extend_from_slice(m);
    v
}

/// A [`K_LEFT`] frame (the message is cut at 64 KiB).
pub(crate) fn left_frame(msg: &str) -> Vec<u8> {
    let m = cut_message(msg);
    let mut v = frame_header(K_LEFT, m.len()).to_vec();
    v.extend_from_slice(m);
    v
}

// ---------------------------------------------------------------------------
// Rank-to-rank frames (protocol v3)

/// The proof on a rank-to-rank frame: `SHA-256(label ‖ secret ‖ from ‖ to ‖
/// word ‖ nonce ‖ payload)`, where `word` is nranks for a ring hello and the
/// exchange's tag otherwise.
pub(crate) fn peer_mac(
    label: &[u8],
    secret: &[u8; 16],
    from: u32,
    to: u32,
    word: u64,
    nonce: &[u8; 16],
    payload: &[u8],
) -> [u8; MAC_LEN] {
    let mut h = Sha256::new();
    h.update(label);
    h.update(secret);
    h.update(from.to_le_bytes());
    h.update(to.to_le_bytes());
    h.update(word.to_le_bytes());
    h.update(nonce);
    h.update(payload);
    h.finalize().into()
}

pub(crate) const LABEL_RING: &[u8] = b"braid-bootstrap-ring";
pub(crate) const LABEL_XCHG: &[u8] = b"braid-bootstrap-xchg";
pub(crate) const LABEL_XREPLY: &[u8] = b"braid-bootstrap-xreply";

/// A rank-to-rank frame's fixed part: magic, version, `from`, `to`, a word
/// (nranks or tag), a nonce and the proof; a payload follows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PeerFrame {
    pub from: u32,
    pub to: u32,
    pub word: u64,
    pub nonce: [u8; 16],
    pub mac: [u8; MAC_LEN],
    pub payload: Vec<u8>,
}

/// Bytes of [`PeerFrame`]'s fixed part.
pub(crate) const PEER_FIXED: usize = 8 + 4 + 4 + 4 + 8 + 16 + MAC_LEN;

impl PeerFrame {
    /// A frame of `kind` proved with `secret` (`label` per kind).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sealed(
        kind: u8,
        secret: &[u8; 16],
        from: u32,
        to: u32,
        word: u64,
        nonce: [u8; 16],
        payload: &[u8],
    ) -> Vec<u8> {
        let mac = peer_mac(label_of(kind), secret, from, to, word, &nonce, payload);
        let mut v = frame_header(kind, PEER_FIXED + payload.len()).to_vec();
        v.extend_from_slice(&MAGIC);
        v.extend_from_slice(&VERSION.to_le_bytes());
        v.extend_from_slice(&from.to_le_bytes());
        v.extend_from_slice(&to.to_le_bytes());
        v.extend_from_slice(&word.to_le_bytes());
        v.extend_from_slice(&nonce);
        v.extend_from_slice(&mac);
        v.extend_from_slice(payload);
        v
    }

    /// Decodes the body of a rank-to-rank frame (any of its kinds).
    pub(super) fn parse(body: &[u8]) -> Result<PeerFrame, String> {
        let mut r = Reader::new(body);
        let (Ok(magic), Ok(version)) = (r.arr::<8>(), r.u32()) else {
            return Err("truncated".into());
        };
        if magic != MAGIC {
            return Err("wrong magic (not a braid rank)".into());
        }
        if version != VERSION {
            return Err(format!(
                "bootstrap protocol v{version}, this rank speaks v{VERSION} (all ranks must run the same braid version)"
            ));
        }
        let fields = (r.u32(), r.u32(), r.u64(), r.arr::<16>(), r.arr::<MAC_LEN>());
        let (Ok(from), Ok(to), Ok(word), Ok(nonce), Ok(mac)) = fields else {
            return Err("truncated".into());
        };
        Ok(PeerFrame {
            from,
            to,
            word,
            nonce,
            mac,
            payload: body[PEER_FIXED..].to_vec(),
        })
    }

    /// Whether the frame, of `kind`, is proved with `secret`.
    pub(super) fn proves(&self, kind: u8, secret: &[u8; 16]) -> bool {
        let want = peer_mac(
            label_of(kind),
            secret,
            self.from,
            self.to,
            self.word,
            &self.nonce,
            &self.payload,
        );
        ct_eq(&self.mac, &want)
    }
}

fn label_of(kind: u8) -> &'static [u8] {
    match kind {
        K_RING_HELLO => LABEL_RING,
        K_XCHG => LABEL_XCHG,
        _ => LABEL_XREPLY,
    }
}

/// A rank's listening address as its hello payload carries it (family
/// byte, address, port, IPv6 scope id).
pub(crate) fn encode_addr(a: &std::net::SocketAddr) -> Vec<u8> {
    let mut v = Vec::with_capacity(27);
    match a {
        std::net::SocketAddr::V4(a) => {
            v.push(4);
            v.extend_from_slice(&a.ip().octets());
            v.extend_from_slice(&a.port().to_le_bytes());
        }
        std::net::SocketAddr::V6(a) => {
            v.push(6);
            v.extend_from_slice(&a.ip().octets());
            v.extend_from_slice(&a.port().to_le_bytes());
            v.extend_from_slice(&a.scope_id().to_le_bytes());
        }
    }
    v
}

/// Decodes [`encode_addr`]'s bytes at the start of `b`: the address and
/// how many bytes it took.
pub(crate) fn decode_addr(b: &[u8]) -> Option<(std::net::SocketAddr, usize)> {
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};
    let mut r = Reader::new(b);
    match r.u8().ok()? {
        4 => {
            let ip = r.arr::<4>().ok()?;
            let port = r.u16().ok()?;
            Some((SocketAddrV4::new(Ipv4Addr::from(ip), port).into(), 7))
        }
        6 => {
            let ip = r.arr::<16>().ok()?;
            let port = r.u16().ok()?;
            let scope = r.u32().ok()?;
            Some((
                SocketAddrV6::new(Ipv6Addr::from(ip), port, 0, scope).into(),
                23,
            ))
        }
        _ => None,
    }
}

// ---------------------------------------------------------------------------
// Decoders

/// The length field of a frame whose first bytes are `buf`, if all four
/// bytes are there.
fn frame_len(buf: &[u8]) -> Option<usize> {
    Reader::new(buf).u32().ok().map(|n| n as usize)
}

/// Accumulates bytes of one connection and cuts them into frames.
#[derive(Debug, Default)]
pub(crate) struct FrameBuf {
    pub buf: Vec<u8>,
}

impl FrameBuf {
    /// The next complete frame `(kind, body)`, or an error for a malformed
    /// length.
    pub(super) fn next_frame(&mut self) -> Result<Option<(u8, Vec<u8>)>, String> {
        let Some(n) = frame_len(&self.buf) else {
            return Ok(None);
        };
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
    pub(super) fn proves(&self, secret: &[u8; 16], root_nonce: &[u8; NONCE_LEN]) -> bool {
        let expect = client_mac(secret, root_nonce, &self.cnonce, self.rank, self.nranks);
        ct_eq(&self.mac, &expect)
    }

    /// The hello's fixed part on the wire (the payload follows it).
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(HELLO_FIXED);
        v.extend_from_slice(&MAGIC);
        v.extend_from_slice(&VERSION.to_le_bytes());
        v.extend_from_slice(&self.rank.to_le_bytes());
        v.extend_from_slice(&self.nranks.to_le_bytes());
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
fn hello_fixed(kind: u8, body_len: usize, avail: &[u8]) -> Result<Option<HelloFixed>, HelloError> {
    if kind != K_HELLO || body_len < 12 {
        return Err(HelloError::NotHello);
    }
    if avail.len() < 12 {
        return Ok(None);
    }
    let mut r = Reader::new(avail);
    let (Ok(magic), Ok(version)) = (r.arr::<8>(), r.u32()) else {
        return Ok(None);
    };
    if magic != MAGIC {
        return Err(HelloError::Magic);
    }
    if version != VERSION {
        return Err(HelloError::Version(version));
    }
    if body_len < HELLO_FIXED {
        return Err(HelloError::Truncated);
    }
    if avail.len() < HELLO_FIXED {
        return Ok(None);
    }
    let fields = (r.u32(), r.u32(), r.arr(), r.arr());
    let (Ok(rank), Ok(nranks), Ok(cnonce), Ok(mac)) = fields else {
        return Err(HelloError::Truncated);
    };
    Ok(Some(HelloFixed {
        rank,
        nranks,
        cnonce,
        mac,
    }))
}

/// Decodes the start of a connection's byte stream as a hello frame, as far
/// as the bytes go (at most [`HELLO_PREFIX`] of them matter).
pub(crate) fn hello_prefix(buf: &[u8]) -> Result<Option<HelloFixed>, HelloError> {
    let Some(n) = frame_len(buf) else {
        return Ok(None);
    };
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
pub(crate) fn parse_hello(kind: u8, body: &[u8]) -> Result<(HelloFixed, &[u8]), HelloError> {
    match hello_fixed(kind, body.len(), body)? {
        Some(h) => Ok((h, &body[HELLO_FIXED..])),
        // Unreachable: all `body.len()` bytes are there.
        None => Err(HelloError::Truncated),
    }
}

/// Decodes a `CONTRIB` body: `(round, data)`.
pub(crate) fn parse_contrib(body: &[u8]) -> Option<(u64, &[u8])> {
    let mut r = Reader::new(body);
    let round = r.u64().ok()?;
    let data = r.take(r.remaining()).ok()?;
    Some((round, data))
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
pub(crate) fn parse_challenge(kind: u8, body: &[u8]) -> Result<[u8; NONCE_LEN], ChallengeError> {
    if kind != K_CHALLENGE || body.len() != 8 + 4 + NONCE_LEN {
        return Err(ChallengeError::NotBraid);
    }
    let mut r = Reader::new(body);
    let (Ok(magic), Ok(version), Ok(nonce)) = (r.arr::<8>(), r.u32(), r.arr()) else {
        return Err(ChallengeError::NotBraid);
    };
    if magic != MAGIC {
        return Err(ChallengeError::NotBraid);
    }
    if version != VERSION {
        return Err(ChallengeError::Version(version));
    }
    Ok(nonce)
}

/// Checks one `DATA` frame of round `round` that must come from rank `want`;
/// returns its data, or what arrived instead.
pub(crate) fn parse_data(kind: u8, body: &[u8], round: u64, want: u32) -> Result<&[u8], String> {
    let mut r = Reader::new(body);
    let (Ok(got_round), Ok(src)) = (r.u64(), r.u32()) else {
        return Err("a truncated data message".into());
    };
    if kind != K_DATA || got_round != round || src != want {
        return Err(format!(
            "kind {kind} round {got_round} rank {src}, expected round {round} rank {want}"
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
) -> Result<(u8, Vec<u8>), FrameError> {
    let mut len = [0u8; 4];
    read_exact(&mut len).map_err(FrameError::Io)?;
    let n = frame_len(&len).unwrap_or(0);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(secret: &[u8; 16], rnonce: &[u8; NONCE_LEN], rank: u32, nranks: u32) -> Vec<u8> {
        let cnonce = [5; NONCE_LEN];
        let h = HelloFixed {
            rank,
            nranks,
            cnonce,
            mac: client_mac(secret, rnonce, &cnonce, rank, nranks),
        };
        [&hello_header(7)[..], &h.encode(), b"payload"].concat()
    }

    /// The root's early check agrees with the check of the complete hello
    /// on every prefix of valid and broken hellos.
    #[test]
    fn hello_prefix_agrees_with_the_complete_hello() {
        let secret = [3u8; 16];
        let rnonce = [4u8; NONCE_LEN];
        let good = hello(&secret, &rnonce, 2, 4);
        let mut bad_magic = good.clone();
        bad_magic[5] ^= 1;
        let mut v9 = good.clone();
        v9[5 + 8] = 9;
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
        huge[..4].copy_from_slice(&((MAX_FRAME + 1) as u32).to_le_bytes());
        assert_eq!(
            hello_prefix(&huge[..4]),
            Err(HelloError::Length(MAX_FRAME + 1))
        );
        assert_eq!(hello_prefix(&[0, 0, 0, 0]), Err(HelloError::Length(0)));
    }

    /// Integers are little-endian since v2 (v3 moved the rounds onto a
    /// ring of ranks); a big-endian (v1-framed) hello is refused by its
    /// length as soon as the length is in, like any frame of a stranger.
    #[test]
    fn little_endian_and_big_endian_refused() {
        assert_eq!(VERSION, 3);
        let f = challenge_frame(&[9; NONCE_LEN]);
        assert_eq!(&f[..5], &[45, 0, 0, 0, K_CHALLENGE]);
        assert_eq!(&f[5 + 8..5 + 12], &[3, 0, 0, 0]);
        assert_eq!(parse_challenge(f[4], &f[5..]), Ok([9; NONCE_LEN]));
        let d = [data_header(0x0102, 7, 1), vec![0xee]].concat();
        assert_eq!(&d[..5], &[14, 0, 0, 0, K_DATA]);
        assert_eq!(&d[5..7], &[2, 1]);
        assert_eq!(parse_data(d[4], &d[5..], 0x0102, 7), Ok(&[0xee][..]));
        assert_eq!(
            parse_contrib(&[5, 0, 0, 0, 0, 0, 0, 0, 1, 2]),
            Some((5, &[1, 2][..]))
        );
        assert_eq!(parse_contrib(&[5, 0, 0]), None);

        // A v1 hello: big-endian length, kind, magic, big-endian version 1.
        let mut v1 = 93u32.to_be_bytes().to_vec();
        v1.push(K_HELLO);
        v1.extend_from_slice(&MAGIC);
        v1.extend_from_slice(&1u32.to_be_bytes());
        v1.extend_from_slice(&[0; 80]);
        for k in 0..v1.len() {
            let want = if k < 4 {
                Ok(None)
            } else {
                Err(HelloError::Length(0x5d00_0000))
            };
            assert_eq!(hello_prefix(&v1[..k]), want, "at {k}");
        }
    }

    /// Rank-to-rank frames: proved with the secret, bound to their kind,
    /// ranks, word and payload; addresses round-trip.
    #[test]
    fn peer_frames_and_addresses() {
        let secret = [7u8; 16];
        let f = PeerFrame::sealed(K_XCHG, &secret, 1, 5, 42, [3; 16], b"blob");
        let mut fb = FrameBuf { buf: f };
        let (kind, body) = fb.next_frame().unwrap().unwrap();
        assert_eq!(kind, K_XCHG);
        let p = PeerFrame::parse(&body).unwrap();
        assert_eq!(
            (p.from, p.to, p.word, &p.payload[..]),
            (1, 5, 42, &b"blob"[..])
        );
        assert!(p.proves(K_XCHG, &secret));
        assert!(!p.proves(K_XREPLY, &secret), "bound to its kind");
        assert!(!p.proves(K_XCHG, &[8; 16]), "bound to the secret");
        let mut q = p.clone();
        q.word = 43;
        assert!(!q.proves(K_XCHG, &secret), "bound to the tag");
        for k in 0..body.len() {
            if let Ok(p) = PeerFrame::parse(&body[..k]) {
                assert!(!p.proves(K_XCHG, &secret), "a prefix of {k} bytes");
            }
        }
        let scoped = std::net::SocketAddrV6::new("fe80::1".parse().unwrap(), 80, 0, 7);
        for a in [
            "10.1.2.3:4567".parse().unwrap(),
            scoped.into(),
            "[::1]:1".parse().unwrap(),
        ] {
            let a: std::net::SocketAddr = a;
            let b = encode_addr(&a);
            assert_eq!(decode_addr(&b), Some((a, b.len())));
            assert_eq!(decode_addr(&b[..b.len() - 1]), None);
        }
        assert_eq!(decode_addr(&[5]), None);
    }

    #[test]
    fn frames_cut_in_any_pieces() {
        let stream = [
            challenge_frame(&[1; NONCE_LEN]),
            error_frame("why"),
            contrib_header(3, 0),
        ]
        .concat();
        for piece in [1, 2, 7, 1000] {
            let mut fb = FrameBuf::default();
            let mut got = Vec::new();
            for c in stream.chunks(piece) {
                fb.buf.extend_from_slice(c);
                while let Some(f) = fb.next_frame().unwrap() {
                    got.push(f);
                }
            }
            let kinds: Vec<u8> = got.iter().map(|f| f.0).collect();
            assert_eq!(kinds, [K_CHALLENGE, K_ERROR, K_CONTRIB]);
            assert_eq!(got[1].1, b"why");
        }
        let mut fb = FrameBuf {
            buf: vec![0, 0, 0, 0],
        };
        assert_eq!(fb.next_frame().unwrap_err(), "empty frame");
        let long = "x".repeat(100 << 10);
        assert_eq!(error_frame(&long).len(), 5 + (64 << 10));
    }
}
