//! A clock for plans: every rank's [`Program`] run together, without data,
//! on a timed model of hosts and links in the manner of LogGP (Alexandrov
//! et al., 1995) — to predict how long an algorithm takes on thousands of
//! ranks, and to check the tuner's cost model against it.
//!
//! The model ([`Machine`]):
//!
//! - A rank is one CPU that runs one op at a time. An op costs the
//!   per-message overhead `o` of each link it receives from or sends to,
//!   plus its bytes at the CPU's copy speed (and at the reduction speed
//!   when it reduces). Ops of a stage run in any order as they become
//!   ready, pieces to or from one peer in order, as in the engine.
//! - A message leaves when its op ends. Inside a host it reaches the peer
//!   after the shared-memory latency plus its bytes at shared-memory
//!   bandwidth (each directed pair streams on its own). Between hosts it
//!   first waits for its host's network interface (egress: one message at
//!   a time at the network bandwidth), travels for the network latency,
//!   and enters through the receiving host's interface (ingress, likewise
//!   one at a time).
//! - Each directed link holds `fifo_depth` unconsumed messages (the
//!   transport's slots); a sender waits for room.
//!
//! Nothing here is measured: the numbers are a machine's description. The
//! simulation is deterministic.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use crate::error::{CoreError, Result};
use crate::plan::{Op, Program};

/// One class of link (inside a host, or between hosts).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Link {
    /// One-way latency of a message, µs.
    pub latency_us: f64,
    /// Bandwidth, GB/s (10⁹ bytes per second): per directed pair inside a
    /// host; per host interface and direction between hosts.
    pub gbps: f64,
    /// CPU time per message at each end, µs.
    pub overhead_us: f64,
}

/// A cluster: hosts, their links, the CPUs' speeds and the slot FIFOs.
#[derive(Clone, Debug, PartialEq)]
pub struct Machine {
    /// Host of each rank.
    pub hosts: Vec<u32>,
    /// Links inside a host (shared memory).
    pub shm: Link,
    /// Links between hosts (the network).
    pub net: Link,
    /// CPU copy speed, GB/s: every byte a rank sends or receives is copied
    /// once at each end, and local copies cost the same.
    pub copy_gbps: f64,
    /// CPU reduction speed, GB/s (bytes reduced per op that reduces).
    pub reduce_gbps: f64,
    /// Messages a directed link holds before its sender waits.
    pub fifo_depth: usize,
}

impl Machine {
    /// `hosts` hosts of `per_host` ranks each, ranks numbered host by host.
    pub fn uniform(hosts: usize, per_host: usize, shm: Link, net: Link) -> Machine {
        Machine {
            hosts: (0..hosts * per_host)
                .map(|r| (r / per_host.max(1)) as u32)
                .collect(),
            shm,
            net,
            copy_gbps: 20.0,
            reduce_gbps: 10.0,
            fifo_depth: 8,
        }
    }

    /// Number of ranks.
    pub fn nranks(&self) -> usize {
        self.hosts.len()
    }
}

/// What a timed run produced.
#[derive(Clone, Debug, PartialEq)]
pub struct Timing {
    /// When the last rank finished, µs from the common start.
    pub time_us: f64,
    /// Messages sent in all.
    pub messages: u64,
    /// Bytes sent in all.
    pub bytes: u64,
}

/// An op without its regions: what the clock needs.
#[derive(Clone, Copy, Debug)]
struct Step {
    from: u32,
    to: u32,
    bytes: u32,
    /// Reduces (costs the reduction speed) / is a local copy.
    reduce: bool,
    copy: bool,
}

const NONE: u32 = u32::MAX;

impl Step {
    fn of(op: &Op) -> Step {
        let bytes = match *op {
            Op::Copy { src, .. } => src.len,
            _ => op.wire_len(),
        } as u32;
        Step {
            from: op.recv_peer().unwrap_or(NONE),
            to: op.send_peer().unwrap_or(NONE),
            bytes,
            reduce: matches!(
                op,
                Op::RecvReduceSend { .. }
                    | Op::RecvReduceCopy { .. }
                    | Op::RecvReduceCopySend { .. }
            ),
            copy: matches!(op, Op::Copy { .. }),
        }
    }
}

#[derive(Default)]
struct LinkQ {
    /// Arrival times of the messages not yet taken, in order.
    arrivals: VecDeque<f64>,
    /// When this pair's stream is free (inside a host).
    free_at: f64,
}

struct RankRun {
    steps: Vec<Step>,
    stage_ends: Vec<u32>,
    stage: usize,
    done: Vec<bool>,
    busy_until: f64,
    end: f64,
    /// (peer, link index) of the links this rank sends on / receives on.
    outs: Vec<(u32, usize)>,
    ins: Vec<(u32, usize)>,
}

fn find(v: &[(u32, usize)], peer: u32) -> Option<usize> {
    v.iter().find(|(p, _)| *p == peer).map(|(_, i)| *i)
}

/// Picoseconds, for the event queue's order.
fn ps(t_us: f64) -> u64 {
    (t_us * 1e6).round().max(0.0) as u64
}

/// Run every rank's program, made by `program(rank)`, on `machine`.
/// Programs are taken one at a time and kept only as what the clock needs
/// (16 bytes an op), so thousands of ranks fit.
pub fn run(machine: &Machine, mut program: impl FnMut(u32) -> Result<Program>) -> Result<Timing> {
    let p = machine.nranks();
    if machine.fifo_depth == 0 {
        return Err(CoreError::InvalidArgument("fifo depth must be ≥ 1".into()));
    }
    let mut ranks: Vec<RankRun> = Vec::with_capacity(p);
    for r in 0..p as u32 {
        let prog = program(r)?;
        ranks.push(RankRun {
            steps: prog.ops.iter().map(Step::of).collect(),
            stage_ends: prog.stage_ends.clone(),
            stage: 0,
            done: Vec::new(),
            busy_until: 0.0,
            end: 0.0,
            outs: Vec::new(),
            ins: Vec::new(),
        });
    }
    let mut clock = Clock::new(machine, ranks);
    while let Some(Reverse((t_ps, r))) = clock.queue.pop() {
        let ri = r as usize;
        if clock.scheduled[ri] != Some(t_ps) {
            continue;
        }
        clock.scheduled[ri] = None;
        clock.advance(r, t_ps);
    }
    clock.finish()
}

/// The state of a timed run: the ranks, the links between them, the hosts'
/// network interfaces and the event queue of wake-ups.
struct Clock<'m> {
    machine: &'m Machine,
    ranks: Vec<RankRun>,
    /// Links, created as first used.
    links: Vec<LinkQ>,
    /// Per host: when its network interface is free to send / to receive.
    egress: Vec<f64>,
    ingress: Vec<f64>,
    /// Wake-ups: (picoseconds, rank), earliest first.
    queue: BinaryHeap<Reverse<(u64, u32)>>,
    /// Each rank's one pending wake-up (earlier ones replace later ones; a
    /// rank that finds nothing to do schedules its next arrival itself).
    scheduled: Vec<Option<u64>>,
    messages: u64,
    bytes: u64,
    /// Scratch for [`Clock::pick`]: the links of the pending ops passed over.
    used: Vec<(u32, u32)>,
}

/// Microseconds that `bytes` take at `gbps`.
fn cost(bytes: u32, gbps: f64) -> f64 {
    bytes as f64 / (gbps * 1e3)
}

impl<'m> Clock<'m> {
    /// A run of `ranks` on `machine`, every rank due at time 0.
    fn new(machine: &'m Machine, ranks: Vec<RankRun>) -> Clock<'m> {
        let p = ranks.len();
        let nhosts = machine.hosts.iter().max().map_or(0, |&h| h as usize + 1);
        Clock {
            machine,
            ranks,
            links: Vec::new(),
            egress: vec![0.0f64; nhosts],
            ingress: vec![0.0f64; nhosts],
            queue: (0..p as u32).map(|r| Reverse((0, r))).collect(),
            scheduled: vec![Some(0); p],
            messages: 0,
            bytes: 0,
            used: Vec::new(),
        }
    }

    /// The host of rank `r`.
    fn host(&self, r: u32) -> u32 {
        self.machine.hosts[r as usize]
    }

    /// Schedule rank `r` at `at` ps, unless it is due earlier already.
    fn wake(&mut self, r: u32, at: u64) {
        let s = &mut self.scheduled[r as usize];
        if s.is_none_or(|s| at < s) {
            *s = Some(at);
            self.queue.push(Reverse((at, r)));
        }
    }

    /// Rank `r`, woken at `t_ps`: moves past finished stages, then runs the
    /// first ready op of its stage, or waits (for its CPU, or for the next
    /// message to arrive).
    fn advance(&mut self, r: u32, t_ps: u64) {
        let ri = r as usize;
        let t = t_ps as f64 / 1e6;
        loop {
            let rk = &mut self.ranks[ri];
            if rk.stage >= rk.stage_ends.len() {
                break;
            }
            let start = if rk.stage == 0 {
                0
            } else {
                rk.stage_ends[rk.stage - 1] as usize
            };
            let end = rk.stage_ends[rk.stage] as usize;
            if rk.done.len() != end - start {
                rk.done.clear();
                rk.done.resize(end - start, false);
            }
            if rk.done.iter().all(|&d| d) {
                rk.stage += 1;
                rk.done.clear();
                if rk.stage >= rk.stage_ends.len() {
                    rk.end = rk.busy_until.max(t);
                }
                continue;
            }
            if ps(rk.busy_until) > t_ps {
                let at = ps(rk.busy_until);
                self.wake(r, at);
                break;
            }
            let Some(i) = self.pick(ri, start, end, t_ps) else {
                // Nothing ready: look again when the next message arrives
                // (a slot freed by a receiver wakes this rank itself).
                let next = self.ranks[ri]
                    .ins
                    .iter()
                    .filter_map(|&(_, l)| self.links[l].arrivals.front())
                    .map(|&a| ps(a))
                    .filter(|&a| a > t_ps)
                    .min();
                if let Some(at) = next {
                    self.wake(r, at);
                }
                break;
            };
            self.ranks[ri].done[i - start] = true;
            self.execute(r, self.ranks[ri].steps[i], t, t_ps);
            break;
        }
    }

    /// The first ready op of rank `ri`'s stage (ops `start..end`) at
    /// `t_ps`: its message has arrived and its link has room; an op waits
    /// behind an earlier pending op of its stage on the same link.
    fn pick(&mut self, ri: usize, start: usize, end: usize, t_ps: u64) -> Option<usize> {
        let rk = &self.ranks[ri];
        self.used.clear();
        for i in start..end {
            if rk.done[i - start] {
                continue;
            }
            let s = rk.steps[i];
            let blocked_link = self
                .used
                .iter()
                .any(|&(f, o)| (s.from != NONE && f == s.from) || (s.to != NONE && o == s.to));
            let ready_in = s.from == NONE
                || find(&rk.ins, s.from)
                    .and_then(|l| self.links[l].arrivals.front())
                    .is_some_and(|&a| ps(a) <= t_ps);
            let ready_out = s.to == NONE
                || find(&rk.outs, s.to)
                    .is_none_or(|l| self.links[l].arrivals.len() < self.machine.fifo_depth);
            if !blocked_link && ready_in && ready_out {
                return Some(i);
            }
            self.used.push((s.from, s.to));
        }
        None
    }

    /// Rank `r` runs step `s` at `t` µs (`t_ps`): takes its message, costs
    /// its CPU time, sends its message, and wakes itself when done.
    fn execute(&mut self, r: u32, s: Step, t: f64, t_ps: u64) {
        let ri = r as usize;
        let machine = self.machine;
        let mut cpu = 0.0;
        if s.from != NONE {
            let l = find(&self.ranks[ri].ins, s.from).unwrap_or(0);
            self.links[l].arrivals.pop_front();
            let lk = if self.host(s.from) == self.host(r) {
                machine.shm
            } else {
                machine.net
            };
            cpu += lk.overhead_us + cost(s.bytes, machine.copy_gbps);
            // The sender may have waited for this slot.
            self.wake(s.from, t_ps);
        }
        if s.reduce {
            cpu += cost(s.bytes, machine.reduce_gbps);
        }
        if s.copy {
            cpu += cost(s.bytes, machine.copy_gbps);
        }
        let to = s.to;
        if to != NONE {
            let same = self.host(to) == self.host(r);
            let lk = if same { machine.shm } else { machine.net };
            cpu += lk.overhead_us + cost(s.bytes, machine.copy_gbps);
        }
        let done_at = t + cpu;
        self.ranks[ri].busy_until = done_at;
        if to != NONE {
            self.send(r, to, s.bytes, done_at);
        }
        self.wake(r, ps(done_at));
    }

    /// A message of `bytes` from rank `r` to rank `to`, leaving at
    /// `done_at` µs: inside a host over the pair's own stream, between
    /// hosts through both hosts' interfaces; it arrives after the link's
    /// earlier messages and wakes the receiver.
    fn send(&mut self, r: u32, to: u32, bytes: u32, done_at: f64) {
        let ri = r as usize;
        let machine = self.machine;
        let l = match find(&self.ranks[ri].outs, to) {
            Some(l) => l,
            None => {
                self.links.push(LinkQ::default());
                let l = self.links.len() - 1;
                self.ranks[ri].outs.push((to, l));
                self.ranks[to as usize].ins.push((r, l));
                l
            }
        };
        let wire = |g: f64| cost(bytes, g);
        let arrive = if self.host(to) == self.host(r) {
            let st = done_at.max(self.links[l].free_at);
            self.links[l].free_at = st + wire(machine.shm.gbps);
            self.links[l].free_at + machine.shm.latency_us
        } else {
            let (h1, h2) = (self.host(r) as usize, self.host(to) as usize);
            let st = done_at.max(self.egress[h1]);
            self.egress[h1] = st + wire(machine.net.gbps);
            let a = (self.egress[h1] + machine.net.latency_us)
                .max(self.ingress[h2] + wire(machine.net.gbps));
            self.ingress[h2] = a;
            a
        };
        let arrivals = &mut self.links[l].arrivals;
        let arrive = arrivals.back().map_or(arrive, |&b| arrive.max(b));
        arrivals.push_back(arrive);
        self.wake(to, ps(arrive));
        self.messages += 1;
        self.bytes += bytes as u64;
    }

    /// The timing, or an error naming a rank that never finished.
    fn finish(self) -> Result<Timing> {
        if let Some((r, rk)) = self
            .ranks
            .iter()
            .enumerate()
            .find(|(_, rk)| rk.stage < rk.stage_ends.len())
        {
            return Err(CoreError::Protocol {
                peer: r as u32,
                detail: format!(
                    "timed run stuck: rank {r} at stage {} of {}",
                    rk.stage,
                    rk.stage_ends.len()
                ),
            });
        }
        Ok(Timing {
            time_us: self.ranks.iter().map(|r| r.end).fold(0.0, f64::max),
            messages: self.messages,
            bytes: self.bytes,
        })
    }
}
