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
//! communicator then has a rendezvous of its own, hosted by that member,
//! and fresh links: links of the old one may be in the middle of a failed
//! operation, so none of their state is trusted.

use sha2::{Digest, Sha256};

use super::*;
use crate::bootstrap::{fmt_ranks, Ask};

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
    /// and after [`Communicator::revoke`]. Operations still pending on this
    /// communicator in other threads are not waited for: revoke or abort it
    /// first. This communicator itself is left as it is (drop it).
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
        let (id, root) = self.agree(tag, &keep, &view, &what, |disagree| {
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
        info!(
            rank = sh.rank,
            new_rank,
            size = keep.len(),
            dropped = %fmt_ranks(&dropped),
            "braid: shrink"
        );
        self.rebuild(&id, new_rank, keep.len() as u32, root)
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
        let (id, root) = self.agree(tag, &keep, &nranks.to_le_bytes(), &what, |disagree| {
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
        self.rebuild(&id, sh.rank, nranks, root)
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
    /// each sends `view` to the lowest member, which checks that all agree
    /// (`disagree` words the error, from the ranks that do not), gets the
    /// new rendezvous from `host` and answers every member with its id.
    /// Returns the id, and the root on the member that hosts it.
    fn agree(
        &self,
        tag: u64,
        members: &[u32],
        view: &[u8],
        what: &str,
        disagree: impl FnOnce(&[u32]) -> String,
        host: impl FnOnce(&Bootstrap) -> Result<(UniqueId, RootServer)>,
    ) -> Result<(UniqueId, Option<RootServer>)> {
        let sh = &*self.shared;
        let leader = members[0];
        let boot = self.boot()?;
        let fail = |e: crate::bootstrap::ExchangeError| {
            Error::Bootstrap(format!("rank {}: {what}: {e}", sh.rank))
        };
        if leader != sh.rank {
            let ask = |tag, msg: &[u8]| Ask {
                peer: leader,
                tag,
                msg: msg.to_vec(),
            };
            boot.exchange_past_abort(&[ask(tag, view)]).map_err(fail)?;
            let verdict = boot
                .exchange_past_abort(&[ask(tag + 1, &[])])
                .map_err(fail)?
                .pop()
                .unwrap_or_default();
            return match verdict.split_first() {
                Some((1, id)) => {
                    let id = std::str::from_utf8(id)
                        .map_err(|_| {
                            Error::Bootstrap(format!("{what}: rank {leader} sent a malformed id"))
                        })?
                        .parse()?;
                    Ok((id, None))
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
        let asks = |tag, msg: &[u8]| -> Vec<Ask> {
            others
                .iter()
                .map(|&peer| Ask {
                    peer,
                    tag,
                    msg: msg.to_vec(),
                })
                .collect()
        };
        let views = boot.exchange_past_abort(&asks(tag, view)).map_err(fail)?;
        let odd: Vec<u32> = others
            .iter()
            .zip(&views)
            .filter(|(_, v)| v.as_slice() != view)
            .map(|(&r, _)| r)
            .collect();
        let (verdict, result) = if !odd.is_empty() {
            let why = disagree(&odd);
            (
                [&[0u8][..], why.as_bytes()].concat(),
                Err(Error::Bootstrap(format!("{what}: {why}"))),
            )
        } else {
            match host(&boot) {
                Ok((id, root)) => (
                    [&[1u8][..], id.to_string().as_bytes()].concat(),
                    Ok((id, Some(root))),
                ),
                Err(e) => (
                    [&[0u8][..], format!("rank {leader}: {e}").as_bytes()].concat(),
                    Err(e),
                ),
            }
        };
        boot.exchange_past_abort(&asks(tag + 1, &verdict))
            .map_err(fail)?;
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
    ) -> Result<Communicator> {
        let sh = &*self.shared;
        let config = Config {
            timeout: sh.policy.timeout,
            abort: None,
        };
        Self::init_inner(id, rank, nranks, &config, root, sh.settings.clone())
    }
}
