//! Defaults read from the host (`/sys`): how long to spin, whether ranks
//! share CPUs, when to copy single-copy and with streaming stores; each
//! with its `BRAID_*` override.

use super::*;

/// AllGathers over slots of at most this many bytes (the whole result) read
/// every block from its owner instead of relaying it along the ring (see
/// `PlanParams::direct_moves`): 4 ranks on the 2-core VM, side by side,
/// 64 bytes 2.4-2.5 against 3.1-5.0 µs, 4 KiB 2.6-4.8 against 3.6-7.5 µs;
/// at 256 KiB no difference beyond the noise.
pub(super) const FLAT_ALLGATHER_MAX_BYTES: usize = 64 * 1024;

/// Pieces of single-copy operations go by reference from this size where
/// some host's ranks share CPUs, and pieces a socket's sender would copy
/// go by reference from it whatever the CPUs ([`direct_min_default`]).
pub(super) const DIRECT_MIN: usize = 64 * 1024;

/// The same where no rank's CPUs are shared with another's: so on 2 ranks a
/// 32 KiB Broadcast or AllGather moves single-copy.
pub(super) const FREE_CPUS_DIRECT_MIN: usize = 16 * 1024;

/// The size from which single-copy operations pass pieces by reference
/// (`BRAID_DIRECT_MIN_BYTES`, `set`, overrides), the same on every rank
/// (`any_oversubscribed`: some rank's host is [`oversubscribed`]). A
/// reference makes the sender wait until the receiver has read, where a
/// slot lets it run ahead; with a core per rank that wait is short, and
/// under load one read beats two copies with waits between them. The
/// 2-core VM, braid-perf -D 0.2, medians of 3-5 alternated runs: with one
/// busy process per core (what a training step does beside its
/// collectives), 2 ranks, a 32 KiB Broadcast 9.5-14 µs against 13-40 at
/// 64 KiB, AllGather 15-16 against 31-32 (huge pages or not); idle, within
/// noise (Broadcast 3.5 against 4.8 on huge pages, 5.4 against 5.0 on 4 KiB
/// pages; AllGather 32 KiB 4.9 against 4.0 on 4 KiB pages; AllToAll 64 KiB,
/// Reduce and AllReduce 1 MiB alike). But 4 ranks on 2 cores, idle: a 64
/// KiB Broadcast 22 against 11 µs, AllGather 38 against 14, AllToAll 33
/// against 17: there a sender that waits for a descheduled reader loses
/// its turn.
pub(super) fn direct_min_default(set: Option<usize>, any_oversubscribed: bool) -> usize {
    set.unwrap_or(if any_oversubscribed {
        DIRECT_MIN
    } else {
        FREE_CPUS_DIRECT_MIN
    })
}

/// What a rank says about its single-copy settings once its first links are
/// connected: plans cut pieces by them, so every rank must use the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CopySay {
    /// Its host's ranks share CPUs ([`oversubscribed`]).
    pub oversubscribed: bool,
    /// `BRAID_SINGLE_COPY_MIN_BYTES`, if set.
    pub single_copy_set: Option<usize>,
    /// The threshold it would use ([`single_copy_default`] unless set):
    /// hosts may differ in their huge-page mode.
    pub single_copy: usize,
    /// `BRAID_DIRECT_MIN_BYTES`, if set.
    pub direct_set: Option<usize>,
}

impl CopySay {
    /// Bytes of [`CopySay::encode`].
    pub(super) const LEN: usize = 25;

    pub(super) fn encode(&self) -> [u8; Self::LEN] {
        let opt = |v: Option<usize>| v.map_or(u64::MAX, |v| v as u64);
        let mut b = [0u8; Self::LEN];
        b[0] = self.oversubscribed as u8;
        b[1..9].copy_from_slice(&opt(self.single_copy_set).to_le_bytes());
        b[9..17].copy_from_slice(&(self.single_copy as u64).to_le_bytes());
        b[17..25].copy_from_slice(&opt(self.direct_set).to_le_bytes());
        b
    }

    pub(super) fn decode(b: &[u8]) -> Option<CopySay> {
        let word = |i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?))
        };
        let opt = |v: u64| (v != u64::MAX).then_some(v as usize);
        Some(CopySay {
            oversubscribed: *b.first()? != 0,
            single_copy_set: opt(word(1)?),
            single_copy: word(9)? as usize,
            direct_set: opt(word(17)?),
        })
    }
}

/// The single-copy thresholds every rank uses, from what each said
/// (`says[r]`: rank r's): `(single_copy_min, direct_min)`. Settings made
/// differently on two ranks are an error naming the variable and both
/// ranks (different pieces would leave every rank waiting for one that
/// never comes). Unset, the single-copy threshold is the largest any rank
/// would use (a host without huge pages keeps its slots) and the piece
/// threshold follows CPU sharing anywhere ([`direct_min_default`]).
pub(super) fn agree_copy(says: &[CopySay]) -> std::result::Result<(usize, usize), String> {
    // The value every rank set (or none), or an error naming the first
    // rank whose value differs from rank 0's.
    let alike = |get: fn(&CopySay) -> Option<usize>,
                 var: &str|
     -> std::result::Result<Option<usize>, String> {
        let want = says.first().and_then(get);
        match says.iter().position(|s| get(s) != want) {
            None => Ok(want),
            Some(r) => {
                let show = |v: Option<usize>| v.map_or("unset".to_string(), |v| v.to_string());
                Err(format!(
                    "{var} is {} on rank 0 but {} on rank {r}: set it alike on every rank (plans cut pieces by it)",
                    show(want),
                    show(get(&says[r]))
                ))
            }
        }
    };
    let single_set = alike(|s| s.single_copy_set, "BRAID_SINGLE_COPY_MIN_BYTES")?;
    let direct_set = alike(|s| s.direct_set, "BRAID_DIRECT_MIN_BYTES")?;
    let single =
        single_set.unwrap_or_else(|| says.iter().map(|s| s.single_copy).max().unwrap_or(0));
    let direct = direct_min_default(direct_set, says.iter().any(|s| s.oversubscribed));
    Ok((single, direct))
}

/// How long a waiting rank spins before it sleeps (on its links' doorbells;
/// see `engine::Waiter`). Spinning is what makes small operations fast (a
/// flag in shared memory is seen in ~0.1 µs, a woken thread in 25–30 µs),
/// but when ranks on this host share CPUs (more ranks than cores, see
/// [`oversubscribed`]) a spinning rank steals the core from the rank it
/// waits for, so it sleeps at once. `BRAID_SPIN` (`set`) overrides
/// (iterations; a spin also ends after `engine::SPIN_MAX`).
pub(super) fn spin_budget(set: Option<u32>, oversubscribed: bool) -> u32 {
    set.unwrap_or(if oversubscribed {
        0
    } else {
        WaitPolicy::default().spin
    })
}

/// How many times a waiting rank yields the CPU after its spin, before it
/// sleeps: where ranks share CPUs (see [`spin_budget`]) the rank it waits
/// for is likely runnable on this core, and a yield hands the core over
/// at once. None otherwise, or with `BRAID_SPIN` set (`set`).
pub(super) fn yield_budget(set: Option<u32>, oversubscribed: bool) -> u32 {
    if oversubscribed && set.is_none() {
        OVERSUBSCRIBED_YIELDS
    } else {
        0
    }
}

/// [`yield_budget`] where ranks share CPUs.
pub(super) const OVERSUBSCRIBED_YIELDS: u32 = 200;

/// The ranks of this host that share CPUs with this one (itself included)
/// and the CPUs they share. `sets` holds the CPUs each rank on this host
/// may run on (`None`: unknown, taken as all `online` CPUs); `me` indexes
/// ours. The ranks whose sets overlap ours, directly or through other such
/// ranks, are counted against the CPUs of their sets together: four
/// unbound ranks on two cores are oversubscribed, two ranks bound one per
/// core (mpirun's default for two ranks, `srun --cpu-bind=cores`,
/// `taskset`) are not, though each sees a single CPU. (Counting the CPUs a
/// rank sees took bound ranks for oversubscribed and made them yield at
/// every wait: an 8-byte AllReduce on 2 ranks bound to one core each took
/// 0.42-0.58 µs instead of 0.17-0.27.)
pub(super) fn cpu_share(me: usize, sets: &[Option<CpuSet>], online: u32) -> CpuShare {
    let all: Vec<u32> = (0..online.max(1)).collect();
    let cpus = |i: usize| -> &[u32] {
        match &sets[i] {
            Some(s) if !s.0.is_empty() => &s.0,
            _ => &all,
        }
    };
    let mut member = vec![false; sets.len()];
    let Some(m) = member.get_mut(me) else {
        return CpuShare {
            ranks: 1,
            cpus: all.len() as u32,
        };
    };
    *m = true;
    let mut union: std::collections::BTreeSet<u32> = cpus(me).iter().copied().collect();
    let mut grew = true;
    while grew {
        grew = false;
        for (j, m) in member.iter_mut().enumerate() {
            if !*m && cpus(j).iter().any(|c| union.contains(c)) {
                *m = true;
                union.extend(cpus(j).iter().copied());
                grew = true;
            }
        }
    }
    CpuShare {
        ranks: member.iter().filter(|&&m| m).count() as u32,
        cpus: union.len() as u32,
    }
}

/// What [`cpu_share`] found: `ranks` ranks of one host (this one among
/// them) may run on the same `cpus` CPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CpuShare {
    pub ranks: u32,
    pub cpus: u32,
}

impl CpuShare {
    /// More ranks than CPUs: a waiting rank's peer is likely runnable on
    /// its core.
    pub(super) fn oversubscribed(self) -> bool {
        self.ranks > self.cpus
    }
}

/// Whether this rank shares CPUs with more ranks than those CPUs can run at
/// once ([`cpu_share`]).
#[cfg(test)]
fn oversubscribed(me: usize, sets: &[Option<CpuSet>], online: u32) -> bool {
    cpu_share(me, sets, online).oversubscribed()
}

/// CPUs online on this host (`/sys/devices/system/cpu/online`), whatever
/// this process may run on.
pub(super) fn online_cpus() -> u32 {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|l| CpuSet::from_list(&l))
        .map(|s| s.0.len() as u32)
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u32))
}

/// Where the kernel says whether anonymous memory gets transparent huge
/// pages (`always`, `madvise` or `never`, the chosen one in brackets).
pub(super) const THP_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// The smallest largest-buffer size at which collectives read peers'
/// buffers with `process_vm_readv` instead of passing data through slots.
///
/// What decides it is the page size of the callers' buffers, which braid
/// cannot see: `process_vm_readv` pins every page it reads, which on 4 KiB
/// pages ran at 14 GB/s on these VMs against memcpy's 52 GB/s, but at
/// 39-48 GB/s on 2 MiB pages (`scripts/cma-pages.c`, 1 MiB reads).
/// Side by side on 2 ranks (Broadcast, AllGather, AllToAll): on 4 KiB-page
/// buffers the slot path was about 2x faster up to 4 MiB and single-copy
/// won from 16 MiB; on 2 MiB-aligned huge-page buffers single-copy was
/// faster from 512 KiB (1.3-2x at 1-4 MiB) and even at 128-256 KiB. So:
/// 512 KiB where every anonymous mapping gets huge pages (THP `always`),
/// else 8 MiB. Callers whose buffers are on huge pages under THP `madvise`
/// (e.g. glibc's `hugetlb` tunable, or `madvise(MADV_HUGEPAGE)`) should set
/// `BRAID_SINGLE_COPY_MIN_BYTES=524288`.
pub(super) fn single_copy_default(thp_file: &str) -> usize {
    let always = std::fs::read_to_string(thp_file)
        .map(|s| s.contains("[always]"))
        .unwrap_or(false);
    if always {
        512 << 10
    } else {
        8 << 20
    }
}

/// Where Linux describes CPU 0's caches (`index*/level`, `index*/size`).
pub(super) const CPU0_CACHES: &str = "/sys/devices/system/cpu/cpu0/cache";

/// The size of the largest cache CPU 0 has (its last level), from `dir`
/// laid out as [`CPU0_CACHES`]; `None` if it says nothing usable.
pub(super) fn last_level_cache(dir: &std::path::Path) -> Option<usize> {
    let mut best: Option<(u32, usize)> = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let read = |f: &str| std::fs::read_to_string(e.path().join(f)).ok();
        let (Some(level), Some(size)) = (read("level"), read("size")) else {
            continue;
        };
        let Ok(level) = level.trim().parse::<u32>() else {
            continue;
        };
        let size = size.trim();
        let (digits, unit) = match size.strip_suffix('K') {
            Some(d) => (d, 1 << 10),
            None => match size.strip_suffix('M') {
                Some(d) => (d, 1 << 20),
                None => (size, 1),
            },
        };
        let Ok(n) = digits.parse::<usize>() else {
            continue;
        };
        if best.is_none_or(|(l, _)| level > l) {
            best = Some((level, n.saturating_mul(unit)));
        }
    }
    best.map(|(_, b)| b)
}

/// The default of `BRAID_STREAM_MIN_BYTES` for `local` ranks on this host:
/// collectives whose buffers, times the ranks sharing the last-level cache,
/// exceed that cache copy with streaming stores (their destinations would
/// not stay cached anyway; `braid_core::copy`). 32 MiB when sysfs says
/// nothing.
pub(super) fn stream_default(caches: &std::path::Path, local: usize) -> usize {
    last_level_cache(caches).unwrap_or(32 << 20) / local.max(1)
}

/// Default slot size when a communicator has no links (one rank).
pub(super) const DEFAULT_PIECE: usize = 512 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    fn cpus(list: &str) -> Option<CpuSet> {
        Some(CpuSet::from_list(list).unwrap())
    }

    /// Ranks sharing CPUs spin not at all and yield before they sleep;
    /// others spin and do not yield; BRAID_SPIN decides alone when set.
    #[test]
    fn sharing_ranks_yield_instead_of_spinning() {
        assert_eq!(spin_budget(None, true), 0);
        assert_eq!(yield_budget(None, true), OVERSUBSCRIBED_YIELDS);
        assert!(spin_budget(None, false) > 0);
        assert_eq!(yield_budget(None, false), 0);
        assert_eq!(
            (spin_budget(Some(7), true), yield_budget(Some(7), true)),
            (7, 0)
        );
    }

    #[test]
    fn ranks_bound_one_per_core_are_not_oversubscribed() {
        // mpirun's default for two ranks: one core each.
        let bound = [cpus("0"), cpus("1")];
        assert!(!oversubscribed(0, &bound, 2));
        assert!(!oversubscribed(1, &bound, 2));
        // Unbound: each may run anywhere, two ranks for two CPUs.
        let free = [cpus("0-1"), cpus("0-1")];
        assert!(!oversubscribed(0, &free, 2));
        // Eight ranks bound to eight distinct CPUs of a 64-CPU host.
        let spread: Vec<_> = (0..8).map(|c| cpus(&(c * 8).to_string())).collect();
        assert!((0..8).all(|r| !oversubscribed(r, &spread, 64)));
    }

    #[test]
    fn cpu_share_counts_the_ranks_and_cpus_that_overlap() {
        let share = |me, sets: &[Option<CpuSet>], online| {
            let s = cpu_share(me, sets, online);
            (s.ranks, s.cpus)
        };
        // Two unbound ranks on two CPUs: both share both.
        let free = [cpus("0-1"), cpus("0-1")];
        assert_eq!(share(0, &free, 2), (2, 2));
        // Bound one per core: each alone on its own.
        let bound = [cpus("0"), cpus("1")];
        assert_eq!(share(1, &bound, 2), (1, 1));
        // Unknown sets count as every online CPU.
        assert_eq!(share(0, &[None, None, None], 4), (3, 4));
        // Through a third rank: three ranks on CPUs 0-1.
        let chain = [cpus("0-1"), cpus("0"), cpus("1"), cpus("4-7")];
        assert_eq!(share(1, &chain, 8), (3, 2));
        assert_eq!(share(3, &chain, 8), (1, 4));
        // A rank index outside the list: itself on every CPU.
        assert_eq!(share(9, &chain, 8), (1, 8));
    }

    #[test]
    fn ranks_sharing_cpus_are_oversubscribed() {
        // Four unbound ranks on two CPUs.
        let four = vec![cpus("0-1"); 4];
        assert!((0..4).all(|r| oversubscribed(r, &four, 2)));
        // Four ranks bound round-robin to two cores: two per core.
        let rr = [cpus("0"), cpus("1"), cpus("0"), cpus("1")];
        assert!((0..4).all(|r| oversubscribed(r, &rr, 2)));
        // Two ranks bound to the same core, a third alone on another.
        let same = [cpus("3"), cpus("3"), cpus("5")];
        assert!(oversubscribed(0, &same, 8));
        assert!(oversubscribed(1, &same, 8));
        assert!(!oversubscribed(2, &same, 8));
        // Sharing through a third rank: B on CPU 0 and C on CPU 1 do not
        // overlap, but A may run on both, so three ranks share two CPUs.
        let chain = [cpus("0-1"), cpus("0"), cpus("1")];
        assert!((0..3).all(|r| oversubscribed(r, &chain, 4)));
    }

    #[test]
    fn unknown_cpu_sets_count_as_every_online_cpu() {
        let unknown = [None, None, None];
        assert!(oversubscribed(0, &unknown, 2));
        assert!(!oversubscribed(0, &unknown, 4));
        // One rank bound, the other unknown (may run anywhere): 2 ranks, 2 CPUs.
        assert!(!oversubscribed(0, &[cpus("1"), None], 2));
        // An empty set is as good as unknown.
        assert!(!oversubscribed(
            0,
            &[Some(CpuSet(Vec::new())), cpus("0")],
            2
        ));
        // A rank alone never is.
        assert!(!oversubscribed(0, &[None], 1));
    }

    #[test]
    fn ranks_agree_on_single_copy_or_name_the_setting_that_differs() {
        let say = |o: bool, ss: Option<usize>, s: usize, ds: Option<usize>| CopySay {
            oversubscribed: o,
            single_copy_set: ss,
            single_copy: s,
            direct_set: ds,
        };
        for s in [
            say(true, Some(7), 9, None),
            say(false, None, 1 << 20, Some(4096)),
        ] {
            assert_eq!(CopySay::decode(&s.encode()), Some(s));
        }
        assert_eq!(CopySay::decode(&[0u8; 24]), None);
        // Unset: the largest threshold (one host without huge pages), and
        // 64 KiB pieces once any host shares CPUs.
        let a = say(false, None, 512 << 10, None);
        let b = say(false, None, 8 << 20, None);
        assert_eq!(agree_copy(&[a, a]), Ok((512 << 10, 16 << 10)));
        assert_eq!(agree_copy(&[a, b]), Ok((8 << 20, 16 << 10)));
        let c = say(true, None, 512 << 10, None);
        assert_eq!(agree_copy(&[a, c, a]), Ok((512 << 10, 64 << 10)));
        // Set alike: the settings win.
        let d = say(true, Some(1 << 20), 1 << 20, Some(4096));
        assert_eq!(agree_copy(&[d, d]), Ok((1 << 20, 4096)));
        // Set differently (or on one rank only): an error naming both.
        let e = agree_copy(&[d, say(true, Some(2 << 20), 2 << 20, Some(4096))]).unwrap_err();
        assert!(
            e.contains("BRAID_SINGLE_COPY_MIN_BYTES")
                && e.contains("rank 0")
                && e.contains("rank 1"),
            "{e}"
        );
        let e = agree_copy(&[a, a, say(false, None, 512 << 10, Some(4096))]).unwrap_err();
        assert!(
            e.contains("BRAID_DIRECT_MIN_BYTES is unset on rank 0 but 4096 on rank 2"),
            "{e}"
        );
    }

    #[test]
    fn direct_min_follows_cpu_sharing_unless_set() {
        assert_eq!(direct_min_default(None, false), 16 * 1024);
        assert_eq!(direct_min_default(None, true), 64 * 1024);
        assert_eq!(direct_min_default(Some(4096), false), 4096);
        assert_eq!(direct_min_default(Some(1 << 20), true), 1 << 20);
    }

    #[test]
    fn single_copy_threshold_follows_the_thp_mode() {
        let dir = std::env::temp_dir().join(format!("braid-thp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("enabled");
        let at = |text: &str| {
            std::fs::write(&f, text).unwrap();
            single_copy_default(f.to_str().unwrap())
        };
        assert_eq!(at("[always] madvise never\n"), 512 << 10);
        assert_eq!(at("always [madvise] never\n"), 8 << 20);
        assert_eq!(at("always madvise [never]\n"), 8 << 20);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(single_copy_default("/nonexistent/braid/thp"), 8 << 20);
    }

    /// The streaming threshold is the largest (last-level) cache of a
    /// recorded sysfs tree, shared by the local ranks; unreadable or
    /// malformed entries are skipped.
    #[test]
    fn streaming_threshold_is_the_last_level_cache_per_local_rank() {
        let dir = std::env::temp_dir().join(format!("braid-caches-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // This VM's CPU 0: L1d, L1i, L2 and L3 (listed out of order).
        for (idx, level, size) in [
            ("index3", "3", "32768K\n"),
            ("index0", "1", "48K\n"),
            ("index1", "1", "32K\n"),
            ("index2", "2", "1024K\n"),
            ("index9", "4", "lots\n"),
        ] {
            let d = dir.join(idx);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("level"), level).unwrap();
            std::fs::write(d.join("size"), size).unwrap();
        }
        std::fs::create_dir_all(dir.join("index7")).unwrap(); // no files
        assert_eq!(last_level_cache(&dir), Some(32 << 20));
        assert_eq!(stream_default(&dir, 1), 32 << 20);
        assert_eq!(stream_default(&dir, 2), 16 << 20);
        assert_eq!(stream_default(&dir, 0), 32 << 20);
        std::fs::write(dir.join("index3/size"), "2M").unwrap();
        assert_eq!(last_level_cache(&dir), Some(2 << 20));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            last_level_cache(std::path::Path::new("/nonexistent/braid")),
            None
        );
        assert_eq!(
            stream_default(std::path::Path::new("/nonexistent/braid"), 4),
            8 << 20
        );
    }
}
