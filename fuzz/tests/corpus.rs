//! The seed corpus is what the generator (`braid_fuzz::seeds`) makes, and
//! every committed input of every target (seeds, and inputs that once
//! crashed a decoder) passes its target's checks. Runs without libFuzzer.
//!
//! `BRAID_FUZZ_WRITE_CORPUS=1 cargo test --manifest-path fuzz/Cargo.toml`
//! rewrites the seeds after a wire format changed.

use std::fs;
use std::path::PathBuf;

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target)
}

#[test]
fn seeds_are_committed() {
    let write = std::env::var_os("BRAID_FUZZ_WRITE_CORPUS").is_some();
    let seeds = braid_fuzz::seeds();
    let names: Vec<&str> = seeds.iter().map(|(t, _)| *t).collect();
    assert_eq!(names, braid_fuzz::TARGETS, "a target without seeds");
    for (target, inputs) in seeds {
        let dir = corpus_dir(target);
        for (name, bytes) in inputs {
            let path = dir.join(&name);
            if write {
                fs::create_dir_all(&dir).unwrap();
                fs::write(&path, &bytes).unwrap();
            }
            let got = fs::read(&path).unwrap_or_else(|e| {
                panic!(
                    "{}: {e}; run BRAID_FUZZ_WRITE_CORPUS=1 cargo test --manifest-path fuzz/Cargo.toml",
                    path.display()
                )
            });
            assert!(
                got == bytes,
                "{} is stale; run BRAID_FUZZ_WRITE_CORPUS=1 cargo test --manifest-path fuzz/Cargo.toml",
                path.display()
            );
        }
    }
}

#[test]
fn committed_inputs_pass() {
    for target in braid_fuzz::TARGETS {
        let mut n = 0;
        for entry in fs::read_dir(corpus_dir(target)).unwrap() {
            let path = entry.unwrap().path();
            let data = fs::read(&path).unwrap();
            let out = std::panic::catch_unwind(|| braid_fuzz::run(target, &data));
            assert!(out.is_ok(), "{target}: {} fails", path.display());
            n += 1;
        }
        assert!(n > 0, "{target}: empty corpus");
    }
}
