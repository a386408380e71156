//! Compile every reduction kernel braid ships with the real NVRTC and
//! assemble it with ptxas, without a GPU: `scripts/cuda-kernels.sh` installs
//! NVRTC and ptxas and runs this.
//!
//! For each architecture (`--arch 80,90`, the default) it compiles
//! [`braid_cuda::kernels::source`] to PTX through
//! [`braid_cuda::driver::compile_ptx`] (braid's run-time compile with
//! `--gpu-architecture=compute_XY`; NVRTC is loaded from the library path),
//! checks that every kernel of [`braid_cuda::kernels::all_names`] is an
//! entry of the PTX, assembles it with `ptxas -arch=sm_XY -v`, and prints
//! each kernel's registers and spills. Any failure (NVRTC missing, a compile
//! error or warning, a ptxas error or warning, a kernel missing) is said and
//! makes the exit status 1.
//!
//! ```text
//! kernel-check [--ptxas PATH] [--arch 80,90] [--out DIR]
//! ```
//!
//! `--ptxas` defaults to `ptxas` on the `PATH`; `--out` (default: a
//! temporary folder) receives the PTX, the cubins and ptxas's output.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

use braid_cuda::driver::compile_ptx;
use braid_cuda::kernels;

/// What ptxas said about one entry function.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Usage {
    registers: Option<u32>,
    stack: Option<u32>,
    spill_stores: Option<u32>,
    spill_loads: Option<u32>,
}

/// One row of the table.
#[derive(Debug)]
struct Row {
    kernel: String,
    arch: u32,
    ok: bool,
    usage: Usage,
    note: String,
}

/// The number before `unit` in `text` ("12 registers" -> 12).
fn number_before(text: &str, unit: &str) -> Option<u32> {
    let at = text.find(unit)?;
    text[..at].split_whitespace().last()?.parse().ok()
}

/// Per entry function, what `ptxas -v` printed (its info lines).
fn parse_ptxas(out: &str) -> BTreeMap<String, Usage> {
    let mut map: BTreeMap<String, Usage> = BTreeMap::new();
    let mut current: Option<String> = None;
    let quoted = |line: &str| -> Option<String> {
        let start = line.find('\'')? + 1;
        let len = line[start..].find('\'')?;
        Some(line[start..start + len].to_string())
    };
    for line in out.lines() {
        if line.contains("Compiling entry function") {
            current = quoted(line);
            if let Some(c) = &current {
                map.entry(c.clone()).or_default();
            }
        } else if let Some(at) = line.find("Function properties for ") {
            let name = line[at + "Function properties for ".len()..].trim();
            current = Some(name.to_string());
            map.entry(name.to_string()).or_default();
        } else if let Some(u) = current.as_ref().and_then(|c| map.get_mut(c)) {
            if line.contains("bytes stack frame") {
                u.stack = number_before(line, "bytes stack frame");
                u.spill_stores = number_before(line, "bytes spill stores");
                u.spill_loads = number_before(line, "bytes spill loads");
            } else if line.contains("Used ") && line.contains(" registers") {
                u.registers = number_before(line, " registers");
            }
        }
    }
    map
}

struct Args {
    ptxas: PathBuf,
    archs: Vec<u32>,
    out: PathBuf,
}

fn parse_args() -> Result<Args, String> {
    let mut ptxas = PathBuf::from("ptxas");
    let mut archs = vec![80, 90];
    let mut out = std::env::temp_dir().join(format!("braid-kernel-check-{}", std::process::id()));
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--ptxas" => ptxas = PathBuf::from(value()?),
            "--out" => out = PathBuf::from(value()?),
            "--arch" => {
                archs = value()?
                    .split(',')
                    .map(|s| {
                        let s = s.trim().trim_start_matches("sm_");
                        s.parse::<u32>()
                            .map_err(|_| format!("--arch: {s:?} is not a number such as 80"))
                    })
                    .collect::<Result<_, _>>()?;
            }
            "-h" | "--help" => {
                return Err("usage: kernel-check [--ptxas PATH] [--arch 80,90] [--out DIR]".into())
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    Ok(Args { ptxas, archs, out })
}

/// Compile and assemble for one architecture; one row per kernel. Errors
/// that concern the whole architecture are printed and put in every row.
fn check_arch(args: &Args, arch: u32, names: &[String]) -> Vec<Row> {
    let fail_all = |note: String| -> Vec<Row> {
        names
            .iter()
            .map(|k| Row {
                kernel: k.clone(),
                arch,
                ok: false,
                usage: Usage::default(),
                note: note.clone(),
            })
            .collect()
    };
    let virt = format!("compute_{arch}");
    let (ptx, log) = match compile_ptx(&virt) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("FAIL {virt}: {e}");
            return fail_all("NVRTC failed".into());
        }
    };
    let version = ptx
        .lines()
        .find(|l| l.trim_start().starts_with(".version"))
        .unwrap_or("(no .version line)")
        .trim();
    println!("{virt}: NVRTC made {} bytes of PTX ({version})", ptx.len());
    let ptx_path = args.out.join(format!("braid_kernels.{virt}.ptx"));
    if let Err(e) = std::fs::write(&ptx_path, &ptx) {
        eprintln!("FAIL {}: cannot write: {e}", ptx_path.display());
        return fail_all("cannot write PTX".into());
    }
    let mut arch_note = String::new();
    if !log.is_empty() {
        eprintln!("FAIL {virt}: NVRTC warnings:\n{log}");
        arch_note = "NVRTC warning".into();
    }
    let cubin = args.out.join(format!("braid_kernels.sm_{arch}.cubin"));
    let run = Command::new(&args.ptxas)
        .arg(format!("-arch=sm_{arch}"))
        .arg("-v")
        .arg("-o")
        .arg(&cubin)
        .arg(&ptx_path)
        .output();
    let run = match run {
        Ok(r) => r,
        Err(e) => {
            eprintln!("FAIL sm_{arch}: cannot run {}: {e}", args.ptxas.display());
            return fail_all("ptxas not run".into());
        }
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    let _ = std::fs::write(args.out.join(format!("ptxas.sm_{arch}.txt")), &text);
    if !run.status.success() {
        eprintln!("FAIL sm_{arch}: ptxas exited with {}:\n{text}", run.status);
        return fail_all("ptxas error".into());
    }
    let warnings: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("ptxas warning") || l.contains("ptxas fatal"))
        .collect();
    if !warnings.is_empty() {
        eprintln!("FAIL sm_{arch}: ptxas warnings:\n{}", warnings.join("\n"));
        if arch_note.is_empty() {
            arch_note = "ptxas warning".into();
        }
    }
    let usage = parse_ptxas(&text);
    for extra in usage.keys().filter(|k| !names.contains(k)) {
        println!("sm_{arch}: note: ptxas also compiled {extra} (not a kernel braid launches)");
    }
    names
        .iter()
        .map(|k| {
            let in_ptx = ptx.contains(&format!(".entry {k}("));
            let u = usage.get(k).cloned();
            let (ok, note) = match (&u, in_ptx) {
                (_, false) => (false, "missing from the PTX".to_string()),
                (None, true) => (false, "not reported by ptxas".to_string()),
                (Some(u), true) if u.registers.is_none() || u.spill_stores.is_none() => {
                    (false, "ptxas output not understood".to_string())
                }
                _ => (arch_note.is_empty(), arch_note.clone()),
            };
            Row {
                kernel: k.clone(),
                arch,
                ok,
                usage: u.unwrap_or_default(),
                note,
            }
        })
        .collect()
}

fn show(v: Option<u32>) -> String {
    v.map_or_else(|| "-".to_string(), |n| n.to_string())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = std::fs::create_dir_all(&args.out) {
        eprintln!("FAIL: cannot create {}: {e}", args.out.display());
        return ExitCode::FAILURE;
    }
    let names = kernels::all_names();
    let rows: Vec<Row> = args
        .archs
        .iter()
        .flat_map(|&arch| check_arch(&args, arch, &names))
        .collect();

    let w = names.iter().map(String::len).max().unwrap_or(6).max(6);
    println!();
    println!(
        "{:<w$}  {:<5}  {:<4}  {:>9}  {:>11}  {:>11}  {:>11}  note",
        "kernel", "arch", "ok", "registers", "stack bytes", "spill st B", "spill ld B"
    );
    for r in &rows {
        println!(
            "{:<w$}  {:<5}  {:<4}  {:>9}  {:>11}  {:>11}  {:>11}  {}",
            r.kernel,
            format!("sm_{}", r.arch),
            if r.ok { "ok" } else { "FAIL" },
            show(r.usage.registers),
            show(r.usage.stack),
            show(r.usage.spill_stores),
            show(r.usage.spill_loads),
            r.note
        );
    }
    let failed = rows.iter().filter(|r| !r.ok).count();
    let regs: Vec<u32> = rows.iter().filter_map(|r| r.usage.registers).collect();
    let spilled = rows
        .iter()
        .filter(|r| {
            r.usage.spill_stores.unwrap_or(0) > 0
                || r.usage.spill_loads.unwrap_or(0) > 0
                || r.usage.stack.unwrap_or(0) > 0
        })
        .count();
    println!();
    println!(
        "{} kernels x {} archs ({}): {} ok, {failed} failed; registers {}..{}; {spilled} with spills or a stack frame; output in {}",
        names.len(),
        args.archs.len(),
        args.archs
            .iter()
            .map(|a| format!("sm_{a}"))
            .collect::<Vec<_>>()
            .join(", "),
        rows.len() - failed,
        regs.iter().min().copied().unwrap_or(0),
        regs.iter().max().copied().unwrap_or(0),
        args.out.display(),
    );
    if failed > 0 {
        eprintln!(
            "FAIL: {failed} of {} kernel x arch checks failed (see above)",
            rows.len()
        );
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ptxas_verbose_output() {
        let out = "ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'braid_reduce_i8_sum' for 'sm_80'\n\
            ptxas info    : Function properties for braid_reduce_i8_sum\n\
            \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
            ptxas info    : Used 12 registers, 380 bytes cmem[0]\n\
            ptxas info    : Compiling entry function 'braid_divide_f64' for 'sm_80'\n\
            ptxas info    : Function properties for braid_divide_f64\n\
            \x20   8 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads\n\
            ptxas info    : Used 255 registers, used 1 barriers, 372 bytes cmem[0]\n";
        let m = parse_ptxas(out);
        assert_eq!(m.len(), 2);
        assert_eq!(
            m["braid_reduce_i8_sum"],
            Usage {
                registers: Some(12),
                stack: Some(0),
                spill_stores: Some(0),
                spill_loads: Some(0)
            }
        );
        assert_eq!(
            m["braid_divide_f64"],
            Usage {
                registers: Some(255),
                stack: Some(8),
                spill_stores: Some(4),
                spill_loads: Some(8)
            }
        );
    }
}
