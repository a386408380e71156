//! InfiniBand / RoCE transport: reliable-connected queue pairs and RDMA
//! WRITE WITH IMMEDIATE into the receiver's slot FIFO, over libibverbs
//! loaded at run time (all of that, and every `unsafe`, in `verbs/`).
//!
//! # Building and running
//!
//! Every build has this transport and needs nothing RDMA-related to build:
//! libibverbs (`libibverbs.so.1`, rdma-core v32 or later) is opened with
//! `dlopen` the first time a communicator looks for RDMA devices, as NCCL
//! does. A host with no `/sys/class/infiniband` devices does not even load
//! it. Without the library, or without a provider for the device
//! (`ibverbs-providers` on Debian), IB is "unavailable" with the reason
//! (`BRAID_DEBUG=INFO` shows the transport table) and TCP serves other
//! hosts; on a host that does have RDMA devices that is also a warning.
//!
//! # How the seam maps to verbs
//!
//! Each directed connection sender → receiver is `BRAID_IB_QPS_PER_CONNECTION`
//! RC queue pairs on each end, one completion queue with a completion
//! channel per end, and one **progress thread** per device and process that
//! polls the CQs of every end on that device (it spins briefly, then sleeps
//! on all their channels at once, so idle links cost nothing; a rank's
//! threads do not grow with its peers).
//!
//! - **Set-up.** Phase 1 (`listen` / `prepare_send`) opens nothing new on
//!   the wire: it creates the CQ and QPs, moves them to INIT, posts receive
//!   requests, registers a small control buffer and, on the receiving end,
//!   the slot FIFO (`slots × slot_bytes`, page-aligned, registered for
//!   remote writes). The blobs carry magic, version, both ranks, LID, GID,
//!   link layer, MTU, a random 24-bit PSN, the QP numbers, the control
//!   buffer's address and rkey, and (receiver) the FIFO's address, rkey and
//!   geometry. The sender's `connect` registers its staging slots (the ones
//!   the engine fills) and moves its QPs to RTR and RTS; it waits for
//!   nothing. The receiver's `connect` does the same, then sends a READY
//!   notice (zero-length write with immediate) on every QP and waits until
//!   the sender's HCA acknowledged them all: that proves the sender's QPs
//!   exist and accept packets. A sender that never attaches makes it return
//!   [`CoreError::Timeout`] at its deadline. Blobs are validated field by
//!   field; garbage is an error, never a panic.
//! - **Data.** Message `seq` lives in slot `seq % slots` on both ends. The
//!   sender may use a slot once READY arrived on every QP and it holds a
//!   credit (`committed − released < slots`). `commit` cuts the message in
//!   pieces of at least 64 KiB (one piece below 128 KiB), at most one per
//!   QP, piece `j` on QP `(seq + j) % qps`, and posts each as a signalled
//!   RDMA WRITE from the staging slot straight into the same slot of the
//!   receiver's FIFO, followed on the same QP by an 8-byte RDMA WRITE WITH
//!   IMMEDIATE (the *notice*) of the message length into the receiver's
//!   control buffer; the immediate says the slot and the number of pieces.
//!   Writes on one QP land in order, so when the receiver's progress thread
//!   has seen a notice from every QP of the message, the data and the length
//!   are in place; it publishes the slot's length with a release store, so
//!   `poll_peek` is one atomic load. The immediate also carries the
//!   message's sequence number mod 2^12: a notice that arrives twice or out
//!   of order is a protocol error naming the peer, never a new message
//!   (see *Soft-RoCE* below for how that happened).
//! - **Credits.** `release` posts a zero-length write with an immediate
//!   holding the receiver's cumulative count of released slots (mod 2^28) on
//!   QP 0; the sender's progress thread stores it, so `poll_acquire` and
//!   `poll_drained` are atomic loads. Credits on one QP arrive in order; a
//!   credit older than the last one (serial-number arithmetic) is ignored.
//! - **Failures.** Every send work request is signalled; a completion with
//!   an error (retry exceeded when the peer's process died or the path is
//!   gone, remote access error, ...) is recorded with the verbs status text,
//!   number and vendor error, and every later call returns
//!   [`CoreError::Peer`] naming the peer. The retry window is
//!   4.096 µs × 2^`BRAID_IB_TIMEOUT` × (`BRAID_IB_RETRY_CNT` + 1). An end
//!   that is being waited on (the engine calls `check_peer`) sends a
//!   zero-length keep-alive write every 500 ms, so a dead peer is noticed
//!   within that window even when no data flows. `abort(reason)` writes the
//!   reason into the peer's control buffer with an ABORT immediate (the
//!   peer reports [`CoreError::PeerAborted`] with it); dropping an end sends
//!   a CLOSE notice ("closed its end"), behind the receiver's last credit
//!   on QP 0. A receiver still delivers slots that arrived before a close,
//!   and a sender whose messages were all released is drained, not failed,
//!   when the close arrives in the same poll as the last credit.
//! - **Direct (single-copy) transfers** are not offered (the trait
//!   defaults): data is copied into a registered staging slot and written
//!   by the HCA.
//! - **Kept links** (a shrink): an idle link (nothing failed, aborted or
//!   unreleased; the last credit sent) goes on under its new peer rank from
//!   where it stands. A link that either end aborted (nothing else failed:
//!   the queue pairs still work, the peer did not close) goes on through a
//!   **resync**: once an end gives its resume point, every notice from the
//!   peer is skipped until the peer's resync notice on that QP (the
//!   receiver's on QP 0 for the sender, the sender's on every QP for the
//!   receiver). The sender's `resume` waits (at most 10 s) until every
//!   write of the old link completed, so that none lands in a slot after
//!   the new link's, then posts a resync notice carrying its count on
//!   every QP; the first one the receiver's progress thread sees restarts
//!   its count of data notices from there (writes on one QP land in order,
//!   so what follows a QP's resync is the new link's); the receiver's
//!   `resume` posts its own resync and waits for the sender's on every QP.
//!   What the receiver had not released is dropped; every slot is free.
//!
//! # Soft-RoCE: retransmissions can break a connection
//!
//! Between two QEMU guests with the 6.1 kernel's `rdma_rxe`, connections
//! used to fail after a while with "remote invalid request error" (verbs
//! status 9). Packet captures in both guests (`tcpdump` on the RoCE port,
//! every BTH decoded) and rxe's own state trace (dynamic debug) show why:
//!
//! 1. An ACK arrives late (the emulated guests are slow; with
//!    `BRAID_IB_TIMEOUT=14`, 67 ms, about 300 retransmissions per two-guest
//!    test run, no packet lost), so the requester's ACK timer fires and it
//!    resends its oldest unfinished RDMA WRITE `W` from its first packet.
//! 2. While `W` is being resent (rxe's `wqe_state_processing`), the late
//!    ACK for `W`'s last packet arrives. rxe's completer then advances its
//!    acknowledged PSN past `W` without retiring `W`.
//! 3. At the next retry, rxe computes how far into `W` to resume from that
//!    PSN, skips all of `W` and sends one extra zero-length `WRITE_ONLY`.
//!    Every later packet goes out one PSN later than its first copy.
//! 4. The responder takes the shifted packets beyond its expected PSN as
//!    new: it executes a notice (WRITE WITH IMMEDIATE) a second time (a
//!    duplicate credit or notice; this is the "stale credit" seen earlier),
//!    and then a `WRITE_MIDDLE` that does not follow a `WRITE_FIRST`:
//!    `ERR_MISSING_OPCODE_FIRST`, a NAK "invalid request", and both QPs go
//!    to the error state.
//!
//! With a 4 ms timeout (`BRAID_IB_TIMEOUT=10`) the failure comes within
//! seconds; with 1.07 s (18) a two-guest run on a busy host still saw 13
//! retransmissions. It needs a retransmission of a multi-packet write, so
//! braid cannot prevent it once the timer fires. What braid does: the default ACK timeout is
//! NCCL's 4.3 s (`BRAID_IB_TIMEOUT=20`), far above a late ACK in the
//! guests; the Soft-RoCE tests use it too (with fewer retries, so a dead
//! peer still shows within about 17 s); and a notice delivered twice is
//! reported as such instead of being taken for a message.
//!
//! # Choosing the device
//!
//! See [`probe`]: `BRAID_IB_HCA` (NCCL_IB_HCA syntax), active ports with
//! link layer InfiniBand or Ethernet, the RoCE v2 IPv4 GID by default
//! (`BRAID_IB_GID_INDEX`), the NIC on this process's NUMA node first. The
//! port's *fabric* (`ib:<subnet prefix>` or `roce`) goes to every rank at
//! start-up ([`Transport::fabric`](braid_core::transport::Transport::fabric)); IB connects two ranks when both have a
//! port on the same fabric.
//!
//! # Environment
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `BRAID_IB_HCA` | devices and ports to use (`mlx5_0:1,mlx5_1`, `^` excludes, `=` exact) | all |
//! | `BRAID_IB_GID_INDEX` | GID index (RoCE) | RoCE v2 IPv4-mapped |
//! | `BRAID_IB_QPS_PER_CONNECTION` | queue pairs per connection (each slot striped over them), 1–16 | 1 |
//! | `BRAID_IB_TIMEOUT` | ACK timeout exponent: 4.096 µs × 2^n, 1–31 | 20 (≈4.3 s, NCCL's; with 6 retries a dead peer is reported within ≈30 s). Keep it large on Soft-RoCE, see below |
//! | `BRAID_IB_RETRY_CNT` | retries before a retry-exceeded error, 0–7 (7 means forever on Soft-RoCE) | 6 |
//! | `BRAID_IB_SL`, `BRAID_IB_TC` | service level, traffic class | 0, 0 |
//! | `BRAID_IB_SLOT_BYTES`, `BRAID_IB_SLOTS` | slot geometry per connection | 512 KiB × 8 |

use braid_core::error::{CoreError, Result};

pub mod info;
pub mod probe;

mod link;
mod transport;
mod verbs;

pub use transport::{library_missing, ports, IbTransport};

/// The transport's name (`BRAID_TRANSPORT=ib`).
pub const NAME: &str = "ib";

/// Environment variable: devices and ports.
pub const ENV_HCA: &str = "BRAID_IB_HCA";
/// Environment variable: GID index.
pub const ENV_GID_INDEX: &str = "BRAID_IB_GID_INDEX";
/// Environment variable: QPs per connection.
pub const ENV_QPS: &str = "BRAID_IB_QPS_PER_CONNECTION";
/// Environment variable: ACK timeout exponent.
pub const ENV_TIMEOUT: &str = "BRAID_IB_TIMEOUT";
/// Environment variable: retry count.
pub const ENV_RETRY_CNT: &str = "BRAID_IB_RETRY_CNT";
/// Environment variable: service level.
pub const ENV_SL: &str = "BRAID_IB_SL";
/// Environment variable: traffic class.
pub const ENV_TC: &str = "BRAID_IB_TC";
/// Environment variable: bytes per slot.
pub const ENV_SLOT_BYTES: &str = "BRAID_IB_SLOT_BYTES";
/// Environment variable: slots per connection.
pub const ENV_SLOTS: &str = "BRAID_IB_SLOTS";
/// Environment variable for tests: `1` means the RDMA hardware is asked for,
/// so tests that need it fail without it instead of passing as skipped
/// (`scripts/rdma-guest.sh` sets it inside the Soft-RoCE guests).
pub const ENV_REQUIRE_IB: &str = "BRAID_REQUIRE_IB";

/// For tests that need an RDMA port: `Ok(true)` when the IB transport can
/// be created here with the current `BRAID_IB_*` environment; `Ok(false)`
/// after printing "skipped: needs an RDMA device: NEEDS (why)"; `Err` with
/// that text when [`ENV_REQUIRE_IB`] asks for the hardware.
pub fn available_for_tests(needs: &str) -> std::result::Result<bool, String> {
    let env = braid_core::config::process_env;
    let required =
        braid_core::config::flag(&env, ENV_REQUIRE_IB, false).map_err(|e| e.to_string())?;
    match IbConfig::from_env().and_then(IbTransport::new) {
        Ok(_) => Ok(true),
        Err(e) if required => Err(format!(
            "{ENV_REQUIRE_IB} is set but this test cannot run: needs an RDMA device: {needs} ({e})"
        )),
        Err(e) => {
            eprintln!("skipped: needs an RDMA device: {needs} ({e})");
            Ok(false)
        }
    }
}

/// Configuration of an IB transport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IbConfig {
    /// `BRAID_IB_HCA`.
    pub hca: Option<String>,
    /// `BRAID_IB_GID_INDEX`.
    pub gid_index: Option<u32>,
    /// Queue pairs per connection.
    pub qps: usize,
    /// ACK timeout exponent.
    pub timeout: u8,
    /// Retry count.
    pub retry_cnt: u8,
    /// Service level.
    pub sl: u8,
    /// Traffic class.
    pub tc: u8,
    /// Bytes per slot (of the connections this end receives on).
    pub slot_bytes: usize,
    /// Slots per connection.
    pub slots: usize,
    /// Device names, nearest first (from a topology planner); overrides
    /// the NUMA rule.
    pub nearest: Vec<String>,
}

impl Default for IbConfig {
    fn default() -> Self {
        IbConfig {
            hca: None,
            gid_index: None,
            // NCCL's default too. More QPs stripe each slot.
            qps: 1,
            // NCCL's default. An ACK timeout that fires while the ACK is
            // merely late makes the HCA retransmit, and Soft-RoCE (6.1)
            // can break a connection when that happens (crate docs).
            timeout: 20,
            // Not 7: Soft-RoCE (rdma_rxe) takes 7 to mean "retry forever",
            // and a dead peer would never be reported.
            retry_cnt: 6,
            sl: 0,
            tc: 0,
            slot_bytes: 512 * 1024,
            slots: 8,
            nearest: Vec::new(),
        }
    }
}

impl IbConfig {
    /// Defaults overridden by `BRAID_IB_*`; an error names a variable that
    /// is set but invalid.
    pub fn from_env() -> Result<IbConfig> {
        IbConfig::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like [`IbConfig::from_env`] with a custom lookup (tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<IbConfig> {
        use braid_core::config;
        let env: &dyn Fn(&str) -> Option<String> = &get;
        let num = |k: &str, d| -> Result<u32> {
            config::number::<u32>(env, k)
                .map(|v| v.unwrap_or(d))
                .map_err(|e| CoreError::InvalidArgument(e.to_string()))
        };
        let bytes = |k: &str, d| -> Result<usize> {
            config::number::<usize>(env, k)
                .map(|v| v.unwrap_or(d))
                .map_err(|e| CoreError::InvalidArgument(e.to_string()))
        };
        let d = IbConfig::default();
        let c = IbConfig {
            hca: config::value(env, ENV_HCA),
            gid_index: config::number::<u32>(env, ENV_GID_INDEX)
                .map_err(|e| CoreError::InvalidArgument(e.to_string()))?,
            qps: bytes(ENV_QPS, d.qps)?,
            timeout: num(ENV_TIMEOUT, d.timeout.into())?
                .try_into()
                .map_err(|_| {
                    CoreError::InvalidArgument(format!("{ENV_TIMEOUT}: must be 1 to 31"))
                })?,
            retry_cnt: num(ENV_RETRY_CNT, d.retry_cnt.into())?
                .try_into()
                .map_err(|_| {
                    CoreError::InvalidArgument(format!("{ENV_RETRY_CNT}: must be 0 to 7"))
                })?,
            sl: num(ENV_SL, d.sl.into())?
                .try_into()
                .map_err(|_| CoreError::InvalidArgument(format!("{ENV_SL}: must be 0 to 15")))?,
            tc: num(ENV_TC, d.tc.into())?
                .try_into()
                .map_err(|_| CoreError::InvalidArgument(format!("{ENV_TC}: must be 0 to 255")))?,
            slot_bytes: bytes(ENV_SLOT_BYTES, d.slot_bytes)?,
            slots: bytes(ENV_SLOTS, d.slots)?,
            nearest: Vec::new(),
        };
        c.validate()?;
        Ok(c)
    }

    /// Checks ranges; the error names the variable.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(CoreError::InvalidArgument(m));
        if let Err(e) = info::check_geometry(self.slot_bytes, self.slots, self.qps) {
            return bad(format!(
                "IB transport: {e} ({ENV_SLOT_BYTES}, {ENV_SLOTS}, {ENV_QPS})"
            ));
        }
        if !(1..=31).contains(&self.timeout) {
            return bad(format!("{ENV_TIMEOUT}={}: must be 1 to 31", self.timeout));
        }
        if self.retry_cnt > 7 {
            return bad(format!(
                "{ENV_RETRY_CNT}={}: must be 0 to 7",
                self.retry_cnt
            ));
        }
        if self.sl > 15 {
            return bad(format!("{ENV_SL}={}: must be 0 to 15", self.sl));
        }
        if let Some(h) = &self.hca {
            probe::HcaSpec::parse(h)
                .map_err(|e| CoreError::InvalidArgument(format!("{ENV_HCA}={h:?}: {e}")))?;
        }
        Ok(())
    }

    /// Slot geometry of the connections this end receives on.
    pub fn with_geometry(mut self, slot_bytes: usize, slots: usize) -> Self {
        self.slot_bytes = slot_bytes;
        self.slots = slots;
        self
    }

    /// Queue pairs per connection.
    pub fn with_qps(mut self, qps: usize) -> Self {
        self.qps = qps;
        self
    }

    /// ACK timeout exponent and retry count.
    pub fn with_timeout(mut self, timeout: u8, retry_cnt: u8) -> Self {
        self.timeout = timeout;
        self.retry_cnt = retry_cnt;
        self
    }

    /// Device names, nearest first.
    pub fn with_nearest(mut self, devices: Vec<String>) -> Self {
        self.nearest = devices;
        self
    }

    /// The retry window: how long a dead peer may go unnoticed while data
    /// is outstanding.
    pub fn retry_window(&self) -> std::time::Duration {
        let one = 4.096e-6 * f64::from(1u32 << self.timeout);
        std::time::Duration::from_secs_f64(one * f64::from(self.retry_cnt + 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<IbConfig> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        IbConfig::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn environment_is_parsed_and_checked() {
        assert_eq!(cfg(&[]).unwrap(), IbConfig::default());
        let c = cfg(&[
            (ENV_QPS, "4"),
            (ENV_TIMEOUT, "14"),
            (ENV_RETRY_CNT, "3"),
            (ENV_GID_INDEX, "1"),
            (ENV_HCA, "^mlx5_1"),
        ])
        .unwrap();
        assert_eq!(
            (c.qps, c.timeout, c.retry_cnt, c.gid_index),
            (4, 14, 3, Some(1))
        );
        for (k, v) in [
            (ENV_QPS, "0"),
            (ENV_QPS, "17"),
            (ENV_TIMEOUT, "0"),
            (ENV_TIMEOUT, "x"),
            (ENV_RETRY_CNT, "8"),
            (ENV_SLOTS, "0"),
            (ENV_SLOT_BYTES, "100"),
            (ENV_HCA, "mlx5_0:x"),
        ] {
            let e = cfg(&[(k, v)]).unwrap_err().to_string();
            assert!(e.contains(k), "{k}={v}: {e}");
        }
    }

    #[test]
    fn retry_window_follows_the_verbs_formula() {
        let w = IbConfig::default().with_timeout(14, 7).retry_window();
        assert!((w.as_secs_f64() - 8.0 * 4.096e-6 * 16384.0).abs() < 1e-6);
    }
}
