//! Wire formats: the connect-info blobs both ends publish through the
//! bootstrap, and the 32-bit immediate that every RDMA WRITE WITH IMMEDIATE
//! carries. Integers are little-endian; a blob has one exact length, so
//! truncated, padded or foreign blobs are rejected, never half-parsed.
//!
//! Both blobs start with braid's connect-info header
//! ([`braid_core::wire::Header`]: magic `BRIB`, version, role byte 1 for the
//! receiver's blob, 2 for the sender's). Version 3 has the layout of
//! version 2 (whose header was decoded here); the bump marks the change of
//! decoder and its messages.

use braid_core::wire::{Header, Reader, ROLE_RECEIVER, ROLE_SENDER};

/// Wire version; bump on any change of the formats in this module.
pub const VERSION: u16 = 3;
/// The header of both connect-info blobs.
pub const HEADER: Header = Header {
    magic: *b"BRIB",
    version: VERSION,
    what: "IB",
};

/// Largest slot (a slot is written by at most one RDMA write per QP; 8 MiB
/// is below every HCA's message size limit, Soft-RoCE's included).
pub const MAX_SLOT_BYTES: usize = 8 << 20;
/// Most slots per connection (the immediate carries a 12-bit slot index).
pub const MAX_SLOTS: usize = 4096;
/// Most queue pairs per connection (the immediate carries the piece count in
/// 4 bits, 1 to 16).
pub const MAX_QPS: usize = 16;

/// Why a blob was rejected.
pub type ParseError = String;

/// How the peer's port is addressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Addr {
    /// Local identifier (InfiniBand); 0 on RoCE.
    pub lid: u16,
    /// Global identifier (RoCE always; InfiniBand when routed).
    pub gid: [u8; 16],
    /// Link layer: true for Ethernet (RoCE), false for InfiniBand.
    pub roce: bool,
    /// Active MTU of the port, as the verbs enum (1 = 256 ... 5 = 4096).
    pub mtu: u8,
}

/// One end's queue pairs and control buffer, common to both roles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Sending rank.
    pub from: u32,
    /// Receiving rank.
    pub to: u32,
    /// Port address.
    pub addr: Addr,
    /// Initial packet sequence number of every QP of this end (24 bits).
    pub psn: u32,
    /// QP numbers, one per QP of the connection (24 bits each).
    pub qpns: Vec<u32>,
    /// Control buffer: abort reasons are written here.
    pub ctrl_addr: u64,
    /// Remote key of the control buffer.
    pub ctrl_rkey: u32,
}

/// The receiving end's blob: its endpoint plus the slot FIFO the sender
/// writes into, and the link's geometry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvInfo {
    /// Queue pairs and control buffer.
    pub ep: Endpoint,
    /// Address of slot 0 of the FIFO.
    pub fifo_addr: u64,
    /// Remote key of the FIFO.
    pub fifo_rkey: u32,
    /// Bytes per slot.
    pub slot_bytes: usize,
    /// Slots.
    pub slots: usize,
}

/// The sending end's blob.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendInfo {
    /// Queue pairs and control buffer.
    pub ep: Endpoint,
}

/// Checks a slot geometry and QP count.
pub fn check_geometry(slot_bytes: usize, slots: usize, qps: usize) -> Result<(), String> {
    if !(64..=MAX_SLOT_BYTES).contains(&slot_bytes) || !slot_bytes.is_multiple_of(64) {
        return Err(format!(
            "slot size {slot_bytes} must be a multiple of 64 between 64 and {MAX_SLOT_BYTES}"
        ));
    }
    if !(1..=MAX_SLOTS).contains(&slots) {
        return Err(format!("{slots} slots: must be 1 to {MAX_SLOTS}"));
    }
    if !(1..=MAX_QPS).contains(&qps) {
        return Err(format!(
            "{qps} queue pairs per connection: must be 1 to {MAX_QPS}"
        ));
    }
    Ok(())
}

impl Endpoint {
    fn encode(&self, role: u8, v: &mut Vec<u8>) {
        HEADER.write(v, role);
        v.extend_from_slice(&self.from.to_le_bytes());
        v.extend_from_slice(&self.to.to_le_bytes());
        v.extend_from_slice(&self.addr.lid.to_le_bytes());
        v.extend_from_slice(&self.addr.gid);
        v.push(u8::from(self.addr.roce));
        v.push(self.addr.mtu);
        v.extend_from_slice(&self.psn.to_le_bytes());
        v.extend_from_slice(&self.ctrl_addr.to_le_bytes());
        v.extend_from_slice(&self.ctrl_rkey.to_le_bytes());
        v.push(self.qpns.len() as u8);
        for q in &self.qpns {
            v.extend_from_slice(&q.to_le_bytes());
        }
    }

    fn decode(r: &mut Reader<'_>, role: u8) -> Result<Endpoint, ParseError> {
        HEADER.read(r, role)?;
        let from = r.u32()?;
        let to = r.u32()?;
        let lid = r.u16()?;
        let gid = r.arr::<16>()?;
        let roce = match r.u8()? {
            0 => false,
            1 => true,
            x => return Err(format!("link layer flag {x}")),
        };
        let mtu = r.u8()?;
        if !(1..=5).contains(&mtu) {
            return Err(format!("MTU code {mtu} (1 to 5 expected)"));
        }
        let psn = r.u32()?;
        if psn >= 1 << 24 {
            return Err(format!("PSN {psn:#x} wider than 24 bits"));
        }
        let ctrl_addr = r.u64()?;
        let ctrl_rkey = r.u32()?;
        let n = r.u8()? as usize;
        if !(1..=MAX_QPS).contains(&n) {
            return Err(format!("{n} queue pairs (1 to {MAX_QPS} expected)"));
        }
        let mut qpns = Vec::with_capacity(n);
        for _ in 0..n {
            let q = r.u32()?;
            if q == 0 || q >= 1 << 24 {
                return Err(format!("QP number {q:#x} out of range"));
            }
            qpns.push(q);
        }
        Ok(Endpoint {
            from,
            to,
            addr: Addr {
                lid,
                gid,
                roce,
                mtu,
            },
            psn,
            qpns,
            ctrl_addr,
            ctrl_rkey,
        })
    }
}

impl RecvInfo {
    /// Serialises.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(96);
        self.ep.encode(ROLE_RECEIVER, &mut v);
        v.extend_from_slice(&self.fifo_addr.to_le_bytes());
        v.extend_from_slice(&self.fifo_rkey.to_le_bytes());
        v.extend_from_slice(&(self.slot_bytes as u32).to_le_bytes());
        v.extend_from_slice(&(self.slots as u32).to_le_bytes());
        v
    }

    /// Parses and validates.
    pub fn decode(b: &[u8]) -> Result<RecvInfo, ParseError> {
        let mut r = Reader::new(b);
        let ep = Endpoint::decode(&mut r, ROLE_RECEIVER)?;
        let fifo_addr = r.u64()?;
        let fifo_rkey = r.u32()?;
        let slot_bytes = r.u32()? as usize;
        let slots = r.u32()? as usize;
        r.end()?;
        check_geometry(slot_bytes, slots, ep.qpns.len())?;
        Ok(RecvInfo {
            ep,
            fifo_addr,
            fifo_rkey,
            slot_bytes,
            slots,
        })
    }
}

impl SendInfo {
    /// Serialises.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(80);
        self.ep.encode(ROLE_SENDER, &mut v);
        v
    }

    /// Parses and validates.
    pub fn decode(b: &[u8]) -> Result<SendInfo, ParseError> {
        let mut r = Reader::new(b);
        let ep = Endpoint::decode(&mut r, ROLE_SENDER)?;
        r.end()?;
        Ok(SendInfo { ep })
    }
}

/// What an immediate says. Layout: bits 28-31 the kind; for data, bits 0-11
/// the slot index, bits 12-15 the number of pieces minus one and bits 16-27
/// the message's sequence number modulo 2^12 (so a notice that arrives twice
/// or out of order is caught, not taken for a new message); for credits, bits 0-27 the receiver's cumulative count of released slots
/// modulo 2^28.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Imm {
    /// A piece of message `tag` (its sequence number modulo 2^12) in
    /// `slot`, which has `pieces` pieces.
    Data { slot: u16, pieces: u8, tag: u16 },
    /// The receiver released slots up to this count (mod 2^28).
    Credit(u32),
    /// The receiving end is connected (one per QP).
    Ready,
    /// The peer closed its end.
    Close,
    /// The peer aborted; the reason was written into the control buffer.
    Abort,
    /// A resume after an abort: the notices before it on this QP are the
    /// old link's; the value is the sender's count the link goes on from
    /// (mod 2^28).
    Resync(u32),
}

const K_DATA: u32 = 0;
const K_CREDIT: u32 = 1;
const K_READY: u32 = 2;
const K_CLOSE: u32 = 3;
const K_ABORT: u32 = 4;
const K_RESYNC: u32 = 5;
/// Mask of a data notice's message tag (sequence number modulo 2^12).
pub const TAG_MASK: u32 = (1 << 12) - 1;
/// Mask of a credit count.
pub const CREDIT_MASK: u32 = (1 << 28) - 1;

impl Imm {
    /// The 32-bit value.
    pub fn encode(self) -> u32 {
        match self {
            Imm::Data { slot, pieces, tag } => {
                (K_DATA << 28)
                    | (u32::from(tag) & TAG_MASK) << 16
                    | ((u32::from(pieces) - 1) & 0xf) << 12
                    | (u32::from(slot) & 0xfff)
            }
            Imm::Credit(c) => (K_CREDIT << 28) | (c & CREDIT_MASK),
            Imm::Ready => K_READY << 28,
            Imm::Close => K_CLOSE << 28,
            Imm::Abort => K_ABORT << 28,
            Imm::Resync(c) => (K_RESYNC << 28) | (c & CREDIT_MASK),
        }
    }

    /// Parses a received immediate.
    pub fn decode(v: u32) -> Result<Imm, ParseError> {
        match v >> 28 {
            K_DATA => Ok(Imm::Data {
                slot: (v & 0xfff) as u16,
                pieces: ((v >> 12) & 0xf) as u8 + 1,
                tag: ((v >> 16) & TAG_MASK) as u16,
            }),
            K_CREDIT => Ok(Imm::Credit(v & CREDIT_MASK)),
            K_READY => Ok(Imm::Ready),
            K_CLOSE => Ok(Imm::Close),
            K_ABORT => Ok(Imm::Abort),
            K_RESYNC => Ok(Imm::Resync(v & CREDIT_MASK)),
            k => Err(format!("immediate of unknown kind {k} ({v:#010x})")),
        }
    }
}

/// The receiver's bookkeeping of data notices: per slot, the pieces seen so
/// far of the message due there next, and that message's sequence number.
/// Message `seq` lives in slot `seq % slots`, and a sender reuses a slot
/// only after the receiver released it, so the next notice for a slot must
/// carry the tag of the message due there; any other tag is a notice
/// delivered twice or out of order, which must never be taken for a new
/// message.
#[derive(Clone, Debug)]
pub struct Arrivals {
    due: Vec<(u8, u64)>,
}

impl Arrivals {
    /// Nothing arrived yet in any of `slots` slots.
    pub fn new(slots: usize) -> Arrivals {
        Arrivals::starting_at(slots, 0)
    }

    /// Nothing arrived yet, and message `at` is the next one (a resumed
    /// link): each slot waits for the first message from `at` on that
    /// lives in it.
    pub fn starting_at(slots: usize, at: u64) -> Arrivals {
        let n = slots as u64;
        Arrivals {
            due: (0..n).map(|s| (0, at + (s + n - at % n) % n)).collect(),
        }
    }

    /// Notes one data notice. `Ok(true)` when it completes its message
    /// (every piece arrived), `Ok(false)` when pieces are still missing,
    /// and an error for a notice that does not fit.
    pub fn note(&mut self, slot: u16, pieces: u8, tag: u16) -> Result<bool, String> {
        let slots = self.due.len();
        let s = slot as usize;
        let Some(d) = self.due.get_mut(s) else {
            return Err(format!("data for slot {s} of {slots}"));
        };
        if u32::from(tag) != (d.1 as u32) & TAG_MASK {
            return Err(format!(
                "a notice for message {tag} (mod 4096) arrived in slot {s}, where message {} \
                 was due: the RDMA device delivered a write twice or out of order \
                 (Soft-RoCE does this after retransmissions; see BRAID_IB_TIMEOUT)",
                d.1
            ));
        }
        d.0 += 1;
        if d.0 < pieces {
            return Ok(false);
        }
        if d.0 > pieces {
            return Err(format!("slot {s}: more pieces than the {pieces} announced"));
        }
        *d = (0, d.1 + slots as u64);
        Ok(true)
    }
}

/// Advances a full 64-bit counter by a 28-bit wrapped one.
pub fn unwrap_credit(prev: u64, wrapped: u32) -> u64 {
    let delta = wrapped.wrapping_sub(prev as u32) & CREDIT_MASK;
    prev + u64::from(delta)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(from: u32, to: u32) -> Endpoint {
        Endpoint {
            from,
            to,
            addr: Addr {
                lid: 7,
                gid: [9; 16],
                roce: true,
                mtu: 5,
            },
            psn: 0xabcdef,
            qpns: vec![17, 18, 19],
            ctrl_addr: 0x7f00_1234_5000,
            ctrl_rkey: 0x55aa,
        }
    }

    #[test]
    fn blobs_round_trip_and_reject_garbage() {
        let ri = RecvInfo {
            ep: ep(0, 1),
            fifo_addr: 0x7f00_0000_0000,
            fifo_rkey: 42,
            slot_bytes: 512 * 1024,
            slots: 8,
        };
        let b = ri.encode();
        assert_eq!(RecvInfo::decode(&b).unwrap(), ri);
        for n in 0..b.len() {
            assert!(RecvInfo::decode(&b[..n]).is_err(), "prefix {n}");
        }
        let mut longer = b.clone();
        longer.push(0);
        assert!(RecvInfo::decode(&longer).is_err());
        // Roles are not interchangeable.
        let si = SendInfo { ep: ep(0, 1) };
        let sb = si.encode();
        assert_eq!(SendInfo::decode(&sb).unwrap(), si);
        let e = RecvInfo::decode(&sb).unwrap_err();
        assert!(e.contains("IB connect-info of role 2, expected 1"), "{e}");
        let e = SendInfo::decode(&b).unwrap_err();
        assert!(e.contains("IB connect-info of role 1, expected 2"), "{e}");
        let mut old = b.clone();
        old[4] = 2; // version
        let e = RecvInfo::decode(&old).unwrap_err();
        assert!(
            e.contains("IB connect-info version 2, this build speaks 3"),
            "{e}"
        );
        old[0] = b'X'; // magic
        let e = RecvInfo::decode(&old).unwrap_err();
        assert!(e.starts_with("not a braid IB connect-info"), "{e}");
        // Out-of-range fields.
        let mut bad = ri.clone();
        bad.slots = 0;
        assert!(RecvInfo::decode(&bad.encode()).is_err());
        let mut bad = ri.clone();
        bad.ep.qpns = vec![1 << 24];
        assert!(RecvInfo::decode(&bad.encode()).is_err());
        let mut bad = ri;
        bad.ep.addr.mtu = 9;
        assert!(RecvInfo::decode(&bad.encode()).is_err());
    }

    #[test]
    fn notices_are_accepted_once_in_order() {
        let mut a = Arrivals::new(2);
        // Message 0 in slot 0 (two pieces), message 1 in slot 1 (one).
        assert_eq!(a.note(0, 2, 0), Ok(false));
        assert_eq!(a.note(1, 1, 1), Ok(true));
        assert_eq!(a.note(0, 2, 0), Ok(true));
        // Message 2 is due in slot 0 next: message 0 again is a duplicate.
        let e = a.note(0, 1, 0).unwrap_err();
        assert!(e.contains("message 2 was due"), "{e}");
        let mut a = Arrivals::new(2);
        assert!(a.note(0, 1, 2).is_err(), "a message ahead of its turn");
        assert!(a.note(2, 1, 2).is_err(), "a slot out of range");
        // A resumed link: message 7 is next, in slot 7 % 3 = 1; slot 2 waits
        // for message 8, slot 0 for message 9.
        let mut a = Arrivals::starting_at(3, 7);
        assert!(a.note(0, 1, 6).is_err(), "a message of the old link");
        assert_eq!(a.note(1, 1, 7), Ok(true));
        assert_eq!(a.note(2, 1, 8), Ok(true));
        assert_eq!(a.note(0, 1, 9), Ok(true));
        assert_eq!(a.note(1, 1, 10), Ok(true));
        // Tags wrap at 4096.
        let mut a = Arrivals::new(1);
        for seq in 0..5000u32 {
            assert_eq!(a.note(0, 1, (seq & TAG_MASK) as u16), Ok(true), "{seq}");
        }
    }

    #[test]
    fn immediates_round_trip() {
        for imm in [
            Imm::Data {
                slot: 4095,
                pieces: 16,
                tag: 4095,
            },
            Imm::Data {
                slot: 0,
                pieces: 1,
                tag: 0,
            },
            Imm::Data {
                slot: 7,
                pieces: 3,
                tag: 1234,
            },
            Imm::Credit(CREDIT_MASK),
            Imm::Credit(5),
            Imm::Ready,
            Imm::Close,
            Imm::Abort,
            Imm::Resync(0),
            Imm::Resync(CREDIT_MASK),
        ] {
            assert_eq!(Imm::decode(imm.encode()).unwrap(), imm);
        }
        assert!(Imm::decode(0xf000_0000).is_err());
    }

    #[test]
    fn credits_unwrap_across_the_28_bit_boundary() {
        let prev = u64::from(CREDIT_MASK) - 1;
        assert_eq!(unwrap_credit(prev, CREDIT_MASK), prev + 1);
        assert_eq!(unwrap_credit(prev, 2), prev + 4);
        assert_eq!(unwrap_credit(5, 5), 5);
        assert_eq!(unwrap_credit(3 << 28, 1), (3 << 28) + 1);
    }
}
