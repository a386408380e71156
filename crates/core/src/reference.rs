//! Independent reference code for tests: input generators whose reductions
//! are exact in every datatype whatever the order, and the expected result
//! computed by a plain loop over `f64` / `i128` from the generator's values
//! (never from braid's buffers or reduction code). Nothing in braid's data
//! path uses this module; it exists so that the simulator's tests, the
//! multi-process suite and `braid-perf -c` compare against code that is not
//! the code under test.

use crate::plan::Collective;
use crate::types::{DataType, RedOp};

/// The six collectives the test suites sweep (point-to-point groups aside).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Reduce,
    AllToAll,
}

impl Kind {
    /// Every kind, in a fixed order.
    pub const ALL: [Kind; 6] = [
        Kind::AllReduce,
        Kind::ReduceScatter,
        Kind::AllGather,
        Kind::Broadcast,
        Kind::Reduce,
        Kind::AllToAll,
    ];

    /// The collective of this kind: `count` is the per-rank count as
    /// [`Collective`] names it (ReduceScatter's receive count, AllGather's
    /// send count); `op` and `root` are used where the kind has them.
    pub fn collective(self, count: usize, op: RedOp, root: u32) -> Collective {
        match self {
            Kind::AllReduce => Collective::AllReduce { count, op },
            Kind::ReduceScatter => Collective::ReduceScatter {
                recv_count: count,
                op,
            },
            Kind::AllGather => Collective::AllGather { send_count: count },
            Kind::Broadcast => Collective::Broadcast { count, root },
            Kind::Reduce => Collective::Reduce { count, op, root },
            Kind::AllToAll => Collective::AllToAll { count },
        }
    }
}

/// Filler written into receive buffers before an operation, to catch
/// elements that were never written.
pub const GARBAGE: u8 = 0xAB;

fn mix(r: usize, i: usize) -> u64 {
    let x = (i as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((r as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F));
    (x ^ (x >> 29)).wrapping_mul(0x1656_67B1_9E37_79F9) >> 40
}

/// Input element `i` of rank `r` for operator `op`: small integers (and
/// powers of two for products) so that every reduction is exact in every
/// type for up to 16 ranks, and not periodic in `i`, so misplaced blocks show.
pub fn value(op: RedOp, r: usize, i: usize) -> f64 {
    let h = mix(r, i);
    match op {
        RedOp::Prod => [1.0, 2.0, 1.0, -1.0][(h % 4) as usize],
        RedOp::Min | RedOp::Max => (h % 11) as f64 - 5.0,
        RedOp::Sum | RedOp::Avg => (h % 5) as f64,
    }
}

/// Wrap an integer to the datatype's range, as its own arithmetic does.
fn wrap(dt: DataType, v: i128) -> i128 {
    match dt {
        DataType::I8 => v as i8 as i128,
        DataType::U8 => v as u8 as i128,
        DataType::I32 => v as i32 as i128,
        DataType::U32 => v as u32 as i128,
        DataType::I64 => v as i64 as i128,
        DataType::U64 => v as u64 as i128,
        _ => v,
    }
}

/// Write `v` as one element of `dt` into `out` (exactly `dt.size()` bytes).
fn encode(dt: DataType, v: f64, out: &mut [u8]) {
    encode_exact(dt, v, v as i128, out)
}

/// Write an element: integer types take `i`, floating types `v`.
fn encode_exact(dt: DataType, v: f64, i: i128, out: &mut [u8]) {
    match dt {
        DataType::I8 => out.copy_from_slice(&(i as i8).to_ne_bytes()),
        DataType::U8 => out.copy_from_slice(&(i as u8).to_ne_bytes()),
        DataType::I32 => out.copy_from_slice(&(i as i32).to_ne_bytes()),
        DataType::U32 => out.copy_from_slice(&(i as u32).to_ne_bytes()),
        DataType::I64 => out.copy_from_slice(&(i as i64).to_ne_bytes()),
        DataType::U64 => out.copy_from_slice(&(i as u64).to_ne_bytes()),
        DataType::F16 => out.copy_from_slice(&half::f16::from_f64(v).to_ne_bytes()),
        DataType::Bf16 => out.copy_from_slice(&half::bf16::from_f64(v).to_ne_bytes()),
        DataType::F32 => out.copy_from_slice(&(v as f32).to_ne_bytes()),
        DataType::F64 => out.copy_from_slice(&v.to_ne_bytes()),
    }
}

/// Read one element of `dt` as f64 (for messages and tolerances).
pub fn decode(dt: DataType, b: &[u8]) -> f64 {
    let mut a = [0u8; 8];
    let n = dt.size().min(b.len());
    a[..n].copy_from_slice(&b[..n]);
    match dt {
        DataType::I8 => a[0] as i8 as f64,
        DataType::U8 => a[0] as f64,
        DataType::I32 => i32::from_ne_bytes([a[0], a[1], a[2], a[3]]) as f64,
        DataType::U32 => u32::from_ne_bytes([a[0], a[1], a[2], a[3]]) as f64,
        DataType::I64 => i64::from_ne_bytes(a) as f64,
        DataType::U64 => u64::from_ne_bytes(a) as f64,
        DataType::F16 => half::f16::from_ne_bytes([a[0], a[1]]).to_f64(),
        DataType::Bf16 => half::bf16::from_ne_bytes([a[0], a[1]]).to_f64(),
        DataType::F32 => f32::from_ne_bytes([a[0], a[1], a[2], a[3]]) as f64,
        DataType::F64 => f64::from_ne_bytes(a),
    }
}

/// Rank `r`'s input elements `base..base + n` for `op`, as bytes.
pub fn gen_at(dt: DataType, op: RedOp, r: usize, base: usize, n: usize) -> Vec<u8> {
    let es = dt.size();
    let mut out = vec![0u8; n * es];
    for (k, e) in out.chunks_exact_mut(es).enumerate() {
        encode(dt, value(op, r, base + k), e);
    }
    out
}

/// Rank `r`'s first `n` input elements for `op`, as bytes.
pub fn gen(dt: DataType, op: RedOp, r: usize, n: usize) -> Vec<u8> {
    gen_at(dt, op, r, 0, n)
}

/// The reduction over ranks `0..p` of input elements `base..base + n`,
/// folded in rank order with the type's wrapping for integers.
pub fn reduced(dt: DataType, op: RedOp, p: usize, base: usize, n: usize) -> Vec<u8> {
    let es = dt.size();
    let mut out = vec![0u8; n * es];
    for (k, e) in out.chunks_exact_mut(es).enumerate() {
        let i = base + k;
        if dt.is_float() {
            let mut acc = value(op, 0, i);
            for r in 1..p {
                let v = value(op, r, i);
                acc = match op {
                    RedOp::Sum | RedOp::Avg => acc + v,
                    RedOp::Prod => acc * v,
                    RedOp::Min => acc.min(v),
                    RedOp::Max => acc.max(v),
                };
            }
            if op == RedOp::Avg {
                acc /= p as f64;
            }
            encode(dt, acc, e);
        } else {
            let input = |r: usize| wrap(dt, value(op, r, i) as i128);
            let mut acc = input(0);
            for r in 1..p {
                let v = input(r);
                acc = wrap(
                    dt,
                    match op {
                        RedOp::Sum | RedOp::Avg => acc.wrapping_add(v),
                        RedOp::Prod => acc.wrapping_mul(v),
                        RedOp::Min => acc.min(v),
                        RedOp::Max => acc.max(v),
                    },
                );
            }
            if op == RedOp::Avg {
                acc /= p as i128;
            }
            encode_exact(dt, 0.0, acc, e);
        }
    }
    out
}

/// Number of elements of `got` that differ from `want` (exact, except Avg
/// on floating types, which may differ by the rounding of the final division).
pub fn count_wrong(dt: DataType, op: RedOp, got: &[u8], want: &[u8]) -> usize {
    let es = dt.size();
    if got.len() != want.len() {
        return got.len().max(want.len()) / es;
    }
    got.chunks_exact(es)
        .zip(want.chunks_exact(es))
        .filter(|(g, w)| !elem_ok(dt, op, g, w))
        .count()
}

fn elem_ok(dt: DataType, op: RedOp, g: &[u8], w: &[u8]) -> bool {
    if op == RedOp::Avg && dt.is_float() {
        let (g, w) = (decode(dt, g), decode(dt, w));
        let tol = match dt {
            DataType::F16 | DataType::Bf16 => 1e-2,
            _ => 1e-6,
        } * w.abs().max(1.0);
        (g - w).abs() <= tol
    } else {
        g == w
    }
}

/// The first wrong element, described, if any.
pub fn first_wrong(dt: DataType, op: RedOp, got: &[u8], want: &[u8]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("length {} instead of {}", got.len(), want.len()));
    }
    let es = dt.size();
    got.chunks_exact(es)
        .zip(want.chunks_exact(es))
        .position(|(g, w)| !elem_ok(dt, op, g, w))
        .map(|i| {
            let (g, w) = (&got[i * es..(i + 1) * es], &want[i * es..(i + 1) * es]);
            format!("element {i}: got {}, want {}", decode(dt, g), decode(dt, w))
        })
}

/// Assert that `got` equals `want` element by element (see [`count_wrong`]).
///
/// # Panics
///
/// On the first wrong element, naming it: this is a test assertion.
pub fn assert_elems_eq(dt: DataType, op: RedOp, got: &[u8], want: &[u8], what: &str) {
    if let Some(w) = first_wrong(dt, op, got, want) {
        panic!("{what}: {w}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_matches_hand_computed_values() {
        // Two ranks, element 0, checked against values computed by hand.
        let (a, b) = (value(RedOp::Sum, 0, 0), value(RedOp::Sum, 1, 0));
        let got = reduced(DataType::F32, RedOp::Sum, 2, 0, 1);
        assert_eq!(
            f32::from_ne_bytes(got[..4].try_into().unwrap()),
            (a + b) as f32
        );
        // u8 product wraps: -1 is 255, 255 * 255 = 1 (mod 256).
        for i in 0..200 {
            let vals: Vec<f64> = (0..3).map(|r| value(RedOp::Prod, r, i)).collect();
            let mut acc: u8 = vals[0] as i64 as u8;
            for v in &vals[1..] {
                acc = acc.wrapping_mul(*v as i64 as u8);
            }
            assert_eq!(
                reduced(DataType::U8, RedOp::Prod, 3, i, 1),
                vec![acc],
                "element {i}"
            );
        }
        assert!(first_wrong(DataType::I32, RedOp::Sum, &[1, 0, 0, 0], &[2, 0, 0, 0]).is_some());
        assert_eq!(
            count_wrong(DataType::U8, RedOp::Max, &[1, 2, 3], &[1, 9, 3]),
            1
        );
    }
}
