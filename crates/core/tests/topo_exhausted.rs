//! Detection in a process out of file descriptors says so instead of
//! describing a machine with one NUMA node, no GPUs and no NICs (what a
//! bootstrap root flooded with connections once made rank 0 report). This
//! file holds one test: it lowers its own process's descriptor limit.

use std::fs::File;
use std::path::Path;

use braid_core::topo::{detect, NoGpus, SysfsReader, TopoError};

/// Opens /dev/null until the process is out of descriptors.
fn exhaust() -> Vec<File> {
    let mut held = Vec::new();
    loop {
        match File::open("/dev/null") {
            Ok(f) => held.push(f),
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) => return held,
            Err(e) => panic!("opening /dev/null: {e}"),
        }
        assert!(held.len() < 100_000, "no descriptor limit reached");
    }
}

#[test]
fn detection_out_of_descriptors_is_an_error_that_says_so() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/topo/nvswitch8");
    let whole = detect(&SysfsReader::new(&root).unwrap(), &NoGpus).unwrap();
    assert!(!whole.system.cpus.is_empty());

    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into `r`, a valid rlimit.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
    r.rlim_cur = r.rlim_cur.min(256);
    // SAFETY: setrlimit reads `r`; lowering the soft limit is always allowed.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) }, 0);

    // A reader made before the descriptors ran out: detection cut short.
    let reader = SysfsReader::new(&root).unwrap();
    let held = exhaust();
    let e = detect(&reader, &NoGpus).unwrap_err();
    assert!(matches!(e, TopoError::Exhausted { .. }), "{e:?}");
    assert!(e.to_string().contains("out of file descriptors"), "{e}");
    // No reader at all.
    let e = SysfsReader::new(&root).unwrap_err();
    assert!(matches!(e, TopoError::Exhausted { .. }), "{e:?}");
    assert!(e.to_string().contains("Too many open files"), "{e}");

    // With descriptors again, the same machine as before.
    drop(held);
    let again = detect(&SysfsReader::new(&root).unwrap(), &NoGpus).unwrap();
    assert_eq!(again.system, whole.system);
}
