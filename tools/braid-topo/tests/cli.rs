//! braid-topo runs on this machine and on every fixture; --xml output parses
//! back into the same model; errors name the file and line.

use std::path::{Path, PathBuf};
use std::process::Command;

use braid_core::topo::{self, xml};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../crates/core/tests/fixtures/topo")
}

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_braid-topo"))
        .args(args)
        .env_remove("BRAID_TOPO_FILE")
        .env_remove("BRAID_TRANSPORT")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn runs_on_this_machine() {
    let (rc, out, err) = run(&["--ranks", "4"]);
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("NUMA") && out.contains("transports:"), "{out}");
    let (rc, out, err) = run(&["--json"]);
    assert_eq!(rc, 0, "{err}");
    assert!(serde_json::from_str::<serde_json::Value>(&out).is_ok());
}

#[test]
fn runs_on_every_fixture_and_xml_parses_back() {
    let f = fixtures();
    let mut sources: Vec<Vec<String>> = Vec::new();
    for d in ["nvswitch8", "pcie4", "nvbridge4", "vm"] {
        sources.push(vec!["--sysfs-root".into(), f.join(d).display().to_string()]);
    }
    for x in ["nvswitch8", "pcie4", "nvbridge4", "cloud-partial"] {
        sources.push(vec![
            "--topo-file".into(),
            f.join(format!("{x}.xml")).display().to_string(),
        ]);
    }
    for src in sources {
        let a: Vec<&str> = src.iter().map(String::as_str).collect();
        for extra in [
            &["--paths"][..],
            &["--ranks", "8", "--hosts", "2"],
            &["--json", "--ranks", "4"],
        ] {
            let args: Vec<&str> = a.iter().chain(extra).copied().collect();
            let (rc, out, err) = run(&args);
            assert_eq!(rc, 0, "{args:?}: {err}");
            assert!(!out.is_empty());
        }
        let (rc, out, err) = run(&[a[0], a[1], "--xml"]);
        assert_eq!(rc, 0, "{err}");
        let back = xml::from_xml("stdout", &out).unwrap();
        let (_, json, _) = run(&[a[0], a[1], "--json"]);
        let model = topo::json::from_json("stdout.json", &json).unwrap();
        assert_eq!(
            back, model,
            "{a:?}: --xml parses back into the model --json shows"
        );
    }
}

#[test]
fn clear_errors() {
    let bad = fixtures().join("bad/mismatched.xml");
    let (rc, _, err) = run(&["--topo-file", &bad.display().to_string()]);
    assert_eq!(rc, 1);
    assert!(err.contains(&format!("{}:4:", bad.display())), "{err}");
    let (rc, _, err) = run(&["--sysfs-root", "/nonexistent/root"]);
    assert_eq!(rc, 1);
    assert!(err.contains("/nonexistent/root/sys"), "{err}");
    let (rc, _, err) = run(&["--bogus"]);
    assert_eq!(rc, 2);
    assert!(err.contains("unknown argument"), "{err}");
    let (rc, _, err) = run(&["--ranks", "0"]);
    assert_eq!(rc, 2, "{err}");
}

/// The case: a vendor file planned for two hosts; every hop between
/// hosts stays on one rail and the summary names the rails.
#[test]
fn real_vendor_file_two_hosts_stay_on_rails() {
    let f = fixtures().join("real/vendor/ibm-gx3d-h100-topo.xml");
    let f = f.display().to_string();
    let (rc, out, err) = run(&[
        "--topo-file",
        &f,
        "--file-only",
        "--ranks",
        "16",
        "--hosts",
        "2",
    ]);
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("alone (--file-only)"), "{out}");
    assert!(
        out.contains("rails: 8 (BRAID_CROSS_NIC=2); hops between hosts: 16, on one rail: 16"),
        "{out}"
    );
    assert!(
        out.contains("via mlx5_7 -> mlx5_7 (rail 7; PXN out, PIX in)"),
        "{out}"
    );
    assert!(!out.contains("crosses rails"), "{out}");
    // Merged with this machine's detection (no GPU, no RDMA here): the
    // file's GPUs and NICs stay.
    let (rc, out, err) = run(&["--topo-file", &f, "--ranks", "16", "--hosts", "2"]);
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("merged with detection"), "{out}");
    assert!(out.contains("on one rail: 16"), "{out}");
    let (rc, _, err) = run(&["--file-only"]);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("--file-only needs --topo-file"), "{err}");
}

/// Issue 30, item 5: Azure NCv4's file merged with this VM's recorded
/// sysfs (eth0 virtio at 0000:00:03.0, no RDMA device) plans socket between
/// hosts, as the file alone does, and says why not ib; it planned ib
/// through 0000:00:03.0 before.
#[test]
fn vendor_file_merged_with_a_nic_without_rdma_plans_socket() {
    let f = fixtures().join("real/vendor/azure-ncv4-topo.xml");
    let f = f.display().to_string();
    let vm = fixtures().join("vm").display().to_string();
    let args = ["--topo-file", &f, "--ranks", "8", "--hosts", "2"];
    let merged: Vec<&str> = args.iter().copied().chain(["--sysfs-root", &vm]).collect();
    let alone: Vec<&str> = args.iter().copied().chain(["--file-only"]).collect();
    for a in [merged, alone] {
        let (rc, out, err) = run(&a);
        assert_eq!(rc, 0, "{a:?}: {err}");
        assert!(
            out.contains("3 -> 4: socket NET 12.0 GB/s via eth0 -> eth0"),
            "{a:?}: {out}"
        );
        assert!(!out.contains(": ib "), "{a:?}: {out}");
        assert!(!out.contains("placeholder"), "{a:?}: {out}");
        assert!(
            out.contains("not ib") && out.contains("no RDMA device"),
            "{a:?}: {out}"
        );
    }
}

/// Recorded NVML answers replayed over a sysfs tree written for the model.
#[test]
fn nvml_answers_replay() {
    let real = fixtures().join("real");
    let dir = std::env::temp_dir().join(format!("braid-topo-cli-nvml-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let f = real
        .join("vendor/ibm-gx3d-h100-topo.xml")
        .display()
        .to_string();
    let d = dir.display().to_string();
    let (rc, out, err) = run(&["--topo-file", &f, "--file-only", "--write-sysfs", &d]);
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("wrote a sysfs tree"), "{out}");
    let _ = std::fs::remove_file(dir.join("nvml-gpus.xml"));
    let nv = real
        .join("nvml/ibm-gx3d-h100.nvml.json")
        .display()
        .to_string();
    let (rc, out, err) = run(&["--sysfs-root", &d, "--nvml-file", &nv]);
    assert_eq!(rc, 0, "{err}");
    assert!(out.contains("GPUs: 8, NVSwitches: 4"), "{out}");
    assert!(out.contains("NV18"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}
