//! Streaming copies (`braid_core::copy`) against `memcpy`, over buffers that
//! fit the cache (8 MiB) and buffers that do not (32 MiB), copied in 2 MiB
//! pieces as the engine copies a rank's own block.
//!
//! `cargo bench -p braid-core --bench copy`

use std::hint::black_box;
use std::time::Duration;

use braid_core::copy::copy_streaming;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const PIECE: usize = 2 << 20;

fn benches(c: &mut Criterion) {
    for mib in [8usize, 32] {
        let bytes = mib << 20;
        let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
        let mut dst = vec![0u8; bytes];
        let mut g = c.benchmark_group(format!("copy_{mib}MiB"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1))
            .throughput(Throughput::Bytes(bytes as u64));
        g.bench_function("memcpy", |b| {
            b.iter(|| {
                for (d, s) in dst.chunks_mut(PIECE).zip(black_box(&src).chunks(PIECE)) {
                    d.copy_from_slice(s);
                }
            })
        });
        g.bench_function("streaming", |b| {
            b.iter(|| {
                for (d, s) in dst.chunks_mut(PIECE).zip(black_box(&src).chunks(PIECE)) {
                    // SAFETY: `d` and `s` are pieces of equal length of two
                    // distinct vectors.
                    unsafe { copy_streaming(d.as_mut_ptr(), s.as_ptr(), s.len()) };
                }
            })
        });
        g.finish();
    }
}

criterion_group!(copy, benches);
criterion_main!(copy);
