//! Workloads shared by the rank binaries (fault tests, soak).

use braid::{Communicator, RedOp};

/// `iters` rounds of mixed collectives: every collective in turn (the
/// SendRecv round ends in a barrier), sizes
/// varying from one element to a few hundred KiB, results checked;
/// `after(i)` runs after round `i`.
pub fn mixed(
    comm: &Communicator,
    iters: usize,
    mut after: impl FnMut(usize),
) -> Result<(), String> {
    let p = comm.nranks() as usize;
    let r = comm.rank();
    for i in 0..iters {
        let n = 1 + (i * 7919) % 40_000;
        let e = |e: braid::Error| e.to_string();
        let wrong = |what: &str| {
            Err(format!(
                "rank {r}, round {i} ({n} elements): wrong {what} result"
            ))
        };
        match i % 7 {
            0 => {
                // Values depend on rank and position: a misplaced piece shows.
                let mut a: Vec<u32> = (0..n).map(|j| j as u32 + r).collect();
                comm.all_reduce_in_place(&mut a, RedOp::Sum).map_err(e)?;
                let base = (p * (p - 1) / 2) as u32;
                if a.iter()
                    .enumerate()
                    .any(|(j, &x)| x != j as u32 * p as u32 + base)
                {
                    return wrong("AllReduce");
                }
            }
            1 => {
                let mut g = vec![0u32; n * p];
                let mine: Vec<u32> = (0..n).map(|j| (j as u32) << 8 | r).collect();
                comm.all_gather(&mine, &mut g).map_err(e)?;
                if g.iter()
                    .enumerate()
                    .any(|(k, &x)| x != ((k % n) as u32) << 8 | (k / n) as u32)
                {
                    return wrong("AllGather");
                }
            }
            2 => {
                let root = (i % p) as u32;
                let mut b: Vec<u8> = (0..n).map(|j| (j as u32 * 31 + r) as u8).collect();
                comm.broadcast(&mut b, root).map_err(e)?;
                if b.iter()
                    .enumerate()
                    .any(|(j, &x)| x != (j as u32 * 31 + root) as u8)
                {
                    return wrong("Broadcast");
                }
            }
            3 => {
                let mut out = vec![0f32; n];
                let send: Vec<f32> = (0..n * p).map(|k| (k % 97) as f32 + r as f32).collect();
                comm.reduce_scatter(&send, &mut out, RedOp::Max)
                    .map_err(e)?;
                let off = r as usize * n;
                if out
                    .iter()
                    .enumerate()
                    .any(|(j, &x)| x != ((off + j) % 97) as f32 + (p - 1) as f32)
                {
                    return wrong("ReduceScatter");
                }
            }
            4 => {
                let send: Vec<u64> = (0..n * p).map(|k| (r as u64) << 32 | k as u64).collect();
                let mut out = vec![0u64; n * p];
                comm.all_to_all(&send, &mut out).map_err(e)?;
                // Block q of the result is block r of rank q's input.
                if out.iter().enumerate().any(|(k, &x)| {
                    let (q, j) = (k / n, k % n);
                    x != (q as u64) << 32 | (r as usize * n + j) as u64
                }) {
                    return wrong("AllToAll");
                }
            }
            5 => {
                let mut out = vec![0i32; n];
                comm.reduce(&vec![r as i32 + 1; n], &mut out, RedOp::Sum, 0)
                    .map_err(e)?;
                if r == 0 && out.iter().any(|&x| x != (p * (p + 1) / 2) as i32) {
                    return wrong("Reduce");
                }
            }
            _ => {
                let out = vec![r; n];
                let mut inc = vec![0u32; n];
                let (next, prev) = ((r + 1) % p as u32, (r + p as u32 - 1) % p as u32);
                let mut g = comm.group();
                g.send(&out, next);
                g.recv(&mut inc, prev);
                g.run().map_err(e)?;
                if inc.iter().any(|&x| x != prev) {
                    return wrong("SendRecv");
                }
                // Every seventh round ends in a barrier, so that faults also
                // land in one.
                comm.barrier().map_err(e)?;
            }
        }
        after(i);
    }
    Ok(())
}
