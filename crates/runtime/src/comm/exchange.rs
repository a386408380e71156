//! Gather, Scatter and AllToAllv (blocks of any size): collectives whose
//! data goes straight from the rank that holds it to the rank that needs
//! it, each run as one group of point-to-point operations (as NCCL 2.28's
//! `ncclGather`, `ncclScatter` and `ncclAlltoAll` are grouped sends and
//! receives). Every argument is checked before anything is sent; a rank's
//! own block is a send to itself paired with a receive (a local copy).
//!
//! The typed forms take contiguous buffers (MPI's and NCCL's layout); the
//! untyped `*_bytes` forms take one byte slice per rank, which may live
//! anywhere (the Python binding passes the memory of a list of tensors).

use std::ops::Range;

use super::ops::{bytes, bytes_mut};
use super::*;

/// How a buffer of [`Communicator::all_to_all_v`] splits into one block per
/// rank: block `j` holds `counts[j]` elements from element `displs[j]`.
#[derive(Clone, Copy, Debug)]
pub struct Blocks<'a> {
    counts: &'a [usize],
    displs: Option<&'a [usize]>,
}

impl<'a> Blocks<'a> {
    /// Blocks back to back in rank order: block `j` starts where block
    /// `j - 1` ends (the displacements are the running sums of `counts`).
    pub fn packed(counts: &'a [usize]) -> Blocks<'a> {
        Blocks {
            counts,
            displs: None,
        }
    }

    /// Block `j` at element `displs[j]` (`MPI_Alltoallv`'s displacements).
    pub fn at(counts: &'a [usize], displs: &'a [usize]) -> Blocks<'a> {
        Blocks {
            counts,
            displs: Some(displs),
        }
    }
}

/// A writable byte slice as the engine's raw buffer.
fn raw_mut(b: &mut [u8]) -> RawBuf {
    RawBuf {
        ptr: b.as_mut_ptr(),
        len: b.len(),
    }
}

/// `p` blocks of `block` elements each, back to back in `buf` (which holds
/// exactly `p · block`).
fn split<T>(buf: &[T], block: usize, p: usize) -> Vec<&[T]> {
    if block == 0 {
        return vec![&[][..]; p];
    }
    buf.chunks(block).collect()
}

/// [`split`], writable.
fn split_mut<T>(buf: &mut [T], block: usize, p: usize) -> Vec<&mut [T]> {
    if block == 0 {
        return (0..p).map(|_| <&mut [T]>::default()).collect();
    }
    buf.chunks_mut(block).collect()
}

/// The ranges of `buf` as writable slices, in the order given; `None` if
/// two non-empty ranges overlap. Every range lies inside `buf` (checked by
/// the caller).
fn disjoint_mut<'b, T>(buf: &'b mut [T], ranges: &[Range<usize>]) -> Option<Vec<&'b mut [T]>> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| (ranges[i].start, ranges[i].end));
    let mut out: Vec<Option<&'b mut [T]>> = (0..ranges.len()).map(|_| None).collect();
    let (mut rest, mut at) = (buf, 0usize);
    for i in order {
        let r = ranges[i].clone();
        if r.is_empty() {
            out[i] = Some(<&mut [T]>::default());
            continue;
        }
        if r.start < at || r.end > at + rest.len() {
            return None;
        }
        let tail = std::mem::take(&mut rest).split_at_mut(r.start - at).1;
        let (block, tail) = tail.split_at_mut(r.len());
        out[i] = Some(block);
        (rest, at) = (tail, r.end);
    }
    out.into_iter().collect()
}

impl Communicator {
    /// Gather to `root` (`MPI_Gather`, `ncclGather`): the root's `recv`
    /// receives every rank's `send` in rank order, so it holds
    /// `nranks · send.len()` elements; other ranks' `recv` is not used
    /// (may be empty). Every rank sends as many elements.
    pub fn gather<T: Element>(&self, send: &[T], recv: &mut [T], root: u32) -> Result<()> {
        const OP: &str = "Gather";
        self.check_root(OP, root)?;
        if root != self.rank() {
            return self.gather_bytes(T::DTYPE, bytes(send), &mut [], root);
        }
        let p = self.nranks() as usize;
        self.check_whole(OP, ("send", send.len()), ("recv", recv.len()))?;
        let block = std::mem::size_of_val(send);
        let mut blocks = split_mut(bytes_mut(recv), block, p);
        self.gather_bytes(T::DTYPE, bytes(send), &mut blocks, root)
    }

    /// Scatter from `root` (`MPI_Scatter`, `ncclScatter`): block `j` of the
    /// root's `send`, which holds `nranks · recv.len()` elements, lands in
    /// rank `j`'s `recv`; other ranks' `send` is not used (may be empty).
    /// Every rank receives as many elements.
    pub fn scatter<T: Element>(&self, send: &[T], recv: &mut [T], root: u32) -> Result<()> {
        const OP: &str = "Scatter";
        self.check_root(OP, root)?;
        if root != self.rank() {
            return self.scatter_bytes(T::DTYPE, &[], bytes_mut(recv), root);
        }
        let p = self.nranks() as usize;
        self.check_whole(OP, ("recv", recv.len()), ("send", send.len()))?;
        let blocks = split(bytes(send), std::mem::size_of_val(recv), p);
        self.scatter_bytes(T::DTYPE, &blocks, bytes_mut(recv), root)
    }

    /// AllToAllv (`MPI_Alltoallv`): block `j` of `send` goes to rank `j`
    /// and lands in block `rank` of its `recv`; the blocks have any size
    /// (`send_blocks`, `recv_blocks`: counts and displacements in
    /// elements). Rank `i`'s count for rank `j` must equal rank `j`'s count
    /// for rank `i`. Send blocks may overlap; receive blocks may not.
    ///
    /// ```no_run
    /// # fn main() -> braid::Result<()> {
    /// use braid::Blocks;
    /// let comm = braid::Communicator::from_env()?;
    /// let (r, p) = (comm.rank() as usize, comm.nranks() as usize);
    /// // Rank r sends r + 1 elements to every rank.
    /// let send = vec![r as u32; (r + 1) * p];
    /// let send_counts = vec![r + 1; p];
    /// let recv_counts: Vec<usize> = (1..=p).collect();
    /// let mut recv = vec![0u32; recv_counts.iter().sum()];
    /// comm.all_to_all_v(
    ///     &send,
    ///     Blocks::packed(&send_counts),
    ///     &mut recv,
    ///     Blocks::packed(&recv_counts),
    /// )?;
    /// # Ok(()) }
    /// ```
    pub fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_blocks: Blocks<'_>,
        recv: &mut [T],
        recv_blocks: Blocks<'_>,
    ) -> Result<()> {
        const OP: &str = "AllToAllv";
        let sr = self.block_ranges(OP, "send", send_blocks, send.len())?;
        let rr = self.block_ranges(OP, "recv", recv_blocks, recv.len())?;
        let sends: Vec<&[u8]> = sr.iter().map(|r| bytes(&send[r.clone()])).collect();
        let Some(recvs) = disjoint_mut(recv, &rr) else {
            return Err(self.invalid(
                OP,
                "the blocks of recv overlap; give each rank a block of its own".into(),
            ));
        };
        let mut recvs: Vec<&mut [u8]> = recvs.into_iter().map(bytes_mut).collect();
        self.all_to_all_v_bytes(T::DTYPE, &sends, &mut recvs)
    }

    /// AllToAll in place: block `j` of `buf` (`nranks` equal blocks) goes
    /// to rank `j`, and block `j` is replaced by the block rank `j` sent
    /// (braid copies the send side first).
    pub fn all_to_all_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let count = self.block_count("AllToAll", buf.len())?;
        self.run_coll_bytes_in_place(&Collective::AllToAll { count }, T::DTYPE, bytes_mut(buf))
    }

    /// Gather on byte slices holding elements of `dt` (the untyped form,
    /// like NCCL's `void*` and datatype): on the root, `recvs[q]` receives
    /// rank `q`'s `send` (one slice per rank, each as long as `send`, which
    /// may live anywhere); other ranks' `recvs` is not used (may be empty).
    pub fn gather_bytes(
        &self,
        dt: DataType,
        send: &[u8],
        recvs: &mut [&mut [u8]],
        root: u32,
    ) -> Result<()> {
        const OP: &str = "Gather";
        self.check_root(OP, root)?;
        let send = raw_bytes(send);
        self.check_block(OP, "send", send, dt)?;
        if root != self.rank() {
            return self.exchange(OP, dt, &[(root, send)], &[]);
        }
        let blocks = recvs.iter_mut().map(|b| raw_mut(b));
        let recvs = self.rank_blocks(OP, "recv", blocks, dt, send.len)?;
        self.exchange(OP, dt, &[(root, send)], &recvs)
    }

    /// Scatter on byte slices holding elements of `dt` (see
    /// [`Communicator::gather_bytes`]): on the root, `sends[q]` goes to
    /// rank `q`'s `recv` (one slice per rank, each as long as `recv`);
    /// other ranks' `sends` is not used (may be empty).
    pub fn scatter_bytes(
        &self,
        dt: DataType,
        sends: &[&[u8]],
        recv: &mut [u8],
        root: u32,
    ) -> Result<()> {
        const OP: &str = "Scatter";
        self.check_root(OP, root)?;
        let recv = raw_mut(recv);
        self.check_block(OP, "recv", recv, dt)?;
        if root != self.rank() {
            return self.exchange(OP, dt, &[], &[(root, recv)]);
        }
        let blocks = sends.iter().map(|b| raw_bytes(b));
        let sends = self.rank_blocks(OP, "send", blocks, dt, recv.len)?;
        self.exchange(OP, dt, &sends, &[(root, recv)])
    }

    /// AllToAllv on byte slices holding elements of `dt` (see
    /// [`Communicator::gather_bytes`]): `sends[j]` goes to rank `j` and
    /// lands in its `recvs[rank]`; one slice per rank each, of any length
    /// (the receiver's slice as long as the sender's).
    pub fn all_to_all_v_bytes(
        &self,
        dt: DataType,
        sends: &[&[u8]],
        recvs: &mut [&mut [u8]],
    ) -> Result<()> {
        const OP: &str = "AllToAllv";
        let p = self.nranks() as usize;
        let me = self.rank() as usize;
        for (what, n) in [("send", sends.len()), ("recv", recvs.len())] {
            if n != p {
                return Err(self.invalid(
                    OP,
                    format!("{n} {what} blocks; it takes one per rank ({p})"),
                ));
            }
        }
        let sends: Vec<(u32, RawBuf)> = (0..p).map(|q| (q as u32, raw_bytes(sends[q]))).collect();
        let recvs: Vec<(u32, RawBuf)> = recvs
            .iter_mut()
            .enumerate()
            .map(|(q, b)| (q as u32, raw_mut(b)))
            .collect();
        for (what, list) in [("send", &sends), ("recv", &recvs)] {
            for &(q, b) in list {
                self.check_block(OP, &format!("{what} block {q}"), b, dt)?;
            }
        }
        let (mine, back) = (sends[me].1.len, recvs[me].1.len);
        if mine != back {
            return Err(self.invalid(
                OP,
                format!(
                    "this rank sends itself {} elements of {dt} but receives {}; both must be equal",
                    mine / dt.size(),
                    back / dt.size()
                ),
            ));
        }
        self.exchange(OP, dt, &sends, &recvs)
    }

    /// Runs `sends` and `recvs` (peer, bytes) as one group named `op`;
    /// empty transfers are left out. The buffers are borrowed by the
    /// caller for the call, receive buffers apart from every other buffer.
    fn exchange(
        &self,
        op: &'static str,
        dt: DataType,
        sends: &[(u32, RawBuf)],
        recvs: &[(u32, RawBuf)],
    ) -> Result<()> {
        let es = dt.size();
        let mut ops = Vec::with_capacity(sends.len() + recvs.len());
        let mut bufs = Vec::with_capacity(ops.capacity());
        let all = sends
            .iter()
            .map(|s| (P2pKind::Send, s))
            .chain(recvs.iter().map(|r| (P2pKind::Recv, r)));
        for (kind, &(peer, buf)) in all.filter(|(_, (_, b))| b.len > 0) {
            ops.push(P2p {
                kind,
                peer,
                count: buf.len / es,
            });
            bufs.push(buf);
        }
        if ops.is_empty() {
            return Ok(());
        }
        let coll = Collective::Group(ops);
        coll.validate(dt, self.rank(), self.nranks())
            .map_err(|e| match e {
                CoreError::InvalidArgument(m) => self.invalid(op, m),
                other => Error::Core(other),
            })?;
        self.run_named(coll, dt, &bufs, op)
    }

    /// An argument error of `op` on this rank.
    fn invalid(&self, op: &str, msg: String) -> Error {
        Error::InvalidArgument(format!("rank {}: {op}: {msg}", self.rank()))
    }

    fn check_root(&self, op: &str, root: u32) -> Result<()> {
        let p = self.nranks();
        if root >= p {
            return Err(self.invalid(
                op,
                format!(
                    "root {root} out of range: the communicator has ranks 0..{}",
                    p - 1
                ),
            ));
        }
        Ok(())
    }

    /// A block holds whole elements of `dt`, aligned for it.
    fn check_block(&self, op: &str, what: &str, b: RawBuf, dt: DataType) -> Result<()> {
        let es = dt.size();
        if !b.len.is_multiple_of(es) {
            return Err(self.invalid(
                op,
                format!(
                    "{what} holds {} bytes, not a whole number of {dt} elements ({es} bytes each)",
                    b.len
                ),
            ));
        }
        if b.len > 0 && !(b.ptr as usize).is_multiple_of(es) {
            return Err(self.invalid(
                op,
                format!("{what} at {:p} is not aligned for {dt} ({es} bytes)", b.ptr),
            ));
        }
        Ok(())
    }

    /// The root's buffer `whole` holds one block of `block`'s length per
    /// rank (each is (name, elements)).
    fn check_whole(&self, op: &str, block: (&str, usize), whole: (&str, usize)) -> Result<()> {
        let p = self.nranks() as usize;
        let want = block.1.checked_mul(p);
        if want != Some(whole.1) {
            return Err(self.invalid(
                op,
                format!(
                    "{} holds {} elements, so the root's {} must hold {p} x {} elements, not {}",
                    block.0, block.1, whole.0, block.1, whole.1
                ),
            ));
        }
        Ok(())
    }

    /// The root's per-rank slices of a Gather or Scatter, checked: one per
    /// rank, each `len` bytes, as (rank, bytes).
    fn rank_blocks(
        &self,
        op: &str,
        what: &str,
        blocks: impl ExactSizeIterator<Item = RawBuf>,
        dt: DataType,
        len: usize,
    ) -> Result<Vec<(u32, RawBuf)>> {
        let p = self.nranks() as usize;
        if blocks.len() != p {
            return Err(self.invalid(
                op,
                format!(
                    "the root passes {} {what} blocks; it needs one per rank ({p})",
                    blocks.len()
                ),
            ));
        }
        let mut out = Vec::with_capacity(p);
        for (q, b) in blocks.enumerate() {
            let name = format!("{what} block {q}");
            self.check_block(op, &name, b, dt)?;
            if b.len != len {
                let es = dt.size();
                return Err(self.invalid(
                    op,
                    format!(
                        "{name} holds {} elements of {dt} but every block needs {} (this rank's {})",
                        b.len / es,
                        len / es,
                        if what == "recv" { "send" } else { "recv" }
                    ),
                ));
            }
            out.push((q as u32, b));
        }
        Ok(out)
    }

    /// Each rank's block of a buffer of `len` elements as an element range,
    /// checked: one count (and displacement) per rank, inside the buffer.
    fn block_ranges(
        &self,
        op: &str,
        what: &str,
        blocks: Blocks<'_>,
        len: usize,
    ) -> Result<Vec<Range<usize>>> {
        let p = self.nranks() as usize;
        let lists = [("counts", Some(blocks.counts)), ("displs", blocks.displs)];
        for (name, list) in lists {
            if let Some(l) = list.filter(|l| l.len() != p) {
                return Err(self.invalid(
                    op,
                    format!(
                        "{what} {name} has {} entries; it needs one per rank ({p})",
                        l.len()
                    ),
                ));
            }
        }
        let mut out = Vec::with_capacity(p);
        let mut next = 0usize;
        for (q, &c) in blocks.counts.iter().enumerate() {
            let d = blocks.displs.map_or(next, |d| d[q]);
            let end = d.checked_add(c).filter(|&e| e <= len);
            let Some(end) = end else {
                return Err(self.invalid(
                    op,
                    format!(
                        "block {q} of {what} ({c} elements from element {d}) lies past its end ({len} elements)"
                    ),
                ));
            };
            out.push(d..end);
            next = end;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on every rank of a fresh `n`-rank communicator (threads).
    fn on_ranks<R: Send + 'static>(
        n: u32,
        secs: f64,
        f: impl Fn(Communicator) -> R + Send + Sync + Clone + 'static,
    ) -> Vec<R> {
        let config = Config {
            timeout: Duration::from_secs_f64(secs),
            abort: None,
        };
        let comms = Communicator::init_threads(n, &config).expect("init_threads");
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = f.clone();
                std::thread::spawn(move || f(c))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    }

    /// Element `i` of what rank `from` has for rank `to`.
    fn val(from: usize, to: usize, i: usize) -> u32 {
        ((from as u32) << 24) ^ ((to as u32) << 16) ^ ((i as u32).wrapping_mul(2654435761) >> 16)
    }

    const UNTOUCHED: u32 = 0xDEAD_BEEF;

    #[test]
    fn gather_and_scatter_match_a_plain_loop() {
        // Sizes from nothing to several pieces; every root.
        for n in [1u32, 2, 3, 5] {
            on_ranks(n, 60.0, move |c| {
                let (r, p) = (c.rank() as usize, n as usize);
                for count in [0usize, 1, 1000, 300_000] {
                    for root in 0..n {
                        let rt = root as usize;
                        // Gather: rank q's block is val(q, root, i).
                        let send: Vec<u32> = (0..count).map(|i| val(r, rt, i)).collect();
                        let mut recv = vec![UNTOUCHED; if r == rt { p * count } else { 3 }];
                        c.gather(&send, &mut recv, root).unwrap();
                        if r == rt {
                            for q in 0..p {
                                for i in 0..count {
                                    assert_eq!(
                                        recv[q * count + i],
                                        val(q, rt, i),
                                        "gather {n} {count} {root}"
                                    );
                                }
                            }
                        } else {
                            assert_eq!(recv, [UNTOUCHED; 3], "gather wrote a non-root's recv");
                        }
                        // Scatter: block q of the root's send is val(root, q, i).
                        let send: Vec<u32> = if r == rt {
                            (0..p * count)
                                .map(|k| val(rt, k / count.max(1), k % count.max(1)))
                                .collect()
                        } else {
                            Vec::new()
                        };
                        let mut recv = vec![UNTOUCHED; count];
                        c.scatter(&send, &mut recv, root).unwrap();
                        for (i, &x) in recv.iter().enumerate() {
                            assert_eq!(x, val(rt, r, i), "scatter {n} {count} {root}");
                        }
                    }
                }
            });
        }
    }

    /// Rank `from`'s count for rank `to` in case `k` (zeros included).
    fn count(from: usize, to: usize, k: usize) -> usize {
        [0, 1, 7, 1000, 3][(from * 3 + to * 7 + k) % 5] * (1 + k * (k % 2) * 150)
    }

    #[test]
    fn all_to_all_v_matches_a_plain_loop() {
        for n in [1u32, 2, 3, 4] {
            on_ranks(n, 60.0, move |c| {
                let (r, p) = (c.rank() as usize, n as usize);
                for k in 0..4 {
                    let sc: Vec<usize> = (0..p).map(|q| count(r, q, k)).collect();
                    let rc: Vec<usize> = (0..p).map(|q| count(q, r, k)).collect();
                    // Packed sends; receives in reverse rank order with a
                    // gap of 5 before each block (left untouched).
                    let send: Vec<u32> = (0..p)
                        .flat_map(|q| (0..sc[q]).map(move |i| val(r, q, i)))
                        .collect();
                    let mut rd = vec![0; p];
                    let mut at = 0;
                    for q in (0..p).rev() {
                        rd[q] = at + 5;
                        at += 5 + rc[q];
                    }
                    let mut recv = vec![UNTOUCHED; at];
                    c.all_to_all_v(&send, Blocks::packed(&sc), &mut recv, Blocks::at(&rc, &rd))
                        .unwrap();
                    let mut want = vec![UNTOUCHED; at];
                    for q in 0..p {
                        for i in 0..rc[q] {
                            want[rd[q] + i] = val(q, r, i);
                        }
                    }
                    assert!(recv == want, "all_to_all_v n={n} k={k} rank {r}");
                }
            });
        }
    }

    #[test]
    fn all_to_all_in_place_and_the_byte_forms_on_separate_blocks() {
        on_ranks(3, 60.0, |c| {
            let (r, p) = (c.rank() as usize, 3usize);
            for count in [0usize, 5, 200_000] {
                let mut buf: Vec<f64> = (0..p * count)
                    .map(|k| val(r, k / count.max(1), k % count.max(1)) as f64)
                    .collect();
                c.all_to_all_in_place(&mut buf).unwrap();
                for q in 0..p {
                    for i in 0..count {
                        assert_eq!(buf[q * count + i], val(q, r, i) as f64);
                    }
                }
            }
            // The untyped forms on blocks that live apart (as a list of
            // tensors does): each rank's block its own Vec.
            let dt = DataType::I64;
            let mk = |from: usize, to: usize| -> Vec<i64> {
                (0..to + 2).map(|i| val(from, to, i) as i64).collect()
            };
            let sends: Vec<Vec<i64>> = (0..p).map(|q| mk(r, q)).collect();
            let mut recvs: Vec<Vec<i64>> = (0..p).map(|_| vec![-1; r + 2]).collect();
            {
                let s: Vec<&[u8]> = sends.iter().map(|v| bytes(v)).collect();
                let mut d: Vec<&mut [u8]> = recvs.iter_mut().map(|v| bytes_mut(v)).collect();
                c.all_to_all_v_bytes(dt, &s, &mut d).unwrap();
            }
            for (q, v) in recvs.iter().enumerate() {
                assert_eq!(*v, mk(q, r));
            }
            let mine = mk(r, 1);
            let mut got: Vec<Vec<i64>> = (0..p).map(|_| vec![-1; 3]).collect();
            {
                let mut d: Vec<&mut [u8]> = got.iter_mut().map(|v| bytes_mut(v)).collect();
                let d = if r == 1 { &mut d[..] } else { &mut [][..] };
                c.gather_bytes(dt, bytes(&mine), d, 1).unwrap();
            }
            if r == 1 {
                for (q, v) in got.iter().enumerate() {
                    assert_eq!(*v, mk(q, 1));
                }
            }
            let mut back = vec![-1i64; 3];
            {
                let s: Vec<&[u8]> = got.iter().map(|v| bytes(v)).collect();
                let s = if r == 1 { &s[..] } else { &[][..] };
                c.scatter_bytes(dt, s, bytes_mut(&mut back), 1).unwrap();
            }
            assert_eq!(back, mk(r, 1));
        });
    }

    fn refused(r: Result<()>, says: &str) {
        match r {
            Err(Error::InvalidArgument(m)) => assert!(m.contains(says), "{m:?} lacks {says:?}"),
            other => panic!("expected InvalidArgument ({says}), got {other:?}"),
        }
    }

    #[test]
    fn bad_arguments_are_refused_before_anything_is_sent() {
        on_ranks(3, 20.0, |c| {
            let r = c.rank();
            let a = [1u32; 4];
            let mut b = [0u32; 12];
            refused(c.gather(&a, &mut b, 3), "root 3 out of range");
            refused(c.scatter(&b, &mut [0u32; 4], 7), "root 7 out of range");
            if r == 0 {
                // Only the root knows these are wrong: nothing is sent.
                refused(
                    c.gather(&a, &mut b[..11], 0),
                    "recv must hold 3 x 4 elements, not 11",
                );
                refused(
                    c.scatter(&b[..8], &mut [0u32; 4], 0),
                    "send must hold 3 x 4 elements, not 8",
                );
                let mut short = [0u8; 4];
                let mut blocks: Vec<&mut [u8]> = vec![&mut short[..]];
                refused(
                    c.gather_bytes(DataType::F32, bytes(&[0f32]), &mut blocks, 0),
                    "the root passes 1 recv blocks; it needs one per rank (3)",
                );
            }
            let counts = [1usize, 1, 1];
            let mut recv = [0u32; 3];
            refused(
                c.all_to_all_v(
                    &a,
                    Blocks::packed(&[1, 1]),
                    &mut recv,
                    Blocks::packed(&counts),
                ),
                "send counts has 2 entries",
            );
            refused(
                c.all_to_all_v(
                    &a,
                    Blocks::at(&counts, &[0, 1]),
                    &mut recv,
                    Blocks::packed(&counts),
                ),
                "send displs has 2 entries",
            );
            refused(
                c.all_to_all_v(
                    &a,
                    Blocks::at(&counts, &[0, 1, 4]),
                    &mut recv,
                    Blocks::packed(&counts),
                ),
                "block 2 of send (1 elements from element 4) lies past its end (4 elements)",
            );
            refused(
                c.all_to_all_v(
                    &a,
                    Blocks::packed(&counts),
                    &mut recv,
                    Blocks::at(&counts, &[0, 1, 1]),
                ),
                "the blocks of recv overlap",
            );
            let mut own = [0u32; 4];
            let mut rc = [1usize; 3];
            rc[r as usize] = 2;
            refused(
                c.all_to_all_v(&a, Blocks::packed(&counts), &mut own, Blocks::packed(&rc)),
                "this rank sends itself 1 elements of uint32 but receives 2",
            );
            // Untyped blocks that are not whole, aligned elements.
            let words = [0u64; 2];
            let raw = bytes(&words);
            let mut dst = [0u64; 2];
            let mut d: Vec<&mut [u8]> = (0..3).map(|_| Default::default()).collect();
            d[r as usize] = &mut bytes_mut(&mut dst)[..6];
            let s = [&raw[..6], &raw[..0], &raw[..0]];
            refused(
                c.all_to_all_v_bytes(DataType::F32, &s, &mut d),
                "send block 0 holds 6 bytes, not a whole number of float elements",
            );
            let s = [&raw[1..5], &raw[..0], &raw[..0]];
            refused(
                c.all_to_all_v_bytes(DataType::F32, &s, &mut d),
                "send block 0 at",
            );
            refused(
                c.all_to_all_in_place(&mut [0u8; 4]),
                "does not split into 3 equal blocks",
            );
            // Still usable: a real Gather works afterwards.
            let mut all = vec![0u32; 3];
            c.gather(&[r], &mut all, 2).unwrap();
            if r == 2 {
                assert_eq!(all, [0, 1, 2]);
            }
        });
    }

    #[test]
    fn a_gather_whose_counts_disagree_is_an_error_naming_it() {
        let got = on_ranks(3, 10.0, |c| {
            let r = c.rank();
            // Rank 1 sends 5 elements where the root expects 4.
            let send = vec![r; if r == 1 { 5 } else { 4 }];
            let mut recv = vec![0u32; if r == 0 { 12 } else { 0 }];
            c.gather(&send, &mut recv, 0).map_err(|e| e.to_string())
        });
        let e = got[0].as_ref().expect_err("the root saw the mismatch");
        assert!(e.contains("Gather"), "{e}");
    }
}
