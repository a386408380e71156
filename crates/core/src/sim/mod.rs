//! In-memory simulator: runs every rank's [`Program`] together.
//!
//! Each directed pair of ranks is a FIFO of at most `fifo_depth` messages.
//! Ranks take turns; an op runs when its input message is there and its output
//! FIFO has room, ops of one stage in any order. A full pass in which no rank
//! moves while some rank still has work is a deadlock and an error, so the
//! simulator also proves that plans cannot deadlock with FIFOs of that depth.
//! It counts the bytes each rank sends, which the volume tests check against
//! the formulas of the seed ((p−1)·S/p, 2(p−1)·S/p, …).
//!
//! [`run_with`] can also check that plans may send by reference (single
//! copy): every message that a rank sent from its buffers must still match
//! those buffers when the receiver takes it — a rank that rewrites a region
//! before the peer read it would have corrupted a by-reference transfer.
//! And it can run the ranks' turns in reverse order, another interleaving.
//!
//! [`clock`] runs the same programs without data on a timed model of hosts
//! and links (LogGP-style) to predict how long each algorithm takes.

pub mod clock;

use std::collections::{HashMap, VecDeque};

use crate::error::{CoreError, Result};
use crate::plan::{Op, Program, Region};
use crate::reduce;

/// One rank's input to the simulator.
#[derive(Clone, Debug)]
pub struct RankSetup {
    /// The rank's program.
    pub program: Program,
    /// Backing memory.
    pub storages: Vec<Vec<u8>>,
    /// For each buffer index of the program: (storage index, byte offset).
    /// Two buffers mapped into the same storage model in-place operations.
    pub buffers: Vec<(usize, usize)>,
}

/// What a simulation produced.
#[derive(Clone, Debug)]
pub struct SimReport {
    /// Every rank's storages after the run.
    pub storages: Vec<Vec<Vec<u8>>>,
    /// Bytes each rank sent.
    pub bytes_sent: Vec<u64>,
    /// Largest single message seen.
    pub max_message: usize,
}

struct RankState {
    setup: RankSetup,
    stage: usize,
    done: Vec<bool>,
    sent: u64,
}

fn sim_err(rank: usize, detail: String) -> CoreError {
    CoreError::Protocol {
        peer: rank as u32,
        detail,
    }
}

impl RankState {
    fn range(&self, r: Region) -> Result<(usize, std::ops::Range<usize>)> {
        let &(st, base) = self
            .setup
            .buffers
            .get(r.buf as usize)
            .ok_or_else(|| CoreError::InvalidArgument(format!("no buffer {}", r.buf)))?;
        let start = base + r.offset;
        let end = start + r.len;
        if end > self.setup.storages[st].len() {
            return Err(CoreError::InvalidArgument(format!(
                "region {r:?} runs past buffer {} ({} bytes)",
                r.buf,
                self.setup.storages[st].len() - base
            )));
        }
        Ok((st, start..end))
    }

    fn read(&self, r: Region) -> Result<Vec<u8>> {
        let (st, range) = self.range(r)?;
        Ok(self.setup.storages[st][range].to_vec())
    }

    fn write(&mut self, r: Region, data: &[u8]) -> Result<()> {
        let (st, range) = self.range(r)?;
        self.setup.storages[st][range].copy_from_slice(data);
        Ok(())
    }

    fn reduce(&self, a: &[u8], b: &[u8]) -> Result<Vec<u8>> {
        let p = &self.setup.program;
        let mut out = vec![0u8; a.len()];
        match (p.dtype, p.red_op) {
            (Some(dt), Some(op)) => reduce::reduce_bytes(&mut out, a, b, dt, op)?,
            _ => {
                return Err(CoreError::InvalidArgument(
                    "reducing op in a program without datatype and operator".into(),
                ))
            }
        }
        Ok(out)
    }

    fn finalize(&self, data: &mut [u8], finalize: bool) -> Result<()> {
        let p = &self.setup.program;
        if finalize && p.divisor > 1 {
            if let Some(dt) = p.dtype {
                reduce::divide_bytes(data, dt, p.divisor)?;
            }
        }
        Ok(())
    }
}

/// A message in flight: its bytes and, for data sent from the sender's
/// buffers, where they came from (storage index and byte range).
struct Msg {
    data: Vec<u8>,
    from_buffer: Option<(usize, std::ops::Range<usize>)>,
}

type Fifos = HashMap<(u32, u32), VecDeque<Msg>>;

/// How [`run_with`] runs the programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimOptions {
    /// Messages each directed link holds.
    pub fifo_depth: usize,
    /// Fail if a rank rewrites a region it sent before the receiver took
    /// the message (see the module docs).
    pub check_references: bool,
    /// Ranks take their turns from the last to the first.
    pub reverse: bool,
}

/// Run all ranks' programs together with FIFOs of `fifo_depth` messages.
pub fn run(setups: Vec<RankSetup>, fifo_depth: usize) -> Result<SimReport> {
    run_with(
        setups,
        SimOptions {
            fifo_depth,
            check_references: false,
            reverse: false,
        },
    )
}

/// Run all ranks' programs together as `opts` say.
pub fn run_with(setups: Vec<RankSetup>, opts: SimOptions) -> Result<SimReport> {
    let fifo_depth = opts.fifo_depth;
    if fifo_depth == 0 {
        return Err(CoreError::InvalidArgument("fifo depth must be ≥ 1".into()));
    }
    // Note: ring steps hold an input slot while they fill an output slot, so
    // rings need FIFOs of at least two slots; pairwise exchanges and groups
    // work with one. Transports must offer at least two slots.
    let mut ranks: Vec<RankState> = setups
        .into_iter()
        .map(|s| RankState {
            done: vec![false; s.program.ops.len()],
            setup: s,
            stage: 0,
            sent: 0,
        })
        .collect();
    let mut fifos: Fifos = HashMap::new();
    let mut max_message = 0;
    let n = ranks.len();
    loop {
        let mut progressed = false;
        let mut all_done = true;
        for turn in 0..n {
            let r = if opts.reverse { n - 1 - turn } else { turn };
            while ranks[r].stage < ranks[r].setup.program.stage_ends.len() {
                let st = &ranks[r];
                let start = if st.stage == 0 {
                    0
                } else {
                    st.setup.program.stage_ends[st.stage - 1] as usize
                };
                let end = st.setup.program.stage_ends[st.stage] as usize;
                let mut stage_done = true;
                // Pieces to or from one peer keep their order: an op waits
                // while an earlier blocked op of its stage uses the same link.
                let mut claimed: Vec<(Option<u32>, Option<u32>)> = Vec::new();
                for i in start..end {
                    if ranks[r].done[i] {
                        continue;
                    }
                    let op = ranks[r].setup.program.ops[i];
                    let (rp, sp) = (op.recv_peer(), op.send_peer());
                    let overlaps = claimed
                        .iter()
                        .any(|&(cr, cs)| (rp.is_some() && rp == cr) || (sp.is_some() && sp == cs));
                    if !overlaps
                        && try_op(r as u32, &mut ranks, op, &mut fifos, opts, &mut max_message)?
                    {
                        ranks[r].done[i] = true;
                        progressed = true;
                    } else {
                        stage_done = false;
                        claimed.push((rp, sp));
                    }
                }
                if stage_done {
                    ranks[r].stage += 1;
                } else {
                    break;
                }
            }
            if ranks[r].stage < ranks[r].setup.program.stage_ends.len() {
                all_done = false;
            }
        }
        if all_done {
            break;
        }
        if !progressed {
            let stuck: Vec<String> = ranks
                .iter()
                .enumerate()
                .filter(|(_, s)| s.stage < s.setup.program.stage_ends.len())
                .map(|(r, s)| format!("rank {r} at stage {}", s.stage))
                .collect();
            return Err(sim_err(0, format!("deadlock: {}", stuck.join(", "))));
        }
    }
    if let Some(((from, to), q)) = fifos.iter().find(|(_, q)| !q.is_empty()) {
        return Err(sim_err(
            *from as usize,
            format!(
                "{} message(s) from rank {from} to rank {to} never consumed",
                q.len()
            ),
        ));
    }
    Ok(SimReport {
        bytes_sent: ranks.iter().map(|s| s.sent).collect(),
        storages: ranks.into_iter().map(|s| s.setup.storages).collect(),
        max_message,
    })
}

/// Run `op` of rank `me` if its input is there and its output has room.
fn try_op(
    me: u32,
    ranks: &mut [RankState],
    op: Op,
    fifos: &mut Fifos,
    opts: SimOptions,
    max_message: &mut usize,
) -> Result<bool> {
    if let Some(from) = op.recv_peer() {
        if fifos.get(&(from, me)).is_none_or(|q| q.is_empty()) {
            return Ok(false);
        }
    }
    if let Some(to) = op.send_peer() {
        if fifos
            .get(&(me, to))
            .is_some_and(|q| q.len() >= opts.fifo_depth)
        {
            return Ok(false);
        }
    }
    let input = match op.recv_peer() {
        Some(from) => {
            let msg = fifos
                .get_mut(&(from, me))
                .and_then(|q| q.pop_front())
                .ok_or_else(|| sim_err(me as usize, "message vanished".into()))?;
            if msg.data.len() != op.wire_len() {
                return Err(sim_err(
                    me as usize,
                    format!(
                        "rank {me} expected {} bytes from rank {from}, got {}",
                        op.wire_len(),
                        msg.data.len()
                    ),
                ));
            }
            if let (true, Some((sti, range))) = (opts.check_references, &msg.from_buffer) {
                let now = ranks
                    .get(from as usize)
                    .and_then(|s| s.setup.storages.get(*sti))
                    .and_then(|s| s.get(range.clone()));
                if now != Some(&msg.data[..]) {
                    return Err(sim_err(
                        from as usize,
                        format!(
                            "rank {from} rewrote bytes {range:?} of its storage {sti} that it had sent to rank {me} before rank {me} took them: a by-reference transfer would have been corrupted"
                        ),
                    ));
                }
            }
            msg.data
        }
        None => Vec::new(),
    };
    let st = &mut ranks[me as usize];
    let source = |st: &RankState, r: Region| st.range(r).ok();
    let (out, from_buffer) = match op {
        Op::Copy { src, dst, finalize } => {
            let mut d = st.read(src)?;
            st.finalize(&mut d, finalize)?;
            st.write(dst, &d)?;
            (None, None)
        }
        Op::Send { src, .. } => (Some(st.read(src)?), source(st, src)),
        Op::Recv { dst, .. } => {
            st.write(dst, &input)?;
            (None, None)
        }
        Op::RecvReduceSend { src, .. } => (Some(st.reduce(&input, &st.read(src)?)?), None),
        Op::RecvReduceCopy {
            src, dst, finalize, ..
        } => {
            let mut d = st.reduce(&input, &st.read(src)?)?;
            st.finalize(&mut d, finalize)?;
            st.write(dst, &d)?;
            (None, None)
        }
        Op::RecvCopySend { dst, .. } => {
            st.write(dst, &input)?;
            (Some(input), source(st, dst))
        }
        Op::RecvReduceCopySend {
            src, dst, finalize, ..
        } => {
            let mut d = st.reduce(&input, &st.read(src)?)?;
            st.finalize(&mut d, finalize)?;
            st.write(dst, &d)?;
            (Some(d), source(st, dst))
        }
    };
    if let (Some(data), Some(to)) = (out, op.send_peer()) {
        st.sent += data.len() as u64;
        *max_message = (*max_message).max(data.len());
        fifos
            .entry((me, to))
            .or_default()
            .push_back(Msg { data, from_buffer });
    }
    Ok(true)
}
