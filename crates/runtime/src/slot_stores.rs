//! Ordinary or streaming stores into a peer's slots, chosen from how fast
//! each kind of write has been on that link.
//!
//! A piece written into a slot with ordinary stores first takes every line
//! back from the cache of the receiver, whose last read of that slot left
//! the lines there. Where both ranks share a last-level cache that is cheap,
//! and the receiver then reads the piece from that cache. Where they do not
//! (two dies or sockets; on the 2-core VMs braid is developed on, whenever
//! the hypervisor runs the two vCPUs on different dies, which it does for
//! seconds at a time: a cache-line round trip then takes 0.35 µs instead of
//! 0.09: `scripts/placement-probe.c`), each line crosses the fabric before
//! it is overwritten: in a C model of two processes passing 128 KiB pieces
//! through 16 slots (`scripts/slot-stores.c`), the sender wrote at 2.4 GB/s
//! instead of 12, while streaming stores, which write
//! whole lines to memory without fetching them, ran at 30 GB/s on either
//! placement and the receiver read their data from memory at 7-8 GB/s. So
//! ordinary stores win 12 to 7 on a shared cache and lose 2.4 to 8 across
//! dies; a 1 MiB Reduce on 2 ranks took 34 µs with ordinary stores and
//! 65 µs with streaming ones on a shared cache, 435 µs against 52 µs across
//! dies.
//!
//! Where the ranks run cannot be told from the topology (the guest sees one
//! cache; the placement changes under it), so each link measures: the sender
//! times its writes of large pieces, keeps a recent best speed for each kind
//! (a new sample, or the old best decayed by [`DECAY`], whichever is higher,
//! so one write slowed by preemption does not count but a run of slow ones
//! does), writes every [`PROBE_EVERY`]th piece the other way to keep both
//! speeds current, and streams while ordinary writes run at less than a
//! fifth of the streaming speed (back to ordinary stores above a third).
//! The decision is per link and per process; receivers see the same bytes
//! either way. `BRAID_SLOT_STREAM=0` keeps ordinary stores, `1` streams
//! every timed piece (both for measurements and tests), `auto` (the default)
//! decides as above.

use std::cell::{Cell, UnsafeCell};

/// Pieces of at least this many bytes are timed and may stream: below it the
/// clock reads would cost more than a streaming store saves.
pub(crate) const TIMED_MIN_BYTES: usize = 64 * 1024;

/// Every this many timed pieces, one is written the other way (a probe).
pub(crate) const PROBE_EVERY: u32 = 32;

/// The factor by which the recent best speed of a kind of write decays per
/// sample of that kind.
pub(crate) const DECAY: f32 = 0.8;

/// Stream once ordinary writes are this many times slower than streaming.
const TO_STREAMING: f32 = 5.0;

/// Go back to ordinary stores once they are at most this many times slower.
const TO_ORDINARY: f32 = 3.0;

/// Environment variable: `auto` (default), `0` (ordinary stores) or `1`
/// (streaming stores) for pieces of at least [`TIMED_MIN_BYTES`].
pub(crate) const ENV: &str = "BRAID_SLOT_STREAM";

/// How a communicator writes large pieces into slots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Measure and decide per link (the module docs).
    #[default]
    Auto,
    /// Ordinary stores.
    Ordinary,
    /// Streaming stores.
    Streaming,
}

impl Mode {
    /// The mode `BRAID_SLOT_STREAM` asks for (`None`: unset or empty).
    pub(crate) fn parse(v: Option<&str>) -> Result<Mode, String> {
        match v.map(str::trim) {
            None | Some("") => Ok(Mode::Auto),
            Some(a) if a.eq_ignore_ascii_case("auto") => Ok(Mode::Auto),
            Some(b) => match braid_core::config::parse_bool(ENV, b) {
                Ok(false) => Ok(Mode::Ordinary),
                Ok(true) => Ok(Mode::Streaming),
                Err(_) => Err(format!(
                    "{ENV}={b}: expected auto, 0 (ordinary stores into slots) or 1 (streaming stores)"
                )),
            },
        }
    }
}

/// One link's recent write speeds (bytes per nanosecond; 0: not yet seen).
#[derive(Debug, Default)]
struct Link {
    ordinary: Cell<f32>,
    streaming: Cell<f32>,
    stream: Cell<bool>,
    pieces: Cell<u32>,
}

/// Per peer: how to write pieces into its slots (see the module docs).
/// Lives with the communicator, across operations.
#[derive(Debug, Default)]
pub(crate) struct SlotStores {
    mode: Mode,
    links: Vec<Link>,
    /// Where a reduction meant for a streaming link is computed first
    /// (8-byte words: aligned for every element type).
    scratch: UnsafeCell<Vec<u64>>,
}

impl SlotStores {
    /// Links to `nranks` peers, each starting with ordinary stores.
    pub(crate) fn new(nranks: usize, mode: Mode) -> Self {
        SlotStores {
            mode,
            links: (0..nranks).map(|_| Link::default()).collect(),
            scratch: UnsafeCell::new(Vec::new()),
        }
    }

    /// A scratch buffer of at least `len` bytes, 8-byte aligned, valid until
    /// the next call (which may move it); grows as needed, never shrinks.
    pub(crate) fn scratch(&self, len: usize) -> *mut u8 {
        // SAFETY: `SlotStores` is not `Sync` (its `Cell`s), so only this
        // thread reaches the buffer, and no reference into it outlives this
        // call: callers get a raw pointer.
        let v = unsafe { &mut *self.scratch.get() };
        let words = len.div_ceil(8);
        if v.len() < words {
            v.resize(words, 0);
        }
        v.as_mut_ptr().cast()
    }

    /// Whether the next piece of `len` bytes to `peer` should stream. Pieces
    /// below [`TIMED_MIN_BYTES`] never do (and are not counted).
    pub(crate) fn choose(&self, peer: u32, len: usize) -> bool {
        let Some(l) = self.links.get(peer as usize) else {
            return false;
        };
        if len < TIMED_MIN_BYTES {
            return false;
        }
        match self.mode {
            Mode::Auto => {}
            Mode::Ordinary => return false,
            Mode::Streaming => return true,
        }
        let n = l.pieces.get().wrapping_add(1);
        l.pieces.set(n);
        let stream = l.stream.get();
        let other_unknown = if stream {
            l.ordinary.get() == 0.0
        } else {
            l.streaming.get() == 0.0
        };
        if other_unknown || n.is_multiple_of(PROBE_EVERY) {
            !stream
        } else {
            stream
        }
    }

    /// A piece of `len` bytes to `peer` was written (`streamed` or not) in
    /// `nanos` nanoseconds.
    pub(crate) fn record(&self, peer: u32, streamed: bool, len: usize, nanos: u64) {
        let Some(l) = self.links.get(peer as usize) else {
            return;
        };
        if self.mode != Mode::Auto {
            return;
        }
        let speed = len as f32 / nanos.max(1) as f32;
        let kind = if streamed { &l.streaming } else { &l.ordinary };
        kind.set(speed.max(kind.get() * DECAY));
        let (o, s) = (l.ordinary.get(), l.streaming.get());
        if o == 0.0 || s == 0.0 {
            return;
        }
        if !l.stream.get() && o * TO_STREAMING < s {
            l.stream.set(true);
        } else if l.stream.get() && o * TO_ORDINARY > s {
            l.stream.set(false);
        }
    }

    /// Whether the link to `peer` streams now (its decision, not counting
    /// probes).
    pub(crate) fn streaming(&self, peer: u32) -> bool {
        match self.mode {
            Mode::Auto => self
                .links
                .get(peer as usize)
                .is_some_and(|l| l.stream.get()),
            Mode::Ordinary => false,
            Mode::Streaming => (peer as usize) < self.links.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PIECE: usize = 512 * 1024;

    /// Nanoseconds to write a piece at `gbps` GB/s (bytes per ns).
    fn at(gbps: f32) -> u64 {
        (PIECE as f32 / gbps) as u64
    }

    /// Runs `n` pieces to peer 1 where ordinary writes go at `ordinary` and
    /// streaming ones at `streaming` GB/s; returns how many streamed.
    fn run(s: &SlotStores, n: usize, ordinary: f32, streaming: f32) -> usize {
        let mut streamed = 0;
        for _ in 0..n {
            let st = s.choose(1, PIECE);
            streamed += st as usize;
            s.record(1, st, PIECE, at(if st { streaming } else { ordinary }));
        }
        streamed
    }

    #[test]
    fn a_shared_cache_keeps_ordinary_stores() {
        // The VM's shared-cache figures: ordinary 12, streaming 30 GB/s.
        let s = SlotStores::new(2, Mode::Auto);
        let streamed = run(&s, 320, 12.0, 30.0);
        assert!(!s.streaming(1));
        // One probe to learn the streaming speed, then one in 32.
        assert!(streamed <= 1 + 320 / PROBE_EVERY as usize, "{streamed}");
    }

    #[test]
    fn writes_across_dies_switch_to_streaming_and_back() {
        let s = SlotStores::new(2, Mode::Auto);
        run(&s, 64, 12.0, 30.0);
        assert!(!s.streaming(1));
        // Placement changes: ordinary writes drop to 2.4 GB/s. The decayed
        // best (12 · 0.8^k) falls below 30 / 5 after four slow writes.
        let streamed = run(&s, 8, 2.4, 30.0);
        assert!(s.streaming(1), "still ordinary after 8 slow writes");
        assert!(streamed >= 3, "{streamed}");
        let streamed = run(&s, 320, 2.4, 30.0);
        assert!(s.streaming(1));
        assert!(streamed >= 320 - 320 / PROBE_EVERY as usize, "{streamed}");
        // Back on one die: the next probe of ordinary stores sees 12 GB/s.
        run(&s, PROBE_EVERY as usize, 12.0, 30.0);
        assert!(!s.streaming(1), "a fast ordinary probe switches back");
    }

    #[test]
    fn one_slow_write_does_not_switch() {
        let s = SlotStores::new(2, Mode::Auto);
        run(&s, 64, 12.0, 30.0);
        // A write stalled by preemption (0.5 GB/s), then normal ones.
        let st = s.choose(1, PIECE);
        s.record(1, st, PIECE, at(0.5));
        assert!(!s.streaming(1));
        run(&s, 16, 12.0, 30.0);
        assert!(!s.streaming(1));
    }

    #[test]
    fn fixed_modes_ignore_the_timings() {
        for (mode, want) in [(Mode::Ordinary, false), (Mode::Streaming, true)] {
            let s = SlotStores::new(2, mode);
            // Timings that would make Auto switch the other way.
            let speeds = if want { (12.0, 30.0) } else { (1.0, 30.0) };
            let streamed = run(&s, 64, speeds.0, speeds.1);
            assert_eq!(streamed, if want { 64 } else { 0 }, "{mode:?}");
            assert_eq!(s.streaming(1), want, "{mode:?}");
            assert!(!s.choose(1, TIMED_MIN_BYTES - 1), "{mode:?}: small piece");
        }
        assert_eq!(Mode::parse(None), Ok(Mode::Auto));
        assert_eq!(Mode::parse(Some(" auto ")), Ok(Mode::Auto));
        assert_eq!(Mode::parse(Some("0")), Ok(Mode::Ordinary));
        assert_eq!(Mode::parse(Some("1")), Ok(Mode::Streaming));
        // Booleans read as everywhere else (core::config).
        assert_eq!(Mode::parse(Some("yes")), Ok(Mode::Streaming));
        assert_eq!(Mode::parse(Some("off")), Ok(Mode::Ordinary));
        let e = Mode::parse(Some("maybe")).unwrap_err();
        assert!(
            e.contains("BRAID_SLOT_STREAM=maybe") && e.contains("expected auto"),
            "{e}"
        );
    }

    #[test]
    fn small_pieces_and_unknown_peers_never_stream() {
        let s = SlotStores::new(2, Mode::Auto);
        run(&s, 64, 1.0, 30.0);
        assert!(s.streaming(1));
        assert!(!s.choose(1, TIMED_MIN_BYTES - 1));
        assert!(!s.choose(7, PIECE));
        s.record(7, true, PIECE, 1);
        assert!(!s.streaming(7));
        // Another peer's link is its own.
        assert!(!s.streaming(0));
    }
}
