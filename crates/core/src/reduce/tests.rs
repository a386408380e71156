//! The reductions against plain loops, per datatype and operator.

use super::*;

const LENS: [usize; 6] = [0, 1, 7, 33, 1000, 4099];

/// Run `f` on every code path this CPU can take: the run-time selected
/// (AVX-512 with BF16, AVX2/F16C) loops, the AVX-512 ones without BF16,
/// the AVX2 ones, and the baseline ones.
fn on_every_path(f: impl Fn()) {
    f();
    #[cfg(target_arch = "x86_64")]
    {
        x86::NO_AVX512_BF16.with(|b| b.set(true));
        f();
        x86::NO_AVX512_BF16.with(|b| b.set(false));
        x86::NO_AVX512.with(|b| b.set(true));
        f();
        x86::NO_AVX512.with(|b| b.set(false));
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

/// The slice conversions of bf16 (8 lanes at a time with AVX2 where the CPU
/// has it, the scalar loop on the other path) give `half`'s bits: widening
/// every bf16, narrowing a stride over all f32 and every rounding boundary
/// (each tie and its two neighbours), NaNs and infinities included.
#[test]
fn bf16_slice_conversions_match_half_crate() {
    on_every_path(|| {
        let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let mut wide = vec![0f32; all.len()];
        bf16::widen_slice(&all, &mut wide);
        for (h, w) in all.iter().zip(&wide) {
            assert_eq!(
                w.to_bits(),
                h.to_f32().to_bits(),
                "bf16 {:#06x}",
                h.to_bits()
            );
        }
        let ties = (0..=u16::MAX).flat_map(|h| {
            let t = (u32::from(h) << 16) | 0x8000;
            [t - 1, t, t + 1]
        });
        let xs: Vec<f32> = (0..=u32::MAX)
            .step_by(4099)
            .chain(ties)
            .map(f32::from_bits)
            .collect();
        let mut out = vec![bf16::ZERO; xs.len()];
        bf16::narrow_slice(&xs, &mut out);
        for (x, o) in xs.iter().zip(&out) {
            assert_eq!(
                o.to_bits(),
                bf16::from_f32(*x).to_bits(),
                "f32 {:#010x}",
                x.to_bits()
            );
        }
    });
}

/// The one-pass bf16 Sum and Prod give the baseline path's bits on every
/// path, whatever the operands: arbitrary bit patterns (NaNs with payloads,
/// infinities, signed zeros, subnormals) and pairs whose f32 result is
/// subnormal, which `vcvtne2ps2bf16` would flush to zero (the AVX-512 BF16
/// loop must round them as `narrow` does). Lengths cover whole 32-element
/// blocks, the 16-element loop and the scalar tail; every form, in place
/// included.
#[test]
fn fused_bf16_gives_the_baseline_bits_for_any_operands() {
    let mut rng = Rng(0xb16f_10a7);
    let mut a: Vec<u16> = (0..4099).map(|_| rng.next() as u16).collect();
    let mut b: Vec<u16> = (0..4099).map(|_| rng.next() as u16).collect();
    // Subnormal f32 results: the smallest normal magnitudes (2^-126 and a
    // little above) summed with their near opposites, and small products.
    for k in 0..64u16 {
        let i = 200 + 2 * k as usize;
        a[i] = 0x0080 + k; // 2^-126 * (1 + k/128)
        b[i] = 0x8080 + k / 2; // -(2^-126 * (1 + (k/2)/128))
        a[i + 1] = 0x2000 + k; // ~2^-63
        b[i + 1] = 0x1f80 - k; // ~2^-64: the product is ~2^-127
    }
    // A block of subnormal sums only (the whole 32-element block falls back),
    // and subnormal operands.
    for i in 1024..1056 {
        a[i] = 0x0081;
        b[i] = 0x8080;
    }
    for i in 2048..2080 {
        a[i] = 0x0001 + i as u16 % 7;
        b[i] = 0x0040;
    }
    let bytes = |v: &[u16]| -> Vec<u8> { v.iter().flat_map(|h| h.to_ne_bytes()).collect() };
    let (ab, bb) = (bytes(&a), bytes(&b));
    for op in [RedOp::Sum, RedOp::Prod, RedOp::Avg] {
        for n in [0, 1, 15, 16, 31, 32, 33, 47, 64, 100, 1040, 4099] {
            let (x, y) = (&ab[..2 * n], &bb[..2 * n]);
            let run = |x: &[u8], y: &[u8]| -> [Vec<u8>; 3] {
                let mut dst = vec![0u8; x.len()];
                reduce_bytes(&mut dst, x, y, DataType::Bf16, op).unwrap();
                let mut acc = x.to_vec();
                reduce_into_bytes(&mut acc, y, DataType::Bf16, op).unwrap();
                let mut acc_b = y.to_vec();
                let p = acc_b.as_mut_ptr();
                // SAFETY: dst == b; `x` and `acc_b` hold n elements each.
                unsafe { reduce_raw(p, x.as_ptr(), p, n, DataType::Bf16, op) };
                [dst, acc, acc_b]
            };
            #[cfg(target_arch = "x86_64")]
            x86::BASELINE_ONLY.with(|f| f.set(true));
            let want = run(x, y);
            #[cfg(target_arch = "x86_64")]
            x86::BASELINE_ONLY.with(|f| f.set(false));
            on_every_path(|| {
                let got = run(x, y);
                for (form, (g, w)) in ["binary", "accumulate", "dst==b"]
                    .iter()
                    .zip(got.iter().zip(&want))
                {
                    if let Some(e) = (0..n).find(|&e| g[2 * e..2 * e + 2] != w[2 * e..2 * e + 2]) {
                        panic!(
                            "bf16 {op} {form} n={n}: element {e}: {:#06x} {op} {:#06x} gave {:#04x?}, baseline {:#04x?}",
                            a[e], b[e], &g[2 * e..2 * e + 2], &w[2 * e..2 * e + 2]
                        );
                    }
                }
            });
        }
    }
}
