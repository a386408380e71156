//! Streams: asynchronous, ordered execution of operations.
//!
//! A [`Stream`] is a worker thread bound to a communicator, like a CUDA
//! stream: operations submitted to it run in submission order, each call
//! returns a [`Handle`] at once, and [`Handle::wait`] returns the operation's
//! buffers when it is done. Buffers are moved into the operation (any
//! `AsRef<[T]>`/`AsMut<[T]>` owner: `Vec`, `Box<[T]>`, …), so nothing can
//! touch them while it runs.

use std::sync::mpsc;
use std::thread::JoinHandle;

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::{Element, RedOp};

type Job = Box<dyn FnOnce(&Communicator) + Send>;

/// An ordered queue of operations on one communicator.
#[derive(Debug)]
pub struct Stream {
    tx: Option<mpsc::Sender<Job>>,
    worker: Option<JoinHandle<()>>,
}

/// The pending result of an operation submitted to a [`Stream`].
#[derive(Debug)]
pub struct Handle<R> {
    rx: mpsc::Receiver<Result<R>>,
    done: Option<Result<R>>,
}

impl<R> Handle<R> {
    /// Block until the operation is done; returns its buffers.
    pub fn wait(mut self) -> Result<R> {
        if let Some(r) = self.done.take() {
            return r;
        }
        self.rx
            .recv()
            .unwrap_or_else(|_| Err(Error::Unusable("the stream's worker stopped".into())))
    }

    /// True once the operation finished (successfully or not).
    pub fn is_done(&mut self) -> bool {
        if self.done.is_none() {
            match self.rx.try_recv() {
                Ok(r) => self.done = Some(r),
                Err(mpsc::TryRecvError::Empty) => return false,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.done = Some(Err(Error::Unusable("the stream's worker stopped".into())))
                }
            }
        }
        true
    }
}

impl Stream {
    /// A new stream on `comm`.
    pub fn new(comm: &Communicator) -> Result<Stream> {
        let (tx, rx) = mpsc::channel::<Job>();
        let comm = comm.clone();
        let worker = std::thread::Builder::new()
            .name(format!("braid-stream-r{}", comm.rank()))
            .spawn(move || {
                // Nobody is blocked on what runs here: waits sleep early.
                crate::engine::set_background(true);
                while let Ok(job) = rx.recv() {
                    job(&comm);
                }
            })
            .map_err(|e| Error::BootstrapIo {
                what: "spawning a stream thread".into(),
                source: e,
            })?;
        Ok(Stream {
            tx: Some(tx),
            worker: Some(worker),
        })
    }

    /// Submit any work on the communicator; it runs after everything
    /// submitted before it.
    pub fn submit<R, F>(&self, f: F) -> Handle<R>
    where
        R: Send + 'static,
        F: FnOnce(&Communicator) -> Result<R> + Send + 'static,
    {
        let (rtx, rrx) = mpsc::channel();
        let job: Job = Box::new(move |c| {
            let _ = rtx.send(f(c));
        });
        let sent = self
            .tx
            .as_ref()
            .map(|tx| tx.send(job).is_ok())
            .unwrap_or(false);
        Handle {
            rx: rrx,
            done: (!sent).then(|| Err(Error::Unusable("the stream is closed".into()))),
        }
    }

    /// Block until everything submitted so far is done.
    pub fn synchronize(&self) -> Result<()> {
        self.submit(|_| Ok(())).wait()
    }

    /// AllReduce, asynchronously.
    pub fn all_reduce<T, S, R>(&self, send: S, mut recv: R, op: RedOp) -> Handle<(S, R)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        self.submit(move |c| {
            c.all_reduce(send.as_ref(), recv.as_mut(), op)
                .map(|_| (send, recv))
        })
    }

    /// AllReduce in place, asynchronously.
    pub fn all_reduce_in_place<T, B>(&self, mut buf: B, op: RedOp) -> Handle<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        self.submit(move |c| c.all_reduce_in_place(buf.as_mut(), op).map(|_| buf))
    }

    /// ReduceScatter, asynchronously.
    pub fn reduce_scatter<T, S, R>(&self, send: S, mut recv: R, op: RedOp) -> Handle<(S, R)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        self.submit(move |c| {
            c.reduce_scatter(send.as_ref(), recv.as_mut(), op)
                .map(|_| (send, recv))
        })
    }

    /// AllGather, asynchronously.
    pub fn all_gather<T, S, R>(&self, send: S, mut recv: R) -> Handle<(S, R)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        self.submit(move |c| {
            c.all_gather(send.as_ref(), recv.as_mut())
                .map(|_| (send, recv))
        })
    }

    /// Broadcast in place, asynchronously.
    pub fn broadcast<T, B>(&self, mut buf: B, root: u32) -> Handle<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        self.submit(move |c| c.broadcast(buf.as_mut(), root).map(|_| buf))
    }

    /// Reduce, asynchronously.
    pub fn reduce<T, S, R>(&self, send: S, mut recv: R, op: RedOp, root: u32) -> Handle<(S, R)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        self.submit(move |c| {
            c.reduce(send.as_ref(), recv.as_mut(), op, root)
                .map(|_| (send, recv))
        })
    }

    /// AllToAll, asynchronously.
    pub fn all_to_all<T, S, R>(&self, send: S, mut recv: R) -> Handle<(S, R)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        self.submit(move |c| {
            c.all_to_all(send.as_ref(), recv.as_mut())
                .map(|_| (send, recv))
        })
    }

    /// Barrier, asynchronously (`MPI_Ibarrier`): the handle completes once
    /// every rank reached the barrier, in this stream's order.
    pub fn barrier(&self) -> Handle<()> {
        self.submit(|c| c.barrier())
    }

    /// Send, asynchronously.
    pub fn send<T, B>(&self, buf: B, peer: u32) -> Handle<B>
    where
        T: Element,
        B: AsRef<[T]> + Send + 'static,
    {
        self.submit(move |c| c.send(buf.as_ref(), peer).map(|_| buf))
    }

    /// Receive, asynchronously.
    pub fn recv<T, B>(&self, mut buf: B, peer: u32) -> Handle<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        self.submit(move |c| c.recv(buf.as_mut(), peer).map(|_| buf))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Closing the queue lets the worker finish what was submitted, then
        // exit; every operation is bounded by the communicator's timeout.
        drop(self.tx.take());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}
