//! Mismatch detection: every operation sends, on each link it uses, one small
//! header (64 bytes, its own slot) ahead of its data, saying what the sender
//! is doing: the kind, datatype, operator, root and count of the operation and
//! its sequence number. The receiver checks it against what it is doing
//! itself before it touches any data, so a rank that calls AllGather while
//! its peer calls AllReduce, or passes another count or root, gets an error
//! that says what each side called — instead of a hang or garbage.
//!
//! Collectives are numbered per communicator (every rank calls every
//! collective); point-to-point transfers are numbered per ordered pair of
//! ranks, and their header carries the total count sent to that peer in the
//! group. One header per link per operation, not per slot.

use braid_core::plan::{Collective, P2pKind, Program};
use braid_core::{DataType, RedOp};

/// The phrase in every mismatch report; a peer that aborted because of a
/// mismatch relays the report as its reason ([`crate::ErrorKind::Mismatch`]).
pub(crate) const MISMATCH: &str = "every rank must issue the same operations";

/// Bytes of one header (one slot message of its own).
pub const HEADER_BYTES: usize = 32;
const MAGIC: [u8; 4] = *b"BRHD";
const NONE: u8 = 0xff;
/// [`OpHeader::kind`] of a barrier (which has no count, datatype or operator
/// of its own to describe).
const KIND_BARRIER: u8 = 8;
/// Where the sequence number lies in an encoded header.
const SEQ_AT: std::ops::Range<usize> = 24..32;

/// What one side of a link is doing in the current operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpHeader {
    /// 1 AllReduce, 2 ReduceScatter, 3 AllGather, 4 Broadcast, 5 Reduce,
    /// 6 AllToAll, 7 point-to-point, 8 barrier.
    pub kind: u8,
    /// Datatype wire code.
    pub dtype: u8,
    /// Reduction operator wire code (or none).
    pub op: u8,
    /// Root (or `u32::MAX`).
    pub root: u32,
    /// Element count as the caller passed it (point-to-point: elements sent
    /// to this peer in the group).
    pub count: u64,
    /// Sequence number (collectives: per communicator; point-to-point: per
    /// ordered pair).
    pub seq: u64,
}

impl OpHeader {
    /// The header of collective `coll` number `seq`.
    pub fn collective(coll: &Collective, dt: DataType, seq: u64) -> OpHeader {
        let (kind, count) = match *coll {
            Collective::AllReduce { count, .. } => (1, count),
            Collective::ReduceScatter { recv_count, .. } => (2, recv_count),
            Collective::AllGather { send_count } => (3, send_count),
            Collective::Broadcast { count, .. } => (4, count),
            Collective::Reduce { count, .. } => (5, count),
            Collective::AllToAll { count } => (6, count),
            Collective::Group(_) => (7, 0),
            Collective::Barrier => (KIND_BARRIER, 0),
        };
        OpHeader {
            kind,
            dtype: dt as u8,
            op: coll.red_op().map(|o| o as u8).unwrap_or(NONE),
            root: coll.root().unwrap_or(u32::MAX),
            count: count as u64,
            seq,
        }
    }

    /// Encode into one header message.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = self.kind;
        b[5] = self.dtype;
        b[6] = self.op;
        b[8..12].copy_from_slice(&self.root.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[SEQ_AT].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    /// Decode a header message; an error says what arrived instead.
    pub fn decode(b: &[u8]) -> Result<OpHeader, String> {
        if b.len() != HEADER_BYTES || b[0..4] != MAGIC {
            return Err(data_not_header(b.len()));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        Ok(OpHeader {
            kind: b[4],
            dtype: b[5],
            op: b[6],
            root: u32_at(8),
            count: u64_at(16),
            seq: u64_at(SEQ_AT.start),
        })
    }

    /// Human-readable form: `AllReduce(count=1024, float, sum) #7`.
    pub fn describe(&self) -> String {
        if self.kind == KIND_BARRIER {
            return format!("Barrier #{}", self.seq);
        }
        let name = match self.kind {
            1 => "AllReduce",
            2 => "ReduceScatter",
            3 => "AllGather",
            4 => "Broadcast",
            5 => "Reduce",
            6 => "AllToAll",
            7 => "Send/Recv",
            _ => "an unknown operation",
        };
        let dt = DataType::from_u8(self.dtype)
            .map(|d| d.name().to_string())
            .unwrap_or_else(|| format!("datatype #{}", self.dtype));
        let mut s = format!("{name}(count={}, {dt}", self.count);
        if let Some(op) = RedOp::from_u8(self.op) {
            s.push_str(&format!(", {op}"));
        }
        if self.root != u32::MAX {
            s.push_str(&format!(", root={}", self.root));
        }
        s.push_str(&format!(") #{}", self.seq));
        s
    }
}

/// The headers of one operation: what to send to each peer and what to
/// expect from each peer (indexed by rank). A collective sends one header,
/// the same on every link, and expects the same from every peer; a group
/// has a header per peer.
#[derive(Clone, Debug, Default)]
pub struct Headers {
    /// Ranks of the communicator.
    nranks: usize,
    /// A collective's header, decoded and encoded.
    common: Option<(OpHeader, [u8; HEADER_BYTES])>,
    /// A group: `(peer, header)` for every peer the program sends to.
    send: Vec<(u32, [u8; HEADER_BYTES])>,
    /// A group: for each rank the program receives from, the header it
    /// must send.
    expect: Vec<Option<OpHeader>>,
    /// `expect`, encoded (zeros where `expect` is `None`): a matching header
    /// is recognised by comparing bytes, without decoding.
    expect_bytes: Vec<[u8; HEADER_BYTES]>,
}

fn peers(prog: &Program, nranks: u32) -> (Vec<bool>, Vec<bool>) {
    let mut to = vec![false; nranks as usize];
    let mut from = vec![false; nranks as usize];
    for op in &prog.ops {
        if let Some(p) = op.send_peer() {
            to[p as usize] = true;
        }
        if let Some(p) = op.recv_peer() {
            from[p as usize] = true;
        }
    }
    (to, from)
}

impl Headers {
    /// Headers of collective `coll` number `seq` on `nranks` ranks.
    #[cfg(test)]
    pub fn for_collective(coll: &Collective, dt: DataType, seq: u64, nranks: u32) -> Headers {
        let mut h = Headers::default();
        h.fill_collective(coll, dt, seq, nranks);
        h
    }

    /// Make these the headers of collective `coll` number `seq` on `nranks`
    /// ranks, reusing this value (this runs for
    /// every operation: one header to encode, nothing per peer).
    pub fn fill_collective(&mut self, coll: &Collective, dt: DataType, seq: u64, nranks: u32) {
        let h = OpHeader::collective(coll, dt, seq);
        self.nranks = nranks as usize;
        self.common = Some((h, h.encode()));
        self.send.clear();
        self.expect.clear();
        self.expect_bytes.clear();
    }

    /// Ranks of the communicator (peers are below this).
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// The header to send to `to` (if the program sends to it: a
    /// collective's program is only asked about the peers it sends to).
    pub fn to_peer(&self, to: u32) -> Option<[u8; HEADER_BYTES]> {
        match &self.common {
            Some((_, b)) => Some(*b),
            None => self.send.iter().find(|(p, _)| *p == to).map(|(_, b)| *b),
        }
    }

    /// The header `from` must send, decoded and encoded.
    pub fn expected_from(&self, from: u32) -> Option<(&OpHeader, &[u8; HEADER_BYTES])> {
        match &self.common {
            Some((h, b)) => Some((h, b)),
            None => {
                let h = self.expect.get(from as usize)?.as_ref()?;
                Some((h, self.expect_bytes.get(from as usize)?))
            }
        }
    }

    /// Headers of a point-to-point group: per peer, the total count sent to
    /// it (and expected from it) and the pair's sequence numbers, which are
    /// advanced here for every peer the group talks to.
    pub fn for_group(
        coll: &Collective,
        dt: DataType,
        me: u32,
        prog: &Program,
        send_seq: &mut [u64],
        recv_seq: &mut [u64],
    ) -> Headers {
        let nranks = send_seq.len() as u32;
        let (to, from) = peers(prog, nranks);
        let mut sent = vec![0u64; nranks as usize];
        let mut recvd = vec![0u64; nranks as usize];
        if let Collective::Group(ops) = coll {
            for o in ops.iter().filter(|o| o.peer != me) {
                match o.kind {
                    P2pKind::Send => sent[o.peer as usize] += o.count as u64,
                    P2pKind::Recv => recvd[o.peer as usize] += o.count as u64,
                }
            }
        }
        let header = |count: u64, seq: u64| OpHeader {
            kind: 7,
            dtype: dt as u8,
            op: NONE,
            root: u32::MAX,
            count,
            seq,
        };
        let mut h = Headers {
            nranks: nranks as usize,
            common: None,
            send: Vec::new(),
            expect: vec![None; nranks as usize],
            expect_bytes: vec![[0; HEADER_BYTES]; nranks as usize],
        };
        for p in 0..nranks as usize {
            if to[p] {
                h.send
                    .push((p as u32, header(sent[p], send_seq[p]).encode()));
                send_seq[p] += 1;
            }
            if from[p] {
                let want = header(recvd[p], recv_seq[p]);
                h.expect[p] = Some(want);
                h.expect_bytes[p] = want.encode();
                recv_seq[p] += 1;
            }
        }
        h
    }
}

fn data_not_header(len: usize) -> String {
    format!(
        "expected an operation header, got {len} bytes of data: the ranks called different operations"
    )
}

/// What [`check`] says when `peer` sent `len` bytes of data (or a
/// single-copy reference to them) where its operation header was due.
pub fn not_a_header(peer: u32, len: usize) -> String {
    format!("from rank {peer}: {}", data_not_header(len))
}

/// Compare a peer's header with ours; the error says what each side called.
pub fn check(peer: u32, me: u32, got: &[u8], want: &OpHeader) -> Result<(), String> {
    let theirs = OpHeader::decode(got).map_err(|e| format!("from rank {peer}: {e}"))?;
    if theirs == *want {
        return Ok(());
    }
    Err(format!(
        "rank {peer} called {} where rank {me} called {}: {MISMATCH}, with the same counts, datatypes, operators and roots, in the same order",
        theirs.describe(),
        want.describe()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_describe_both_sides() {
        let a = OpHeader::collective(
            &Collective::AllReduce {
                count: 1024,
                op: RedOp::Sum,
            },
            DataType::F32,
            7,
        );
        assert_eq!(OpHeader::decode(&a.encode()).unwrap(), a);
        let b = OpHeader::collective(
            &Collective::AllGather { send_count: 1024 },
            DataType::F32,
            7,
        );
        let e = check(1, 0, &b.encode(), &a).unwrap_err();
        assert!(
            e.contains("rank 1 called AllGather(count=1024, float) #7"),
            "{e}"
        );
        assert!(
            e.contains("rank 0 called AllReduce(count=1024, float, sum) #7"),
            "{e}"
        );
        let r = OpHeader::collective(
            &Collective::Broadcast { count: 5, root: 2 },
            DataType::I8,
            0,
        );
        assert!(r.describe().contains("root=2"));
        assert!(check(0, 1, &[0u8; 17], &a)
            .unwrap_err()
            .contains("17 bytes"));
    }

    /// A collective sends and expects the same header on every link; a
    /// group one per peer, with the counts and sequence numbers of that
    /// pair, and nothing for peers it does not talk to.
    #[test]
    fn collective_and_group_headers_per_peer() {
        use braid_core::plan::{plan, P2p, PlanParams};
        let ar = Collective::AllReduce {
            count: 3,
            op: RedOp::Sum,
        };
        let h = Headers::for_collective(&ar, DataType::F32, 6, 4);
        let want = OpHeader::collective(&ar, DataType::F32, 6);
        for p in 0..4 {
            assert_eq!(h.to_peer(p), Some(want.encode()));
            assert_eq!(h.expected_from(p), Some((&want, &want.encode())));
        }
        assert_eq!(h.nranks(), 4);
        let g = Collective::Group(vec![
            P2p {
                kind: P2pKind::Send,
                peer: 2,
                count: 5,
            },
            P2p {
                kind: P2pKind::Recv,
                peer: 3,
                count: 7,
            },
        ]);
        let prog = plan(&g, DataType::I8, &PlanParams::new(1, 4, 4096)).unwrap();
        let (mut ss, mut rs) = (vec![10u64; 4], vec![20u64; 4]);
        let h = Headers::for_group(&g, DataType::I8, 1, &prog, &mut ss, &mut rs);
        let dec = |b: [u8; HEADER_BYTES]| OpHeader::decode(&b).unwrap();
        assert_eq!(
            h.to_peer(2).map(dec).map(|x| (x.count, x.seq)),
            Some((5, 10))
        );
        assert_eq!(h.to_peer(3), None);
        assert_eq!(
            h.expected_from(3).map(|(x, _)| (x.count, x.seq)),
            Some((7, 20))
        );
        assert_eq!(h.expected_from(2), None);
        assert_eq!((ss[2], rs[3], ss[3], rs[2]), (11, 21, 10, 20));
        // A collective after a group: the group's per-peer headers are gone.
        let mut h = h;
        h.fill_collective(&ar, DataType::F32, 7, 4);
        let want = OpHeader::collective(&ar, DataType::F32, 7);
        assert_eq!(h.to_peer(2), Some(want.encode()));
        assert_eq!(h.expected_from(2), Some((&want, &want.encode())));
    }
}
