//! Host copies that bypass the cache.
//!
//! A copy larger than the last-level cache gains nothing from keeping its
//! destination cached: every line it writes is evicted again before anyone
//! reads it, and an ordinary store first reads the line it overwrites (a
//! read-for-ownership), so the memory bus carries the destination twice.
//! Streaming (non-temporal) stores write whole lines without reading them.
//! glibc switches `memcpy` to them only above `x86_non_temporal_threshold`,
//! which it derives from the CPUID cache sizes; on virtual machines those
//! often describe the whole host (384 MiB on the 2-core VMs braid is
//! developed on, where the guest's cache is 32 MiB), so `memcpy` never
//! streams there. Measured on that VM (`crates/core/benches/copy.rs`), a
//! 32 MiB copy in 2 MiB pieces: `memcpy` 1.5–2.8 ms, streaming 1.2–1.6 ms;
//! an 8 MiB copy (in cache): `memcpy` 150 µs, streaming 200 µs. The engine
//! therefore streams only the copies of collectives whose buffers exceed
//! the cache (see `stream_min` in the runtime).
//!
//! On x86-64 the loop uses SSE2 `movntdq` (part of the baseline, so no
//! run-time detection; 16- and 32-byte streaming stores measured the same);
//! elsewhere [`copy_streaming`] is an ordinary copy.

/// Copies `len` bytes from `src` to `dst` with streaming stores where the
/// CPU has them (see the module documentation); the bytes are in memory,
/// not necessarily in the cache, when it returns.
///
/// # Safety
///
/// `src` must be valid for reads and `dst` for writes of `len` bytes, and
/// the two ranges must not overlap.
pub unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: forwarded from this function's contract.
    unsafe {
        x86::copy(dst, src, len)
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: forwarded from this function's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    /// Bytes per loop iteration: four 64-byte lines.
    const STEP: usize = 256;

    /// # Safety
    ///
    /// As [`super::copy_streaming`].
    pub(super) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
        // Ordinary copy up to the first 16-byte aligned destination byte
        // (streaming stores need aligned addresses), and for short copies.
        let head = dst.align_offset(16).min(len);
        if len - head < STEP {
            // SAFETY: the caller's contract covers all `len` bytes.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
            return;
        }
        // SAFETY: `head <= len`, inside the caller's ranges.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let body = (len - head) / STEP * STEP;
        let mut i = head;
        while i < head + body {
            // SAFETY: `i + STEP <= len`, so the 16 loads and stores stay in
            // the caller's ranges; `dst + i` is 16-byte aligned (`head`
            // aligned it and `i - head` is a multiple of 16); the loads are
            // unaligned loads; SSE2 is part of the x86-64 baseline.
            unsafe {
                let (s, d) = (src.add(i), dst.add(i));
                let mut v: [__m128i; 16] = [std::mem::zeroed(); 16];
                for (k, r) in v.iter_mut().enumerate() {
                    *r = _mm_loadu_si128(s.add(16 * k).cast());
                }
                for (k, r) in v.iter().enumerate() {
                    _mm_stream_si128(d.add(16 * k).cast(), *r);
                }
            }
            i += STEP;
        }
        // SAFETY: the tail lies inside the caller's ranges; the fence orders
        // the streaming stores before any later store (e.g. the flag that
        // tells a peer the data is there) as ordinary stores are ordered.
        unsafe {
            std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
            _mm_sfence();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::copy_streaming;

    /// Every (destination misalignment, length) around the loop's step and
    /// alignment boundaries copies exactly the bytes asked, and nothing
    /// beyond them.
    #[test]
    fn copies_exactly_the_range() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        for off in 0..17 {
            for len in (0..20)
                .chain(240..280)
                .chain([1000, 4095, 4096, 4097, 4600])
            {
                let mut dst = vec![0xEEu8; 5000 + 64];
                // SAFETY: `src[1..]` holds at least `len` bytes and
                // `dst[off..]` room for them; separate vectors.
                unsafe { copy_streaming(dst.as_mut_ptr().add(off), src.as_ptr().add(1), len) };
                assert!(dst[..off].iter().all(|&b| b == 0xEE), "off {off} len {len}");
                assert_eq!(
                    &dst[off..off + len],
                    &src[1..1 + len],
                    "off {off} len {len}"
                );
                assert!(
                    dst[off + len..].iter().all(|&b| b == 0xEE),
                    "off {off} len {len}"
                );
            }
        }
    }
}
