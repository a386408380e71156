//! The one module with `unsafe` FFI: slot memory shared between the engine
//! (which reads and writes slots through the raw [`SlotBuf`] pointers the
//! seam hands out) and the helper threads (which send from and receive into
//! it), and the system calls that move bytes between sockets and raw memory
//! (slots, or the caller's buffers for direct transfers).
//!
//! Who may touch which bytes when is decided by the protocol in `link.rs`;
//! the functions here only turn a `(slot, offset, len)` that the caller has
//! exclusive (or shared read) access to into a slice.
//!
//! [`SlotBuf`]: braid_core::transport::SlotBuf

use std::io;
use std::os::fd::RawFd;
use std::ptr::NonNull;

use nix::libc;

/// `slots` buffers of `slot_bytes` each, in one anonymous mapping: zeroed,
/// page-aligned, and resident only as far as it is used (a link that only
/// carries small messages costs a page per slot, not `slots × slot_bytes`;
/// heap memory of this size may come back from `calloc` already touched).
#[derive(Debug)]
pub(crate) struct SlotMem {
    ptr: NonNull<u8>,
    size: usize,
    slot_bytes: usize,
    slots: usize,
}

// SAFETY: SlotMem owns a private anonymous mapping with no thread affinity; all
// access to its bytes goes through raw pointers whose exclusivity the
// protocol in link.rs guarantees (see the safety contracts below).
unsafe impl Send for SlotMem {}
// SAFETY: as above; `&SlotMem` only hands out pointers, and the unsafe
// slice functions put the burden of exclusivity on their callers.
unsafe impl Sync for SlotMem {}

impl SlotMem {
    /// Maps zeroed slot memory; `slot_bytes` must be a non-zero multiple of
    /// 64 (so every slot is 64-byte aligned in the page-aligned mapping).
    pub(crate) fn new(slot_bytes: usize, slots: usize) -> Result<SlotMem, String> {
        if slot_bytes == 0 || !slot_bytes.is_multiple_of(64) || slots == 0 {
            return Err(format!("invalid slot geometry {slots} x {slot_bytes}"));
        }
        let size = slot_bytes
            .checked_mul(slots)
            .ok_or_else(|| format!("{slots} x {slot_bytes} bytes overflows"))?;
        // SAFETY: a new private anonymous mapping of a non-zero size (both
        // factors are non-zero) at an address the kernel picks; nothing
        // else refers to it; the result is checked below.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(format!(
                "cannot map {size} bytes of slot memory: {}",
                io::Error::last_os_error()
            ));
        }
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| format!("cannot map {size} bytes of slot memory"))?;
        Ok(SlotMem {
            ptr,
            size,
            slot_bytes,
            slots,
        })
    }

    /// Start of slot `i` (`i < slots`; 64-byte aligned).
    pub(crate) fn slot_ptr(&self, i: usize) -> *mut u8 {
        assert!(i < self.slots, "slot index {i} out of range");
        // `wrapping_add` keeps this safe; the result is in bounds because
        // `i * slot_bytes < slots * slot_bytes` = the allocation's size.
        self.ptr.as_ptr().wrapping_add(i * self.slot_bytes)
    }

    fn check(&self, i: usize, off: usize, len: usize) {
        assert!(
            i < self.slots && off <= self.slot_bytes && len <= self.slot_bytes - off,
            "slot range {i}:{off}+{len} out of bounds"
        );
    }

    /// Bytes `off..off + len` of slot `i`, to read (the fuzzing harness
    /// reads the slots its readers filled).
    ///
    /// # Safety
    ///
    /// Nobody may write these bytes while the returned slice lives.
    #[cfg(feature = "fuzzing")]
    pub(crate) unsafe fn slice(&self, i: usize, off: usize, len: usize) -> &[u8] {
        self.check(i, off, len);
        // SAFETY: the range is inside the allocation (checked above), the
        // memory is initialised (zeroed at allocation), and the caller
        // promises no concurrent writer.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(i).add(off), len) }
    }

    /// Bytes `off..off + len` of slot `i`, to write.
    ///
    /// # Safety
    ///
    /// Nobody else may read or write these bytes while the returned slice
    /// lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut(&self, i: usize, off: usize, len: usize) -> &mut [u8] {
        self.check(i, off, len);
        // SAFETY: the range is inside the allocation (checked above) and
        // initialised; the caller promises exclusive access to it.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(i).add(off), len) }
    }
}

/// Writes `head` then `len` bytes at `payload` with one `sendmsg`
/// (`MSG_NOSIGNAL`, and `MSG_DONTWAIT` with `dontwait`), resuming `skip`
/// bytes into the pair, until all is written or, with `dontwait`, the socket
/// buffer is full. Returns how far it got (counting `skip`). The payload is
/// passed to the kernel as a raw address, never as a Rust reference: the
/// kernel copies it (or fails with `EFAULT`).
///
/// # Safety
///
/// `payload` must be valid for reads of `len` bytes, and nobody may write
/// them, for the duration of the call.
pub(crate) unsafe fn send_head_payload(
    fd: RawFd,
    head: &[u8],
    payload: *const u8,
    len: usize,
    mut skip: usize,
    dontwait: bool,
) -> io::Result<usize> {
    let total = head.len() + len;
    let mut flags = libc::MSG_NOSIGNAL;
    if dontwait {
        flags |= libc::MSG_DONTWAIT;
    }
    while skip < total {
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 2];
        let mut n = 0;
        if skip < head.len() {
            iov[0] = libc::iovec {
                iov_base: head[skip..].as_ptr() as *mut libc::c_void,
                iov_len: head.len() - skip,
            };
            n = 1;
        }
        let off = skip.saturating_sub(head.len());
        if off < len {
            iov[n] = libc::iovec {
                // `wrapping_add` keeps this safe; `off < len` keeps it in
                // the caller's range.
                iov_base: payload.wrapping_add(off) as *mut libc::c_void,
                iov_len: len - off,
            };
            n += 1;
        }
        // SAFETY: a zeroed msghdr is a valid "no address, no control data"
        // header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = n as _;
        // SAFETY: `msg` points at `n` iovecs over `head` (a live slice) and
        // the payload range the caller vouches for; the kernel only reads
        // them during the call.
        let r = unsafe { libc::sendmsg(fd, &msg, flags) };
        if r > 0 {
            skip += r as usize;
            continue;
        }
        if r == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "socket accepted no bytes",
            ));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EAGAIN) if dontwait => return Ok(skip),
            _ => return Err(e),
        }
    }
    Ok(skip)
}

/// One non-blocking `recv` of at most `len` bytes into `dst`: `Ok(Some(n))`
/// (0 at end of stream) or `Ok(None)` when nothing is there yet.
///
/// # Safety
///
/// `dst` must be valid for writes of `len` bytes, and nobody else may
/// access them, for the duration of the call.
pub(crate) unsafe fn recv_some(fd: RawFd, dst: *mut u8, len: usize) -> io::Result<Option<usize>> {
    loop {
        // SAFETY: the caller vouches for `dst..dst + len`; the kernel writes
        // only there, during the call.
        let r = unsafe { libc::recv(fd, dst as *mut libc::c_void, len, libc::MSG_DONTWAIT) };
        if r >= 0 {
            return Ok(Some(r as usize));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EAGAIN) => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// Copies `src` to `dst`.
///
/// # Safety
///
/// `dst` must be valid for writes of `src.len()` bytes that nobody else
/// accesses meanwhile, and must not overlap `src`.
pub(crate) unsafe fn copy_to(src: &[u8], dst: *mut u8) {
    // SAFETY: forwarded from this function's contract.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
}

impl Drop for SlotMem {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `size` are the mapping made in `new`, unmapped
        // only here, once; no slice into it outlives the SlotMem.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.size) };
    }
}
