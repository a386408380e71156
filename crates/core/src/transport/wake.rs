//! Sleeping until a link moves: the doorbell a transport rings when one end
//! of a link may be able to go on, and the engine's sleep on it.
//!
//! An engine whose operation is blocked first spins (a peer's flag is seen
//! in ~0.1 µs), but braid runs inside someone else's program: a training
//! step computes on the same cores while its collectives are in flight. A
//! waiter that keeps polling, or yields and comes back at once, takes its
//! full share of a busy core and sees the peer's data only when the
//! scheduler next gives it a turn (milliseconds on a loaded core). A waiter
//! that sleeps in the kernel costs nothing while it waits, and the
//! scheduler runs it promptly when it is woken. So after its spin the
//! engine sleeps on a futex word that the other side of the link (or the
//! transport's progress thread) bumps when it changes something this end
//! may be waiting for.
//!
//! The protocol is an event count, with the sleepers counted so that a
//! ringer with nobody asleep pays only a fence and a load:
//!
//! 1. the waiter *arms*: `sleepers += 1`, full fence, reads `seq`
//!    ([`Doorbell::arm`]);
//! 2. it polls its link once more (anything published before the arm is
//!    seen now), and if still blocked sleeps while `seq` holds the value
//!    it read ([`sleep_any`]);
//! 3. afterwards it disarms (`sleepers -= 1`);
//!
//! and the ringer, after publishing its change, issues a full fence and,
//! if `sleepers` is not zero, bumps `seq` and wakes every sleeper on it
//! ([`Doorbell::ring`]). The two fences make it impossible for both the
//! waiter's poll to miss the change and the ringer to miss the sleeper.
//!
//! A doorbell may live in memory shared between processes (the shm
//! transport keeps one per end in each segment; the futex is then a
//! shared one) or in one process's memory (the socket transport's progress
//! thread rings it). Every sleep is bounded by a timeout, so a peer that
//! dies without ringing is still noticed by the waiter's own checks.

use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::Duration;

/// A doorbell: an event counter (the futex word) and the number of
/// waiters armed on it. 64-byte aligned so that it shares no cache line
/// with what the hot path touches.
#[repr(C, align(64))]
#[derive(Debug, Default)]
pub struct Doorbell {
    seq: AtomicU32,
    sleepers: AtomicU32,
}

/// A futex word to sleep on, as armed: sleep while it still holds `seen`.
#[derive(Clone, Copy, Debug)]
pub struct WakeWord {
    word: *const AtomicU32,
    seen: u32,
    shared: bool,
}

// SAFETY: a WakeWord is an address and two values; it is only dereferenced
// by `sleep_any`, whose caller guarantees the doorbell is still mapped.
unsafe impl Send for WakeWord {}

impl Doorbell {
    /// A doorbell nobody waits on.
    pub const fn new() -> Doorbell {
        Doorbell {
            seq: AtomicU32::new(0),
            sleepers: AtomicU32::new(0),
        }
    }

    /// Step 1 of a wait: count this waiter as asleep and read the word.
    /// The caller must poll its link once more before it sleeps on the
    /// returned word, and call [`Doorbell::disarm`] once after.
    /// `shared`: the doorbell lives in memory other processes map.
    pub fn arm(&self, shared: bool) -> WakeWord {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        // Pairs with the fence in `ring`: either the ringer sees this
        // waiter, or the waiter's next poll sees what was published.
        fence(Ordering::SeqCst);
        WakeWord {
            word: &self.seq,
            seen: self.seq.load(Ordering::SeqCst),
            shared,
        }
    }

    /// Undo one [`Doorbell::arm`].
    pub fn disarm(&self) {
        // A corrupt shared segment could hold 0 here: never wrap below it
        // (too many sleepers only costs a ringer a wake-up call).
        let _ = self
            .sleepers
            .fetch_update(Ordering::SeqCst, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    /// Wake every waiter armed on this doorbell; call after publishing the
    /// change (with a Release store or stronger). Costs a fence and a load
    /// when nobody is armed.
    pub fn ring(&self, shared: bool) {
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::Relaxed) != 0 {
            self.seq.fetch_add(1, Ordering::SeqCst);
            sys::wake_all(&self.seq, shared);
        }
    }

    /// Waiters armed now (for tests).
    pub fn armed(&self) -> u32 {
        self.sleepers.load(Ordering::SeqCst)
    }
}

/// How a sleep ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Woken {
    /// A word changed (or was already different): poll again.
    Rung,
    /// The timeout passed.
    TimedOut,
    /// A signal or a spurious wake-up: poll again.
    Spurious,
}

/// Sleep until one of `words` no longer holds the value it was armed with,
/// or `timeout` passes. More than one word needs Linux 5.16
/// (`futex_waitv`); on older kernels the sleep watches the first word only,
/// for at most 200 µs, and the caller polls again.
///
/// # Safety
///
/// Every word must come from [`Doorbell::arm`] on a doorbell that is still
/// mapped (its link end alive) for the whole call.
pub unsafe fn sleep_any(words: &[WakeWord], timeout: Duration) -> Woken {
    match words {
        [] => {
            std::thread::sleep(timeout);
            Woken::TimedOut
        }
        // SAFETY: forwarded from this function's contract.
        [w] => unsafe { sys::wait_one(w, timeout) },
        // SAFETY: forwarded from this function's contract.
        _ => match unsafe { sys::wait_many(words, timeout) } {
            Some(w) => w,
            // SAFETY: as above.
            None => unsafe { sys::wait_one(&words[0], timeout.min(Duration::from_micros(200))) },
        },
    }
}

/// The futex system calls (Linux).
mod sys {
    use super::{WakeWord, Woken};
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    const FUTEX_WAIT: libc::c_int = 0;
    const FUTEX_WAKE: libc::c_int = 1;
    const FUTEX_PRIVATE_FLAG: libc::c_int = 128;
    /// `futex_waitv`'s flag for a 32-bit word.
    const FUTEX2_SIZE_U32: u32 = 2;
    /// `futex_waitv`'s flag for a word private to this process.
    const FUTEX2_PRIVATE: u32 = 128;
    /// The most words one `futex_waitv` watches.
    const WAITV_MAX: usize = 128;

    fn op(base: libc::c_int, shared: bool) -> libc::c_int {
        if shared {
            base
        } else {
            base | FUTEX_PRIVATE_FLAG
        }
    }

    fn timespec(d: Duration) -> libc::timespec {
        libc::timespec {
            tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: d.subsec_nanos() as libc::c_long,
        }
    }

    fn errno() -> i32 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    pub(super) fn wake_all(word: &AtomicU32, shared: bool) {
        // SAFETY: FUTEX_WAKE reads nothing but the address, which is a live
        // AtomicU32 (a reference); a failure only means nobody was woken.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                op(FUTEX_WAKE, shared),
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
            );
        }
    }

    /// # Safety
    ///
    /// `w.word` must point to a live AtomicU32 for the whole call.
    pub(super) unsafe fn wait_one(w: &WakeWord, timeout: Duration) -> Woken {
        let ts = timespec(timeout);
        // SAFETY: the word is live (this function's contract); the kernel
        // reads it atomically and the timespec lives on this stack frame.
        let r = unsafe {
            libc::syscall(
                libc::SYS_futex,
                w.word,
                op(FUTEX_WAIT, w.shared),
                w.seen,
                &ts as *const libc::timespec,
            )
        };
        if r == 0 {
            return Woken::Rung;
        }
        match errno() {
            libc::EAGAIN => Woken::Rung,
            libc::ETIMEDOUT => Woken::TimedOut,
            _ => Woken::Spurious,
        }
    }

    /// The kernel's `struct futex_waitv`.
    #[repr(C)]
    struct FutexWaitv {
        val: u64,
        uaddr: u64,
        flags: u32,
        reserved: u32,
    }

    /// `None` when the kernel has no `futex_waitv` (before 5.16).
    ///
    /// # Safety
    ///
    /// Every word must point to a live AtomicU32 for the whole call.
    pub(super) unsafe fn wait_many(words: &[WakeWord], timeout: Duration) -> Option<Woken> {
        let v: Vec<FutexWaitv> = words
            .iter()
            .take(WAITV_MAX)
            .map(|w| FutexWaitv {
                val: u64::from(w.seen),
                uaddr: w.word as u64,
                flags: FUTEX2_SIZE_U32 | if w.shared { 0 } else { FUTEX2_PRIVATE },
                reserved: 0,
            })
            .collect();
        // futex_waitv takes an absolute CLOCK_MONOTONIC deadline.
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `now` is a valid timespec to write.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
        let t = timespec(timeout);
        let mut sec = now.tv_sec.saturating_add(t.tv_sec);
        let mut nsec = now.tv_nsec + t.tv_nsec;
        if nsec >= 1_000_000_000 {
            nsec -= 1_000_000_000;
            sec = sec.saturating_add(1);
        }
        let until = libc::timespec {
            tv_sec: sec,
            tv_nsec: nsec,
        };
        // SAFETY: `v` describes live words (this function's contract) and,
        // like `until`, lives on this frame for the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_futex_waitv,
                v.as_ptr(),
                v.len() as libc::c_uint,
                0 as libc::c_uint,
                &until as *const libc::timespec,
                libc::CLOCK_MONOTONIC,
            )
        };
        if r >= 0 {
            return Some(Woken::Rung);
        }
        match errno() {
            libc::ENOSYS => None,
            libc::EAGAIN => Some(Woken::Rung),
            libc::ETIMEDOUT => Some(Woken::TimedOut),
            _ => Some(Woken::Spurious),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn a_ring_after_the_arm_ends_the_sleep() {
        let bell = Arc::new(Doorbell::new());
        let w = bell.arm(false);
        let b = bell.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            b.ring(false);
        });
        let t0 = Instant::now();
        // SAFETY: `bell` outlives the call.
        let r = unsafe { sleep_any(&[w], Duration::from_secs(10)) };
        bell.disarm();
        t.join().unwrap();
        assert_ne!(r, Woken::TimedOut);
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        assert_eq!(bell.armed(), 0);
    }

    #[test]
    fn a_ring_between_arm_and_sleep_is_not_lost() {
        let bell = Doorbell::new();
        let w = bell.arm(false);
        bell.ring(false);
        // SAFETY: `bell` outlives the call.
        let r = unsafe { sleep_any(&[w], Duration::from_secs(10)) };
        assert_eq!(r, Woken::Rung);
        bell.disarm();
    }

    #[test]
    fn nobody_armed_means_no_bump_and_timeouts_hold() {
        let bell = Doorbell::new();
        bell.ring(false);
        let w = bell.arm(false);
        assert_eq!(w.seen, 0, "a ring with nobody armed bumped the word");
        let t0 = Instant::now();
        // SAFETY: `bell` outlives the call.
        let r = unsafe { sleep_any(&[w], Duration::from_millis(30)) };
        assert_eq!(r, Woken::TimedOut);
        assert!(t0.elapsed() >= Duration::from_millis(25));
        bell.disarm();
        bell.disarm();
        assert_eq!(bell.armed(), 0, "disarm went below zero");
    }

    #[test]
    fn any_of_several_words_wakes_the_sleeper() {
        let bells: Arc<Vec<Doorbell>> = Arc::new((0..3).map(|_| Doorbell::new()).collect());
        let words: Vec<WakeWord> = bells.iter().map(|b| b.arm(false)).collect();
        let b = bells.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            b[2].ring(false);
        });
        let t0 = Instant::now();
        // SAFETY: `bells` outlives the call.
        let r = unsafe { sleep_any(&words, Duration::from_secs(10)) };
        t.join().unwrap();
        assert_ne!(r, Woken::TimedOut);
        assert!(t0.elapsed() < Duration::from_secs(5));
        for b in bells.iter() {
            b.disarm();
        }
    }
}
