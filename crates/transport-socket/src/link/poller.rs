//! The progress thread: one per process for every socket of every link
//! (`braid-sock-poll`), so a rank's threads do not grow with its peers.
//!
//! Each link end registers its sockets with a [`Source`] that does,
//! without blocking, whatever its sockets allow: write queued pieces, read
//! frames into slots, read credits and control frames. The engine does the
//! same inline while it polls (writes on commit, reads while it waits), so
//! the thread only carries on what nobody waits for; it sleeps in
//! `epoll_wait` otherwise.
//!
//! Interest is one-shot ([`Poller::arm`]): a socket is watched only while
//! its owner wants the thread's help (a data socket to read between frames,
//! a queue of pieces the socket did not take), and each event disarms it
//! until the owner arms it again. So a socket whose payload the engine is
//! reading itself, or whose queue is empty, costs the thread no wake-up per
//! arriving packet or freed buffer (on two busy cores, those wake-ups and
//! their lock traffic took a 64 MiB AllReduce between two hosts from about
//! 2 to 0.2 GB/s). Every socket's state is behind its own lock, taken by
//! whichever side works on it; arming is level-triggered, so readiness
//! that arrived while nobody watched is reported at once.
//!
//! The thread starts with the first registered link and ends (joined) when
//! the last [`Poller`] handle is dropped.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};

use braid_core::error::{CoreError, Result};

use super::lock;
use crate::NAME;

/// What the progress thread drives: one link end.
pub(super) trait Source: Send + Sync {
    /// Socket `idx` of this end may have become readable or writable (or
    /// its peer hung up): do what it allows without blocking.
    fn ready(&self, idx: usize);
    /// Writes what waits in this end's queues as far as its sockets take it
    /// now (an engine that waits keeps the sockets full, instead of the
    /// progress thread refilling them only once they are half empty).
    fn poke(&self) {}
}

/// The token of the wake-up descriptor.
const WAKE: u64 = u64::MAX;
/// Every socket's interest is one-shot (and hang-ups are always reported).
const ONESHOT: EpollFlags = EpollFlags::EPOLLONESHOT.union(EpollFlags::EPOLLRDHUP);
/// Read interest.
pub(super) const IN: EpollFlags = EpollFlags::EPOLLIN;
/// Write interest.
pub(super) const OUT: EpollFlags = EpollFlags::EPOLLOUT;
/// Sockets of one source at most (data sockets and the control socket).
const MAX_IDX: u64 = 256;

struct Registry {
    sources: Mutex<HashMap<u64, Arc<dyn Source>>>,
    stop: AtomicBool,
}

/// A handle on the progress thread; the last one dropped stops it.
pub(crate) struct Poller {
    epoll: Arc<Epoll>,
    wake: Arc<EventFd>,
    reg: Arc<Registry>,
    next_id: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Poller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Poller").finish_non_exhaustive()
    }
}

static GLOBAL: Mutex<Weak<Poller>> = Mutex::new(Weak::new());

fn unavailable(what: &str, e: nix::errno::Errno) -> CoreError {
    CoreError::Unavailable {
        transport: NAME,
        reason: format!("{what}: {e}"),
    }
}

/// The process's progress thread, started if there is none.
pub(crate) fn poller() -> Result<Arc<Poller>> {
    let mut g = lock(&GLOBAL);
    if let Some(p) = g.upgrade() {
        return Ok(p);
    }
    let p = Arc::new(Poller::start()?);
    *g = Arc::downgrade(&p);
    Ok(p)
}

impl Poller {
    fn start() -> Result<Poller> {
        let epoll = Arc::new(
            Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)
                .map_err(|e| unavailable("cannot create an epoll instance", e))?,
        );
        let wake = Arc::new(
            EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
                .map_err(|e| unavailable("cannot create an eventfd", e))?,
        );
        epoll
            .add(wake.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, WAKE))
            .map_err(|e| unavailable("epoll_ctl on the eventfd", e))?;
        let reg = Arc::new(Registry {
            sources: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
        });
        let (ep, wk, rg) = (epoll.clone(), wake.clone(), reg.clone());
        let thread = std::thread::Builder::new()
            .name("braid-sock-poll".into())
            .spawn(move || run(&ep, &wk, &rg))
            .map_err(|e| CoreError::Unavailable {
                transport: NAME,
                reason: format!("cannot start the socket progress thread: {e}"),
            })?;
        Ok(Poller {
            epoll,
            wake,
            reg,
            next_id: AtomicU64::new(0),
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Registers `src` for the sockets `fds` (`fds[i]` is its socket `i`,
    /// watched for `want[i]`, once: see [`Armer::arm`]); returns its id
    /// for [`Poller::deregister`].
    pub(super) fn register(
        &self,
        src: Arc<dyn Source>,
        fds: &[BorrowedFd<'_>],
        want: &[EpollFlags],
    ) -> Result<u64> {
        if fds.len() as u64 >= MAX_IDX {
            return Err(CoreError::InvalidArgument(format!(
                "{} sockets on one link end",
                fds.len()
            )));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&self.reg.sources).insert(id, src);
        for (i, fd) in fds.iter().enumerate() {
            let flags = want.get(i).copied().unwrap_or(EpollFlags::empty()) | ONESHOT;
            if let Err(e) = self
                .epoll
                .add(fd, EpollEvent::new(flags, id * MAX_IDX + i as u64))
            {
                self.deregister(id, &fds[..i]);
                return Err(unavailable("epoll_ctl(ADD) on a link socket", e));
            }
        }
        Ok(id)
    }

    /// What source `id` arms its sockets with (it keeps no handle on the
    /// thread itself, which may drop the source's last reference).
    pub(super) fn armer(&self, id: u64) -> Armer {
        Armer {
            epoll: self.epoll.clone(),
            id,
        }
    }

    /// Stops delivering events of `fds` to source `id` and forgets it. A
    /// call of its `ready` already under way may still finish: sources
    /// guard their sockets with their own state (closing flags) for that.
    pub(super) fn deregister(&self, id: u64, fds: &[BorrowedFd<'_>]) {
        for fd in fds {
            let _ = self.epoll.delete(fd);
        }
        lock(&self.reg.sources).remove(&id);
    }
}

impl Poller {
    /// Does, on the caller's thread, what the progress thread would do for
    /// the events pending now (without waiting), and writes every queue as
    /// far as its socket takes it: an engine that polls a link while it
    /// waits moves every link's bytes itself instead of waiting for the
    /// progress thread to be scheduled, which on busy CPUs can take
    /// milliseconds, and keeps the sockets full (the thread is told of room
    /// only once a socket's buffer is half empty). An event goes to one
    /// taker only, so each is handled once, by whoever takes it.
    pub(super) fn help(&self) {
        let mut events = [EpollEvent::empty(); 16];
        if let Ok(n) = self.epoll.wait(&mut events, EpollTimeout::ZERO) {
            dispatch(&events[..n], &self.wake, &self.reg);
        }
        let sources: Vec<Arc<dyn Source>> = lock(&self.reg.sources).values().cloned().collect();
        for s in sources {
            s.poke();
        }
    }
}

/// Arms one source's sockets.
pub(super) struct Armer {
    epoll: Arc<Epoll>,
    id: u64,
}

impl Armer {
    /// Watches socket `idx` (`fd`) for `want` (readable, writable), once:
    /// the next event for it disarms it again. Arming a socket that is
    /// ready now reports it at once.
    pub(super) fn arm(&self, idx: usize, fd: BorrowedFd<'_>, want: EpollFlags) {
        let mut ev = EpollEvent::new(want | ONESHOT, self.id * MAX_IDX + idx as u64);
        let _ = self.epoll.modify(fd, &mut ev);
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.reg.stop.store(true, Ordering::Release);
        let _ = self.wake.write(1);
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

fn run(epoll: &Epoll, wake: &EventFd, reg: &Registry) {
    let mut events = vec![EpollEvent::empty(); 64];
    while !reg.stop.load(Ordering::Acquire) {
        let n = match epoll.wait(&mut events, EpollTimeout::NONE) {
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                tracing::error!("socket transport: epoll_wait failed ({e}); progress stops");
                return;
            }
        };
        dispatch(&events[..n], wake, reg);
    }
}

fn dispatch(events: &[EpollEvent], wake: &EventFd, reg: &Registry) {
    for ev in events {
        let token = ev.data();
        if token == WAKE {
            let _ = wake.read();
            continue;
        }
        let (id, idx) = (token / MAX_IDX, (token % MAX_IDX) as usize);
        let src = lock(&reg.sources).get(&id).cloned();
        if let Some(src) = src {
            src.ready(idx);
        }
    }
}
