//! What this host allows the shm transport, and whether a peer process is
//! still there.
//!
//! - **Segments** live in `/dev/shm` (POSIX shared memory); what braid left
//!   there is listed by [`leftover_segments`] (for leak checks; set-up
//!   unlinks every name once both ends mapped it).
//! - **Cross-memory attach**: single-copy transfers need the receiver to
//!   read its sender's memory with `process_vm_readv` (same user, ptrace
//!   not forbidden by Yama or seccomp). The receiver's `connect` proves it
//!   on a word the sender advertised ([`can_read_process`]) before it
//!   enables them.
//! - **Liveness**: a peer process that is gone, or a zombie, is reported
//!   by [`process_alive`] (the ends check it while they wait).
//!
//! The segment layout aligns to 4096-byte pages and asks for transparent
//! huge pages (see `segment.rs`); nothing here depends on the host's page
//! size beyond that.

use crate::segment;

/// Names in `/dev/shm` that start with `braid-` (for leak checks).
pub fn leftover_segments() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with("braid-"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Whether this process may read process `pid`'s memory: reads the word at
/// `addr` there, which must hold the segment magic (the sender advertises
/// its mapping of the segment header).
pub(crate) fn can_read_process(pid: u32, addr: u64) -> bool {
    addr != 0 && segment::read_process_word(pid, addr).is_ok_and(|w| w == segment::HEADER_MAGIC)
}

/// Liveness of a process: `Err(what)` if it is gone.
pub(crate) fn process_alive(pid: u32) -> Result<(), String> {
    use nix::sys::signal::kill;
    use nix::unistd::Pid;
    // `pid` was validated to be in 1..=i32::MAX when the blob was parsed.
    // EPERM means it exists but belongs to someone else; only ESRCH is proof.
    if let Err(nix::errno::Errno::ESRCH) = kill(Pid::from_raw(pid as i32), None) {
        return Err(format!("process {pid} is gone"));
    }
    // A killed child that its parent has not reaped yet still answers
    // kill(2); /proc tells us it is a zombie.
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // Format: "pid (comm) S ..."; comm may contain spaces and parens.
        if let Some(state) = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
        {
            if state == "Z" || state == "X" {
                return Err(format!("process {pid} is gone (exited, not yet reaped)"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_alive() {
        assert!(process_alive(std::process::id()).is_ok());
    }

    #[test]
    fn reading_this_process_proves_the_probe_word() {
        let me = std::process::id();
        let magic = segment::HEADER_MAGIC;
        let other = magic ^ 1;
        assert!(can_read_process(me, &magic as *const u64 as u64));
        assert!(!can_read_process(me, &other as *const u64 as u64));
        assert!(!can_read_process(me, 0));
    }
}
