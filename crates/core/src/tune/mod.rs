//! The tuner's cost model: how long each algorithm takes for a collective
//! of a given size on a given shape of job, from the per-message latency,
//! per-byte cost and per-message CPU overhead of the two kinds of link
//! (inside a host, between hosts) — the step structure of each plan in
//! closed form, as NCCL's `tuning.cc` models its algorithms (a latency per
//! step plus bytes over a bandwidth), with the pipelining and the sharing
//! of a host's network interface that [`crate::sim::clock`] simulates.
//! [`best`] picks the fastest candidate; the runtime caches its answer per
//! call shape. Pure: the runtime supplies the link costs (measured at
//! first use, or [`Costs::defaults`]) and the shape.
//!
//! The model is checked against the timed simulator by
//! `crates/core/tests/sim_clock.rs` and its golden table: in every cell
//! the pick's simulated time is within 10% of the best algorithm's.

use serde::{Deserialize, Serialize};

use crate::plan::{Algo, Choice, CollKind};
use crate::sim::clock::{Link, Machine};
use crate::transport::TransportKind;

mod settings;
mod trial;

pub use settings::{parse_choice, Forced, LinkCosts, Rule, Rules};
pub use trial::{
    runs_within, size_class, timed_pick, trial, Trial, TrialLimits, TRIAL_BUDGET_US, TRIAL_MARGIN,
    TRIAL_MAX, TRIAL_MAX_BYTES,
};

/// What the model knows of the links and CPUs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Costs {
    /// Links inside a host.
    pub shm: Link,
    /// Links between hosts.
    pub net: Link,
    /// CPU copy speed, GB/s.
    pub copy_gbps: f64,
    /// CPU reduction speed, GB/s.
    pub reduce_gbps: f64,
}

impl Costs {
    /// Defaults for a job whose hosts talk over `net` (the network
    /// transport in use), for when nothing was measured: shared memory
    /// 0.5 µs and 20 GB/s per pair; sockets 25 µs and 1.25 GB/s (10 Gb/s
    /// Ethernet); InfiniBand 3 µs and 12.5 GB/s.
    pub fn defaults(net: TransportKind) -> Costs {
        let net = match net {
            TransportKind::Ib => Link {
                latency_us: 3.0,
                gbps: 12.5,
                overhead_us: 1.0,
            },
            _ => Link {
                latency_us: 25.0,
                gbps: 1.25,
                overhead_us: 3.0,
            },
        };
        Costs {
            shm: Link {
                latency_us: 0.5,
                gbps: 20.0,
                overhead_us: 0.2,
            },
            net,
            copy_gbps: 20.0,
            reduce_gbps: 10.0,
        }
    }

    /// The costs of `m`'s links and CPUs.
    pub fn of_machine(m: &Machine) -> Costs {
        Costs {
            shm: m.shm,
            net: m.net,
            copy_gbps: m.copy_gbps,
            reduce_gbps: m.reduce_gbps,
        }
    }
}

/// The shape of a job as the model sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Ranks.
    pub nranks: usize,
    /// Hosts.
    pub nhosts: usize,
    /// Ranks on the fullest host.
    pub per_host: usize,
    /// Largest piece of reducing collectives (the smallest slot), bytes.
    pub piece: usize,
    /// Largest piece of collectives that only move data, bytes.
    pub move_piece: usize,
    /// Pieces of at least this many bytes cross hosts by reference in
    /// algorithms that allow it ([`Choice::single_copy_safe`]): the sender's
    /// copy into a slot goes (sockets: the progress thread writes from the
    /// caller's buffer). `usize::MAX`: never.
    pub net_ref_min_bytes: usize,
}

impl Shape {
    /// `nhosts` hosts of `per_host` ranks, pieces of `piece` bytes.
    pub fn uniform(nhosts: usize, per_host: usize, piece: usize) -> Shape {
        Shape {
            nranks: nhosts * per_host,
            nhosts,
            per_host,
            piece,
            move_piece: piece,
            net_ref_min_bytes: usize::MAX,
        }
    }
}

/// One exchange step's costs, µs.
#[derive(Clone, Copy, Debug, Default)]
struct Step {
    /// CPU, and the pieces after the first.
    cpu: f64,
    /// The first piece on the wire, behind the host's other ranks' pieces.
    wire: f64,
    /// The part of `wire` spent behind the other ranks' pieces.
    queued: f64,
    latency: f64,
}

/// Link classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    Shm,
    /// The network, with this many ranks of a host using its interface at
    /// once.
    Net(usize),
}

struct Model<'a> {
    c: &'a Costs,
    s: &'a Shape,
    /// The algorithm may send by reference ([`Shape::net_ref_min_bytes`]).
    by_ref: bool,
}

/// Bytes → µs at `gbps`.
fn at(bytes: f64, gbps: f64) -> f64 {
    bytes / (gbps * 1e3)
}

impl Model<'_> {
    fn link(&self, v: Via) -> (Link, f64) {
        match v {
            Via::Shm => (self.c.shm, 1.0),
            Via::Net(share) => (self.c.net, share.max(1) as f64),
        }
    }

    /// CPU time of one message of `b` bytes at one end.
    fn cpu(&self, v: Via, b: f64) -> f64 {
        self.link(v).0.overhead_us + at(b, self.c.copy_gbps)
    }

    /// CPU time of one message of `b` bytes at both ends: without the
    /// sender's copy where it goes by reference.
    fn pair(&self, v: Via, b: f64) -> f64 {
        let by_ref =
            self.by_ref && matches!(v, Via::Net(_)) && b >= self.s.net_ref_min_bytes as f64;
        2.0 * self.cpu(v, b) - if by_ref { at(b, self.c.copy_gbps) } else { 0.0 }
    }

    fn red(&self, b: f64) -> f64 {
        at(b, self.c.reduce_gbps)
    }

    /// One exchange step: every rank sends `bytes` and receives as much
    /// (reducing it when `reduce`) over `v`, in pieces of `piece`, both
    /// directions in one stage. A sequence of steps adds up with
    /// [`Model::steps`].
    fn exchange(&self, v: Via, bytes: f64, piece: usize, reduce: bool) -> Step {
        if bytes <= 0.0 {
            return Step::default();
        }
        let (lk, share) = self.link(v);
        let np = (bytes / piece as f64).ceil().max(1.0);
        let b = bytes / np;
        let cpu = self.pair(v, b) + if reduce { self.red(b) } else { 0.0 };
        let wire = at(b, lk.gbps) * share;
        Step {
            cpu: cpu + (np - 1.0) * cpu.max(wire),
            wire,
            queued: wire - wire / share,
            latency: lk.latency_us,
        }
    }

    /// A sequence of exchange steps, each waiting for the one before. Each
    /// costs its CPU, wire and latency, except that where ranks of a host
    /// share its interface, the next step's messages of the ranks done
    /// first queue behind the others' while their latency passes.
    fn steps(&self, steps: &[Step]) -> f64 {
        let mut t = 0.0;
        let mut queued = 0.0f64;
        for s in steps {
            t += s.cpu + s.wire + s.latency - queued.min(s.latency);
            queued = s.queued;
        }
        t
    }

    /// How a rank reaches the partner `d` ring positions away when ranks
    /// are numbered host by host: inside the host if `d` stays inside
    /// every host's block, else the network, shared by the ranks of a host
    /// that cross at once.
    fn via_distance(&self, d: usize) -> Via {
        let (h, ppn) = (self.s.nhosts, self.s.per_host.max(1));
        if h <= 1 || (d < ppn && ppn.is_multiple_of(2 * d)) {
            Via::Shm
        } else {
            Via::Net(d.min(ppn))
        }
    }

    /// One hop of a pipelined chain of `b`-byte pieces over `v`: the
    /// sender's and receiver's CPU, the wire and the latency.
    fn hop(&self, v: Via, b: f64, reduce: bool) -> f64 {
        let (lk, share) = self.link(v);
        lk.latency_us
            + self.pair(v, b)
            + if reduce { self.red(b) } else { 0.0 }
            + at(b, lk.gbps) * share
    }

    /// A hop of a ring over every rank: the network for the share of hops
    /// that leave a host, shared memory for the others.
    fn ring_hop(&self, b: f64, reduce: bool) -> f64 {
        let (p, h) = (self.s.nranks as f64, self.s.nhosts as f64);
        if self.s.nhosts <= 1 {
            return self.hop(Via::Shm, b, reduce);
        }
        let f = h / p;
        f * self.hop(Via::Net(1), b, reduce) + (1.0 - f) * self.hop(Via::Shm, b, reduce)
    }

    /// A chain of `m` ranks inside a host moving `bytes` in pieces.
    fn chain(&self, v: Via, m: usize, bytes: f64, piece: usize, reduce: bool) -> f64 {
        if m <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        let np = (bytes / piece as f64).ceil().max(1.0);
        let b = bytes / np;
        let per = self.pair(v, b) + if reduce { self.red(b) } else { 0.0 };
        let (lk, share) = self.link(v);
        let wire = at(b, lk.gbps) * share;
        (m - 1) as f64 * self.hop(v, b, reduce) + (np - 1.0) * per.max(wire)
    }

    /// Recursive doubling over `p` ranks (`ppn` per host).
    fn rd(&self, p: usize, bytes: f64) -> f64 {
        if p <= 1 {
            return 0.0;
        }
        let pp = 1usize << (usize::BITS - 1 - p.leading_zeros());
        let mut st = Vec::new();
        let fold = self.exchange(self.via_distance(pp), bytes, self.s.piece, false);
        if pp < p {
            st.push(fold);
        }
        let mut m = 1;
        while m < pp {
            st.push(self.exchange(self.via_distance(m), bytes, self.s.piece, true));
            m *= 2;
        }
        if pp < p {
            st.push(fold);
        }
        self.steps(&st)
    }

    /// Rabenseifner over `p` ranks.
    fn rab(&self, p: usize, bytes: f64) -> f64 {
        self.halving(p, bytes, false)
    }

    /// Rabenseifner's AllReduce over `p` ranks, or with `reduce` its
    /// Reduce: the gather to the root costs as the all-gather's steps do
    /// (each moves the same range, one way), the result goes back to a
    /// folded root only.
    fn halving(&self, p: usize, bytes: f64, reduce: bool) -> f64 {
        if p <= 1 {
            return 0.0;
        }
        let pp = 1usize << (usize::BITS - 1 - p.leading_zeros());
        let fold = self.exchange(self.via_distance(pp), bytes, self.s.piece, false);
        let mut rs = Vec::new();
        let mut ag = Vec::new();
        let mut m = 1;
        let mut part = bytes;
        while m < pp {
            part /= 2.0;
            let v = self.via_distance(m);
            rs.push(self.exchange(v, part, self.s.piece, true));
            ag.push(self.exchange(v, part, self.s.piece, false));
            m *= 2;
        }
        ag.reverse();
        let mut st = Vec::new();
        if pp < p {
            st.push(fold);
        }
        st.extend(rs);
        st.extend(ag);
        if pp < p && !reduce {
            st.push(fold);
        }
        self.steps(&st)
    }

    /// Ring AllReduce over every rank.
    fn ring_allreduce(&self, bytes: f64) -> f64 {
        let p = self.s.nranks;
        if p <= 1 {
            return 0.0;
        }
        let loops = (bytes / (p * self.s.piece) as f64).ceil().max(1.0);
        let c = bytes / (loops * p as f64);
        loops * self.ring_steps(p - 1, c, true).max(0.0) + loops * self.ring_steps(p - 1, c, false)
    }

    /// `n` steps of a ring over every rank moving `c`-byte chunks: the
    /// longer of the critical path (the network's share of hops at its
    /// latency, the rest inside hosts) and the bandwidth bound (every step
    /// crosses the slowest link once, one chunk per step).
    fn ring_steps(&self, n: usize, c: f64, reduce: bool) -> f64 {
        let n = n as f64;
        let path = n * self.ring_hop(c, reduce);
        let v = if self.s.nhosts > 1 {
            Via::Net(1)
        } else {
            Via::Shm
        };
        let (lk, _) = self.link(v);
        let per = self.pair(v, c) + if reduce { self.red(c) } else { 0.0 };
        let bound = n * per.max(at(c, lk.gbps)) + lk.latency_us;
        path.max(bound)
    }

    /// Double binary tree: every piece up both trees, then down. On hosts
    /// of several ranks, the rail-aligned trees ([`Model::rail_trees`]).
    fn tree_allreduce(&self, bytes: f64) -> f64 {
        let p = self.s.nranks;
        if p <= 1 {
            return 0.0;
        }
        if self.s.nhosts > 1 && self.s.per_host > 1 {
            return self.rail_trees(bytes);
        }
        let depth = (usize::BITS - (p - 1).leading_zeros()) as f64;
        let v = if self.s.nhosts > 1 {
            Via::Net(1)
        } else {
            Via::Shm
        };
        let half = bytes / 2.0;
        let np = (half / self.s.piece as f64).ceil().max(1.0);
        let b = half / np;
        // A rank handles each piece of both trees in turn: two children's
        // pieces reduced and one sent up in one tree, one sent up in the
        // other; down, one received and two sent, and one received.
        let wire = 2.0 * at(b, self.link(v).0.gbps) * self.s.per_host as f64;
        let up = 2.0 * depth * self.hop(v, b, true)
            + (np - 1.0) * (5.0 * self.cpu(v, b) + 2.0 * self.red(b)).max(wire);
        let down =
            2.0 * depth * self.hop(v, b, false) + (np - 1.0) * (5.0 * self.cpu(v, b)).max(wire);
        up + down
    }

    /// The double binary tree on H hosts of m ranks (the plan's
    /// rail-aligned trees): each tree a chain of m − 1 shared-memory hops
    /// inside a host and ⌈log2 H⌉ levels between hosts, where one rank per
    /// host and tree uses the network. The pieces barely pipeline (the
    /// timed simulator shows it): a rank takes piece j of the second tree
    /// only after piece j of the first, and the second tree's chain passes
    /// through the first tree's head, so each piece waits for the one
    /// before it to go up and down both trees. The first piece takes one
    /// and a half such trips: the trees' first pieces go up together.
    fn rail_trees(&self, bytes: f64) -> f64 {
        let half = bytes / 2.0;
        let np = (half / self.s.piece as f64).ceil().max(1.0);
        let b = half / np;
        let trip = self.rail_path(b, true) + self.rail_path(b, false);
        1.5 * trip + (np - 1.0) * 2.0 * trip
    }

    /// One piece of `b` bytes up (`reduce`) or down one rail-aligned tree:
    /// the host's chain and the levels between hosts.
    fn rail_path(&self, b: f64, reduce: bool) -> f64 {
        let levels = Self::ceil_log2(self.s.nhosts) as f64;
        (self.s.per_host - 1) as f64 * self.hop(Via::Shm, b, reduce)
            + levels * self.hop(Via::Net(1), b, reduce)
    }

    /// ⌈log2 n⌉ (0 for n ≤ 1): the levels of a binary or binomial tree
    /// over n nodes.
    fn ceil_log2(n: usize) -> usize {
        (usize::BITS - n.saturating_sub(1).leading_zeros()) as usize
    }

    fn hier_allreduce(&self, bytes: f64, inner: Algo) -> f64 {
        let m = self.s.per_host;
        let h = self.s.nhosts;
        let leaders = Shape {
            nranks: h,
            nhosts: h,
            per_host: 1,
            ..*self.s
        };
        let lead = Model {
            c: self.c,
            s: &leaders,
            by_ref: self.by_ref,
        };
        let inner_t = match inner {
            Algo::Rd => lead.rd(h, bytes),
            Algo::Rabenseifner => lead.rab(h, bytes),
            Algo::Tree => lead.tree_allreduce(bytes),
            _ => lead.ring_allreduce(bytes),
        };
        self.chain(Via::Shm, m, bytes, self.s.piece, true)
            + inner_t
            + self.chain(Via::Shm, m, bytes, self.s.piece, false)
    }

    /// Bruck AllGather / ReduceScatter: `total` is the whole gathered (or
    /// scattered) buffer.
    fn bruck(&self, total: f64, reduce: bool) -> f64 {
        let p = self.s.nranks;
        let block = total / p as f64;
        let piece = if reduce {
            self.s.piece
        } else {
            self.s.move_piece
        };
        // The partner is `d` ring positions away (not a bit flip): the
        // `d` ranks at the end of every host cross to the next, sharing its
        // interface. Steps below a host's size move a chain of blocks less
        // than a host's width, so one of them at most adds a network
        // latency to the critical path; the others pay the host's.
        let ppn = self.s.per_host.max(1);
        let mut st = Vec::new();
        let mut d = 1;
        while d < p {
            let cnt = d.min(p - d) as f64;
            let v = if self.s.nhosts > 1 {
                Via::Net(d.min(ppn))
            } else {
                Via::Shm
            };
            let mut step = self.exchange(v, cnt * block, piece, reduce);
            if self.s.nhosts > 1 && 2 * d < ppn {
                let b = cnt * block;
                step.latency = self.c.shm.latency_us;
                step.cpu -= 2.0
                    * (self.c.net.overhead_us - self.c.shm.overhead_us)
                    * (b / piece as f64).ceil().max(1.0);
            }
            st.push(step);
            d *= 2;
        }
        if reduce {
            st.reverse();
        }
        self.steps(&st)
    }

    /// Ring AllGather / ReduceScatter: per piece of a block, p − 1 steps.
    fn ring_moves(&self, total: f64, reduce: bool) -> f64 {
        let p = self.s.nranks;
        if p <= 1 {
            return 0.0;
        }
        let block = total / p as f64;
        let piece = if reduce {
            self.s.piece
        } else {
            self.s.move_piece
        };
        let loops = (block / piece as f64).ceil().max(1.0);
        let c = block / loops;
        loops * self.ring_steps(p - 1, c, reduce)
    }

    /// A chain along the ring from the root (Broadcast, or Reduce toward
    /// it): h − 1 hops between hosts and p − h inside them for the first
    /// piece, then a piece per the slowest link's or CPU's time.
    fn ring_chain(&self, bytes: f64, reduce: bool, piece: usize) -> f64 {
        let (p, h) = (self.s.nranks, self.s.nhosts.max(1));
        let np = (bytes / piece as f64).ceil().max(1.0);
        let b = bytes / np;
        // A Reduce's chain starts after the root and ends at it, so it
        // crosses one more host boundary (with the root first on its host).
        let cross = if reduce { h.min(p - 1) } else { h - 1 };
        let first = cross as f64 * self.hop(Via::Net(1), b, reduce)
            + (p - 1 - cross) as f64 * self.hop(Via::Shm, b, reduce);
        let v = if h > 1 { Via::Net(1) } else { Via::Shm };
        let per = self.pair(v, b) + if reduce { self.red(b) } else { 0.0 };
        first + (np - 1.0) * per.max(at(b, self.link(v).0.gbps))
    }

    /// Direct AllGather: every block to every rank in one stage.
    fn direct_allgather(&self, total: f64) -> f64 {
        let p = self.s.nranks;
        if p <= 1 {
            return 0.0;
        }
        let block = total / p as f64;
        let ppn = self.s.per_host.max(1);
        let remote = p.saturating_sub(ppn) as f64;
        let local = (ppn - 1) as f64;
        let cpu =
            remote * 2.0 * self.cpu(Via::Net(1), block) + local * 2.0 * self.cpu(Via::Shm, block);
        let nic = at(block * remote * ppn as f64, self.c.net.gbps);
        let lat = if remote > 0.0 {
            self.c.net.latency_us
        } else {
            self.c.shm.latency_us
        };
        // Sends go first, receives as messages come in: the latency hides
        // behind the sends once they take longer.
        let last = self.cpu(Via::Net(1), block);
        (cpu + last).max(nic + lat).max(lat + cpu / 2.0 + last)
    }

    /// Binomial Broadcast (or Reduce, `reduce`): ⌈log2 p⌉ levels, level
    /// `m` between ranks `m` apart (the network, shared by every rank of a
    /// host, once `m` reaches a host's size); pieces pipeline behind the
    /// first, at the pace of the busiest rank (the root, sending each piece
    /// to every child) or of a host's interface.
    ///
    /// On hosts of several ranks the tree is hierarchical and
    /// rail-aligned ([`Model::rail_binomial`]).
    fn binomial(&self, bytes: f64, reduce: bool, piece: usize) -> f64 {
        let p = self.s.nranks;
        let np = (bytes / piece as f64).ceil().max(1.0);
        let b = bytes / np;
        if self.s.nhosts > 1 && self.s.per_host > 1 {
            return self.rail_binomial(np, b, reduce);
        }
        let mut first = 0.0;
        let mut nic = 0.0;
        let mut levels = 0.0;
        let mut m = 1;
        while m < p {
            // Every rank of a host sends across at that level, though
            // (broadcasting) not all at the same moment.
            let share = if reduce {
                self.s.per_host
            } else {
                (3 * self.s.per_host).div_ceil(4)
            };
            let v = match self.via_distance(m) {
                Via::Net(_) => Via::Net(share),
                v => v,
            };
            first += self.hop(v, b, reduce);
            if let Via::Net(share) = v {
                nic += share as f64 * at(b, self.c.net.gbps);
            }
            levels += 1.0;
            m *= 2;
        }
        let v = if self.s.nhosts > 1 {
            Via::Net(1)
        } else {
            Via::Shm
        };
        let per = levels * (self.cpu(v, b) + if reduce { self.red(b) } else { 0.0 });
        first + (np - 1.0) * per.max(nic)
    }

    /// Hierarchical binomial Broadcast (or Reduce) of `np` pieces of `b`
    /// bytes: ⌈log2 H⌉ levels between hosts, on one rank per host, and
    /// ⌈log2 m⌉ inside them. The first piece crosses every level; the
    /// others follow at the pace of the root — a message per level per
    /// piece (and, broadcasting, its own copy; reducing, a reduction per
    /// child) — or of its host's interface, which sends (or receives) one
    /// piece per level between hosts.
    fn rail_binomial(&self, np: f64, b: f64, reduce: bool) -> f64 {
        let lh = Self::ceil_log2(self.s.nhosts) as f64;
        let lm = Self::ceil_log2(self.s.per_host) as f64;
        let first = lh * self.hop(Via::Net(1), b, reduce) + lm * self.hop(Via::Shm, b, reduce);
        let red = if reduce { self.red(b) } else { 0.0 };
        let copy = if reduce { 0.0 } else { at(b, self.c.copy_gbps) };
        let root =
            lh * (self.cpu(Via::Net(1), b) + red) + lm * (self.cpu(Via::Shm, b) + red) + copy;
        let nic = lh * at(b, self.c.net.gbps);
        first + (np - 1.0) * root.max(nic)
    }

    /// Direct Broadcast: the root sends every piece to every rank and
    /// copies its own buffer, all in one stage.
    fn direct_broadcast(&self, bytes: f64) -> f64 {
        let p = self.s.nranks;
        let piece = self.s.move_piece;
        let np = (bytes / piece as f64).ceil().max(1.0);
        let b = bytes / np;
        let ppn = self.s.per_host.max(1);
        let remote = p.saturating_sub(ppn) as f64;
        let local = (ppn - 1) as f64;
        let local_cpu = np * local * self.cpu(Via::Shm, b);
        let cpu = np * remote * self.cpu(Via::Net(1), b) + local_cpu + at(bytes, self.c.copy_gbps);
        let nic = at(remote * bytes, self.c.net.gbps);
        let (lat, last) = if remote > 0.0 {
            (self.c.net.latency_us, self.cpu(Via::Net(1), b))
        } else {
            (self.c.shm.latency_us, self.cpu(Via::Shm, b))
        };
        // The root's peers on its host come first (rank order), so its
        // interface starts after their copies.
        lat + cpu.max(local_cpu + self.cpu(Via::Net(1), b) + nic) + last
    }

    fn estimate(&self, kind: CollKind, choice: Choice, bytes: f64) -> f64 {
        let p = self.s.nranks;
        match (kind, choice.algo) {
            (CollKind::AllReduce, Algo::Ring) => self.ring_allreduce(bytes),
            (CollKind::AllReduce, Algo::Rd) => self.rd(p, bytes),
            (CollKind::AllReduce, Algo::Rabenseifner) => self.rab(p, bytes),
            (CollKind::AllReduce, Algo::Tree) => self.tree_allreduce(bytes),
            (CollKind::AllReduce, Algo::Hier) => {
                self.hier_allreduce(bytes, choice.inner.unwrap_or(Algo::Ring))
            }
            (CollKind::AllGather, Algo::Ring) => self.ring_moves(bytes, false),
            (CollKind::ReduceScatter, Algo::Ring) => self.ring_moves(bytes, true),
            (CollKind::AllGather, Algo::Bruck) => self.bruck(bytes, false),
            (CollKind::ReduceScatter, Algo::Bruck) => self.bruck(bytes, true),
            (CollKind::AllGather, Algo::Direct) => self.direct_allgather(bytes),
            (CollKind::Broadcast, Algo::Direct) => self.direct_broadcast(bytes),
            (CollKind::Broadcast, Algo::Ring) => self.ring_chain(bytes, false, self.s.move_piece),
            (CollKind::Reduce, Algo::Ring) => self.ring_chain(bytes, true, self.s.piece),
            (CollKind::Broadcast, Algo::Tree) => self.binomial(bytes, false, self.s.move_piece),
            (CollKind::Reduce, Algo::Tree) => self.binomial(bytes, true, self.s.piece),
            (CollKind::Reduce, Algo::Rabenseifner) => self.halving(p, bytes, true),
            _ => f64::INFINITY,
        }
    }
}

/// The model's time, µs, for `choice` running `kind` over `bytes` (the
/// whole buffer, as nccl-tests count it: the AllGather's result, the
/// ReduceScatter's input) on `shape`. Infinite when the algorithm cannot
/// run the collective.
pub fn estimate(costs: &Costs, shape: &Shape, kind: CollKind, choice: Choice, bytes: usize) -> f64 {
    if shape.nranks <= 1 {
        return 0.0;
    }
    Model {
        c: costs,
        s: shape,
        by_ref: choice.single_copy_safe(),
    }
    .estimate(kind, choice, bytes as f64)
}

/// Ranks up to which the direct algorithms (p − 1 messages per rank in
/// one stage) are candidates.
pub const DIRECT_MAX_RANKS: usize = 64;

/// The choices the tuner weighs for `kind` on `shape`: every algorithm
/// that runs it, the hierarchical one with each leaders' algorithm where
/// hosts hold several ranks, the direct ones up to [`DIRECT_MAX_RANKS`].
pub fn candidates(kind: CollKind, shape: &Shape) -> Vec<Choice> {
    let mut out = Vec::new();
    for a in kind.algorithms() {
        match a {
            Algo::Hier => {
                if shape.nhosts > 1 && shape.per_host > 1 {
                    for inner in [Algo::Ring, Algo::Rd, Algo::Rabenseifner, Algo::Tree] {
                        out.push(Choice::hier(inner));
                    }
                }
            }
            Algo::Direct if shape.nranks > DIRECT_MAX_RANKS => {}
            a => out.push(Choice::of(a)),
        }
    }
    out
}

/// The fastest of `choices` by the model, with its time (the first of
/// equals; `None` if `choices` is empty).
pub fn fastest(
    costs: &Costs,
    shape: &Shape,
    kind: CollKind,
    bytes: usize,
    choices: &[Choice],
) -> Option<(Choice, f64)> {
    let mut best: Option<(Choice, f64)> = None;
    for &c in choices {
        let t = estimate(costs, shape, kind, c, bytes);
        if best.is_none_or(|(_, b)| t < b) {
            best = Some((c, t));
        }
    }
    best
}

/// The tuner's pick for `kind` of `bytes` on `shape`: the fastest of the
/// [`candidates`].
pub fn best(costs: &Costs, shape: &Shape, kind: CollKind, bytes: usize) -> (Choice, f64) {
    fastest(costs, shape, kind, bytes, &candidates(kind, shape))
        .unwrap_or((Choice::of(Algo::Ring), f64::INFINITY))
}

/// The leaders' algorithm for a hierarchical AllReduce forced without
/// one: the fastest flat algorithm among the `shape`'s host leaders.
pub fn hier_inner(costs: &Costs, shape: &Shape, bytes: usize) -> Algo {
    let lead = Shape {
        nranks: shape.nhosts,
        nhosts: shape.nhosts,
        per_host: 1,
        ..*shape
    };
    let flat: Vec<Choice> = [Algo::Ring, Algo::Rd, Algo::Rabenseifner, Algo::Tree]
        .map(Choice::of)
        .to_vec();
    fastest(costs, &lead, CollKind::AllReduce, bytes, &flat).map_or(Algo::Ring, |(c, _)| c.algo)
}

/// How a choice was made, for logs and `braid-perf`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// `BRAID_ALGO`.
    Forced,
    /// A rule of the rules file.
    Rule,
    /// The cost model.
    Model,
    /// Close candidates of the cost model, timed at the first call.
    Timed,
    /// braid's defaults for one host (rings, recursive doubling for small
    /// AllReduce, direct moves), kept where nothing else decides.
    Default,
}

impl Source {
    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Source::Forced => "forced",
            Source::Rule => "rule",
            Source::Model => "model",
            Source::Timed => "timed",
            Source::Default => "default",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model's estimates grow with size and its picks follow the
    /// known regimes: latency-bound sizes avoid the ring on many hosts.
    #[test]
    fn the_model_prefers_log_steps_when_latency_bound() {
        let c = Costs::defaults(TransportKind::Socket);
        let s = Shape::uniform(16, 1, 1 << 19);
        let (small, _) = best(&c, &s, CollKind::AllReduce, 8);
        assert_ne!(small.algo, Algo::Ring, "{small}");
        for k in CollKind::ALL {
            for a in k.algorithms() {
                let ch = if a == Algo::Hier {
                    Choice::hier(Algo::Ring)
                } else {
                    Choice::of(a)
                };
                let t1 = estimate(&c, &s, k, ch, 1 << 10);
                let t2 = estimate(&c, &s, k, ch, 1 << 24);
                assert!(t1.is_finite() && t1 > 0.0 && t2 > t1, "{k} {a}: {t1} {t2}");
            }
        }
    }

    /// Where pieces cross hosts by reference, the model drops the sender's
    /// copy for the algorithms that may send that way and not for
    /// recursive doubling, which must go through slots: on 2 hosts over a
    /// fast network with slow copies (2 emulated nodes on a 2-core VM:
    /// ring 390-530 µs, rd 610-740 µs at 1 MiB) the pick turns from rd to
    /// the ring.
    #[test]
    fn references_spare_the_copy_only_where_the_algorithm_allows_them() {
        let c = Costs {
            net: Link {
                latency_us: 30.0,
                gbps: 3.0,
                overhead_us: 5.0,
            },
            copy_gbps: 4.0,
            reduce_gbps: 4.0,
            ..Costs::defaults(TransportKind::Socket)
        };
        let slots = Shape::uniform(2, 1, 1 << 19);
        let refs = Shape {
            net_ref_min_bytes: 64 << 10,
            ..slots
        };
        let (ring, rd) = (Choice::of(Algo::Ring), Choice::of(Algo::Rd));
        let mib = 1 << 20;
        let t = |s: &Shape, ch| estimate(&c, s, CollKind::AllReduce, ch, mib);
        assert_eq!(t(&refs, rd), t(&slots, rd));
        assert!(
            t(&refs, ring) < t(&slots, ring) - 100.0,
            "{} {}",
            t(&refs, ring),
            t(&slots, ring)
        );
        assert_eq!(best(&c, &slots, CollKind::AllReduce, mib).0, rd);
        assert_eq!(best(&c, &refs, CollKind::AllReduce, mib).0, ring);
        // Below the threshold nothing changes.
        let small = |s: &Shape| estimate(&c, s, CollKind::AllReduce, ring, 8 << 10);
        assert_eq!(small(&refs), small(&slots));
    }
}
