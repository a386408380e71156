//! PNG plots of busbw and latency against size, log-log, from reports.
//!
//! Pure Rust, no system fonts: shapes are rasterised here (anti-aliased
//! lines and markers), text uses embedded-graphics' built-in bitmap fonts,
//! and the `png` crate encodes the picture.

use std::collections::BTreeMap;
use std::path::Path;

use embedded_graphics::mono_font::iso_8859_1::{FONT_10X20, FONT_7X13, FONT_8X13, FONT_9X15};
use embedded_graphics::mono_font::{MonoFont, MonoTextStyle};
use embedded_graphics::pixelcolor::Rgb888;
use embedded_graphics::prelude::*;
use embedded_graphics::text::{Alignment, Baseline, Text, TextStyleBuilder};

use crate::report::{JsonMeas, Report, Row};

/// Which measurement of each row to plot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    OutOfPlace,
    InPlace,
    Both,
}

/// A line on the plots.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub name: String,
    /// (size in bytes, busbw GB/s, time µs), sorted by size.
    pub points: Vec<(f64, f64, f64)>,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    run: usize,
    label: String,
    coll: String,
    nranks: u32,
    dtype: String,
    redop: String,
    root: i64,
    in_place: bool,
}

/// Group the rows of `reports` into series: one per run, collective, rank
/// count, type, operator, root and placement; repeated sizes (`-N`) are
/// averaged. Names carry the label plus whatever differs between series.
pub fn series_from(
    reports: &[Report],
    placement: Placement,
    coll: Option<&str>,
) -> (Vec<Series>, String) {
    let mut groups: BTreeMap<Key, BTreeMap<u64, (f64, f64, u32)>> = BTreeMap::new();
    for (run, rep) in reports.iter().enumerate() {
        for row in &rep.rows {
            if coll.is_some_and(|c| c != row.collective) {
                continue;
            }
            let mut add = |m: &Option<JsonMeas>, in_place: bool| {
                if let Some(m) = m {
                    let key = key_of(run, rep, row, in_place);
                    let e = groups.entry(key).or_default().entry(row.size).or_default();
                    e.0 += m.busbw_gbps;
                    e.1 += m.time_us;
                    e.2 += 1;
                }
            };
            if placement != Placement::InPlace {
                add(&row.out_of_place, false);
            }
            if placement != Placement::OutOfPlace {
                add(&row.in_place, true);
            }
        }
    }
    let keys: Vec<&Key> = groups.keys().collect();
    let varies = |f: &dyn Fn(&Key) -> String| {
        keys.first()
            .is_some_and(|k0| keys.iter().any(|k| f(k) != f(k0)))
    };
    let fields: [(&str, &KeyField); 7] = [
        ("label", &|k| k.label.clone()),
        ("coll", &|k| k.coll.clone()),
        ("np", &|k| format!("np{}", k.nranks)),
        ("type", &|k| k.dtype.clone()),
        ("redop", &|k| k.redop.clone()),
        ("root", &|k| {
            if k.root >= 0 {
                format!("root {}", k.root)
            } else {
                String::new()
            }
        }),
        ("place", &|k| {
            if k.in_place {
                "in-place".into()
            } else {
                "out-of-place".into()
            }
        }),
    ];
    let varying: Vec<bool> = fields.iter().map(|(_, f)| varies(*f)).collect();
    let mut common = Vec::new();
    if let Some(k0) = keys.first() {
        for (i, (name, f)) in fields.iter().enumerate() {
            let v = f(k0);
            if !varying[i] && *name != "label" && !v.is_empty() {
                common.push(if *name == "np" {
                    format!("{} ranks", k0.nranks)
                } else {
                    v
                });
            }
        }
    }
    let series = groups
        .into_iter()
        .map(|(k, pts)| {
            let mut parts = vec![k.label.clone()];
            for (i, (name, f)) in fields.iter().enumerate() {
                if varying[i] && *name != "label" {
                    let v = f(&k);
                    if !v.is_empty() {
                        parts.push(v);
                    }
                }
            }
            Series {
                name: parts.join(" "),
                points: pts
                    .into_iter()
                    .map(|(size, (bw, t, n))| (size as f64, bw / f64::from(n), t / f64::from(n)))
                    .collect(),
            }
        })
        .collect();
    (series, common.join(", "))
}

/// Reads one part of a series key as text.
type KeyField = dyn Fn(&Key) -> String;

fn key_of(run: usize, rep: &Report, row: &Row, in_place: bool) -> Key {
    Key {
        run,
        label: rep.label.clone(),
        coll: row.collective.clone(),
        nranks: row.nranks,
        dtype: row.dtype.clone(),
        redop: row.redop.clone(),
        root: row.root,
        in_place,
    }
}

/// An RGB picture.
#[derive(Debug, Clone)]
pub struct Canvas {
    w: u32,
    h: u32,
    px: Vec<u8>,
}

type Rgb = [u8; 3];

const WHITE: Rgb = [255, 255, 255];
const BLACK: Rgb = [0, 0, 0];
const GRID: Rgb = [225, 225, 225];
const GRID_MINOR: Rgb = [242, 242, 242];
const AXIS: Rgb = [60, 60, 60];
const TEXT: Rgb = [30, 30, 30];

/// Tableau 10.
const PALETTE: [Rgb; 10] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
    [188, 189, 34],
    [23, 190, 207],
];

impl Canvas {
    pub fn new(w: u32, h: u32) -> Canvas {
        Canvas {
            w,
            h,
            px: vec![255; (w * h * 3) as usize],
        }
    }

    fn blend(&mut self, x: i64, y: i64, c: Rgb, a: f64) {
        if x < 0 || y < 0 || x >= i64::from(self.w) || y >= i64::from(self.h) || a <= 0.0 {
            return;
        }
        let a = a.min(1.0);
        let i = ((y as usize) * self.w as usize + x as usize) * 3;
        for (p, &new) in self.px[i..i + 3].iter_mut().zip(&c) {
            let old = f64::from(*p);
            *p = (old + (f64::from(new) - old) * a).round() as u8;
        }
    }

    fn rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb) {
        for y in y0..y1 {
            for x in x0..x1 {
                self.blend(x, y, c, 1.0);
            }
        }
    }

    fn hline(&mut self, x0: i64, x1: i64, y: i64, c: Rgb) {
        self.rect(x0, y, x1 + 1, y + 1, c);
    }

    fn vline(&mut self, x: i64, y0: i64, y1: i64, c: Rgb) {
        self.rect(x, y0, x + 1, y1 + 1, c);
    }

    /// Anti-aliased line of width `w`.
    fn line(&mut self, (ax, ay): (f64, f64), (bx, by): (f64, f64), w: f64, c: Rgb) {
        let r = w / 2.0 + 1.0;
        let (x0, x1) = (
            (ax.min(bx) - r).floor() as i64,
            (ax.max(bx) + r).ceil() as i64,
        );
        let (y0, y1) = (
            (ay.min(by) - r).floor() as i64,
            (ay.max(by) + r).ceil() as i64,
        );
        let (dx, dy) = (bx - ax, by - ay);
        let len2 = dx * dx + dy * dy;
        for y in y0..=y1 {
            for x in x0..=x1 {
                let (px, py) = (x as f64 + 0.5, y as f64 + 0.5);
                let t = if len2 > 0.0 {
                    (((px - ax) * dx + (py - ay) * dy) / len2).clamp(0.0, 1.0)
                } else {
                    0.0
                };
                let (qx, qy) = (ax + t * dx - px, ay + t * dy - py);
                let d = (qx * qx + qy * qy).sqrt();
                self.blend(x, y, c, w / 2.0 + 0.5 - d);
            }
        }
    }

    /// A marker: 0 circle, 1 square, 2 diamond, 3 ring.
    fn marker(&mut self, (cx, cy): (f64, f64), kind: usize, r: f64, c: Rgb) {
        let (x0, x1) = ((cx - r - 1.0).floor() as i64, (cx + r + 1.0).ceil() as i64);
        let (y0, y1) = ((cy - r - 1.0).floor() as i64, (cy + r + 1.0).ceil() as i64);
        for y in y0..=y1 {
            for x in x0..=x1 {
                let (dx, dy) = (x as f64 + 0.5 - cx, y as f64 + 0.5 - cy);
                let cov = match kind % 4 {
                    0 => r + 0.5 - (dx * dx + dy * dy).sqrt(),
                    1 => (r * 0.85 + 0.5 - dx.abs()).min(r * 0.85 + 0.5 - dy.abs()),
                    2 => (r * 1.2 + 0.5 - (dx.abs() + dy.abs())) / std::f64::consts::SQRT_2,
                    _ => {
                        let d = (dx * dx + dy * dy).sqrt();
                        (r + 0.5 - d).min(d - (r - 2.0) + 0.5)
                    }
                };
                self.blend(x, y, c, cov.clamp(0.0, 1.0));
            }
        }
    }

    fn text(&mut self, s: &str, x: i64, y: i64, font: &MonoFont<'_>, align: Alignment, c: Rgb) {
        let style = MonoTextStyle::new(font, Rgb888::new(c[0], c[1], c[2]));
        let ts = TextStyleBuilder::new()
            .alignment(align)
            .baseline(Baseline::Middle)
            .build();
        let _ = Text::with_text_style(s, Point::new(x as i32, y as i32), style, ts).draw(self);
    }

    /// Text turned 90° counter-clockwise, centred on (cx, cy).
    fn text_vertical(&mut self, s: &str, cx: i64, cy: i64, font: &MonoFont<'_>, c: Rgb) {
        let tw = font.character_size.width as i64 * s.chars().count() as i64;
        let th = font.character_size.height as i64;
        let mut m = Canvas::new(tw.max(1) as u32, th.max(1) as u32);
        m.text(s, 0, th / 2, font, Alignment::Left, BLACK);
        for y in 0..th {
            for x in 0..tw {
                let i = ((y * tw + x) * 3) as usize;
                if m.px[i] < 128 {
                    // (x, y) -> (cx - th/2 + y, cy + tw/2 - x)
                    self.blend(cx - th / 2 + y, cy + tw / 2 - x, c, 1.0);
                }
            }
        }
    }

    /// Encode as PNG.
    pub fn save_png(&self, path: &Path) -> Result<(), String> {
        let f = std::fs::File::create(path)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        let mut enc = png::Encoder::new(std::io::BufWriter::new(f), self.w, self.h);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let err = |e: png::EncodingError| format!("cannot write {}: {e}", path.display());
        let mut wr = enc.write_header().map_err(err)?;
        wr.write_image_data(&self.px).map_err(err)?;
        wr.finish().map_err(err)
    }
}

impl OriginDimensions for Canvas {
    fn size(&self) -> Size {
        Size::new(self.w, self.h)
    }
}

impl DrawTarget for Canvas {
    type Color = Rgb888;
    type Error = std::convert::Infallible;

    fn draw_iter<I>(&mut self, pixels: I) -> Result<(), Self::Error>
    where
        I: IntoIterator<Item = Pixel<Self::Color>>,
    {
        for Pixel(p, c) in pixels {
            self.blend(i64::from(p.x), i64::from(p.y), [c.r(), c.g(), c.b()], 1.0);
        }
        Ok(())
    }
}

/// Bytes with binary suffixes: 8, 1K, 64K, 1M, 2G.
pub fn fmt_bytes(b: f64) -> String {
    let b = b.round() as u64;
    if b >= 1 << 30 && b.is_multiple_of(1 << 30) {
        format!("{}G", b >> 30)
    } else if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{}M", b >> 20)
    } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
        format!("{}K", b >> 10)
    } else {
        b.to_string()
    }
}

/// A tick value on a log10 axis: 0.001, 0.5, 20, 1000, 1e+05.
pub fn fmt_tick(v: f64) -> String {
    if !(1e-3..1e5).contains(&v) {
        let e = v.log10().floor() as i32;
        let m = v / 10f64.powi(e);
        if (m - 1.0).abs() < 1e-9 {
            format!("1e{e}")
        } else {
            format!("{m:.0}e{e}")
        }
    } else if v >= 1.0 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').to_string()
    }
}

struct Axes {
    x0: f64,
    y0: f64,
    x1: f64,
    y1: f64,
    /// log2 range of x.
    lx: (f64, f64),
    /// log10 range of y.
    ly: (f64, f64),
}

impl Axes {
    fn map(&self, x: f64, y: f64) -> (f64, f64) {
        let fx = (x.log2() - self.lx.0) / (self.lx.1 - self.lx.0);
        let fy = (y.log10() - self.ly.0) / (self.ly.1 - self.ly.0);
        (
            self.x0 + fx * (self.x1 - self.x0),
            self.y1 - fy * (self.y1 - self.y0),
        )
    }
}

fn log10_range(vals: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in vals.filter(|v| *v > 0.0 && v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return None;
    }
    let (a, mut b) = (lo.log10().floor(), hi.log10().ceil());
    if b <= a {
        b = a + 1.0;
    }
    Some((a, b))
}

/// Draw one panel: grid, ticks, labels, series.
fn panel(
    c: &mut Canvas,
    ax: &Axes,
    series: &[Series],
    y_of: fn(&(f64, f64, f64)) -> f64,
    ylabel: &str,
    title: &str,
) {
    let (x0, y0, x1, y1) = (ax.x0 as i64, ax.y0 as i64, ax.x1 as i64, ax.y1 as i64);
    // y grid: decades, with minor 2..9.
    let decades = (ax.ly.1 - ax.ly.0).round() as i64;
    let label_step = if decades > 8 { 2 } else { 1 };
    for d in 0..=decades {
        let e = ax.ly.0 as i64 + d;
        let base = 10f64.powi(e as i32);
        if d < decades && decades <= 5 {
            for m in 2..10 {
                let (_, py) = ax.map(1.0, base * f64::from(m));
                c.hline(x0, x1, py.round() as i64, GRID_MINOR);
                if decades <= 2 && (m == 2 || m == 5) {
                    c.text(
                        &fmt_tick(base * f64::from(m)),
                        x0 - 6,
                        py.round() as i64,
                        &FONT_7X13,
                        Alignment::Right,
                        TEXT,
                    );
                }
            }
        }
        let (_, py) = ax.map(1.0, base);
        let py = py.round() as i64;
        c.hline(x0, x1, py, GRID);
        c.hline(x0 - 5, x0, py, AXIS);
        if d % label_step == 0 {
            c.text(
                &fmt_tick(base),
                x0 - 8,
                py,
                &FONT_8X13,
                Alignment::Right,
                TEXT,
            );
        }
    }
    // x grid: powers of two, at most ~12 labels.
    let (ea, eb) = (ax.lx.0 as i64, ax.lx.1 as i64);
    let span = (eb - ea).max(1);
    let step = ((span + 11) / 12).max(1);
    for e in ea..=eb {
        let (px, _) = ax.map(2f64.powi(e as i32), 1.0);
        let px = px.round() as i64;
        let major = (e - ea) % step == 0;
        c.vline(px, y0, y1, if major { GRID } else { GRID_MINOR });
        if major {
            c.vline(px, y1, y1 + 5, AXIS);
            c.text(
                &fmt_bytes(2f64.powi(e as i32)),
                px,
                y1 + 16,
                &FONT_8X13,
                Alignment::Center,
                TEXT,
            );
        }
    }
    // Frame.
    c.hline(x0, x1, y0, AXIS);
    c.hline(x0, x1, y1, AXIS);
    c.vline(x0, y0, y1, AXIS);
    c.vline(x1, y0, y1, AXIS);
    c.text(
        title,
        (x0 + x1) / 2,
        y0 - 14,
        &FONT_9X15,
        Alignment::Center,
        TEXT,
    );
    c.text(
        "size (bytes)",
        (x0 + x1) / 2,
        y1 + 38,
        &FONT_9X15,
        Alignment::Center,
        TEXT,
    );
    c.text_vertical(ylabel, x0 - 72, (y0 + y1) / 2, &FONT_9X15, TEXT);
    // Series.
    for (i, s) in series.iter().enumerate() {
        let col = PALETTE[i % PALETTE.len()];
        let pts: Vec<Option<(f64, f64)>> = s
            .points
            .iter()
            .map(|p| {
                let y = y_of(p);
                (p.0 > 0.0 && y > 0.0 && y.is_finite()).then(|| ax.map(p.0, y))
            })
            .collect();
        for w in pts.windows(2) {
            if let (Some(a), Some(b)) = (w[0], w[1]) {
                c.line(a, b, 2.2, col);
            }
        }
        for p in pts.iter().flatten() {
            c.marker(*p, i, 4.0, col);
        }
    }
}

/// Render busbw (top) and latency (bottom) against size for `series`.
pub fn render(series: &[Series], title: &str) -> Canvas {
    let (w, h) = (1280u32, 1000u32);
    let mut c = Canvas::new(w, h);
    c.rect(0, 0, i64::from(w), i64::from(h), WHITE);
    c.text(
        title,
        i64::from(w) / 2,
        22,
        &FONT_10X20,
        Alignment::Center,
        BLACK,
    );
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for x in xs.filter(|x| *x > 0.0) {
        lo = lo.min(x);
        hi = hi.max(x);
    }
    let lx = if lo.is_finite() {
        let (mut a, mut b) = (lo.log2().floor(), hi.log2().ceil());
        if b <= a {
            b = a + 1.0;
        }
        // Start the axis so that labelled ticks (every `step` powers of
        // two) land on both ends.
        let span = (b - a) as i64;
        let step = ((span + 11) / 12).max(1);
        a -= ((step - span % step) % step) as f64;
        (a, b)
    } else {
        (3.0, 26.0)
    };
    let bw = log10_range(series.iter().flat_map(|s| s.points.iter().map(|p| p.1)));
    let lat = log10_range(series.iter().flat_map(|s| s.points.iter().map(|p| p.2)));
    let (left, right) = (110.0, 920.0);
    let top = Axes {
        x0: left,
        y0: 75.0,
        x1: right,
        y1: 465.0,
        lx,
        ly: bw.unwrap_or((-2.0, 2.0)),
    };
    let bottom = Axes {
        x0: left,
        y0: 560.0,
        x1: right,
        y1: 935.0,
        lx,
        ly: lat.unwrap_or((0.0, 4.0)),
    };
    panel(
        &mut c,
        &top,
        series,
        |p| p.1,
        "busbw (GB/s)",
        "bus bandwidth (higher is better)",
    );
    panel(
        &mut c,
        &bottom,
        series,
        |p| p.2,
        "time (us)",
        "time per operation (lower is better)",
    );
    if bw.is_none() {
        c.text(
            "no positive busbw (1 rank, or size 0)",
            ((left + right) / 2.0) as i64,
            270,
            &FONT_9X15,
            Alignment::Center,
            AXIS,
        );
    }
    // Legend.
    let lx0 = right as i64 + 24;
    c.text("legend", lx0, 80, &FONT_9X15, Alignment::Left, BLACK);
    for (i, s) in series.iter().enumerate().take(40) {
        let col = PALETTE[i % PALETTE.len()];
        let y = 104 + 22 * i as i64;
        c.line(
            (lx0 as f64, y as f64),
            ((lx0 + 28) as f64, y as f64),
            2.2,
            col,
        );
        c.marker(((lx0 + 14) as f64, y as f64), i, 4.0, col);
        let mut name = s.name.clone();
        if name.chars().count() > 44 {
            name = name.chars().take(41).collect::<String>() + "...";
        }
        c.text(&name, lx0 + 36, y, &FONT_7X13, Alignment::Left, TEXT);
    }
    if series.len() > 40 {
        c.text(
            &format!("... and {} more", series.len() - 40),
            lx0,
            104 + 22 * 40,
            &FONT_7X13,
            Alignment::Left,
            TEXT,
        );
    }
    c
}

/// Plot `reports` into `out`.
pub fn plot_reports(
    reports: &[Report],
    out: &Path,
    title: Option<&str>,
    placement: Placement,
    coll: Option<&str>,
) -> Result<(), String> {
    let (series, common) = series_from(reports, placement, coll);
    if series.is_empty() {
        return Err(match coll {
            Some(c) => format!(
                "no rows of '{c}' to plot: check --coll against the JSON's collective names"
            ),
            None => "no rows to plot: the JSON files hold no measurements".into(),
        });
    }
    let title = match title {
        Some(t) => t.to_string(),
        None if common.is_empty() => "braid-perf".into(),
        None => format!("braid-perf: {common}"),
    };
    render(&series, &title).save_png(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tick_labels() {
        assert_eq!(fmt_bytes(8.0), "8");
        assert_eq!(fmt_bytes(1024.0), "1K");
        assert_eq!(fmt_bytes(65536.0), "64K");
        assert_eq!(fmt_bytes(64.0 * 1048576.0), "64M");
        assert_eq!(fmt_bytes(2.0 * 1073741824.0), "2G");
        assert_eq!(fmt_tick(0.01), "0.01");
        assert_eq!(fmt_tick(0.5), "0.5");
        assert_eq!(fmt_tick(1.0), "1");
        assert_eq!(fmt_tick(1000.0), "1000");
        assert_eq!(fmt_tick(1e6), "1e6");
        assert_eq!(fmt_tick(1e-4), "1e-4");
    }

    #[test]
    fn draws_a_png() {
        let s = vec![Series {
            name: "braid".into(),
            points: vec![
                (8.0, 0.001, 5.0),
                (1024.0, 0.2, 6.0),
                (1048576.0, 5.0, 200.0),
            ],
        }];
        let dir = std::env::temp_dir().join(format!("braid-perf-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.png");
        render(&s, "test").save_png(&p).unwrap();
        let b = std::fs::read(&p).unwrap();
        assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
