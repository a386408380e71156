//! Wire formats: the connect-info blobs, the hello every socket starts with,
//! data-frame and control-frame headers. All integers are little-endian and
//! every blob has one exact length, so truncated, padded or foreign blobs
//! are rejected instead of half-parsed.
//!
//! Both blobs start with braid's connect-info header
//! ([`braid_core::wire::Header`]: magic `BRSK`, version, role byte 1 for the
//! receiver's blob, 2 for the sender's). Version 3 has the layout of
//! version 2 (whose header was decoded here); the bump marks the change of
//! decoder and its messages.
//!
//! The hello keeps its own header (magic `BRSH`, the same version, then the
//! socket's kind): the receiver does not know in advance which kind of
//! socket a hello opens, so it has no role to check.

use braid_core::wire::{Header, Reader, ROLE_RECEIVER, ROLE_SENDER};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

/// Wire version; bump on any change of the formats in this module.
pub const VERSION: u16 = 3;
/// The header of both connect-info blobs.
pub const HEADER: Header = Header {
    magic: *b"BRSK",
    version: VERSION,
    what: "socket",
};
/// `BRSH`: socket hellos.
pub const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"BRSH");

/// Largest slot size accepted (the frame header carries 32-bit offsets).
pub const MAX_SLOT_BYTES: usize = 1 << 30;
/// Most slots per connection.
pub const MAX_SLOTS: usize = 1024;
/// Most data sockets per connection (NCCL's product limit).
pub const MAX_NSOCKS: usize = 64;

/// Why a blob was rejected.
pub type ParseError = String;

/// Checks a slot geometry and socket count.
pub fn check_geometry(slot_bytes: usize, slots: usize, nsocks: usize) -> Result<(), String> {
    check_slot_bytes(slot_bytes)?;
    check_slots(slots)?;
    check_nsocks(nsocks)
}

/// Checks a slot size.
pub(crate) fn check_slot_bytes(slot_bytes: usize) -> Result<(), String> {
    if !(64..=MAX_SLOT_BYTES).contains(&slot_bytes) || !slot_bytes.is_multiple_of(64) {
        return Err(format!(
            "slot size {slot_bytes} must be a multiple of 64 between 64 and {MAX_SLOT_BYTES}"
        ));
    }
    Ok(())
}

/// Checks a slot count.
pub(crate) fn check_slots(slots: usize) -> Result<(), String> {
    if !(1..=MAX_SLOTS).contains(&slots) {
        return Err(format!("{slots} slots: must be 1 to {MAX_SLOTS}"));
    }
    Ok(())
}

/// Checks a data socket count.
pub(crate) fn check_nsocks(nsocks: usize) -> Result<(), String> {
    if !(1..=MAX_NSOCKS).contains(&nsocks) {
        return Err(format!("{nsocks} data sockets: must be 1 to {MAX_NSOCKS}"));
    }
    Ok(())
}

/// The receiving end's blob: where to connect and what to prove.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvInfo {
    /// Sending rank.
    pub from: u32,
    /// Receiving rank.
    pub to: u32,
    /// The listener's address.
    pub addr: SocketAddr,
    /// Random secret every socket's hello must carry.
    pub token: [u8; 16],
    /// Bytes per slot.
    pub slot_bytes: usize,
    /// Slots.
    pub slots: usize,
    /// Data sockets.
    pub nsocks: usize,
}

impl RecvInfo {
    /// Serialises.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(68);
        HEADER.write(&mut v, ROLE_RECEIVER);
        v.push(if self.addr.is_ipv4() { 4 } else { 6 });
        v.extend_from_slice(&self.from.to_le_bytes());
        v.extend_from_slice(&self.to.to_le_bytes());
        v.extend_from_slice(&self.token);
        v.extend_from_slice(&(self.slot_bytes as u32).to_le_bytes());
        v.extend_from_slice(&(self.slots as u32).to_le_bytes());
        v.extend_from_slice(&(self.nsocks as u32).to_le_bytes());
        v.extend_from_slice(&self.addr.port().to_le_bytes());
        v.extend_from_slice(&0u16.to_le_bytes());
        match self.addr {
            SocketAddr::V4(a) => v.extend_from_slice(&a.ip().octets()),
            SocketAddr::V6(a) => {
                v.extend_from_slice(&a.ip().octets());
                v.extend_from_slice(&a.scope_id().to_le_bytes());
            }
        }
        v
    }

    /// Parses and validates.
    pub fn decode(b: &[u8]) -> Result<RecvInfo, ParseError> {
        let mut r = Reader::new(b);
        HEADER.read(&mut r, ROLE_RECEIVER)?;
        let fam = r.u8()?;
        let from = r.u32()?;
        let to = r.u32()?;
        let token = r.arr::<16>()?;
        let slot_bytes = r.u32()? as usize;
        let slots = r.u32()? as usize;
        let nsocks = r.u32()? as usize;
        let port = r.u16()?;
        if r.u16()? != 0 {
            return Err("reserved field is not zero".into());
        }
        let addr = match fam {
            4 => SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(r.arr::<4>()?), port)),
            6 => {
                let ip = Ipv6Addr::from(r.arr::<16>()?);
                let scope = r.u32()?;
                SocketAddr::V6(SocketAddrV6::new(ip, port, 0, scope))
            }
            f => return Err(format!("unknown address family {f}")),
        };
        r.end()?;
        check_geometry(slot_bytes, slots, nsocks)?;
        if port == 0 || addr.ip().is_unspecified() || is_multicast(&addr.ip()) {
            return Err(format!("{addr} is not an address to connect to"));
        }
        if token == [0; 16] {
            return Err("zero token".into());
        }
        Ok(RecvInfo {
            from,
            to,
            addr,
            token,
            slot_bytes,
            slots,
            nsocks,
        })
    }
}

fn is_multicast(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => a.is_multicast() || a.is_broadcast(),
        IpAddr::V6(a) => a.is_multicast(),
    }
}

/// The sending end's blob: who it is and the nonce its hellos carry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendInfo {
    /// Sending rank.
    pub from: u32,
    /// Receiving rank.
    pub to: u32,
    /// Random value every hello of this sender carries.
    pub nonce: [u8; 16],
}

impl SendInfo {
    /// Blob length.
    pub const LEN: usize = 32;

    /// Serialises.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::LEN);
        HEADER.write(&mut v, ROLE_SENDER);
        v.push(0);
        v.extend_from_slice(&self.from.to_le_bytes());
        v.extend_from_slice(&self.to.to_le_bytes());
        v.extend_from_slice(&self.nonce);
        v
    }

    /// Parses and validates.
    pub fn decode(b: &[u8]) -> Result<SendInfo, ParseError> {
        let mut r = Reader::new(b);
        HEADER.read(&mut r, ROLE_SENDER)?;
        if r.u8()? != 0 {
            return Err("reserved field is not zero".into());
        }
        let from = r.u32()?;
        let to = r.u32()?;
        let nonce = r.arr::<16>()?;
        r.end()?;
        if nonce == [0; 16] {
            return Err("zero nonce".into());
        }
        Ok(SendInfo { from, to, nonce })
    }
}

/// What kind of socket a hello opens.
pub const KIND_DATA: u8 = 0;
/// The control socket.
pub const KIND_CTRL: u8 = 1;

/// The first bytes on every socket of a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// [`KIND_DATA`] or [`KIND_CTRL`].
    pub kind: u8,
    /// Data socket index (0 for control).
    pub index: u8,
    /// Sending rank.
    pub from: u32,
    /// Receiving rank.
    pub to: u32,
    /// The receiver's token.
    pub token: [u8; 16],
    /// The sender's nonce.
    pub nonce: [u8; 16],
}

impl Hello {
    /// Bytes on the wire.
    pub const LEN: usize = 48;

    /// Serialises.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut v = [0u8; Self::LEN];
        v[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        v[4..6].copy_from_slice(&VERSION.to_le_bytes());
        v[6] = self.kind;
        v[7] = self.index;
        v[8..12].copy_from_slice(&self.from.to_le_bytes());
        v[12..16].copy_from_slice(&self.to.to_le_bytes());
        v[16..32].copy_from_slice(&self.token);
        v[32..48].copy_from_slice(&self.nonce);
        v
    }

    /// Parses (the caller checks the values).
    pub fn decode(b: &[u8; Self::LEN]) -> Result<Hello, ParseError> {
        let mut r = Reader::new(b);
        if r.u32()? != HELLO_MAGIC {
            return Err("not a braid socket hello (bad magic)".into());
        }
        let v = r.u16()?;
        if v != VERSION {
            return Err(format!(
                "hello of wire version {v}, this build speaks {VERSION}"
            ));
        }
        Ok(Hello {
            kind: r.u8()?,
            index: r.u8()?,
            from: r.u32()?,
            to: r.u32()?,
            token: r.arr()?,
            nonce: r.arr()?,
        })
    }
}

/// Header of one piece of one message on a data socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Message sequence number (slot `seq % slots`).
    pub seq: u64,
    /// Whole message length.
    pub total: u32,
    /// Offset of this piece in the message.
    pub offset: u32,
    /// Length of this piece.
    pub len: u32,
    /// The message was committed by reference (`commit_direct`): the
    /// receiver reads its payload straight into the engine's destination
    /// instead of a slot, and it may be longer than a slot. On the wire: the
    /// top bit of the sequence word.
    pub direct: bool,
}

/// Top bit of the sequence word: a direct message.
const FRAME_DIRECT: u64 = 1 << 63;

const FRAME_CHECK: u32 = 0xB5A1_D0F7;

impl FrameHeader {
    /// Bytes on the wire.
    pub const LEN: usize = 24;

    /// Serialises; the last word guards against a desynchronised stream.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut v = [0u8; Self::LEN];
        let seq = self.seq | if self.direct { FRAME_DIRECT } else { 0 };
        v[0..8].copy_from_slice(&seq.to_le_bytes());
        v[8..12].copy_from_slice(&self.total.to_le_bytes());
        v[12..16].copy_from_slice(&self.offset.to_le_bytes());
        v[16..20].copy_from_slice(&self.len.to_le_bytes());
        let check = FRAME_CHECK
            ^ (seq as u32)
            ^ ((seq >> 32) as u32)
            ^ self.total
            ^ self.offset.rotate_left(7);
        v[20..24].copy_from_slice(&check.to_le_bytes());
        v
    }

    /// Parses; `None` if the check word does not match.
    pub fn decode(b: &[u8; Self::LEN]) -> Option<FrameHeader> {
        let w = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut s = [0u8; 8];
        s.copy_from_slice(&b[0..8]);
        let seq = u64::from_le_bytes(s);
        let h = FrameHeader {
            seq: seq & !FRAME_DIRECT,
            total: w(8),
            offset: w(12),
            len: w(16),
            direct: seq & FRAME_DIRECT != 0,
        };
        let check =
            FRAME_CHECK ^ (seq as u32) ^ ((seq >> 32) as u32) ^ h.total ^ h.offset.rotate_left(7);
        (w(20) == check).then_some(h)
    }
}

/// Control frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CtrlKind {
    /// Receiver → sender: cumulative count of released slots.
    Credit = 1,
    /// Either way: the peer gave up; the payload is the reason (UTF-8).
    Abort = 2,
    /// Either way: the peer dropped its end normally.
    Close = 3,
    /// Either way, on a resume after an abort: the frames before it are
    /// the old link's; the value is the sender's count the link goes on
    /// from, and the sender's payload the bytes it wrote on each data
    /// socket (u64 little-endian, in socket order), where the new link's
    /// streams begin.
    Resync = 4,
}

/// Control frame header: kind, payload length, value.
pub const CTRL_LEN: usize = 16;
/// Longest control payload (an abort reason is cut to it; a resync's
/// stream positions take at most 512 bytes).
pub const MAX_REASON: usize = 1024;

/// Serialises a control frame.
pub fn ctrl_frame(kind: CtrlKind, value: u64, payload: &[u8]) -> Vec<u8> {
    let payload = &payload[..payload.len().min(MAX_REASON)];
    let mut v = Vec::with_capacity(CTRL_LEN + payload.len());
    v.push(kind as u8);
    v.extend_from_slice(&[0; 3]);
    v.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    v.extend_from_slice(&value.to_le_bytes());
    v.extend_from_slice(payload);
    v
}

/// Parses a control frame header: `(kind, payload length, value)`.
pub fn ctrl_decode(b: &[u8; CTRL_LEN]) -> Result<(CtrlKind, usize, u64), ParseError> {
    let kind = match b[0] {
        1 => CtrlKind::Credit,
        2 => CtrlKind::Abort,
        3 => CtrlKind::Close,
        4 => CtrlKind::Resync,
        k => return Err(format!("unknown control frame kind {k}")),
    };
    let len = u32::from_le_bytes([b[4], b[5], b[6], b[7]]) as usize;
    if len > MAX_REASON || (kind == CtrlKind::Credit && len != 0) {
        return Err(format!("control frame with a {len}-byte payload"));
    }
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[8..16]);
    Ok((kind, len, u64::from_le_bytes(v)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv_info(addr: &str) -> RecvInfo {
        RecvInfo {
            from: 3,
            to: 7,
            addr: addr.parse().unwrap(),
            token: [9; 16],
            slot_bytes: 512 * 1024,
            slots: 8,
            nsocks: 4,
        }
    }

    #[test]
    fn recv_info_round_trips_v4_and_v6() {
        for a in ["10.1.2.3:4567", "[fe80::1%3]:80", "[2001:db8::1]:9"] {
            let i = recv_info(a);
            let b = i.encode();
            assert_eq!(RecvInfo::decode(&b).unwrap(), i, "{a}");
            // Every truncation and any extension is rejected.
            for n in 0..b.len() {
                assert!(RecvInfo::decode(&b[..n]).is_err(), "{a}: prefix {n}");
            }
            let mut longer = b.clone();
            longer.push(0);
            assert!(RecvInfo::decode(&longer).is_err());
        }
        let b = recv_info("[fe80::1%3]:80").encode();
        match RecvInfo::decode(&b).unwrap().addr {
            SocketAddr::V6(v6) => assert_eq!(v6.scope_id(), 3),
            a => panic!("{a}"),
        }
    }

    #[test]
    fn recv_info_rejects_bad_values() {
        let good = recv_info("10.1.2.3:4567");
        let bad = |f: &dyn Fn(&mut RecvInfo)| {
            let mut i = good.clone();
            f(&mut i);
            RecvInfo::decode(&i.encode()).unwrap_err()
        };
        bad(&|i| i.slot_bytes = 0);
        bad(&|i| i.slot_bytes = 100);
        bad(&|i| i.slots = 0);
        bad(&|i| i.nsocks = 0);
        bad(&|i| i.nsocks = 65);
        bad(&|i| i.addr.set_port(0));
        bad(&|i| i.addr = "0.0.0.0:5".parse().unwrap());
        bad(&|i| i.token = [0; 16]);
        let mut b = good.encode();
        b[4] = 9; // version
        let e = RecvInfo::decode(&b).unwrap_err();
        assert!(
            e.contains("socket connect-info version 9, this build speaks 3"),
            "{e}"
        );
        let mut b = good.encode();
        b[0] = b'X'; // magic
        let e = RecvInfo::decode(&b).unwrap_err();
        assert!(e.starts_with("not a braid socket connect-info"), "{e}");
        let mut b = good.encode();
        b[7] = 5; // family
        assert!(RecvInfo::decode(&b).is_err());
        // A sender blob is not a receiver blob and vice versa.
        let s = SendInfo {
            from: 1,
            to: 2,
            nonce: [1; 16],
        };
        let e = RecvInfo::decode(&s.encode()).unwrap_err();
        assert!(e.contains("role 2, expected 1"), "{e}");
        let e = SendInfo::decode(&good.encode()).unwrap_err();
        assert!(e.contains("role 1, expected 2"), "{e}");
    }

    #[test]
    fn send_info_round_trips() {
        let s = SendInfo {
            from: 1,
            to: 2,
            nonce: [5; 16],
        };
        let b = s.encode();
        assert_eq!(b.len(), SendInfo::LEN);
        assert_eq!(SendInfo::decode(&b).unwrap(), s);
        for n in 0..b.len() {
            assert!(SendInfo::decode(&b[..n]).is_err());
        }
        assert!(SendInfo::decode(&[0xff; SendInfo::LEN]).is_err());
    }

    #[test]
    fn hello_and_frames_round_trip() {
        let h = Hello {
            kind: KIND_DATA,
            index: 3,
            from: 1,
            to: 2,
            token: [7; 16],
            nonce: [8; 16],
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        assert!(Hello::decode(&[0; Hello::LEN]).is_err());
        let mut b = h.encode();
        b[4] = 2; // version
        let e = Hello::decode(&b).unwrap_err();
        assert!(e.contains("version 2, this build speaks 3"), "{e}");
        let f = FrameHeader {
            seq: 1 << 40 | 5,
            total: 1 << 20,
            offset: 65536,
            len: 4096,
            direct: false,
        };
        let mut b = f.encode();
        assert_eq!(FrameHeader::decode(&b), Some(f));
        b[13] ^= 1;
        assert_eq!(FrameHeader::decode(&b), None);
        let d = FrameHeader { direct: true, ..f };
        let mut b = d.encode();
        assert_eq!(FrameHeader::decode(&b), Some(d));
        assert_ne!(b, f.encode());
        b[7] ^= 0x80;
        assert_eq!(FrameHeader::decode(&b), None, "the direct bit is checked");
        let c = ctrl_frame(CtrlKind::Abort, 0, b"why");
        let mut hdr = [0u8; CTRL_LEN];
        hdr.copy_from_slice(&c[..CTRL_LEN]);
        assert_eq!(ctrl_decode(&hdr).unwrap(), (CtrlKind::Abort, 3, 0));
        assert_eq!(&c[CTRL_LEN..], b"why");
        hdr[0] = 9;
        assert!(ctrl_decode(&hdr).is_err());
    }
}
