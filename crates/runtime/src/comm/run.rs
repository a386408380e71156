//! The operation path: a call's plan (cached, [`Planned`]), its links
//! connected on first use, the host engine run over the caller's buffers
//! ([`Engine::run`], the one call of `host::execute`), and the one failure
//! path ([`Communicator::step`], [`Communicator::fail_op`]).

use super::*;

/// A collective's plan, whether it moves data single-copy, the links it
/// uses, and its algorithm with what chose it.
#[derive(Clone, Debug)]
pub(super) struct Planned {
    pub(super) prog: Arc<Program>,
    pub(super) single_copy: bool,
    /// The plan leaves every region it sent unchanged until the receiver
    /// has it ([`Choice::single_copy_safe`]), so pieces may go by reference
    /// where that only saves a copy (`Exec::free_direct_min`) even when the
    /// call is not single-copy.
    ///
    /// [`Choice::single_copy_safe`]: braid_core::plan::Choice::single_copy_safe
    pub(super) by_ref: bool,
    pub(super) links: Arc<connect::LinkSet>,
    pub(super) algo: Option<(braid_core::plan::Choice, braid_core::tune::Source)>,
    /// Bytes of scratch memory the plan uses (`plan::SCRATCH`).
    pub(super) scratch: usize,
    /// The program's largest piece if it is small (`host::small_max`).
    pub(super) small_max: Option<usize>,
}

impl Planned {
    /// `picked`: an algorithm chose it (its plans may use `plan::SCRATCH`;
    /// braid's defaults and groups, whose buffer 2 is a caller's, do not).
    /// `single_copy`: the call moves data single-copy; it does so only where
    /// the algorithm allows (`by_ref` below). A plan without an algorithm
    /// (groups of sends and receives) sends regions nobody rewrites.
    pub(super) fn new(
        prog: Program,
        single_copy: bool,
        algo: Option<(braid_core::plan::Choice, braid_core::tune::Source)>,
        picked: bool,
    ) -> Planned {
        let (send, recv) = prog.peers();
        let by_ref = algo.is_none_or(|(c, _)| c.single_copy_safe());
        Planned {
            scratch: if picked { prog.scratch_bytes() } else { 0 },
            small_max: host::small_max(&prog),
            prog: Arc::new(prog),
            single_copy: single_copy && by_ref,
            by_ref,
            links: Arc::new(connect::LinkSet { send, recv }),
            algo,
        }
    }

    /// The plan as the engine runs it.
    pub(super) fn job(&self) -> Job<'_> {
        Job {
            prog: &self.prog,
            scratch: self.scratch,
            single_copy: self.single_copy,
            by_ref: self.by_ref,
            small_max: self.small_max,
        }
    }
}

/// An operation as logs, errors and the progress record name it.
#[derive(Clone, Copy, Debug)]
pub(super) struct OpId {
    pub(super) name: &'static str,
    pub(super) seq: u64,
}

/// How a program runs, besides its plan and its buffers.
#[derive(Clone, Copy, Debug)]
pub(super) struct Mode {
    /// Copies between the caller's buffers use streaming stores.
    pub(super) stream_copies: bool,
    /// Pieces go into slots with the stores each link's [`SlotStores`]
    /// chose (else ordinary ones).
    pub(super) slot_stores: bool,
    /// The operation headers in `State::headers` go with it (the mismatch
    /// check).
    pub(super) headers: bool,
    /// A user's operation: its progress record starts and ends with it
    /// (`true`: with its start time taken at once); `None` for programs run
    /// within an operation.
    pub(super) record: Option<bool>,
}

/// A program as the engine runs it: its scratch memory (`plan::SCRATCH`
/// bytes), and whether pieces go by reference where the links allow
/// (`single_copy`), or only where that just saves a copy (`by_ref`; see
/// [`Planned`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Job<'p> {
    pub(super) prog: &'p Program,
    pub(super) scratch: usize,
    pub(super) single_copy: bool,
    pub(super) by_ref: bool,
    /// The program's largest piece if it is small (`host::small_max`).
    pub(super) small_max: Option<usize>,
}

/// What of the [`State`] the engine uses while a program runs, borrowed
/// beside the last plan ([`State::split`]).
pub(super) struct Engine<'s> {
    pub(super) chans: &'s mut Channels,
    pub(super) header_flags: &'s mut host::HeaderFlags,
    pub(super) plan_scratch: &'s mut Vec<u64>,
    pub(super) slot_stores: &'s SlotStores,
    pub(super) headers: &'s Headers,
    /// `Moves::direct_min`.
    pub(super) direct_min: usize,
}

impl State {
    /// The last plan ([`Communicator::plan_last`]) and, beside it, the
    /// engine's part of the state.
    pub(super) fn split(&mut self) -> (Option<&Planned>, Engine<'_>) {
        (
            self.last.as_ref().map(|l| &l.2),
            Engine {
                chans: &mut self.chans,
                header_flags: &mut self.header_flags,
                plan_scratch: &mut self.plan_scratch,
                slot_stores: &self.slot_stores,
                headers: &self.headers,
                direct_min: self.moves.direct_min,
            },
        )
    }
}

/// The error for an operation without a plan (never seen: `plan_last`
/// leaves one).
pub(super) fn no_plan() -> CoreError {
    CoreError::InvalidArgument("the operation has no plan".into())
}

impl Engine<'_> {
    /// Runs `job` over `bufs` (its send and receive buffers; `job`'s
    /// scratch memory is added here, as buffer `plan::SCRATCH`): the one
    /// call of the host engine.
    ///
    /// # Safety
    ///
    /// As for [`host::execute`], for `bufs` and the job's program.
    pub(super) unsafe fn run(
        self,
        sh: &Shared,
        job: Job<'_>,
        mode: Mode,
        bufs: &[RawBuf],
    ) -> std::result::Result<(), CoreError> {
        let with_scratch;
        let bufs = if job.scratch > 0 {
            let &[send, recv] = bufs else {
                return Err(CoreError::InvalidArgument(format!(
                    "a program with scratch memory over {} buffers",
                    bufs.len()
                )));
            };
            let words = job.scratch.div_ceil(8);
            if self.plan_scratch.len() < words {
                self.plan_scratch.resize(words, 0);
            }
            with_scratch = [
                send,
                recv,
                RawBuf {
                    ptr: self.plan_scratch.as_mut_ptr().cast(),
                    len: job.scratch,
                },
            ];
            &with_scratch[..]
        } else {
            bufs
        };
        let ex = Exec {
            bufs,
            policy: &sh.policy,
            abort: &sh.abort,
            direct_min: if job.single_copy {
                self.direct_min
            } else {
                usize::MAX
            },
            free_direct_min: if job.by_ref {
                sh.direct_min
            } else {
                usize::MAX
            },
            stream_copies: mode.stream_copies,
            slot_stores: mode.slot_stores.then_some(self.slot_stores),
            rank: sh.rank,
            headers: mode.headers.then_some(self.headers),
            progress: Some(&sh.progress),
            small_max: job.small_max,
        };
        // SAFETY: `bufs` are valid as this function's contract says, and
        // the scratch buffer points into `plan_scratch`, resized above to
        // the program's scratch and not touched otherwise during the call.
        unsafe { host::execute(job.prog, self.chans, &ex, self.header_flags) }
    }
}

impl Communicator {
    /// Plan and run one operation over raw buffers (validated by the caller).
    pub(super) fn run(&self, coll: Collective, dt: DataType, bufs: &[RawBuf]) -> Result<()> {
        let name = coll.name();
        self.run_named(coll, dt, bufs, name)
    }

    /// [`Communicator::run`], the operation called `name` in logs, errors
    /// and the progress snapshot (a collective built from a group says what
    /// it is: Gather, not Group).
    pub(super) fn run_named(
        &self,
        coll: Collective,
        dt: DataType,
        bufs: &[RawBuf],
        name: &'static str,
    ) -> Result<()> {
        let sh = &*self.shared;
        let mut guard = self.lock()?;
        let st = &mut *guard;
        if let Some(why) = &st.broken {
            return Err(Error::Unusable(why.clone()));
        }
        if let Some(why) = sh.aborted_why() {
            return Err(Error::Unusable(why));
        }
        let op = OpId { name, seq: st.seq };
        st.seq += 1;
        let _span = info_span!("op", op = name, seq = op.seq, rank = sh.rank).entered();
        // A group's plan is its own; a collective's stays in `st.last`,
        // where the next identical call finds it, and runs from there.
        let own = if let Collective::Group(_) = coll {
            let planned = self.program(st, &coll, dt, Some(op))?;
            if sh.check_headers {
                st.headers = Headers::for_group(
                    &coll,
                    dt,
                    sh.rank,
                    &planned.prog,
                    &mut st.p2p_send_seq,
                    &mut st.p2p_recv_seq,
                );
            }
            Some(planned)
        } else {
            if sh.check_headers {
                // Before planning: the tuner's programs for this call carry
                // its headers too.
                st.headers
                    .fill_collective(&coll, dt, st.coll_seq, sh.nranks);
            }
            self.plan_last(st, coll, dt, op)?;
            if sh.check_headers {
                st.coll_seq += 1;
            }
            None
        };
        let buf_bytes = bufs.iter().map(|b| b.len).sum::<usize>();
        let mode = Mode {
            stream_copies: buf_bytes >= sh.stream_min,
            slot_stores: true,
            headers: sh.check_headers,
            // Operations that may run a while without waiting (long copies
            // and reductions) take their start time now; small ones once
            // they wait.
            record: Some(buf_bytes >= 64 * 1024),
        };
        // SAFETY: the typed entry points built `bufs` from live slices of the
        // right lengths (checked), borrowed for this whole call, aligned for
        // `dt`, aliasing only as the in-place plans allow.
        unsafe { self.execute(st, own.as_ref(), bufs, op, None, mode) }
    }

    /// The one way into the engine: runs `own`, or else the plan
    /// [`Communicator::plan_last`] left in `State::last` (borrowed there),
    /// over `bufs` (its send and receive buffers; the plan's scratch memory
    /// is added here), connecting its links on first use. A failure breaks
    /// the communicator ([`Communicator::step`]) and is reported as `op`;
    /// `part` names a program run on `op`'s behalf (the tuner's), which
    /// also names its link set-up.
    ///
    /// # Safety
    ///
    /// As for [`host::execute`]: every buffer of `bufs` is valid for reads
    /// and writes of its length for the whole call, aligned for the plan's
    /// datatype and touched by nothing else meanwhile, and the plan's
    /// regions lie inside them.
    pub(super) unsafe fn execute(
        &self,
        st: &mut State,
        own: Option<&Planned>,
        bufs: &[RawBuf],
        op: OpId,
        part: Option<&'static str>,
        mode: Mode,
    ) -> Result<()> {
        let (stages, missing) = {
            let last = st.last.as_ref().map(|l| &l.2);
            let planned = own.or(last).ok_or_else(no_plan)?;
            let connected = planned.links.connected(&st.chans);
            (
                planned.prog.stage_ends.len(),
                (!connected).then(|| planned.links.clone()),
            )
        };
        if let Some(links) = missing {
            let name = part.unwrap_or(op.name);
            self.connect_links(st, &links, OpId { name, ..op })?;
        }
        let sh = &*self.shared;
        self.step(st, op, mode.record.map(|long| (stages, long)), |st| {
            let (last, eng) = st.split();
            let planned = own.or(last).ok_or_else(no_plan)?;
            if mode.record.is_some() {
                debug!(ops = planned.prog.ops.len(), "start");
            }
            // SAFETY: forwarded from this function's contract.
            let res = unsafe { eng.run(sh, planned.job(), mode, bufs) };
            if let (Err(_), Some(part)) = (&res, part) {
                debug!(
                    rank = sh.rank,
                    "{} #{} failed in the {part}", op.name, op.seq
                );
            }
            res
        })
    }

    /// One step of operation `op`, `f`, with its progress record (`record`:
    /// the stages, and whether to take the start time now; `None` within an
    /// operation whose record runs already) and the one failure path:
    /// [`Communicator::fail_op`].
    pub(super) fn step<T>(
        &self,
        st: &mut State,
        op: OpId,
        record: Option<(usize, bool)>,
        f: impl FnOnce(&mut State) -> std::result::Result<T, CoreError>,
    ) -> Result<T> {
        let sh = &*self.shared;
        if let Some((stages, long)) = record {
            sh.progress.start(op.name, op.seq, stages, long);
        }
        let res = f(st);
        if record.is_some() {
            sh.progress
                .finish(res.as_ref().err().map(|e| e.to_string()).as_deref());
        }
        res.map_err(|source| self.fail_op(st, op.name, op.seq, source))
    }

    /// The one failure path of an operation: the peers hear the original
    /// cause (a rank that failed because a peer aborted passes that peer's
    /// reason on unchanged, a revocation its revoker's), and the
    /// communicator is unusable from now on.
    pub(super) fn fail_op(&self, st: &mut State, op: &str, seq: u64, source: CoreError) -> Error {
        let sh = &*self.shared;
        let source = sh.failure_cause(source);
        let msg = format!("{op} #{seq} failed: {source}");
        tracing::error!(rank = sh.rank, "{msg}");
        let origin = match &source {
            CoreError::PeerAborted { reason, .. } => reason.clone(),
            CoreError::Aborted(why) if why.contains(REVOKED) => why.clone(),
            other => format!("rank {}: {other}", sh.rank),
        };
        if origin.contains(REVOKED) {
            // A revocation that reached this rank over a link before the
            // revoker's notice did: the communicator is revoked here too
            // (`is_revoked`), as the notice would make it.
            sh.revoked_here(&origin);
        }
        st.chans.abort_all(&origin);
        st.broken = Some(msg);
        Error::Operation {
            rank: sh.rank,
            op: op.to_string(),
            seq,
            source,
        }
    }

    /// Connects the links of `links` this rank lacks (their first use), with
    /// the ranks at their other ends; a failure breaks the communicator
    /// like a failed operation, naming the peer.
    pub(super) fn connect_links(
        &self,
        st: &mut State,
        links: &connect::LinkSet,
        op: OpId,
    ) -> Result<()> {
        let boot = self.boot()?;
        let timeout = self.shared.policy.timeout;
        self.step(st, op, Some((0, true)), |st| {
            let res = st.links.ensure(&mut st.chans, links, &boot, timeout);
            drop(boot);
            res
        })
    }

    /// Whether this collective may move its data single-copy: groups
    /// always (their pieces are cut per message), collectives when their
    /// largest buffer reaches [`single_copy_threshold`]. The same answer on
    /// every rank, since the plans must cut pieces alike.
    pub(super) fn single_copy(&self, st: &State, coll: &Collective, dt: DataType) -> bool {
        if matches!(coll, Collective::Group(_)) {
            return true;
        }
        let sh = &*self.shared;
        let largest = coll
            .collective_counts(sh.nranks)
            .map(|[s, r]| s.max(r))
            .unwrap_or(0)
            .saturating_mul(dt.size());
        largest > 0
            && largest
                >= single_copy_threshold(
                    coll,
                    sh.nranks,
                    st.moves.single_copy_min,
                    st.moves.direct_min,
                )
    }

    /// Leaves the plan of `coll` (not a group) in `st.last`, where
    /// [`Communicator::execute`] borrows it and the next identical call
    /// finds it without hashing: kept there, else from the cache, else
    /// planned now for `call`.
    pub(super) fn plan_last(
        &self,
        st: &mut State,
        coll: Collective,
        dt: DataType,
        call: OpId,
    ) -> Result<()> {
        if matches!(&st.last, Some((c, d, _)) if *d == dt && *c == coll) {
            return Ok(());
        }
        let planned = self.program(st, &coll, dt, Some(call))?;
        st.last = Some((coll, dt, planned));
        Ok(())
    }

    /// The plan of `coll` (cached, except a group's); `call`: the user's
    /// call it is for (`None` at creation), which the tuner's programs run
    /// on behalf of.
    pub(super) fn program(
        &self,
        st: &mut State,
        coll: &Collective,
        dt: DataType,
        call: Option<OpId>,
    ) -> Result<Planned> {
        let sh = &*self.shared;
        let cacheable = !matches!(coll, Collective::Group(_));
        if cacheable {
            if let Some((c, d, p)) = &st.last {
                if *d == dt && c == coll {
                    return Ok(p.clone());
                }
            }
            if let Some(p) = st.cache.get(&(coll.clone(), dt)) {
                return Ok(p.clone());
            }
        }
        let single_copy = self.single_copy(st, coll, dt);
        let params = PlanParams {
            rank: sh.rank,
            ring: sh.ring.clone(),
            piece_bytes: sh.piece,
            move_piece_bytes: if single_copy {
                st.moves.piece
            } else {
                sh.piece
            },
            small_allreduce_bytes: sh.small_allreduce,
            direct_moves: st.moves.direct
                && (single_copy
                    || matches!(*coll, Collective::AllGather { send_count }
                        if send_count
                            .saturating_mul(sh.nranks as usize)
                            .saturating_mul(dt.size())
                            <= FLAT_ALLGATHER_MAX_BYTES)),
        };
        let picked = self.pick(st, coll, dt, &params, call)?;
        let planned = match picked {
            Some(pk) => {
                let prog = plan::plan_with(coll, dt, &params, pk.choice, &sh.algos.hosts)?;
                let log = |msg: &str| {
                    if sh.rank == 0 {
                        info!(
                            op = coll.name(),
                            bytes = algo::coll_bytes(coll, dt, sh.nranks),
                            nranks = sh.nranks,
                            hosts = sh.algos.shape.nhosts,
                            algorithm = %pk.choice,
                            by = pk.source.name(),
                            model_us = pk.estimate_us,
                            "{msg}"
                        );
                    } else {
                        debug!(algorithm = %pk.choice, by = pk.source.name(), "{msg}");
                    }
                };
                log("braid: algorithm");
                Planned::new(prog, single_copy, Some((pk.choice, pk.source)), true)
            }
            None => {
                let algo = braid_core::plan::CollKind::of(coll).map(|_| {
                    (
                        algo::default_choice(coll, dt, &params),
                        braid_core::tune::Source::Default,
                    )
                });
                Planned::new(plan::plan(coll, dt, &params)?, single_copy, algo, false)
            }
        };
        // Plans made at creation (`call` is `None`) are not kept: they skip
        // the tuner's trials, which the first call of their shape runs.
        if cacheable && call.is_some() {
            if st.cache.len() >= 256 {
                st.cache.clear();
            }
            st.cache.insert((coll.clone(), dt), planned.clone());
        }
        Ok(planned)
    }
}
