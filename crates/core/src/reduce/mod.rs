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

// f16 / bf16: each element is widened to f32, combined, and rounded back.
// The scalar conversions are written branch-free (selects) and give the same
// bits as `half`'s (tested exhaustively), whose per-element and slice forms
// are far slower in a loop; on x86-64 the slice conversions use F16C (f16)
// or AVX2 integer rounding (bf16), and Sum and Prod run in one pass with
// AVX-512 or AVX2 (module `x86`).

/// A 16-bit float computed through `f32`.
trait Narrow: Copy {
    fn widen(self) -> f32;
    /// Round to nearest, ties to even; NaN stays (quiet) NaN.
    fn narrow(x: f32) -> Self;
    /// `dst[i] = src[i].widen()` for the shorter length.
    #[inline(always)]
    fn widen_slice(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.widen();
        }
    }
    /// `dst[i] = narrow(src[i])` for the shorter length.
    #[inline(always)]
    fn narrow_slice(src: &[f32], dst: &mut [Self]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::narrow(s);
        }
    }
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
    #[inline(always)]
    fn widen_slice(src: &[Self], dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if x86::has_f16c() {
            // SAFETY: the CPU has AVX2 and F16C (just checked).
            return unsafe { x86::widen_f16(src, dst) };
        }
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.widen();
        }
    }
    #[inline(always)]
    fn narrow_slice(src: &[f32], dst: &mut [Self]) {
        #[cfg(target_arch = "x86_64")]
        if x86::has_f16c() {
            // SAFETY: the CPU has AVX2 and F16C (just checked).
            return unsafe { x86::narrow_f16(src, dst) };
        }
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::narrow(s);
        }
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
    #[inline(always)]
    fn widen_slice(src: &[Self], dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if x86::has_avx2() {
            // SAFETY: the CPU has AVX2 (just checked).
            return unsafe { x86::widen_bf16(src, dst) };
        }
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.widen();
        }
    }
    #[inline(always)]
    fn narrow_slice(src: &[f32], dst: &mut [Self]) {
        #[cfg(target_arch = "x86_64")]
        if x86::has_avx2() {
            // SAFETY: the CPU has AVX2 (just checked).
            return unsafe { x86::narrow_bf16(src, dst) };
        }
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::narrow(s);
        }
    }
}

/// A loop over 16-bit floats computed as f32. As a [`Visit`] (any operator)
/// it widens a block at a time into `f32` stack buffers, combines there and
/// rounds back: three simple loops, each of which vectorises (a loop fused
/// per element did not for bf16, whose NaN selects on 16-bit lanes kept it
/// at 1.7-1.9 GiB/s where f32 sums at 9-30). Sum and Prod run it in one
/// pass instead where the CPU allows ([`Loop::raw`], module `x86`).
enum Loop<'s, H> {
    Binary {
        dst: &'s mut [H],
        a: &'s [H],
        b: &'s [H],
    },
    Acc {
        acc: &'s mut [H],
        other: &'s [H],
        rev: bool,
    },
    Square {
        acc: &'s mut [H],
    },
}

#[inline(always)]
fn widen_block<H: Narrow>(src: &[H], dst: &mut [f32]) {
    H::widen_slice(src, dst)
}

#[inline(always)]
fn narrow_block<H: Narrow>(src: &[f32], dst: &mut [H]) {
    H::narrow_slice(src, dst)
}

impl<H> Loop<'_, H> {
    /// The loop as raw parts for a one-pass kernel: destination, first and
    /// second operand (`first op second`), length. The destination may be
    /// an operand; element `i` of both is read before element `i` of the
    /// destination is written.
    #[cfg(target_arch = "x86_64")]
    fn raw(self) -> (*mut H, *const H, *const H, usize) {
        match self {
            Loop::Binary { dst, a, b } => {
                let n = dst.len().min(a.len()).min(b.len());
                (dst.as_mut_ptr(), a.as_ptr(), b.as_ptr(), n)
            }
            Loop::Acc { acc, other, rev } => {
                let n = acc.len().min(other.len());
                let p = acc.as_mut_ptr();
                if rev {
                    (p, other.as_ptr(), p.cast_const(), n)
                } else {
                    (p, p.cast_const(), other.as_ptr(), n)
                }
            }
            Loop::Square { acc } => {
                let n = acc.len();
                let p = acc.as_mut_ptr();
                (p, p.cast_const(), p.cast_const(), n)
            }
        }
    }
}

impl<H: Narrow> Visit<f32> for Loop<'_, H> {
    #[inline(always)]
    fn run<F: Fn(f32, f32) -> f32 + Copy>(self, f: F) {
        let mut fa = [0f32; BLOCK];
        let mut fb = [0f32; BLOCK];
        match self {
            Loop::Binary { dst, a, b } => {
                let chunks = dst
                    .chunks_mut(BLOCK)
                    .zip(a.chunks(BLOCK))
                    .zip(b.chunks(BLOCK));
                for ((d, x), y) in chunks {
                    let (fa, fb) = (&mut fa[..d.len()], &mut fb[..d.len()]);
                    widen_block(x, fa);
                    widen_block(y, fb);
                    acc_loop(fa, fb, f);
                    narrow_block(fa, d);
                }
            }
            Loop::Acc { acc, other, rev } => {
                for (d, y) in acc.chunks_mut(BLOCK).zip(other.chunks(BLOCK)) {
                    let (fa, fb) = (&mut fa[..d.len()], &mut fb[..d.len()]);
                    widen_block(d, fa);
                    widen_block(y, fb);
                    if rev {
                        acc_loop(fa, fb, move |p, q| f(q, p));
                    } else {
                        acc_loop(fa, fb, f);
                    }
                    narrow_block(fa, d);
                }
            }
            Loop::Square { acc } => {
                for d in acc.chunks_mut(BLOCK) {
                    let fa = &mut fa[..d.len()];
                    widen_block(d, fa);
                    square_loop(fa, f);
                    narrow_block(fa, d);
                }
            }
        }
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
mod x86;

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

/// Run a loop over 16-bit floats: in one pass (Sum, Prod) where the CPU
/// allows, else staged through f32 blocks (`Loop`'s visit). `$fused` is
/// the x86 one-pass runner of the type.
macro_rules! half_loop {
    ($fused:ident, $op:expr, $len:expr, $variant:ident { $($field:ident),* }) => {{
        #[cfg(target_arch = "x86_64")]
        if let Some(f) = fused($op, $len) {
            if x86::$fused(Loop::$variant { $($field),* }, f) {
                return;
            }
        }
        fastest(|| f32::visit($op, Loop::$variant { $($field),* }))
    }};
}

// SAFETY: `half` declares `f16` `repr(transparent)` over a `u16`: size ==
// align == 2 (asserted below), no padding, every bit pattern valid.
unsafe impl Kernel for f16 {
    const ZERO: Self = f16::ZERO;
    #[inline(never)]
    fn binary(dst: &mut [Self], a: &[Self], b: &[Self], op: RedOp) {
        half_loop!(run_f16, op, dst.len(), Binary { dst, a, b })
    }
    #[inline(never)]
    fn accumulate(acc: &mut [Self], other: &[Self], op: RedOp, rev: bool) {
        half_loop!(run_f16, op, acc.len(), Acc { acc, other, rev })
    }
    #[inline(never)]
    fn square(acc: &mut [Self], op: RedOp) {
        half_loop!(run_f16, op, acc.len(), Square { acc })
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
        half_loop!(run_bf16, op, dst.len(), Binary { dst, a, b })
    }
    #[inline(never)]
    fn accumulate(acc: &mut [Self], other: &[Self], op: RedOp, rev: bool) {
        half_loop!(run_bf16, op, acc.len(), Acc { acc, other, rev })
    }
    #[inline(never)]
    fn square(acc: &mut [Self], op: RedOp) {
        half_loop!(run_bf16, op, acc.len(), Square { acc })
    }
    #[inline(never)]
    fn divide(dst: &mut [Self], divisor: u32) {
        fastest(|| divide_narrow(dst, divisor))
    }
}
/// The operator of a 16-bit float loop that runs fused in one pass (Sum,
/// Avg's sum and Prod), for more than [`SCALAR_MAX`] elements.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn fused(op: RedOp, len: usize) -> Option<x86::Fused> {
    if len <= SCALAR_MAX {
        return None;
    }
    match op.pairwise() {
        RedOp::Sum | RedOp::Avg => Some(x86::Fused::Add),
        RedOp::Prod => Some(x86::Fused::Mul),
        RedOp::Min | RedOp::Max => None,
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
mod tests;
