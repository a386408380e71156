//! The typed collective API and the checks every call passes before
//! anything is sent.

use super::*;

impl Communicator {
    /// The element counts of `coll`'s send and receive buffers, once its
    /// description checks out against this communicator. Every call passes
    /// here and through [`Communicator::check_buf`]: the checks are inlined
    /// and their messages built out of line (`#[cold]`), so that an
    /// 8-byte call pays a few compares for them.
    #[inline]
    pub(super) fn check_coll(&self, coll: &Collective, dt: DataType) -> Result<[usize; 2]> {
        if let Collective::Group(_) = coll {
            return Err(Error::InvalidArgument(
                "point-to-point operations go through Communicator::group()".into(),
            ));
        }
        coll.validated_counts(dt, self.shared.rank, self.shared.nranks)
            .map_err(|e| self.invalid_coll(e))
    }

    #[cold]
    #[inline(never)]
    fn invalid_coll(&self, e: CoreError) -> Error {
        match e {
            CoreError::InvalidArgument(m) => {
                Error::InvalidArgument(format!("rank {}: {m}", self.shared.rank))
            }
            other => Error::Core(other),
        }
    }

    #[inline]
    pub(super) fn check_align(
        &self,
        coll: &Collective,
        what: &str,
        b: RawBuf,
        dt: DataType,
    ) -> Result<()> {
        // Every datatype's size is a power of two (`types` tests it): a
        // mask instead of a division.
        if b.len > 0 && (b.ptr as usize) & (dt.size() - 1) != 0 {
            return Err(self.misaligned(coll, what, b, dt));
        }
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn misaligned(&self, coll: &Collective, what: &str, b: RawBuf, dt: DataType) -> Error {
        Error::InvalidArgument(format!(
            "rank {}: {} {what} buffer at {:p} is not aligned for {dt} ({} bytes)",
            self.shared.rank,
            coll.name(),
            b.ptr,
            dt.size()
        ))
    }

    #[inline]
    pub(super) fn check_buf(
        &self,
        coll: &Collective,
        what: &str,
        b: RawBuf,
        count: usize,
        dt: DataType,
    ) -> Result<()> {
        self.check_align(coll, what, b, dt)?;
        if b.len != count * dt.size() {
            return Err(self.wrong_size(coll, what, b, count, dt));
        }
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn wrong_size(
        &self,
        coll: &Collective,
        what: &str,
        b: RawBuf,
        count: usize,
        dt: DataType,
    ) -> Error {
        let want = count * dt.size();
        let p = self.shared.nranks;
        Error::InvalidArgument(format!(
            "rank {}: {} {what} buffer holds {} bytes ({} elements of {dt}) but {want} bytes ({count} elements) are needed with {p} ranks",
            self.shared.rank,
            coll.name(),
            b.len,
            b.len / dt.size(),
        ))
    }

    /// AllReduce: `recv[i] = op over ranks of send[i]`.
    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: RedOp) -> Result<()> {
        let coll = Collective::AllReduce {
            count: send.len(),
            op,
        };
        self.run_coll_bytes(&coll, T::DTYPE, bytes(send), bytes_mut(recv))
    }

    /// AllReduce in place.
    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: RedOp) -> Result<()> {
        let coll = Collective::AllReduce {
            count: buf.len(),
            op,
        };
        self.run_coll_bytes_in_place(&coll, T::DTYPE, bytes_mut(buf))
    }

    /// ReduceScatter: `send` holds `nranks · n` elements, `recv` receives the
    /// `n` elements of block `rank` of the reduced array.
    pub fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: RedOp) -> Result<()> {
        let coll = Collective::ReduceScatter {
            recv_count: recv.len(),
            op,
        };
        self.run_coll_bytes(&coll, T::DTYPE, bytes(send), bytes_mut(recv))
    }

    /// ReduceScatter in place: `buf` holds `nranks · n` elements; the result
    /// lands in block `rank` of it.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: RedOp) -> Result<()> {
        let recv_count = self.block_count("ReduceScatter", buf.len())?;
        let coll = Collective::ReduceScatter { recv_count, op };
        self.run_coll_bytes_in_place(&coll, T::DTYPE, bytes_mut(buf))
    }

    /// AllGather: `recv` receives every rank's `send`, in rank order.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let coll = Collective::AllGather {
            send_count: send.len(),
        };
        self.run_coll_bytes(&coll, T::DTYPE, bytes(send), bytes_mut(recv))
    }

    /// AllGather in place: this rank's contribution is already in block
    /// `rank` of `buf`.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let send_count = self.block_count("AllGather", buf.len())?;
        let coll = Collective::AllGather { send_count };
        self.run_coll_bytes_in_place(&coll, T::DTYPE, bytes_mut(buf))
    }

    /// Broadcast in place: the root's `buf` is copied to every rank's `buf`.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: u32) -> Result<()> {
        let coll = Collective::Broadcast {
            count: buf.len(),
            root,
        };
        self.run_coll_bytes_in_place(&coll, T::DTYPE, bytes_mut(buf))
    }

    /// Broadcast out of place: `send` is read on the root only (other ranks
    /// may pass an empty slice).
    pub fn broadcast_from<T: Element>(&self, send: &[T], recv: &mut [T], root: u32) -> Result<()> {
        let coll = Collective::Broadcast {
            count: recv.len(),
            root,
        };
        self.run_coll_bytes(&coll, T::DTYPE, bytes(send), bytes_mut(recv))
    }

    /// Reduce to `root`: the root's `recv` receives the reduction of every
    /// rank's `send`; other ranks' `recv` is not used (may be empty).
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: RedOp,
        root: u32,
    ) -> Result<()> {
        let coll = Collective::Reduce {
            count: send.len(),
            op,
            root,
        };
        self.run_coll_bytes(&coll, T::DTYPE, bytes(send), bytes_mut(recv))
    }

    /// Reduce in place: the root's `buf` receives the result; other ranks'
    /// buffers are left as they are.
    pub fn reduce_in_place<T: Element>(&self, buf: &mut [T], op: RedOp, root: u32) -> Result<()> {
        let coll = Collective::Reduce {
            count: buf.len(),
            op,
            root,
        };
        self.run_coll_bytes_in_place(&coll, T::DTYPE, bytes_mut(buf))
    }

    /// AllToAll: block `j` of `send` goes to rank `j`, landing in block
    /// `rank` of its `recv`. Both hold `nranks · n` elements.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let count = self.block_count("AllToAll", send.len())?;
        self.run_coll_bytes(
            &Collective::AllToAll { count },
            T::DTYPE,
            bytes(send),
            bytes_mut(recv),
        )
    }

    pub(super) fn block_count(&self, op: &str, len: usize) -> Result<usize> {
        let p = self.shared.nranks as usize;
        if !len.is_multiple_of(p) {
            return Err(Error::InvalidArgument(format!(
                "rank {}: {op}: a buffer of {len} elements does not split into {p} equal blocks",
                self.shared.rank
            )));
        }
        Ok(len / p)
    }

    /// Send `buf` to `peer` (which must call [`Communicator::recv`]). Two
    /// ranks that send to each other must use a [`Group`].
    pub fn send<T: Element>(&self, buf: &[T], peer: u32) -> Result<()> {
        let mut g = self.group();
        g.send(buf, peer);
        g.run()
    }

    /// Receive `buf.len()` elements from `peer`.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: u32) -> Result<()> {
        let mut g = self.group();
        g.recv(buf, peer);
        g.run()
    }

    /// Start a group of point-to-point operations that progress together
    /// (the building block of AllToAllv, gather, scatter, halo exchanges).
    pub fn group<'a>(&'a self) -> Group<'a> {
        Group {
            comm: self,
            ops: Vec::new(),
            bufs: Vec::new(),
            dtype: None,
            error: None,
            _borrows: std::marker::PhantomData,
        }
    }
}

/// Point-to-point operations issued together; run them with [`Group::run`].
/// All operations of a group share one datatype.
#[derive(Debug)]
pub struct Group<'a> {
    comm: &'a Communicator,
    ops: Vec<P2p>,
    bufs: Vec<RawBuf>,
    dtype: Option<DataType>,
    error: Option<String>,
    _borrows: std::marker::PhantomData<&'a mut [u8]>,
}

impl<'a> Group<'a> {
    pub(super) fn add<T: Element>(&mut self, kind: P2pKind, peer: u32, b: RawBuf, count: usize) {
        match self.dtype {
            Some(d) if d != T::DTYPE => {
                self.error.get_or_insert(format!(
                    "a group mixes datatypes {d} and {}; issue one group per datatype",
                    T::DTYPE
                ));
            }
            _ => self.dtype = Some(T::DTYPE),
        }
        self.ops.push(P2p { kind, peer, count });
        self.bufs.push(b);
    }

    /// Add a send of `buf` to `peer`.
    pub fn send<T: Element>(&mut self, buf: &'a [T], peer: u32) -> &mut Self {
        self.add::<T>(P2pKind::Send, peer, raw_bytes(bytes(buf)), buf.len());
        self
    }

    /// Add a receive into `buf` from `peer`.
    pub fn recv<T: Element>(&mut self, buf: &'a mut [T], peer: u32) -> &mut Self {
        let n = buf.len();
        self.add::<T>(P2pKind::Recv, peer, raw_bytes(bytes_mut(buf)), n);
        self
    }

    /// Run every operation of the group; returns when all are done.
    pub fn run(self) -> Result<()> {
        if let Some(e) = self.error {
            return Err(Error::InvalidArgument(e));
        }
        let Some(dt) = self.dtype else { return Ok(()) };
        let coll = Collective::Group(self.ops);
        coll.validate(dt, self.comm.rank(), self.comm.nranks())
            .map_err(|e| match e {
                CoreError::InvalidArgument(m) => Error::InvalidArgument(m),
                other => Error::Core(other),
            })?;
        self.comm.run(coll, dt, &self.bufs)
    }
}

/// The bytes of a typed slice.
pub(super) fn bytes<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: Element types are plain numbers without padding; the byte view
    // covers exactly the slice's memory and borrows it for the same lifetime.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
}

/// The bytes of a typed slice, writable.
pub(super) fn bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes`; moreover every bit pattern is a valid value of
    // each Element type (integers, IEEE floats), so writes through the byte
    // view cannot produce invalid values.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut u8, std::mem::size_of_val(s)) }
}

/// A byte slice as the engine's raw buffer (writable only if it came from a
/// `&mut`: the plans never write a send buffer).
pub(super) fn raw_bytes(s: &[u8]) -> RawBuf {
    RawBuf {
        ptr: s.as_ptr() as *mut u8,
        len: s.len(),
    }
}
