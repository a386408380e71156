//! Tagged point-to-point messages: a [`Mailbox`] matches every message by
//! (source, tag), as MPI and gloo do, and receives from any source.
//!
//! [`Communicator::group`]'s sends and receives match by order only, with
//! lengths agreed in advance. A mailbox lets a receive name a tag (a message
//! with another tag waits for its own receive) or no source at all, so the
//! receiver learns what arrives as it arrives. That needs two things the
//! group path does not have:
//!
//! - **A communicator of its own.** A receive from any source reads whatever
//!   comes next on every link; on links shared with collectives that could be
//!   a collective's data from a rank that is already ahead. The mailbox splits
//!   off a communicator that carries nothing else, connected to every rank at
//!   creation (a rank cannot know in advance who will send to it).
//! - **A progress loop that never blocks on a peer.** Each ordered pair's link
//!   carries a byte stream of messages (a 16-byte header: tag and length, then
//!   the payload). The stream travels in *bursts*: a head of fixed size
//!   ([`HEAD_BYTES`]: burst header and up to ~1000 bytes of the stream inline)
//!   and, when the link is empty, a body of up to a link's worth of one
//!   message's payload (taken straight from the sender's buffer, landing
//!   straight in the matched receive buffer). The loop runs rounds, each one
//!   engine operation (a [`Collective::Group`] through the slots, never by
//!   reference): a head goes out only where the link has a free slot, a body
//!   only where the link is empty (room for head and body), and a head is read
//!   only where one has arrived (a body always follows its head, already
//!   committed). So every transfer of a round completes without waiting for
//!   a peer to do anything, and no set of ranks can wait for each other in a
//!   cycle however the operations interleave (a ring of large sends and
//!   receives included). Between rounds the loop waits through the engine's
//!   [`Waiter`] on the links it needs (deadline, abort, peer liveness,
//!   doorbells), so a dead or silent peer is an error naming it.
//!
//! Matching is MPI's: receives match in the order they were posted, each
//! takes the oldest message from its source (or any source) with its tag;
//! a message that matches no posted receive is kept (unexpected) until one
//! does. A message's length must equal its receive's.

use std::collections::VecDeque;
use std::marker::PhantomData;

use braid_core::plan::{P2p, P2pKind};

use super::*;
use crate::engine::{Blocked, Waiter};

/// Bytes of a burst's head (at most the communicator's piece size).
const HEAD_BYTES: usize = 1024;
/// A head starts with this.
const HEAD_MAGIC: [u8; 4] = *b"BRMB";
/// Magic, inline length (u32), burst number (u64), body length (u64).
const HEAD_FIXED: usize = 24;
/// A message's header in the stream: tag (u64), length (u64).
const MSG_HDR: usize = 16;
/// What a receive from any rank waits for (timeouts name it).
const WAIT_ANY: &str = "a message for a receive from any rank";

/// Tagged point-to-point messaging on a communicator of its own (see
/// [`Communicator::mailbox`]): sends and receives carry a tag and match by
/// (source, tag) as MPI's and gloo's do; a receive may take a message from
/// any rank and says which rank sent it.
///
/// ```no_run
/// # fn main() -> braid::Result<()> {
/// let comm = braid::Communicator::from_env()?;
/// let mb = comm.mailbox()?; // every rank
/// if comm.rank() == 0 {
///     let mut x = [0u8; 4];
///     let from = mb.recv(&mut x, None, 7)?; // from any rank, tag 7
///     println!("rank {from} sent {x:?}");
/// } else if comm.rank() == 1 {
///     mb.send(&[1u8, 2, 3, 4], 0, 7)?;
/// }
/// # Ok(()) }
/// ```
///
/// Operations issued together ([`Mailbox::batch`]) progress together, so two
/// ranks may send each other messages of any size in one batch each. A send
/// completes once its bytes are on the link (the receiver keeps what it has
/// no receive for yet), a receive once its message arrived. Every wait has
/// the communicator's deadline; an error breaks the mailbox (not the
/// communicator it was split from). Cheap to clone.
#[derive(Clone, Debug)]
pub struct Mailbox {
    inner: Arc<MailboxInner>,
}

#[derive(Debug)]
struct MailboxInner {
    comm: Communicator,
    matcher: Mutex<Matcher>,
}

impl Communicator {
    /// Create a [`Mailbox`] for tagged point-to-point messages. Every rank
    /// calls it (a collective): it splits off a communicator that carries
    /// only the mailbox's messages and connects it to every rank.
    pub fn mailbox(&self) -> Result<Mailbox> {
        let comm = self
            .split(Some(0), 0)?
            .ok_or_else(|| Error::Unusable("the mailbox's communicator was not created".into()))?;
        comm.connect_every_peer()?;
        let head = HEAD_BYTES.min(comm.shared.piece);
        let p = comm.nranks() as usize;
        Ok(Mailbox {
            inner: Arc::new(MailboxInner {
                comm,
                matcher: Mutex::new(Matcher::new(p, head)),
            }),
        })
    }

    /// Connects both directions with every rank a transport reaches (every
    /// rank calls it).
    fn connect_every_peer(&self) -> Result<()> {
        let mut st = self.lock()?;
        let links = connect::LinkSet::all(self.shared.rank, &st.links.choice);
        if links.connected(&st.chans) {
            return Ok(());
        }
        // Part of creation, not an operation: no sequence number of its own.
        let op = OpId {
            name: "Mailbox",
            seq: st.seq,
        };
        self.connect_links(&mut st, &links, op)
    }
}

impl Mailbox {
    /// This rank.
    pub fn rank(&self) -> u32 {
        self.inner.comm.rank()
    }

    /// Number of ranks.
    pub fn nranks(&self) -> u32 {
        self.inner.comm.nranks()
    }

    /// The communicator the mailbox's messages travel on (its own, split
    /// off at creation): abort it to make a waiting operation fail.
    pub fn communicator(&self) -> &Communicator {
        &self.inner.comm
    }

    /// Start a batch of sends and receives that progress together.
    pub fn batch(&self) -> MailBatch<'_> {
        MailBatch {
            mb: self,
            sends: Vec::new(),
            recvs: Vec::new(),
            _borrows: PhantomData,
        }
    }

    /// Send `buf` to rank `to` with `tag`.
    pub fn send<T: Element>(&self, buf: &[T], to: u32, tag: u64) -> Result<()> {
        let mut b = self.batch();
        b.send(buf, to, tag);
        b.run().map(|_| ())
    }

    /// Receive the next message with `tag` from rank `from` (`None`: from
    /// any rank) into `buf`, whose length it must have; returns the sender.
    pub fn recv<T: Element>(&self, buf: &mut [T], from: Option<u32>, tag: u64) -> Result<u32> {
        let mut b = self.batch();
        b.recv(buf, from, tag);
        let src = b.run()?;
        src.first()
            .copied()
            .ok_or_else(|| Error::Unusable("a receive completed without a sender".into()))
    }
}

/// Sends and receives of a [`Mailbox`] issued together; run them with
/// [`MailBatch::run`].
#[derive(Debug)]
pub struct MailBatch<'a> {
    mb: &'a Mailbox,
    sends: Vec<(u32, u64, RawBuf)>,
    recvs: Vec<(Option<u32>, u64, RawBuf)>,
    _borrows: PhantomData<&'a mut [u8]>,
}

impl<'a> MailBatch<'a> {
    /// Add a send of `buf` to rank `to` with `tag`.
    pub fn send<T: Element>(&mut self, buf: &'a [T], to: u32, tag: u64) -> &mut Self {
        self.sends.push((to, tag, raw_bytes(ops::bytes(buf))));
        self
    }

    /// Add a receive into `buf` of the next message with `tag` from rank
    /// `from` (`None`: any rank).
    pub fn recv<T: Element>(&mut self, buf: &'a mut [T], from: Option<u32>, tag: u64) -> &mut Self {
        self.recvs.push((from, tag, raw_bytes(ops::bytes_mut(buf))));
        self
    }

    /// Run every operation of the batch; returns when all are done, with
    /// the sender of each receive (in the order they were added). Peers out
    /// of range or this rank itself are an error before anything is sent.
    pub fn run(self) -> Result<Vec<u32>> {
        if self.sends.is_empty() && self.recvs.is_empty() {
            return Ok(Vec::new());
        }
        let inner = &*self.mb.inner;
        let mut m = inner
            .matcher
            .lock()
            .map_err(|_| Error::Unusable("a thread panicked inside a mailbox operation".into()))?;
        let outs = self
            .sends
            .iter()
            .map(|&(to, tag, buf)| Out {
                to,
                tag,
                buf,
                hdr: false,
                sent: 0,
            })
            .collect();
        let ins = self
            .recvs
            .iter()
            .map(|&(from, tag, buf)| In {
                from,
                tag,
                buf,
                state: RState::Pending,
            })
            .collect();
        inner.comm.run_mail(&mut m, outs, ins)
    }
}

/// What a mailbox keeps between batches: where each peer's stream stands,
/// and the messages no receive took yet.
#[derive(Debug)]
struct Matcher {
    head: usize,
    rx: Vec<Rx>,
    /// Bursts sent to each peer.
    tx_seq: Vec<u64>,
    /// Unexpected messages, oldest first.
    stash: VecDeque<Stashed>,
    next_id: u64,
}

/// The stream from one peer.
#[derive(Debug, Default)]
struct Rx {
    /// Bursts read so far.
    seq: u64,
    /// Bytes of body that come next (0: a head comes next).
    body: usize,
    /// The message whose payload is arriving.
    cur: Option<Cur>,
}

#[derive(Debug)]
struct Cur {
    len: usize,
    done: usize,
    dest: Dest,
}

/// Where a message's payload goes: a receive of the running batch, or the
/// stash.
#[derive(Clone, Copy, Debug)]
enum Dest {
    Recv(usize),
    Stash(u64),
}

#[derive(Debug)]
struct Stashed {
    id: u64,
    from: u32,
    tag: u64,
    data: Vec<u8>,
    complete: bool,
    /// The receive of the running batch that took it while it arrives.
    claimed: Option<usize>,
}

/// A send of the running batch.
#[derive(Debug)]
struct Out {
    to: u32,
    tag: u64,
    buf: RawBuf,
    /// Its header is in the stream.
    hdr: bool,
    /// Payload bytes in the stream.
    sent: usize,
}

impl Out {
    fn done(&self) -> bool {
        self.hdr && self.sent == self.buf.len
    }

    /// Stream bytes still to go.
    fn left(&self) -> usize {
        (if self.hdr { 0 } else { MSG_HDR }) + self.buf.len - self.sent
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RState {
    Pending,
    /// Matched; its message (from this rank) is arriving.
    Active(u32),
    Done(u32),
}

/// A receive of the running batch.
#[derive(Debug)]
struct In {
    from: Option<u32>,
    tag: u64,
    buf: RawBuf,
    state: RState,
}

/// What one round moves.
#[derive(Default)]
struct Round {
    ops: Vec<P2p>,
    bufs: Vec<RawBuf>,
    /// Peers whose head we read (index into the heads buffer).
    heads: Vec<(u32, usize)>,
    /// Peers whose body we read.
    bodies: Vec<u32>,
}

impl Round {
    fn push(&mut self, kind: P2pKind, peer: u32, buf: RawBuf) {
        self.ops.push(P2p {
            kind,
            peer,
            count: buf.len,
        });
        self.bufs.push(buf);
    }
}

fn protocol(peer: u32, detail: impl Into<String>) -> CoreError {
    CoreError::Protocol {
        peer,
        detail: detail.into(),
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Copies `src` into `dst` at `off` (checked).
fn copy_into(dst: RawBuf, off: usize, src: &[u8]) -> std::result::Result<(), CoreError> {
    if off.checked_add(src.len()).is_none_or(|e| e > dst.len) {
        return Err(CoreError::InvalidArgument(format!(
            "mailbox: {} bytes at offset {off} do not fit a buffer of {}",
            src.len(),
            dst.len
        )));
    }
    // SAFETY: `dst` is a caller's buffer the running batch borrows for its
    // whole run (nothing else accesses it meanwhile), and the range lies
    // inside it (checked above); `src` is our own memory, apart from it.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.ptr.add(off), src.len()) };
    Ok(())
}

/// `len` bytes of `buf` from `off` (the callers keep them inside it; the
/// engine reads or writes them under [`host::execute`]'s contract).
fn sub(buf: RawBuf, off: usize, len: usize) -> RawBuf {
    debug_assert!(off + len <= buf.len);
    RawBuf {
        ptr: buf.ptr.wrapping_add(off),
        len,
    }
}

impl Matcher {
    fn new(p: usize, head: usize) -> Matcher {
        Matcher {
            head,
            rx: (0..p).map(|_| Rx::default()).collect(),
            tx_seq: vec![0; p],
            stash: VecDeque::new(),
            next_id: 0,
        }
    }

    fn stash_mut(&mut self, id: u64) -> std::result::Result<&mut Stashed, CoreError> {
        self.stash
            .iter_mut()
            .find(|s| s.id == id)
            .ok_or_else(|| CoreError::InvalidArgument("mailbox: a stashed message vanished".into()))
    }

    /// Receives take the oldest kept messages that match them (a batch's
    /// first step).
    fn claim_stashed(&mut self, me: u32, ins: &mut [In]) -> std::result::Result<(), CoreError> {
        for (i, r) in ins.iter_mut().enumerate() {
            let Some(k) = self.stash.iter().position(|s| {
                s.claimed.is_none() && s.tag == r.tag && r.from.is_none_or(|f| f == s.from)
            }) else {
                continue;
            };
            let s = &mut self.stash[k];
            if s.data.len() != r.buf.len {
                return Err(size_mismatch(me, s.from, s.tag, s.data.len(), r));
            }
            if s.complete {
                copy_into(r.buf, 0, &s.data)?;
                r.state = RState::Done(s.from);
                self.stash.remove(k);
            } else {
                s.claimed = Some(i);
                r.state = RState::Active(s.from);
            }
        }
        Ok(())
    }

    /// A message header from `from`: the first posted receive it matches,
    /// or the stash.
    fn open(
        &mut self,
        me: u32,
        from: u32,
        tag: u64,
        len: usize,
        ins: &mut [In],
    ) -> std::result::Result<Dest, CoreError> {
        let hit = ins.iter().position(|r| {
            r.state == RState::Pending && r.tag == tag && r.from.is_none_or(|f| f == from)
        });
        if let Some(i) = hit {
            let r = &mut ins[i];
            if r.buf.len != len {
                return Err(size_mismatch(me, from, tag, len, r));
            }
            r.state = RState::Active(from);
            return Ok(Dest::Recv(i));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.stash.push_back(Stashed {
            id,
            from,
            tag,
            data: vec![0; len],
            complete: false,
            claimed: None,
        });
        Ok(Dest::Stash(id))
    }

    /// Where payload byte `off` of the message arriving at `dest` goes.
    fn dest_buf(&mut self, dest: Dest, ins: &[In]) -> std::result::Result<RawBuf, CoreError> {
        Ok(match dest {
            Dest::Recv(i) => ins[i].buf,
            Dest::Stash(id) => {
                let s = self.stash_mut(id)?;
                RawBuf {
                    ptr: s.data.as_mut_ptr(),
                    len: s.data.len(),
                }
            }
        })
    }

    /// The message arriving at `dest` from `from` is complete.
    fn complete(
        &mut self,
        from: u32,
        dest: Dest,
        ins: &mut [In],
    ) -> std::result::Result<(), CoreError> {
        match dest {
            Dest::Recv(i) => ins[i].state = RState::Done(from),
            Dest::Stash(id) => {
                let s = self.stash_mut(id)?;
                s.complete = true;
                if let Some(i) = s.claimed {
                    copy_into(ins[i].buf, 0, &s.data)?;
                    ins[i].state = RState::Done(from);
                    self.stash.retain(|s| s.id != id);
                }
            }
        }
        Ok(())
    }

    /// Parses a head read from `from`.
    fn take_head(
        &mut self,
        me: u32,
        from: u32,
        h: &[u8],
        ins: &mut [In],
    ) -> std::result::Result<(), CoreError> {
        if h.len() != self.head || h[0..4] != HEAD_MAGIC {
            return Err(protocol(
                from,
                "a mailbox message arrived garbled (no burst head where one was due)",
            ));
        }
        let inline = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
        let (seq, body) = (u64_at(h, 8), u64_at(h, 16));
        let rx_seq = self.rx[from as usize].seq;
        if seq != rx_seq || inline > self.head - HEAD_FIXED {
            return Err(protocol(
                from,
                format!("mailbox burst #{seq} of {inline} bytes where #{rx_seq} was due"),
            ));
        }
        self.rx[from as usize].seq += 1;
        let data = &h[HEAD_FIXED..HEAD_FIXED + inline];
        let mut at = 0;
        while at < data.len() {
            match self.rx[from as usize]
                .cur
                .as_ref()
                .map(|c| (c.dest, c.len, c.done))
            {
                Some((dest, len, done)) => {
                    let n = (len - done).min(data.len() - at);
                    let buf = self.dest_buf(dest, ins)?;
                    copy_into(buf, done, &data[at..at + n])?;
                    at += n;
                    self.advance(from, n, ins)?;
                }
                None => {
                    if data.len() - at < MSG_HDR {
                        return Err(protocol(from, "a mailbox message header was cut"));
                    }
                    let (tag, len) = (u64_at(data, at), u64_at(data, at + 8));
                    at += MSG_HDR;
                    let len = usize::try_from(len)
                        .map_err(|_| protocol(from, "a mailbox message longer than memory"))?;
                    let dest = self.open(me, from, tag, len, ins)?;
                    if len == 0 {
                        self.complete(from, dest, ins)?;
                    } else {
                        self.rx[from as usize].cur = Some(Cur { len, done: 0, dest });
                    }
                }
            }
        }
        if body > 0 {
            let left = self.rx[from as usize]
                .cur
                .as_ref()
                .map_or(0, |c| (c.len - c.done) as u64);
            if body > left {
                return Err(protocol(
                    from,
                    format!("a mailbox body of {body} bytes where {left} were due"),
                ));
            }
            self.rx[from as usize].body = body as usize;
        }
        Ok(())
    }

    /// `n` more payload bytes of `from`'s current message arrived.
    fn advance(
        &mut self,
        from: u32,
        n: usize,
        ins: &mut [In],
    ) -> std::result::Result<(), CoreError> {
        let rx = &mut self.rx[from as usize];
        let Some(c) = rx.cur.as_mut() else {
            return Ok(());
        };
        c.done += n;
        if c.done == c.len {
            let dest = c.dest;
            rx.cur = None;
            self.complete(from, dest, ins)?;
        }
        Ok(())
    }
}

/// Keeps the error that best explains why a receive from any rank has no
/// rank left to wait for: a rank that died over one that gave up because of
/// another (whose reason relays the first cause anyway).
fn note_gone(kept: &mut Option<CoreError>, e: CoreError) {
    let relayed = |e: &CoreError| matches!(e, CoreError::PeerAborted { .. });
    if kept.as_ref().is_none_or(|k| relayed(k) && !relayed(&e)) {
        *kept = Some(e);
    }
}

fn size_mismatch(me: u32, from: u32, tag: u64, len: usize, r: &In) -> CoreError {
    let src = match r.from {
        Some(f) => format!("from rank {f}"),
        None => "from any rank".into(),
    };
    protocol(
        from,
        format!(
            "rank {from} sent {len} bytes with tag {tag} where rank {me} receives {} bytes with that tag ({src}): every rank must issue the same operations, with matching sizes",
            r.buf.len
        ),
    )
}

impl Communicator {
    /// Runs a mailbox batch to completion on this (the mailbox's own)
    /// communicator; the sender of each receive.
    fn run_mail(&self, m: &mut Matcher, mut outs: Vec<Out>, mut ins: Vec<In>) -> Result<Vec<u32>> {
        let sh = &*self.shared;
        let (me, p) = (sh.rank, sh.nranks);
        let mut st = self.lock()?;
        if let Some(why) = &st.broken {
            return Err(Error::Unusable(why.clone()));
        }
        if let Some(why) = sh.aborted_why() {
            return Err(Error::Unusable(why));
        }
        // Checks: nothing is sent before they pass.
        for o in &outs {
            if o.to >= p || o.to == me {
                return Err(Error::InvalidArgument(format!(
                    "rank {me}: send to rank {}: not another rank of this communicator (0..{p})",
                    o.to
                )));
            }
            if st.chans.send[o.to as usize].is_none() {
                return Err(Error::InvalidArgument(format!(
                    "rank {me}: no transport connects this rank and rank {}",
                    o.to
                )));
            }
        }
        for r in &ins {
            match r.from {
                Some(f) if f >= p || f == me => {
                    return Err(Error::InvalidArgument(format!(
                        "rank {me}: receive from rank {f}: not another rank of this communicator (0..{p})"
                    )))
                }
                Some(f) if st.chans.recv[f as usize].is_none() => {
                    return Err(Error::InvalidArgument(format!(
                        "rank {me}: no transport connects this rank and rank {f}"
                    )))
                }
                None if p < 2 => {
                    return Err(Error::InvalidArgument(format!(
                        "rank {me}: a receive from any rank, but this communicator has no other rank"
                    )))
                }
                _ => {}
            }
        }
        let name = match (outs.len(), ins.len()) {
            (1, 0) => "Send",
            (0, 1) => "Recv",
            _ => "Send/Recv",
        };
        let op = OpId { name, seq: st.seq };
        st.seq += 1;
        let _span = info_span!("op", op = name, seq = op.seq, rank = me).entered();
        self.step(&mut st, op, Some((0, true)), |st| {
            self.mail_loop(st, m, &mut outs, &mut ins)
        })?;
        Ok(ins
            .iter()
            .map(|r| match r.state {
                RState::Done(s) => s,
                _ => u32::MAX,
            })
            .collect())
    }

    fn mail_loop(
        &self,
        st: &mut State,
        m: &mut Matcher,
        outs: &mut [Out],
        ins: &mut [In],
    ) -> std::result::Result<(), CoreError> {
        let sh = &*self.shared;
        let (me, p) = (sh.rank, sh.nranks as usize);
        m.claim_stashed(me, ins)?;
        // Each peer's sends, in the order they were added.
        let mut to_peer: Vec<Vec<usize>> = vec![Vec::new(); p];
        for (i, o) in outs.iter().enumerate() {
            to_peer[o.to as usize].push(i);
        }
        let mut waiter = Waiter::new(&sh.policy, &sh.abort, Some(&sh.progress));
        let r = self.mail_steps(st, m, outs, ins, &to_peer, &mut waiter);
        if r.is_err() {
            waiter.disarm(&mut st.chans);
        }
        r
    }

    /// The rounds of a batch, and the waits between them.
    fn mail_steps(
        &self,
        st: &mut State,
        m: &mut Matcher,
        outs: &mut [Out],
        ins: &mut [In],
        to_peer: &[Vec<usize>],
        waiter: &mut Waiter<'_>,
    ) -> std::result::Result<(), CoreError> {
        let sh = &*self.shared;
        let (me, p) = (sh.rank, sh.nranks as usize);
        let head = m.head;
        let mut heads_out: Vec<u8> = Vec::new();
        let mut heads_in: Vec<u8> = Vec::new();
        // Ranks a receive from any rank no longer waits for: their link is
        // empty and they closed it or died (they cannot send any more), and
        // the first such error (reported if no rank is left to wait for).
        let mut gone = vec![false; p];
        let mut gone_err: Option<CoreError> = None;
        loop {
            let sending = outs.iter().any(|o| !o.done());
            let receiving = ins.iter().any(|r| !matches!(r.state, RState::Done(_)));
            if !sending && !receiving {
                return Ok(());
            }
            let any_src = ins
                .iter()
                .any(|r| r.state == RState::Pending && r.from.is_none());
            // Peers a pending receive names.
            let mut specific = vec![false; p];
            for r in ins.iter() {
                if let (RState::Pending, Some(f)) = (r.state, r.from) {
                    specific[f as usize] = true;
                }
            }
            let mut round = Round::default();
            let mut blocked: Vec<Blocked> = Vec::new();
            let mut any_blocked: Vec<Blocked> = Vec::new();
            // Sends: what each link has room for. (peer, where its head is
            // in `heads_out`, its body).
            let mut bursts: Vec<(u32, usize, Option<RawBuf>)> = Vec::new();
            heads_out.clear();
            for (q, list) in to_peer.iter().enumerate() {
                let left: usize = list.iter().map(|&i| outs[i].left()).sum();
                if left == 0 {
                    continue;
                }
                let ch = st.chans.sender(q as u32)?;
                let body_max = if ch.poll_drained()? {
                    ch.slots().saturating_sub(1) * sh.piece
                } else if left <= head - HEAD_FIXED && ch.poll_acquire()?.is_some() {
                    0
                } else {
                    blocked.push(Blocked::slot(q as u32));
                    continue;
                };
                // Fill the head (and pick the body) from the stream.
                let k = heads_out.len();
                heads_out.resize(k + head, 0);
                let h = &mut heads_out[k..k + head];
                let mut at = HEAD_FIXED;
                let mut body = None;
                for &i in list {
                    let o = &mut outs[i];
                    if o.done() {
                        continue;
                    }
                    if !o.hdr {
                        if head - at < MSG_HDR {
                            break;
                        }
                        h[at..at + 8].copy_from_slice(&o.tag.to_le_bytes());
                        h[at + 8..at + 16].copy_from_slice(&(o.buf.len as u64).to_le_bytes());
                        at += MSG_HDR;
                        o.hdr = true;
                    }
                    let n = (o.buf.len - o.sent).min(head - at);
                    // SAFETY: `o.buf` is a send buffer the running batch
                    // borrows for its whole run; sent + n ≤ its length.
                    let src = unsafe { std::slice::from_raw_parts(o.buf.ptr.add(o.sent), n) };
                    h[at..at + n].copy_from_slice(src);
                    at += n;
                    o.sent += n;
                    if o.sent < o.buf.len {
                        if body_max > 0 {
                            let b = (o.buf.len - o.sent).min(body_max);
                            body = Some(sub(o.buf, o.sent, b));
                            o.sent += b;
                        }
                        break;
                    }
                }
                h[0..4].copy_from_slice(&HEAD_MAGIC);
                h[4..8].copy_from_slice(&((at - HEAD_FIXED) as u32).to_le_bytes());
                h[8..16].copy_from_slice(&m.tx_seq[q].to_le_bytes());
                h[16..24].copy_from_slice(&(body.map_or(0, |b| b.len) as u64).to_le_bytes());
                m.tx_seq[q] += 1;
                bursts.push((q as u32, k, body));
            }
            // (`heads_out` is not resized again until the round has run.)
            let base = RawBuf {
                ptr: heads_out.as_mut_ptr(),
                len: heads_out.len(),
            };
            for &(q, k, body) in &bursts {
                round.push(P2pKind::Send, q, sub(base, k, head));
                if let Some(b) = body {
                    round.push(P2pKind::Send, q, b);
                }
            }
            // Receives: bodies due, and heads that have arrived where needed.
            let mut head_peers: Vec<u32> = Vec::new();
            for s in 0..p {
                if s == me as usize {
                    continue;
                }
                let rx = &m.rx[s];
                if rx.body > 0 {
                    let Some(c) = rx.cur.as_ref() else {
                        return Err(protocol(s as u32, "a mailbox body without its message"));
                    };
                    let (dest, done, body) = (c.dest, c.done, rx.body);
                    let buf = m.dest_buf(dest, ins)?;
                    if done + body > buf.len {
                        return Err(protocol(s as u32, "a mailbox body longer than its message"));
                    }
                    round.push(P2pKind::Recv, s as u32, sub(buf, done, body));
                    round.bodies.push(s as u32);
                } else if specific[s] || rx.cur.is_some() {
                    let Some(ch) = st.chans.recv[s].as_mut() else {
                        continue;
                    };
                    if ch.poll_peek_any()?.is_some() {
                        head_peers.push(s as u32);
                    } else {
                        blocked.push(Blocked::data(s as u32));
                    }
                } else if any_src && !gone[s] {
                    let Some(ch) = st.chans.recv[s].as_mut() else {
                        continue;
                    };
                    match ch.poll_peek_any() {
                        Ok(Some(_)) => head_peers.push(s as u32),
                        Ok(None) => any_blocked.push(Blocked::data(s as u32)),
                        Err(e) => {
                            gone[s] = true;
                            note_gone(&mut gone_err, e);
                        }
                    }
                }
            }
            heads_in.clear();
            heads_in.resize(head_peers.len() * head, 0);
            let base = RawBuf {
                ptr: heads_in.as_mut_ptr(),
                len: heads_in.len(),
            };
            for (j, &s) in head_peers.iter().enumerate() {
                round.push(P2pKind::Recv, s, sub(base, j * head, head));
                round.heads.push((s, j * head));
            }
            if round.ops.is_empty() {
                // Nothing can move: wait on every link we need.
                let only_any = blocked.is_empty();
                // Ranks waited for only by a receive from any rank.
                let any_only: Vec<u32> = any_blocked
                    .iter()
                    .map(|b| b.peer)
                    .filter(|&q| !blocked.iter().any(|b| b.peer == q))
                    .collect();
                blocked.extend(any_blocked);
                if blocked.is_empty() {
                    return Err(gone_err.unwrap_or_else(|| {
                        CoreError::InvalidArgument(
                            "mailbox: operations left with nothing to wait for".into(),
                        )
                    }));
                }
                match waiter.idle_any(&mut st.chans, &blocked, &[]) {
                    Ok(()) => continue,
                    // Such a rank left or died: wait for the others (its
                    // link is polled once more first, for what it sent
                    // before it left).
                    Err(e)
                        if !matches!(e, CoreError::Timeout { .. } | CoreError::Aborted(_))
                            && e.peer().is_some_and(|q| any_only.contains(&q)) =>
                    {
                        let q = e.peer().unwrap_or_default() as usize;
                        let data = st.chans.recv[q]
                            .as_mut()
                            .is_some_and(|c| c.poll_peek_any().is_ok_and(|x| x.is_some()));
                        if !data {
                            gone[q] = true;
                            note_gone(&mut gone_err, e);
                        }
                        continue;
                    }
                    // A receive from any rank timed out: a rank that died
                    // meanwhile is the likelier cause than the ones alive.
                    Err(CoreError::Timeout {
                        transport,
                        peer,
                        after,
                        ..
                    }) if only_any => {
                        return Err(gone_err.unwrap_or(CoreError::Timeout {
                            transport,
                            peer,
                            waiting_for: WAIT_ANY,
                            after,
                        }))
                    }
                    Err(e) => return Err(e),
                }
            }
            waiter.progressed(&mut st.chans);
            self.mail_round(st, round.ops, &round.bufs)?;
            // What arrived.
            for &s in &round.bodies {
                let n = std::mem::take(&mut m.rx[s as usize].body);
                m.advance(s, n, ins)?;
            }
            for &(s, k) in &round.heads {
                m.take_head(me, s, &heads_in[k..k + head], ins)?;
            }
        }
    }

    /// One round: `ops` over `bufs` as a group through the slots (no
    /// references, no operation headers: the mailbox's bursts check
    /// themselves).
    fn mail_round(
        &self,
        st: &mut State,
        ops: Vec<P2p>,
        bufs: &[RawBuf],
    ) -> std::result::Result<(), CoreError> {
        let sh = &*self.shared;
        let params = PlanParams {
            rank: sh.rank,
            ring: sh.ring.clone(),
            piece_bytes: sh.piece,
            move_piece_bytes: sh.piece,
            small_allreduce_bytes: 0,
            direct_moves: false,
        };
        let prog = plan::plan(&Collective::Group(ops), DataType::U8, &params)?;
        let job = Job {
            prog: &prog,
            scratch: 0,
            // Never by reference: a round must not wait for a peer to read.
            single_copy: false,
            by_ref: false,
            small_max: host::small_max(&prog),
        };
        let mode = Mode {
            stream_copies: false,
            slot_stores: true,
            headers: false,
            record: None,
        };
        // SAFETY: every buffer is a head of ours (alive for the round) or a
        // range of a caller's buffer that the running batch borrows (a send
        // buffer read, a receive buffer or stashed message written, each
        // written range used by this one op); ranges checked against their
        // buffers when the round was built. Datatype u8: no alignment.
        unsafe { st.split().1.run(sh, job, mode, bufs) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(secs: f64) -> Config {
        Config {
            timeout: Duration::from_secs_f64(secs),
            abort: None,
        }
    }

    /// Runs `f` on every rank's mailbox of a fresh `n`-rank communicator.
    fn on_mailboxes<R: Send + 'static>(
        n: u32,
        secs: f64,
        f: impl Fn(Mailbox) -> R + Send + Sync + Clone + 'static,
    ) -> Vec<R> {
        let comms = Communicator::init_threads(n, &config(secs)).expect("init_threads");
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = f.clone();
                std::thread::spawn(move || f(c.mailbox().expect("mailbox")))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    }

    fn pattern(n: usize, seed: u32) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u32).wrapping_mul(2654435761).wrapping_add(seed) as u8)
            .collect()
    }

    #[test]
    fn tags_match_out_of_order_and_unexpected_messages_wait() {
        on_mailboxes(2, 30.0, |mb| {
            let big = 3 << 20; // several bursts
            if mb.rank() == 0 {
                let (a, b, c) = (pattern(100, 1), pattern(big, 2), pattern(0, 3));
                let mut batch = mb.batch();
                batch.send(&a, 1, 1).send(&b, 1, 2).send(&c, 1, 3);
                batch.run().unwrap();
                // Then the same tag twice: order kept.
                mb.send(&pattern(10, 4), 1, 9).unwrap();
                mb.send(&pattern(10, 5), 1, 9).unwrap();
            } else {
                // Tag 3 first (behind 1 and 2 on the link), then 2, then 1.
                let mut c = [];
                assert_eq!(mb.recv::<u8>(&mut c, Some(0), 3).unwrap(), 0);
                let mut b = vec![0u8; big];
                mb.recv(&mut b, Some(0), 2).unwrap();
                assert!(b == pattern(big, 2));
                let mut a = vec![0u8; 100];
                mb.recv(&mut a, None, 1).unwrap();
                assert_eq!(a, pattern(100, 1));
                let (mut x, mut y) = (vec![0u8; 10], vec![0u8; 10]);
                let mut batch = mb.batch();
                batch.recv(&mut x, None, 9).recv(&mut y, Some(0), 9);
                assert_eq!(batch.run().unwrap(), vec![0, 0]);
                assert_eq!((x, y), (pattern(10, 4), pattern(10, 5)));
            }
        });
    }

    #[test]
    fn a_ring_of_large_exchanges_in_one_batch_each() {
        // Every rank sends to the next and receives from the previous, both
        // larger than a link holds: progress needs both in one batch.
        on_mailboxes(3, 30.0, |mb| {
            let (r, n) = (mb.rank(), mb.nranks());
            let len = 5 << 20;
            let out = pattern(len, r);
            let mut inb = vec![0u8; len];
            let mut b = mb.batch();
            b.send(&out, (r + 1) % n, 0)
                .recv(&mut inb, Some((r + n - 1) % n), 0);
            b.run().unwrap();
            assert!(inb == pattern(len, (r + n - 1) % n));
        });
    }

    #[test]
    fn any_source_reports_each_sender() {
        let got = on_mailboxes(4, 30.0, |mb| {
            let r = mb.rank();
            if r == 0 {
                let mut from = Vec::new();
                for _ in 0..6 {
                    let mut x = [0u32; 3];
                    let s = mb.recv(&mut x, None, 5).unwrap();
                    assert_eq!(x, [s; 3]);
                    from.push(s);
                }
                from.sort_unstable();
                from
            } else {
                mb.send(&[r; 3], 0, 5).unwrap();
                mb.send(&[r; 3], 0, 5).unwrap();
                Vec::new()
            }
        });
        assert_eq!(got[0], vec![1, 1, 2, 2, 3, 3]);
    }

    #[test]
    fn bad_peers_are_refused_and_size_mismatch_is_named() {
        on_mailboxes(2, 30.0, |mb| {
            let r = mb.rank();
            let e = mb.send(&[1u8], r, 0).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
            let e = mb.send(&[1u8], 5, 0).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
            // Still usable.
            if r == 0 {
                mb.send(&[7u8; 8], 1, 0).unwrap();
                let _ = mb.send(&[7u8; 8], 1, 1);
            } else {
                let mut x = [0u8; 8];
                mb.recv(&mut x, Some(0), 0).unwrap();
                assert_eq!(x, [7; 8]);
                let mut y = [0u8; 4];
                let e = mb.recv(&mut y, Some(0), 1).unwrap_err().to_string();
                assert!(
                    e.contains("sent 8 bytes with tag 1") && e.contains("receives 4 bytes"),
                    "{e}"
                );
            }
        });
    }

    #[test]
    fn any_source_reads_what_a_rank_sent_before_it_left_and_waits_past_it() {
        on_mailboxes(3, 30.0, |mb| match mb.rank() {
            0 => {
                // Rank 1 sent and left before this receive; rank 2 sends
                // later, after rank 1's link closed.
                std::thread::sleep(Duration::from_millis(300));
                let mut got = Vec::new();
                for _ in 0..2 {
                    let mut x = [0u32; 2];
                    let s = mb.recv(&mut x, None, 1).unwrap();
                    assert_eq!(x, [s; 2]);
                    got.push(s);
                }
                got.sort_unstable();
                assert_eq!(got, vec![1, 2]);
            }
            1 => {
                mb.send(&[1u32; 2], 0, 1).unwrap();
                drop(mb); // closes its links
            }
            _ => {
                std::thread::sleep(Duration::from_millis(600));
                mb.send(&[2u32; 2], 0, 1).unwrap();
            }
        });
    }

    #[test]
    fn a_receive_nobody_sends_times_out_naming_what_it_waits_for() {
        on_mailboxes(2, 1.0, |mb| {
            if mb.rank() == 0 {
                let mut x = [0u8; 4];
                let e = mb.recv(&mut x, None, 3).unwrap_err().to_string();
                assert!(
                    e.contains("timed out") && e.contains("from any rank"),
                    "{e}"
                );
            } else {
                // Alive (a rank that left would be named instead).
                std::thread::sleep(Duration::from_secs(2));
            }
        });
    }
}
