//! Creating a communicator: rendezvous, topology fusion, the transport
//! choice per peer, link set-up, and the defaults that depend on them.

use super::*;

impl Communicator {
    /// Join the communicator named by `id` as `rank` of `nranks`. Some process
    /// must host the id's root ([`Communicator::unique_id`] does).
    pub fn init(id: &UniqueId, rank: u32, nranks: u32, config: &Config) -> Result<Communicator> {
        Self::init_inner(id, rank, nranks, config, None, Settings::from_env()?, None)
    }

    /// Create a unique id whose rendezvous root runs in this process, on
    /// `addr` (port 0 picks a free port). Hand the id's text form to the other
    /// ranks; keep the returned server alive until they have all joined, or
    /// pass it to [`Communicator::init_hosting`].
    pub fn unique_id(addr: SocketAddr) -> Result<(UniqueId, RootServer)> {
        create_unique_id(addr)
    }

    /// Like [`Communicator::init`], and keep `root` alive as long as this
    /// communicator.
    pub fn init_hosting(
        id: &UniqueId,
        root: RootServer,
        rank: u32,
        nranks: u32,
        config: &Config,
    ) -> Result<Communicator> {
        Self::init_inner(
            id,
            rank,
            nranks,
            config,
            Some(root),
            Settings::from_env()?,
            None,
        )
    }

    /// Create the communicator from the launcher's environment: `braid-run`
    /// (`BRAID_*`), torchrun, Slurm or Open MPI.
    pub fn from_env() -> Result<Communicator> {
        crate::init_logging();
        let info = LaunchInfo::from_env()?;
        let config = Config::from_env()?;
        let root = info.host_root_server(config.timeout)?;
        info!(
            rank = info.rank,
            nranks = info.nranks,
            launcher = info.source,
            "braid: joining communicator"
        );
        let settings = Settings::from_env()?;
        Self::init_inner(
            &info.id,
            info.rank,
            info.nranks,
            &config,
            root,
            settings,
            None,
        )
    }

    /// Create all `nranks` ranks as threads of this process (tests, and
    /// programs that drive several devices from one process).
    pub fn init_threads(nranks: u32, config: &Config) -> Result<Vec<Communicator>> {
        Self::init_threads_with(nranks, config, Settings::from_env()?)
    }

    /// [`Communicator::init_threads`] with these settings for all ranks.
    pub(crate) fn init_threads_with(
        nranks: u32,
        config: &Config,
        settings: Settings,
    ) -> Result<Vec<Communicator>> {
        if nranks == 0 {
            return Err(Error::InvalidArgument("nranks must be at least 1".into()));
        }
        let (id, root) = create_unique_id(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0))?;
        let root = Arc::new(Mutex::new(Some(root)));
        let handles: Vec<_> = (0..nranks)
            .map(|r| {
                let (id, config, root) = (id, config.clone(), root.clone());
                let settings = settings.clone();
                std::thread::Builder::new()
                    .name(format!("braid-init-{r}"))
                    .spawn(move || {
                        let root = if r == 0 {
                            root.lock().ok().and_then(|mut g| g.take())
                        } else {
                            None
                        };
                        Self::init_inner(&id, r, nranks, &config, root, settings, None)
                    })
            })
            .collect();
        let mut out = Vec::new();
        let mut first_err = None;
        for h in handles {
            match h {
                Ok(h) => match h.join() {
                    Ok(Ok(c)) => out.push(c),
                    Ok(Err(e)) => first_err = first_err.or(Some(e)),
                    Err(_) => {
                        first_err =
                            first_err.or(Some(Error::Unusable("an init thread panicked".into())))
                    }
                },
                Err(e) => {
                    first_err = first_err.or(Some(Error::BootstrapIo {
                        what: "spawning an init thread".into(),
                        source: e,
                    }))
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// `settings`: the `BRAID_*` settings, read from the environment by
    /// the public constructors, a split's from its parent; `kept`: links
    /// a shrink kept, already resumed under this communicator's ranks (the
    /// ranks at their other ends have them too).
    pub(super) fn init_inner(
        id: &UniqueId,
        rank: u32,
        nranks: u32,
        config: &Config,
        root: Option<RootServer>,
        settings: Settings,
        kept: Option<Channels>,
    ) -> Result<Communicator> {
        crate::init_logging();
        progress::install_dump_signal().map_err(Error::Env)?;
        if nranks == 0 || rank >= nranks {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} out of range for {nranks} ranks: ranks are 0..nranks-1"
            )));
        }
        let timeout = config.timeout;
        // The table first: network transports probe their fabric, which
        // every rank needs to know about the others.
        let env = |k: &str| settings.env.get(k);
        let policy = settings.policy.clone();
        let table = TransportTable::host(id.addr, &policy, &env)?;
        let me = PeerDesc {
            rank,
            host_id: topology::host_id(settings.host_id.as_deref()),
            pid: std::process::id(),
            fabrics: table.fabrics(),
        };
        let abort = config
            .abort
            .clone()
            .unwrap_or_else(|| Arc::new(AtomicBool::new(false)));
        let (boot, infos) = Bootstrap::connect_abortable(
            id,
            rank,
            nranks,
            &encode_peer(&me),
            timeout,
            Some(abort.clone()),
        )?;
        let peers: Vec<PeerDesc> = infos
            .iter()
            .enumerate()
            .map(|(r, b)| decode_peer(b, r as u32))
            .collect::<Result<_>>()?;

        // The CPUs this rank may run on: its NUMA node in the topology round,
        // the oversubscription test after link set-up.
        let allowed = braid_core::topo::bind::allowed_cpus();
        // A forced device transport (nvlink, pcie) is for device
        // communicators: host links are planned as usual.
        let mut host_policy = policy.clone();
        if host_policy.forced.is_some_and(|f| f.is_device()) {
            host_policy.forced = None;
        }
        let placement = topology::place(
            &boot,
            &me,
            &peers,
            &table,
            &host_policy,
            allowed.as_ref(),
            &env,
        )?;
        let (choice, ring, topo_plan) = (placement.choice, placement.ring, placement.plan);
        let topo_cluster = placement.cluster;

        // Plans must cut pieces the same way on every rank, so agree on the
        // smallest slot any link will have (each rank knows the slots of the
        // transports it receives on before connecting anything), and say
        // which CPUs this rank may run on (a hex mask; empty when unknown),
        // for the oversubscription test.
        let p = nranks as usize;
        let mode = settings.connect;
        // Pieces a link's sender would otherwise copy (sockets) go by
        // reference from here; single-copy operations use the agreed
        // `Moves::direct_min` (below).
        let direct_min = settings.direct_min.unwrap_or(DIRECT_MIN);
        // This host's single-copy threshold (see `single_copy_default`);
        // the job's is agreed once the first links are connected.
        let local_single_copy = settings
            .single_copy_min
            .unwrap_or_else(|| single_copy_default(THP_ENABLED));
        let slot_mode = settings.slot_stores;
        let chans = match kept {
            Some(kept) => planned_links(kept, &choice),
            None => Channels {
                send: (0..p).map(|_| None).collect(),
                recv: (0..p).map(|_| None).collect(),
                scratch: Vec::new(),
            },
        };
        let local_piece =
            connect::min_slot_bytes(&table, &choice, &chans).unwrap_or(usize::MAX) as u64;
        let mut mine = local_piece.to_le_bytes().to_vec();
        mine.extend(
            allowed
                .as_ref()
                .map(|s| s.to_mask())
                .unwrap_or_default()
                .bytes(),
        );
        let all = boot.allgather(&mine)?;
        let mut piece = u64::MAX;
        let mut local_cpus: Vec<Option<CpuSet>> = Vec::new();
        let mut me_local = 0;
        for (r, b) in all.iter().enumerate() {
            let (Some(p), Some(mask)) = (b.get(0..8), b.get(8..)) else {
                return Err(Error::Bootstrap(format!(
                    "rank {r} sent a malformed link summary"
                )));
            };
            let mut a = [0u8; 8];
            a.copy_from_slice(p);
            piece = piece.min(u64::from_le_bytes(a));
            if peers.get(r).is_some_and(|p| p.host_id == me.host_id) {
                if r == rank as usize {
                    me_local = local_cpus.len();
                }
                local_cpus.push(std::str::from_utf8(mask).ok().and_then(CpuSet::from_mask));
            }
        }
        let share = cpu_share(me_local, &local_cpus, online_cpus());
        let oversub = share.oversubscribed();
        info!(
            rank,
            local_ranks = local_cpus.len(),
            sharing = share.ranks,
            cpus = share.cpus,
            oversubscribed = oversub,
            "braid: waits {}",
            if oversub {
                format!(
                    "yield up to {} times, then sleep (ranks here share CPUs)",
                    super::tuning::OVERSUBSCRIBED_YIELDS
                )
            } else {
                "spin up to 50 µs, then sleep".to_string()
            }
        );
        let piece = if piece == u64::MAX {
            DEFAULT_PIECE
        } else {
            piece as usize
        };
        // The tuner's settings, the same on every rank (one more round);
        // its piece for pure data movement is set with the communicator's,
        // once the first links are connected (below).
        let algos = super::algo::Algos::from_env(&topo_plan, piece, piece, direct_min, &env)?;
        algos.agree(&boot, rank)?;
        let transports = choice
            .iter()
            .map(|c| c.map_or("self", |k| k.name()))
            .collect();
        let door_ip = boot.local_ip().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let comm = Communicator {
            shared: Arc::new_cyclic(|this| Shared {
                rank,
                nranks,
                ring,
                piece,
                small_allreduce: settings.small_allreduce,
                // process_vm_readv runs at about half the speed of memcpy on
                // the VMs measured (page pinning), but it replaces two copies
                // and leaves the sender free: side by side it was faster for
                // Broadcast, AllGather and AllToAll from 1 to 64 MiB.
                direct_min,
                stream_min: settings.stream_min.unwrap_or_else(|| {
                    stream_default(
                        std::path::Path::new(CPU0_CACHES),
                        peers.iter().filter(|p| p.host_id == me.host_id).count(),
                    )
                }),
                cpu_share: share,
                // Mismatch detection (one 32-byte header per link per
                // operation); BRAID_CHECK_MISMATCH=0 turns it off.
                check_headers: settings.check_headers,
                policy: WaitPolicy {
                    timeout,
                    spin: spin_budget(settings.spin, oversub),
                    yields: yield_budget(settings.spin, oversub),
                    stall_warn: progress::stall_warn(settings.stall_warn, timeout),
                },
                abort,
                abort_why: Default::default(),
                secret: id.secret,
                // Revocations from the other ranks (`revoke.rs`).
                door: super::revoke::Door::open(door_ip, id.secret, this.clone())
                    .map_err(|e| {
                        warn!(
                            rank,
                            "braid: cannot listen for revocations on {door_ip} ({e}); \
                             this rank learns of one only from its links"
                        )
                    })
                    .ok(),
                doors: Default::default(),
                grow_root: Mutex::new(None),
                repairs: Default::default(),
                state: OpLock::new(State {
                    chans,
                    // Decided once the first links are connected (below).
                    moves: Moves {
                        piece,
                        direct: false,
                        direct_min,
                        single_copy_min: local_single_copy,
                    },
                    links: connect::Connector {
                        me: me.clone(),
                        peers: peers.clone(),
                        choice: choice.clone(),
                        table,
                        xchg: vec![0; p],
                        mode,
                    },
                    seq: 0,
                    coll_seq: 0,
                    p2p_send_seq: vec![0; p],
                    p2p_recv_seq: vec![0; p],
                    headers: Headers::default(),
                    header_flags: Default::default(),
                    slot_stores: SlotStores::new(p, slot_mode),
                    broken: None,
                    cache: HashMap::new(),
                    last: None,
                    tune: Default::default(),
                    plan_scratch: Vec::new(),
                }),
                bootstrap: Mutex::new(boot),
                transports,
                topo_plan,
                algos,
                topo_cluster,
                transport_policy: policy,
                children: Mutex::new(Vec::new()),
                progress: Progress::register(rank, nranks, format!("comm@{}", id.addr)),
                settings,
                _root: root,
            }),
        };
        // The links of the default collectives (every pair when eager),
        // then a barrier: after it every receiver has run its single-copy
        // probe, so the senders know whether their links pass references.
        comm.connect_initial()?;
        comm.boot()?.barrier()?;
        let local_direct = {
            let mut st = comm.lock()?;
            st.chans
                .send
                .iter_mut()
                .flatten()
                .all(|c| c.direct().is_some())
        };
        // With whether its links pass references and its single-copy
        // settings, each rank says where it hears revocations.
        let say = CopySay {
            oversubscribed: oversub,
            single_copy_set: comm.shared.settings.single_copy_min,
            single_copy: local_single_copy,
            direct_set: comm.shared.settings.direct_min,
        };
        let mut mine = vec![local_direct as u8];
        mine.extend(say.encode());
        if let Some(d) = &comm.shared.door {
            mine.extend(d.addr.to_string().bytes());
        }
        let all = comm.allgather_bytes(&mine)?;
        let doors = all
            .iter()
            .map(|b| {
                std::str::from_utf8(b.get(1 + CopySay::LEN..)?)
                    .ok()?
                    .parse()
                    .ok()
            })
            .collect();
        let _ = comm.shared.doors.set(doors);
        // Whether every link passes references: then pieces of pure data
        // movement can be much larger than a slot (fewer system calls;
        // pieces below `direct_min` still fit a slot). Links connected later
        // are of the same transports, so they are alike.
        let all_direct = all.iter().all(|b| b.first() == Some(&1));
        let says = all
            .iter()
            .enumerate()
            .map(|(r, b)| {
                b.get(1..).and_then(CopySay::decode).ok_or_else(|| {
                    Error::Bootstrap(format!("rank {r} sent a malformed link summary"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let (single_copy_min, agreed_direct_min) = agree_copy(&says).map_err(Error::Env)?;
        let settings = &comm.shared.settings;
        let moves = Moves {
            piece: if all_direct && direct_min <= piece {
                piece.max(settings.direct_piece)
            } else {
                piece
            },
            direct: all_direct && direct_min <= piece && settings.direct_moves,
            direct_min: agreed_direct_min,
            single_copy_min,
        };
        {
            // Plans made before this used the provisional pieces.
            let mut st = comm.lock()?;
            st.moves = moves;
            st.cache.clear();
            st.last = None;
        }
        info!(rank, nranks, piece, "braid: communicator ready");
        Ok(comm)
    }

    /// Connects what the communicator needs from the start: the links of
    /// its default collectives (AllReduce of every size, Barrier: the ring
    /// neighbours and the recursive-doubling partners, as their programs
    /// say), or every pair with `BRAID_CONNECT=eager`.
    fn connect_initial(&self) -> Result<()> {
        let sh = &*self.shared;
        let mut st = self.lock()?;
        let need = match st.links.mode {
            connect::ConnectMode::Eager => connect::LinkSet::all(sh.rank, &st.links.choice),
            connect::ConnectMode::Lazy => {
                let mut need = connect::LinkSet::default();
                for (coll, dt) in [
                    (
                        Collective::AllReduce {
                            count: 1,
                            op: RedOp::Sum,
                        },
                        DataType::U8,
                    ),
                    (
                        Collective::AllReduce {
                            count: 16 << 20,
                            op: RedOp::Sum,
                        },
                        DataType::F32,
                    ),
                    (Collective::Barrier, DataType::U8),
                ] {
                    let planned = self.program(&mut st, &coll, dt, None)?;
                    need.merge(&planned.links);
                }
                need
            }
        };
        let boot = self.boot()?;
        let st = &mut *st;
        st.links
            .ensure(&mut st.chans, &need, &boot, sh.policy.timeout)
            .map_err(Error::Core)
    }
}

/// The kept links whose transport is the one this communicator chose for
/// their peer (both ends decide alike: the choice is the same on both
/// ranks); the others are dropped, and made afresh when used.
fn planned_links(
    mut kept: Channels,
    choice: &[Option<braid_core::transport::TransportKind>],
) -> Channels {
    let p = choice.len();
    kept.send.resize_with(p, || None);
    kept.recv.resize_with(p, || None);
    let name = |q: usize| choice.get(q).copied().flatten().map(|k| k.name());
    for (q, c) in kept.send.iter_mut().enumerate() {
        if c.as_ref().is_some_and(|c| Some(c.transport()) != name(q)) {
            *c = None;
        }
    }
    for (q, c) in kept.recv.iter_mut().enumerate() {
        if c.as_ref().is_some_and(|c| Some(c.transport()) != name(q)) {
            *c = None;
        }
    }
    kept
}
