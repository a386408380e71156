//! Delay every packet of one netfilter queue by a fixed time: a stand-in for
//! `tc qdisc … netem delay` on kernels built without `sch_netem` (this
//! project's VMs have `NFQUEUE` but no netem).
//!
//!   braid-netdelay QUEUE DELAY_MS       (fractions allowed: 0.5)
//!
//! Run it inside a network namespace, then send that namespace's packets to
//! the queue, e.g. `iptables -A OUTPUT -o eth0 -j NFQUEUE --queue-num QUEUE`.
//! It prints `ready` once bound, holds each packet for DELAY_MS and then
//! accepts it (packets leave in the order they came), and exits when its
//! standard input closes — so it dies with the test that started it — after
//! printing `delayed N packets`. The queue fails open: if it overflows,
//! packets pass undelayed rather than being dropped.
//!
//! The netlink messages (nfnetlink_queue) are built by hand: a header, the
//! nfgenmsg, and attributes, all in network byte order where the kernel says.

use std::collections::VecDeque;
use std::io::Write;
use std::time::{Duration, Instant};

const NFNL_SUBSYS_QUEUE: u16 = 3;
const NFQNL_MSG_PACKET: u16 = 0;
const NFQNL_MSG_CONFIG: u16 = 2;
const NFQNL_MSG_VERDICT_BATCH: u16 = 3;
const NFQA_PACKET_HDR: u16 = 1;
const NFQA_VERDICT_HDR: u16 = 2;
const NFQA_CFG_CMD: u16 = 1;
const NFQA_CFG_PARAMS: u16 = 2;
const NFQA_CFG_QUEUE_MAXLEN: u16 = 3;
const NFQA_CFG_MASK: u16 = 4;
const NFQA_CFG_FLAGS: u16 = 5;
const NFQNL_CFG_CMD_BIND: u8 = 1;
const NFQNL_COPY_META: u8 = 1;
const NFQA_CFG_F_FAIL_OPEN: u32 = 1;
const NF_ACCEPT: u32 = 1;
const NLMSG_ERROR: u16 = 2;
const NLMSG_HDRLEN: usize = 16;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// One netlink message to the queue subsystem.
fn message(msg: u16, flags: u16, seq: u32, queue: u16, attrs: &[(u16, Vec<u8>)]) -> Vec<u8> {
    let mut b = vec![0u8; NLMSG_HDRLEN];
    // nfgenmsg: family AF_UNSPEC, version 0, resource id (the queue), big endian.
    b.extend_from_slice(&[libc::AF_UNSPEC as u8, 0]);
    b.extend_from_slice(&queue.to_be_bytes());
    for (ty, payload) in attrs {
        let len = 4 + payload.len();
        b.extend_from_slice(&(len as u16).to_ne_bytes());
        b.extend_from_slice(&ty.to_ne_bytes());
        b.extend_from_slice(payload);
        b.resize(align4(b.len()), 0);
    }
    let len = b.len() as u32;
    b[0..4].copy_from_slice(&len.to_ne_bytes());
    b[4..6].copy_from_slice(&((NFNL_SUBSYS_QUEUE << 8) | msg).to_ne_bytes());
    b[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16 | flags).to_ne_bytes());
    b[8..12].copy_from_slice(&seq.to_ne_bytes());
    b
}

struct Netlink {
    fd: libc::c_int,
}

impl Netlink {
    fn open() -> std::io::Result<Netlink> {
        // SAFETY: plain socket(2) call; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW, libc::NETLINK_NETFILTER) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let nl = Netlink { fd };
        let size: libc::c_int = 8 << 20;
        // SAFETY: `size` outlives the call and its length is passed. A failure
        // only leaves the default buffer size, so it is ignored.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                &size as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        // SAFETY: an all-zero sockaddr_nl is valid (pid 0: the kernel picks).
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `addr` is a valid sockaddr_nl and its size is passed.
        let r = unsafe {
            libc::bind(
                fd,
                &addr as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(nl)
    }

    fn send(&self, msg: &[u8]) -> std::io::Result<()> {
        // SAFETY: an all-zero sockaddr_nl addresses the kernel.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `msg` and `addr` are valid for the lengths passed.
        let r = unsafe {
            libc::sendto(
                self.fd,
                msg.as_ptr() as *const libc::c_void,
                msg.len(),
                0,
                &addr as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Non-blocking receive of one datagram into `buf`; `Ok(0)` when none.
    fn recv(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        // SAFETY: `buf` is valid for writes of its length.
        let r = unsafe {
            libc::recv(
                self.fd,
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) => Ok(0),
                // The kernel dropped messages for us (the queue fails open,
                // so those packets went through undelayed): carry on.
                Some(libc::ENOBUFS) => Ok(0),
                _ => Err(e),
            };
        }
        Ok(r as usize)
    }

    /// Send a request with an ACK and wait for the kernel's answer.
    fn request(&self, msg: &[u8], what: &str) -> Result<(), String> {
        self.send(msg).map_err(|e| format!("{what}: {e}"))?;
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut buf = vec![0u8; 65536];
        loop {
            let n = self.recv(&mut buf).map_err(|e| format!("{what}: {e}"))?;
            if n >= NLMSG_HDRLEN + 4 {
                let ty = u16::from_ne_bytes([buf[4], buf[5]]);
                if ty == NLMSG_ERROR {
                    let err = i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
                    return if err == 0 {
                        Ok(())
                    } else {
                        Err(format!(
                            "{what}: {}",
                            std::io::Error::from_raw_os_error(-err)
                        ))
                    };
                }
            }
            if Instant::now() > deadline {
                return Err(format!("{what}: no answer from the kernel"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Netlink {
    fn drop(&mut self) {
        // SAFETY: the descriptor is ours and closed once.
        unsafe { libc::close(self.fd) };
    }
}

/// Packet ids in the NFQA_PACKET_HDR attributes of the messages in `buf`.
fn packet_ids(buf: &[u8], out: &mut Vec<u32>) {
    let mut off = 0;
    while off + NLMSG_HDRLEN <= buf.len() {
        let len = u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]]) as usize;
        if len < NLMSG_HDRLEN || off + len > buf.len() {
            return;
        }
        let ty = u16::from_ne_bytes([buf[off + 4], buf[off + 5]]);
        if ty == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET {
            let mut a = off + NLMSG_HDRLEN + 4;
            while a + 4 <= off + len {
                let alen = u16::from_ne_bytes([buf[a], buf[a + 1]]) as usize;
                let aty = u16::from_ne_bytes([buf[a + 2], buf[a + 3]]) & 0x3fff;
                if alen < 4 || a + alen > off + len {
                    break;
                }
                if aty == NFQA_PACKET_HDR && alen >= 8 {
                    out.push(u32::from_be_bytes([
                        buf[a + 4],
                        buf[a + 5],
                        buf[a + 6],
                        buf[a + 7],
                    ]));
                }
                a += align4(alen);
            }
        }
        off += align4(len);
    }
}

fn run(queue: u16, delay: Duration) -> Result<u64, String> {
    let nl = Netlink::open().map_err(|e| format!("netlink socket: {e}"))?;
    let ack = libc::NLM_F_ACK as u16;
    let cmd = vec![NFQNL_CFG_CMD_BIND, 0, 0, 0];
    nl.request(
        &message(NFQNL_MSG_CONFIG, ack, 1, queue, &[(NFQA_CFG_CMD, cmd)]),
        "binding the queue (is another program bound to it?)",
    )?;
    // copy_range (u32, big endian) then copy_mode: metadata only.
    let mut params = 0u32.to_be_bytes().to_vec();
    params.push(NFQNL_COPY_META);
    nl.request(
        &message(
            NFQNL_MSG_CONFIG,
            ack,
            2,
            queue,
            &[
                (NFQA_CFG_PARAMS, params),
                (NFQA_CFG_QUEUE_MAXLEN, 65536u32.to_be_bytes().to_vec()),
                (NFQA_CFG_FLAGS, NFQA_CFG_F_FAIL_OPEN.to_be_bytes().to_vec()),
                (NFQA_CFG_MASK, NFQA_CFG_F_FAIL_OPEN.to_be_bytes().to_vec()),
            ],
        ),
        "configuring the queue",
    )?;
    println!("ready");
    let _ = std::io::stdout().flush();

    let mut pending: VecDeque<(Instant, u32)> = VecDeque::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut ids = Vec::new();
    let mut count = 0u64;
    let mut seq = 3u32;
    loop {
        let now = Instant::now();
        // Accept every packet whose time has come, in one batch verdict.
        let mut last = None;
        while let Some(&(due, id)) = pending.front() {
            if due > now {
                break;
            }
            last = Some(id);
            pending.pop_front();
        }
        if let Some(id) = last {
            let mut v = NF_ACCEPT.to_be_bytes().to_vec();
            v.extend_from_slice(&id.to_be_bytes());
            seq = seq.wrapping_add(1);
            nl.send(&message(
                NFQNL_MSG_VERDICT_BATCH,
                0,
                seq,
                queue,
                &[(NFQA_VERDICT_HDR, v)],
            ))
            .map_err(|e| format!("verdict: {e}"))?;
        }
        // The wait until the next packet is due, to the microsecond (a
        // millisecond poll would hold a 0.5 ms delay for 1-2 ms).
        let wait = match pending.front() {
            Some(&(due, _)) => due
                .saturating_duration_since(Instant::now())
                .max(Duration::from_micros(1)),
            None => Duration::from_millis(100),
        };
        let ts = libc::timespec {
            tv_sec: wait.as_secs() as libc::time_t,
            tv_nsec: wait.subsec_nanos() as libc::c_long,
        };
        let mut fds = [
            libc::pollfd {
                fd: nl.fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: 0,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfds, `ts` a valid
        // timespec; the signal mask is left alone (null).
        let r = unsafe { libc::ppoll(fds.as_mut_ptr(), 2, &ts, std::ptr::null()) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(format!("poll: {e}"));
        }
        if fds[1].revents != 0 {
            // Standard input closed (or anything arrived on it): stop. The
            // kernel releases our queued packets when the socket closes.
            let mut b = [0u8; 64];
            // SAFETY: `b` is valid for writes of its length.
            let n = unsafe { libc::read(0, b.as_mut_ptr() as *mut libc::c_void, b.len()) };
            if n <= 0 {
                return Ok(count);
            }
        }
        if fds[0].revents != 0 {
            loop {
                let n = nl.recv(&mut buf).map_err(|e| format!("receive: {e}"))?;
                if n == 0 {
                    break;
                }
                ids.clear();
                packet_ids(&buf[..n], &mut ids);
                let due = Instant::now() + delay;
                for &id in &ids {
                    pending.push_back((due, id));
                }
                count += ids.len() as u64;
            }
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let parsed = match (args.get(1), args.get(2)) {
        (Some(q), Some(d)) => q
            .parse::<u16>()
            .ok()
            .zip(d.parse::<f64>().ok().filter(|d| d.is_finite() && *d >= 0.0)),
        _ => None,
    };
    let Some((queue, delay_ms)) = parsed else {
        eprintln!("usage: braid-netdelay QUEUE DELAY_MS");
        std::process::exit(2);
    };
    match run(queue, Duration::from_secs_f64(delay_ms / 1e3)) {
        Ok(n) => println!("delayed {n} packets"),
        Err(e) => {
            eprintln!("braid-netdelay: {e}");
            std::process::exit(1);
        }
    }
}
