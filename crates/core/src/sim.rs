//! In-memory simulator: runs every rank's [`Program`] together.
//!
//! Each directed pair of ranks is a FIFO of at most `fifo_depth` messages.
//! Ranks take turns; an op runs when its input message is there and its output
//! FIFO has room, ops of one stage in any order. A full pass in which no rank
//! moves while some rank still has work is a deadlock and an error, so the
//! simulator also proves that plans cannot deadlock with FIFOs of that depth.
//! It counts the bytes each rank sends, which the volume tests check against
//! the formulas of the seed ((p−1)·S/p, 2(p−1)·S/p, …).

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

type Fifos = HashMap<(u32, u32), VecDeque<Vec<u8>>>;

/// Run all ranks' programs together with FIFOs of `fifo_depth` messages.
pub fn run(setups: Vec<RankSetup>, fifo_depth: usize) -> Result<SimReport> {
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
    loop {
        let mut progressed = false;
        let mut all_done = true;
        for (r, st) in ranks.iter_mut().enumerate() {
            while st.stage < st.setup.program.stage_ends.len() {
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
                    if st.done[i] {
                        continue;
                    }
                    let op = st.setup.program.ops[i];
                    let (rp, sp) = (op.recv_peer(), op.send_peer());
                    let overlaps = claimed
                        .iter()
                        .any(|&(cr, cs)| (rp.is_some() && rp == cr) || (sp.is_some() && sp == cs));
                    if !overlaps
                        && try_op(r as u32, st, op, &mut fifos, fifo_depth, &mut max_message)?
                    {
                        st.done[i] = true;
                        progressed = true;
                    } else {
                        stage_done = false;
                        claimed.push((rp, sp));
                    }
                }
                if stage_done {
                    st.stage += 1;
                } else {
                    break;
                }
            }
            if st.stage < st.setup.program.stage_ends.len() {
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

/// Run `op` if its input is there and its output has room.
fn try_op(
    me: u32,
    st: &mut RankState,
    op: Op,
    fifos: &mut Fifos,
    depth: usize,
    max_message: &mut usize,
) -> Result<bool> {
    if let Some(from) = op.recv_peer() {
        if fifos.get(&(from, me)).is_none_or(|q| q.is_empty()) {
            return Ok(false);
        }
    }
    if let Some(to) = op.send_peer() {
        if fifos.get(&(me, to)).is_some_and(|q| q.len() >= depth) {
            return Ok(false);
        }
    }
    let input = match op.recv_peer() {
        Some(from) => {
            let msg = fifos
                .get_mut(&(from, me))
                .and_then(|q| q.pop_front())
                .unwrap_or_default();
            if msg.len() != op.wire_len() {
                return Err(sim_err(
                    me as usize,
                    format!(
                        "rank {me} expected {} bytes from rank {from}, got {}",
                        op.wire_len(),
                        msg.len()
                    ),
                ));
            }
            msg
        }
        None => Vec::new(),
    };
    let out = match op {
        Op::Copy { src, dst, finalize } => {
            let mut d = st.read(src)?;
            st.finalize(&mut d, finalize)?;
            st.write(dst, &d)?;
            None
        }
        Op::Send { src, .. } => Some(st.read(src)?),
        Op::Recv { dst, .. } => {
            st.write(dst, &input)?;
            None
        }
        Op::RecvReduceSend { src, .. } => Some(st.reduce(&input, &st.read(src)?)?),
        Op::RecvReduceCopy {
            src, dst, finalize, ..
        } => {
            let mut d = st.reduce(&input, &st.read(src)?)?;
            st.finalize(&mut d, finalize)?;
            st.write(dst, &d)?;
            None
        }
        Op::RecvCopySend { dst, .. } => {
            st.write(dst, &input)?;
            Some(input)
        }
        Op::RecvReduceCopySend {
            src, dst, finalize, ..
        } => {
            let mut d = st.reduce(&input, &st.read(src)?)?;
            st.finalize(&mut d, finalize)?;
            st.write(dst, &d)?;
            Some(d)
        }
    };
    if let (Some(data), Some(to)) = (out, op.send_peer()) {
        st.sent += data.len() as u64;
        *max_message = (*max_message).max(data.len());
        fifos.entry((me, to)).or_default().push_back(data);
    }
    Ok(true)
}
