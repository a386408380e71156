//! Links on demand. A communicator connects, at creation, the links its
//! default collectives use (the ring neighbours, the recursive-doubling
//! partners: what their programs name, [`Program::peers`]); every other link
//! connects when an operation first uses it, between the two ranks
//! concerned only: each makes its ends of the link's directions, they swap
//! connect-info point to point through the bootstrap
//! ([`Bootstrap::exchange`]: no round, no barrier, nothing from the other
//! ranks), and connect (send ends first, which never wait, then receive
//! ends), and say so to each other (a second exchange: a send end then knows
//! whether its receiver's single-copy probe succeeded). Both ranks decide alike that an operation uses a link, since rank
//! a's program sends to b exactly when b's receives from a; each pair
//! counts its exchanges, so the n-th on one side meets the n-th on the
//! other. `BRAID_CONNECT=eager` connects every pair at creation instead.
//!
//! What a rank holds (shared-memory segments, socket buffers, connections)
//! so grows with the links its operations use, not with the job.

use std::time::{Duration, Instant};

use braid_core::config;
use braid_core::transport::{PeerDesc, PendingRecv, PendingSend, Transport, TransportKind};
use braid_core::CoreError;

use crate::bootstrap::{Ask, Bootstrap, ExchangeError};
use crate::engine::Channels;
use crate::error::{Error, Result};
use crate::transports::TransportTable;

/// Environment variable: `lazy` (the default) or `eager`.
pub(crate) const ENV_CONNECT: &str = "BRAID_CONNECT";

/// When a communicator connects its links.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ConnectMode {
    /// At creation the links of the default collectives; the others on
    /// first use.
    Lazy,
    /// Every pair at creation.
    Eager,
}

impl ConnectMode {
    /// `BRAID_CONNECT` as `env` gives it (lazy when unset).
    pub(crate) fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<ConnectMode> {
        match config::value(env, ENV_CONNECT).as_deref().map(str::trim) {
            None | Some("") | Some("lazy") => Ok(ConnectMode::Lazy),
            Some("eager") => Ok(ConnectMode::Eager),
            Some(v) => Err(Error::Config(config::ConfigError::new(
                ENV_CONNECT,
                v,
                "expected lazy or eager",
            ))),
        }
    }
}

/// The links an operation uses: the peers it sends to and receives from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct LinkSet {
    pub send: Vec<u32>,
    pub recv: Vec<u32>,
}

impl LinkSet {
    /// Both directions with every peer of `choice` that a transport
    /// serves (eager mode).
    pub(crate) fn all(rank: u32, choice: &[Option<TransportKind>]) -> LinkSet {
        let peers: Vec<u32> = (0..choice.len() as u32)
            .filter(|&q| q != rank && choice[q as usize].is_some())
            .collect();
        LinkSet {
            send: peers.clone(),
            recv: peers,
        }
    }

    /// Adds `other`'s links.
    pub(crate) fn merge(&mut self, other: &LinkSet) {
        for (mine, theirs) in [(&mut self.send, &other.send), (&mut self.recv, &other.recv)] {
            mine.extend_from_slice(theirs);
            mine.sort_unstable();
            mine.dedup();
        }
    }

    /// Whether `chans` has every link of the set.
    pub(crate) fn connected(&self, chans: &Channels) -> bool {
        self.send
            .iter()
            .all(|&q| chans.send.get(q as usize).is_some_and(Option::is_some))
            && self
                .recv
                .iter()
                .all(|&q| chans.recv.get(q as usize).is_some_and(Option::is_some))
    }
}

/// What a communicator keeps to connect links later.
#[derive(Debug)]
pub(crate) struct Connector {
    pub me: PeerDesc,
    pub peers: Vec<PeerDesc>,
    pub choice: Vec<Option<TransportKind>>,
    pub table: TransportTable,
    /// Exchanges done with each peer: the tag of the next one.
    pub xchg: Vec<u64>,
    pub mode: ConnectMode,
}

/// The first byte of a connect message (its format).
const MSG_VERSION: u8 = 1;
/// Flag: the sender of the message sends to its receiver on this link.
const SENDS: u8 = 1;
/// Flag: the sender of the message receives from its receiver.
const RECEIVES: u8 = 2;
/// The second message of a first use: "my ends of our links are connected".
const CONNECTED: u8 = 4;

/// One pair's part of a connection: our pending ends and what we ask.
struct PairPlan {
    peer: u32,
    send: Option<Box<dyn PendingSend>>,
    recv: Option<Box<dyn PendingRecv>>,
}

fn put(v: &mut Vec<u8>, b: &[u8]) {
    v.extend_from_slice(&(b.len() as u32).to_le_bytes());
    v.extend_from_slice(b);
}

fn take<'a>(b: &'a [u8], at: &mut usize) -> Option<&'a [u8]> {
    let l = b.get(*at..*at + 4)?;
    let l = u32::from_le_bytes(l.try_into().ok()?) as usize;
    let x = b.get(*at + 4..(*at + 4).checked_add(l)?)?;
    *at += 4 + l;
    Some(x)
}

/// A peer's connect message: its flags, the connect-info of its sending
/// end (for our receiving end) and of its receiving end (for our sending
/// end), as far as it has them.
/// A decoded connect message: flags, the sender's send-side and
/// receive-side connect-info.
pub(crate) type ConnectMsg = (u8, Option<Vec<u8>>, Option<Vec<u8>>);

pub(crate) fn decode_msg(b: &[u8]) -> Option<ConnectMsg> {
    let (&v, &flags) = (b.first()?, b.get(1)?);
    if v != MSG_VERSION || flags & !(SENDS | RECEIVES) != 0 {
        return None;
    }
    let mut at = 2;
    let send = if flags & SENDS != 0 {
        Some(take(b, &mut at)?.to_vec())
    } else {
        None
    };
    let recv = if flags & RECEIVES != 0 {
        Some(take(b, &mut at)?.to_vec())
    } else {
        None
    };
    (at == b.len()).then_some((flags, send, recv))
}

fn names(peers: &[u32]) -> String {
    if peers.is_empty() {
        return "none".into();
    }
    peers
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

impl Connector {
    fn transport_name(&self, q: u32) -> &'static str {
        self.choice
            .get(q as usize)
            .copied()
            .flatten()
            .map_or("bootstrap", TransportKind::name)
    }

    fn exchange_error(&self, e: ExchangeError) -> CoreError {
        match e {
            ExchangeError::Peer {
                peer,
                what,
                timed_out: Some(after),
            } => {
                tracing::debug!(peer, "connecting a link on first use: {what}");
                CoreError::Timeout {
                    transport: self.transport_name(peer),
                    peer,
                    waiting_for: "its connect-info for a link used for the first time",
                    after,
                }
            }
            ExchangeError::Peer { peer, what, .. } => CoreError::Peer {
                transport: self.transport_name(peer),
                peer,
                what: format!("connecting the link on first use: {what}"),
                source: None,
            },
            ExchangeError::Aborted => {
                CoreError::Aborted("the communicator was aborted while it connected links".into())
            }
            ExchangeError::Local(e) => CoreError::Unavailable {
                transport: "bootstrap",
                reason: e.to_string(),
            },
        }
    }

    /// Connects the links of `need` that `chans` lacks: the ranks
    /// concerned swap connect-info through `boot` and connect within
    /// `timeout`. Every rank that shares a missing link with this one must
    /// call this for the same operation.
    ///
    /// A peer that fails here may have given up because of a third rank
    /// (which it then outlives only briefly, or leaves this rank waiting
    /// for its half of a link): a failure also names the ranks this one has
    /// links with that are gone, so the first cause is named too.
    pub(crate) fn ensure(
        &mut self,
        chans: &mut Channels,
        need: &LinkSet,
        boot: &Bootstrap,
        timeout: Duration,
    ) -> std::result::Result<(), CoreError> {
        match self.ensure_inner(chans, need, boot, timeout) {
            Err(e) if !matches!(e, CoreError::Aborted(_)) => {
                let gone = dead_links(chans, e.peer());
                if gone.is_empty() {
                    return Err(e);
                }
                let peer = e.peer().unwrap_or(gone[0].0);
                Err(CoreError::Peer {
                    transport: self.transport_name(peer),
                    peer,
                    what: format!(
                        "{e}; and {}",
                        gone.iter()
                            .map(|(q, why)| format!("rank {q} is gone too ({why})"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    source: None,
                })
            }
            other => other,
        }
    }

    fn ensure_inner(
        &mut self,
        chans: &mut Channels,
        need: &LinkSet,
        boot: &Bootstrap,
        timeout: Duration,
    ) -> std::result::Result<(), CoreError> {
        let me = self.me.rank;
        let p = self.peers.len();
        // Per peer: (we send, we receive) on links not connected yet.
        let mut pairs: Vec<(u32, bool, bool)> = Vec::new();
        for &q in &need.send {
            if chans.send.get(q as usize).is_some_and(Option::is_none) {
                pairs.push((q, true, false));
            }
        }
        for &q in &need.recv {
            if chans.recv.get(q as usize).is_some_and(Option::is_none) {
                match pairs.iter_mut().find(|x| x.0 == q) {
                    Some(x) => x.2 = true,
                    None => pairs.push((q, false, true)),
                }
            }
        }
        if pairs.is_empty() {
            return Ok(());
        }
        pairs.sort_unstable();
        let start = Instant::now();
        let mut plans = Vec::with_capacity(pairs.len());
        let mut asks = Vec::with_capacity(pairs.len());
        for &(q, send, recv) in &pairs {
            if q as usize >= p || q == me {
                return Err(CoreError::InvalidArgument(format!(
                    "an operation uses a link with rank {q} (this is rank {me} of {p})"
                )));
            }
            let kind = self.choice[q as usize].ok_or_else(|| CoreError::Unavailable {
                transport: "none",
                reason: format!("no transport connects rank {me} and rank {q}"),
            })?;
            let t = self.table.get(kind).ok_or_else(|| CoreError::Unavailable {
                transport: kind.name(),
                reason: format!(
                    "the planner chose {} for rank {q}, but it is off on this rank",
                    kind.name()
                ),
            })?;
            let peer = &self.peers[q as usize];
            let mut msg = vec![MSG_VERSION, 0];
            let mut plan = PairPlan {
                peer: q,
                send: None,
                recv: None,
            };
            if send {
                let (ps, blob) = t.prepare_send(&self.me, peer)?;
                msg[1] |= SENDS;
                put(&mut msg, &blob);
                plan.send = Some(ps);
            }
            if recv {
                let (pr, blob) = t.listen(&self.me, peer)?;
                msg[1] |= RECEIVES;
                put(&mut msg, &blob);
                plan.recv = Some(pr);
            }
            asks.push(Ask {
                peer: q,
                tag: self.xchg[q as usize],
                msg,
            });
            plans.push(plan);
        }
        let replies = boot.exchange(&asks).map_err(|e| self.exchange_error(e))?;
        for a in &asks {
            self.xchg[a.peer as usize] += 1;
        }
        // Check the answers before connecting anything.
        let mut infos = Vec::with_capacity(plans.len());
        for (plan, reply) in plans.iter().zip(&replies) {
            let q = plan.peer;
            let Some((flags, their_send, their_recv)) = decode_msg(reply) else {
                return Err(CoreError::Protocol {
                    peer: q,
                    detail: "malformed connect message for a link used for the first time".into(),
                });
            };
            let (we_send, we_recv) = (plan.send.is_some(), plan.recv.is_some());
            if (flags & SENDS != 0) != we_recv || (flags & RECEIVES != 0) != we_send {
                let dir = |s: bool, r: bool| match (s, r) {
                    (true, true) => "both ways",
                    (true, false) => "to send",
                    (false, true) => "to receive",
                    (false, false) => "not at all",
                };
                return Err(CoreError::Protocol {
                    peer: q,
                    detail: format!(
                        "this operation uses the link with rank {q} {} here but {} there (from rank {q}'s side): did the ranks call different operations?",
                        dir(we_send, we_recv),
                        dir(flags & SENDS != 0, flags & RECEIVES != 0),
                    ),
                });
            }
            infos.push((their_send, their_recv));
        }
        let deadline = Instant::now() + timeout;
        let mut plans = plans;
        // Send ends first: they never wait for the peer.
        for (plan, (_, their_recv)) in plans.iter_mut().zip(&infos) {
            if let (Some(ps), Some(info)) = (plan.send.take(), their_recv) {
                chans.send[plan.peer as usize] = Some(ps.connect(info, deadline)?);
            }
        }
        for (plan, (their_send, _)) in plans.iter_mut().zip(&infos) {
            if let (Some(pr), Some(info)) = (plan.recv.take(), their_send) {
                chans.recv[plan.peer as usize] = Some(pr.connect(info, deadline)?);
            }
        }
        // Every receive end here has run its single-copy probe: a second
        // exchange tells the peers, so their send ends know whether the link
        // passes references before its first piece (plans cut pieces larger
        // than a slot for links that do), as the barrier after creation does
        // for the first links.
        let done: Vec<Ask> = pairs
            .iter()
            .map(|&(q, ..)| Ask {
                peer: q,
                tag: self.xchg[q as usize],
                msg: vec![MSG_VERSION, CONNECTED],
            })
            .collect();
        let replies = boot.exchange(&done).map_err(|e| self.exchange_error(e))?;
        for a in &done {
            self.xchg[a.peer as usize] += 1;
        }
        for (a, reply) in done.iter().zip(&replies) {
            if reply[..] != [MSG_VERSION, CONNECTED] {
                return Err(CoreError::Protocol {
                    peer: a.peer,
                    detail: "malformed confirmation of a link used for the first time".into(),
                });
            }
        }
        let (s, r): (Vec<u32>, Vec<u32>) = (
            pairs.iter().filter(|x| x.1).map(|x| x.0).collect(),
            pairs.iter().filter(|x| x.2).map(|x| x.0).collect(),
        );
        tracing::debug!(
            rank = me,
            "braid: connected links in {:?}: sending to {}, receiving from {}",
            start.elapsed(),
            names(&s),
            names(&r)
        );
        Ok(())
    }
}

/// The peers (other than `except`) whose connected links report them dead
/// or gone, with what the link says.
fn dead_links(chans: &mut Channels, except: Option<u32>) -> Vec<(u32, String)> {
    let mut out: Vec<(u32, String)> = Vec::new();
    let mut note = |q: u32, r: std::result::Result<(), CoreError>| {
        if let Err(e) = r {
            if Some(q) != except && !out.iter().any(|x| x.0 == q) {
                out.push((q, e.to_string()));
            }
        }
    };
    for (q, c) in chans.send.iter_mut().enumerate() {
        if let Some(c) = c {
            note(q as u32, c.check_peer());
        }
    }
    for (q, c) in chans.recv.iter_mut().enumerate() {
        if let Some(c) = c {
            note(q as u32, c.check_peer());
        }
    }
    out.sort_unstable();
    out
}

/// The slot size every link of this rank will have at least: the smallest
/// of the transports it receives on (see [`Transport::recv_slot_bytes`]),
/// and of `chans`' connected links.
pub(crate) fn min_slot_bytes(
    table: &TransportTable,
    choice: &[Option<TransportKind>],
    chans: &Channels,
) -> Option<usize> {
    let mut kinds: Vec<TransportKind> = choice.iter().flatten().copied().collect();
    kinds.sort_unstable();
    kinds.dedup();
    let hints = kinds
        .into_iter()
        .filter_map(|k| table.get(k))
        .filter_map(|t| t.recv_slot_bytes());
    hints.chain(chans.min_slot_bytes()).min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_messages_round_trip_and_garbage_is_refused() {
        let mut m = vec![MSG_VERSION, SENDS | RECEIVES];
        put(&mut m, b"send-info");
        put(&mut m, b"");
        assert_eq!(
            decode_msg(&m),
            Some((3, Some(b"send-info".to_vec()), Some(Vec::new())))
        );
        let only = [MSG_VERSION, 0];
        assert_eq!(decode_msg(&only), Some((0, None, None)));
        for k in 0..m.len() {
            assert_eq!(decode_msg(&m[..k]), None, "prefix {k}");
        }
        let mut extra = m.clone();
        extra.push(0);
        assert_eq!(decode_msg(&extra), None);
        assert_eq!(decode_msg(&[2, 0]), None);
        assert_eq!(decode_msg(&[MSG_VERSION, 4]), None);
        let mut huge = vec![MSG_VERSION, SENDS];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_msg(&huge), None);
    }

    #[test]
    fn the_mode_is_read_from_the_environment() {
        let env = |v: &'static str| move |k: &str| (k == ENV_CONNECT).then(|| v.to_string());
        assert_eq!(ConnectMode::from_env(&|_| None).unwrap(), ConnectMode::Lazy);
        assert_eq!(
            ConnectMode::from_env(&env("eager")).unwrap(),
            ConnectMode::Eager
        );
        assert_eq!(
            ConnectMode::from_env(&env("lazy")).unwrap(),
            ConnectMode::Lazy
        );
        let e = ConnectMode::from_env(&env("sometimes")).unwrap_err();
        assert!(e.to_string().contains(ENV_CONNECT), "{e}");
    }

    #[test]
    fn link_sets() {
        let choice = [Some(TransportKind::Shm), None, Some(TransportKind::Socket)];
        let all = LinkSet::all(0, &choice);
        assert_eq!(all.send, vec![2]);
        let mut s = LinkSet {
            send: vec![3, 1],
            recv: vec![2],
        };
        s.merge(&LinkSet {
            send: vec![1, 4],
            recv: vec![],
        });
        assert_eq!(s.send, vec![1, 3, 4]);
        assert_eq!(s.recv, vec![2]);
    }
}
