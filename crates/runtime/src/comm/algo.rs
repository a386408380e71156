//! Which algorithm runs each collective (see `docs/algorithms.md`):
//! `BRAID_ALGO` first, then the rules file (`BRAID_TUNING_FILE`), then —
//! on jobs over several hosts — the cost model of [`braid_core::tune`],
//! with the network's latency and bandwidth measured at the first call
//! that needs them, and close candidates timed at the first call of each
//! collective and size class (`BRAID_TUNE_MEASURE=0`: per-transport
//! defaults and no timing). On one
//! host braid keeps its defaults (rings, recursive doubling for small
//! AllReduce, direct moves), which the model does not improve on there.
//! The answer is cached with the plan, per collective and datatype.

use braid_core::config;
use braid_core::plan::{Algo, Choice, CollKind};
use braid_core::transport::TransportKind;
use braid_core::tune::{self, Costs, Forced, Rules, Shape, Source};

use super::*;

/// `BRAID_ALGO`, the rules file and the shape of the job, fixed at
/// creation.
#[derive(Debug)]
pub(super) struct Algos {
    forced: Forced,
    forced_text: String,
    rules: Rules,
    rules_path: Option<String>,
    measure: bool,
    /// Host (index) of every rank, from the transports: ranks joined by
    /// anything but a network share a host.
    pub(super) hosts: Vec<u32>,
    /// The job's shape, with the piece of pure data movement known at
    /// creation ([`Algos::shape`] gives it with the final one).
    pub(super) shape: Shape,
    /// The network transport between hosts, if any.
    net: Option<TransportKind>,
}

/// The cost-model state of a communicator (under its operation lock).
#[derive(Debug, Default)]
pub(super) struct TuneState {
    /// Link costs, once measured (or defaulted).
    costs: Option<Costs>,
    /// Collectives for which a bare `BRAID_ALGO` item was said not to run.
    warned: Vec<CollKind>,
    /// Timing trials' answers by collective and size class (`None`: the
    /// model's pick stands).
    timed: Vec<(CollKind, u32, Option<Choice>)>,
}

/// The network as the tuner measured it (see `measure_network`).
struct Measured {
    /// One message's time from a rank to its ring successor, µs.
    round_us: f64,
    /// Bandwidth per host, GB/s.
    gbps: f64,
    /// CPU time per message at each end, µs.
    overhead_us: f64,
}

/// What decided a plan's algorithm.
#[derive(Clone, Copy, Debug)]
pub(super) struct Picked {
    pub(super) choice: Choice,
    pub(super) source: Source,
    /// The model's estimate, µs (NaN when the model was not asked).
    pub(super) estimate_us: f64,
}

/// What an internal program (one the user did not call) is for.
#[derive(Clone, Copy)]
enum Internal {
    /// Measuring the network: through slots.
    Measurement,
    /// Timing candidate algorithms: a candidate as the call would run it,
    /// by reference where `single_copy` (its plan was cut for it), and on
    /// links where a reference only saves a copy where `by_ref` (its
    /// algorithm leaves what it sent unchanged: `Choice::single_copy_safe`).
    Trial { single_copy: bool, by_ref: bool },
}

impl Internal {
    fn name(self) -> &'static str {
        match self {
            Internal::Measurement => "tuner measurement",
            Internal::Trial { .. } => "tuner trial",
        }
    }

    /// `prog` as this program runs: a trial by reference as its
    /// `single_copy` and `by_ref` say (neither for the trials' own
    /// programs, [`TRIAL_SLOTS`]), with the scratch memory its algorithm
    /// uses; a measurement through slots and without scratch memory (its
    /// groups' buffer 2 is a caller's).
    fn planned(self, prog: Program) -> Planned {
        let (send, recv) = prog.peers();
        let (single_copy, by_ref, scratch) = match self {
            Internal::Measurement => (false, false, 0),
            Internal::Trial {
                single_copy,
                by_ref,
            } => (single_copy, by_ref, prog.scratch_bytes()),
        };
        Planned {
            small_max: host::small_max(&prog),
            prog: Arc::new(prog),
            single_copy,
            by_ref,
            links: Arc::new(super::connect::LinkSet { send, recv }),
            algo: None,
            scratch,
        }
    }
}

/// The trials' own programs (barriers, agreeing on times): through slots.
const TRIAL_SLOTS: Internal = Internal::Trial {
    single_copy: false,
    by_ref: false,
};

/// A small stable hash (FNV-1a), to compare settings across ranks.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Algos {
    /// Reads `BRAID_ALGO`, `BRAID_TUNING_FILE` and `BRAID_TUNE_MEASURE`;
    /// errors name the variable (or the file) and what is wrong.
    /// `direct_min`: pieces from this size go by reference on links that
    /// allow it (`BRAID_DIRECT_MIN_BYTES`); the model counts it between
    /// hosts over sockets, whose references spare the sender a copy.
    /// `env`: the communicator's snapshot of the environment.
    pub(super) fn from_env(
        plan: &braid_core::topo::Plan,
        piece: usize,
        move_piece: usize,
        direct_min: usize,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Algos> {
        let forced_text = config::value(env, "BRAID_ALGO").unwrap_or_default();
        let forced = Forced::parse(&forced_text)
            .map_err(|e| Error::Env(format!("BRAID_ALGO={forced_text}: {e}")))?;
        let rules_path = config::value(env, "BRAID_TUNING_FILE");
        let rules = match &rules_path {
            None => Rules::default(),
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| {
                    Error::Env(format!("BRAID_TUNING_FILE={p}: cannot read it: {e}"))
                })?;
                Rules::parse(&text)
                    .map_err(|e| Error::Env(format!("BRAID_TUNING_FILE={p}: {e}")))?
            }
        };
        let measure = config::flag(env, "BRAID_TUNE_MEASURE", true)?;
        let (hosts, net) = hosts_of(plan);
        let nhosts = hosts.iter().max().map_or(1, |&h| h as usize + 1);
        let mut per = vec![0usize; nhosts];
        for &h in &hosts {
            per[h as usize] += 1;
        }
        let shape = Shape {
            nranks: hosts.len(),
            nhosts,
            per_host: per.into_iter().max().unwrap_or(1),
            piece,
            move_piece,
            net_ref_min_bytes: if net == Some(TransportKind::Socket)
                && braid_transport_socket::SocketConfig::from_env(env)?.direct()
            {
                direct_min
            } else {
                usize::MAX
            },
        };
        Ok(Algos {
            forced,
            forced_text,
            rules,
            rules_path,
            measure,
            hosts,
            shape,
            net,
        })
    }

    /// The job's shape for the tuner, with `move_piece` (the
    /// communicator's, once its first links are connected: `State::moves`).
    pub(super) fn shape(&self, move_piece: usize) -> Shape {
        Shape {
            move_piece,
            ..self.shape
        }
    }

    /// What every rank must agree on: the forced algorithms, the rules and
    /// whether the network is measured (the measurement itself is agreed
    /// on when it is taken).
    pub(super) fn fingerprint(&self) -> u64 {
        let rules = format!("{:?}", self.rules);
        fnv(format!(
            "{}|{rules}|{}|{}",
            self.forced_text, self.measure, self.shape.net_ref_min_bytes
        )
        .as_bytes())
    }

    /// Checks that every rank has the same settings (a mismatch would make
    /// ranks run different plans).
    pub(super) fn agree(&self, boot: &Bootstrap, rank: u32) -> Result<()> {
        let all = boot.allgather(&self.fingerprint().to_le_bytes())?;
        if let Some(r) = all.iter().position(|b| b[..] != all[rank as usize][..]) {
            return Err(Error::Env(format!(
                "BRAID_ALGO, BRAID_TUNING_FILE, BRAID_TUNE_MEASURE, BRAID_DIRECT_MIN_BYTES or BRAID_SOCKET_DIRECT differ between rank {rank} and rank {r} (here: BRAID_ALGO={:?}, BRAID_TUNING_FILE={:?}); set them alike on every rank",
                self.forced_text, self.rules_path
            )));
        }
        Ok(())
    }
}

/// Host index of every rank (ranks linked by anything but a network
/// transport share a host), and the network transport in use.
fn hosts_of(plan: &braid_core::topo::Plan) -> (Vec<u32>, Option<TransportKind>) {
    let p = plan.transports.len();
    let mut root: Vec<usize> = (0..p).collect();
    fn find(root: &mut [usize], mut x: usize) -> usize {
        while root[x] != x {
            root[x] = root[root[x]];
            x = root[x];
        }
        x
    }
    let mut net = None;
    for (a, row) in plan.transports.iter().enumerate() {
        for (b, t) in row.iter().enumerate() {
            match t {
                Some(k) if k.is_network() => net = net.or(Some(*k)),
                Some(_) => {
                    let (x, y) = (find(&mut root, a), find(&mut root, b));
                    root[x.max(y)] = x.min(y);
                }
                None => {}
            }
        }
    }
    let mut index = vec![u32::MAX; p];
    let mut next = 0;
    let hosts = (0..p)
        .map(|r| {
            let g = find(&mut root, r);
            if index[g] == u32::MAX {
                index[g] = next;
                next += 1;
            }
            index[g]
        })
        .collect();
    (hosts, net)
}

/// nccl-tests' size of a collective: the whole array.
pub(super) fn coll_bytes(coll: &Collective, dt: DataType, nranks: u32) -> u64 {
    let n = match *coll {
        Collective::AllReduce { count, .. }
        | Collective::Broadcast { count, .. }
        | Collective::Reduce { count, .. } => count,
        Collective::AllGather { send_count } => send_count.saturating_mul(nranks as usize),
        Collective::ReduceScatter { recv_count, .. } => recv_count.saturating_mul(nranks as usize),
        _ => 0,
    };
    (n as u64).saturating_mul(dt.size() as u64)
}

/// The algorithm `plan::plan` picks by itself (braid's defaults), named.
pub(super) fn default_choice(coll: &Collective, dt: DataType, params: &PlanParams) -> Choice {
    let p = params.nranks();
    match *coll {
        Collective::AllReduce { count, .. }
            if count.saturating_mul(dt.size())
                <= params.small_allreduce_bytes.min(params.piece_bytes) =>
        {
            Choice::of(Algo::Rd)
        }
        Collective::AllGather { .. } | Collective::Broadcast { .. }
            if params.direct_moves && p > 2 =>
        {
            Choice::of(Algo::Direct)
        }
        _ => Choice::of(Algo::Ring),
    }
}

impl Communicator {
    /// The algorithm for `coll` (of a kind the tuner chooses for), or
    /// `None` for braid's defaults (`plan::plan`). `call`: the user's call
    /// this is for (`None` while the communicator is created). The
    /// programs the tuner runs meanwhile (the network's measurement,
    /// trials; on several hosts only) run on the call's behalf: a failure
    /// is the call's, as if its own program had failed, and they carry the
    /// call's operation headers (`State::headers`, filled for it first),
    /// so that ranks that reached different calls learn it at once, each
    /// told what the other called, instead of the tuner's programs
    /// running apart until a wrong piece or the deadline.
    pub(super) fn pick(
        &self,
        st: &mut State,
        coll: &Collective,
        dt: DataType,
        params: &PlanParams,
        call: Option<OpId>,
    ) -> Result<Option<Picked>> {
        let sh = &*self.shared;
        let Some(kind) = CollKind::of(coll) else {
            return Ok(None);
        };
        let a = &sh.algos;
        let shape = a.shape(st.moves.piece);
        let bytes = coll_bytes(coll, dt, sh.nranks);
        let mut picked = None;
        match a.forced.get(kind) {
            Ok(Some(c)) => picked = Some((c, Source::Forced)),
            Ok(None) => {}
            Err(items) => {
                if !st.tune.warned.contains(&kind) {
                    st.tune.warned.push(kind);
                    let names: Vec<String> = items.iter().map(|c| c.to_string()).collect();
                    let able: Vec<&str> = kind.algorithms().iter().map(|x| x.name()).collect();
                    warn!(
                        rank = sh.rank,
                        "braid: BRAID_ALGO={}: {} cannot run {kind} (algorithms for {kind}: {}); it is chosen as without BRAID_ALGO",
                        a.forced_text,
                        names.join(", "),
                        able.join(", ")
                    );
                }
            }
        }
        if picked.is_none() {
            if let Some((_, c)) = a.rules.get(kind, bytes, &shape) {
                picked = Some((c, Source::Rule));
            }
        }
        let (mut choice, source, mut estimate_us) = match picked {
            Some((c, s)) => (c, s, f64::NAN),
            None if a.shape.nhosts <= 1 => return Ok(None),
            None => {
                let costs = self.costs(st, call)?;
                let (c, t) = tune::best(&costs, &shape, kind, bytes as usize);
                match self.timed(st, call, coll, dt, params, &costs)? {
                    Some(tc) => (tc, Source::Timed, f64::NAN),
                    None => (c, Source::Model, t),
                }
            }
        };
        if choice.algo == Algo::Hier && choice.inner.is_none() {
            choice.inner = Some(if a.shape.nhosts <= 1 {
                Algo::Ring
            } else {
                let costs = self.costs(st, call)?;
                tune::hier_inner(&costs, &shape, bytes as usize)
            });
        }
        if estimate_us.is_nan() && a.shape.nhosts > 1 {
            if let Some(costs) = st.tune.costs {
                estimate_us = tune::estimate(&costs, &shape, kind, choice, bytes as usize);
            }
        }
        Ok(Some(Picked {
            choice,
            source,
            estimate_us,
        }))
    }

    /// The model's pick checked by timing, where close candidates make its
    /// error matter (`tune::trial`): each candidate runs `coll` once on
    /// scratch buffers (connecting its links); as many timed runs of each
    /// as still fit the budget by the agreed time of those first runs
    /// (`tune::runs_within`) follow, each after a barrier; the ranks agree
    /// on each one's slowest time and take the fastest. Answers once per
    /// collective kind and size class (the bit length of its bytes).
    /// `None`: no trial (measuring is off, the communicator is being
    /// created, a clear winner, or too costly to time by the estimates or
    /// by the first runs). `call`: as for [`Communicator::pick`].
    fn timed(
        &self,
        st: &mut State,
        call: Option<OpId>,
        coll: &Collective,
        dt: DataType,
        params: &PlanParams,
        costs: &Costs,
    ) -> Result<Option<Choice>> {
        let sh = &*self.shared;
        let a = &sh.algos;
        let shape = a.shape(st.moves.piece);
        let (true, Some(kind)) = (a.measure, CollKind::of(coll)) else {
            return Ok(None);
        };
        // At creation (`call` is `None`) programs are planned only to learn
        // which links to connect, the AllReduce among them at 64 MiB: no
        // trial there (with trials up to 64 MiB, one ran in every
        // communicator's creation and took a shrink on 2 emulated hosts
        // from 16 ms to 0.9 s). The first call of that size class times
        // them.
        if call.is_none() {
            return Ok(None);
        }
        let bytes = coll_bytes(coll, dt, sh.nranks) as usize;
        let class = tune::size_class(bytes);
        if let Some(&(_, _, c)) = st
            .tune
            .timed
            .iter()
            .find(|(k, b, _)| *k == kind && *b == class)
        {
            return Ok(c);
        }
        let limits = a.rules.trial_limits();
        let Some(trial) = tune::trial(costs, &shape, kind, bytes, limits) else {
            st.tune.timed.push((kind, class, None));
            return Ok(None);
        };
        let [ns, nr] = coll.collective_counts(sh.nranks)?;
        // u64 words: aligned for every datatype.
        let words = |count: usize| (count.saturating_mul(dt.size())).div_ceil(8);
        let mut send = vec![0u64; words(ns)];
        let mut recv = vec![0u64; words(nr)];
        let bufs = [
            RawBuf {
                ptr: send.as_mut_ptr().cast(),
                len: ns * dt.size(),
            },
            RawBuf {
                ptr: recv.as_mut_ptr().cast(),
                len: nr * dt.size(),
            },
        ];
        // Each candidate runs as the call would: by reference where the
        // call may and the algorithm allows (its plan cuts pieces for that:
        // `move_piece_bytes`), else through slots.
        let single_copy = self.single_copy(st, coll, dt);
        // A first run of each connects its links; its time (agreed on)
        // holds the rest to the budget in real time, whatever the
        // estimates said.
        let mut progs = Vec::with_capacity(trial.choices.len());
        let t0 = Instant::now();
        for (choice, _) in &trial.choices {
            let prog = plan::plan_with(coll, dt, params, *choice, &a.hosts)?;
            let run = Internal::Trial {
                single_copy: single_copy && choice.single_copy_safe(),
                by_ref: choice.single_copy_safe(),
            };
            let planned = run.planned(prog);
            self.run_internal(st, call, &planned, &bufs, run)?;
            progs.push((planned, run));
        }
        let first_us = t0.elapsed().as_secs_f64() * 1e6;
        let first_us = self.agree_max(st, call, params, &[first_us], TRIAL_SLOTS)?[0];
        let runs = tune::runs_within(&trial, first_us, limits);
        if runs == 0 {
            if sh.rank == 0 {
                info!(
                    op = coll.name(),
                    bytes,
                    "braid: tuner: the first runs of the close candidates took {:.1} ms, too long for the trials' budget of {:.3} ms; the model's pick stands",
                    first_us / 1e3,
                    limits.budget_us / 1e3
                );
            }
            st.tune.timed.push((kind, class, None));
            return Ok(None);
        }
        let mut times = Vec::with_capacity(progs.len());
        for (planned, run) in &progs {
            let mut best = f64::INFINITY;
            for _ in 0..runs {
                self.internal_barrier(st, call, params, TRIAL_SLOTS)?;
                let t0 = Instant::now();
                self.run_internal(st, call, planned, &bufs, *run)?;
                best = best.min(t0.elapsed().as_secs_f64() * 1e6);
            }
            times.push(best);
        }
        let times = self.agree_max(st, call, params, &times, TRIAL_SLOTS)?;
        let pick = tune::timed_pick(&trial, &times);
        if sh.rank == 0 {
            let each: Vec<String> = trial
                .choices
                .iter()
                .zip(&times)
                .map(|((c, est), t)| format!("{c} {t:.0} µs (model {est:.0})"))
                .collect();
            info!(
                op = coll.name(),
                bytes,
                "braid: tuner: timed close candidates: {}; picked {pick}",
                each.join(", ")
            );
        }
        st.tune.timed.push((kind, class, Some(pick)));
        Ok(Some(pick))
    }

    /// A barrier among all ranks over the data links (an 8-byte AllReduce).
    fn internal_barrier(
        &self,
        st: &mut State,
        call: Option<OpId>,
        params: &PlanParams,
        run: Internal,
    ) -> Result<()> {
        self.agree_max(st, call, params, &[0.0], run).map(|_| ())
    }

    /// The element-wise maximum of `vals` over all ranks.
    fn agree_max(
        &self,
        st: &mut State,
        call: Option<OpId>,
        params: &PlanParams,
        vals: &[f64],
        run: Internal,
    ) -> Result<Vec<f64>> {
        let mut inp = vals.to_vec();
        let mut out = vec![0f64; vals.len()];
        let prog = plan::plan(
            &Collective::AllReduce {
                count: vals.len(),
                op: RedOp::Max,
            },
            DataType::F64,
            params,
        )?;
        let bufs = [
            RawBuf {
                ptr: inp.as_mut_ptr().cast(),
                len: 8 * vals.len(),
            },
            RawBuf {
                ptr: out.as_mut_ptr().cast(),
                len: 8 * vals.len(),
            },
        ];
        let planned = run.planned(prog);
        self.run_internal(st, call, &planned, &bufs, run)?;
        Ok(out)
    }

    /// The model's link costs: measured at the first call that needs them
    /// (every rank calls it at the same collective), or the defaults of the
    /// network transport, or the rules file's.
    fn costs(&self, st: &mut State, call: Option<OpId>) -> Result<Costs> {
        if let Some(c) = st.tune.costs {
            return Ok(c);
        }
        let a = &self.shared.algos;
        let mut c = Costs::defaults(a.net.unwrap_or(TransportKind::Socket));
        let given = a.rules.links;
        if let Some(l) = given.and_then(|l| l.shm) {
            c.shm = l;
        }
        if let Some(l) = given.and_then(|l| l.net) {
            c.net = l;
        } else if a.measure && a.shape.nhosts > 1 {
            let m = self.measure_network(st, call)?;
            c.net.overhead_us = m.overhead_us;
            c.net.latency_us = (m.round_us - 2.0 * c.net.overhead_us).max(1.0);
            c.net.gbps = m.gbps;
            info!(
                rank = self.shared.rank,
                latency_us = c.net.latency_us,
                gbps = c.net.gbps,
                overhead_us = c.net.overhead_us,
                "braid: tuner: network measured ({} µs one way, {} GB/s per host, {} µs per message at each end)",
                format!("{:.1}", c.net.latency_us),
                format!("{:.3}", c.net.gbps),
                format!("{:.1}", c.net.overhead_us)
            );
        }
        st.tune.costs = Some(c);
        Ok(c)
    }

    /// Run `planned` over `bufs` (its send and receive buffers): a
    /// program of the tuner's, which all ranks run at the same point, on
    /// behalf of `call` (see [`Communicator::pick`]) or, at creation, as
    /// itself.
    fn run_internal(
        &self,
        st: &mut State,
        call: Option<OpId>,
        planned: &Planned,
        bufs: &[RawBuf],
        run: Internal,
    ) -> Result<()> {
        let op = call.unwrap_or(OpId {
            name: run.name(),
            seq: st.seq,
        });
        let mode = Mode {
            stream_copies: false,
            slot_stores: false,
            headers: call.is_some() && self.shared.check_headers,
            record: None,
        };
        // SAFETY: `bufs` point into live vectors of the caller's, of the
        // lengths given; the program's regions fit them (it was planned for
        // them) and nothing else touches them meanwhile.
        unsafe { self.execute(st, Some(planned), bufs, op, Some(run.name()), mode) }
    }

    /// One-way latency (µs), bandwidth (GB/s) and per-message CPU cost (µs
    /// at each end) of the slowest ring hop: every rank sends to its ring
    /// successor and receives from its predecessor at once — 8 rounds of
    /// one 8-byte message, 4 of a burst of 16, 2 of 1 MiB (the fastest
    /// counts) — and the ranks agree on the slowest (an AllReduce of the
    /// maxima). The ring leaves
    /// each host once, so this is one stream through each host's network
    /// interface; the burst's extra time per message is what every
    /// message costs the CPUs at both ends while all ranks send at once
    /// (where many ranks share few cores, far more than the transport's
    /// default).
    fn measure_network(&self, st: &mut State, call: Option<OpId>) -> Result<Measured> {
        let sh = &*self.shared;
        let p = sh.nranks as usize;
        let pos = sh.ring.iter().position(|&r| r == sh.rank).unwrap_or(0);
        let (next, prev) = (sh.ring[(pos + 1) % p], sh.ring[(pos + p - 1) % p]);
        let params = PlanParams {
            rank: sh.rank,
            ring: sh.ring.clone(),
            piece_bytes: sh.piece,
            move_piece_bytes: sh.piece,
            small_allreduce_bytes: sh.small_allreduce,
            direct_moves: false,
        };
        const BIG: usize = 1 << 20;
        const BURST: usize = 16;
        const BIG_ROUNDS: usize = 2;
        // `k` messages of `n` bytes each way.
        let shift = |k: usize, n: usize| -> Result<Program> {
            let mut ops = Vec::with_capacity(2 * k);
            for _ in 0..k {
                ops.push(P2p {
                    kind: P2pKind::Send,
                    peer: next,
                    count: n,
                });
            }
            for _ in 0..k {
                ops.push(P2p {
                    kind: P2pKind::Recv,
                    peer: prev,
                    count: n,
                });
            }
            Ok(plan::plan(&Collective::Group(ops), DataType::U8, &params)?)
        };
        let mut send = vec![0u8; BIG];
        let mut recv = vec![0u8; BIG];
        let mut round = |this: &Self, st: &mut State, k: usize, n: usize| -> Result<f64> {
            let planned = Internal::Measurement.planned(shift(k, n)?);
            // Every message of a burst reads (writes) the same 8 bytes.
            let mut bufs = Vec::with_capacity(2 * k);
            for _ in 0..k {
                bufs.push(RawBuf {
                    ptr: send.as_mut_ptr(),
                    len: n,
                });
            }
            for _ in 0..k {
                bufs.push(RawBuf {
                    ptr: recv.as_mut_ptr(),
                    len: n,
                });
            }
            let t0 = Instant::now();
            this.run_internal(st, call, &planned, &bufs, Internal::Measurement)?;
            Ok(t0.elapsed().as_secs_f64() * 1e6)
        };
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        round(self, st, 1, 8)?;
        let small: Vec<f64> = (0..8)
            .map(|_| round(self, st, 1, 8))
            .collect::<Result<_>>()?;
        let lat = median(small);
        let burst: Vec<f64> = (0..4)
            .map(|_| round(self, st, BURST, 8))
            .collect::<Result<_>>()?;
        let burst = median(burst);
        // Fresh TCP connections take several megabytes to reach their
        // speed (slow start, buffer autotuning): between two network
        // namespaces here the first four 1 MiB rounds took 1.2-1.7 ms, the
        // next ones 0.25-0.37 ms, so two rounds put the network at 0.43
        // GB/s where iperf3 measured 2.6 (eight measured 2.6-4.3). Eight
        // were tried and dropped: this runs again in a communicator made by
        // a shrink, and with them (together with a trial that then ran at
        // creation, removed since; the two were not measured apart) the
        // kill-to-recovered time over sockets on 4-16 ranks on 2 cores
        // grew from 15-100 ms to 0.65-1.6 s. Two stay; the trials (up to
        // 64 MiB) time the close candidates where the model's bandwidth
        // is off.
        let big = (0..BIG_ROUNDS)
            .map(|_| round(self, st, 1, BIG))
            .collect::<Result<Vec<f64>>>()?
            .into_iter()
            .fold(f64::INFINITY, f64::min);
        // Agree on the slowest link: an AllReduce (maximum) of all three.
        let out = self.agree_max(st, call, &params, &[lat, big, burst], Internal::Measurement)?;
        let (lat, big, burst) = (out[0], out[1], out[2]);
        // Each message of the burst is sent by one CPU and received by
        // another, and each rank does both: its time per message covers
        // one send and one receive.
        let overhead_us = ((burst - lat) / (BURST - 1) as f64 / 2.0).clamp(0.1, lat.max(0.1));
        let gbps = (BIG as f64 / ((big - lat).max(1.0) * 1e3)).clamp(1e-4, 1e3);
        Ok(Measured {
            round_us: lat,
            gbps,
            overhead_us,
        })
    }

    /// The algorithm this communicator runs (or ran) for `coll` on `dt`,
    /// as `BRAID_ALGO` names it (`ring`, `rd`, `hier(rabenseifner)`, …),
    /// with what decided it (`forced`, `rule`, `model`, `timed` or `default`); `None`
    /// for operations without a choice (AllToAll) or when the
    /// choice would need the network measured first (call the operation
    /// once). Asks no other rank.
    pub fn algorithm(
        &self,
        coll: &crate::Collective,
        dt: DataType,
    ) -> Option<(String, &'static str)> {
        let coll = &coll.plan();
        let st = self.lock().ok()?;
        if let Some((c, d, p)) = &st.last {
            if c == coll && *d == dt {
                return p.algo.map(|(c, s)| (c.to_string(), s.name()));
            }
        }
        st.cache
            .get(&(coll.clone(), dt))
            .and_then(|p| p.algo)
            .map(|(c, s)| (c.to_string(), s.name()))
    }
}
