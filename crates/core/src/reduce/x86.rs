//! The x86-64 kernels with AVX-512, AVX2 and F16C, chosen at run time where
//! the CPU has them: conversions of 16-bit float slices, and Sum and Prod
//! of 16-bit floats in one pass.

use std::arch::x86_64::{
    __m128i, __m256i, _mm256_add_epi32, _mm256_and_si256, _mm256_blendv_epi8,
    _mm256_castsi256_si128, _mm256_cmpgt_epi32, _mm256_cvtepu16_epi32, _mm256_cvtph_ps,
    _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_loadu_si256, _mm256_or_si256, _mm256_packus_epi32,
    _mm256_permute4x64_epi64, _mm256_set1_epi32, _mm256_slli_epi32, _mm256_srli_epi32,
    _mm256_storeu_ps, _mm256_storeu_si256, _mm_loadu_si128, _mm_storeu_si128,
    _MM_FROUND_TO_NEAREST_INT,
};

use super::{bf16, f16, Loop, Narrow};

#[cfg(test)]
thread_local! {
    /// Tests set this to exercise the baseline loops on this thread.
    pub(super) static BASELINE_ONLY: std::cell::Cell<bool> =
        const { std::cell::Cell::new(false) };
    /// Tests set this to exercise the AVX2 loops on a CPU with AVX-512.
    pub(super) static NO_AVX512: std::cell::Cell<bool> =
        const { std::cell::Cell::new(false) };
    /// Tests set this to exercise the AVX-512 loops that round bfloat16
    /// with integer operations on a CPU with AVX-512 BF16.
    pub(super) static NO_AVX512_BF16: std::cell::Cell<bool> =
        const { std::cell::Cell::new(false) };
}

/// True if the CPU has AVX-512 F and BW (cached by std).
#[inline(always)]
pub(super) fn has_avx512() -> bool {
    #[cfg(test)]
    if NO_AVX512.with(|b| b.get()) {
        return false;
    }
    has_avx2()
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
}

/// True if the CPU has AVX-512 F, BW, DQ and BF16 (the bfloat16
/// conversions).
#[inline(always)]
pub(super) fn has_avx512_bf16() -> bool {
    #[cfg(test)]
    if NO_AVX512_BF16.with(|b| b.get()) {
        return false;
    }
    has_avx512()
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512bf16")
}

/// True if the CPU has AVX2 (cached by std after the first call).
#[inline(always)]
pub(super) fn has_avx2() -> bool {
    #[cfg(test)]
    if BASELINE_ONLY.with(|b| b.get()) {
        return false;
    }
    std::arch::is_x86_feature_detected!("avx2")
}

/// True if the CPU has AVX2 and F16C.
#[inline(always)]
pub(super) fn has_f16c() -> bool {
    has_avx2() && std::arch::is_x86_feature_detected!("f16c")
}

/// Runs `f` in an AVX2 context.
///
/// # Safety
///
/// The CPU supports AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// `dst = widen(src)`, 8 lanes at a time with F16C.
///
/// # Safety
///
/// The CPU supports AVX and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn widen_f16(src: &[f16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n`, so 8 `f16` (16 bytes) are readable at
        // `src[i..]` and 8 `f32` writable at `dst[i..]`; both intrinsics
        // are unaligned accesses; the features are this function's.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    for (d, s) in dst[i..n].iter_mut().zip(&src[i..n]) {
        *d = s.widen();
    }
}

/// `dst = narrow(src)` (round to nearest even), 8 lanes at a time with
/// F16C.
///
/// # Safety
///
/// The CPU supports AVX and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn narrow_f16(src: &[f32], dst: &mut [f16]) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: as in `widen_f16`, with the roles of the slices swapped.
        unsafe {
            let v = _mm256_loadu_ps(src.as_ptr().add(i));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), h);
        }
        i += 8;
    }
    for (d, &s) in dst[i..n].iter_mut().zip(&src[i..n]) {
        *d = f16::narrow(s);
    }
}

/// 8 bfloat16 to f32: the 16 bits are the top of the f32 (a NaN is kept as
/// it is; a rounding back with [`bf16x8`] quietens it).
#[target_feature(enable = "avx2")]
#[inline]
fn f32x8(h: __m128i) -> __m256i {
    _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h))
}

/// 8 f32 (as bits) to bfloat16, rounding to nearest even as the scalar
/// `narrow`; a NaN keeps the top of its payload and is quiet.
#[target_feature(enable = "avx2")]
#[inline]
fn bf16x8(x: __m256i) -> __m128i {
    let nan = _mm256_cmpgt_epi32(
        _mm256_and_si256(x, _mm256_set1_epi32(0x7fff_ffff)),
        _mm256_set1_epi32(0x7f80_0000),
    );
    let top = _mm256_srli_epi32::<16>(x);
    let odd = _mm256_and_si256(top, _mm256_set1_epi32(1));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
        x,
        _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd),
    ));
    let nanv = _mm256_or_si256(top, _mm256_set1_epi32(0x0040));
    let v = _mm256_blendv_epi8(rounded, nanv, nan);
    // Every lane is below 2^16: the unsigned saturating pack keeps it; the
    // pack works per 128-bit half, the permute joins them.
    _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b11_01_10_00>(
        _mm256_packus_epi32(v, v),
    ))
}

/// `dst = widen(src)` for bfloat16, 8 lanes at a time; a NaN is quietened
/// (as the scalar `widen`).
///
/// # Safety
///
/// The CPU supports AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    let (abs, inf, quiet) = (
        _mm256_set1_epi32(0x7fff_ffff),
        _mm256_set1_epi32(0x7f80_0000),
        _mm256_set1_epi32(0x0040_0000),
    );
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n`: 8 bf16 (16 bytes) are readable at `src[i..]`
        // and 8 f32 (32 bytes) writable at `dst[i..]`; unaligned accesses.
        unsafe {
            let x = f32x8(_mm_loadu_si128(src.as_ptr().add(i).cast()));
            let nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, abs), inf);
            let x = _mm256_or_si256(x, _mm256_and_si256(nan, quiet));
            _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast::<__m256i>(), x);
        }
        i += 8;
    }
    for (d, s) in dst[i..n].iter_mut().zip(&src[i..n]) {
        *d = s.widen();
    }
}

/// `dst = narrow(src)` for bfloat16, 8 lanes at a time ([`bf16x8`]).
///
/// # Safety
///
/// The CPU supports AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n`: 8 f32 are readable at `src[i..]` and 8 bf16
        // (16 bytes) writable at `dst[i..]`; unaligned accesses.
        unsafe {
            let x = _mm256_loadu_si256(src.as_ptr().add(i).cast::<__m256i>());
            _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), bf16x8(x));
        }
        i += 8;
    }
    for (d, &s) in dst[i..n].iter_mut().zip(&src[i..n]) {
        *d = bf16::narrow(s);
    }
}

/// The operators the one-pass 16-bit float loops compute.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Fused {
    Add,
    Mul,
}

/// Runs `l` with `op` in one pass with AVX-512 (16 lanes) or AVX2 (8): the
/// hot case of mixed-precision training, gradients summed in bf16. False
/// when the CPU has neither (the caller runs its own loop).
pub(super) fn run_bf16(l: Loop<'_, bf16>, op: Fused) -> bool {
    let (d, x, y, n) = l.raw();
    if has_avx512_bf16() {
        // SAFETY: the CPU has AVX-512 F, BW, DQ and BF16 (just checked); the
        // parts come from `Loop::raw`.
        unsafe { run_bf16_512_bf16(d, x, y, n, op) };
        true
    } else if has_avx512() {
        // SAFETY: the CPU has AVX-512 F and BW (just checked); the parts
        // come from `Loop::raw`.
        unsafe { run_bf16_512(d, x, y, n, op) };
        true
    } else if has_avx2() {
        // SAFETY: the CPU has AVX2 (just checked); parts as above.
        unsafe { run_bf16_256(d, x, y, n, op) };
        true
    } else {
        false
    }
}

/// The scalar tail of a one-pass loop, from element `from`.
///
/// # Safety
///
/// `d`, `x`, `y` are valid for `n` elements (`d` for writes), as from
/// `Loop::raw`.
unsafe fn tail<H: Narrow>(d: *mut H, x: *const H, y: *const H, from: usize, n: usize, op: Fused) {
    for i in from..n {
        // SAFETY: `i < n`: inside every slice (this function's contract).
        unsafe {
            let (p, q) = (x.add(i).read().widen(), y.add(i).read().widen());
            let r = match op {
                Fused::Add => p + q,
                Fused::Mul => p * q,
            };
            d.add(i).write(H::narrow(r));
        }
    }
}

/// 32 elements at a time with AVX-512 BF16: each half of a 64-byte block
/// is widened (a bfloat16 is the top half of its f32), combined, and both
/// halves are rounded back at once by `vcvtne2ps2bf16`, which rounds to
/// nearest even and quietens a NaN as the scalar `narrow` does. (Widening
/// the even and odd elements in place instead, a shift and a mask, needs a
/// word permutation to put the results back in order, and measured slower:
/// 18-20 GiB/s at 4 MiB against 20-21.) The instruction flushes subnormal
/// results to zero where `narrow` rounds them, so a block with a subnormal
/// f32 result (rare: magnitudes below 2^-126) takes [`run_bf16_512`]'s
/// integer rounding instead; the results are bit for bit those of every
/// other path. On the Zen 4 VM this was developed on (`cargo bench -p
/// braid-core --bench reduce`), a 64 KiB sum took 12.2 GiB/s with the
/// integer rounding and takes 21.5 (f32: 35); a
/// 2-rank AllReduce of bf16 from 256 KiB to 4 MiB took 1.3-1.45x f32's
/// time for the same bytes and now takes about the same.
///
/// # Safety
///
/// The CPU supports AVX-512 F, BW, DQ and BF16; the parts are as from
/// `Loop::raw`.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16")]
unsafe fn run_bf16_512_bf16(d: *mut bf16, x: *const bf16, y: *const bf16, n: usize, op: Fused) {
    use std::arch::x86_64::{
        __m256i, __m512i, _mm256_loadu_si256, _mm512_add_ps, _mm512_castsi512_ps,
        _mm512_cvtepu16_epi32, _mm512_cvtne2ps_pbh, _mm512_fpclass_ps_mask, _mm512_mul_ps,
        _mm512_slli_epi32, _mm512_storeu_si512,
    };
    // `vfpclassps` category 0x20: subnormal.
    const SUBNORMAL: i32 = 0x20;
    let mut i = 0;
    while i + 32 <= n {
        // SAFETY: `i + 32 <= n`: 32 bf16 (64 bytes) are readable at `x + i`
        // and `y + i` and writable at `d + i` (`Loop::raw`); unaligned
        // accesses; both loads happen before the store, so `d` may alias
        // them, and the fallback reads the same unchanged elements.
        unsafe {
            let wide = |p: *const bf16| {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_loadu_si256(p.cast::<__m256i>()),
                )))
            };
            let (ae, ao) = (wide(x.add(i)), wide(x.add(i + 16)));
            let (be, bo) = (wide(y.add(i)), wide(y.add(i + 16)));
            let (re, ro) = match op {
                Fused::Add => (_mm512_add_ps(ae, be), _mm512_add_ps(ao, bo)),
                Fused::Mul => (_mm512_mul_ps(ae, be), _mm512_mul_ps(ao, bo)),
            };
            let sub =
                _mm512_fpclass_ps_mask::<SUBNORMAL>(re) | _mm512_fpclass_ps_mask::<SUBNORMAL>(ro);
            if sub != 0 {
                run_bf16_512(d.add(i), x.add(i), y.add(i), 32, op);
            } else {
                let h: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(ro, re));
                _mm512_storeu_si512(d.add(i).cast::<__m512i>(), h);
            }
        }
        i += 32;
    }
    // SAFETY: the rest (fewer than 32 elements) as the 16-bit loop does it;
    // the offsets stay inside the parts (`i <= n`).
    unsafe { run_bf16_512(d.add(i), x.add(i), y.add(i), n - i, op) };
}

/// # Safety
///
/// The CPU supports AVX-512 F and BW; the parts are as from `Loop::raw`.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn run_bf16_512(d: *mut bf16, x: *const bf16, y: *const bf16, n: usize, op: Fused) {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm256_storeu_si256, _mm512_add_epi32, _mm512_add_ps,
        _mm512_and_si512, _mm512_castps_si512, _mm512_castsi512_ps, _mm512_cmpgt_epi32_mask,
        _mm512_cvtepi32_epi16, _mm512_cvtepu16_epi32, _mm512_mask_blend_epi32, _mm512_mul_ps,
        _mm512_or_si512, _mm512_set1_epi32, _mm512_slli_epi32, _mm512_srli_epi32,
    };
    let (abs, inf, quiet, half, one) = (
        _mm512_set1_epi32(0x7fff_ffff),
        _mm512_set1_epi32(0x7f80_0000),
        _mm512_set1_epi32(0x0040),
        _mm512_set1_epi32(0x7fff),
        _mm512_set1_epi32(1),
    );
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: `i + 16 <= n`: 16 bf16 (32 bytes) are readable at `x + i`
        // and `y + i` and writable at `d + i` (`Loop::raw`); unaligned accesses;
        // both loads happen before the store, so `d` may alias them.
        unsafe {
            let wa = _mm512_cvtepu16_epi32(_mm256_loadu_si256(x.add(i).cast::<__m256i>()));
            let wb = _mm512_cvtepu16_epi32(_mm256_loadu_si256(y.add(i).cast::<__m256i>()));
            let fa = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wa));
            let fb = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wb));
            let r = match op {
                Fused::Add => _mm512_add_ps(fa, fb),
                Fused::Mul => _mm512_mul_ps(fa, fb),
            };
            // Round to nearest even as the scalar `narrow`; a NaN keeps the
            // top of its payload, quiet.
            let v = _mm512_castps_si512(r);
            let nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(v, abs), inf);
            let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(v), one);
            let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(v, _mm512_add_epi32(half, odd)));
            let nanv = _mm512_or_si512(_mm512_srli_epi32::<16>(v), quiet);
            let h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, nanv));
            _mm256_storeu_si256(d.add(i).cast::<__m256i>(), h);
        }
        i += 16;
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { tail(d, x, y, i, n, op) };
}

/// # Safety
///
/// The CPU supports AVX2; the parts are as from `Loop::raw`.
#[target_feature(enable = "avx2")]
unsafe fn run_bf16_256(d: *mut bf16, x: *const bf16, y: *const bf16, n: usize, op: Fused) {
    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_castps_si256, _mm256_castsi256_ps, _mm256_mul_ps,
    };
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: as in `run_bf16_512`, for 8 elements (16 bytes).
        unsafe {
            let fa = _mm256_castsi256_ps(f32x8(_mm_loadu_si128(x.add(i).cast())));
            let fb = _mm256_castsi256_ps(f32x8(_mm_loadu_si128(y.add(i).cast())));
            let r = match op {
                Fused::Add => _mm256_add_ps(fa, fb),
                Fused::Mul => _mm256_mul_ps(fa, fb),
            };
            _mm_storeu_si128(d.add(i).cast(), bf16x8(_mm256_castps_si256(r)));
        }
        i += 8;
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { tail(d, x, y, i, n, op) };
}

/// Runs `l` with `op` in one pass with AVX-512 (16 lanes) or AVX2 and F16C
/// (8); false when the CPU has neither.
pub(super) fn run_f16(l: Loop<'_, f16>, op: Fused) -> bool {
    let (d, x, y, n) = l.raw();
    if has_avx512() && has_f16c() {
        // SAFETY: the CPU has AVX-512 F and F16C (just checked); the parts
        // come from `Loop::raw`.
        unsafe { run_f16_512(d, x, y, n, op) };
        true
    } else if has_f16c() {
        // SAFETY: the CPU has AVX2 and F16C; pointers as above.
        unsafe { run_f16_256(d, x, y, n, op) };
        true
    } else {
        false
    }
}

/// # Safety
///
/// The CPU supports AVX-512 F; `d`, `x`, `y` are valid for `n` elements
/// (`d` for writes; it may alias `x` or `y`).
#[target_feature(enable = "avx512f,f16c")]
unsafe fn run_f16_512(d: *mut f16, x: *const f16, y: *const f16, n: usize, op: Fused) {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm256_storeu_si256, _mm512_add_ps, _mm512_cvtph_ps,
        _mm512_cvtps_ph, _mm512_mul_ps,
    };
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: `i + 16 <= n`: 16 f16 (32 bytes) are readable at `x + i`
        // and `y + i` and writable at `d + i`; unaligned accesses; both
        // loads happen before the store.
        unsafe {
            let fa = _mm512_cvtph_ps(_mm256_loadu_si256(x.add(i).cast::<__m256i>()));
            let fb = _mm512_cvtph_ps(_mm256_loadu_si256(y.add(i).cast::<__m256i>()));
            let r = match op {
                Fused::Add => _mm512_add_ps(fa, fb),
                Fused::Mul => _mm512_mul_ps(fa, fb),
            };
            let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r);
            _mm256_storeu_si256(d.add(i).cast::<__m256i>(), h);
        }
        i += 16;
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { tail(d, x, y, i, n, op) };
}

/// # Safety
///
/// The CPU supports AVX2 and F16C; pointers as for [`run_f16_512`].
#[target_feature(enable = "avx2,f16c")]
unsafe fn run_f16_256(d: *mut f16, x: *const f16, y: *const f16, n: usize, op: Fused) {
    use std::arch::x86_64::{_mm256_add_ps, _mm256_mul_ps};
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: as in `run_f16_512`, for 8 elements (16 bytes).
        unsafe {
            let fa = _mm256_cvtph_ps(_mm_loadu_si128(x.add(i).cast()));
            let fb = _mm256_cvtph_ps(_mm_loadu_si128(y.add(i).cast()));
            let r = match op {
                Fused::Add => _mm256_add_ps(fa, fb),
                Fused::Mul => _mm256_mul_ps(fa, fb),
            };
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r);
            _mm_storeu_si128(d.add(i).cast(), h);
        }
        i += 8;
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { tail(d, x, y, i, n, op) };
}
