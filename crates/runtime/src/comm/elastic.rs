//! Elastic communicators: drop failed ranks ([`Communicator::shrink`],
//! NCCL's `ncclCommShrink`), stop every operation everywhere
//! ([`Communicator::revoke`], `ncclCommRevoke`), add ranks
//! ([`Communicator::grow_id`] and [`Communicator::grow`], NCCL's
//! `ncclCommGetUniqueId` and `ncclCommGrow`), and find the ranks whose
//! process is gone ([`Communicator::gone_ranks`], like ULFM's
//! `MPIX_Comm_get_failed`).
//!
//! Shrink and grow agree through the bootstrap's point-to-point exchanges,
//! which need neither the root (it may have died with its rank) nor the
//! ring (a failed round breaks it): the lowest member collects every
//! member's view (round 1), checks they agree, and answers each with the
//! new communicator's id or the reason there is none (round 2). The new
//! communicator then has a rendezvous of its own, hosted by that member.
//!
//! A shrink keeps the links the survivors have between them, also after an
//! operation failed in the middle: in round 1 each survivor also says where
//! each end of its links to other survivors stands
//! ([`SendChannel::resume_point`]), the lowest member keeps a link when its
//! two ends fit ([`Resume::fits`]: the receiver can drop what the sender
//! committed and it did not read) and tells each member which of its links
//! go on and from which message (round 2); each member then resumes those
//! ends under their new ranks and hands them to the new communicator, which
//! connects only the links it lacks. Shared-memory, socket and IB links
//! are kept also after an abort (socket and IB links resynchronise: see
//! [`Resume::resync`]); a link whose ends would go on differently (one
//! resynchronises, the other stands idle), whose peer died, or that failed
//! otherwise is made afresh.
//!
//! [`SendChannel::resume_point`]: braid_core::transport::SendChannel::resume_point

use sha2::{Digest, Sha256};

use super::*;
use crate::bootstrap::{fmt_ranks, Ask};
use braid_core::transport::Resume;

/// The bootstrap tags of repairs: far above those of link set-up (which
/// count exchanges with each peer from 0).
const TAG_BASE: u64 = 0xB7A1_D000_0000_0000;
const KIND_SHRINK: u64 = 1 << 40;
const KIND_GROW: u64 = 2 << 40;

/// Marks errors caused by a revocation ([`ErrorKind::Revoked`]).
///
/// [`ErrorKind::Revoked`]: crate::ErrorKind::Revoked
pub(crate) const REVOKED: &str = "revoked the communicator";

impl Communicator {
    /// Drop the ranks `exclude` and go on with the others, like NCCL's
    /// `ncclCommShrink` (with `NCCL_SHRINK_ABORT`) and ULFM's
    /// `MPIX_Comm_shrink`: every rank that stays calls it with the same
    /// list (in any order) and gets a new communicator of the ranks that
    /// stay, in their old order (rank `r` becomes `r` minus the number of
    /// dropped ranks below it). The dropped ranks do not call it.
    ///
    /// Works on a healthy communicator, after a failed operation (a peer
    /// died or stalled in the middle of it), after [`Communicator::abort`]
    /// and after [`Communicator::revoke`]. The links between the ranks that
    /// stay move to the new communicator, which makes only the links it
    /// lacks (what an operation that failed left in a link is dropped; a
    /// transport that cannot keep a link after a failure gets a fresh one).
    /// Operations still pending on this communicator in other threads are
    /// not waited for (revoke or abort it first); a shrink that finds one
    /// running keeps no links of this rank. This communicator stays as it
    /// was otherwise: after a failure, drop it; a healthy one still works
    /// and connects links again when an operation needs them.
    ///
    /// Every wait has the communicator's timeout: a rank that stays but
    /// does not call `shrink`, or dies during it, is an error naming it; a
    /// rank that passes a different list is an error naming it on every
    /// rank. [`Communicator::gone_ranks`] finds the ranks whose process is
    /// gone.
    pub fn shrink(&self, exclude: &[u32]) -> Result<Communicator> {
        let sh = &*self.shared;
        let n = sh.nranks;
        let mut dropped = exclude.to_vec();
        dropped.sort_unstable();
        dropped.dedup();
        if let Some(&bad) = dropped.iter().find(|&&r| r >= n) {
            return Err(Error::InvalidArgument(format!(
                "shrink: rank {bad} is not a rank of this communicator (ranks 0..{n})"
            )));
        }
        if dropped.binary_search(&sh.rank).is_ok() {
            return Err(Error::InvalidArgument(format!(
                "shrink: this rank ({}) is in the list of ranks to drop; only the ranks that stay call shrink",
                sh.rank
            )));
        }
        let keep: Vec<u32> = (0..n)
            .filter(|r| dropped.binary_search(r).is_err())
            .collect();
        let new_rank = keep.iter().position(|&r| r == sh.rank).unwrap_or(0) as u32;
        let mut view = b"braid-shrink".to_vec();
        view.extend(n.to_le_bytes());
        for r in &dropped {
            view.extend(r.to_le_bytes());
        }
        let view: Vec<u8> = Sha256::digest(&view)[..16].to_vec();
        let what = format!("shrink to {} of {n} ranks", keep.len());
        let tag = self.repair_tag(KIND_SHRINK);
        // The links stay still while the members agree on which to keep.
        let mut links = self.hold_links();
        let offer = links
            .as_mut()
            .map(|st| encode_offers(&offers(&mut st.chans, &keep, sh.rank)))
            .unwrap_or_default();
        let (id, root, kept) = self.agree(tag, &keep, &view, &offer, |all| kept_links(&keep, all), &what, |disagree| {
            format!(
                "{} {} a different list of ranks to drop than {}: every rank that stays must pass the same list",
                fmt_ranks(disagree),
                if disagree.len() == 1 { "passes" } else { "pass" },
                if dropped.is_empty() {
                    "none".to_string()
                } else {
                    fmt_ranks(&dropped)
                }
            )
        }, |boot| {
            let ip = boot.local_ip().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
            create_unique_id_with_timeout(SocketAddr::new(ip, 0), sh.policy.timeout)
        })?;
        let kept = decode_kept(&kept).ok_or_else(|| {
            Error::Bootstrap(format!(
                "{what}: rank {} sent a malformed list of links to keep",
                keep[0]
            ))
        })?;
        let chans = match links.as_mut() {
            Some(st) => resume_kept(&mut st.chans, &kept, &keep)?,
            None => empty_channels(keep.len()),
        };
        drop(links);
        info!(
            rank = sh.rank,
            new_rank,
            size = keep.len(),
            dropped = %fmt_ranks(&dropped),
            kept_links = kept.len(),
            "braid: shrink"
        );
        self.rebuild(&id, new_rank, keep.len() as u32, root, Some(chans))
    }

    /// The op lock, so that no operation moves the links while a shrink
    /// decides which to keep: `None` if an operation in another thread
    /// holds it for longer than a second (it was not aborted; the shrink
    /// then keeps none of this rank's links).
    fn hold_links(&self) -> Option<OpGuard<'_, State>> {
        let until = Instant::now() + Duration::from_secs(1).min(self.shared.policy.timeout);
        loop {
            match self.shared.state.try_lock() {
                Some(Ok(g)) => return Some(g),
                Some(Err(_)) => return None,
                None if Instant::now() >= until => {
                    warn!(
                        rank = self.shared.rank,
                        "braid: shrink: an operation is still running on the old communicator; its links are not kept"
                    );
                    return None;
                }
                None => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    }

    /// An id for ranks that join this communicator with
    /// [`Communicator::grow`], like `ncclCommGetUniqueId`: call it on rank 0
    /// and hand the id to the new processes, which join with
    /// [`Communicator::init`] as ranks `nranks()..` of the grown size. Its
    /// rendezvous runs in this process until the grow completes (a later
    /// call replaces it).
    pub fn grow_id(&self) -> Result<UniqueId> {
        let sh = &*self.shared;
        if sh.rank != 0 {
            return Err(Error::InvalidArgument(format!(
                "grow_id: call it on rank 0 (this is rank {}); the other ranks just call grow",
                sh.rank
            )));
        }
        let ip = self
            .boot()?
            .local_ip()
            .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let (id, root) = create_unique_id_with_timeout(SocketAddr::new(ip, 0), sh.policy.timeout)?;
        *sh.grow_root
            .lock()
            .map_err(|_| Error::Unusable("a thread panicked while growing".into()))? =
            Some((id, root));
        Ok(id)
    }

    /// Add ranks, like `ncclCommGrow`: every rank of this communicator calls
    /// it with the new size `nranks` (rank 0 after [`Communicator::grow_id`]),
    /// the new processes call [`Communicator::init`] with that id, the same
    /// `nranks` and ranks `self.nranks()..nranks`. The result has the old
    /// ranks first, with the ranks they had. This communicator is left as
    /// it is.
    pub fn grow(&self, nranks: u32) -> Result<Communicator> {
        let sh = &*self.shared;
        if nranks < sh.nranks {
            return Err(Error::InvalidArgument(format!(
                "grow: {nranks} ranks is fewer than the {} this communicator has; drop ranks with shrink",
                sh.nranks
            )));
        }
        let keep: Vec<u32> = (0..sh.nranks).collect();
        let what = format!("grow from {} to {nranks} ranks", sh.nranks);
        let tag = self.repair_tag(KIND_GROW);
        let (id, root, _) = self.agree(tag, &keep, &nranks.to_le_bytes(), &[], |all| vec![Vec::new(); all.len()], &what, |disagree| {
            format!(
                "{} {} a different new size than rank 0's {nranks}",
                fmt_ranks(disagree),
                if disagree.len() == 1 { "asks for" } else { "ask for" },
            )
        }, |_| {
            sh.grow_root
                .lock()
                .map_err(|_| Error::Unusable("a thread panicked while growing".into()))?
                .take()
                .ok_or_else(|| {
                    Error::InvalidArgument(
                        "grow: rank 0 has no id to grow with: call grow_id on rank 0 first and hand that id to the new ranks".into(),
                    )
                })
        })?;
        info!(rank = sh.rank, from = sh.nranks, to = nranks, "braid: grow");
        self.rebuild(&id, sh.rank, nranks, root, None)
    }

    /// Revoke this communicator on every rank, like `ncclCommRevoke` and
    /// ULFM's `MPIX_Comm_revoke`: every pending and later operation on it,
    /// here and on every other rank, fails with an error of kind
    /// [`ErrorKind::Revoked`](crate::ErrorKind::Revoked) saying which rank
    /// revoked it. Not collective: one rank calls it (any number may). The
    /// other ranks hear it through a socket of the communicator's own
    /// (within milliseconds; a rank that cannot be reached is logged), and
    /// from the links of operations under way. Afterwards the survivors
    /// [`shrink`](Communicator::shrink) it or drop it.
    pub fn revoke(&self) {
        let sh = &*self.shared;
        let why = format!("rank {} {REVOKED}", sh.rank);
        sh.abort(&why);
        let Some(doors) = sh.doors.get() else {
            return;
        };
        let to: Vec<(u32, SocketAddr)> = doors
            .iter()
            .enumerate()
            .filter(|&(r, _)| r as u32 != sh.rank)
            .filter_map(|(r, a)| a.map(|a| (r as u32, a)))
            .collect();
        let frame = super::revoke::notice(&sh.secret, sh.rank, &why);
        let missed = super::revoke::send_all(&to, &frame);
        if !missed.is_empty() {
            warn!(
                rank = sh.rank,
                "braid: revoke: {} could not be told directly (gone, or unreachable); they learn it from their links",
                fmt_ranks(&missed)
            );
        }
    }

    /// Whether this communicator was revoked, here or by another rank
    /// (ULFM's `MPIX_Comm_is_revoked`).
    pub fn is_revoked(&self) -> bool {
        self.shared
            .aborted_why()
            .is_some_and(|w| w.contains(REVOKED))
    }

    /// The ranks whose process is gone (ULFM's `MPIX_Comm_get_failed`):
    /// nothing listens at their bootstrap address any more, or their host
    /// does not answer within a second. A stopped or stuck process is not
    /// gone. Survivors pass the result to [`Communicator::shrink`]; since
    /// they look at slightly different moments, shrink checks that they
    /// agree.
    pub fn gone_ranks(&self) -> Result<Vec<u32>> {
        self.boot()?.gone_ranks(Duration::from_secs(1))
    }

    /// The tag of this rank's next repair of `kind`: every member calls the
    /// same repairs in the same order, so the counts agree.
    fn repair_tag(&self, kind: u64) -> u64 {
        let k = self.shared.repairs.fetch_add(1, Ordering::Relaxed);
        TAG_BASE | kind | ((k & 0xFF_FFFF) << 1)
    }

    /// The two rounds of a repair among `members` (old ranks, ascending):
    /// each sends `view` and `offer` to the lowest member, which checks
    /// that the views agree (`disagree` words the error, from the ranks
    /// that do not), gets the new rendezvous from `host`, computes an
    /// answer for each member from all offers (`answers`, in member order)
    /// and tells every member the id and its answer. Returns the id, the
    /// root on the member that hosts it, and this member's answer.
    #[allow(clippy::too_many_arguments)]
    fn agree(
        &self,
        tag: u64,
        members: &[u32],
        view: &[u8],
        offer: &[u8],
        answers: impl FnOnce(&[&[u8]]) -> Vec<Vec<u8>>,
        what: &str,
        disagree: impl FnOnce(&[u32]) -> String,
        host: impl FnOnce(&Bootstrap) -> Result<(UniqueId, RootServer)>,
    ) -> Result<(UniqueId, Option<RootServer>, Vec<u8>)> {
        let sh = &*self.shared;
        let leader = members[0];
        let boot = self.boot()?;
        let fail = |e: crate::bootstrap::ExchangeError| {
            Error::Bootstrap(format!("rank {}: {what}: {e}", sh.rank))
        };
        let mut mine = (view.len() as u32).to_le_bytes().to_vec();
        mine.extend_from_slice(view);
        mine.extend_from_slice(offer);
        if leader != sh.rank {
            let ask = |tag, msg: &[u8]| Ask {
                peer: leader,
                tag,
                msg: msg.to_vec(),
            };
            boot.exchange_past_abort(&[ask(tag, &mine)]).map_err(fail)?;
            let verdict = boot
                .exchange_past_abort(&[ask(tag + 1, &[])])
                .map_err(fail)?
                .pop()
                .unwrap_or_default();
            let malformed =
                || Error::Bootstrap(format!("{what}: rank {leader} sent a malformed answer"));
            return match verdict.split_first() {
                Some((1, rest)) => {
                    let (id, answer) = split_field(rest).ok_or_else(malformed)?;
                    let id = std::str::from_utf8(id).map_err(|_| malformed())?.parse()?;
                    Ok((id, None, answer.to_vec()))
                }
                Some((_, why)) => Err(Error::Bootstrap(format!(
                    "{what}: {}",
                    String::from_utf8_lossy(why)
                ))),
                None => Err(Error::Bootstrap(format!(
                    "{what}: rank {leader} sent an empty answer"
                ))),
            };
        }
        let others = &members[1..];
        let views = boot
            .exchange_past_abort(
                &others
                    .iter()
                    .map(|&peer| Ask {
                        peer,
                        tag,
                        msg: mine.clone(),
                    })
                    .collect::<Vec<_>>(),
            )
            .map_err(fail)?;
        let mut offers: Vec<&[u8]> = vec![offer];
        let mut odd: Vec<u32> = Vec::new();
        for (&r, v) in others.iter().zip(&views) {
            match split_field(v) {
                Some((theirs, off)) if theirs == view => offers.push(off),
                _ => {
                    odd.push(r);
                    offers.push(&[]);
                }
            }
        }
        let (verdicts, result) = if !odd.is_empty() {
            let why = disagree(&odd);
            (
                vec![[&[0u8][..], why.as_bytes()].concat(); members.len()],
                Err(Error::Bootstrap(format!("{what}: {why}"))),
            )
        } else {
            match host(&boot) {
                Ok((id, root)) => {
                    let text = id.to_string();
                    let mut answers = answers(&offers);
                    answers.resize(members.len(), Vec::new());
                    let verdicts = answers
                        .iter()
                        .map(|a| {
                            let mut v = vec![1u8];
                            v.extend((text.len() as u32).to_le_bytes());
                            v.extend(text.as_bytes());
                            v.extend_from_slice(a);
                            v
                        })
                        .collect();
                    let own = std::mem::take(&mut answers[0]);
                    (verdicts, Ok((id, Some(root), own)))
                }
                Err(e) => (
                    vec![
                        [&[0u8][..], format!("rank {leader}: {e}").as_bytes()].concat();
                        members.len()
                    ],
                    Err(e),
                ),
            }
        };
        let asks: Vec<Ask> = others
            .iter()
            .zip(&verdicts[1..])
            .map(|(&peer, msg)| Ask {
                peer,
                tag: tag + 1,
                msg: msg.clone(),
            })
            .collect();
        boot.exchange_past_abort(&asks).map_err(fail)?;
        result
    }

    /// The repaired communicator: this rank as `rank` of `nranks` at `id`,
    /// with this one's timeout and settings; `root` on the rank that hosts
    /// its rendezvous.
    fn rebuild(
        &self,
        id: &UniqueId,
        rank: u32,
        nranks: u32,
        root: Option<RootServer>,
        kept: Option<Channels>,
    ) -> Result<Communicator> {
        let sh = &*self.shared;
        let config = Config {
            timeout: sh.policy.timeout,
            abort: None,
        };
        Self::init_inner(id, rank, nranks, &config, root, sh.settings.clone(), kept)
    }
}

/// A length-prefixed field and what follows it.
fn split_field(b: &[u8]) -> Option<(&[u8], &[u8])> {
    let n = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
    let field = b.get(4..4usize.checked_add(n)?)?;
    Some((field, &b[4 + n..]))
}

/// One end of a link between two members of a shrink, as its rank offers
/// to keep it (old ranks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Offer {
    peer: u32,
    /// The sending end (else the receiving end).
    sends: bool,
    at: Resume,
}

const OFFER_BYTES: usize = 4 + 1 + 8 + 8 + 1;

/// The ends of this rank's links with the other `members` that can go on.
fn offers(chans: &mut Channels, members: &[u32], me: u32) -> Vec<Offer> {
    let mut out = Vec::new();
    for &q in members.iter().filter(|&&q| q != me) {
        if let Some(at) = chans
            .send
            .get_mut(q as usize)
            .and_then(|c| c.as_mut()?.resume_point())
        {
            out.push(Offer {
                peer: q,
                sends: true,
                at,
            });
        }
        if let Some(at) = chans
            .recv
            .get_mut(q as usize)
            .and_then(|c| c.as_mut()?.resume_point())
        {
            out.push(Offer {
                peer: q,
                sends: false,
                at,
            });
        }
    }
    out
}

fn encode_offers(offers: &[Offer]) -> Vec<u8> {
    let mut v = Vec::with_capacity(offers.len() * OFFER_BYTES);
    for o in offers {
        v.extend(o.peer.to_le_bytes());
        v.push(o.sends as u8);
        v.extend(o.at.count.to_le_bytes());
        v.extend(o.at.drop_max.to_le_bytes());
        v.push(o.at.resync as u8);
    }
    v
}

fn decode_offers(b: &[u8]) -> Option<Vec<Offer>> {
    if !b.len().is_multiple_of(OFFER_BYTES) {
        return None;
    }
    b.chunks_exact(OFFER_BYTES)
        .map(|c| {
            let u64_at = |i: usize| u64::from_le_bytes(c[i..i + 8].try_into().unwrap_or_default());
            Some(Offer {
                peer: u32::from_le_bytes(c[..4].try_into().ok()?),
                sends: match c[4] {
                    0 => false,
                    1 => true,
                    _ => return None,
                },
                at: Resume {
                    count: u64_at(5),
                    drop_max: u64_at(13),
                    resync: match c[21] {
                        0 => false,
                        1 => true,
                        _ => return None,
                    },
                },
            })
        })
        .collect()
}

/// A link end a member keeps: the peer (old rank), which end, and the
/// sender's count to go on from.
type Kept = (u32, bool, u64);

const KEPT_BYTES: usize = 4 + 1 + 8;

/// The leader's decision: a link `a → b` goes on when `a` offers its
/// sending end, `b` its receiving end, and the two fit; each member's
/// answer lists its ends that go on. A malformed offer keeps nothing of
/// its member's.
fn kept_links(members: &[u32], all: &[&[u8]]) -> Vec<Vec<u8>> {
    let offers: Vec<Vec<Offer>> = all
        .iter()
        .map(|b| decode_offers(b).unwrap_or_default())
        .collect();
    let index = |r: u32| members.iter().position(|&m| m == r);
    let mut answers = vec![Vec::new(); members.len()];
    for (i, mine) in offers.iter().enumerate() {
        let a = members[i];
        for s in mine.iter().filter(|o| o.sends) {
            let Some(j) = index(s.peer).filter(|&j| j != i) else {
                continue;
            };
            let fits = offers[j]
                .iter()
                .any(|r| !r.sends && r.peer == a && Resume::fits(s.at, r.at));
            if fits {
                for (k, q, sends) in [(i, s.peer, true), (j, a, false)] {
                    answers[k].extend(q.to_le_bytes());
                    answers[k].push(sends as u8);
                    answers[k].extend(s.at.count.to_le_bytes());
                }
            }
        }
    }
    answers
}

fn decode_kept(b: &[u8]) -> Option<Vec<Kept>> {
    if !b.len().is_multiple_of(KEPT_BYTES) {
        return None;
    }
    b.chunks_exact(KEPT_BYTES)
        .map(|c| {
            Some((
                u32::from_le_bytes(c[..4].try_into().ok()?),
                c[4] == 1,
                u64::from_le_bytes(c[5..].try_into().ok()?),
            ))
        })
        .collect()
}

fn empty_channels(p: usize) -> Channels {
    Channels {
        send: (0..p).map(|_| None).collect(),
        recv: (0..p).map(|_| None).collect(),
        scratch: Vec::new(),
    }
}

/// Moves the ends in `kept` out of `old` into the new communicator's
/// channels, resumed under their new ranks (a member's new rank is its
/// place in `members`).
fn resume_kept(old: &mut Channels, kept: &[Kept], members: &[u32]) -> Result<Channels> {
    let mut new = empty_channels(members.len());
    // Sending ends first: a receiving end's resume may wait for its
    // sender's (a socket link after an abort waits for the sender's cut),
    // and a sender's never waits, so no two members wait for each other.
    let order = kept
        .iter()
        .filter(|k| k.1)
        .chain(kept.iter().filter(|k| !k.1));
    for &(q, sends, at) in order {
        let Some(nq) = members.iter().position(|&m| m == q) else {
            return Err(Error::Bootstrap(format!(
                "shrink: told to keep a link with rank {q}, which does not stay"
            )));
        };
        let missing = || {
            Error::Bootstrap(format!(
                "shrink: told to keep the link {} rank {q}, which this rank does not have",
                if sends { "to" } else { "from" }
            ))
        };
        if sends {
            let mut c = old
                .send
                .get_mut(q as usize)
                .and_then(Option::take)
                .ok_or_else(missing)?;
            c.resume(nq as u32, at).map_err(Error::Core)?;
            new.send[nq] = Some(c);
        } else {
            let mut c = old
                .recv
                .get_mut(q as usize)
                .and_then(Option::take)
                .ok_or_else(missing)?;
            c.resume(nq as u32, at).map_err(Error::Core)?;
            new.recv[nq] = Some(c);
        }
    }
    Ok(new)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where each connected end of `c`'s links lives (the box's address:
    /// a kept link is the same object under its new rank).
    fn ends(c: &Communicator) -> (Vec<Option<usize>>, Vec<Option<usize>>) {
        let st = c.lock().unwrap();
        let addr = |p: *const ()| p as usize;
        (
            st.chans
                .send
                .iter()
                .map(|e| {
                    e.as_ref().map(|b| {
                        addr(&**b as *const dyn braid_core::transport::SendChannel as *const ())
                    })
                })
                .collect(),
            st.chans
                .recv
                .iter()
                .map(|e| {
                    e.as_ref().map(|b| {
                        addr(&**b as *const dyn braid_core::transport::RecvChannel as *const ())
                    })
                })
                .collect(),
        )
    }

    /// Every rank's AllReduce of `rank + 1` at `len` elements (pieces of
    /// every path: box, slot, several slots) and an AllToAll: checked
    /// against plain sums.
    fn check(c: &Communicator, old_ranks: &[u32]) {
        let want: u64 = old_ranks.iter().map(|&r| u64::from(r) + 1).sum();
        let mine = u64::from(old_ranks[c.rank() as usize]) + 1;
        for len in [1usize, 4000, 300_000] {
            let mut v = vec![mine; len];
            c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
            assert!(
                v.iter().all(|&x| x == want),
                "rank {}: {} != {want}",
                c.rank(),
                v[0]
            );
        }
        let n = c.nranks() as usize;
        let send: Vec<u32> = (0..n * 100)
            .map(|i| c.rank() * 1_000_000 + i as u32)
            .collect();
        let mut recv = vec![0u32; n * 100];
        c.all_to_all(&send, &mut recv).unwrap();
        for (i, x) in recv.iter().enumerate() {
            let (from, k) = (i / 100, i % 100);
            assert_eq!(
                *x,
                from as u32 * 1_000_000 + (c.rank() as usize * 100 + k) as u32
            );
        }
    }

    fn config() -> Config {
        Config {
            timeout: Duration::from_secs(20),
            abort: None,
        }
    }

    /// Runs `f(comm)` on 4 thread ranks with these `BRAID_*` settings (a
    /// rank whose check fails makes the others' operations fail within the
    /// timeout: no wait outside braid's).
    fn on_four_with<R: Send>(env: &[(&str, &str)], f: impl Fn(Communicator) -> R + Sync) -> Vec<R> {
        let settings = Settings::from_snapshot(crate::settings::Env::from_pairs(env)).unwrap();
        let comms = Communicator::init_threads_with(4, &config(), settings).unwrap();
        std::thread::scope(|s| {
            let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(|| f(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn the_leader_keeps_a_link_only_when_both_ends_fit() {
        let o = |peer, sends, count, drop_max| Offer {
            peer,
            sends,
            at: Resume {
                count,
                drop_max,
                resync: false,
            },
        };
        // Members 0, 2, 5 (old ranks).
        let members = [0u32, 2, 5];
        let offers = [
            // 0 → 2 fits (2 dropped nothing), 0 → 5 does not (5 released
            // more than 0 committed), 0 ← 2 has no sending end on 2.
            vec![o(2, true, 7, 0), o(5, true, 3, 0), o(2, false, 1, 16)],
            vec![o(0, false, 7, 16), o(5, true, 9, 0)],
            // 5 ← 2: 9 committed, 4 released, 4 droppable: too few.
            vec![o(0, false, 4, 16), o(2, false, 4, 4)],
        ];
        let enc: Vec<Vec<u8>> = offers.iter().map(|v| encode_offers(v)).collect();
        let all: Vec<&[u8]> = enc.iter().map(|v| v.as_slice()).collect();
        let answers = kept_links(&members, &all);
        let kept: Vec<Vec<Kept>> = answers.iter().map(|a| decode_kept(a).unwrap()).collect();
        assert_eq!(kept, vec![vec![(2, true, 7)], vec![(0, false, 7)], vec![]]);
        // Room for one more dropped message: 2 → 5 fits.
        let mut offers = offers;
        offers[2][1].at.drop_max = 5;
        let enc: Vec<Vec<u8>> = offers.iter().map(|v| encode_offers(v)).collect();
        let all: Vec<&[u8]> = enc.iter().map(|v| v.as_slice()).collect();
        let kept: Vec<Vec<Kept>> = kept_links(&members, &all)
            .iter()
            .map(|a| decode_kept(a).unwrap())
            .collect();
        assert_eq!(kept[2], vec![(2, false, 9)]);
        assert_eq!(kept[1], vec![(0, false, 7), (5, true, 9)]);
        // Ends that would go on differently (one resynchronises) do not fit;
        // both resynchronising do.
        offers[2][1].at.resync = true;
        let keep = |offers: &[Vec<Offer>]| -> Vec<Vec<Kept>> {
            let enc: Vec<Vec<u8>> = offers.iter().map(|v| encode_offers(v)).collect();
            let all: Vec<&[u8]> = enc.iter().map(|v| v.as_slice()).collect();
            kept_links(&members, &all)
                .iter()
                .map(|a| decode_kept(a).unwrap())
                .collect()
        };
        assert_eq!(keep(&offers)[2], vec![]);
        offers[1][1].at.resync = true;
        assert_eq!(keep(&offers)[2], vec![(2, false, 9)]);
        // A malformed offer keeps nothing of its member's.
        let bad = [&enc[0][..], &enc[1][..3], &enc[2][..]];
        assert!(kept_links(&members, &bad).iter().all(|a| a.is_empty()));
        assert!(decode_offers(&[0; OFFER_BYTES + 1]).is_none());
        let mut flag = encode_offers(&offers[0][..1]);
        flag[OFFER_BYTES - 1] = 2;
        assert!(decode_offers(&flag).is_none());
    }

    #[test]
    fn shrink_keeps_links_after_a_rank_died_mid_operation() {
        kept_after_a_death(&[]);
    }

    /// Rank 3 leaves in the middle of a large AllReduce on four ranks with
    /// these settings; the three others shrink, keep every link between
    /// them and run every collective on them.
    fn kept_after_a_death(env: &[(&str, &str)]) {
        let kept = on_four_with(env, |c| {
            let r = c.rank();
            // Every pair connected (AllToAll), then rank 3 leaves in the
            // middle of a large AllReduce that has pieces in flight.
            check(&c, &[0, 1, 2, 3]);
            let before = ends(&c);
            c.barrier().unwrap();
            if r == 3 {
                std::thread::sleep(Duration::from_millis(30));
                drop(c);
                return 0;
            }
            let mut v = vec![1.0f32; 4 << 20];
            assert!(c.all_reduce_in_place(&mut v, RedOp::Sum).is_err());
            let s = c.shrink(&[3]).unwrap();
            let after = ends(&s);
            // Every link between the three survivors is the same object.
            let mut same = 0;
            for q in 0..3usize {
                if q == r as usize {
                    continue;
                }
                assert_eq!(
                    after.0[q], before.0[q],
                    "rank {r}: the link to {q} was not kept"
                );
                assert_eq!(
                    after.1[q], before.1[q],
                    "rank {r}: the link from {q} was not kept"
                );
                same += 2;
            }
            check(&s, &[0, 1, 2]);
            same
        });
        assert_eq!(kept, vec![4, 4, 4, 0]);
    }

    #[test]
    fn a_healthy_shrink_keeps_links_and_leaves_the_old_communicator_working() {
        healthy_shrink(&[]);
    }

    #[test]
    fn a_healthy_shrink_keeps_socket_links() {
        healthy_shrink(&[("BRAID_TRANSPORT", "socket")]);
    }

    #[test]
    fn after_a_failure_socket_links_are_kept() {
        kept_after_a_death(&[("BRAID_TRANSPORT", "socket")]);
    }

    /// Rank 1 stays out of a shrink of a healthy communicator; the others'
    /// links move to the new one, which works, and the old one works again
    /// after (it reconnects the moved links).
    fn healthy_shrink(env: &[(&str, &str)]) {
        on_four_with(env, |c| {
            let r = c.rank();
            check(&c, &[0, 1, 2, 3]);
            let before = ends(&c);
            if r != 1 {
                let s = c.shrink(&[1]).unwrap();
                let after = ends(&s);
                let old = [0u32, 2, 3];
                for (nq, &q) in old.iter().enumerate() {
                    if q != r {
                        assert_eq!(after.0[nq], before.0[q as usize], "rank {r}: link to {q}");
                        assert_eq!(after.1[nq], before.1[q as usize], "rank {r}: link from {q}");
                    }
                }
                check(&s, &old);
            }
            // The old communicator connects its links again (rank 1 waits
            // in it for the others meanwhile).
            check(&c, &[0, 1, 2, 3]);
        });
    }
}
