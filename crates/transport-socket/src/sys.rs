//! The one module with `unsafe`: slot memory shared between the engine (which
//! reads and writes slots through the raw [`SlotBuf`] pointers the seam hands
//! out) and the helper threads (which send from and receive into it).
//!
//! Who may touch which bytes when is decided by the protocol in `link.rs`;
//! the functions here only turn a `(slot, offset, len)` that the caller has
//! exclusive (or shared read) access to into a slice.
//!
//! [`SlotBuf`]: braid_core::transport::SlotBuf

use std::alloc::Layout;
use std::ptr::NonNull;

/// Alignment of the slot array (slots themselves are multiples of 64 bytes,
/// so every slot is 64-byte aligned).
const ALIGN: usize = 4096;

/// `slots` buffers of `slot_bytes` each, in one zeroed allocation.
#[derive(Debug)]
pub struct SlotMem {
    ptr: NonNull<u8>,
    layout: Layout,
    slot_bytes: usize,
    slots: usize,
}

// SAFETY: SlotMem owns a plain heap allocation with no thread affinity; all
// access to its bytes goes through raw pointers whose exclusivity the
// protocol in link.rs guarantees (see the safety contracts below).
unsafe impl Send for SlotMem {}
// SAFETY: as above; `&SlotMem` only hands out pointers, and the unsafe
// slice functions put the burden of exclusivity on their callers.
unsafe impl Sync for SlotMem {}

impl SlotMem {
    /// Allocates zeroed slot memory; `slot_bytes` must be a non-zero
    /// multiple of 64.
    pub fn new(slot_bytes: usize, slots: usize) -> Result<SlotMem, String> {
        if slot_bytes == 0 || !slot_bytes.is_multiple_of(64) || slots == 0 {
            return Err(format!("invalid slot geometry {slots} x {slot_bytes}"));
        }
        let size = slot_bytes
            .checked_mul(slots)
            .ok_or_else(|| format!("{slots} x {slot_bytes} bytes overflows"))?;
        let layout = Layout::from_size_align(size, ALIGN).map_err(|e| e.to_string())?;
        // SAFETY: `layout` has a non-zero size (both factors are non-zero).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)
            .ok_or_else(|| format!("cannot allocate {size} bytes of slot memory"))?;
        Ok(SlotMem {
            ptr,
            layout,
            slot_bytes,
            slots,
        })
    }

    /// Start of slot `i` (`i < slots`; 64-byte aligned).
    pub fn slot_ptr(&self, i: usize) -> *mut u8 {
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

    /// Bytes `off..off + len` of slot `i`, to read.
    ///
    /// # Safety
    ///
    /// Nobody may write these bytes while the returned slice lives.
    pub unsafe fn slice(&self, i: usize, off: usize, len: usize) -> &[u8] {
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
    pub unsafe fn slice_mut(&self, i: usize, off: usize, len: usize) -> &mut [u8] {
        self.check(i, off, len);
        // SAFETY: the range is inside the allocation (checked above) and
        // initialised; the caller promises exclusive access to it.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(i).add(off), len) }
    }
}

impl Drop for SlotMem {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed(self.layout)` and is freed
        // only here, once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}
