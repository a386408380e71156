//! The engines: they run a plan's [`Program`] over connected transport
//! channels and are the only code that touches memory (user buffers, slots).
//!
//! - [`host`]: host memory, on the caller's thread (CPU copies and
//!   reductions).
//! - [`proxy`]: device memory, on a proxy thread per device communicator
//!   that enqueues copies and reduction kernels on a CUDA stream and moves
//!   the slots' credits (NCCL's proxy model; every device link works).
//! - [`stream`]: device memory with GPU-side synchronisation: a collective
//!   becomes one list of stream commands, and a watchdog thread watches it
//!   (links that are rings in GPU memory only).
//!
//! They share what this module holds: the channels of a communicator, the
//! waiting policy and the [`Waiter`] that applies it (spin first — a
//! spinning shared-memory flag costs ~0.1 µs, waking a sleeping thread
//! 25–30 µs —, then yield the CPU, as ranks may outnumber cores, then sleep
//! briefly; check the abort flag and the peers' liveness now and then;
//! publish long waits for the hang dump, warn once a wait stalls, and give
//! up with [`CoreError::Timeout`] after the timeout without progress), and
//! the stage runner [`run_stages`] that the host and proxy engines drive
//! their ops with.

pub(crate) mod host;
pub(crate) mod proxy;
pub(crate) mod stream;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use braid_core::plan::{Op, Program};
use braid_core::transport::{sleep_any, RecvChannel, SendChannel, WakeWord};
use braid_core::CoreError;

use crate::progress::{Progress, Waiting};

/// A caller buffer as the engine sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawBuf {
    /// Start of the buffer.
    pub ptr: *mut u8,
    /// Length in bytes.
    pub len: usize,
}

/// The channels of one communicator, indexed by peer rank.
#[derive(Default)]
pub(crate) struct Channels {
    /// Sending ends, `send[peer]`.
    pub send: Vec<Option<Box<dyn SendChannel>>>,
    /// Receiving ends, `recv[peer]`.
    pub recv: Vec<Option<Box<dyn RecvChannel>>>,
    /// Where direct (single-copy) input is copied before it is reduced.
    pub scratch: Vec<u64>,
}

impl std::fmt::Debug for Channels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names = |v: Vec<Option<&'static str>>| {
            v.into_iter()
                .enumerate()
                .filter_map(|(r, t)| t.map(|t| format!("{r}:{t}")))
                .collect::<Vec<_>>()
                .join(" ")
        };
        f.debug_struct("Channels")
            .field(
                "send",
                &names(
                    self.send
                        .iter()
                        .map(|c| c.as_ref().map(|c| c.transport()))
                        .collect(),
                ),
            )
            .field(
                "recv",
                &names(
                    self.recv
                        .iter()
                        .map(|c| c.as_ref().map(|c| c.transport()))
                        .collect(),
                ),
            )
            .finish()
    }
}

/// The error for a link this rank lacks (built out of the hot path).
#[cold]
#[inline(never)]
fn not_connected(dir: &str, peer: u32) -> CoreError {
    CoreError::InvalidArgument(format!("no connection {dir} rank {peer}"))
}

impl Channels {
    /// Tell every peer that this side gave up.
    pub(crate) fn abort_all(&mut self, reason: &str) {
        for c in self.send.iter_mut().flatten() {
            c.abort(reason);
        }
        for c in self.recv.iter_mut().flatten() {
            c.abort(reason);
        }
    }

    #[inline]
    pub(crate) fn sender(&mut self, peer: u32) -> Result<&mut Box<dyn SendChannel>, CoreError> {
        match self.send.get_mut(peer as usize) {
            Some(Some(c)) => Ok(c),
            _ => Err(not_connected("to", peer)),
        }
    }

    #[inline]
    pub(crate) fn receiver(&mut self, peer: u32) -> Result<&mut Box<dyn RecvChannel>, CoreError> {
        match self.recv.get_mut(peer as usize) {
            Some(Some(c)) => Ok(c),
            _ => Err(not_connected("from", peer)),
        }
    }

    /// The smallest slot size over all connected channels (the plans' piece).
    pub(crate) fn min_slot_bytes(&self) -> Option<usize> {
        let s = self.send.iter().flatten().map(|c| c.slot_bytes());
        let r = self.recv.iter().flatten().map(|c| c.slot_bytes());
        s.chain(r).min()
    }
}

/// How long and how hard to wait.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WaitPolicy {
    /// Give up after this long without progress.
    pub timeout: Duration,
    /// Busy-poll iterations before sleeping (or yielding, on links without
    /// a doorbell); the spin also ends after [`SPIN_MAX`].
    pub spin: u32,
    /// After the spin, the CPU yielded this many times (a poll after each)
    /// before sleeping on the doorbells: where this host's ranks share
    /// CPUs, the rank waited for is likely runnable on this very core, and
    /// a yield hands it over at once where a doorbell's wake-up costs
    /// 25-30 µs per dependent step.
    pub yields: u32,
    /// Log a wait at WARN once it lasts this long.
    pub stall_warn: Duration,
}

impl Default for WaitPolicy {
    fn default() -> Self {
        WaitPolicy {
            timeout: Duration::from_secs(120),
            spin: 2000,
            yields: 0,
            stall_warn: Duration::from_secs(10),
        }
    }
}

/// The longest spin of one wait, whatever [`WaitPolicy::spin`] says: a
/// peer that has not answered by then is not running or far behind, and a
/// waiter that spins on takes a core from whoever needs it.
pub(crate) const SPIN_MAX: Duration = Duration::from_micros(50);

/// Spin iterations of a wait on a background thread (see
/// [`set_background`]): a stream's worker runs operations nobody is blocked
/// on, while the application computes on the same cores; its spin only
/// takes a core from that computation (and, woken by the submission, it may
/// preempt the very thread that submitted). DDP step on 2 ranks, 2 cores:
/// issuing a bucket's all-reduce took 0.3 ms of the backward pass with the
/// full spin, 0.01 ms without.
pub(crate) const BACKGROUND_SPIN: u32 = 0;

thread_local! {
    static BACKGROUND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling thread as a background worker (a stream's): its waits
/// spin [`BACKGROUND_SPIN`] iterations before they sleep.
pub(crate) fn set_background(on: bool) {
    BACKGROUND.with(|b| b.set(on));
}

/// The longest a wait yields ([`WaitPolicy::yields`]) before it sleeps.
pub(crate) const YIELD_MAX: Duration = Duration::from_millis(1);

/// How often a wait checks its peers' liveness (`check_peer`: on shm a
/// `kill(pid, 0)` and a read of `/proc/<pid>/stat`, some microseconds of
/// system calls). The first check comes this long after an operation first
/// waited, not at once: checking at every wait's start cost each 8-byte
/// AllReduce of 4 ranks sharing 2 cores tens of microseconds (85% of the
/// run's CPU time in the kernel, reading `/proc`), where ranks wait at
/// every step. A dead peer is still found within this, or within a
/// doorbell sleep ([`SLEEP_MAX`]), of the wait that needs it.
pub(crate) const CHECK_EVERY: Duration = Duration::from_millis(2);

/// The longest sleep on a doorbell: a dead peer never rings, and the abort
/// flag is a plain store, so the waiter looks at both at least this often.
const SLEEP_MAX: Duration = Duration::from_millis(5);

/// Tracks one wait with no progress: spin, then sleep on the links'
/// doorbells (or, on links without one, yield, then sleep briefly); checks
/// the abort flag and the peers' liveness now and then; publishes a wait
/// that lasts (hang dump), warns once it stalls, and times out.
pub(crate) struct Waiter<'a> {
    policy: &'a WaitPolicy,
    abort: &'a AtomicBool,
    progress: Option<&'a Progress>,
    /// Spin iterations before sleeping: the policy's, or [`BACKGROUND_SPIN`]
    /// on a background thread.
    spin: u32,
    iters: u32,
    /// Yields before sleeping ([`WaitPolicy::yields`]; none on a
    /// background thread, which must not compete with the application),
    /// and those this wait made.
    yield_budget: u32,
    yielded: u32,
    /// When this wait's spin began (read every 64 iterations).
    spin_start: Option<Instant>,
    since: Option<Instant>,
    /// When the peers' liveness was last checked (or, before the first
    /// check, when this operation first waited): checked every
    /// [`CHECK_EVERY`] of waiting, never on a wait's first idle call.
    last_check: Option<Instant>,
    /// Check at the next call whatever the time (a sending end's failure
    /// seen once, to be confirmed).
    recheck: bool,
    /// The stage being run (for the progress record).
    pub(crate) stage: usize,
    /// The current wait was published / logged as a stall.
    published: bool,
    warned: bool,
    /// The link ends whose doorbells count this waiter as asleep, and the
    /// words to sleep on: armed before the last poll, slept on if it found
    /// nothing, disarmed after the sleep or once something moved.
    armed: Vec<(Blocked, WakeWord)>,
    /// A receiver's failure seen by a liveness check of a sending end,
    /// held back until the caller has polled once more: the wait may have
    /// been met just before the check (a receiver that released everything,
    /// then closed its end or exited at once, is not a failure of this
    /// operation). Only for sending ends: a receiving end must not go on
    /// after its sender failed (a direct message lives in the sender's
    /// memory, which it may reuse once its operation returned the error).
    peer_error: Option<CoreError>,
    /// `idle_any` ran since the last [`Waiter::progressed`]: only then has
    /// that anything to reset (most ops of a small call never wait).
    idled: bool,
    /// Sleeps on doorbells so far (for tests).
    pub(crate) sleeps: u64,
    /// Yields (before a doorbell sleep, or on ends without a doorbell)
    /// and short sleeps so far (tests).
    pub(crate) yields: u64,
    pub(crate) naps: u64,
}

impl<'a> Waiter<'a> {
    pub(crate) fn new(
        policy: &'a WaitPolicy,
        abort: &'a AtomicBool,
        progress: Option<&'a Progress>,
    ) -> Self {
        let background = BACKGROUND.with(|b| b.get());
        let spin = if background {
            BACKGROUND_SPIN
        } else {
            policy.spin
        };
        Waiter {
            policy,
            abort,
            progress,
            spin,
            iters: 0,
            yield_budget: if background { 0 } else { policy.yields },
            yielded: 0,
            spin_start: None,
            since: None,
            last_check: None,
            recheck: false,
            stage: 0,
            published: false,
            warned: false,
            armed: Vec::new(),
            peer_error: None,
            idled: false,
            sleeps: 0,
            yields: 0,
            naps: 0,
        }
    }

    /// Something moved: the next wait starts afresh.
    #[inline]
    pub(crate) fn progressed(&mut self, chans: &mut Channels) {
        if self.idled {
            self.reset(chans);
        }
    }

    /// What [`Waiter::progressed`] does after a wait.
    fn reset(&mut self, chans: &mut Channels) {
        self.idled = false;
        self.peer_error = None;
        self.iters = 0;
        self.yielded = 0;
        self.spin_start = None;
        self.since = None;
        if !self.armed.is_empty() {
            self.disarm(chans);
        }
        if self.published {
            self.published = false;
            self.warned = false;
            if let Some(p) = self.progress {
                p.wait_ends();
            }
        }
    }

    /// Takes this waiter off every doorbell it is armed on. Also needed
    /// before an error ends the operation with the waiter armed.
    pub(crate) fn disarm(&mut self, chans: &mut Channels) {
        for (Blocked { peer, wait: what }, _) in self.armed.drain(..) {
            if what == Wait::Data {
                if let Ok(c) = chans.receiver(peer) {
                    c.disarm_wake();
                }
            } else if let Ok(c) = chans.sender(peer) {
                c.disarm_wake();
            }
        }
    }

    /// Called when nothing could move: see [`Waiter::idle_any`].
    pub(crate) fn idle(
        &mut self,
        chans: &mut Channels,
        blocked: Blocked,
        helping: &[u32],
    ) -> Result<(), CoreError> {
        self.idle_any(chans, &[blocked], helping)
    }

    /// Called when nothing could move. `blocked` names what the blocked
    /// ops wait for (at least one; the first is the one errors and the
    /// hang dump name); `helping` are the peers this operation sent direct
    /// slots to, whose copies we take a share of meanwhile
    /// ([`DirectSend::poll_help`]) — unless we wait for data: then we have
    /// work of our own coming, and side by side (AllGather on 2 ranks,
    /// 16 MiB) helping there made the operation 12% slower, while helping
    /// from slot and drain waits made Broadcast on 2 ranks 1.6x faster.
    ///
    /// Each call returns for the caller to poll again. The first calls
    /// spin; after the spin, a call arms the blocked ends' doorbells (so
    /// the next poll is the last before sleeping) and the next call, if
    /// the same ends are still blocked, sleeps until one of them rings,
    /// at most [`SLEEP_MAX`]. Where an end has no doorbell the calls yield
    /// the CPU instead, and after 20 ms sleep 50 µs each.
    ///
    /// [`DirectSend::poll_help`]: braid_core::transport::DirectSend::poll_help
    pub(crate) fn idle_any(
        &mut self,
        chans: &mut Channels,
        blocked: &[Blocked],
        helping: &[u32],
    ) -> Result<(), CoreError> {
        let Some(&first) = blocked.first() else {
            return Ok(());
        };
        self.idled = true;
        if !helping.is_empty() && first.wait != Wait::Data {
            for &peer in helping {
                if let Some(d) = chans.sender(peer)?.direct() {
                    if d.poll_help()? {
                        return Ok(());
                    }
                }
            }
        }
        self.iters = self.iters.saturating_add(1);
        if self.iters < self.spin {
            // A PAUSE costs ~40 ns on recent x86 cores, as much as seeing a
            // peer's flag: polling without one took an 8-byte AllReduce on
            // 2 ranks from 0.20 to 0.18 µs (median of 20 runs side by
            // side). One in 16 keeps a hyperthread sibling breathing.
            if self.iters.is_multiple_of(16) {
                std::hint::spin_loop();
            }
            if !self.iters.is_multiple_of(64) {
                return Ok(());
            }
            let now = Instant::now();
            let t0 = *self.spin_start.get_or_insert(now);
            if now.duration_since(t0) < SPIN_MAX {
                return Ok(());
            }
            self.iters = self.spin;
        }
        let now = Instant::now();
        let since = match self.since {
            Some(t) => t,
            None => {
                if let Some(p) = self.progress {
                    p.stamp();
                }
                *self.since.insert(now)
            }
        };
        if self.abort.load(Ordering::Relaxed) {
            self.disarm(chans);
            return Err(CoreError::Aborted("the communicator was aborted".into()));
        }
        let last = *self.last_check.get_or_insert(now);
        if self.recheck || now.duration_since(last) >= CHECK_EVERY {
            self.recheck = false;
            self.last_check = Some(now);
            for &Blocked { peer, wait: what } in blocked {
                let r = if what != Wait::Data {
                    chans.sender(peer)?.check_peer()
                } else {
                    chans.receiver(peer)?.check_peer()
                };
                if let Err(e) = r {
                    if what != Wait::Data && self.peer_error.is_none() {
                        // Poll once more before failing (see `peer_error`),
                        // and check again at the next call.
                        self.peer_error = Some(e);
                        self.recheck = true;
                        return Ok(());
                    }
                    self.disarm(chans);
                    return Err(self.peer_error.take().unwrap_or(e));
                }
            }
        }
        let Blocked { peer, wait: what } = first;
        let waited = now.duration_since(since);
        let mut transport = || -> Result<&'static str, CoreError> {
            Ok(if what != Wait::Data {
                chans.sender(peer)?.transport()
            } else {
                chans.receiver(peer)?.transport()
            })
        };
        if !self.published && waited >= Duration::from_millis(1) {
            self.published = true;
            if let Some(p) = self.progress {
                p.wait_begins(
                    self.stage,
                    Waiting {
                        peer,
                        transport: transport()?,
                        what: what.describe(),
                        since,
                    },
                );
            }
        }
        if !self.warned && waited >= self.policy.stall_warn {
            self.warned = true;
            tracing::warn!(
                peer,
                transport = transport()?,
                waiting_for = what.describe(),
                waited_s = waited.as_secs_f64(),
                "braid: stalled: {}",
                self.progress.map(|p| p.describe()).unwrap_or_default()
            );
        }
        if waited >= self.policy.timeout {
            let transport = transport()?;
            self.disarm(chans);
            return Err(CoreError::Timeout {
                transport,
                peer,
                waiting_for: what.describe(),
                after: waited,
            });
        }
        if self.armed.is_empty() && self.yielded < self.yield_budget && waited < YIELD_MAX {
            // Yield before arming the doorbells, polling after each yield:
            // a peer that publishes meanwhile has nobody to wake (a futex
            // system call on its side). 4 ranks on 2 cores, 8-byte
            // AllReduce: median 7.2 µs (5.8-11.7) against 10.9 (7.3-16.5)
            // yielding armed, 5 alternated runs.
            self.yielded += 1;
            self.yields += 1;
            std::thread::yield_now();
            return Ok(());
        }
        let same = self.armed.len() == blocked.len()
            && self.armed.iter().zip(blocked).all(|(a, b)| a.0 == *b);
        if same {
            // Armed before the poll that just found these ends blocked:
            // anything that moves now rings.
            let words: Vec<WakeWord> = self.armed.iter().map(|a| a.1).collect();
            let left = self.policy.timeout.saturating_sub(waited);
            // SAFETY: the words come from `arm_wake` of ends in `chans`,
            // which live for the whole operation; we disarm them below.
            unsafe { sleep_any(&words, left.min(SLEEP_MAX)) };
            self.sleeps += 1;
            self.disarm(chans);
            return Ok(());
        }
        self.disarm(chans);
        if self.arm(chans, blocked)? {
            return Ok(());
        }
        if waited > Duration::from_millis(20) || self.spin == 0 {
            // Links without a doorbell: long waits, and waits of threads
            // that must not take a core (a stream's worker, oversubscribed
            // ranks), sleep instead of yielding: a yielding thread keeps its
            // share of a busy core.
            std::thread::sleep(Duration::from_micros(50));
            self.naps += 1;
        } else {
            std::thread::yield_now();
            self.yields += 1;
        }
        Ok(())
    }

    /// Arms the doorbells of the ends in `blocked`: true if every one has
    /// a doorbell (otherwise none stays armed).
    fn arm(&mut self, chans: &mut Channels, blocked: &[Blocked]) -> Result<bool, CoreError> {
        for &b in blocked {
            let Blocked { peer, wait: what } = b;
            let w = if what == Wait::Data {
                chans.receiver(peer)?.arm_wake()
            } else {
                chans.sender(peer)?.arm_wake()
            };
            match w {
                Some(w) => self.armed.push((b, w)),
                None => {
                    self.disarm(chans);
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }
}

/// What a blocked op waits for (the waiter checks the matching channel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Data from the peer.
    Data,
    /// A free slot on the link to the peer.
    Slot,
    /// The peer to finish its single-copy read of our buffer.
    Drain,
}

impl Wait {
    /// How errors, warnings and the progress snapshot say it.
    pub(crate) const fn describe(self) -> &'static str {
        match self {
            Wait::Data => "data",
            Wait::Slot => "a free slot",
            Wait::Drain => "its single-copy read of our buffer",
        }
    }
}

/// A blocked op: the peer it waits for and what it waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Blocked {
    /// The peer whose link holds the op up.
    pub peer: u32,
    /// What the op waits for on that link.
    pub wait: Wait,
}

impl Blocked {
    /// Waiting for data from `peer`.
    pub(crate) const fn data(peer: u32) -> Blocked {
        Blocked {
            peer,
            wait: Wait::Data,
        }
    }

    /// Waiting for a free slot on the link to `peer`.
    pub(crate) const fn slot(peer: u32) -> Blocked {
        Blocked {
            peer,
            wait: Wait::Slot,
        }
    }

    /// Waiting for `peer` to finish its single-copy read of our buffer.
    pub(crate) const fn drain(peer: u32) -> Blocked {
        Blocked {
            peer,
            wait: Wait::Drain,
        }
    }
}

/// What a stage runner drives: one engine's way of trying an op.
pub(crate) trait OpRunner {
    /// Try to run `op`: `Ok(None)` when it ran, `Ok(Some(blocked))` when it
    /// must wait, having changed nothing visible (its retry starts over).
    fn try_op(&mut self, op: &Op, chans: &mut Channels) -> Result<Option<Blocked>, CoreError>;
    /// Peers whose single-copy reads of our buffers this operation may help
    /// with while it waits ([`DirectSend::poll_help`]).
    fn helping(&self) -> &[u32] {
        &[]
    }
}

/// Run every stage of `prog` with `runner`. The ops of a stage run in any
/// order as their links allow, except that pieces to or from one peer keep
/// their order: once an op is blocked, later ops of the stage that use its
/// peers wait too. Waits go through `waiter`.
pub(crate) fn run_stages<R: OpRunner>(
    prog: &Program,
    chans: &mut Channels,
    waiter: &mut Waiter<'_>,
    runner: &mut R,
) -> Result<(), CoreError> {
    let r = stages_inner(prog, chans, waiter, runner);
    if r.is_err() {
        waiter.disarm(chans);
    }
    r
}

fn stages_inner<R: OpRunner>(
    prog: &Program,
    chans: &mut Channels,
    waiter: &mut Waiter<'_>,
    runner: &mut R,
) -> Result<(), CoreError> {
    let mut pending: Vec<bool> = Vec::new();
    let mut claimed: Vec<(Option<u32>, Option<u32>)> = Vec::new();
    let mut blocked: Vec<Blocked> = Vec::new();
    for (si, stage) in prog.stages().enumerate() {
        waiter.stage = si;
        if let [op] = stage {
            // The common case: one op, retried until it runs.
            while let Some(blocked) = runner.try_op(op, chans)? {
                waiter.idle(chans, blocked, runner.helping())?;
            }
            waiter.progressed(chans);
            continue;
        }
        pending.clear();
        pending.resize(stage.len(), true);
        let mut left = stage.len();
        while left > 0 {
            let mut moved = false;
            blocked.clear();
            claimed.clear();
            for (i, op) in stage.iter().enumerate() {
                if !pending[i] || claims_overlap(&claimed, op) {
                    continue;
                }
                match runner.try_op(op, chans)? {
                    None => {
                        pending[i] = false;
                        left -= 1;
                        moved = true;
                    }
                    Some(b) => {
                        blocked.push(b);
                        claimed.push((op.recv_peer(), op.send_peer()));
                    }
                }
            }
            if moved || blocked.is_empty() {
                waiter.progressed(chans);
            } else {
                waiter.idle_any(chans, &blocked, runner.helping())?;
            }
        }
    }
    Ok(())
}

/// Whether `op` uses a link that an earlier, blocked op of its stage uses.
fn claims_overlap(claimed: &[(Option<u32>, Option<u32>)], op: &Op) -> bool {
    let (r, s) = (op.recv_peer(), op.send_peer());
    claimed
        .iter()
        .any(|&(cr, cs)| (r.is_some() && r == cr) || (s.is_some() && s == cs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_core::plan::Region;
    use braid_core::transport::SlotBuf;
    use braid_core::types::MemKind;
    use std::sync::Arc;

    /// A link end that never moves anything itself and is alive unless
    /// told otherwise; as a receiving end, with a doorbell if given one
    /// (rung by whoever makes the data arrive), and counting its liveness
    /// checks if given a [`Liveness`].
    struct Idle(
        u32,
        Option<Arc<braid_core::transport::Doorbell>>,
        Option<Liveness>,
    );

    /// A receiving end's liveness checks so far, and whether they fail as
    /// a gone peer process would.
    struct Liveness {
        checks: Arc<std::sync::atomic::AtomicUsize>,
        dead: bool,
    }

    impl SendChannel for Idle {
        fn peer(&self) -> u32 {
            self.0
        }
        fn transport(&self) -> &'static str {
            "fake"
        }
        fn mem_kind(&self) -> MemKind {
            MemKind::Host
        }
        fn slot_bytes(&self) -> usize {
            4096
        }
        fn slots(&self) -> usize {
            1
        }
        fn poll_acquire(&mut self) -> braid_core::error::Result<Option<SlotBuf>> {
            Ok(None)
        }
        fn commit(&mut self, _: usize) -> braid_core::error::Result<()> {
            Ok(())
        }
        fn poll_drained(&mut self) -> braid_core::error::Result<bool> {
            Ok(true)
        }
        fn check_peer(&mut self) -> braid_core::error::Result<()> {
            Ok(())
        }
        fn abort(&mut self, _: &str) {}
    }

    impl RecvChannel for Idle {
        fn peer(&self) -> u32 {
            self.0
        }
        fn transport(&self) -> &'static str {
            "fake"
        }
        fn mem_kind(&self) -> MemKind {
            MemKind::Host
        }
        fn slot_bytes(&self) -> usize {
            4096
        }
        fn poll_peek(&mut self) -> braid_core::error::Result<Option<(SlotBuf, usize)>> {
            Ok(None)
        }
        fn release(&mut self) -> braid_core::error::Result<()> {
            Ok(())
        }
        fn check_peer(&mut self) -> braid_core::error::Result<()> {
            let Some(l) = &self.2 else { return Ok(()) };
            l.checks.fetch_add(1, Ordering::SeqCst);
            if l.dead {
                return Err(CoreError::Peer {
                    transport: "fake",
                    peer: self.0,
                    what: "process 4242 is gone".into(),
                    source: None,
                });
            }
            Ok(())
        }
        fn abort(&mut self, _: &str) {}
        fn arm_wake(&mut self) -> Option<WakeWord> {
            self.1.as_ref().map(|b| b.arm(false))
        }
        fn disarm_wake(&mut self) {
            if let Some(b) = &self.1 {
                b.disarm();
            }
        }
    }

    fn chans(p: u32) -> Channels {
        Channels {
            send: (0..p)
                .map(|q| Some(Box::new(Idle(q, None, None)) as Box<dyn SendChannel>))
                .collect(),
            recv: (0..p)
                .map(|q| Some(Box::new(Idle(q, None, None)) as Box<dyn RecvChannel>))
                .collect(),
            scratch: Vec::new(),
        }
    }

    fn region() -> Region {
        Region {
            buf: 0,
            offset: 0,
            len: 8,
        }
    }

    fn recv(from: u32) -> Op {
        Op::Recv {
            from,
            dst: region(),
        }
    }

    fn program(stages: Vec<Vec<Op>>) -> Program {
        let mut ops = Vec::new();
        let mut stage_ends = Vec::new();
        for s in stages {
            ops.extend(s);
            stage_ends.push(ops.len() as u32);
        }
        Program {
            ops,
            stage_ends,
            dtype: None,
            red_op: None,
            divisor: 1,
        }
    }

    /// Ops from a peer run only once that peer has "sent" (`ready[peer]`
    /// tries have passed); records the order ops ran in.
    struct Script {
        tries: Vec<u32>,
        ready: Vec<u32>,
        ran: Vec<u32>,
    }

    impl OpRunner for Script {
        fn try_op(&mut self, op: &Op, _: &mut Channels) -> Result<Option<Blocked>, CoreError> {
            let from = op.recv_peer().expect("recv");
            let t = &mut self.tries[from as usize];
            *t += 1;
            if *t <= self.ready[from as usize] {
                return Ok(Some(Blocked::data(from)));
            }
            self.ran.push(from);
            Ok(None)
        }
    }

    /// Every op runs once; within a stage, a blocked op does not hold up
    /// ops of other peers, but later ops of the same peer keep their order.
    #[test]
    fn stages_run_every_op_and_keep_each_peers_order() {
        let prog = program(vec![vec![recv(1), recv(2), recv(1)], vec![recv(2)]]);
        let policy = WaitPolicy::default();
        let abort = AtomicBool::new(false);
        let mut waiter = Waiter::new(&policy, &abort, None);
        let mut s = Script {
            tries: vec![0; 3],
            ready: vec![0, 3, 0],
            ran: Vec::new(),
        };
        run_stages(&prog, &mut chans(3), &mut waiter, &mut s).unwrap();
        assert_eq!(s.ran, [2, 1, 1, 2], "peer 2 ran while peer 1 was blocked");
    }

    /// A wait that never ends is published (peer, what, transport) for the
    /// hang dump while it lasts, and times out naming the peer.
    #[test]
    fn a_blocked_wait_is_published_then_times_out_naming_the_peer() {
        let prog = program(vec![vec![recv(2)]]);
        let progress = Progress::register(0, 3, "test".into());
        let p2 = progress.clone();
        let seen = Arc::new(std::sync::Mutex::new(None));
        let seen2 = seen.clone();
        let watcher = std::thread::spawn(move || {
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(5) {
                if let Some(w) = p2.snapshot().running.and_then(|r| r.waiting) {
                    *seen2.lock().unwrap() = Some((w.peer, w.what, w.transport));
                    return;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        let policy = WaitPolicy {
            timeout: Duration::from_millis(300),
            spin: 10,
            yields: 0,
            stall_warn: Duration::from_millis(100),
        };
        let abort = AtomicBool::new(false);
        progress.start("AllReduce", 7, 1, true);
        let mut waiter = Waiter::new(&policy, &abort, Some(&progress));
        let mut s = Script {
            tries: vec![0; 3],
            ready: vec![0, 0, u32::MAX],
            ran: Vec::new(),
        };
        let t0 = Instant::now();
        let e = run_stages(&prog, &mut chans(3), &mut waiter, &mut s).unwrap_err();
        let took = t0.elapsed();
        watcher.join().unwrap();
        match e {
            CoreError::Timeout {
                peer, waiting_for, ..
            } => {
                assert_eq!(peer, 2);
                assert_eq!(waiting_for, Wait::Data.describe());
            }
            other => panic!("expected a timeout, got {other}"),
        }
        assert!(took >= policy.timeout, "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        assert_eq!(
            *seen.lock().unwrap(),
            Some((2, Wait::Data.describe(), "fake"))
        );
    }

    /// Ops run once `ready` is set.
    struct WhenReady(Arc<AtomicBool>);

    impl OpRunner for WhenReady {
        fn try_op(&mut self, op: &Op, _: &mut Channels) -> Result<Option<Blocked>, CoreError> {
            let from = op.recv_peer().expect("recv");
            if self.0.load(Ordering::SeqCst) {
                Ok(None)
            } else {
                Ok(Some(Blocked::data(from)))
            }
        }
    }

    fn thread_cpu() -> Duration {
        // SAFETY: `ru` is a valid rusage to write; RUSAGE_THREAD is the
        // calling thread.
        let ru = unsafe {
            let mut ru: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_THREAD, &mut ru);
            ru
        };
        let t = |v: libc::timeval| Duration::new(v.tv_sec as u64, v.tv_usec as u32 * 1000);
        t(ru.ru_utime) + t(ru.ru_stime)
    }

    /// A wait on an end with a doorbell sleeps after its spin instead of
    /// polling (the waiting thread uses almost no CPU while the peer takes
    /// 300 ms), ends as soon as the peer rings, and leaves nobody armed.
    #[test]
    fn a_wait_sleeps_on_the_doorbell_and_ends_when_rung() {
        let prog = program(vec![vec![recv(1)]]);
        let ready = Arc::new(AtomicBool::new(false));
        let bell = Arc::new(braid_core::transport::Doorbell::new());
        let mut ch = chans(2);
        ch.recv[1] = Some(Box::new(Idle(1, Some(bell.clone()), None)));
        let (r2, b2) = (ready.clone(), bell.clone());
        let peer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            r2.store(true, Ordering::SeqCst);
            b2.ring(false);
            Instant::now()
        });
        let policy = WaitPolicy::default();
        let abort = AtomicBool::new(false);
        let mut waiter = Waiter::new(&policy, &abort, None);
        let cpu0 = thread_cpu();
        run_stages(&prog, &mut ch, &mut waiter, &mut WhenReady(ready)).unwrap();
        let done = Instant::now();
        let cpu = thread_cpu() - cpu0;
        eprintln!("waiting thread CPU: {cpu:?}");
        let rung = peer.join().unwrap();
        assert!(waiter.sleeps >= 1, "never slept");
        // Polling (yield, then 50 µs sleeps) used 36 ms here.
        assert!(
            cpu < Duration::from_millis(15),
            "the wait used {cpu:?} of CPU in 300 ms"
        );
        assert!(
            done.duration_since(rung) < Duration::from_millis(100),
            "woke {:?} after the ring",
            done.duration_since(rung)
        );
        assert_eq!(bell.armed(), 0, "left armed");
    }

    /// Where the policy says so (ranks sharing CPUs), a wait on an end with
    /// a doorbell yields that many times after its spin, polling after
    /// each, then sleeps on the doorbell; a background thread sleeps
    /// without yielding.
    #[test]
    fn a_wait_yields_its_budget_before_it_sleeps() {
        let wait = |background: bool| {
            std::thread::spawn(move || {
                set_background(background);
                let prog = program(vec![vec![recv(1)]]);
                let ready = Arc::new(AtomicBool::new(false));
                let bell = Arc::new(braid_core::transport::Doorbell::new());
                let mut ch = chans(2);
                ch.recv[1] = Some(Box::new(Idle(1, Some(bell.clone()), None)));
                let (r2, b2) = (ready.clone(), bell.clone());
                let peer = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(50));
                    r2.store(true, Ordering::SeqCst);
                    b2.ring(false);
                });
                let policy = WaitPolicy {
                    spin: 0,
                    yields: 5,
                    ..WaitPolicy::default()
                };
                let abort = AtomicBool::new(false);
                let mut waiter = Waiter::new(&policy, &abort, None);
                run_stages(&prog, &mut ch, &mut waiter, &mut WhenReady(ready)).unwrap();
                peer.join().unwrap();
                assert_eq!(bell.armed(), 0, "left armed");
                (waiter.yields, waiter.sleeps)
            })
            .join()
            .unwrap()
        };
        // Fewer only if this thread was held off the CPU past YIELD_MAX
        // (a loaded machine); never more.
        let (yields, sleeps) = wait(false);
        assert!((1..=5).contains(&yields), "caller: {yields} yields");
        assert!(sleeps >= 1, "caller never slept");
        let (yields, sleeps) = wait(true);
        assert_eq!(yields, 0, "background: {sleeps} sleeps");
        assert!(sleeps >= 1, "background never slept");
    }

    /// A background thread waiting on an end without a doorbell sleeps
    /// between polls from the start instead of yielding (a yielding thread
    /// keeps its share of a busy core); the caller's own thread yields for
    /// its first 20 ms, then sleeps too.
    #[test]
    fn background_waits_without_a_doorbell_sleep() {
        let wait = |background: bool| {
            std::thread::spawn(move || {
                set_background(background);
                let prog = program(vec![vec![recv(1)]]);
                let ready = Arc::new(AtomicBool::new(false));
                let r2 = ready.clone();
                let peer = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(60));
                    r2.store(true, Ordering::SeqCst);
                });
                let policy = WaitPolicy::default();
                let abort = AtomicBool::new(false);
                let mut waiter = Waiter::new(&policy, &abort, None);
                run_stages(&prog, &mut chans(2), &mut waiter, &mut WhenReady(ready)).unwrap();
                peer.join().unwrap();
                (waiter.yields, waiter.naps, waiter.sleeps)
            })
            .join()
            .unwrap()
        };
        let (yields, naps, sleeps) = wait(true);
        assert_eq!((yields, sleeps), (0, 0), "background: {naps} naps");
        assert!(naps > 10, "background: {naps} naps");
        let (yields, naps, _) = wait(false);
        assert!(
            yields > 0 && naps > 0,
            "caller: {yields} yields, {naps} naps"
        );
    }

    /// A stream's worker (a background thread) sleeps without spinning;
    /// the caller's own thread spins first.
    #[test]
    fn background_threads_do_not_spin() {
        let policy = WaitPolicy::default();
        let abort = AtomicBool::new(false);
        assert_eq!(Waiter::new(&policy, &abort, None).spin, policy.spin);
        let bg = std::thread::spawn(move || {
            set_background(true);
            let abort = AtomicBool::new(false);
            Waiter::new(&WaitPolicy::default(), &abort, None).spin
        });
        assert_eq!(bg.join().unwrap(), 0);
    }

    /// An abort makes a waiting stage runner fail promptly.
    #[test]
    fn an_abort_ends_the_wait() {
        let prog = program(vec![vec![recv(1)]]);
        let policy = WaitPolicy {
            spin: 10,
            ..WaitPolicy::default()
        };
        let abort = AtomicBool::new(true);
        let mut waiter = Waiter::new(&policy, &abort, None);
        let mut s = Script {
            tries: vec![0; 2],
            ready: vec![0, u32::MAX],
            ran: Vec::new(),
        };
        let t0 = Instant::now();
        let e = run_stages(&prog, &mut chans(2), &mut waiter, &mut s).unwrap_err();
        assert!(matches!(e, CoreError::Aborted(_)), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    /// Short waits do not check the peers' liveness (a system call or two
    /// each on shm): operations whose every wait lasts a few polls, each
    /// with a waiter of its own as the engine makes them, run without a
    /// check. When a wait lasts, the peer is checked, and a dead one ends
    /// it with the peer's error long before the timeout.
    #[test]
    fn liveness_is_checked_when_a_wait_lasts_not_at_every_wait() {
        let checks = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut ch = chans(2);
        ch.recv[1] = Some(Box::new(Idle(
            1,
            None,
            Some(Liveness {
                checks: checks.clone(),
                dead: false,
            }),
        )));
        let policy = WaitPolicy {
            spin: 0,
            yields: 0,
            ..WaitPolicy::default()
        };
        let abort = AtomicBool::new(false);
        let ops = 100;
        for _ in 0..ops {
            let prog = program(vec![vec![recv(1)]]);
            let mut waiter = Waiter::new(&policy, &abort, None);
            let mut s = Script {
                tries: vec![0; 2],
                ready: vec![0, 2],
                ran: Vec::new(),
            };
            run_stages(&prog, &mut ch, &mut waiter, &mut s).unwrap();
            assert_eq!(s.ran, [1]);
        }
        // Checking at each operation's first wait made 100. A loaded
        // machine may stretch a few waits past CHECK_EVERY.
        let n = checks.load(Ordering::SeqCst);
        assert!(
            n <= ops / 10,
            "{n} liveness checks in {ops} short operations"
        );

        ch.recv[1] = Some(Box::new(Idle(
            1,
            None,
            Some(Liveness {
                checks: checks.clone(),
                dead: true,
            }),
        )));
        let policy = WaitPolicy {
            timeout: Duration::from_secs(20),
            ..policy
        };
        let prog = program(vec![vec![recv(1)]]);
        let mut waiter = Waiter::new(&policy, &abort, None);
        let mut s = Script {
            tries: vec![0; 2],
            ready: vec![0, u32::MAX],
            ran: Vec::new(),
        };
        let t0 = Instant::now();
        let e = run_stages(&prog, &mut ch, &mut waiter, &mut s).unwrap_err();
        assert!(
            matches!(e, CoreError::Peer { peer: 1, .. }),
            "expected the dead peer's error, got {e}"
        );
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }
}
