//! The x86-64 kernels with AVX2 and F16C, chosen at run time where the CPU
//! has them.

use std::arch::x86_64::{
    _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps, _mm_loadu_si128,
    _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
};

use super::{acc_loop, f16, square_loop, Narrow, Visit, BLOCK};

#[cfg(test)]
thread_local! {
    /// Tests set this to exercise the baseline loops on this thread.
    pub(super) static BASELINE_ONLY: std::cell::Cell<bool> =
        const { std::cell::Cell::new(false) };
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
#[inline]
unsafe fn widen(src: &[f16], dst: &mut [f32]) {
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
#[inline]
unsafe fn narrow(src: &[f32], dst: &mut [f16]) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: as in `widen`, with the roles of the slices swapped.
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

/// The f16 loops with F16C conversions: blocks are widened into stack
/// f32 buffers, combined there (vectorised with AVX2) and narrowed back.
pub(super) enum F16c<'s> {
    Binary {
        dst: &'s mut [f16],
        a: &'s [f16],
        b: &'s [f16],
    },
    Acc {
        acc: &'s mut [f16],
        other: &'s [f16],
        rev: bool,
    },
    Square {
        acc: &'s mut [f16],
    },
}

/// Proof that the CPU has AVX2 and F16C: only [`cpu`] makes one.
#[derive(Clone, Copy)]
pub(super) struct Cpu(());

/// `Some` if the CPU has AVX2 and F16C.
#[inline(always)]
pub(super) fn cpu() -> Option<Cpu> {
    has_f16c().then_some(Cpu(()))
}

/// An [`F16c`] loop cleared to run on this CPU.
pub(super) struct Checked<'s>(pub(super) Cpu, pub(super) F16c<'s>);

impl Visit<f32> for Checked<'_> {
    #[inline(always)]
    fn run<F: Fn(f32, f32) -> f32 + Copy>(self, f: F) {
        // SAFETY: a `Cpu` exists only if the CPU has AVX2 and F16C.
        unsafe { run_f16c(self.1, f) }
    }
}

/// # Safety
///
/// The CPU supports AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
unsafe fn run_f16c<F: Fn(f32, f32) -> f32 + Copy>(l: F16c<'_>, f: F) {
    let mut fa = [0f32; BLOCK];
    let mut fb = [0f32; BLOCK];
    // SAFETY (all blocks below): this function has the features `widen`
    // and `narrow` need.
    match l {
        F16c::Binary { dst, a, b } => {
            let chunks = dst
                .chunks_mut(BLOCK)
                .zip(a.chunks(BLOCK))
                .zip(b.chunks(BLOCK));
            for ((d, x), y) in chunks {
                let (fa, fb) = (&mut fa[..d.len()], &mut fb[..d.len()]);
                // SAFETY: see above.
                unsafe { widen(x, fa) };
                // SAFETY: see above.
                unsafe { widen(y, fb) };
                acc_loop(fa, fb, f);
                // SAFETY: see above.
                unsafe { narrow(fa, d) };
            }
        }
        F16c::Acc { acc, other, rev } => {
            for (d, y) in acc.chunks_mut(BLOCK).zip(other.chunks(BLOCK)) {
                let (fa, fb) = (&mut fa[..d.len()], &mut fb[..d.len()]);
                // SAFETY: see above.
                unsafe { widen(d, fa) };
                // SAFETY: see above.
                unsafe { widen(y, fb) };
                if rev {
                    acc_loop(fa, fb, move |p, q| f(q, p));
                } else {
                    acc_loop(fa, fb, f);
                }
                // SAFETY: see above.
                unsafe { narrow(fa, d) };
            }
        }
        F16c::Square { acc } => {
            for d in acc.chunks_mut(BLOCK) {
                let fa = &mut fa[..d.len()];
                // SAFETY: see above.
                unsafe { widen(d, fa) };
                square_loop(fa, f);
                // SAFETY: see above.
                unsafe { narrow(fa, d) };
            }
        }
    }
}
