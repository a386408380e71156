//! Throughput of the host reduction loops against a `memcpy` baseline.
//!
//! Every benchmark reports `Throughput::Bytes` = bytes written, so a reduction
//! (which also reads twice as much) compares directly with a copy of the same
//! size. Two sizes: 4 MiB buffers (beyond most L2 caches: memory/L3 bound) and
//! 64 KiB buffers (in L1/L2: shows whether the loop body keeps up).
//!
//! `cargo bench -p braid-core --bench reduce` (optionally with a filter, e.g.
//! `-- f32`).

use std::hint::black_box;
use std::time::Duration;

use braid_core::reduce::{reduce_bytes, reduce_into_bytes};
use braid_core::{DataType, RedOp};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const BIG: usize = 4 << 20;
const SMALL: usize = 64 << 10;

/// A byte buffer of `len` bytes, 64-byte aligned, filled with small values of
/// `dt` (so products and sums stay finite for floats).
struct Buf {
    v: Vec<u8>,
    start: usize,
    len: usize,
}

impl Buf {
    fn new(len: usize, dt: DataType, seed: u8) -> Buf {
        let mut v = vec![0u8; len + 64];
        let start = v.as_ptr().align_offset(64);
        let one: Vec<u8> = match dt {
            DataType::F16 => braid_core::types::f16::from_f32(1.0).to_ne_bytes().to_vec(),
            DataType::Bf16 => braid_core::types::bf16::from_f32(1.0)
                .to_ne_bytes()
                .to_vec(),
            DataType::F32 => 1.0f32.to_ne_bytes().to_vec(),
            DataType::F64 => 1.0f64.to_ne_bytes().to_vec(),
            _ => {
                let mut e = vec![0u8; dt.size()];
                e[0] = seed;
                e
            }
        };
        for e in v[start..start + len].chunks_mut(dt.size()) {
            e.copy_from_slice(&one);
        }
        Buf { v, start, len }
    }
    fn bytes(&self) -> &[u8] {
        &self.v[self.start..self.start + self.len]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.v[self.start..self.start + self.len]
    }
}

fn bench_size(c: &mut Criterion, label: &str, bytes: usize, types: &[DataType]) {
    let mut g = c.benchmark_group(format!("reduce_{label}"));
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(700))
        .throughput(Throughput::Bytes(bytes as u64));

    {
        let src = Buf::new(bytes, DataType::U8, 1);
        let mut dst = Buf::new(bytes, DataType::U8, 0);
        g.bench_function("memcpy", |bch| {
            bch.iter(|| dst.bytes_mut().copy_from_slice(black_box(src.bytes())))
        });
    }

    for &dt in types {
        let ops: &[RedOp] = if dt == DataType::F32 {
            &[RedOp::Sum, RedOp::Prod, RedOp::Min, RedOp::Max]
        } else {
            &[RedOp::Sum]
        };
        let a = Buf::new(bytes, dt, 3);
        let b = Buf::new(bytes, dt, 5);
        let mut dst = Buf::new(bytes, dt, 0);
        for &op in ops {
            g.bench_function(format!("{dt}_{op}"), |bch| {
                bch.iter(|| {
                    reduce_bytes(dst.bytes_mut(), black_box(a.bytes()), b.bytes(), dt, op).unwrap()
                })
            });
        }
        if dt == DataType::F32 {
            // In place (acc = acc + other), the recv-reduce shape.
            let mut acc = Buf::new(bytes, dt, 3);
            g.bench_function(format!("{dt}_sum_inplace"), |bch| {
                bch.iter(|| {
                    reduce_into_bytes(acc.bytes_mut(), black_box(b.bytes()), dt, RedOp::Sum)
                        .unwrap()
                })
            });
        }
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    bench_size(c, "4MiB", BIG, &DataType::ALL);
    bench_size(
        c,
        "64KiB",
        SMALL,
        &[DataType::F32, DataType::F16, DataType::Bf16],
    );
}

criterion_group!(reduce, benches);
criterion_main!(reduce);
