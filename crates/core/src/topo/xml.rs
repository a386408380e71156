//! NCCL topology XML (`NCCL_TOPO_FILE` / `NCCL_TOPO_DUMP_FILE`): a small
//! tolerant parser, import into [`System`] and export from it.
//!
//! The parser accepts what NCCL writes and what vendors ship: an optional
//! `<?xml ...?>` declaration, comments, single or double quotes, self-closing
//! or explicit end tags, and unknown elements (skipped) or attributes (kept).
//! Every error names the file and the line.

use super::model::{Attrs, C2c, Cpu, CpuSet, Gpu, Net, Nic, NvLink, Pci, System};
use super::TopoError;

/// A parsed XML element.
#[derive(Clone, Debug, PartialEq)]
pub struct Element {
    pub name: String,
    pub attrs: Vec<(String, String)>,
    pub children: Vec<Element>,
    /// 1-based line of the start tag.
    pub line: usize,
}

impl Element {
    fn attr(&self, k: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    }
}

struct Parser<'a> {
    file: &'a str,
    s: &'a [u8],
    pos: usize,
    line: usize,
}

impl<'a> Parser<'a> {
    fn err(&self, msg: impl Into<String>) -> TopoError {
        TopoError::Parse {
            file: self.file.to_string(),
            line: self.line,
            msg: msg.into(),
        }
    }
    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }
    fn bump(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.pos += 1;
        if c == b'\n' {
            self.line += 1;
        }
        Some(c)
    }
    fn starts(&self, p: &str) -> bool {
        self.s[self.pos..].starts_with(p.as_bytes())
    }
    fn skip_ws(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            self.bump();
        }
    }
    fn skip_until(&mut self, end: &str, what: &str) -> Result<(), TopoError> {
        let start = self.line;
        while !self.starts(end) {
            if self.bump().is_none() {
                self.line = start;
                return Err(self.err(format!("unterminated {what}")));
            }
        }
        for _ in 0..end.len() {
            self.bump();
        }
        Ok(())
    }
    /// Skip whitespace, text, comments, declarations and processing instructions.
    fn skip_misc(&mut self) -> Result<(), TopoError> {
        loop {
            self.skip_ws();
            if self.starts("<!--") {
                self.skip_until("-->", "comment")?;
            } else if self.starts("<?") {
                self.skip_until("?>", "<? ... ?> declaration")?;
            } else if self.starts("<!") {
                self.skip_until(">", "<! ... > declaration")?;
            } else if self.peek().is_some_and(|c| c != b'<') {
                // Character data: NCCL's format has none that matters.
                while self.peek().is_some_and(|c| c != b'<') {
                    self.bump();
                }
            } else {
                return Ok(());
            }
        }
    }
    fn name(&mut self) -> Result<String, TopoError> {
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.' | b':'))
        {
            self.bump();
        }
        if start == self.pos {
            return Err(match self.peek() {
                Some(c) => self.err(format!("expected a name, found '{}'", c as char)),
                None => self.err("expected a name, found end of file"),
            });
        }
        Ok(String::from_utf8_lossy(&self.s[start..self.pos]).into_owned())
    }
    fn element(&mut self, depth: usize) -> Result<Element, TopoError> {
        if depth > 64 {
            return Err(self.err("elements nested more than 64 deep"));
        }
        let line = self.line;
        if self.bump() != Some(b'<') {
            return Err(self.err("expected '<'"));
        }
        let name = self.name()?;
        let mut el = Element {
            name,
            attrs: Vec::new(),
            children: Vec::new(),
            line,
        };
        loop {
            self.skip_ws();
            match self.peek() {
                None => return Err(self.err(format!("end of file inside <{}>", el.name))),
                Some(b'/') => {
                    self.bump();
                    if self.bump() != Some(b'>') {
                        return Err(self.err(format!("expected '>' after '/' in <{}>", el.name)));
                    }
                    return Ok(el);
                }
                Some(b'>') => {
                    self.bump();
                    break;
                }
                Some(_) => {
                    let k = self.name()?;
                    self.skip_ws();
                    if self.bump() != Some(b'=') {
                        return Err(
                            self.err(format!("attribute '{k}' of <{}> has no '=' value", el.name))
                        );
                    }
                    self.skip_ws();
                    let q = match self.bump() {
                        Some(q @ (b'"' | b'\'')) => q,
                        _ => {
                            return Err(self.err(format!("value of attribute '{k}' must be quoted")))
                        }
                    };
                    let vline = self.line;
                    let start = self.pos;
                    while self.peek().is_some_and(|c| c != q) {
                        self.bump();
                    }
                    if self.peek().is_none() {
                        self.line = vline;
                        return Err(self.err(format!("unterminated value of attribute '{k}'")));
                    }
                    let raw = String::from_utf8_lossy(&self.s[start..self.pos]).into_owned();
                    self.bump();
                    if el.attrs.iter().any(|(n, _)| *n == k) {
                        return Err(self.err(format!("attribute '{k}' repeated in <{}>", el.name)));
                    }
                    el.attrs.push((k, unescape(&raw)));
                }
            }
        }
        // Content.
        loop {
            self.skip_misc()?;
            if self.peek().is_none() {
                self.line = line;
                return Err(self.err(format!("<{}> is never closed", el.name)));
            }
            if self.starts("</") {
                self.bump();
                self.bump();
                let end = self.name()?;
                if end != el.name {
                    return Err(self.err(format!(
                        "</{end}> closes <{}> (opened on line {line})",
                        el.name
                    )));
                }
                self.skip_ws();
                if self.bump() != Some(b'>') {
                    return Err(self.err(format!("expected '>' in </{end}>")));
                }
                return Ok(el);
            }
            el.children.push(self.element(depth + 1)?);
        }
    }
}

fn unescape(s: &str) -> String {
    if !s.contains('&') {
        return s.to_string();
    }
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Parse an XML document into its root element. `file` is only used in errors.
pub fn parse_document(file: &str, text: &str) -> Result<Element, TopoError> {
    let mut p = Parser {
        file,
        s: text.as_bytes(),
        pos: 0,
        line: 1,
    };
    p.skip_misc()?;
    if p.peek().is_none() {
        return Err(p.err("no XML element found (empty file?)"));
    }
    let root = p.element(0)?;
    p.skip_misc()?;
    if p.peek().is_some() {
        return Err(p.err("content after the root element"));
    }
    Ok(root)
}

struct Ctx<'a> {
    file: &'a str,
}

impl Ctx<'_> {
    fn err(&self, el: &Element, msg: impl Into<String>) -> TopoError {
        TopoError::Parse {
            file: self.file.to_string(),
            line: el.line,
            msg: msg.into(),
        }
    }
    fn int<T: std::str::FromStr>(&self, el: &Element, k: &str) -> Result<Option<T>, TopoError> {
        match el.attr(k) {
            None => Ok(None),
            Some(v) => {
                let v = v.trim();
                let parsed = if let Some(h) = v.strip_prefix("0x") {
                    u64::from_str_radix(h, 16)
                        .ok()
                        .and_then(|n| n.to_string().parse().ok())
                } else {
                    v.parse().ok()
                };
                parsed.map(Some).ok_or_else(|| {
                    self.err(
                        el,
                        format!("<{}> {k}=\"{v}\" is not a valid number", el.name),
                    )
                })
            }
        }
    }
    fn hex(&self, el: &Element, k: &str) -> Result<Option<u32>, TopoError> {
        match el.attr(k) {
            None => Ok(None),
            Some(v) => {
                let t = v.trim();
                let h = t.strip_prefix("0x").or(t.strip_prefix("0X")).unwrap_or(t);
                u32::from_str_radix(h, 16).map(Some).map_err(|_| {
                    self.err(el, format!("<{}> {k}=\"{v}\" is not a hex number", el.name))
                })
            }
        }
    }
    fn boolean(&self, el: &Element, k: &str) -> Result<Option<bool>, TopoError> {
        Ok(self.int::<u64>(el, k)?.map(|v| v != 0))
    }
}

fn extras(el: &Element, known: &[&str]) -> Attrs {
    el.attrs
        .iter()
        .filter(|(k, _)| !known.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

const SYSTEM_ATTRS: &[&str] = &["version", "name"];
const CPU_ATTRS: &[&str] = &[
    "numaid", "affinity", "arch", "vendor", "familyid", "modelid",
];
const PCI_ATTRS: &[&str] = &[
    "busid",
    "class",
    "vendor",
    "device",
    "subsystem_vendor",
    "subsystem_device",
    "link_speed",
    "link_width",
    "hostbridge",
];
const GPU_ATTRS: &[&str] = &["dev", "sm", "rank", "gdr"];
const NET_ATTRS: &[&str] = &[
    "name",
    "dev",
    "speed",
    "port",
    "latency",
    "guid",
    "maxconn",
    "gdr",
    "coll",
    "link_layer",
    "state",
    "rdma",
];

/// Parse NCCL topology XML text into a [`System`]. `file` names the source in errors.
pub fn from_xml(file: &str, text: &str) -> Result<System, TopoError> {
    let root = parse_document(file, text)?;
    let cx = Ctx { file };
    if root.name != "system" {
        return Err(cx.err(
            &root,
            format!("root element is <{}>, expected <system>", root.name),
        ));
    }
    if let Some(v) = root.attr("version") {
        if v.trim() != "1" {
            return Err(cx.err(
                &root,
                format!(
                    "<system version=\"{v}\"> is not supported (NCCL topology XML version 1 only)"
                ),
            ));
        }
    }
    let mut sys = System {
        name: root.attr("name").map(str::to_string),
        cpus: Vec::new(),
        attrs: extras(&root, SYSTEM_ATTRS),
    };
    for c in &root.children {
        if c.name == "cpu" {
            sys.cpus.push(cpu(&cx, c)?);
        }
    }
    Ok(sys)
}

fn cpu(cx: &Ctx, el: &Element) -> Result<Cpu, TopoError> {
    let affinity = match el.attr("affinity") {
        None => None,
        Some(m) => Some(CpuSet::from_mask(m).ok_or_else(|| {
            cx.err(
                el,
                format!("<cpu> affinity=\"{m}\" is not a cpumask (hex groups separated by commas)"),
            )
        })?),
    };
    let mut c = Cpu {
        numaid: cx.int::<i32>(el, "numaid")?.unwrap_or(-1),
        affinity,
        arch: el.attr("arch").map(str::to_string),
        vendor: el.attr("vendor").map(str::to_string),
        familyid: cx.int(el, "familyid")?,
        modelid: cx.int(el, "modelid")?,
        pci: Vec::new(),
        nics: Vec::new(),
        attrs: extras(el, CPU_ATTRS),
    };
    for ch in &el.children {
        match ch.name.as_str() {
            "pci" => c.pci.push(pci(cx, ch)?),
            "nic" => c.nics.push(nic(cx, ch)?),
            _ => {}
        }
    }
    Ok(c)
}

fn pci(cx: &Ctx, el: &Element) -> Result<Pci, TopoError> {
    let busid = el
        .attr("busid")
        .ok_or_else(|| cx.err(el, "<pci> without a busid attribute"))?
        .trim()
        .to_ascii_lowercase();
    let mut p = Pci {
        busid,
        class: cx.hex(el, "class")?,
        vendor: el.attr("vendor").map(str::to_string),
        device: el.attr("device").map(str::to_string),
        subsystem_vendor: el.attr("subsystem_vendor").map(str::to_string),
        subsystem_device: el.attr("subsystem_device").map(str::to_string),
        link_speed: el.attr("link_speed").map(str::to_string),
        link_width: cx.int(el, "link_width")?,
        hostbridge: el.attr("hostbridge").map(str::to_string),
        children: Vec::new(),
        gpu: None,
        extra_gpus: Vec::new(),
        nic: None,
        attrs: extras(el, PCI_ATTRS),
    };
    for ch in &el.children {
        match ch.name.as_str() {
            "pci" => p.children.push(pci(cx, ch)?),
            // Several <gpu> in one <pci>: NCCL's layout for several ranks
            // on one GPU. One physical GPU; the others are kept for export.
            "gpu" => match p.gpu {
                None => p.gpu = Some(gpu(cx, ch)?),
                Some(_) => p.extra_gpus.push(gpu(cx, ch)?),
            },
            "nic" => {
                let n = nic(cx, ch)?;
                match &mut p.nic {
                    Some(existing) => existing.nets.extend(n.nets),
                    None => p.nic = Some(n),
                }
            }
            _ => {}
        }
    }
    Ok(p)
}

fn gpu(cx: &Ctx, el: &Element) -> Result<Gpu, TopoError> {
    let mut g = Gpu {
        dev: cx.int(el, "dev")?,
        sm: cx.int(el, "sm")?,
        rank: cx.int(el, "rank")?,
        gdr: cx.boolean(el, "gdr")?,
        nvlinks: Vec::new(),
        c2c: Vec::new(),
        attrs: extras(el, GPU_ATTRS),
    };
    for ch in &el.children {
        if ch.name == "c2c" {
            g.c2c.push(C2c {
                bw: cx.int(ch, "bw")?.unwrap_or(0),
                count: cx.int(ch, "count")?.unwrap_or(1),
                attrs: extras(ch, &["bw", "count"]),
            });
        }
        if ch.name == "nvlink" {
            let target = ch
                .attr("target")
                .ok_or_else(|| cx.err(ch, "<nvlink> without a target attribute"))?
                .trim()
                .to_ascii_lowercase();
            g.nvlinks.push(NvLink {
                target,
                count: cx.int(ch, "count")?.unwrap_or(1),
                tclass: cx.hex(ch, "tclass")?,
            });
        }
    }
    Ok(g)
}

fn nic(cx: &Ctx, el: &Element) -> Result<Nic, TopoError> {
    let mut n = Nic {
        nets: Vec::new(),
        attrs: extras(el, &[]),
    };
    for ch in &el.children {
        if ch.name == "net" {
            let name = ch
                .attr("name")
                .ok_or_else(|| cx.err(ch, "<net> without a name attribute"))?
                .to_string();
            n.nets.push(Net {
                name,
                dev: cx.int(ch, "dev")?,
                speed: cx.int(ch, "speed")?,
                port: cx.int(ch, "port")?,
                latency: ch.attr("latency").map(str::to_string),
                guid: ch.attr("guid").map(str::to_string),
                maxconn: cx.int(ch, "maxconn")?,
                gdr: cx.boolean(ch, "gdr")?,
                coll: cx.boolean(ch, "coll")?,
                link_layer: ch.attr("link_layer").map(str::to_string),
                state: ch.attr("state").map(str::to_string),
                rdma: cx.boolean(ch, "rdma")?,
                attrs: extras(ch, NET_ATTRS),
            });
        }
    }
    Ok(n)
}

/// Write a [`System`] as NCCL topology XML (version 1).
pub fn to_xml(sys: &System) -> String {
    let mut w = Writer { out: String::new() };
    let mut a: Vec<(&str, String)> = vec![("version", "1".into())];
    push(&mut a, "name", sys.name.clone());
    w.open(0, "system", &a, &sys.attrs, false);
    for c in &sys.cpus {
        let mut a: Vec<(&str, String)> = vec![("numaid", c.numaid.to_string())];
        push(&mut a, "affinity", c.affinity.as_ref().map(|s| s.to_mask()));
        push(&mut a, "arch", c.arch.clone());
        push(&mut a, "vendor", c.vendor.clone());
        push(&mut a, "familyid", c.familyid);
        push(&mut a, "modelid", c.modelid);
        let empty = c.pci.is_empty() && c.nics.is_empty();
        w.open(1, "cpu", &a, &c.attrs, empty);
        for p in &c.pci {
            write_pci(&mut w, 2, p);
        }
        for n in &c.nics {
            write_nic(&mut w, 2, n);
        }
        if !empty {
            w.close(1, "cpu");
        }
    }
    w.close(0, "system");
    w.out
}

fn push<T: ToString>(a: &mut Vec<(&'static str, String)>, k: &'static str, v: Option<T>) {
    if let Some(v) = v {
        a.push((k, v.to_string()));
    }
}

fn write_pci(w: &mut Writer, d: usize, p: &Pci) {
    let mut a: Vec<(&str, String)> = vec![("busid", p.busid.clone())];
    push(&mut a, "class", p.class.map(|c| format!("0x{c:06x}")));
    push(&mut a, "vendor", p.vendor.clone());
    push(&mut a, "device", p.device.clone());
    push(&mut a, "subsystem_vendor", p.subsystem_vendor.clone());
    push(&mut a, "subsystem_device", p.subsystem_device.clone());
    push(&mut a, "link_speed", p.link_speed.clone());
    push(&mut a, "link_width", p.link_width);
    push(&mut a, "hostbridge", p.hostbridge.clone());
    let empty = p.children.is_empty() && p.gpu.is_none() && p.nic.is_none();
    debug_assert!(p.gpu.is_some() || p.extra_gpus.is_empty());
    w.open(d, "pci", &a, &p.attrs, empty);
    if empty {
        return;
    }
    for g in p.all_gpus() {
        write_gpu(w, d + 1, g, None);
    }
    if let Some(n) = &p.nic {
        write_nic(w, d + 1, n);
    }
    for c in &p.children {
        write_pci(w, d + 1, c);
    }
    w.close(d, "pci");
}

fn write_gpu(w: &mut Writer, d: usize, g: &Gpu, busid: Option<&str>) {
    let mut a: Vec<(&str, String)> = Vec::new();
    push(&mut a, "busid", busid);
    push(&mut a, "dev", g.dev);
    push(&mut a, "sm", g.sm);
    push(&mut a, "rank", g.rank);
    push(&mut a, "gdr", g.gdr.map(u8::from));
    let empty = g.nvlinks.is_empty() && g.c2c.is_empty();
    w.open(d, "gpu", &a, &g.attrs, empty);
    if !empty {
        for l in &g.nvlinks {
            let mut a: Vec<(&str, String)> =
                vec![("target", l.target.clone()), ("count", l.count.to_string())];
            push(&mut a, "tclass", l.tclass.map(|c| format!("0x{c:06x}")));
            w.open(d + 1, "nvlink", &a, &Attrs::new(), true);
        }
        for c in &g.c2c {
            let a: Vec<(&str, String)> =
                vec![("bw", c.bw.to_string()), ("count", c.count.to_string())];
            w.open(d + 1, "c2c", &a, &c.attrs, true);
        }
        w.close(d, "gpu");
    }
}

/// Write GPUs as `<gpus><gpu busid=...>...</gpu></gpus>` (recorded NVML answers).
pub fn gpus_to_xml(gpus: &[(String, Gpu)]) -> String {
    let mut w = Writer { out: String::new() };
    w.open(0, "gpus", &[], &Attrs::new(), gpus.is_empty());
    if !gpus.is_empty() {
        for (b, g) in gpus {
            write_gpu(&mut w, 1, g, Some(b));
        }
        w.close(0, "gpus");
    }
    w.out
}

/// Import one `<gpu>` element (its `nvlink` children included).
pub(crate) fn element_to_gpu(file: &str, el: &Element) -> Result<Gpu, TopoError> {
    gpu(&Ctx { file }, el)
}

fn write_nic(w: &mut Writer, d: usize, n: &Nic) {
    w.open(d, "nic", &[], &n.attrs, n.nets.is_empty());
    if n.nets.is_empty() {
        return;
    }
    for net in &n.nets {
        let mut a: Vec<(&str, String)> = vec![("name", net.name.clone())];
        push(&mut a, "dev", net.dev);
        push(&mut a, "speed", net.speed);
        push(&mut a, "port", net.port);
        push(&mut a, "latency", net.latency.clone());
        push(&mut a, "guid", net.guid.clone());
        push(&mut a, "maxconn", net.maxconn);
        push(&mut a, "gdr", net.gdr.map(u8::from));
        push(&mut a, "coll", net.coll.map(u8::from));
        push(&mut a, "link_layer", net.link_layer.clone());
        push(&mut a, "state", net.state.clone());
        push(&mut a, "rdma", net.rdma.map(u8::from));
        w.open(d + 1, "net", &a, &net.attrs, true);
    }
    w.close(d, "nic");
}

struct Writer {
    out: String,
}

impl Writer {
    fn open(&mut self, d: usize, name: &str, a: &[(&str, String)], extra: &Attrs, empty: bool) {
        self.out.push_str(&"  ".repeat(d));
        self.out.push('<');
        self.out.push_str(name);
        let extra = extra.iter().map(|(k, v)| (k.as_str(), v));
        for (k, v) in a.iter().map(|(k, v)| (*k, v)).chain(extra) {
            self.out.push_str(&format!(" {k}=\"{}\"", escape(v)));
        }
        self.out.push_str(if empty { "/>\n" } else { ">\n" });
    }
    fn close(&mut self, d: usize, name: &str) {
        self.out.push_str(&"  ".repeat(d));
        self.out.push_str(&format!("</{name}>\n"));
    }
}
