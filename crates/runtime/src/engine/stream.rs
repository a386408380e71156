//! The device engine's stream mode: GPU-side per-step synchronisation.
//!
//! A collective is translated by [`braid_cuda::schedule`] into one in-order
//! list of commands and put, whole, on the caller's stream: copies and
//! reduction kernels, and between them `cuStreamWaitValue32` /
//! `cuStreamWriteValue32` on the two counters that sit after each device
//! link's slot ring ([`DeviceRing`]). The GPU waits for a peer's piece, and
//! a peer's GPU for a free slot, without any host thread per step; the
//! caller's thread returns as soon as the commands are queued.
//!
//! Collectives of one communicator run in the order they were issued, also
//! when issued on different streams: each waits for the previous one's
//! completion event (as NCCL orders a communicator's operations), because
//! piece numbers on a link run on from one collective to the next.
//!
//! No hangs: a watchdog thread per communicator owns the links' control
//! channels (shared-memory FIFOs used here only for liveness and abort
//! reasons). While work is pending it checks the peers every 10 ms and
//! fails the communicator when a peer aborted, when a dead or closed peer
//! still owes pieces to queued work after [`DEAD_PEER_GRACE`], when
//! [`CudaComm::abort`] was
//! called, or when nothing completed for `BRAID_TIMEOUT` (naming the peer
//! whose counter is behind). Failing publishes the reason to every peer and
//! then *rescues* this rank's stream: on a side stream it writes every
//! counter this rank's commands wait on to the value that releases all of
//! them, again and again until the stream drains — so the caller's stream
//! never hangs; the data of the operations in flight is undefined, and the
//! error comes back from [`CudaComm::async_error`],
//! [`CudaComm::synchronize`] and every later call. A peer's abort seen while
//! idle also breaks the communicator (its rescue may have fed this rank
//! undefined pieces).
//!
//! [`CudaComm::abort`]: crate::CudaComm::abort
//! [`CudaComm::async_error`]: crate::CudaComm::async_error
//! [`CudaComm::synchronize`]: crate::CudaComm::synchronize

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use braid_core::plan::Program;
use braid_core::transport::DeviceRing;
use braid_core::CoreError;
use braid_cuda::schedule::{release_values, Cmd, Cursor, Links, Loc};
use braid_cuda::{CudaStream, Device, DeviceBuffer, HostFlag, Kernels};

use super::{Channels, WaitPolicy};

/// How long a dead or closed peer may stand in the way of pending work
/// before the communicator fails (a peer that finished and exited normally
/// never does: everything it sends was posted before it finished).
pub(crate) const DEAD_PEER_GRACE: Duration = Duration::from_secs(5);

/// A device buffer as the stream engine sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DevBuf {
    pub ptr: u64,
    pub len: usize,
}

/// Every link of this rank as a device ring.
#[derive(Clone, Debug)]
pub(crate) struct Rings {
    pub links: Links,
    pub out: Vec<Option<DeviceRing>>,
    pub inc: Vec<Option<DeviceRing>>,
}

impl Rings {
    /// The rings of every link in `chans`, or `None` if some link to another
    /// rank is not a device ring (e.g. staged through host memory).
    pub(crate) fn of(chans: &Channels, rank: u32, nranks: u32) -> Option<Rings> {
        let mut out = Vec::with_capacity(nranks as usize);
        let mut inc = Vec::with_capacity(nranks as usize);
        for q in 0..nranks as usize {
            if q as u32 == rank {
                out.push(None);
                inc.push(None);
                continue;
            }
            out.push(Some(chans.send.get(q)?.as_ref()?.device_ring()?));
            inc.push(Some(chans.recv.get(q)?.as_ref()?.device_ring()?));
        }
        let geo = |v: &Vec<Option<DeviceRing>>| {
            v.iter()
                .map(|r| r.map(|r| (r.slots as u32, r.slot_bytes)))
                .collect()
        };
        Some(Rings {
            links: Links {
                out: geo(&out),
                inc: geo(&inc),
            },
            out,
            inc,
        })
    }

    fn ring(&self, out: bool, peer: u32) -> Result<DeviceRing, CoreError> {
        let side = if out { &self.out } else { &self.inc };
        side.get(peer as usize)
            .copied()
            .flatten()
            .ok_or_else(|| CoreError::InvalidArgument(format!("no device ring for rank {peer}")))
    }
}

/// What the caller's side and the watchdog share.
pub(crate) struct Shared {
    /// Sequence number of the last collective queued.
    pub issued: AtomicU32,
    /// Counter values that release every wait queued so far, per peer.
    pub release: Mutex<Vec<(u32, u32)>>,
    /// The caller's buffers of collectives not yet complete.
    pub keep: Mutex<VecDeque<(u32, Vec<Arc<DeviceBuffer>>)>>,
    /// Set when the communicator is dropped.
    pub shutdown: AtomicBool,
}

impl Shared {
    pub(crate) fn new(nranks: u32) -> Shared {
        Shared {
            issued: AtomicU32::new(0),
            release: Mutex::new(vec![(0, 0); nranks as usize]),
            keep: Mutex::new(VecDeque::new()),
            shutdown: AtomicBool::new(false),
        }
    }

    /// Record what `cur` says after a collective was queued.
    pub(crate) fn queued(&self, seq: u32, cur: &Cursor, keep: Vec<Arc<DeviceBuffer>>) {
        if let Ok(mut r) = self.release.lock() {
            *r = release_values(cur);
        }
        if let Ok(mut k) = self.keep.lock() {
            k.push_back((seq, keep));
        }
        self.issued.store(seq, Ordering::Release);
    }
}

/// Read a ring counter through the side stream (`None` if that fails).
fn read_counter(side: Option<&CudaStream>, addr: u64) -> Option<u32> {
    let side = side?;
    let mut b = [0u8; 4];
    // SAFETY: `addr` is a counter word of a live ring; `b` holds 4 bytes and
    // the side stream is synchronised before `b` is read.
    unsafe { side.copy_dtoh(b.as_mut_ptr(), addr, 4) }.ok()?;
    side.synchronize().ok()?;
    Some(u32::from_le_bytes(b))
}

/// `a` is at or past `b` (wrap-around aware).
fn reached(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) >= 0
}

fn address(bufs: &[DevBuf], rings: &Rings, l: Loc, len: usize) -> Result<u64, CoreError> {
    match l {
        Loc::Buf { buf, offset } => {
            let b = bufs.get(buf as usize).ok_or_else(|| {
                CoreError::InvalidArgument(format!("schedule names buffer {buf}"))
            })?;
            match offset.checked_add(len) {
                Some(end) if end <= b.len => Ok(b.ptr + offset as u64),
                _ => Err(CoreError::InvalidArgument(format!(
                    "region {offset}+{len} outside device buffer {buf} of {} bytes",
                    b.len
                ))),
            }
        }
        Loc::In { peer, slot } | Loc::Out { peer, slot } => {
            let r = rings.ring(matches!(l, Loc::Out { .. }), peer)?;
            if slot as usize >= r.slots || len > r.slot_bytes {
                return Err(CoreError::InvalidArgument(format!(
                    "slot {slot} ({len} bytes) outside the ring of rank {peer} ({} x {} bytes)",
                    r.slots, r.slot_bytes
                )));
            }
            Ok(r.base + slot as u64 * r.slot_bytes as u64)
        }
    }
}

/// Queue `cmds` on `stream`. Every address is checked before it is used.
pub(crate) fn issue(
    cmds: &[Cmd],
    prog: &Program,
    bufs: &[DevBuf],
    rings: &Rings,
    kernels: &Kernels,
    stream: &CudaStream,
) -> Result<(), CoreError> {
    let cuda = CoreError::from;
    let dt_op = || {
        prog.dtype.zip(prog.red_op).ok_or_else(|| {
            CoreError::InvalidArgument("a reduction in a program without datatype".into())
        })
    };
    for cmd in cmds {
        // SAFETY (all arms): every address comes from `address`, which
        // checks it against a live caller buffer (kept alive by the
        // communicator until the stream passed this collective) or a device
        // ring whose memory lives as long as the links (owned by the
        // watchdog, which outlives all queued work). Counter addresses are
        // 4-byte aligned words of those rings. Reductions see whole
        // elements at aligned offsets (allocations are 256-byte aligned,
        // plans cut at element boundaries); `dst` equals an input or is
        // disjoint from it.
        match *cmd {
            Cmd::WaitPosted { from, value } => {
                let at = rings.ring(false, from)?.posted;
                // SAFETY: see above.
                unsafe { stream.wait_value_geq_at(at, value) }.map_err(cuda)?
            }
            Cmd::WaitFreed { to, value } => {
                let at = rings.ring(true, to)?.freed;
                // SAFETY: see above.
                unsafe { stream.wait_value_geq_at(at, value) }.map_err(cuda)?
            }
            Cmd::Post { to, value } => {
                let at = rings.ring(true, to)?.posted;
                // SAFETY: see above.
                unsafe { stream.write_value(at, value) }.map_err(cuda)?
            }
            Cmd::Free { from, value } => {
                let at = rings.ring(false, from)?.freed;
                // SAFETY: see above.
                unsafe { stream.write_value(at, value) }.map_err(cuda)?
            }
            Cmd::Copy { dst, src, len } => {
                let (d, s) = (
                    address(bufs, rings, dst, len)?,
                    address(bufs, rings, src, len)?,
                );
                // SAFETY: see above.
                unsafe { stream.copy_dtod(d, s, len) }.map_err(cuda)?
            }
            Cmd::Reduce { dst, a, b, len } => {
                let (dt, op) = dt_op()?;
                let d = address(bufs, rings, dst, len)?;
                let x = address(bufs, rings, a, len)?;
                let y = address(bufs, rings, b, len)?;
                // SAFETY: see above.
                unsafe { kernels.reduce(stream, dt, op, d, x, y, len / dt.size()) }.map_err(cuda)?
            }
            Cmd::Divide { dst, len } => {
                let (dt, _) = dt_op()?;
                let d = address(bufs, rings, dst, len)?;
                // SAFETY: see above.
                unsafe { kernels.divide(stream, dt, d, len / dt.size(), prog.divisor) }
                    .map_err(cuda)?
            }
        }
    }
    Ok(())
}

/// What the watchdog sees at one tick (gathered by [`Watchdog::run`]).
#[derive(Clone, Debug, Default)]
pub(crate) struct Obs {
    /// Sequence number of the last collective queued.
    pub issued: u32,
    /// Sequence number the stream has completed.
    pub done: u32,
    /// The communicator is being dropped.
    pub shutdown: bool,
    /// The communicator already failed.
    pub broken: bool,
    /// `CudaComm::abort` was called.
    pub aborted: bool,
    /// A peer whose link reported a problem at this tick.
    pub peer: Option<PeerObs>,
}

/// A peer's problem.
#[derive(Clone, Debug, Default)]
pub(crate) struct PeerObs {
    pub peer: u32,
    /// It gave up and said why (not merely closed or gone).
    pub aborted: bool,
    /// Queued work still waits for pieces from it.
    pub owes_data: bool,
    /// The error, for the message.
    pub what: String,
}

/// The watchdog's time limits.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// No completed collective for this long while work is pending: fail.
    pub timeout: Duration,
    /// A dead or closed peer that owes data for this long: fail.
    pub grace: Duration,
}

/// Why the communicator fails.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The caller aborted.
    Aborted,
    /// A peer aborted, or died / left while owing data (the message).
    Peer(String),
    /// Nothing completed for this long (the caller names the peer).
    Stalled(Duration),
}

/// What the watchdog does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Nothing to do for a while.
    Sleep(Duration),
    /// Mark the communicator broken, tell the peers.
    Fail(Failure),
    /// Broken with work pending: release the stream's waits (`give_up`:
    /// the stream has not drained for long; say so, once).
    Rescue { give_up: bool },
    /// Dropped and nothing pending: the thread ends.
    Exit,
}

/// The watchdog's decisions as a pure state machine (no clock, no I/O:
/// `now` and the observations come in, a verdict goes out), so the rules
/// are tested without a GPU.
#[derive(Clone, Debug)]
pub(crate) struct Watch {
    last_done: u32,
    /// Since when no collective completed while work was pending.
    since: Instant,
    /// A dead or closed peer owing data, and since when.
    in_the_way: Option<(u32, Instant, String)>,
    rescue_since: Option<Instant>,
    gave_up: bool,
}

impl Watch {
    pub(crate) fn new(now: Instant, done: u32) -> Watch {
        Watch {
            last_done: done,
            since: now,
            in_the_way: None,
            rescue_since: None,
            gave_up: false,
        }
    }

    pub(crate) fn step(&mut self, now: Instant, o: &Obs, lim: Limits) -> Verdict {
        let pending = !reached(o.done, o.issued);
        if o.done != self.last_done || !pending {
            self.last_done = o.done;
            self.since = now;
            self.in_the_way = None;
        }
        if !pending {
            self.rescue_since = None;
        }
        if o.broken {
            if !pending {
                return if o.shutdown {
                    Verdict::Exit
                } else {
                    Verdict::Sleep(Duration::from_millis(5))
                };
            }
            let t0 = *self.rescue_since.get_or_insert(now);
            let late = now.duration_since(t0) > lim.timeout.max(Duration::from_secs(10));
            if late && o.shutdown {
                return Verdict::Exit;
            }
            let give_up = late && !self.gave_up;
            self.gave_up |= late;
            return Verdict::Rescue { give_up };
        }
        if !pending && o.shutdown {
            return Verdict::Exit;
        }
        if o.aborted {
            return Verdict::Fail(Failure::Aborted);
        }
        if let Some(p) = &o.peer {
            if p.aborted {
                return Verdict::Fail(Failure::Peer(p.what.clone()));
            }
            if pending && p.owes_data {
                let t0 = match &self.in_the_way {
                    Some((q, t, _)) if *q == p.peer => *t,
                    _ => now,
                };
                self.in_the_way = Some((p.peer, t0, p.what.clone()));
            }
        }
        if let Some((_, t0, what)) = &self.in_the_way {
            if now.duration_since(*t0) >= lim.grace {
                return Verdict::Fail(Failure::Peer(what.clone()));
            }
        }
        if pending && now.duration_since(self.since) >= lim.timeout {
            return Verdict::Fail(Failure::Stalled(now.duration_since(self.since)));
        }
        Verdict::Sleep(if pending {
            Duration::from_micros(200)
        } else {
            Duration::from_millis(2)
        })
    }
}

/// The watchdog thread's state.
pub(crate) struct Watchdog {
    pub rank: u32,
    pub dev: Arc<Device>,
    pub rings: Rings,
    pub chans: Channels,
    pub flag: Arc<HostFlag>,
    pub shared: Arc<Shared>,
    pub policy: WaitPolicy,
    pub abort: Arc<AtomicBool>,
    pub broken: Arc<Mutex<Option<String>>>,
}

impl Watchdog {
    pub(crate) fn run(mut self) {
        let rescue = match CudaStream::new(&self.dev) {
            Ok(s) => Some(s),
            Err(e) => {
                self.fail(format!(
                    "rank {}: cannot create the watchdog's stream: {e}",
                    self.rank
                ));
                None
            }
        };
        let mut w = Watch::new(Instant::now(), self.flag.load());
        let limits = Limits {
            timeout: self.policy.timeout,
            grace: DEAD_PEER_GRACE.min(self.policy.timeout),
        };
        let mut last_check = Instant::now();
        loop {
            let now = Instant::now();
            let done = self.flag.load();
            if let Ok(mut k) = self.shared.keep.lock() {
                while k.front().is_some_and(|(s, _)| reached(done, *s)) {
                    k.pop_front();
                }
            }
            let mut obs = Obs {
                issued: self.shared.issued.load(Ordering::Acquire),
                done,
                shutdown: self.shared.shutdown.load(Ordering::Acquire),
                broken: self.broken(),
                aborted: self.abort.load(Ordering::Relaxed),
                peer: None,
            };
            if !obs.broken && now.duration_since(last_check) >= Duration::from_millis(10) {
                last_check = now;
                obs.peer = self.check_peers().map(|(peer, e)| {
                    let aborted = matches!(&e, CoreError::PeerAborted { reason, .. }
                        if !reason.ends_with("closed its end"));
                    PeerObs {
                        peer,
                        aborted,
                        owes_data: !aborted
                            && !reached(obs.done, obs.issued)
                            && self.needs_data_from(rescue.as_ref(), peer),
                        what: e.to_string(),
                    }
                });
            }
            match w.step(now, &obs, limits) {
                Verdict::Exit => break,
                Verdict::Sleep(d) => std::thread::sleep(d),
                Verdict::Rescue { give_up } => {
                    if give_up {
                        tracing::error!(
                            rank = self.rank,
                            "braid: the device stream did not drain after the communicator failed (it may wait for the caller's own work); giving up on it"
                        );
                    }
                    if let Some(r) = &rescue {
                        self.rescue(r);
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Verdict::Fail(f) => {
                    let why = match f {
                        Failure::Aborted => "the device communicator was aborted".to_string(),
                        Failure::Peer(what) => what,
                        Failure::Stalled(after) => self.stalled_on(rescue.as_ref(), after),
                    };
                    // From the next tick on, `broken` makes it rescue.
                    self.fail(format!("rank {}: {why}", self.rank));
                }
            }
        }
    }

    fn broken(&self) -> bool {
        self.broken.lock().map(|b| b.is_some()).unwrap_or(true)
    }

    /// Mark the communicator broken (first reason wins) and tell the peers.
    fn fail(&mut self, msg: String) {
        tracing::error!("braid: device communicator failed: {msg}");
        self.chans.abort_all(&msg);
        if let Ok(mut b) = self.broken.lock() {
            b.get_or_insert(msg);
        }
    }

    /// The first peer whose link reports a problem.
    fn check_peers(&mut self) -> Option<(u32, CoreError)> {
        for c in self.chans.recv.iter_mut().flatten() {
            if let Err(e) = c.check_peer() {
                return Some((c.peer(), e));
            }
        }
        for c in self.chans.send.iter_mut().flatten() {
            if let Err(e) = c.check_peer() {
                return Some((c.peer(), e));
            }
        }
        None
    }

    /// Write, on the side stream, every counter our stream waits on to the
    /// value that releases all queued waits.
    fn rescue(&self, side: &CudaStream) {
        let release = match self.shared.release.lock() {
            Ok(r) => r.clone(),
            Err(_) => return,
        };
        for (q, (posted, freed)) in release.into_iter().enumerate() {
            if let (Some(i), Some(o)) = (self.rings.inc[q], self.rings.out[q]) {
                // SAFETY: counter words of live rings (the channels are
                // owned by this watchdog).
                let _ = unsafe { side.write_value(i.posted, posted) };
                // SAFETY: as above.
                let _ = unsafe { side.write_value(o.freed, freed) };
            }
        }
        let _ = side.synchronize();
    }

    /// Whether our queued work still waits for pieces from `peer`: its
    /// `posted` counter (in our memory) is behind what we queued. True when
    /// the counter cannot be read.
    fn needs_data_from(&self, side: Option<&CudaStream>, peer: u32) -> bool {
        let want = match self.shared.release.lock() {
            Ok(r) => r.get(peer as usize).map(|v| v.0),
            Err(_) => None,
        };
        match (self.rings.inc.get(peer as usize).copied().flatten(), want) {
            (Some(i), Some(want)) => read_counter(side, i.posted).is_none_or(|v| !reached(v, want)),
            _ => true,
        }
    }

    /// Which peer a stalled stream waits for: the first whose `posted`
    /// counter (in this rank's memory) is behind what was queued, else the
    /// first whose `freed` counter is.
    fn stalled_on(&self, side: Option<&CudaStream>, after: Duration) -> String {
        let release = self
            .shared
            .release
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default();
        let read = |addr: u64| read_counter(side, addr);
        let timeout = |peer: u32, transport: &'static str, waiting_for: &'static str| {
            CoreError::Timeout {
                transport,
                peer,
                waiting_for,
                after,
            }
            .to_string()
        };
        for (q, &(posted, _)) in release.iter().enumerate() {
            if let Some(i) = self.rings.inc[q] {
                if read(i.posted).is_some_and(|v| !reached(v, posted)) {
                    let t = self.chans.recv[q]
                        .as_ref()
                        .map_or("cuda", |c| c.transport());
                    return timeout(q as u32, t, "a piece of data (device stream)");
                }
            }
        }
        for (q, &(_, freed)) in release.iter().enumerate() {
            if let Some(o) = self.rings.out[q] {
                let need = freed.wrapping_sub(o.slots as u32);
                if read(o.freed).is_some_and(|v| !reached(v, need)) {
                    let t = self.chans.send[q]
                        .as_ref()
                        .map_or("cuda", |c| c.transport());
                    return timeout(q as u32, t, "a free slot (device stream)");
                }
            }
        }
        format!(
            "the device stream made no progress for {after:?} (no peer is behind: the stream may be waiting for earlier work of the caller); raise BRAID_TIMEOUT if that work is only slow"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_core::transport::{RecvChannel, SendChannel, SlotBuf};
    use braid_core::types::MemKind;

    /// A channel that only reports a device ring (or none).
    struct Fake {
        peer: u32,
        ring: Option<DeviceRing>,
    }

    impl SendChannel for Fake {
        fn peer(&self) -> u32 {
            self.peer
        }
        fn transport(&self) -> &'static str {
            "fake"
        }
        fn mem_kind(&self) -> MemKind {
            MemKind::Device(0)
        }
        fn slot_bytes(&self) -> usize {
            4096
        }
        fn slots(&self) -> usize {
            4
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
        fn device_ring(&self) -> Option<DeviceRing> {
            self.ring
        }
    }

    impl RecvChannel for Fake {
        fn peer(&self) -> u32 {
            self.peer
        }
        fn transport(&self) -> &'static str {
            "fake"
        }
        fn mem_kind(&self) -> MemKind {
            MemKind::Device(0)
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
            Ok(())
        }
        fn abort(&mut self, _: &str) {}
        fn device_ring(&self) -> Option<DeviceRing> {
            self.ring
        }
    }

    fn ring(base: u64, slots: usize) -> DeviceRing {
        DeviceRing {
            base,
            slot_bytes: 4096,
            slots,
            posted: base + 4096 * slots as u64,
            freed: base + 4096 * slots as u64 + 128,
        }
    }

    fn chans(rank: u32, p: u32, staged: Option<u32>) -> Channels {
        let mk = |q: u32, base: u64| {
            (q != rank).then(|| Fake {
                peer: q,
                ring: (staged != Some(q))
                    .then(|| ring(base + q as u64 * 0x10_0000, 2 + q as usize)),
            })
        };
        Channels {
            send: (0..p)
                .map(|q| mk(q, 0x1000_0000).map(|c| Box::new(c) as Box<dyn SendChannel>))
                .collect(),
            recv: (0..p)
                .map(|q| mk(q, 0x2000_0000).map(|c| Box::new(c) as Box<dyn RecvChannel>))
                .collect(),
            scratch: Vec::new(),
        }
    }

    #[test]
    fn rings_take_every_links_geometry_or_none_at_all() {
        let r = Rings::of(&chans(1, 3, None), 1, 3).expect("all links are rings");
        assert_eq!(r.links.out, vec![Some((2, 4096)), None, Some((4, 4096))]);
        assert_eq!(r.links.inc, r.links.out);
        assert_eq!(r.out[2].unwrap().base, 0x1000_0000 + 2 * 0x10_0000);
        assert_eq!(r.inc[0].unwrap().base, 0x2000_0000);
        // One link staged through host memory: no stream mode.
        assert!(Rings::of(&chans(1, 3, Some(2)), 1, 3).is_none());
    }

    #[test]
    fn addresses_are_checked_against_buffers_and_rings() {
        let r = Rings::of(&chans(0, 3, None), 0, 3).unwrap();
        let bufs = [
            DevBuf {
                ptr: 0x9000,
                len: 100,
            },
            DevBuf {
                ptr: 0xA000,
                len: 8,
            },
        ];
        let at = |l, n| address(&bufs, &r, l, n);
        assert_eq!(
            at(Loc::Buf { buf: 0, offset: 60 }, 40).unwrap(),
            0x9000 + 60
        );
        assert!(at(Loc::Buf { buf: 0, offset: 61 }, 40).is_err());
        assert!(at(Loc::Buf { buf: 2, offset: 0 }, 1).is_err());
        assert!(at(
            Loc::Buf {
                buf: 1,
                offset: usize::MAX
            },
            2
        )
        .is_err());
        // Rank 2's rings have 4 slots of 4096 bytes.
        assert_eq!(
            at(Loc::Out { peer: 2, slot: 3 }, 4096).unwrap(),
            0x1000_0000 + 2 * 0x10_0000 + 3 * 4096
        );
        assert_eq!(
            at(Loc::In { peer: 1, slot: 2 }, 10).unwrap(),
            0x2000_0000 + 0x10_0000 + 2 * 4096
        );
        assert!(
            at(Loc::In { peer: 1, slot: 3 }, 10).is_err(),
            "rank 1 has 3 slots"
        );
        assert!(at(Loc::Out { peer: 2, slot: 0 }, 4097).is_err());
        assert!(
            at(Loc::Out { peer: 0, slot: 0 }, 1).is_err(),
            "no ring to self"
        );
    }

    const LIM: Limits = Limits {
        timeout: Duration::from_secs(30),
        grace: Duration::from_secs(5),
    };

    fn obs(issued: u32, done: u32) -> Obs {
        Obs {
            issued,
            done,
            ..Obs::default()
        }
    }

    fn gone(peer: u32, owes_data: bool) -> Option<PeerObs> {
        Some(PeerObs {
            peer,
            aborted: false,
            owes_data,
            what: format!("rank {peer} is gone"),
        })
    }

    #[test]
    fn a_stalled_stream_fails_after_the_timeout_and_progress_resets_it() {
        let t0 = Instant::now();
        let s = |secs: u64| t0 + Duration::from_secs(secs);
        let mut w = Watch::new(t0, 0);
        assert!(matches!(w.step(s(0), &obs(1, 0), LIM), Verdict::Sleep(_)));
        assert!(matches!(w.step(s(29), &obs(2, 0), LIM), Verdict::Sleep(_)));
        // One collective completed at 29 s: the clock starts again.
        assert!(matches!(w.step(s(29), &obs(2, 1), LIM), Verdict::Sleep(_)));
        assert!(matches!(w.step(s(58), &obs(2, 1), LIM), Verdict::Sleep(_)));
        assert_eq!(
            w.step(s(60), &obs(2, 1), LIM),
            Verdict::Fail(Failure::Stalled(Duration::from_secs(31)))
        );
        // Idle for hours: never a timeout.
        let mut w = Watch::new(t0, 7);
        assert!(matches!(
            w.step(s(99_999), &obs(7, 7), LIM),
            Verdict::Sleep(_)
        ));
        // Sequence numbers wrap.
        let mut w = Watch::new(t0, u32::MAX);
        assert!(matches!(
            w.step(s(1), &obs(1, u32::MAX), LIM),
            Verdict::Sleep(_)
        ));
        assert!(matches!(
            w.step(s(40), &obs(1, u32::MAX), LIM),
            Verdict::Fail(_)
        ));
        assert!(matches!(w.step(s(41), &obs(1, 1), LIM), Verdict::Sleep(_)));
    }

    #[test]
    fn a_gone_peer_fails_only_while_it_owes_data() {
        let t0 = Instant::now();
        let s = |secs: u64| t0 + Duration::from_secs(secs);
        let mut w = Watch::new(t0, 0);
        // Pending, the peer left but everything it sends us was posted.
        let mut o = obs(3, 2);
        o.peer = gone(1, false);
        for t in [0, 4, 6, 20] {
            assert!(matches!(w.step(s(t), &o, LIM), Verdict::Sleep(_)), "{t}");
        }
        // It owes us pieces: an error naming it after the grace period.
        let mut w = Watch::new(t0, 0);
        o.peer = gone(1, true);
        assert!(matches!(w.step(s(0), &o, LIM), Verdict::Sleep(_)));
        assert!(matches!(w.step(s(4), &o, LIM), Verdict::Sleep(_)));
        assert_eq!(
            w.step(s(5), &o, LIM),
            Verdict::Fail(Failure::Peer("rank 1 is gone".into()))
        );
        // Idle: a peer that left is not an error.
        let mut w = Watch::new(t0, 3);
        let mut o = obs(3, 3);
        o.peer = gone(2, true);
        assert!(matches!(w.step(s(100), &o, LIM), Verdict::Sleep(_)));
    }

    #[test]
    fn aborts_fail_at_once_even_when_idle() {
        let t0 = Instant::now();
        let mut w = Watch::new(t0, 4);
        let mut o = obs(4, 4);
        o.peer = Some(PeerObs {
            peer: 2,
            aborted: true,
            owes_data: false,
            what: "rank 2 aborted: out of memory".into(),
        });
        assert_eq!(
            w.step(t0, &o, LIM),
            Verdict::Fail(Failure::Peer("rank 2 aborted: out of memory".into()))
        );
        let mut o = obs(5, 4);
        o.aborted = true;
        assert_eq!(w.step(t0, &o, LIM), Verdict::Fail(Failure::Aborted));
    }

    #[test]
    fn broken_rescues_until_drained_then_exits_on_drop() {
        let t0 = Instant::now();
        let s = |secs: u64| t0 + Duration::from_secs(secs);
        let mut w = Watch::new(t0, 0);
        let mut o = obs(3, 1);
        o.broken = true;
        assert_eq!(w.step(s(0), &o, LIM), Verdict::Rescue { give_up: false });
        assert_eq!(w.step(s(30), &o, LIM), Verdict::Rescue { give_up: false });
        // Not drained after the timeout: said once, the rescue goes on.
        assert_eq!(w.step(s(31), &o, LIM), Verdict::Rescue { give_up: true });
        assert_eq!(w.step(s(32), &o, LIM), Verdict::Rescue { give_up: false });
        // Dropped while still stuck: the thread ends.
        o.shutdown = true;
        assert_eq!(w.step(s(33), &o, LIM), Verdict::Exit);
        // Drained: waits for the drop, then ends.
        let mut w = Watch::new(t0, 0);
        let mut o = obs(3, 3);
        o.broken = true;
        assert!(matches!(w.step(s(1), &o, LIM), Verdict::Sleep(_)));
        o.shutdown = true;
        assert_eq!(w.step(s(2), &o, LIM), Verdict::Exit);
        // Dropped with work pending and nothing wrong: it waits.
        let mut w = Watch::new(t0, 0);
        let mut o = obs(2, 1);
        o.shutdown = true;
        assert!(matches!(w.step(s(1), &o, LIM), Verdict::Sleep(_)));
        o.done = 2;
        assert_eq!(w.step(s(2), &o, LIM), Verdict::Exit);
    }

    #[test]
    fn completion_is_wrap_around_aware() {
        assert!(reached(5, 5));
        assert!(reached(6, 5));
        assert!(!reached(4, 5));
        assert!(reached(2, u32::MAX - 1));
        assert!(!reached(u32::MAX - 1, 2));
    }

    #[test]
    fn queued_publishes_release_values_and_keeps_buffers() {
        let s = Shared::new(3);
        let mut cur = Cursor::new(3);
        cur.sent = vec![0, 7, 9];
        cur.recvd = vec![0, 5, 4];
        s.queued(12, &cur, Vec::new());
        assert_eq!(s.issued.load(Ordering::Acquire), 12);
        assert_eq!(*s.release.lock().unwrap(), vec![(0, 0), (5, 7), (4, 9)]);
        assert_eq!(s.keep.lock().unwrap().len(), 1);
    }
}
