//! Host reduction loops.
//!
//! Every loop here is an element-wise pass over slices, monomorphised per
//! (element type, operator), so that LLVM vectorises it: the hot path of the
//! host engine runs these at memory speed. On x86-64 an AVX2 copy of every
//! loop (and F16C conversions for `f16`) is selected at run time when the CPU
//! has it; otherwise the baseline (SSE2) build runs.
//!
//! Semantics, per element:
//!
//! - integers: `Sum` and `Prod` wrap (so the result does not depend on the
//!   order in which ranks are combined); `Min` and `Max` are the ordinary ones;
//! - `f32`/`f64`: `+`, `*`, [`f32::min`], [`f32::max`] (a NaN operand is
//!   ignored by min/max, as IEEE 754 `minNum`/`maxNum`);
//! - `f16`/`bf16`: widened to `f32`, combined as `f32`, rounded back to nearest
//!   (even);
//! - `Avg` reduces pairwise as `Sum` ([`RedOp::pairwise`]); the engine finishes
//!   it once with [`divide_raw`] / [`divide_bytes`] (integer division
//!   truncating toward zero for integer types).
//!
//! Entry points:
//!
//! - [`reduce_raw`] / [`divide_raw`]: raw pointers, for the engine; `dst` may be
//!   one of the inputs (in place).
//! - [`reduce_bytes`], [`reduce_into_bytes`], [`divide_bytes`]: byte slices of
//!   any alignment, for the simulator; they return an error rather than panic.
//! - [`reduce_slice`], [`divide_slice`]: typed slices.

use std::any::TypeId;
use std::marker::PhantomData;
use std::mem::size_of;

use crate::error::{CoreError, Result};
use crate::types::{bf16, f16, DataType, Element, RedOp};

/// Elements per block when misaligned byte slices are staged through aligned
/// stack buffers.
const BLOCK: usize = 256;

// ---------------------------------------------------------------------------
// Element-wise loops, generic over the operator closure.
// ---------------------------------------------------------------------------

/// `dst[i] = f(a[i], b[i])`. The three slices have the same length.
#[inline(always)]
fn binary_loop<T: Copy, F: Fn(T, T) -> T>(dst: &mut [T], a: &[T], b: &[T], f: F) {
    let n = dst.len();
    // Re-slicing to `n` lets LLVM drop every bounds check from the loop.
    let (a, b) = (&a[..n], &b[..n]);
    for ((d, &x), &y) in dst.iter_mut().zip(a).zip(b) {
        *d = f(x, y);
    }
}

/// `acc[i] = f(acc[i], other[i])`. The two slices have the same length.
#[inline(always)]
fn acc_loop<T: Copy, F: Fn(T, T) -> T>(acc: &mut [T], other: &[T], f: F) {
    let other = &other[..acc.len()];
    for (d, &y) in acc.iter_mut().zip(other) {
        *d = f(*d, y);
    }
}

/// `acc[i] = f(acc[i], acc[i])`.
#[inline(always)]
fn square_loop<T: Copy, F: Fn(T, T) -> T>(acc: &mut [T], f: F) {
    for d in acc.iter_mut() {
        *d = f(*d, *d);
    }
}

/// A loop waiting for its operator: [`Arith::visit`] calls `run` with the
/// closure of the requested operator, so each (type, op) pair gets its own
/// monomorphised, vectorisable loop.
trait Visit<T> {
    fn run<F: Fn(T, T) -> T + Copy>(self, f: F);
}

/// Types on which the reduction operators are computed directly.
trait Arith: Copy + 'static {
    /// Run `v` with the pairwise closure of `op` (`Avg` runs as `Sum`).
    fn visit<V: Visit<Self>>(op: RedOp, v: V);
}

macro_rules! arith_int {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn visit<V: Visit<Self>>(op: RedOp, v: V) {
                match op.pairwise() {
                    RedOp::Sum | RedOp::Avg => v.run(|x: $t, y: $t| x.wrapping_add(y)),
                    RedOp::Prod => v.run(|x: $t, y: $t| x.wrapping_mul(y)),
                    RedOp::Min => v.run(|x: $t, y: $t| Ord::min(x, y)),
                    RedOp::Max => v.run(|x: $t, y: $t| Ord::max(x, y)),
                }
            }
        }
    )*};
}
arith_int!(i8, u8, i32, u32, i64, u64);

macro_rules! arith_float {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn visit<V: Visit<Self>>(op: RedOp, v: V) {
                match op.pairwise() {
                    RedOp::Sum | RedOp::Avg => v.run(|x: $t, y: $t| x + y),
                    RedOp::Prod => v.run(|x: $t, y: $t| x * y),
                    RedOp::Min => v.run(|x: $t, y: $t| x.min(y)),
                    RedOp::Max => v.run(|x: $t, y: $t| x.max(y)),
                }
            }
        }
    )*};
}
arith_float!(f32, f64);

/// Loop shapes for the types computed directly.
struct Binary<'s, T> {
    dst: &'s mut [T],
    a: &'s [T],
    b: &'s [T],
}
impl<T: Copy> Visit<T> for Binary<'_, T> {
    #[inline(always)]
    fn run<F: Fn(T, T) -> T + Copy>(self, f: F) {
        binary_loop(self.dst, self.a, self.b, f)
    }
}

struct Acc<'s, T> {
    acc: &'s mut [T],
    other: &'s [T],
    /// Compute `other op acc` rather than `acc op other`.
    rev: bool,
}
impl<T: Copy> Visit<T> for Acc<'_, T> {
    #[inline(always)]
    fn run<F: Fn(T, T) -> T + Copy>(self, f: F) {
        if self.rev {
            acc_loop(self.acc, self.other, move |x, y| f(y, x))
        } else {
            acc_loop(self.acc, self.other, f)
        }
    }
}

struct Square<'s, T> {
    acc: &'s mut [T],
}
impl<T: Copy> Visit<T> for Square<'_, T> {
    #[inline(always)]
    fn run<F: Fn(T, T) -> T + Copy>(self, f: F) {
        square_loop(self.acc, f)
    }
}

// f16 / bf16: each element is widened to f32, combined, and rounded back, in
// one fused loop. The conversions are written branch-free (selects) so that
// the whole loop vectorises on any baseline; they give the same bits as
// `half`'s conversions (tested exhaustively), whose per-element and slice
// forms are far slower in a loop (a call per 8 elements even with F16C). On
// x86-64 CPUs with F16C, f16 instead converts with the hardware instructions
// (module `x86`).

/// A 16-bit float computed through `f32`.
trait Narrow: Copy {
    fn widen(self) -> f32;
    /// Round to nearest, ties to even; NaN stays (quiet) NaN.
    fn narrow(x: f32) -> Self;
}

/// IEEE binary16 to f32 (exact). NaNs are quietened, as `half` does.
#[inline(always)]
fn f16_bits_to_f32(h: u16) -> f32 {
    const SHIFTED_EXP: u32 = 0x7c00 << 13;
    const MAGIC: f32 = 1.0 / 16384.0; // 2^-14, bits (127 - 14) << 23
    let h = u32::from(h);
    let mut o = (h & 0x7fff) << 13; // exponent and mantissa in place
    let exp = o & SHIFTED_EXP;
    o += (127 - 15) << 23; // rebias the exponent
    let special = exp == SHIFTED_EXP;
    if special {
        o += (128 - 16) << 23; // Inf/NaN: exponent all ones
    }
    if special && h & 0x03ff != 0 {
        o |= 0x0040_0000; // quiet NaN
    }
    // Zero or subnormal: renormalise with an exact f32 subtraction.
    let zero_or_sub = f32::from_bits(o + (1 << 23)) - MAGIC;
    let v = if exp == 0 { zero_or_sub.to_bits() } else { o };
    f32::from_bits(v | ((h & 0x8000) << 16))
}

/// f32 to IEEE binary16, rounding to nearest even; overflow gives Inf and a
/// NaN keeps the top of its payload and is quiet, as `half` does.
#[inline(always)]
fn f32_to_f16_bits(x: f32) -> u16 {
    const F32_INF: u32 = 0x7f80_0000;
    const F16_OVERFLOW: u32 = (127 + 16) << 23; // 2^16: rounds to Inf or is Inf/NaN
    const F16_MIN_NORMAL: u32 = (127 - 14) << 23; // 2^-14
    const DENORM_MAGIC: f32 = 0.5; // ulp(0.5) = 2^-24, the f16 subnormal step
    let bits = x.to_bits();
    let sign = bits & 0x8000_0000;
    let f = bits ^ sign;
    let big = if f > F32_INF {
        0x7e00 | ((f >> 13) & 0x03ff)
    } else {
        0x7c00
    };
    // Subnormal or zero result: let the f32 addition round at 2^-24.
    let small = (f32::from_bits(f) + DENORM_MAGIC).to_bits() - DENORM_MAGIC.to_bits();
    // Normal result: rebias, add the round-to-nearest-even increment, shift.
    // A carry out of the mantissa correctly bumps the exponent (up to Inf).
    // (All three candidates are computed, so that the selects vectorise; the
    // unused ones may wrap.)
    let mant_odd = (f >> 13) & 1;
    let normal = f
        .wrapping_sub((127 - 15) << 23)
        .wrapping_add(0x0fff + mant_odd)
        >> 13;
    let o = if f >= F16_OVERFLOW {
        big
    } else if f < F16_MIN_NORMAL {
        small
    } else {
        normal
    };
    (o | (sign >> 16)) as u16
}

/// bfloat16 to f32 (exact). NaNs are quietened, as `half` does.
#[inline(always)]
fn bf16_bits_to_f32(h: u16) -> f32 {
    let x = u32::from(h) << 16;
    let nan = h & 0x7fff > 0x7f80;
    f32::from_bits(if nan { x | 0x0040_0000 } else { x })
}

/// f32 to bfloat16, rounding to nearest even; a NaN stays a quiet NaN.
#[inline(always)]
fn f32_to_bf16_bits(x: f32) -> u16 {
    let x = x.to_bits();
    let nan = x & 0x7fff_ffff > 0x7f80_0000;
    // Round to nearest even: add 0x7fff plus the lowest kept bit. This only
    // wraps for NaN input, which takes the other branch.
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
    let v = if nan { (x >> 16) | 0x0040 } else { rounded };
    v as u16
}

impl Narrow for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn narrow(x: f32) -> Self {
        f16::from_bits(f32_to_f16_bits(x))
    }
}

impl Narrow for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        bf16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn narrow(x: f32) -> Self {
        bf16::from_bits(f32_to_bf16_bits(x))
    }
}

/// Runs a loop over 16-bit floats `H` with an `f32` operator: each pair is
/// widened, combined and rounded back inside the loop.
struct Via<H, V>(V, PhantomData<H>);
impl<H: Narrow, V: Visit<H>> Visit<f32> for Via<H, V> {
    #[inline(always)]
    fn run<F: Fn(f32, f32) -> f32 + Copy>(self, f: F) {
        self.0
            .run(move |x: H, y: H| H::narrow(f(x.widen(), y.widen())))
    }
}

/// Run `f` compiled for the best instruction set this CPU has: on x86-64 an
/// AVX2 copy of every loop (8 f32 lanes instead of SSE2's 4) when the CPU
/// supports it, else the baseline build. `f` and the loops it calls are
/// inlined into the AVX2 function, so they are vectorised for it.
#[inline(always)]
fn fastest<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if x86::has_avx2() {
        // SAFETY: the CPU supports AVX2 (just checked).
        return unsafe { x86::with_avx2(f) };
    }
    f()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! AVX2 and F16C variants, chosen at run time.

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
}

// ---------------------------------------------------------------------------
// The element types braid reduces.
// ---------------------------------------------------------------------------

/// An element type with its reduction kernels.
///
/// # Safety
///
/// Implementors are plain numbers: `size_of::<Self>()` is their datatype's size,
/// `align_of::<Self>() <= size_of::<Self>()`, no padding, and every bit
/// pattern is a valid value, so byte buffers may be viewed as `[Self]` (and
/// back). Only the ten built-in types implement it (the trait is private).
unsafe trait Kernel: Copy + 'static {
    const ZERO: Self;
    /// `dst[i] = a[i] op b[i]`; equal lengths.
    fn binary(dst: &mut [Self], a: &[Self], b: &[Self], op: RedOp);
    /// `acc[i] = acc[i] op other[i]` (or `other[i] op acc[i]` when `rev`);
    /// equal lengths.
    fn accumulate(acc: &mut [Self], other: &[Self], op: RedOp, rev: bool);
    /// `acc[i] = acc[i] op acc[i]`.
    fn square(acc: &mut [Self], op: RedOp);
    /// `dst[i] = dst[i] / divisor`; `divisor != 0`.
    fn divide(dst: &mut [Self], divisor: u32);
}

/// Up to this many elements the baseline loop runs without the dispatch to
/// the AVX2 copy (the latency path: an 8-byte AllReduce reduces one element;
/// element-wise results are the same either way).
const SCALAR_MAX: usize = 16;

macro_rules! kernel_direct {
    ($($t:ty),*) => {$(
        // SAFETY: a primitive number: size == DTYPE.size(), align == size, no
        // padding, every bit pattern valid.
        unsafe impl Kernel for $t {
            const ZERO: Self = 0 as $t;
            #[inline(never)]
            fn binary(dst: &mut [Self], a: &[Self], b: &[Self], op: RedOp) {
                if dst.len() <= SCALAR_MAX {
                    return <$t>::visit(op, Binary { dst, a, b });
                }
                fastest(|| <$t>::visit(op, Binary { dst, a, b }))
            }
            #[inline(never)]
            fn accumulate(acc: &mut [Self], other: &[Self], op: RedOp, rev: bool) {
                if acc.len() <= SCALAR_MAX {
                    return <$t>::visit(op, Acc { acc, other, rev });
                }
                fastest(|| <$t>::visit(op, Acc { acc, other, rev }))
            }
            #[inline(never)]
            fn square(acc: &mut [Self], op: RedOp) {
                fastest(|| <$t>::visit(op, Square { acc }))
            }
            #[inline(never)]
            fn divide(dst: &mut [Self], divisor: u32) {
                fastest(|| divide_direct(dst, divisor))
            }
        }
    )*};
}
kernel_direct!(i8, u8, i32, u32, i64, u64, f32, f64);

/// Divide 16-bit floats through f32.
#[inline(always)]
fn divide_narrow<H: Narrow>(dst: &mut [H], divisor: u32) {
    let d = divisor as f32;
    for x in dst.iter_mut() {
        *x = H::narrow(x.widen() / d);
    }
}

/// Run an f16 loop with F16C conversions when the CPU has them.
macro_rules! f16_loop {
    ($op:expr, $variant:ident { $($field:ident),* }) => {{
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = x86::cpu() {
            let l = x86::F16c::$variant { $($field),* };
            return f32::visit($op, x86::Checked(cpu, l));
        }
        fastest(|| f32::visit($op, Via($variant { $($field),* }, PhantomData)))
    }};
}

// SAFETY: `half` declares `f16` `repr(transparent)` over a `u16`: size ==
// align == 2 (asserted below), no padding, every bit pattern valid.
unsafe impl Kernel for f16 {
    const ZERO: Self = f16::ZERO;
    #[inline(never)]
    fn binary(dst: &mut [Self], a: &[Self], b: &[Self], op: RedOp) {
        f16_loop!(op, Binary { dst, a, b })
    }
    #[inline(never)]
    fn accumulate(acc: &mut [Self], other: &[Self], op: RedOp, rev: bool) {
        f16_loop!(op, Acc { acc, other, rev })
    }
    #[inline(never)]
    fn square(acc: &mut [Self], op: RedOp) {
        f16_loop!(op, Square { acc })
    }
    #[inline(never)]
    fn divide(dst: &mut [Self], divisor: u32) {
        fastest(|| divide_narrow(dst, divisor))
    }
}

// SAFETY: as for `f16`.
unsafe impl Kernel for bf16 {
    const ZERO: Self = bf16::ZERO;
    #[inline(never)]
    fn binary(dst: &mut [Self], a: &[Self], b: &[Self], op: RedOp) {
        fastest(|| f32::visit(op, Via(Binary { dst, a, b }, PhantomData)))
    }
    #[inline(never)]
    fn accumulate(acc: &mut [Self], other: &[Self], op: RedOp, rev: bool) {
        fastest(|| f32::visit(op, Via(Acc { acc, other, rev }, PhantomData)))
    }
    #[inline(never)]
    fn square(acc: &mut [Self], op: RedOp) {
        fastest(|| f32::visit(op, Via(Square { acc }, PhantomData)))
    }
    #[inline(never)]
    fn divide(dst: &mut [Self], divisor: u32) {
        fastest(|| divide_narrow(dst, divisor))
    }
}
const _: () = assert!(
    size_of::<f16>() == 2
        && std::mem::align_of::<f16>() == 2
        && size_of::<bf16>() == 2
        && std::mem::align_of::<bf16>() == 2
);

/// Division by a loop-invariant divisor, per type.
trait DivideDirect: Copy {
    fn divide_all(dst: &mut [Self], divisor: u32);
}

#[inline(always)]
fn divide_direct<T: DivideDirect>(dst: &mut [T], divisor: u32) {
    T::divide_all(dst, divisor)
}

// 8- and 32-bit integers divide through f64, which vectorises (there is no
// SIMD integer division) and is exact: for |x| < 2^53 and 1 <= d, the
// rounding error of fl(x/d) is below 2^-53 * |x|/d < 1/d, the distance from a
// non-integral x/d to the nearest integer, so truncation gives the integer
// quotient (and an integral x/d is computed exactly).
macro_rules! divide_via_f64 {
    ($($t:ty),*) => {$(
        impl DivideDirect for $t {
            #[inline(always)]
            fn divide_all(dst: &mut [Self], divisor: u32) {
                let d = f64::from(divisor);
                for x in dst.iter_mut() {
                    *x = (f64::from(*x) / d) as $t;
                }
            }
        }
    )*};
}
divide_via_f64!(i8, u8, i32, u32);

impl DivideDirect for i64 {
    #[inline(always)]
    fn divide_all(dst: &mut [Self], divisor: u32) {
        let d = i64::from(divisor);
        for x in dst.iter_mut() {
            *x /= d; // Truncates toward zero; cannot overflow as d >= 1.
        }
    }
}

impl DivideDirect for u64 {
    #[inline(always)]
    fn divide_all(dst: &mut [Self], divisor: u32) {
        let d = u64::from(divisor);
        for x in dst.iter_mut() {
            *x /= d;
        }
    }
}

impl DivideDirect for f32 {
    #[inline(always)]
    fn divide_all(dst: &mut [Self], divisor: u32) {
        let d = divisor as f32;
        for x in dst.iter_mut() {
            *x /= d;
        }
    }
}

impl DivideDirect for f64 {
    #[inline(always)]
    fn divide_all(dst: &mut [Self], divisor: u32) {
        let d = f64::from(divisor);
        for x in dst.iter_mut() {
            *x /= d;
        }
    }
}

/// Run `$body` with the type alias `$T` bound to the Rust type of `$dt`.
macro_rules! with_type {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            DataType::I8 => {
                type $T = i8;
                $body
            }
            DataType::U8 => {
                type $T = u8;
                $body
            }
            DataType::I32 => {
                type $T = i32;
                $body
            }
            DataType::U32 => {
                type $T = u32;
                $body
            }
            DataType::I64 => {
                type $T = i64;
                $body
            }
            DataType::U64 => {
                type $T = u64;
                $body
            }
            DataType::F16 => {
                type $T = f16;
                $body
            }
            DataType::Bf16 => {
                type $T = bf16;
                $body
            }
            DataType::F32 => {
                type $T = f32;
                $body
            }
            DataType::F64 => {
                type $T = f64;
                $body
            }
        }
    };
}

// ---------------------------------------------------------------------------
// Raw pointer API (the engine).
// ---------------------------------------------------------------------------

/// `dst[i] = a[i] (op) b[i]` for `n` elements of `dt`. `Avg` reduces as `Sum`
/// (see [`RedOp::pairwise`]); finish it with [`divide_raw`].
///
/// # Safety
///
/// - `a` and `b` are valid for reads of `n * dt.size()` bytes and `dst` for
///   writes of as many (reads too when it equals `a` or `b`);
/// - all three are aligned to `dt.size()` (when `n > 0`);
/// - `dst` may be exactly equal to `a`, to `b`, or to both (in place), but must
///   not otherwise overlap them; `a` and `b` may be equal or overlap freely;
/// - no other thread writes to these bytes for the duration of the call.
pub unsafe fn reduce_raw(
    dst: *mut u8,
    a: *const u8,
    b: *const u8,
    n: usize,
    dt: DataType,
    op: RedOp,
) {
    // SAFETY: forwarded from this function's contract; `T` is `dt`'s type, so
    // `n` elements of `T` are `n * dt.size()` bytes, aligned as required.
    with_type!(dt, T => unsafe { reduce_raw_t::<T>(dst.cast(), a.cast(), b.cast(), n, op) })
}

/// # Safety
///
/// As [`reduce_raw`], counted in elements of `T`.
#[inline]
unsafe fn reduce_raw_t<T: Kernel>(dst: *mut T, a: *const T, b: *const T, n: usize, op: RedOp) {
    if n == 0 {
        return;
    }
    debug_assert!(dst.is_aligned() && a.is_aligned() && b.is_aligned());
    let d = dst.cast_const();
    if d == a && d == b {
        // SAFETY: `dst` is valid for reads and writes of `n` elements and,
        // being equal to both inputs, is the only slice built.
        let acc = unsafe { std::slice::from_raw_parts_mut(dst, n) };
        T::square(acc, op);
    } else if d == a || d == b {
        let (other, rev) = if d == a { (b, false) } else { (a, true) };
        // SAFETY: `dst` is valid for reads and writes of `n` elements, `other`
        // for reads of `n` elements; by the contract `other` does not overlap
        // `dst` (it is not equal to it), so the two slices do not alias.
        let (acc, other) = unsafe {
            (
                std::slice::from_raw_parts_mut(dst, n),
                std::slice::from_raw_parts(other, n),
            )
        };
        T::accumulate(acc, other, op, rev);
    } else {
        // SAFETY: valid and aligned by the contract; `dst` overlaps neither
        // input, and shared slices `a` and `b` may alias each other.
        let (dst, a, b) = unsafe {
            (
                std::slice::from_raw_parts_mut(dst, n),
                std::slice::from_raw_parts(a, n),
                std::slice::from_raw_parts(b, n),
            )
        };
        T::binary(dst, a, b, op);
    }
}

/// `dst[i] = dst[i] / divisor` for `n` elements of `dt`: the finishing step of
/// `Avg`. Integer types use integer division truncating toward zero; `f16` and
/// `bf16` divide as `f32` and round back; `f32` divides by `divisor as f32`.
///
/// # Panics
///
/// If `divisor` is 0.
///
/// # Safety
///
/// `dst` is valid for reads and writes of `n * dt.size()` bytes, aligned to
/// `dt.size()` (when `n > 0`), and no other thread accesses those bytes for
/// the duration of the call.
pub unsafe fn divide_raw(dst: *mut u8, n: usize, dt: DataType, divisor: u32) {
    assert!(divisor != 0, "divide_raw: divisor is 0");
    if n == 0 || divisor == 1 {
        return;
    }
    with_type!(dt, T => {
        debug_assert!(dst.cast::<T>().is_aligned());
        // SAFETY: by the contract `dst` is valid, aligned and unaliased for
        // `n` elements of `T` (`T` is `dt`'s type).
        let dst = unsafe { std::slice::from_raw_parts_mut(dst.cast::<T>(), n) };
        T::divide(dst, divisor);
    })
}

// ---------------------------------------------------------------------------
// Byte-slice API (the simulator): any alignment, errors rather than panics.
// ---------------------------------------------------------------------------

fn check_lengths(dt: DataType, what: &str, lens: &[usize]) -> Result<()> {
    let n = lens[0];
    if lens.iter().any(|&l| l != n) {
        return Err(CoreError::InvalidArgument(format!(
            "{what}: buffer lengths differ ({lens:?} bytes)"
        )));
    }
    // (Not `is_multiple_of`: that needs Rust 1.87.)
    let partial = n % dt.size();
    if partial != 0 {
        return Err(CoreError::InvalidArgument(format!(
            "{what}: {n} bytes is not a whole number of {dt} elements ({} bytes each)",
            dt.size()
        )));
    }
    Ok(())
}

/// View `bytes` as `[T]` if it is aligned for `T`; its length is a multiple
/// of `size_of::<T>()` (checked by the callers).
#[inline]
fn view<T: Kernel>(bytes: &[u8]) -> Option<&[T]> {
    if !bytes.as_ptr().cast::<T>().is_aligned() {
        return None;
    }
    // SAFETY: aligned (checked), in bounds (`len / size` whole elements), and
    // every bit pattern is a valid `T` (`Kernel` contract).
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len() / size_of::<T>()) })
}

/// Mutable [`view`].
#[inline]
fn view_mut<T: Kernel>(bytes: &mut [u8]) -> Option<&mut [T]> {
    if !bytes.as_ptr().cast::<T>().is_aligned() {
        return None;
    }
    // SAFETY: as in `view`; the exclusive borrow of `bytes` moves into the
    // result, and any `T` written is valid bytes.
    Some(unsafe {
        std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast(), bytes.len() / size_of::<T>())
    })
}

/// The bytes of `s`.
#[inline]
fn as_bytes<T: Kernel>(s: &[T]) -> &[u8] {
    // SAFETY: `T` has no padding (`Kernel` contract), so all its bytes are
    // initialised; same memory region and lifetime.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

/// The bytes of `s`, writable.
#[inline]
fn as_bytes_mut<T: Kernel>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; any bytes written form a valid `T` (`Kernel`
    // contract).
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}

fn bytes_binary<T: Kernel>(dst: &mut [u8], a: &[u8], b: &[u8], op: RedOp) {
    if let (Some(x), Some(y)) = (view::<T>(a), view::<T>(b)) {
        if dst.as_ptr().cast::<T>().is_aligned() {
            if let Some(d) = view_mut::<T>(dst) {
                T::binary(d, x, y, op);
            }
            return;
        }
    }
    // Misaligned: stage blocks through aligned stack buffers.
    let sz = size_of::<T>();
    let (mut bd, mut ba, mut bb) = ([T::ZERO; BLOCK], [T::ZERO; BLOCK], [T::ZERO; BLOCK]);
    let chunks = dst
        .chunks_mut(BLOCK * sz)
        .zip(a.chunks(BLOCK * sz))
        .zip(b.chunks(BLOCK * sz));
    for ((d, x), y) in chunks {
        let m = d.len() / sz;
        as_bytes_mut(&mut ba[..m]).copy_from_slice(x);
        as_bytes_mut(&mut bb[..m]).copy_from_slice(y);
        T::binary(&mut bd[..m], &ba[..m], &bb[..m], op);
        d.copy_from_slice(as_bytes(&bd[..m]));
    }
}

fn bytes_accumulate<T: Kernel>(acc: &mut [u8], other: &[u8], op: RedOp) {
    if let Some(y) = view::<T>(other) {
        if acc.as_ptr().cast::<T>().is_aligned() {
            if let Some(d) = view_mut::<T>(acc) {
                T::accumulate(d, y, op, false);
            }
            return;
        }
    }
    let sz = size_of::<T>();
    let (mut bd, mut bo) = ([T::ZERO; BLOCK], [T::ZERO; BLOCK]);
    for (d, y) in acc.chunks_mut(BLOCK * sz).zip(other.chunks(BLOCK * sz)) {
        let m = d.len() / sz;
        as_bytes_mut(&mut bd[..m]).copy_from_slice(d);
        as_bytes_mut(&mut bo[..m]).copy_from_slice(y);
        T::accumulate(&mut bd[..m], &bo[..m], op, false);
        d.copy_from_slice(as_bytes(&bd[..m]));
    }
}

fn bytes_divide<T: Kernel>(dst: &mut [u8], divisor: u32) {
    if dst.as_ptr().cast::<T>().is_aligned() {
        if let Some(d) = view_mut::<T>(dst) {
            T::divide(d, divisor);
        }
        return;
    }
    let sz = size_of::<T>();
    let mut bd = [T::ZERO; BLOCK];
    for d in dst.chunks_mut(BLOCK * sz) {
        let m = d.len() / sz;
        as_bytes_mut(&mut bd[..m]).copy_from_slice(d);
        T::divide(&mut bd[..m], divisor);
        d.copy_from_slice(as_bytes(&bd[..m]));
    }
}

/// `dst = a (op) b`, element-wise over byte buffers holding elements of `dt`
/// (native byte order). `Avg` reduces as `Sum`. Any alignment works (aligned
/// buffers take the fast path).
///
/// # Errors
///
/// [`CoreError::InvalidArgument`] if the three lengths differ or are not a
/// multiple of `dt.size()`; nothing is written then.
pub fn reduce_bytes(dst: &mut [u8], a: &[u8], b: &[u8], dt: DataType, op: RedOp) -> Result<()> {
    check_lengths(dt, "reduce_bytes", &[dst.len(), a.len(), b.len()])?;
    with_type!(dt, T => bytes_binary::<T>(dst, a, b, op));
    Ok(())
}

/// `acc = acc (op) other`, element-wise over byte buffers holding elements of
/// `dt`. `Avg` reduces as `Sum`. Any alignment works.
///
/// # Errors
///
/// [`CoreError::InvalidArgument`] if the lengths differ or are not a multiple
/// of `dt.size()`; nothing is written then.
pub fn reduce_into_bytes(acc: &mut [u8], other: &[u8], dt: DataType, op: RedOp) -> Result<()> {
    check_lengths(dt, "reduce_into_bytes", &[acc.len(), other.len()])?;
    with_type!(dt, T => bytes_accumulate::<T>(acc, other, op));
    Ok(())
}

/// `dst[i] = dst[i] / divisor` over a byte buffer of `dt` elements (see
/// [`divide_raw`] for the semantics). Any alignment works.
///
/// # Errors
///
/// [`CoreError::InvalidArgument`] if the length is not a multiple of
/// `dt.size()` or `divisor` is 0; nothing is written then.
pub fn divide_bytes(dst: &mut [u8], dt: DataType, divisor: u32) -> Result<()> {
    check_lengths(dt, "divide_bytes", &[dst.len()])?;
    if divisor == 0 {
        return Err(CoreError::InvalidArgument(
            "divide_bytes: divisor is 0".into(),
        ));
    }
    if divisor != 1 {
        with_type!(dt, T => bytes_divide::<T>(dst, divisor));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Typed API.
// ---------------------------------------------------------------------------

/// Reinterpret `&mut [T]` as `&mut [K]` when `T` is `K`.
fn typed_mut<T: 'static, K: 'static>(s: &mut [T]) -> Option<&mut [K]> {
    if TypeId::of::<T>() != TypeId::of::<K>() {
        return None;
    }
    // SAFETY: `T` and `K` are the same type (equal `TypeId`s).
    Some(unsafe { &mut *(s as *mut [T] as *mut [K]) })
}

/// Reinterpret `&[T]` as `&[K]` when `T` is `K`.
fn typed<T: 'static, K: 'static>(s: &[T]) -> Option<&[K]> {
    if TypeId::of::<T>() != TypeId::of::<K>() {
        return None;
    }
    // SAFETY: `T` and `K` are the same type (equal `TypeId`s).
    Some(unsafe { &*(s as *const [T] as *const [K]) })
}

fn not_builtin<T>() -> CoreError {
    CoreError::InvalidArgument(format!(
        "{} is not one of braid's built-in element types",
        std::any::type_name::<T>()
    ))
}

/// `acc[i] = acc[i] (op) other[i]` on typed slices. `Avg` reduces as `Sum`
/// (finish with [`divide_slice`]).
///
/// # Errors
///
/// [`CoreError::InvalidArgument`] if the lengths differ (nothing is written).
/// ([`Element`] is sealed to the ten built-in types; any other `T` would be an
/// error too.)
pub fn reduce_slice<T: Element>(acc: &mut [T], other: &[T], op: RedOp) -> Result<()> {
    if acc.len() != other.len() {
        return Err(CoreError::InvalidArgument(format!(
            "reduce_slice: lengths differ ({} and {} elements)",
            acc.len(),
            other.len()
        )));
    }
    with_type!(T::DTYPE, K => match (typed_mut::<T, K>(acc), typed::<T, K>(other)) {
        (Some(acc), Some(other)) => {
            K::accumulate(acc, other, op, false);
            Ok(())
        }
        _ => Err(not_builtin::<T>()),
    })
}

/// `dst[i] = dst[i] / divisor` on a typed slice (see [`divide_raw`]).
///
/// # Errors
///
/// [`CoreError::InvalidArgument`] if `divisor` is 0.
pub fn divide_slice<T: Element>(dst: &mut [T], divisor: u32) -> Result<()> {
    if divisor == 0 {
        return Err(CoreError::InvalidArgument(
            "divide_slice: divisor is 0".into(),
        ));
    }
    with_type!(T::DTYPE, K => match typed_mut::<T, K>(dst) {
        Some(dst) => {
            K::divide(dst, divisor);
            Ok(())
        }
        None => Err(not_builtin::<T>()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LENS: [usize; 6] = [0, 1, 7, 33, 1000, 4099];

    /// Run `f` on every code path this CPU can take: the run-time selected
    /// (AVX2/F16C) loops and the baseline ones.
    fn on_every_path(f: impl Fn()) {
        f();
        #[cfg(target_arch = "x86_64")]
        {
            x86::BASELINE_ONLY.with(|b| b.set(true));
            f();
            x86::BASELINE_ONLY.with(|b| b.set(false));
        }
    }

    /// xorshift64*: deterministic test data.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    /// A value decoded from an element: integers widen to i128, floats to f64.
    #[derive(Clone, Copy, Debug)]
    enum V {
        I(i128),
        F(f64),
    }

    fn decode(dt: DataType, e: &[u8]) -> V {
        match dt {
            DataType::I8 => V::I(i8::from_ne_bytes(e.try_into().unwrap()).into()),
            DataType::U8 => V::I(u8::from_ne_bytes(e.try_into().unwrap()).into()),
            DataType::I32 => V::I(i32::from_ne_bytes(e.try_into().unwrap()).into()),
            DataType::U32 => V::I(u32::from_ne_bytes(e.try_into().unwrap()).into()),
            DataType::I64 => V::I(i64::from_ne_bytes(e.try_into().unwrap()).into()),
            DataType::U64 => V::I(u64::from_ne_bytes(e.try_into().unwrap()).into()),
            DataType::F16 => V::F(f16::from_ne_bytes(e.try_into().unwrap()).to_f64()),
            DataType::Bf16 => V::F(bf16::from_ne_bytes(e.try_into().unwrap()).to_f64()),
            DataType::F32 => V::F(f32::from_ne_bytes(e.try_into().unwrap()).into()),
            DataType::F64 => V::F(f64::from_ne_bytes(e.try_into().unwrap())),
        }
    }

    /// Encode, wrapping integers (`as` truncates the i128) and rounding floats.
    fn encode(dt: DataType, v: V) -> Vec<u8> {
        match (dt, v) {
            (DataType::I8, V::I(x)) => (x as i8).to_ne_bytes().to_vec(),
            (DataType::U8, V::I(x)) => (x as u8).to_ne_bytes().to_vec(),
            (DataType::I32, V::I(x)) => (x as i32).to_ne_bytes().to_vec(),
            (DataType::U32, V::I(x)) => (x as u32).to_ne_bytes().to_vec(),
            (DataType::I64, V::I(x)) => (x as i64).to_ne_bytes().to_vec(),
            (DataType::U64, V::I(x)) => (x as u64).to_ne_bytes().to_vec(),
            (DataType::F16, V::F(x)) => f16::from_f64(x).to_ne_bytes().to_vec(),
            (DataType::Bf16, V::F(x)) => bf16::from_f64(x).to_ne_bytes().to_vec(),
            (DataType::F32, V::F(x)) => (x as f32).to_ne_bytes().to_vec(),
            (DataType::F64, V::F(x)) => x.to_ne_bytes().to_vec(),
            _ => unreachable!(),
        }
    }

    /// Straightforward per-element reference.
    fn reference(dt: DataType, op: RedOp, a: &[u8], b: &[u8]) -> Vec<u8> {
        let sz = dt.size();
        let mut out = Vec::with_capacity(a.len());
        for (x, y) in a.chunks(sz).zip(b.chunks(sz)) {
            let v = match (decode(dt, x), decode(dt, y)) {
                // Only the low bits are kept, so i128 wrapping is exact.
                (V::I(x), V::I(y)) => V::I(match op {
                    RedOp::Sum | RedOp::Avg => x.wrapping_add(y),
                    RedOp::Prod => x.wrapping_mul(y),
                    RedOp::Min => x.min(y),
                    RedOp::Max => x.max(y),
                }),
                (V::F(x), V::F(y)) => V::F(match op {
                    RedOp::Sum | RedOp::Avg => x + y,
                    RedOp::Prod => x * y,
                    RedOp::Min => x.min(y),
                    RedOp::Max => x.max(y),
                }),
                _ => unreachable!(),
            };
            out.extend(encode(dt, v));
        }
        out
    }

    fn reference_divide(dt: DataType, a: &[u8], d: u32) -> Vec<u8> {
        let sz = dt.size();
        a.chunks(sz)
            .flat_map(|x| {
                encode(
                    dt,
                    match decode(dt, x) {
                        V::I(x) => V::I(x / i128::from(d)), // truncates toward zero
                        V::F(x) => V::F(x / f64::from(d)),
                    },
                )
            })
            .collect()
    }

    /// `n` random elements: integers over their full range; floats small
    /// multiples of 1/2 so that sums and products are exact in every type.
    fn values(dt: DataType, n: usize, rng: &mut Rng) -> Vec<u8> {
        (0..n)
            .flat_map(|_| {
                let r = rng.next();
                if dt.is_float() {
                    let k = (r % 33) as i64 - 16;
                    encode(dt, V::F(k as f64 / 2.0))
                } else {
                    r.to_ne_bytes()[..dt.size()].to_vec()
                }
            })
            .collect()
    }

    /// Random finite non-zero floats over (most of) the type's range.
    fn wild_floats(dt: DataType, n: usize, rng: &mut Rng) -> Vec<u8> {
        let mut out = Vec::new();
        while out.len() < n * dt.size() {
            let bits = rng.next().to_ne_bytes();
            let e = &bits[..dt.size()];
            if let V::F(x) = decode(dt, e) {
                if x.is_finite() && x != 0.0 {
                    out.extend_from_slice(e);
                }
            }
        }
        out
    }

    /// A zeroed byte buffer of `len` bytes starting at an address that is
    /// 8-aligned plus `offset`.
    struct Buf {
        v: Vec<u8>,
        start: usize,
        len: usize,
    }
    impl Buf {
        fn new(len: usize, offset: usize) -> Buf {
            let v = vec![0u8; len + 16];
            let start = v.as_ptr().align_offset(8) + offset;
            Buf { v, start, len }
        }
        fn from(data: &[u8], offset: usize) -> Buf {
            let mut b = Buf::new(data.len(), offset);
            b.bytes_mut().copy_from_slice(data);
            b
        }
        fn bytes(&self) -> &[u8] {
            &self.v[self.start..self.start + self.len]
        }
        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut self.v[self.start..self.start + self.len]
        }
        fn ptr(&mut self) -> *mut u8 {
            self.bytes_mut().as_mut_ptr()
        }
    }

    /// Check every entry point on inputs `a`, `b` (aligned).
    fn check_all_forms(dt: DataType, op: RedOp, a: &[u8], b: &[u8]) {
        let n = a.len() / dt.size();
        let want = reference(dt, op, a, b);
        let (mut ba, mut bb) = (Buf::from(a, 0), Buf::from(b, 0));
        let expect = |got: &[u8], want: &[u8], how: &str| {
            assert!(got == want, "{dt} {op} n={n} via {how}: wrong result");
        };

        let mut dst = Buf::new(a.len(), 0);
        reduce_bytes(dst.bytes_mut(), ba.bytes(), bb.bytes(), dt, op).unwrap();
        expect(dst.bytes(), &want, "reduce_bytes");

        let mut dst = Buf::new(a.len(), 0);
        // SAFETY: three distinct 8-aligned buffers of n elements.
        unsafe { reduce_raw(dst.ptr(), ba.ptr(), bb.ptr(), n, dt, op) };
        expect(dst.bytes(), &want, "reduce_raw distinct");

        let mut acc = Buf::from(a, 0);
        let p = acc.ptr();
        // SAFETY: dst == a, b a distinct buffer; aligned, n elements.
        unsafe { reduce_raw(p, p, bb.ptr(), n, dt, op) };
        expect(acc.bytes(), &want, "reduce_raw dst==a");

        let mut acc = Buf::from(b, 0);
        let p = acc.ptr();
        // SAFETY: dst == b, a a distinct buffer; aligned, n elements.
        unsafe { reduce_raw(p, ba.ptr(), p, n, dt, op) };
        expect(acc.bytes(), &want, "reduce_raw dst==b");

        let mut acc = Buf::from(a, 0);
        reduce_into_bytes(acc.bytes_mut(), bb.bytes(), dt, op).unwrap();
        expect(acc.bytes(), &want, "reduce_into_bytes");

        // a == b, distinct dst; and all three equal.
        let want_sq = reference(dt, op, a, a);
        let mut dst = Buf::new(a.len(), 0);
        let pa = ba.ptr();
        // SAFETY: a == b (shared reads), dst distinct; aligned, n elements.
        unsafe { reduce_raw(dst.ptr(), pa, pa, n, dt, op) };
        expect(dst.bytes(), &want_sq, "reduce_raw a==b");
        let mut acc = Buf::from(a, 0);
        let p = acc.ptr();
        // SAFETY: dst == a == b; aligned, n elements.
        unsafe { reduce_raw(p, p, p, n, dt, op) };
        expect(acc.bytes(), &want_sq, "reduce_raw dst==a==b");

        // Misaligned byte slices: all offset by one, and mixed offsets.
        for (od, oa, ob) in [(1, 1, 1), (0, 1, 3), (3, 0, 0), (2, 2, 0)] {
            let (xa, xb) = (Buf::from(a, oa), Buf::from(b, ob));
            let mut dst = Buf::new(a.len(), od);
            reduce_bytes(dst.bytes_mut(), xa.bytes(), xb.bytes(), dt, op).unwrap();
            let how = format!("reduce_bytes offsets {od},{oa},{ob}");
            expect(dst.bytes(), &want, &how);
            let mut acc = Buf::from(a, od);
            reduce_into_bytes(acc.bytes_mut(), xb.bytes(), dt, op).unwrap();
            let how = format!("reduce_into_bytes offsets {od},{ob}");
            expect(acc.bytes(), &want, &how);
        }
    }

    #[test]
    fn half_widening_matches_half_crate_exhaustively() {
        for h in 0..=u16::MAX {
            let want = f16::from_bits(h).to_f32().to_bits();
            assert_eq!(f16_bits_to_f32(h).to_bits(), want, "f16 {h:#06x}");
            let want = bf16::from_bits(h).to_f32().to_bits();
            assert_eq!(bf16_bits_to_f32(h).to_bits(), want, "bf16 {h:#06x}");
        }
    }

    fn check_narrowing(x: f32) {
        let want = f16::from_f32(x).to_bits();
        assert_eq!(f32_to_f16_bits(x), want, "f32 {:#010x} to f16", x.to_bits());
        let want = bf16::from_f32(x).to_bits();
        assert_eq!(
            f32_to_bf16_bits(x),
            want,
            "f32 {:#010x} to bf16",
            x.to_bits()
        );
    }

    #[test]
    fn half_narrowing_matches_half_crate_on_every_boundary() {
        // Every representable value, the midpoints between neighbours (ties)
        // and the f32 values either side of them, with both signs.
        for h in 0..=u16::MAX {
            for (lo, hi) in [
                (
                    f16::from_bits(h).to_f64(),
                    f16::from_bits(h.wrapping_add(1)).to_f64(),
                ),
                (
                    bf16::from_bits(h).to_f64(),
                    bf16::from_bits(h.wrapping_add(1)).to_f64(),
                ),
            ] {
                let mid = ((lo + hi) / 2.0) as f32; // exact when both are finite
                for x in [lo as f32, mid] {
                    for y in [
                        x,
                        f32::from_bits(x.to_bits().wrapping_add(1)),
                        f32::from_bits(x.to_bits().wrapping_sub(1)),
                    ] {
                        check_narrowing(y);
                        check_narrowing(-y);
                    }
                }
            }
        }
        // And a sweep of the whole f32 bit space.
        for b in (0..=u32::MAX).step_by(997) {
            check_narrowing(f32::from_bits(b));
        }
    }

    /// Every 2^32 f32 takes ~30 s; a stride that is odd and prime visits
    /// every exponent and a spread of mantissas (and rounding ties) quickly.
    #[test]
    fn half_narrowing_matches_half_crate_on_a_stride_of_all_f32() {
        let mut b: u32 = 0;
        loop {
            check_narrowing(f32::from_bits(b));
            match b.checked_add(4093) {
                Some(n) => b = n,
                None => break,
            }
        }
    }

    #[test]
    fn every_type_op_and_form_matches_reference() {
        on_every_path(|| {
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
            for dt in DataType::ALL {
                for op in RedOp::ALL {
                    for n in LENS {
                        let a = values(dt, n, &mut rng);
                        let b = values(dt, n, &mut rng);
                        check_all_forms(dt, op, &a, &b);
                    }
                }
            }
        });
    }

    #[test]
    fn floats_over_their_whole_range_round_like_the_reference() {
        on_every_path(|| {
            // Sum and product of two f16/bf16/f32 values computed in f32 and
            // rounded back equals the f64 result rounded back (f32/f64 carry at
            // least 2p+2 bits, so double rounding is innocuous).
            let mut rng = Rng(42);
            for dt in [DataType::F16, DataType::Bf16, DataType::F32, DataType::F64] {
                for op in RedOp::ALL {
                    let a = wild_floats(dt, 4099, &mut rng);
                    let b = wild_floats(dt, 4099, &mut rng);
                    check_all_forms(dt, op, &a, &b);
                }
            }
        });
    }

    #[test]
    fn integers_wrap() {
        on_every_path(|| {
            let mut a = [i32::MAX, i32::MIN, 3];
            reduce_slice(&mut a, &[1, -1, 5], RedOp::Sum).unwrap();
            assert_eq!(a, [i32::MIN, i32::MAX, 8]);
            let mut a = [u8::MAX, 16, 3];
            reduce_slice(&mut a, &[2, 16, 5], RedOp::Prod).unwrap();
            assert_eq!(a, [254, 0, 15]);
            let mut a = [i64::MIN, -1];
            reduce_slice(&mut a, &[-1, 7], RedOp::Min).unwrap();
            assert_eq!(a, [i64::MIN, -1]);
        });
    }

    #[test]
    fn float_min_max_ignore_nan_like_f32_min() {
        on_every_path(|| {
            let mut a = [f32::NAN, 1.0, 2.0];
            reduce_slice(&mut a, &[1.0, f32::NAN, 3.0], RedOp::Min).unwrap();
            assert_eq!(a, [1.0, 1.0, 2.0]);
            let nan = f16::NAN;
            let mut h = [nan, f16::from_f32(1.5)];
            reduce_slice(&mut h, &[f16::from_f32(-2.0), nan], RedOp::Max).unwrap();
            assert_eq!(h, [f16::from_f32(-2.0), f16::from_f32(1.5)]);
            let mut h = [bf16::from_f32(1.0), bf16::NAN];
            reduce_slice(&mut h, &[bf16::NAN, bf16::from_f32(-4.0)], RedOp::Min).unwrap();
            assert_eq!(h, [bf16::from_f32(1.0), bf16::from_f32(-4.0)]);
        });
    }

    #[test]
    fn f16_rounds_back_to_nearest() {
        on_every_path(|| {
            // 2048 + 1 is not representable in f16 (ties to even: 2048); 2048 + 3
            // rounds to 2052.
            let mut h = [f16::from_f32(2048.0), f16::from_f32(2048.0)];
            reduce_slice(
                &mut h,
                &[f16::from_f32(1.0), f16::from_f32(3.0)],
                RedOp::Sum,
            )
            .unwrap();
            assert_eq!(h, [f16::from_f32(2048.0), f16::from_f32(2052.0)]);
            let mut b = [bf16::from_f32(256.0)];
            reduce_slice(&mut b, &[bf16::from_f32(3.0)], RedOp::Sum).unwrap();
            assert_eq!(b, [bf16::from_f32(260.0)]);
        });
    }

    #[test]
    fn typed_slices_match_reference() {
        let mut rng = Rng(7);
        let a: Vec<f32> = (0..1000).map(|_| (rng.next() % 33) as f32 - 16.0).collect();
        let b: Vec<f32> = (0..1000).map(|_| (rng.next() % 33) as f32 - 16.0).collect();
        for op in RedOp::ALL {
            let mut acc = a.clone();
            reduce_slice(&mut acc, &b, op).unwrap();
            let want: Vec<f32> = a
                .iter()
                .zip(&b)
                .map(|(&x, &y)| match op {
                    RedOp::Sum | RedOp::Avg => x + y,
                    RedOp::Prod => x * y,
                    RedOp::Min => x.min(y),
                    RedOp::Max => x.max(y),
                })
                .collect();
            assert_eq!(acc, want, "{op}");
        }
        let mut v = vec![-7i8, 7, -128, 127];
        divide_slice(&mut v, 2).unwrap();
        assert_eq!(v, [-3, 3, -64, 63]);
    }

    #[test]
    fn divide_matches_reference() {
        on_every_path(|| {
            let mut rng = Rng(0xdead_beef);
            let divisors = [
                1u32,
                2,
                3,
                7,
                8,
                100,
                127,
                128,
                255,
                256,
                1000,
                65_537,
                1 << 24,
            ];
            let int_only = [u32::MAX, (1 << 31) + 1];
            for dt in DataType::ALL {
                for n in LENS {
                    let mut a = if dt.is_float() {
                        wild_floats(dt, n, &mut rng)
                    } else {
                        values(dt, n, &mut rng)
                    };
                    // Extremes of the integer types.
                    if !dt.is_float() && n >= 4 {
                        let sz = dt.size();
                        a[..sz].fill(0x00);
                        a[sz..2 * sz].fill(0xff);
                        let hi = if cfg!(target_endian = "little") {
                            sz - 1
                        } else {
                            0
                        };
                        a[2 * sz..3 * sz].fill(0x00);
                        a[2 * sz + hi] = 0x80;
                        a[3 * sz..4 * sz].fill(0xff);
                        a[3 * sz + hi] = 0x7f;
                    }
                    let extra: &[u32] = if dt.is_float() { &[] } else { &int_only };
                    for &d in divisors.iter().chain(extra) {
                        let want = reference_divide(dt, &a, d);
                        let what = format!("{dt} n={n} / {d}");

                        let mut x = Buf::from(&a, 0);
                        divide_bytes(x.bytes_mut(), dt, d).unwrap();
                        assert_eq!(x.bytes(), &want[..], "divide_bytes {what}");

                        let mut x = Buf::from(&a, 1);
                        divide_bytes(x.bytes_mut(), dt, d).unwrap();
                        assert_eq!(x.bytes(), &want[..], "divide_bytes misaligned {what}");

                        let mut x = Buf::from(&a, 0);
                        // SAFETY: an 8-aligned buffer of n elements.
                        unsafe { divide_raw(x.ptr(), n, dt, d) };
                        assert_eq!(x.bytes(), &want[..], "divide_raw {what}");
                    }
                }
            }
        });
    }

    #[test]
    fn avg_is_sum_then_divide() {
        on_every_path(|| {
            let mut acc = [1.0f32, 2.0, -3.0];
            for other in [[3.0f32, 4.0, 5.0], [5.0, 0.0, -2.0]] {
                reduce_slice(&mut acc, &other, RedOp::Avg).unwrap();
            }
            divide_slice(&mut acc, 3).unwrap();
            assert_eq!(acc, [3.0, 2.0, 0.0]);
            let mut i = [-7i32, 7];
            divide_slice(&mut i, 2).unwrap();
            assert_eq!(i, [-3, 3]); // toward zero
        });
    }

    #[test]
    fn bad_lengths_and_divisor_are_errors() {
        let a = [0u8; 8];
        let mut d = [0u8; 8];
        let mut short = [0u8; 4];
        let err = |r: Result<()>| matches!(r, Err(CoreError::InvalidArgument(_)));
        assert!(err(reduce_bytes(
            &mut short,
            &a,
            &a,
            DataType::F32,
            RedOp::Sum
        )));
        assert!(err(reduce_bytes(
            &mut d,
            &a,
            &a[..4],
            DataType::F32,
            RedOp::Sum
        )));
        assert!(err(reduce_bytes(
            &mut d[..6],
            &a[..6],
            &a[..6],
            DataType::F32,
            RedOp::Sum
        )));
        assert!(err(reduce_into_bytes(
            &mut d,
            &a[..4],
            DataType::U8,
            RedOp::Max
        )));
        assert!(err(reduce_into_bytes(
            &mut d[..7],
            &a[..7],
            DataType::I64,
            RedOp::Max
        )));
        assert!(err(divide_bytes(&mut d[..3], DataType::F16, 2)));
        assert!(err(divide_bytes(&mut d, DataType::F16, 0)));
        assert!(err(reduce_slice(&mut [1.0f32, 2.0], &[1.0], RedOp::Sum)));
        assert!(err(divide_slice(&mut [1.0f32], 0)));
        // Nothing was written by the failing calls.
        assert_eq!(d, [0u8; 8]);
        // Empty buffers are fine.
        reduce_bytes(&mut [], &[], &[], DataType::F64, RedOp::Prod).unwrap();
        divide_bytes(&mut [], DataType::I8, 3).unwrap();
    }
}
