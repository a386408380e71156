//! The bootstrap's decoders and encoders over plain bytes, for the fuzz
//! targets in `fuzz/` and their seed corpus (feature `internals`, re-exported
//! as `braid::internals::bootstrap`). Not part of the API: the signatures
//! follow the wire format and change with it.

use std::io::{self, Read};
use std::result::Result;

use super::wire::{
    accept_frame as accept_bytes, challenge_frame as challenge_bytes, client_mac, contrib_header,
    ct_eq, data_header, error_frame as error_bytes, hello_header, read_frame_with, root_mac,
    FrameBuf, FrameError, HelloError, HelloFixed, K_ACCEPT, K_CHALLENGE, K_CONTRIB, K_DATA,
    K_ERROR, K_HELLO, K_LEFT, READ_CHUNK,
};

/// Largest frame on the wire.
pub const MAX_FRAME: usize = super::wire::MAX_FRAME;
/// Bytes of a hello's fixed part.
pub const HELLO_FIXED: usize = super::wire::HELLO_FIXED;
/// Bytes the root reads from a connection before the proof.
pub const HELLO_PREFIX: usize = super::wire::HELLO_PREFIX;
/// Bytes of a nonce.
pub const NONCE_LEN: usize = super::wire::NONCE_LEN;
/// Bytes of a MAC.
pub const MAC_LEN: usize = super::wire::MAC_LEN;
/// Frame kinds.
pub const KINDS: [(u8, &str); 7] = [
    (K_CHALLENGE, "challenge"),
    (K_HELLO, "hello"),
    (K_ACCEPT, "accept"),
    (K_ERROR, "error"),
    (K_DATA, "data"),
    (K_CONTRIB, "contrib"),
    (K_LEFT, "left"),
];

/// A complete frame of `kind` around `body`, as the bootstrap writes it.
pub fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut v = super::wire::frame_header(kind, body.len()).to_vec();
    v.extend_from_slice(body);
    v
}

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
    super::wire::hello_prefix(buf)
        .map(|h| h.map(hello_tuple))
        .map_err(hello_error)
}

/// The root's decoder of a complete hello frame: fixed part and payload.
pub fn parse_hello(kind: u8, body: &[u8]) -> Result<(Hello, Vec<u8>), String> {
    super::wire::parse_hello(kind, body)
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
    super::wire::parse_contrib(body).map(|(r, d)| (r, d.to_vec()))
}

/// A complete `CONTRIB` frame.
pub fn contrib_frame(round: u64, data: &[u8]) -> Vec<u8> {
    let mut v = contrib_header(round, data.len());
    v.extend_from_slice(data);
    v
}

/// The client's decoder of the challenge: the root's nonce.
pub fn parse_challenge(kind: u8, body: &[u8]) -> Result<[u8; NONCE_LEN], String> {
    super::wire::parse_challenge(kind, body).map_err(|e| format!("{e:?}"))
}

/// A complete `CHALLENGE` frame.
pub fn challenge_frame(nonce: &[u8; NONCE_LEN]) -> Vec<u8> {
    challenge_bytes(nonce)
}

/// A complete `ACCEPT` frame proving `secret` to the client.
pub fn accept_frame(
    secret: &[u8; 16],
    cnonce: &[u8; NONCE_LEN],
    root_nonce: &[u8; NONCE_LEN],
    rank: u32,
) -> Vec<u8> {
    accept_bytes(&root_mac(secret, cnonce, root_nonce, rank))
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
    super::wire::parse_data(kind, body, round, want).map(<[u8]>::to_vec)
}

/// A complete `DATA` frame.
pub fn data_frame(round: u64, src: u32, data: &[u8]) -> Vec<u8> {
    let mut v = data_header(round, src, data.len());
    v.extend_from_slice(data);
    v
}

/// A complete `ERROR` frame (the message is cut at 64 KiB).
pub fn error_frame(msg: &str) -> Vec<u8> {
    error_bytes(msg)
}
