//! GPU-side synchronisation: a collective's program as one in-order list of
//! stream commands (pure; no CUDA, no clock).
//!
//! The device engine's stream mode puts a whole collective on the caller's
//! CUDA stream: copies and reduction kernels, and between them the
//! cross-process synchronisation as stream memory operations
//! (`cuStreamWaitValue32` / `cuStreamWriteValue32`) on two 32-bit counters
//! per device link, kept next to the receiver's slot ring (device memory the
//! sender maps through CUDA IPC):
//!
//! - `posted`: written by the sender's stream after piece `k` landed in slot
//!   `k mod S` (value `k + 1`); the receiver's stream waits for it before it
//!   reads the slot.
//! - `freed`: written by the receiver's stream once it consumed piece `k`
//!   (value `k + 1`); the sender's stream waits for `freed ≥ k + 1 − S`
//!   before it writes piece `k` into the slot that piece `k − S` used.
//!
//! No host thread takes part per step, and nothing blocks the caller. Piece
//! numbers run on across collectives (a [`Cursor`] per communicator), and the
//! counters compare wrap-around aware, as `cuStreamWaitValue32`'s `GEQ` does.
//!
//! [`schedule`] translates a [`Program`] op by op. A stream runs its commands
//! strictly in order, whereas the host engine may run the ops of one stage
//! in any order, so each stage is serialised in rounds: the `j`-th piece of
//! every outgoing transfer, then the `j`-th piece of every incoming one
//! (pieces on one link keep their order). [`simulate`] runs every rank's commands in
//! memory, in any interleaving, and checks the protocol on the way (no slot
//! written before its previous piece was consumed, no slot read before it was
//! posted, counters advancing by one), so the tests prove both the results
//! and freedom from deadlock for the slot counts in use.

use braid_core::plan::{Op, Program, Region};
use braid_core::{reduce, CoreError, DataType, RedOp};

type Result<T> = std::result::Result<T, CoreError>;

/// Where a command reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loc {
    /// A byte offset in one of the operation's buffers (see [`Region`]).
    Buf { buf: u16, offset: usize },
    /// Slot `slot` of this rank's ring for the link from `peer`.
    In { peer: u32, slot: u32 },
    /// Slot `slot` of `peer`'s ring for the link from this rank (mapped).
    Out { peer: u32, slot: u32 },
}

/// One stream command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmd {
    /// Wait until `posted` of the link from `from` is at least `value`.
    WaitPosted { from: u32, value: u32 },
    /// Wait until `freed` of the link to `to` is at least `value`.
    WaitFreed { to: u32, value: u32 },
    /// `dst = src` (`len` bytes).
    Copy { dst: Loc, src: Loc, len: usize },
    /// `dst = a (+) b` element-wise (`len` bytes).
    Reduce {
        dst: Loc,
        a: Loc,
        b: Loc,
        len: usize,
    },
    /// `dst /= divisor` element-wise (Avg).
    Divide { dst: Loc, len: usize },
    /// Write `value` into `posted` of the link to `to`.
    Post { to: u32, value: u32 },
    /// Write `value` into `freed` of the link from `from`.
    Free { from: u32, value: u32 },
}

/// Slot geometry of every link of one rank, indexed by peer (`None`: no
/// link, e.g. the rank itself).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Links {
    /// (slots, slot bytes) of the link to each peer.
    pub out: Vec<Option<(u32, usize)>>,
    /// (slots, slot bytes) of the link from each peer.
    pub inc: Vec<Option<(u32, usize)>>,
}

impl Links {
    /// Every peer but `rank` linked both ways with the same geometry.
    pub fn uniform(rank: u32, nranks: u32, slots: u32, slot_bytes: usize) -> Links {
        let v: Vec<_> = (0..nranks)
            .map(|q| (q != rank).then_some((slots, slot_bytes)))
            .collect();
        Links {
            out: v.clone(),
            inc: v,
        }
    }
}

/// Pieces sent to and received from each peer so far (they number the
/// slots and the counter values; they run on across collectives).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cursor {
    /// Pieces sent to each peer.
    pub sent: Vec<u64>,
    /// Pieces received from each peer.
    pub recvd: Vec<u64>,
}

impl Cursor {
    /// A cursor for `nranks` peers, at zero.
    pub fn new(nranks: u32) -> Cursor {
        Cursor {
            sent: vec![0; nranks as usize],
            recvd: vec![0; nranks as usize],
        }
    }

    /// A cursor with `k` pieces already moved on every link.
    pub fn at(nranks: u32, k: u64) -> Cursor {
        Cursor {
            sent: vec![k; nranks as usize],
            recvd: vec![k; nranks as usize],
        }
    }
}

/// Counter values that release every wait issued so far: what a watchdog
/// writes (on a side stream) to drain a stream whose peer died, for each
/// peer `(posted of the link from it, freed of the link to it)`.
pub fn release_values(cur: &Cursor) -> Vec<(u32, u32)> {
    cur.recvd
        .iter()
        .zip(&cur.sent)
        .map(|(&r, &s)| (r as u32, s as u32))
        .collect()
}

fn geometry(
    side: &[Option<(u32, usize)>],
    peer: u32,
    what: &str,
    len: usize,
) -> Result<(u32, usize)> {
    let (slots, bytes) =
        side.get(peer as usize).copied().flatten().ok_or_else(|| {
            CoreError::InvalidArgument(format!("no device link {what} rank {peer}"))
        })?;
    if slots < 2 {
        return Err(CoreError::InvalidArgument(format!(
            "the device link {what} rank {peer} has {slots} slot(s); stream mode needs at least 2"
        )));
    }
    if len > bytes {
        return Err(CoreError::InvalidArgument(format!(
            "piece of {len} bytes does not fit the {bytes}-byte slots of the link {what} rank {peer}"
        )));
    }
    Ok((slots, bytes))
}

fn buf(r: Region) -> Loc {
    Loc::Buf {
        buf: r.buf,
        offset: r.offset,
    }
}

/// The ops of one stage in an order a single in-order stream can run
/// without deadlock (with two or more slots per link): in rounds, round `j`
/// sending the `j`-th piece of every outgoing transfer, then (round 0 only)
/// the local copies, then receiving the `j`-th piece of every incoming
/// transfer. A stage of one op (rings, chains) stays as it is; pieces on one
/// link keep their order.
fn serialise(stage: &[Op]) -> Vec<&Op> {
    if stage.len() <= 1 {
        return stage.iter().collect();
    }
    // Queues per link: sends by destination, receives by source, in order
    // of first appearance; ops that receive and send go with receives.
    let mut sends: Vec<(u32, Vec<&Op>)> = Vec::new();
    let mut recvs: Vec<(u32, Vec<&Op>)> = Vec::new();
    let mut local: Vec<&Op> = Vec::new();
    for op in stage {
        let (queues, peer) = match (op.recv_peer(), op.send_peer()) {
            (Some(from), _) => (&mut recvs, from),
            (None, Some(to)) => (&mut sends, to),
            (None, None) => {
                local.push(op);
                continue;
            }
        };
        match queues.iter_mut().find(|(q, _)| *q == peer) {
            Some((_, v)) => v.push(op),
            None => queues.push((peer, vec![op])),
        }
    }
    let rounds = sends
        .iter()
        .chain(&recvs)
        .map(|(_, v)| v.len())
        .max()
        .unwrap_or(0);
    let mut out = Vec::with_capacity(stage.len());
    for j in 0..rounds.max(1) {
        out.extend(sends.iter().filter_map(|(_, v)| v.get(j).copied()));
        if j == 0 {
            out.append(&mut local);
        }
        out.extend(recvs.iter().filter_map(|(_, v)| v.get(j).copied()));
    }
    out
}

/// Translate `prog` into stream commands, advancing `cur` (left unchanged
/// on error).
pub fn schedule(prog: &Program, links: &Links, cur: &mut Cursor) -> Result<Vec<Cmd>> {
    let mut c = cur.clone();
    let mut cmds = Vec::with_capacity(prog.ops.len() * 5);
    let divide = prog.divisor > 1;
    for stage in prog.stages() {
        for op in serialise(stage) {
            let len = op.wire_len();
            // Input: wait for the piece, note which slot holds it.
            let input = match op.recv_peer() {
                Some(from) => {
                    let (slots, _) = geometry(&links.inc, from, "from", len)?;
                    let k = *c.recvd.get(from as usize).ok_or_else(|| {
                        CoreError::InvalidArgument(format!("no rank {from} in the cursor"))
                    })?;
                    cmds.push(Cmd::WaitPosted {
                        from,
                        value: (k + 1) as u32,
                    });
                    Some((
                        from,
                        k,
                        Loc::In {
                            peer: from,
                            slot: (k % slots as u64) as u32,
                        },
                    ))
                }
                None => None,
            };
            // Output: wait until the slot's previous piece was consumed.
            let output = match op.send_peer() {
                Some(to) => {
                    let (slots, _) = geometry(&links.out, to, "to", len)?;
                    let k = *c.sent.get(to as usize).ok_or_else(|| {
                        CoreError::InvalidArgument(format!("no rank {to} in the cursor"))
                    })?;
                    if k >= slots as u64 {
                        cmds.push(Cmd::WaitFreed {
                            to,
                            value: (k + 1 - slots as u64) as u32,
                        });
                    }
                    Some((
                        to,
                        k,
                        Loc::Out {
                            peer: to,
                            slot: (k % slots as u64) as u32,
                        },
                    ))
                }
                None => None,
            };
            let inp = input.map(|i| i.2);
            let out = output.map(|o| o.2);
            let missing = || CoreError::InvalidArgument(format!("malformed op {op:?}"));
            // `dst = in (+) src`, then the Avg division where asked.
            let reduce_into = |cmds: &mut Vec<Cmd>, src: Region, dst: Region, fin: bool| {
                cmds.push(Cmd::Reduce {
                    dst: buf(dst),
                    a: inp.ok_or_else(missing)?,
                    b: buf(src),
                    len,
                });
                if fin && divide {
                    cmds.push(Cmd::Divide { dst: buf(dst), len });
                }
                Ok::<(), CoreError>(())
            };
            match *op {
                Op::Copy { src, dst, finalize } => {
                    if src != dst {
                        cmds.push(Cmd::Copy {
                            dst: buf(dst),
                            src: buf(src),
                            len: src.len,
                        });
                    }
                    if finalize && divide {
                        cmds.push(Cmd::Divide {
                            dst: buf(dst),
                            len: dst.len,
                        });
                    }
                }
                Op::Send { src, .. } => cmds.push(Cmd::Copy {
                    dst: out.ok_or_else(missing)?,
                    src: buf(src),
                    len,
                }),
                Op::Recv { dst, .. } => cmds.push(Cmd::Copy {
                    dst: buf(dst),
                    src: inp.ok_or_else(missing)?,
                    len,
                }),
                Op::RecvReduceSend { src, .. } => cmds.push(Cmd::Reduce {
                    dst: out.ok_or_else(missing)?,
                    a: inp.ok_or_else(missing)?,
                    b: buf(src),
                    len,
                }),
                Op::RecvReduceCopy {
                    src, dst, finalize, ..
                } => reduce_into(&mut cmds, src, dst, finalize)?,
                Op::RecvCopySend { dst, .. } => {
                    let i = inp.ok_or_else(missing)?;
                    cmds.push(Cmd::Copy {
                        dst: buf(dst),
                        src: i,
                        len,
                    });
                    cmds.push(Cmd::Copy {
                        dst: out.ok_or_else(missing)?,
                        src: i,
                        len,
                    });
                }
                Op::RecvReduceCopySend {
                    src, dst, finalize, ..
                } => {
                    reduce_into(&mut cmds, src, dst, finalize)?;
                    cmds.push(Cmd::Copy {
                        dst: out.ok_or_else(missing)?,
                        src: buf(dst),
                        len,
                    });
                }
            }
            // Publish the output, then give the input slot back.
            if let Some((to, k, _)) = output {
                cmds.push(Cmd::Post {
                    to,
                    value: (k + 1) as u32,
                });
                c.sent[to as usize] = k + 1;
            }
            if let Some((from, k, _)) = input {
                cmds.push(Cmd::Free {
                    from,
                    value: (k + 1) as u32,
                });
                c.recvd[from as usize] = k + 1;
            }
        }
    }
    *cur = c;
    Ok(cmds)
}

/// One rank's part in [`simulate`].
#[derive(Clone, Debug)]
pub struct SimRank {
    /// The commands, in stream order.
    pub cmds: Vec<Cmd>,
    /// Backing memory.
    pub storages: Vec<Vec<u8>>,
    /// For each buffer index: (storage index, byte offset), as in
    /// [`braid_core::sim::RankSetup`].
    pub buffers: Vec<(usize, usize)>,
    /// Element type and pairwise operator of reductions, and the divisor.
    pub reduction: Option<(DataType, RedOp, u32)>,
}

/// The order in which [`simulate`] lets ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interleave {
    /// Each rank runs until it blocks, rank after rank.
    Greedy,
    /// One command per rank per turn.
    RoundRobin,
    /// A pseudo-random rank and burst length each turn (seeded).
    Random(u64),
}

/// One directed link as the simulator keeps it (both ends see it).
#[derive(Clone, Debug)]
struct SimLink {
    slot_bytes: usize,
    ring: Vec<Vec<u8>>,
    /// Piece number held by each slot (written, maybe not yet posted).
    piece: Vec<Option<u64>>,
    posted: u32,
    freed: u32,
    /// Shadows of the counters without wrap-around.
    posted_n: u64,
    freed_n: u64,
}

/// Counter state of every link after a simulation: `(from, to, posted,
/// freed)`.
pub type LinkCounters = Vec<(u32, u32, u32, u32)>;

fn ge(counter: u32, value: u32) -> bool {
    (counter.wrapping_sub(value) as i32) >= 0
}

/// Run every rank's command list together, in the given interleaving, over
/// slot rings of the geometry of `links[r]` (rank `r`'s view; the receiving
/// end's `inc` entry decides a link's geometry). Every link starts with
/// `start` pieces already moved (to test wrap-around of the counters: the
/// ranks' cursors must then start there too).
/// Errors on a protocol violation or a deadlock; returns every rank's
/// storages and the final counters.
pub fn simulate(
    mut ranks: Vec<SimRank>,
    links: &[Links],
    order: Interleave,
    start: u64,
) -> Result<(Vec<Vec<Vec<u8>>>, LinkCounters)> {
    let p = ranks.len();
    let err = |r: usize, d: String| CoreError::Protocol {
        peer: r as u32,
        detail: d,
    };
    // links_map[from][to]
    let mut net: Vec<Vec<Option<SimLink>>> = vec![vec![None; p]; p];
    for (to, l) in links.iter().enumerate() {
        for (from, g) in l.inc.iter().enumerate() {
            if let Some((slots, bytes)) = *g {
                let k0 = start;
                net[from][to] = Some(SimLink {
                    slot_bytes: bytes,
                    ring: vec![vec![0; bytes]; slots as usize],
                    piece: vec![None; slots as usize],
                    posted: k0 as u32,
                    freed: k0 as u32,
                    posted_n: k0,
                    freed_n: k0,
                });
            }
        }
    }
    let mut pc = vec![0usize; p];
    let mut rng = match order {
        Interleave::Random(s) => s | 1,
        _ => 1,
    };
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut turn = 0usize;
    let mut idle_turns = 0usize;
    loop {
        if (0..p).all(|r| pc[r] >= ranks[r].cmds.len()) {
            break;
        }
        let (r, burst) = match order {
            Interleave::Greedy => (turn % p, usize::MAX),
            Interleave::RoundRobin => (turn % p, 1),
            Interleave::Random(_) => ((next() % p as u64) as usize, 1 + (next() % 7) as usize),
        };
        turn += 1;
        let mut ran = 0;
        while ran < burst && pc[r] < ranks[r].cmds.len() {
            let cmd = ranks[r].cmds[pc[r]];
            if !step(r, &cmd, &mut ranks[r], &mut net).map_err(|d| err(r, d))? {
                break;
            }
            pc[r] += 1;
            ran += 1;
        }
        if ran > 0 {
            idle_turns = 0;
        } else {
            idle_turns += 1;
            // Every rank had several chances (random picks may repeat).
            if idle_turns > 64 * p + 64 {
                let stuck: Vec<String> = (0..p)
                    .filter(|&r| pc[r] < ranks[r].cmds.len())
                    .map(|r| format!("rank {r} at {:?}", ranks[r].cmds[pc[r]]))
                    .collect();
                return Err(err(0, format!("deadlock: {}", stuck.join(", "))));
            }
        }
    }
    for (from, row) in net.iter().enumerate() {
        for (to, l) in row.iter().enumerate() {
            if let Some(l) = l {
                if l.posted_n != l.freed_n {
                    return Err(err(
                        from,
                        format!(
                            "{} piece(s) from rank {from} to rank {to} never consumed",
                            l.posted_n - l.freed_n
                        ),
                    ));
                }
            }
        }
    }
    let counters = net
        .iter()
        .enumerate()
        .flat_map(|(from, row)| {
            row.iter().enumerate().filter_map(move |(to, l)| {
                l.as_ref()
                    .map(|l| (from as u32, to as u32, l.posted, l.freed))
            })
        })
        .collect();
    Ok((ranks.into_iter().map(|r| r.storages).collect(), counters))
}

type Net = Vec<Vec<Option<SimLink>>>;

fn link(net: &mut Net, from: u32, to: u32) -> std::result::Result<&mut SimLink, String> {
    net.get_mut(from as usize)
        .and_then(|row| row.get_mut(to as usize))
        .and_then(|l| l.as_mut())
        .ok_or_else(|| format!("no link from rank {from} to rank {to}"))
}

fn read(
    me: usize,
    rank: &SimRank,
    net: &mut Net,
    loc: Loc,
    len: usize,
) -> std::result::Result<Vec<u8>, String> {
    match loc {
        Loc::Buf { buf, offset } => {
            let &(st, base) = rank
                .buffers
                .get(buf as usize)
                .ok_or_else(|| format!("no buffer {buf}"))?;
            rank.storages[st]
                .get(base + offset..base + offset + len)
                .map(|s| s.to_vec())
                .ok_or_else(|| format!("read past buffer {buf}"))
        }
        Loc::In { peer, slot } => {
            let l = link(net, peer, me as u32)?;
            // The slot must hold the next unconsumed piece, already posted.
            let want = l.freed_n;
            let s = slot as usize;
            if l.piece.get(s).copied().flatten() != Some(want) || l.posted_n <= want {
                return Err(format!(
                    "rank {me} reads slot {slot} from rank {peer} before piece {want} was posted there"
                ));
            }
            if len > l.slot_bytes {
                return Err(format!(
                    "read of {len} bytes from a {}-byte slot",
                    l.slot_bytes
                ));
            }
            Ok(l.ring[s][..len].to_vec())
        }
        Loc::Out { peer, slot } => Err(format!(
            "rank {me} reads its outgoing slot {slot} to rank {peer}"
        )),
    }
}

fn write(
    me: usize,
    rank: &mut SimRank,
    net: &mut Net,
    loc: Loc,
    data: &[u8],
) -> std::result::Result<(), String> {
    match loc {
        Loc::Buf { buf, offset } => {
            let &(st, base) = rank
                .buffers
                .get(buf as usize)
                .ok_or_else(|| format!("no buffer {buf}"))?;
            rank.storages[st]
                .get_mut(base + offset..base + offset + data.len())
                .ok_or_else(|| format!("write past buffer {buf}"))?
                .copy_from_slice(data);
            Ok(())
        }
        Loc::Out { peer, slot } => {
            let l = link(net, me as u32, peer)?;
            let k = l.posted_n;
            let s = slot as usize;
            if s >= l.ring.len() || k % l.ring.len() as u64 != s as u64 {
                return Err(format!(
                    "rank {me} writes piece {k} to rank {peer} into slot {slot}"
                ));
            }
            if let Some(old) = l.piece[s] {
                if old != k && old >= l.freed_n {
                    return Err(format!(
                        "rank {me} overwrites piece {old} to rank {peer} before it was consumed"
                    ));
                }
            }
            if data.len() > l.slot_bytes {
                return Err(format!(
                    "{} bytes into a {}-byte slot",
                    data.len(),
                    l.slot_bytes
                ));
            }
            l.piece[s] = Some(k);
            l.ring[s][..data.len()].copy_from_slice(data);
            Ok(())
        }
        Loc::In { peer, slot } => Err(format!(
            "rank {me} writes its incoming slot {slot} from rank {peer}"
        )),
    }
}

/// Run one command; `Ok(false)` when it must wait.
fn step(
    me: usize,
    cmd: &Cmd,
    rank: &mut SimRank,
    net: &mut Net,
) -> std::result::Result<bool, String> {
    match *cmd {
        Cmd::WaitPosted { from, value } => Ok(ge(link(net, from, me as u32)?.posted, value)),
        Cmd::WaitFreed { to, value } => Ok(ge(link(net, me as u32, to)?.freed, value)),
        Cmd::Copy { dst, src, len } => {
            let d = read(me, rank, net, src, len)?;
            write(me, rank, net, dst, &d)?;
            Ok(true)
        }
        Cmd::Reduce { dst, a, b, len } => {
            let (dt, op, _) = rank
                .reduction
                .ok_or("a reduction in a schedule without datatype")?;
            let x = read(me, rank, net, a, len)?;
            let y = read(me, rank, net, b, len)?;
            let mut out = vec![0u8; len];
            reduce::reduce_bytes(&mut out, &x, &y, dt, op).map_err(|e| e.to_string())?;
            write(me, rank, net, dst, &out)?;
            Ok(true)
        }
        Cmd::Divide { dst, len } => {
            let (dt, _, div) = rank
                .reduction
                .ok_or("a division in a schedule without datatype")?;
            let mut d = read(me, rank, net, dst, len)?;
            reduce::divide_bytes(&mut d, dt, div).map_err(|e| e.to_string())?;
            write(me, rank, net, dst, &d)?;
            Ok(true)
        }
        Cmd::Post { to, value } => {
            let l = link(net, me as u32, to)?;
            if value != (l.posted_n + 1) as u32
                || l.piece[(l.posted_n % l.ring.len() as u64) as usize] != Some(l.posted_n)
            {
                return Err(format!(
                    "rank {me} posts {value} to rank {to} after {} pieces, the last not written",
                    l.posted_n
                ));
            }
            l.posted_n += 1;
            l.posted = value;
            Ok(true)
        }
        Cmd::Free { from, value } => {
            let l = link(net, from, me as u32)?;
            if value != (l.freed_n + 1) as u32 || l.freed_n >= l.posted_n {
                return Err(format!(
                    "rank {me} frees {value} from rank {from} after consuming {} of {} posted",
                    l.freed_n, l.posted_n
                ));
            }
            l.freed_n += 1;
            l.freed = value;
            Ok(true)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_core::plan::{plan, Collective, PlanParams};

    fn ring_prog(rank: u32, p: u32, count: usize, piece: usize) -> Program {
        plan(
            &Collective::AllReduce {
                count,
                op: RedOp::Sum,
            },
            DataType::F32,
            &PlanParams::new(rank, p, piece),
        )
        .unwrap()
    }

    #[test]
    fn every_piece_waits_posts_and_frees_once() {
        let prog = ring_prog(0, 3, 3000, 1024);
        let links = Links::uniform(0, 3, 2, 4096);
        let mut cur = Cursor::new(3);
        let cmds = schedule(&prog, &links, &mut cur).unwrap();
        let posts = cmds
            .iter()
            .filter(|c| matches!(c, Cmd::Post { .. }))
            .count();
        let frees = cmds
            .iter()
            .filter(|c| matches!(c, Cmd::Free { .. }))
            .count();
        let waits = cmds
            .iter()
            .filter(|c| matches!(c, Cmd::WaitPosted { .. }))
            .count();
        assert_eq!(posts as u64, cur.sent.iter().sum::<u64>());
        assert_eq!(frees as u64, cur.recvd.iter().sum::<u64>());
        assert_eq!(waits, frees);
        assert!(posts > 2);
        // Slots beyond the first S pieces wait for their previous piece.
        let freed_waits = cmds
            .iter()
            .filter(|c| matches!(c, Cmd::WaitFreed { .. }))
            .count();
        assert_eq!(freed_waits, posts - 2);
    }

    #[test]
    fn a_piece_larger_than_a_slot_is_refused_and_the_cursor_kept() {
        let prog = ring_prog(0, 2, 4096, 8192);
        let links = Links::uniform(0, 2, 4, 4096);
        let mut cur = Cursor::new(2);
        let e = schedule(&prog, &links, &mut cur).unwrap_err().to_string();
        assert!(e.contains("does not fit"), "{e}");
        assert_eq!(cur, Cursor::new(2));
        let one = Links::uniform(0, 2, 1, 1 << 20);
        let e = schedule(&prog, &one, &mut cur).unwrap_err().to_string();
        assert!(e.contains("at least 2"), "{e}");
    }

    #[test]
    fn release_values_cover_every_wait() {
        let prog = ring_prog(1, 3, 5000, 512);
        let links = Links::uniform(1, 3, 3, 4096);
        let mut cur = Cursor::new(3);
        let cmds = schedule(&prog, &links, &mut cur).unwrap();
        let rel = release_values(&cur);
        for c in cmds {
            match c {
                Cmd::WaitPosted { from, value } => assert!(ge(rel[from as usize].0, value)),
                Cmd::WaitFreed { to, value } => assert!(ge(rel[to as usize].1, value)),
                _ => {}
            }
        }
    }
}
