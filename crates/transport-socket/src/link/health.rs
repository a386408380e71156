//! What one end knows about its link's liveness, shared with the progress
//! thread: the first failure (a lost socket, the peer's abort, a protocol
//! violation), the peer's normal close, and this end's own shutdown.
//!
//! A data socket that fails is not the whole story at once: the peer's
//! control socket may still say why (its abort reason) or that it closed
//! normally. The progress thread never waits for that; it records the loss
//! as pending ([`Health::lost_later`]), and the loss counts as the link's
//! failure once the control socket has had its say or [`VERDICT_GRACE`]
//! has passed.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use braid_core::error::CoreError;
use braid_core::transport::Doorbell;

use super::lock;
use crate::NAME;

/// How long a helper that saw its socket fail waits for the control socket
/// to explain why (an abort reason or a normal close) before it reports
/// "connection lost".
const VERDICT_GRACE: Duration = Duration::from_millis(200);

#[derive(Debug)]
pub(super) enum Fail {
    Lost {
        what: String,
        kind: io::ErrorKind,
        cause: String,
    },
    PeerAborted(String),
    Protocol(String),
}

#[derive(Debug, Default)]
struct HealthState {
    fail: Option<Fail>,
    /// A data socket failed at this time: a failure unless the control
    /// socket explains it within [`VERDICT_GRACE`].
    pending: Option<(Fail, Instant)>,
    /// The control reader has finished: it saw an abort, a close, EOF or an
    /// error.
    ctrl_finished: bool,
}

/// What one end knows about its link's liveness; shared with its helpers.
#[derive(Debug)]
pub(super) struct Health {
    /// The rank at the other end (renamed when a new communicator keeps
    /// the link).
    peer: AtomicU32,
    pub(super) failed: AtomicBool,
    /// The peer closed its end normally (a `Close` control frame).
    pub(super) peer_closed: AtomicBool,
    /// This end is shutting its sockets down (drop or abort): helpers exit
    /// quietly.
    pub(super) local_closing: AtomicBool,
    st: Mutex<HealthState>,
    cv: Condvar,
    /// Where this end's engine sleeps while it waits: rung by whoever moves
    /// something it may wait for (a message in, a credit, a piece out, a
    /// failure, the peer's abort or close). Process-private.
    pub(super) bell: Doorbell,
}

impl Health {
    pub(super) fn new(peer: u32) -> Arc<Health> {
        Arc::new(Health {
            peer: AtomicU32::new(peer),
            failed: AtomicBool::new(false),
            peer_closed: AtomicBool::new(false),
            local_closing: AtomicBool::new(false),
            st: Mutex::new(HealthState::default()),
            cv: Condvar::new(),
            bell: Doorbell::new(),
        })
    }

    /// The rank at the other end.
    pub(super) fn peer(&self) -> u32 {
        self.peer.load(Ordering::Relaxed)
    }

    /// Renames the rank at the other end (a kept link).
    pub(super) fn set_peer(&self, peer: u32) {
        self.peer.store(peer, Ordering::Relaxed);
    }

    /// Whether the link is whole: no failure seen or pending, the peer did
    /// not close, this end is not shutting down.
    pub(super) fn whole(&self) -> bool {
        !self.failed.load(Ordering::Acquire)
            && !self.peer_closed.load(Ordering::Acquire)
            && !self.local_closing.load(Ordering::Acquire)
            && {
                let st = lock(&self.st);
                st.fail.is_none() && st.pending.is_none() && !st.ctrl_finished
            }
    }

    /// Whether the link can be resynchronised after an abort: nothing
    /// failed but an abort (this end's own or the peer's), the peer did
    /// not close.
    pub(super) fn resumable(&self) -> bool {
        !self.peer_closed.load(Ordering::Acquire)
            && !self.local_closing.load(Ordering::Acquire)
            && {
                let st = lock(&self.st);
                st.pending.is_none() && matches!(st.fail, None | Some(Fail::PeerAborted(_)))
            }
    }

    /// Whether the peer said it aborted.
    pub(super) fn peer_aborted(&self) -> bool {
        matches!(lock(&self.st).fail, Some(Fail::PeerAborted(_)))
    }

    /// Forgets the old link's abort (a resynchronised resume).
    pub(super) fn reset(&self) {
        let mut st = lock(&self.st);
        *st = HealthState::default();
        self.failed.store(false, Ordering::Release);
    }

    pub(super) fn fail(&self, f: Fail) {
        let mut st = lock(&self.st);
        let replace = match (&st.fail, &f) {
            (None, _) => true,
            // The peer's own reason beats our view of the broken socket.
            (Some(Fail::Lost { .. }), Fail::PeerAborted(_)) => true,
            _ => false,
        };
        if replace {
            if !matches!(f, Fail::PeerAborted(_)) {
                tracing::debug!(peer = self.peer(), "socket link failed: {f:?}");
            }
            st.fail = Some(f);
            self.failed.store(true, Ordering::Release);
        }
        drop(st);
        self.cv.notify_all();
        self.ring();
    }

    /// Wakes this end's engine if it sleeps (see [`Health::bell`]).
    pub(super) fn ring(&self) {
        self.bell.ring(false);
    }

    /// A data socket failed (seen by the progress thread, which must not
    /// wait): the link fails unless the peer's control socket says within
    /// [`VERDICT_GRACE`] that it aborted (its reason wins) or closed.
    pub(super) fn lost_later(&self, what: &str, kind: io::ErrorKind, cause: &str) {
        if self.local_closing.load(Ordering::Acquire) {
            return;
        }
        let mut st = lock(&self.st);
        if st.fail.is_none() && st.pending.is_none() {
            st.pending = Some((
                Fail::Lost {
                    what: what.to_owned(),
                    kind,
                    cause: cause.to_owned(),
                },
                Instant::now(),
            ));
            self.failed.store(true, Ordering::Release);
        }
        drop(st);
        self.ring();
    }

    pub(super) fn lost(&self, what: &str, e: &io::Error) {
        self.fail(Fail::Lost {
            what: what.to_owned(),
            kind: e.kind(),
            cause: e.to_string(),
        });
    }

    pub(super) fn ctrl_finished(&self) {
        lock(&self.st).ctrl_finished = true;
        self.cv.notify_all();
        self.ring();
    }

    /// A data helper saw its socket fail or close: give the control socket a
    /// moment to say why, unless we are closing ourselves.
    pub(super) fn await_verdict(&self) {
        if self.local_closing.load(Ordering::Acquire) {
            return;
        }
        let st = lock(&self.st);
        let _unused = self
            .cv
            .wait_timeout_while(st, VERDICT_GRACE, |s| !s.ctrl_finished && s.fail.is_none());
    }

    pub(super) fn error(&self) -> Option<CoreError> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        let mut st = lock(&self.st);
        if st.fail.is_none() {
            let due = st
                .pending
                .as_ref()
                .is_some_and(|(_, at)| st.ctrl_finished || at.elapsed() >= VERDICT_GRACE);
            if self.peer_closed.load(Ordering::Acquire) && st.ctrl_finished {
                // The peer closed normally: its sockets ending is no failure.
                st.pending = None;
            } else if due {
                st.fail = st.pending.take().map(|(f, _)| f);
            }
        }
        let peer = self.peer();
        st.fail.as_ref().map(|f| match f {
            Fail::Lost { what, kind, cause } => CoreError::Peer {
                transport: NAME,
                peer,
                what: format!("connection lost: {what}: {cause}"),
                source: Some(Box::new(io::Error::new(*kind, cause.clone()))),
            },
            Fail::PeerAborted(reason) => CoreError::PeerAborted {
                transport: NAME,
                peer,
                reason: reason.clone(),
            },
            Fail::Protocol(detail) => CoreError::Protocol {
                peer,
                detail: format!("socket link: {detail}"),
            },
        })
    }
}
