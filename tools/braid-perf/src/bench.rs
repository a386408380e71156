//! One rank's benchmark: buffers, the timed loops, the correctness checks
//! and the rows (printed by rank 0).

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use braid::{Collective, Communicator, CudaComm, DataType, RedOp};
use braid_core::reference::{self, GARBAGE};

use crate::cli::{Average, Bench, Opts, RootSel, Step, Timing, MAX_DURATION_ITERS};
use crate::format::{self, Meas};
use crate::report::{JsonMeas, Report, Row};

/// What went wrong in a run.
#[derive(Debug)]
pub enum BenchError {
    /// Bad options found once the communicator is known (e.g. a root out
    /// of range): exit status 2.
    Usage(String),
    /// braid failed.
    Braid(braid::Error),
    /// Writing output failed.
    Io(String),
}

impl std::fmt::Display for BenchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BenchError::Usage(m) | BenchError::Io(m) => f.write_str(m),
            BenchError::Braid(e) => write!(f, "{e}"),
        }
    }
}

impl From<braid::Error> for BenchError {
    fn from(e: braid::Error) -> Self {
        BenchError::Braid(e)
    }
}

/// The shape of one row: what nccl-tests prints and what braid runs.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    /// Bytes printed in the size column.
    pub size: u64,
    /// Elements printed in the count column (the operation's count
    /// parameter: per rank for all_gather/reduce_scatter, per peer for
    /// alltoall).
    pub count: u64,
    /// The collective (None for sendrecv, a group of a send and a recv).
    pub coll: Option<Collective>,
}

/// nccl-tests' `getCollByteCount`: the per-rank count of all_gather,
/// reduce_scatter and alltoall is size / nranks / typesize rounded down to a
/// multiple of 16 bytes; the others use size / typesize.
pub fn shape(bench: Bench, size: u64, dt: DataType, op: RedOp, root: u32, nranks: u32) -> Shape {
    let ws = dt.size() as u64;
    let p = u64::from(nranks.max(1));
    let count = size / ws;
    let (param, printed) = if bench.total_array() {
        let gran = (16 / ws).max(1);
        let per = count / p / gran * gran;
        (per, per * p * ws)
    } else {
        (count, count * ws)
    };
    let n = param as usize;
    let coll = match bench {
        Bench::AllReduce => Some(Collective::AllReduce { count: n, op }),
        Bench::ReduceScatter => Some(Collective::ReduceScatter { recv_count: n, op }),
        Bench::AllGather => Some(Collective::AllGather { send_count: n }),
        Bench::Broadcast => Some(Collective::Broadcast { count: n, root }),
        Bench::Reduce => Some(Collective::Reduce { count: n, op, root }),
        Bench::AllToAll => Some(Collective::AllToAll { count: n }),
        Bench::SendRecv => None,
    };
    Shape {
        size: printed,
        count: param,
        coll,
    }
}

/// Elements of the send and receive buffers (out-of-place) and of the
/// in-place buffer, for count parameter `n` on `p` ranks.
pub fn buffer_elems(bench: Bench, n: usize, p: usize) -> (usize, usize, usize) {
    match bench {
        Bench::AllReduce | Bench::Broadcast | Bench::Reduce | Bench::SendRecv => (n, n, n),
        Bench::ReduceScatter => (n * p, n, n * p),
        Bench::AllGather => (n, n * p, n * p),
        Bench::AllToAll => (n * p, n * p, n * p),
    }
}

/// Everything a rank needs to run one row.
#[derive(Clone, Copy, Debug)]
struct Case {
    bench: Bench,
    dt: DataType,
    op: RedOp,
    root: u32,
    in_place: bool,
}

/// Heap memory of `len` bytes aligned to `align`, freed on drop.
#[derive(Debug)]
struct Aligned {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: `Aligned` owns its allocation exclusively (like a Box<[u8]>).
unsafe impl Send for Aligned {}

impl Aligned {
    /// `len` bytes aligned to `align`, advised onto huge pages first when
    /// `huge`, then every byte set to `fill` (the first touch). Returns
    /// whether the huge-page advice was taken.
    fn new(len: usize, align: usize, huge: bool, fill: u8) -> Result<(Aligned, bool), BenchError> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), align)
            .map_err(|_| BenchError::Usage(format!("cannot lay out {len} bytes")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        let ptr = std::ptr::NonNull::new(ptr).ok_or_else(|| {
            BenchError::Usage(format!(
                "cannot allocate {len} bytes for a buffer: lower -e"
            ))
        })?;
        let a = Aligned { ptr, layout };
        // SAFETY: the allocation holds `layout.size()` bytes, owned by `a`;
        // nothing reads them as initialised before `write_bytes` below.
        let uninit: &mut [std::mem::MaybeUninit<u8>] =
            unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr().cast(), layout.size()) };
        let advised = huge && advise_huge(uninit);
        // SAFETY: as above; this initialises every byte.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), fill, layout.size()) };
        Ok((a, advised))
    }

    /// The bytes.
    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `new` initialised all `layout.size()` bytes, owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Where a benchmark buffer lives.
#[derive(Debug)]
enum Mem {
    /// The system allocator, like any application buffer.
    Heap(Aligned),
    /// `-R 1`: registered host memory (see [`braid::HostBuffer`]).
    Host(braid::HostBuffer),
}

impl Mem {
    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Mem::Heap(a) => a.bytes(),
            Mem::Host(h) => h.as_mut_slice(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Mem::Heap(a) => a.layout.size(),
            Mem::Host(h) => h.len(),
        }
    }
}

/// The benchmark's buffers: two allocations of the largest size, allocated
/// once and first-touched before any timing. Page-aligned; with huge pages
/// 2 MiB-aligned and a whole number of 2 MiB pages, so that every byte can
/// sit on a huge page (a `Vec` starts anywhere, and its first partial 2 MiB
/// stays on 4 KiB pages — where a 1 MiB message lives — which made
/// single-copy reads three times slower than Open MPI's on 2 MiB-aligned
/// glibc huge-page buffers). With `-R 1` both come from
/// [`braid::HostBuffer`] instead.
#[derive(Debug)]
pub struct Buffers {
    send: Mem,
    recv: Mem,
    huge: bool,
}

const HUGE_PAGE: usize = 2 << 20;

impl Buffers {
    /// Allocate `bytes` for each buffer — registered host buffers when
    /// `register`, else heap memory, optionally advised onto huge pages —
    /// and touch every page.
    pub fn new(bytes: u64, hugepages: bool, register: bool) -> Result<Buffers, BenchError> {
        let len = usize::try_from(bytes.div_ceil(8) * 8 + 8)
            .map_err(|_| BenchError::Usage(format!("{bytes} bytes do not fit in memory")))?;
        let alloc = || -> Result<(Mem, bool), BenchError> {
            if register {
                let mut h = braid::HostBuffer::new(len).map_err(|e| {
                    BenchError::Usage(format!(
                        "-R 1: cannot allocate {len} bytes of registered memory: {e} (lower -e, or run with -R 0)"
                    ))
                })?;
                h.fill(GARBAGE);
                return Ok((Mem::Host(h), false));
            }
            let (len, align) = if hugepages {
                (len.next_multiple_of(HUGE_PAGE), HUGE_PAGE)
            } else {
                (len, 4096)
            };
            let (a, advised) = Aligned::new(len, align, hugepages, GARBAGE)?;
            Ok((Mem::Heap(a), advised))
        };
        let (send, h1) = alloc()?;
        let (recv, h2) = alloc()?;
        Ok(Buffers {
            send,
            recv,
            huge: h1 && h2,
        })
    }

    /// The two buffers as bytes.
    pub fn bytes(&mut self) -> (&mut [u8], &mut [u8]) {
        (self.send.bytes(), self.recv.bytes())
    }

    /// How the buffers were allocated, for the header and the JSON.
    pub fn describe(&self) -> String {
        if matches!(self.send, Mem::Host(_)) {
            return format!(
                "2 x {} bytes per rank (-R 1: braid::HostBuffer, a sealed memory file mapped shared; ranks on this host map it and copy from it without process_vm_readv), first-touched before timing",
                self.send.len()
            );
        }
        let tun = std::env::var("GLIBC_TUNABLES").unwrap_or_else(|_| "-".into());
        format!(
            "2 x {} bytes per rank ({}-aligned, system allocator, {}, GLIBC_TUNABLES={tun}), first-touched before timing",
            self.send.len(),
            if self.huge { "2 MiB" } else { "page" },
            if self.huge {
                "madvise(MADV_HUGEPAGE)"
            } else {
                "no madvise"
            }
        )
    }
}

/// The GPU side of a `--device cuda` run: the device communicator, a stream
/// and device copies of the two buffers. Inputs are prepared on the host
/// (the same reference data as host runs), copied to the GPU, and results
/// copied back for the check.
pub struct DevState {
    cc: CudaComm,
    stream: braid_cuda::CudaStream,
    send: Arc<braid_cuda::DeviceBuffer>,
    recv: Arc<braid_cuda::DeviceBuffer>,
    /// Device-to-device copy bandwidth measured at start-up, GB/s.
    copy_bw: f64,
    copy_bytes: usize,
}

impl std::fmt::Debug for DevState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevState")
            .field("device", &self.cc.device().bus_id())
            .field("copy_bw", &self.copy_bw)
            .finish_non_exhaustive()
    }
}

impl DevState {
    fn new(comm: &Communicator, bytes: usize) -> Result<DevState, BenchError> {
        let cc = CudaComm::new(comm)?;
        let dev = cc.device().clone();
        let cuda = |e: braid_cuda::CudaError| BenchError::Braid(braid::Error::Cuda(e));
        let stream = braid_cuda::CudaStream::new(&dev).map_err(cuda)?;
        let send = Arc::new(braid_cuda::DeviceBuffer::alloc(&dev, bytes).map_err(cuda)?);
        let recv = Arc::new(braid_cuda::DeviceBuffer::alloc(&dev, bytes).map_err(cuda)?);
        let copy_bytes = bytes.clamp(64 << 20, 256 << 20);
        let copy_bw = braid_cuda::d2d_copy_bandwidth(&dev, copy_bytes, 20).map_err(cuda)?;
        Ok(DevState {
            cc,
            stream,
            send,
            recv,
            copy_bw,
            copy_bytes,
        })
    }

    /// Wait until the GPU finished everything issued so far.
    fn sync(&self) -> Result<(), BenchError> {
        self.cc.synchronize()?;
        self.stream
            .synchronize()
            .map_err(|e| BenchError::Braid(braid::Error::Cuda(e)))
    }
}

/// Copy the prepared host inputs (and the poisoned output) to the GPU.
fn upload(
    d: &DevState,
    case: &Case,
    shape: &Shape,
    send: &[u8],
    recv: &[u8],
    p: usize,
) -> Result<(), BenchError> {
    let ws = case.dt.size();
    let (sl, rl, il) = buffer_elems(case.bench, shape.count as usize, p);
    let cuda = |e: braid_cuda::CudaError| BenchError::Braid(braid::Error::Cuda(e));
    d.send.write(&send[..sl * ws]).map_err(cuda)?;
    d.recv.write(&recv[..rl.max(il) * ws]).map_err(cuda)
}

/// Copy the GPU's result back for the check.
fn download(
    d: &DevState,
    case: &Case,
    shape: &Shape,
    recv: &mut [u8],
    p: usize,
) -> Result<(), BenchError> {
    let ws = case.dt.size();
    let (_, rl, il) = buffer_elems(case.bench, shape.count as usize, p);
    d.sync()?;
    d.recv
        .read(&mut recv[..rl.max(il) * ws])
        .map_err(|e| BenchError::Braid(braid::Error::Cuda(e)))
}

/// Enqueue one operation of `shape` on the GPU buffers (out of place).
fn exec_dev(d: &DevState, comm: &Communicator, case: &Case, shape: &Shape) -> braid::Result<()> {
    let (p, r) = (comm.nranks(), comm.rank());
    match &shape.coll {
        Some(c) => d.cc.run(c, case.dt, &d.send, &d.recv, &d.stream),
        None => {
            let (to, from) = ((r + 1) % p, (r + p - 1) % p);
            let n = shape.count as usize;
            d.cc.send_recv(&d.send, to, &d.recv, from, n, case.dt, &d.stream)
        }
    }
}

/// Ask for transparent huge pages on the page-aligned interior of `v`
/// (before it is first touched). Returns whether the kernel accepted.
#[cfg(target_os = "linux")]
fn advise_huge(v: &mut [std::mem::MaybeUninit<u8>]) -> bool {
    const PAGE: usize = 4096;
    let start = v.as_mut_ptr() as usize;
    let end = start + std::mem::size_of_val(v);
    let (a, b) = (start.next_multiple_of(PAGE), end / PAGE * PAGE);
    if b <= a {
        return false;
    }
    // SAFETY: [a, b) lies inside `v`'s allocation, which we borrow mutably;
    // MADV_HUGEPAGE only changes how the kernel backs these pages, never
    // their contents or validity.
    unsafe { libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_HUGEPAGE) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge(_: &mut [std::mem::MaybeUninit<u8>]) -> bool {
    false
}

/// Run one operation of `shape` on the buffers.
fn exec(
    comm: &Communicator,
    case: &Case,
    shape: &Shape,
    send: &[u8],
    recv: &mut [u8],
) -> braid::Result<()> {
    let ws = case.dt.size();
    let (p, r) = (comm.nranks() as usize, comm.rank() as usize);
    let n = shape.count as usize;
    let (sl, rl, il) = buffer_elems(case.bench, n, p);
    match &shape.coll {
        Some(c) if case.in_place => comm.run_bytes_in_place(c, case.dt, &mut recv[..il * ws]),
        Some(c) => comm.run_bytes(c, case.dt, &send[..sl * ws], &mut recv[..rl * ws]),
        None => {
            let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
            let mut g = comm.group();
            g.send::<u8>(&send[..n * ws], next as u32);
            g.recv::<u8>(&mut recv[..n * ws], prev as u32);
            g.run()
        }
    }
}

/// Write this rank's inputs (exact under any reduction order) and fill the
/// receive side with garbage.
fn prepare(comm: &Communicator, case: &Case, shape: &Shape, send: &mut [u8], recv: &mut [u8]) {
    let (dt, ws) = (case.dt, case.dt.size());
    let (p, r) = (comm.nranks() as usize, comm.rank() as usize);
    let n = shape.count as usize;
    let (sl, rl, il) = buffer_elems(case.bench, n, p);
    recv[..rl.max(il) * ws].fill(GARBAGE);
    let dst: &mut [u8] = if case.in_place { recv } else { send };
    match case.bench {
        Bench::AllReduce | Bench::Reduce | Bench::ReduceScatter => {
            let input = reference::gen_at(dt, case.op, r, 0, sl);
            dst[..input.len()].copy_from_slice(&input);
        }
        Bench::AllGather => {
            let own = reference::gen_at(dt, RedOp::Sum, r, 0, n);
            let at = if case.in_place { r * n * ws } else { 0 };
            dst[at..at + own.len()].copy_from_slice(&own);
        }
        Bench::Broadcast | Bench::AllToAll | Bench::SendRecv => {
            let own = reference::gen_at(dt, RedOp::Sum, r, 0, sl);
            dst[..own.len()].copy_from_slice(&own);
        }
    }
}

/// Count this rank's wrong elements against the reference.
fn verify(comm: &Communicator, case: &Case, shape: &Shape, recv: &[u8]) -> u64 {
    let (dt, ws) = (case.dt, case.dt.size());
    let (p, r) = (comm.nranks() as usize, comm.rank() as usize);
    let n = shape.count as usize;
    let sum = RedOp::Sum;
    let concat = |f: &dyn Fn(usize) -> Vec<u8>| (0..p).flat_map(f).collect::<Vec<u8>>();
    let (got, want, op): (&[u8], Vec<u8>, RedOp) = match case.bench {
        Bench::AllReduce => (
            &recv[..n * ws],
            reference::reduced(dt, case.op, p, 0, n),
            case.op,
        ),
        Bench::Reduce => {
            if r != case.root as usize {
                return 0;
            }
            (
                &recv[..n * ws],
                reference::reduced(dt, case.op, p, 0, n),
                case.op,
            )
        }
        Bench::ReduceScatter => {
            let at = if case.in_place { r * n * ws } else { 0 };
            (
                &recv[at..at + n * ws],
                reference::reduced(dt, case.op, p, r * n, n),
                case.op,
            )
        }
        Bench::AllGather => (
            &recv[..n * p * ws],
            concat(&|q| reference::gen_at(dt, sum, q, 0, n)),
            sum,
        ),
        Bench::Broadcast => (
            &recv[..n * ws],
            reference::gen_at(dt, sum, case.root as usize, 0, n),
            sum,
        ),
        Bench::AllToAll => (
            &recv[..n * p * ws],
            concat(&|q| reference::gen_at(dt, sum, q, r * n, n)),
            sum,
        ),
        Bench::SendRecv => (
            &recv[..n * ws],
            reference::gen_at(dt, sum, (r + p - 1) % p, 0, n),
            sum,
        ),
    };
    reference::count_wrong(dt, op, got, &want) as u64
}

/// Faults injected for tests through `BRAID_PERF_FAULT`: `wrong:R` makes
/// rank R damage one element of every checked result (so the run must
/// report wrong values and fail); `exit:R` makes rank R exit with status 3
/// right after joining (so `-np` must stop the others and fail).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Wrong(u32),
    Exit(u32),
}

/// The fault requested by `BRAID_PERF_FAULT`, if any.
pub fn fault() -> Option<Fault> {
    let v = std::env::var("BRAID_PERF_FAULT").ok()?;
    let (kind, rank) = v.split_once(':')?;
    let rank = rank.trim().parse().ok()?;
    match kind.trim() {
        "wrong" => Some(Fault::Wrong(rank)),
        "exit" => Some(Fault::Exit(rank)),
        _ => None,
    }
}

/// The result of a run.
#[derive(Debug)]
pub struct Summary {
    pub report: Report,
    pub wrong_total: u64,
}

/// Drives the sweep on one rank.
pub struct Runner<'a> {
    comm: &'a Communicator,
    opts: &'a Opts,
    bufs: Buffers,
    dev: Option<DevState>,
    out: Box<dyn Write + 'a>,
}

impl std::fmt::Debug for Runner<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner")
            .field("rank", &self.comm.rank())
            .field("bench", &self.opts.bench)
            .field("bufs", &self.bufs)
            .finish_non_exhaustive()
    }
}

impl<'a> Runner<'a> {
    /// Allocate and touch the buffers. Rank 0 writes the table to `out`;
    /// the other ranks' output is discarded.
    pub fn new(
        comm: &'a Communicator,
        opts: &'a Opts,
        out: Box<dyn Write + 'a>,
    ) -> Result<Runner<'a>, BenchError> {
        if let RootSel::One(root) = opts.root {
            if opts.bench.rooted() && root >= comm.nranks() {
                return Err(BenchError::Usage(format!(
                    "-r {root}: root out of range for {} ranks (0..{})",
                    comm.nranks(),
                    comm.nranks() - 1
                )));
            }
        }
        let mut bufs = Buffers::new(opts.max_bytes, opts.hugepages, opts.register)?;
        let dev = if opts.cuda {
            let len = bufs.bytes().0.len();
            Some(DevState::new(comm, len)?)
        } else {
            None
        };
        let out: Box<dyn Write + 'a> = if comm.rank() == 0 {
            out
        } else {
            Box::new(std::io::sink())
        };
        Ok(Runner {
            comm,
            opts,
            bufs,
            dev,
            out,
        })
    }

    fn print(&mut self, s: &str) -> Result<(), BenchError> {
        self.out
            .write_all(s.as_bytes())
            .and_then(|_| self.out.flush())
            .map_err(|e| BenchError::Io(format!("cannot write the table: {e}")))
    }

    /// Host name, pid and transport per peer of every rank, on rank 0 (the
    /// one that prints them; the others get their own and their
    /// successors'). Gathered down the ring (rank r receives the lines of
    /// ranks r+1.. from rank r+1 and passes them with its own to rank
    /// r-1), so the benchmark connects no pair of ranks that its
    /// collectives do not (an AllGather here connected every pair, each
    /// shared-memory link costing memory).
    fn rank_lines(&self) -> Result<Vec<String>, BenchError> {
        const W: usize = 256;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .or_else(|_| std::env::var("HOSTNAME"))
            .unwrap_or_else(|_| "localhost".into());
        let me = self.comm.rank() as usize;
        let tr = match &self.dev {
            Some(d) => d.cc.transports(),
            None => self.comm.transports(),
        };
        let device = match &self.dev {
            Some(d) => format!(
                "cuda:{} {}",
                d.cc.device().ordinal(),
                d.cc.device().bus_id()
            ),
            None => "cpu".to_string(),
        };
        let peers: String = if tr.len() <= 9 {
            tr.iter()
                .enumerate()
                .filter(|(i, _)| *i != me)
                .map(|(i, t)| format!("{i}:{t}"))
                .collect::<Vec<_>>()
                .join(" ")
        } else {
            let mut kinds: Vec<(&str, usize)> = Vec::new();
            for (i, t) in tr.iter().enumerate() {
                if i == me {
                    continue;
                }
                match kinds.iter_mut().find(|(k, _)| k == t) {
                    Some((_, c)) => *c += 1,
                    None => kinds.push((t, 1)),
                }
            }
            kinds
                .iter()
                .map(|(k, c)| format!("{k} x{c}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let cpus = braid_core::topo::bind::allowed_cpus().map_or("?".into(), |c| c.to_list());
        let line = format!(
            "#  Rank {:>2} Group  0 Pid {:>6} on {:>10} device {} cpus {} [peers {}]",
            me,
            std::process::id(),
            host,
            device,
            cpus,
            if peers.is_empty() { "none" } else { &peers }
        );
        let mut mine = [0u8; W];
        let b = line.as_bytes();
        let n = b.len().min(W);
        // Cut on a character boundary.
        let n = (0..=n)
            .rev()
            .find(|&i| line.is_char_boundary(i))
            .unwrap_or(0);
        mine[..n].copy_from_slice(&b[..n]);
        let (r, p) = (self.comm.rank(), self.comm.nranks());
        let mut all = mine.to_vec();
        if r + 1 < p {
            let mut rest = vec![0u8; W * (p - r - 1) as usize];
            self.comm.recv(&mut rest, r + 1)?;
            all.extend_from_slice(&rest);
        }
        if r > 0 {
            self.comm.send(&all, r - 1)?;
        }
        Ok(all
            .chunks(W)
            .map(|c| {
                let end = c.iter().position(|&x| x == 0).unwrap_or(W);
                String::from_utf8_lossy(&c[..end]).into_owned()
            })
            .collect())
    }

    fn header(&mut self, ranks: &[String], buffers: &str) -> String {
        let o = self.opts;
        let step = match o.step {
            Step::Factor(f) => format!("{f}(factor)"),
            Step::Bytes(b) => format!("{b}(bytes)"),
        };
        let mut h = format!(
            "# braid-perf {} {}: braid {}, nccl-tests output format\n",
            env!("CARGO_PKG_VERSION"),
            o.bench.name(),
            env!("CARGO_PKG_VERSION"),
        );
        h += &format!(
            "# nranks {} minBytes {} maxBytes {} step: {step} warmup iters: {} iters: {} agg iters: {} validation: {} blocking: {} average: {}({}) cycles: {}\n",
            self.comm.nranks(),
            o.min_bytes,
            o.max_bytes,
            o.warmup,
            o.iters,
            o.agg,
            o.check,
            o.timing.code(),
            o.average.code(),
            o.average.name(),
            o.cycles,
        );
        h += &format!("# buffers: {buffers}\n");
        for var in ["BRAID_ALGO", "BRAID_TUNING_FILE"] {
            if let Some(v) = std::env::var(var).ok().filter(|v| !v.trim().is_empty()) {
                h += &format!("# algorithm: {var}={v} (see the per-size list after the table)\n");
            }
        }
        h += &format!(
            "# binding: {}\n",
            std::env::var(crate::launch::BINDING_ENV)
                .unwrap_or_else(|_| "by the launcher (each rank's CPUs below)".into())
        );
        h += match o.timing {
            Timing::Alone => "# timing: one synchronising op, then iters x agg ops each alone: an untimed barrier before each op, the op timed by itself (-z 2)\n",
            Timing::Blocking => "# timing: one synchronising op and a barrier, then iters x agg ops back to back on the calling thread, no barrier inside the timing (-z 1: except a barrier after each iteration)\n",
            Timing::Stream => "# timing: one synchronising op and a barrier, then iters x agg ops back to back on the calling thread, no barrier inside the timing\n",
        };
        if let Some(d) = o.duration {
            h += &format!("# duration: each size timed for about {d} s: the iterations above, then more in chunks until the slowest rank has timed {d} s (the count in the JSON output)\n");
        }
        if o.agg > 1 {
            h += "# agg iters: braid has no collective groups, so the ops of an iteration run one after another\n";
        }
        if let Some(d) = &self.dev {
            h += &format!(
                "# device: {} ({}), collectives on a CUDA stream ({} engine); device-to-device copy bandwidth measured in this run: {:.2} GB/s (cuMemcpyDtoDAsync, {} MiB x 20)\n",
                d.cc.device().name(),
                d.cc.device().bus_id(),
                d.cc.engine(),
                d.copy_bw,
                d.copy_bytes >> 20
            );
            h += "# timing: includes the wait for the stream after the last operation\n";
        }
        if o.bench.has_in_place() && self.dev.is_some() {
            h += "# in-place: N/A (not measured with --device cuda yet)\n";
        }
        if !o.bench.has_in_place() {
            h += &format!(
                "# in-place: N/A ({})\n",
                if o.bench == Bench::AllToAll {
                    "braid's in-place AllToAll is the out-of-place one after a copy"
                } else {
                    "a send and a receive of one group cannot share a buffer"
                }
            );
        }
        h += "#\n# Using devices\n";
        for l in ranks {
            h += l;
            h.push('\n');
        }
        h
    }

    /// Combine a per-rank time across ranks as `-a` says.
    fn combine(&self, t: f64) -> braid::Result<f64> {
        let mut v = [t];
        match self.opts.average {
            Average::Rank0 => self.comm.broadcast(&mut v, 0)?,
            Average::Avg => {
                self.comm.all_reduce_in_place(&mut v, RedOp::Sum)?;
                v[0] /= f64::from(self.comm.nranks());
            }
            Average::Min => self.comm.all_reduce_in_place(&mut v, RedOp::Min)?,
            Average::Max => self.comm.all_reduce_in_place(&mut v, RedOp::Max)?,
        }
        Ok(v[0])
    }

    /// Time one placement of one size; returns µs per operation and the
    /// iterations timed.
    fn time(&mut self, case: &Case, shape: &Shape) -> Result<(f64, u64), BenchError> {
        let comm = self.comm;
        let (iters, agg, timing) = (self.opts.iters, self.opts.agg, self.opts.timing);
        let (send, recv) = self.bufs.bytes();
        prepare(comm, case, shape, send, recv);
        let dev = self.dev.as_ref();
        let p = comm.nranks() as usize;
        let run = |send: &[u8], recv: &mut [u8]| -> braid::Result<()> {
            match dev {
                Some(d) => exec_dev(d, comm, case, shape),
                None => exec(comm, case, shape, send, recv),
            }
        };
        if let Some(d) = dev {
            upload(d, case, shape, send, recv, p)?;
        }
        run(send, recv)?;
        if let Some(d) = dev {
            d.sync()?;
        }
        comm.barrier()?;
        // Seconds `n` iterations took on this rank (-z 2: the ops' own
        // times, without the barriers between them).
        let mut batch = |n: u32| -> Result<f64, BenchError> {
            if timing == Timing::Alone {
                let mut total = 0.0;
                for _ in 0..n * agg {
                    comm.barrier()?;
                    let t0 = Instant::now();
                    run(send, recv)?;
                    if let Some(d) = dev {
                        d.sync()?;
                    }
                    total += t0.elapsed().as_secs_f64();
                }
                return Ok(total);
            }
            let t0 = Instant::now();
            for _ in 0..n {
                for _ in 0..agg {
                    run(send, recv)?;
                }
                if timing == Timing::Blocking {
                    if let Some(d) = dev {
                        d.sync()?;
                    }
                    comm.barrier()?;
                }
            }
            if let Some(d) = dev {
                d.sync()?;
            }
            Ok(t0.elapsed().as_secs_f64())
        };
        // -D: chunks until the slowest rank has timed `want` seconds (each
        // at most a quarter of it, from the time per iteration so far, so a
        // slow first chunk cannot stretch the run); the ranks agree after
        // each chunk, outside the timing.
        let mut n = iters;
        let mut secs = batch(n)?;
        if let Some(want) = self.opts.duration {
            loop {
                let mut v = [secs];
                comm.all_reduce_in_place(&mut v, RedOp::Max)?;
                // Iterations x agg stays a u32 (the loops count operations).
                let left = (MAX_DURATION_ITERS / agg.max(1)).saturating_sub(n);
                if v[0] >= want || left == 0 {
                    break;
                }
                let per = v[0].max(1e-9) / f64::from(n);
                let next = ((want - v[0]).min(want / 4.0) / per).ceil();
                let next = (next.min(f64::from(left)) as u32).max(1);
                secs += batch(next)?;
                n += next;
            }
        }
        let us = secs * 1e6 / (f64::from(n) * f64::from(agg));
        Ok((self.combine(us)?, u64::from(n)))
    }

    /// Run `-c` checked operations; returns wrong elements summed over
    /// ranks and check iterations.
    fn check(&mut self, case: &Case, shape: &Shape) -> Result<u64, BenchError> {
        let comm = self.comm;
        let mut wrong = 0u64;
        let corrupt = fault() == Some(Fault::Wrong(comm.rank()));
        for _ in 0..self.opts.check {
            let (send, recv) = self.bufs.bytes();
            prepare(comm, case, shape, send, recv);
            match &self.dev {
                Some(d) => {
                    let p = comm.nranks() as usize;
                    upload(d, case, shape, send, recv, p)?;
                    exec_dev(d, comm, case, shape)?;
                    download(d, case, shape, recv, p)?;
                }
                None => exec(comm, case, shape, send, recv)?,
            }
            if corrupt && shape.count > 0 {
                // Test hook: damage the first checked element.
                let at = match (case.bench, case.in_place) {
                    (Bench::ReduceScatter, true) => {
                        comm.rank() as usize * shape.count as usize * case.dt.size()
                    }
                    _ => 0,
                };
                recv[at] ^= 0x01;
            }
            wrong += verify(comm, case, shape, recv);
        }
        let mut w = [wrong];
        comm.all_reduce_in_place(&mut w, RedOp::Sum)?;
        Ok(w[0])
    }

    fn measure(&mut self, case: &Case, shape: &Shape) -> Result<Meas, BenchError> {
        let (t, iters) = self.time(case, shape)?;
        let wrong = if self.opts.check > 0 {
            Some(self.check(case, shape)?)
        } else {
            None
        };
        let mut m = Meas::new(case.bench, self.comm.nranks(), shape.size, t, wrong);
        m.iters = iters;
        Ok(m)
    }

    fn warmup(&mut self, case: &Case, sizes: &[u64]) -> Result<(), BenchError> {
        if self.opts.warmup == 0 {
            return Ok(());
        }
        let p = self.comm.nranks();
        let ends = [sizes.last(), sizes.first()];
        for size in ends.into_iter().flatten() {
            let sh = shape(case.bench, *size, case.dt, case.op, case.root, p);
            let (send, recv) = self.bufs.bytes();
            prepare(self.comm, case, &sh, send, recv);
            if let Some(d) = &self.dev {
                upload(d, case, &sh, send, recv, self.comm.nranks() as usize)?;
            }
            for _ in 0..self.opts.warmup {
                match &self.dev {
                    Some(d) => exec_dev(d, self.comm, case, &sh)?,
                    None => exec(self.comm, case, &sh, send, recv)?,
                }
            }
            if let Some(d) = &self.dev {
                d.sync()?;
            }
        }
        Ok(())
    }

    /// Run the whole sweep: header, rows, footer.
    pub fn run(&mut self, command: &str) -> Result<Summary, BenchError> {
        let o = self.opts;
        let p = self.comm.nranks();
        let sizes = crate::cli::size_sequence(o.min_bytes, o.max_bytes, o.step)
            .map_err(|e| BenchError::Usage(e.0))?;
        let ranks = self.rank_lines()?;
        let buffers = self.bufs.describe();
        let h = self.header(&ranks, &buffers);
        self.print(&h)?;
        self.print(&format::table_header())?;
        let roots: Vec<u32> = match (o.bench.rooted(), o.root) {
            (false, _) => vec![0],
            (true, RootSel::One(r)) => vec![r],
            (true, RootSel::All) => (0..p).collect(),
        };
        let mut rows = Vec::new();
        let mut algos: Vec<(u64, &str, String)> = Vec::new();
        let (mut wrong_total, mut bw_sum, mut bw_n) = (0u64, 0f64, 0u64);
        let mut cycle = 0u32;
        while o.cycles == 0 || cycle < o.cycles {
            for &dt in &o.dtypes {
                for op in o.effective_ops() {
                    for &root in &roots {
                        let oop = Case {
                            bench: o.bench,
                            dt,
                            op,
                            root,
                            in_place: false,
                        };
                        self.warmup(&oop, &sizes)?;
                        for &size in &sizes {
                            let sh = shape(o.bench, size, dt, op, root, p);
                            let m_oop = self.measure(&oop, &sh)?;
                            let m_ip = if o.bench.has_in_place() && self.dev.is_none() {
                                let ip = Case {
                                    in_place: true,
                                    ..oop
                                };
                                Some(self.measure(&ip, &sh)?)
                            } else {
                                None
                            };
                            for m in [Some(&m_oop), m_ip.as_ref()].into_iter().flatten() {
                                wrong_total += m.wrong.unwrap_or(0);
                                bw_sum += m.busbw;
                                bw_n += 1;
                            }
                            let root_col = if o.bench.rooted() {
                                i64::from(root)
                            } else {
                                -1
                            };
                            let redop = o.bench.redop_name(op);
                            let line = format::row(
                                sh.size,
                                sh.count,
                                dt.name(),
                                redop,
                                root_col,
                                Some(&m_oop),
                                m_ip.as_ref(),
                            );
                            self.print(&(line + "\n"))?;
                            let algorithm = match (&sh.coll, self.dev.is_none()) {
                                (Some(c), true) => self
                                    .comm
                                    .algorithm(c, dt)
                                    .map(|(a, by)| format!("{a} ({by})")),
                                _ => None,
                            };
                            if let Some(a) = &algorithm {
                                algos.push((sh.size, dt.name(), a.clone()));
                            }
                            rows.push(Row {
                                collective: o.bench.name().into(),
                                nranks: p,
                                size: sh.size,
                                count: sh.count,
                                dtype: dt.name().into(),
                                redop: redop.into(),
                                root: root_col,
                                cycle,
                                out_of_place: Some(JsonMeas::from(&m_oop)),
                                in_place: m_ip.as_ref().map(JsonMeas::from),
                                algorithm,
                            });
                        }
                    }
                }
            }
            cycle = cycle.saturating_add(1);
        }
        let avg = if bw_n > 0 { bw_sum / bw_n as f64 } else { 0.0 };
        if !algos.is_empty() {
            let mut t = String::from("# algorithm (chosen by) per size:\n");
            algos.dedup();
            for (size, dt, a) in &algos {
                t += &format!("# {size:>12}  {dt:>8}  {a}\n");
            }
            self.print(&t)?;
        }
        self.print(&format::footer(wrong_total, avg))?;
        Ok(Summary {
            report: Report {
                tool: "braid-perf".into(),
                version: env!("CARGO_PKG_VERSION").into(),
                label: o.label.clone().unwrap_or_else(|| "braid".into()),
                command: command.into(),
                buffers,
                ranks,
                rows,
                avg_busbw_gbps: avg,
                out_of_bounds: wrong_total,
            },
            wrong_total,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid::Config;

    #[test]
    fn huge_page_buffers_are_aligned_whole_pages_and_touched() {
        for (bytes, huge) in [(3u64 << 20, true), (1 << 20, true), (5000, false)] {
            let mut b = Buffers::new(bytes, huge, false).unwrap();
            let align = if huge { HUGE_PAGE } else { 4096 };
            let (s, r) = b.bytes();
            for v in [&*s, &*r] {
                assert_eq!(v.as_ptr() as usize % align, 0, "{bytes} {huge}");
                assert!(v.len() as u64 >= bytes + 8);
                if huge {
                    assert_eq!(v.len() % HUGE_PAGE, 0);
                }
                assert!(v.iter().all(|&x| x == GARBAGE));
            }
        }
    }

    #[test]
    fn shapes_follow_get_coll_byte_count() {
        let f = DataType::F32;
        let s = shape(Bench::AllReduce, 8, f, RedOp::Sum, 0, 4);
        assert_eq!((s.size, s.count), (8, 2));
        // all_gather 1 MiB on 4 ranks: 65536 floats per rank.
        let s = shape(Bench::AllGather, 1 << 20, f, RedOp::Sum, 0, 4);
        assert_eq!((s.size, s.count), (1 << 20, 65536));
        // Below 16 bytes per rank: 0 elements, size 0 (nccl-tests prints it so).
        let s = shape(Bench::ReduceScatter, 32, f, RedOp::Sum, 0, 4);
        assert_eq!((s.size, s.count), (0, 0));
        // 3 ranks: per-rank count rounded down to 16 bytes.
        let s = shape(Bench::AllToAll, 1000, f, RedOp::Sum, 0, 3);
        // 1000 B = 250 floats, 83 per peer, rounded down to 80 (320 B).
        assert_eq!((s.size, s.count), (960, 80));
        let s = shape(Bench::SendRecv, 7, f, RedOp::Sum, 0, 3);
        assert_eq!((s.size, s.count), (4, 1));
        assert!(s.coll.is_none());
        let s = shape(Bench::Broadcast, 64, DataType::F64, RedOp::Sum, 1, 2);
        assert_eq!(s.coll, Some(Collective::Broadcast { count: 8, root: 1 }));
    }

    /// The check path counts a corrupted element: run a real 2-rank
    /// AllReduce (threads), corrupt one element of rank 0's result and
    /// count again.
    #[test]
    fn a_corrupted_result_is_counted_wrong() {
        let comms = Communicator::init_threads(2, &Config::from_env().unwrap()).unwrap();
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                std::thread::spawn(move || {
                    let mut bufs = Buffers::new(4096, false, false).unwrap();
                    let case = Case {
                        bench: Bench::AllReduce,
                        dt: DataType::F32,
                        op: RedOp::Sum,
                        root: 0,
                        in_place: false,
                    };
                    let sh = shape(Bench::AllReduce, 4096, DataType::F32, RedOp::Sum, 0, 2);
                    let (send, recv) = bufs.bytes();
                    prepare(&comm, &case, &sh, send, recv);
                    exec(&comm, &case, &sh, send, recv).unwrap();
                    let clean = verify(&comm, &case, &sh, recv);
                    recv[4 * 7] ^= 0x40; // flip a bit of element 7
                    recv[4 * 100 + 3] ^= 0x80; // flip the sign of element 100
                    let dirty = verify(&comm, &case, &sh, recv);
                    // A receive buffer left as garbage is all wrong.
                    recv[..4096].fill(GARBAGE);
                    let garbage = verify(&comm, &case, &sh, recv);
                    (clean, dirty, garbage)
                })
            })
            .collect();
        for h in handles {
            let (clean, dirty, garbage) = h.join().unwrap();
            assert_eq!((clean, dirty, garbage), (0, 2, 1024));
        }
    }
}
