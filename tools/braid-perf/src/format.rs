//! nccl-tests' table: the same columns, widths and number formats
//! (`src/common.cu` / `util.cu` of nccl-tests 2.x).

use crate::cli::Bench;

/// One measurement (out-of-place or in-place) of a row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Meas {
    pub time_us: f64,
    pub algbw: f64,
    pub busbw: f64,
    /// `None` when checking is off (`-c 0`): prints N/A.
    pub wrong: Option<u64>,
    /// Timed iterations (`-n`, or as many as `-D` took); 0 where unknown.
    pub iters: u64,
}

impl Meas {
    /// algbw and busbw (GB/s, 1e9) for `bytes` moved in `time_us`.
    pub fn new(bench: Bench, nranks: u32, bytes: u64, time_us: f64, wrong: Option<u64>) -> Meas {
        let algbw = if time_us > 0.0 {
            bytes as f64 / 1e9 / (time_us * 1e-6)
        } else {
            0.0
        };
        Meas {
            time_us,
            algbw,
            busbw: algbw * bench.bus_factor(nranks),
            wrong,
            iters: 0,
        }
    }
}

/// The table header: the out-of-place / in-place caption, column names and
/// units, exactly as nccl-tests prints them.
pub fn table_header() -> String {
    let mut s = String::new();
    s.push_str("#\n");
    s.push_str(&format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}           out-of-place                       in-place          \n",
        "", "", "", "", ""
    ));
    s.push_str(&format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}",
        "size", "count", "type", "redop", "root"
    ));
    for _ in 0..2 {
        s.push_str(&format!(
            "  {:>7}  {:>6}  {:>6} {:>6}",
            "time", "algbw", "busbw", "#wrong"
        ));
    }
    s.push('\n');
    s.push_str(&format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}",
        "(B)", "(elements)", "", "", ""
    ));
    for _ in 0..2 {
        s.push_str(&format!(
            "  {:>7}  {:>6}  {:>6} {:>6}",
            "(us)", "(GB/s)", "(GB/s)", ""
        ));
    }
    s.push('\n');
    s
}

/// nccl-tests' time column: `%7.0f` from 10 ms, `%7.1f` from 100 µs,
/// `%7.2f` below.
pub fn fmt_time(us: f64) -> String {
    if us >= 10000.0 {
        format!("{us:>7.0}")
    } else if us >= 100.0 {
        format!("{us:>7.1}")
    } else {
        format!("{us:>7.2}")
    }
}

/// C's `%g` for a non-negative count (6 significant digits).
pub fn fmt_g(v: u64) -> String {
    if v < 1_000_000 {
        return v.to_string();
    }
    let s = format!("{:.5e}", v as f64); // e.g. 1.23457e6
    let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let mant = mant.trim_end_matches('0').trim_end_matches('.');
    let exp: i32 = exp.parse().unwrap_or(0);
    format!("{mant}e+{exp:02}")
}

/// The left part of a row: size, count, type, redop, root.
pub fn row_prefix(size: u64, count: u64, dtype: &str, redop: &str, root: i64) -> String {
    format!("{size:>12}  {count:>12}  {dtype:>8}  {redop:>6}  {root:>6}")
}

/// One half of a row (`None`: this placement is not available, N/A).
pub fn row_half(m: Option<&Meas>) -> String {
    match m {
        Some(m) => {
            let wrong = match m.wrong {
                Some(w) => fmt_g(w),
                None => "N/A".to_string(),
            };
            format!(
                "  {}  {:>6.2}  {:>6.2}  {:>5}",
                fmt_time(m.time_us),
                m.algbw,
                m.busbw,
                wrong
            )
        }
        None => format!("  {:>7}  {:>6}  {:>6}  {:>5}", "N/A", "N/A", "N/A", "N/A"),
    }
}

/// A whole row.
pub fn row(
    size: u64,
    count: u64,
    dtype: &str,
    redop: &str,
    root: i64,
    oop: Option<&Meas>,
    ip: Option<&Meas>,
) -> String {
    format!(
        "{}{}{}",
        row_prefix(size, count, dtype, redop, root),
        row_half(oop),
        row_half(ip)
    )
}

/// The footer: out-of-bounds (wrong) values and the mean busbw over every
/// measurement printed.
pub fn footer(wrong_total: u64, avg_busbw: f64) -> String {
    format!(
        "# {:<20} : {} {}\n# {:<20} : {} \n#\n",
        "Out of bounds values",
        wrong_total,
        if wrong_total == 0 { "OK" } else { "FAILED" },
        "Avg bus bandwidth",
        fmt_g_float(avg_busbw),
    )
}

/// C's `%g` for a float (6 significant digits, trailing zeros removed).
pub fn fmt_g_float(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let exp = v.abs().log10().floor() as i32;
    if !(-5..6).contains(&exp) {
        let s = format!("{v:.5e}");
        let (m, e) = s.split_once('e').unwrap_or((&s, "0"));
        let m = m.trim_end_matches('0').trim_end_matches('.');
        let e: i32 = e.parse().unwrap_or(0);
        let sign = if e < 0 { '-' } else { '+' };
        return format!("{m}e{sign}{:02}", e.abs());
    }
    let decimals = (5 - exp).max(0) as usize;
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_matches_nccl_tests_columns() {
        let h = table_header();
        let lines: Vec<&str> = h.lines().collect();
        assert_eq!(lines[0], "#");
        assert_eq!(
            lines[2],
            "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong"
        );
        assert_eq!(
            lines[3].trim_end(),
            "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)"
        );
        // Every row lines up with the header: same total width.
        let r = row(
            8,
            2,
            "float",
            "sum",
            -1,
            Some(&m(40.22, 0.0, 0.0, Some(0))),
            Some(&m(39.6, 0.0, 0.0, Some(0))),
        );
        assert_eq!(r.len(), lines[2].len());
    }

    fn m(t: f64, a: f64, b: f64, w: Option<u64>) -> Meas {
        Meas {
            time_us: t,
            algbw: a,
            busbw: b,
            wrong: w,
            iters: 0,
        }
    }

    #[test]
    fn rows_match_nccl_tests_output() {
        // A real nccl-tests line.
        assert_eq!(
            row(8, 2, "float", "sum", -1, Some(&m(40.22, 0.0, 0.0, Some(0))), Some(&m(39.60, 0.0, 0.0, Some(0)))),
            "           8             2     float     sum      -1    40.22    0.00    0.00      0    39.60    0.00    0.00      0"
        );
        assert_eq!(
            row(134217728, 33554432, "float", "sum", -1, Some(&m(1381.5, 97.15, 170.02, Some(0))), Some(&m(12345.4, 97.0, 169.8, None))),
            "   134217728      33554432     float     sum      -1   1381.5   97.15  170.02      0    12345   97.00  169.80    N/A"
        );
        assert_eq!(
            row(16, 4, "float", "none", -1, Some(&m(1.0, 0.02, 0.01, Some(0))), None),
            "          16             4     float    none      -1     1.00    0.02    0.01      0      N/A     N/A     N/A    N/A"
        );
    }

    #[test]
    fn numbers_format_like_c() {
        assert_eq!(fmt_time(99.999), " 100.00");
        assert_eq!(fmt_time(100.0), "  100.0");
        assert_eq!(fmt_time(5.0), "   5.00");
        assert_eq!(fmt_time(123456.0), " 123456");
        assert_eq!(fmt_g(0), "0");
        assert_eq!(fmt_g(999_999), "999999");
        assert_eq!(fmt_g(1_234_567), "1.23457e+06");
        assert_eq!(fmt_g(2_000_000), "2e+06");
        assert_eq!(fmt_g_float(52.19321), "52.1932");
        assert_eq!(fmt_g_float(0.0), "0");
        assert_eq!(fmt_g_float(5.0), "5");
        assert_eq!(fmt_g_float(0.00123456), "0.00123456");
        assert_eq!(fmt_g_float(1234567.0), "1.23457e+06");
    }

    #[test]
    fn footer_says_ok_or_failed() {
        assert_eq!(
            footer(0, 52.19321),
            "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 52.1932 \n#\n"
        );
        assert!(footer(3, 1.0).contains(": 3 FAILED"));
    }

    #[test]
    fn bandwidth_is_size_over_time_times_factor() {
        let x = Meas::new(Bench::AllReduce, 4, 1_000_000, 1000.0, Some(0));
        assert!((x.algbw - 1.0).abs() < 1e-12);
        assert!((x.busbw - 1.5).abs() < 1e-12);
        let y = Meas::new(Bench::AllGather, 4, 4_000_000, 1000.0, Some(0));
        assert!((y.algbw - 4.0).abs() < 1e-12 && (y.busbw - 3.0).abs() < 1e-12);
        assert_eq!(Meas::new(Bench::Broadcast, 2, 0, 0.0, None).algbw, 0.0);
    }
}
