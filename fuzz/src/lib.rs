//! The bodies of braid's fuzz targets (one function per target in
//! `fuzz_targets/`) and the seed corpus, made by the real encoders.
//!
//! Each target feeds arbitrary bytes to one of braid's decoders of what
//! arrives from a peer, a launcher or a file, and checks cheap invariants
//! besides "does not panic": a decoded value encodes back to the same
//! bytes, lengths stay within their documented bounds, and two decoders of
//! the same format agree. A failed check panics, which libFuzzer reports as
//! a crash.
//!
//! The functions also run without libFuzzer: `tests/corpus.rs` replays the
//! committed corpus through them with plain `cargo test`.

use std::net::SocketAddr;

use braid::internals::bootstrap as bs;
use braid::internals::fingerprint::{self, OpHeader};
use braid::UniqueId;
use braid_core::topo::{json, xml, System, Topology};
use braid_transport_shm::fuzzing as shm;
use braid_transport_socket::fuzzing as sock;

/// Names of all targets, in the order `scripts/fuzz.sh` runs them.
pub const TARGETS: [&str; 12] = [
    "unique_id",
    "bootstrap_frames",
    "bootstrap_root",
    "bootstrap_client",
    "rendezvous_payloads",
    "op_header",
    "shm_info",
    "socket_info",
    "socket_link",
    "topo_xml",
    "topo_json",
    "slurm_hostlist",
];

/// Runs target `name` on `data` (for replaying a corpus without libFuzzer).
pub fn run(name: &str, data: &[u8]) {
    match name {
        "unique_id" => unique_id(data),
        "bootstrap_frames" => bootstrap_frames(data),
        "bootstrap_root" => bootstrap_root(data),
        "bootstrap_client" => bootstrap_client(data),
        "rendezvous_payloads" => rendezvous_payloads(data),
        "op_header" => op_header(data),
        "shm_info" => shm_info(data),
        "socket_info" => socket_info(data),
        "socket_link" => socket_link(data),
        "topo_xml" => topo_xml(data),
        "topo_json" => topo_json(data),
        "slurm_hostlist" => slurm_hostlist(data),
        _ => panic!("no fuzz target {name}"),
    }
}

/// The secret and nonces the bootstrap targets use, so that seeds can
/// carry valid proofs for the fuzzer to mutate.
pub const SECRET: [u8; 16] = *b"braid-fuzz-01234";
/// The root's nonce of the bootstrap targets.
pub const ROOT_NONCE: [u8; 32] = [0x11; 32];
/// The client's nonce of the bootstrap targets.
pub const CLIENT_NONCE: [u8; 32] = [0x22; 32];

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A frame as the bootstrap writes it: little-endian length, kind, body.
fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    bs::frame(kind, body)
}

const K_HELLO: u8 = 2;
const K_ERROR: u8 = 4;
const K_CONTRIB: u8 = 6;

// ---------------------------------------------------------------- targets

/// `UniqueId` text (`BRAID_UNIQUE_ID`): parse, print, parse again.
pub fn unique_id(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    match s.parse::<UniqueId>() {
        Ok(id) => {
            let text = id.to_string();
            let again: UniqueId = text.parse().expect("a printed id parses");
            assert_eq!(again, id);
            assert!(text.ends_with(&to_hex(&id.secret)));
            assert!(
                !format!("{id:?}").contains(&to_hex(&id.secret)),
                "Debug leaks the secret"
            );
        }
        Err(e) => {
            assert!(matches!(e, braid::Error::InvalidArgument(_)), "{e:?}");
            assert!(e.to_string().contains("<ip>:<port>/<32 hex digits>"));
        }
    }
}

/// Bootstrap framing: the root's frame cutter (bytes arriving in pieces
/// whose sizes come from the first bytes) and the client's frame reader
/// must cut the same frames and refuse the same lengths.
pub fn bootstrap_frames(data: &[u8]) {
    let (&n, rest) = data.split_first().unwrap_or((&0, &[]));
    let npieces = (n % 4) as usize;
    let (sizes, stream) = rest.split_at(npieces.min(rest.len()));
    let pieces: Vec<usize> = sizes.iter().map(|&b| b as usize * 3 + 1).collect();
    let (rf, re) = bs::root_frames(stream, &pieces);
    let (cf, ce) = bs::client_frames(stream);
    assert_eq!(rf, cf, "root and client cut different frames");
    let mut consumed = 0;
    for (kind, body) in &rf {
        assert!(body.len() < bs::MAX_FRAME);
        let f = frame(*kind, body);
        assert_eq!(f, stream[consumed..consumed + f.len()]);
        consumed += f.len();
    }
    match (&re, &ce) {
        (Some(r), Some(c)) => {
            assert!(c.starts_with("length "), "root: {r}; client: {c}");
            assert!(
                r.contains("empty frame") || r.contains("exceeds the limit"),
                "{r}"
            );
        }
        (None, Some(c)) => {
            // Only a truncated last frame: the root waits for more.
            assert_eq!(c, "UnexpectedEof");
            assert!(consumed < stream.len());
        }
        (None, None) => assert_eq!(consumed, stream.len()),
        (Some(r), None) => panic!("root refused ({r}) what the client accepted"),
    }
}

/// The root's decoders of what a connecting stranger sends: the early
/// check of a hello's first bytes (before the proof, on every prefix), the
/// complete hello, and a contribution.
pub fn bootstrap_root(data: &[u8]) {
    let (&mode, stream) = data.split_first().unwrap_or((&0, &[]));
    if mode & 1 == 1 {
        // A contribution body.
        match bs::parse_contrib(stream) {
            Some((round, d)) => {
                assert_eq!(
                    bs::contrib_frame(round, &d),
                    frame(K_CONTRIB, stream),
                    "contribution does not re-encode"
                );
            }
            None => assert!(stream.len() < 8),
        }
        return;
    }
    // The early check must be monotone: undecided, then one final verdict
    // that more bytes never change.
    let mut verdict: Option<Result<bs::Hello, String>> = None;
    for k in 0..=stream.len().min(bs::HELLO_PREFIX) {
        let r = bs::hello_prefix(&stream[..k]);
        match (&verdict, r) {
            (None, Ok(None)) => {}
            (None, Ok(Some(h))) => verdict = Some(Ok(h)),
            (None, Err(e)) => verdict = Some(Err(e)),
            (Some(v), r) => {
                let r = r.map(|h| h.expect("decided, then undecided"));
                assert_eq!(v, &r, "verdict changed at {k} bytes");
            }
        }
    }
    if stream.len() >= bs::HELLO_PREFIX {
        assert!(
            verdict.is_some(),
            "undecided after {} bytes",
            bs::HELLO_PREFIX
        );
    }
    // The complete first frame (if all of it is there) gets the same verdict.
    let (frames, _) = bs::client_frames(stream);
    if let Some((kind, body)) = frames.first() {
        let full = bs::parse_hello(*kind, body);
        match (&verdict, &full) {
            (Some(Ok(h)), Ok((fh, payload))) => {
                assert_eq!(h, fh);
                let mut enc = bs::encode_hello(fh);
                enc.extend_from_slice(payload);
                assert_eq!(&enc, body, "hello does not re-encode");
                let proves = bs::hello_proves(fh, &SECRET, &ROOT_NONCE);
                if proves {
                    let valid = bs::hello_frame(&SECRET, &ROOT_NONCE, &fh.2, fh.0, fh.1, payload);
                    assert_eq!(valid, frame(K_HELLO, body));
                }
            }
            (Some(Err(e)), Err(f)) => assert_eq!(e, f),
            (v, f) => panic!("early check {v:?}, complete hello {f:?}"),
        }
    }
}

/// The client's decoders of what a root sends, in the order of a join: a
/// challenge, an accept (or error), then the data frames of round 0 for
/// `nranks` ranks (from the first byte).
pub fn bootstrap_client(data: &[u8]) {
    let (&n, stream) = data.split_first().unwrap_or((&0, &[]));
    let nranks = u32::from(n % 4) + 1;
    let rank = u32::from(n / 4) % nranks;
    let (frames, _) = bs::client_frames(stream);
    let mut it = frames.iter();
    let Some((kind, body)) = it.next() else {
        return;
    };
    let rnonce = match bs::parse_challenge(*kind, body) {
        Ok(nonce) => {
            assert_eq!(bs::challenge_frame(&nonce), frame(*kind, body));
            nonce
        }
        Err(_) => return,
    };
    let Some((kind, body)) = it.next() else {
        return;
    };
    if *kind == K_ERROR {
        let _ = String::from_utf8_lossy(body);
        return;
    }
    if !bs::accept_proves(*kind, body, &SECRET, &CLIENT_NONCE, &rnonce, rank) {
        return;
    }
    assert_eq!(
        bs::accept_frame(&SECRET, &CLIENT_NONCE, &rnonce, rank),
        frame(*kind, body)
    );
    for want in 0..nranks {
        let Some((kind, body)) = it.next() else {
            return;
        };
        match bs::parse_data(*kind, body, 0, want) {
            Ok(d) => assert_eq!(bs::data_frame(0, want, &d), frame(*kind, body)),
            Err(_) => return,
        }
    }
}

/// The rendezvous payloads every rank decodes from every other: the peer
/// description and the connect-info blobs.
pub fn rendezvous_payloads(data: &[u8]) {
    let [a, b, rest @ ..] = data else {
        return;
    };
    let from = u32::from(*a);
    if let Ok((rank, pid, host, fabrics)) = braid::internals::rendezvous::decode_peer(rest, from) {
        assert_eq!(rank, from);
        assert_eq!(
            braid::internals::rendezvous::encode_peer(rank, pid, &host, &fabrics),
            rest
        );
    }
    let p = usize::from(*b % 9);
    if let Ok(blobs) = braid::internals::rendezvous::decode_blobs(rest, p, from) {
        assert_eq!(blobs.len(), p);
        let enc = braid::internals::rendezvous::encode_blobs(&blobs);
        assert_eq!(enc, rest[..enc.len()]);
    }
}

fn op_header_from(b: &[u8; 23]) -> OpHeader {
    OpHeader {
        kind: b[0],
        dtype: b[1],
        op: b[2],
        root: u32::from_le_bytes([b[3], b[4], b[5], b[6]]),
        count: u64::from_le_bytes(b[7..15].try_into().unwrap()),
        seq: u64::from_le_bytes(b[15..23].try_into().unwrap()),
    }
}

/// The 64-byte operation header every link carries ahead of its data.
pub fn op_header(data: &[u8]) {
    match OpHeader::decode(data) {
        Ok(h) => {
            assert_eq!(data.len(), fingerprint::HEADER_BYTES);
            let enc = h.encode();
            assert_eq!(OpHeader::decode(&enc), Ok(h));
            for r in [0..7, 8..12, 16..32] {
                assert_eq!(enc[r.clone()], data[r]);
            }
            assert_eq!(fingerprint::check(1, 0, data, &h), Ok(()));
            let _ = h.describe();
        }
        Err(e) => assert!(e.contains("bytes of data"), "{e}"),
    }
    // Two headers from the input: the check passes exactly when they agree,
    // and otherwise names both calls.
    if let Some(b) = data.get(..46) {
        let x = op_header_from(b[..23].try_into().unwrap());
        let y = op_header_from(b[23..46].try_into().unwrap());
        match fingerprint::check(3, 4, &x.encode(), &y) {
            Ok(()) => assert_eq!(x, y),
            Err(e) => {
                assert_ne!(x, y);
                assert!(
                    e.contains(&x.describe()) && e.contains(&y.describe()),
                    "{e}"
                );
            }
        }
    }
}

/// The shared-memory transport's connect-info blobs.
pub fn shm_info(data: &[u8]) {
    let (&mode, b) = data.split_first().unwrap_or((&0, &[]));
    if mode & 1 == 0 {
        if let Ok(r) = shm::decode_recv(b) {
            assert_eq!(shm::encode_recv(&r), b, "receiver blob does not re-encode");
            assert!(shm::valid_name(&r.name) && r.name.len() <= shm::MAX_NAME);
            assert!(r.segment_bytes <= i64::MAX as usize);
            assert!(r.segment_bytes >= r.slots as usize * r.slot_bytes as usize);
        }
    } else if let Ok((pid, from, to)) = shm::decode_send(b) {
        assert_eq!(
            shm::encode_send(pid, from, to),
            b,
            "sender blob does not re-encode"
        );
        assert!(pid != 0 && pid <= i32::MAX as u32);
    }
}

fn socket_blobs() -> (sock::RecvInfo, sock::SendInfo) {
    (
        sock::RecvInfo {
            from: 1,
            to: 2,
            addr: "127.0.0.1:4000".parse().unwrap(),
            token: [7; 16],
            slot_bytes: 4096,
            slots: 4,
            nsocks: 2,
        },
        sock::SendInfo {
            from: 1,
            to: 2,
            nonce: [8; 16],
        },
    )
}

/// The socket transport's connect-info blobs, socket hellos, data-frame
/// headers and control-frame headers.
pub fn socket_info(data: &[u8]) {
    let (&mode, b) = data.split_first().unwrap_or((&0, &[]));
    match mode % 5 {
        0 => {
            if let Ok(r) = sock::RecvInfo::decode(b) {
                assert_eq!(r.encode(), b, "receiver blob does not re-encode");
                assert_eq!(
                    sock::check_geometry(r.slot_bytes, r.slots, r.nsocks),
                    Ok(())
                );
                assert!(r.addr.port() != 0 && !r.addr.ip().is_unspecified());
            }
        }
        1 => {
            if let Ok(s) = sock::SendInfo::decode(b) {
                assert_eq!(s.encode(), b, "sender blob does not re-encode");
            }
        }
        2 => {
            let Some(buf) = b.get(..sock::Hello::LEN) else {
                return;
            };
            let buf: &[u8; sock::Hello::LEN] = buf.try_into().unwrap();
            let Ok(h) = sock::Hello::decode(buf) else {
                return;
            };
            assert_eq!(&h.encode(), buf);
            let (ri, si) = socket_blobs();
            // The bytes after the hello say which sockets arrived already.
            let extra = &b[sock::Hello::LEN..];
            let bit = |i: usize| extra.get(i).is_some_and(|x| x & 1 == 1);
            let seen: Vec<bool> = (0..ri.nsocks).map(bit).collect();
            let have_ctrl = bit(ri.nsocks);
            if let Ok((kind, idx)) = sock::check_hello(buf, &ri, &si, &seen, have_ctrl) {
                assert_eq!(
                    (h.token, h.nonce, h.from, h.to),
                    (ri.token, si.nonce, si.from, si.to)
                );
                assert_eq!(kind, h.kind);
                if kind == sock::KIND_CTRL {
                    assert!(!have_ctrl && idx == 0);
                } else {
                    assert!(idx < ri.nsocks && !seen[idx]);
                }
            }
        }
        3 => {
            let Some(buf) = b.get(..sock::FrameHeader::LEN) else {
                return;
            };
            let buf: &[u8; sock::FrameHeader::LEN] = buf.try_into().unwrap();
            if let Some(h) = sock::FrameHeader::decode(buf) {
                assert_eq!(&h.encode(), buf);
            }
        }
        _ => {
            let Some(buf) = b.get(..sock::CTRL_LEN) else {
                return;
            };
            let buf: &[u8; sock::CTRL_LEN] = buf.try_into().unwrap();
            if let Ok((kind, len, value)) = sock::ctrl_decode(buf) {
                assert!(len <= sock::MAX_REASON);
                if kind == sock::CtrlKind::Credit {
                    assert_eq!(len, 0);
                }
                let enc = sock::ctrl_frame(kind, value, &vec![0; len]);
                assert_eq!(enc.len(), sock::CTRL_LEN + len);
                assert_eq!(enc[0], buf[0]);
                assert_eq!(enc[4..sock::CTRL_LEN], buf[4..]);
            }
        }
    }
}

// The largest is enough for two stripes of 64 KiB.
const SLOT_SIZES: [usize; 4] = [64, 4096, 8192, 128 << 10];

/// The socket transport's stream readers: data sockets (frame headers,
/// striping, credits) and the control socket.
pub fn socket_link(data: &[u8]) {
    let [mode, geo, rest @ ..] = data else {
        return;
    };
    let slot_bytes = SLOT_SIZES[usize::from(geo & 3)];
    let slots = usize::from((geo >> 2) & 3) + 1;
    let nsocks = usize::from((geo >> 4) & 3) + 1;
    match mode % 3 {
        // Raw bytes on `nsocks` data sockets (the input cut in equal parts).
        0 => {
            let part = rest.len().div_ceil(nsocks).max(1);
            let mut streams: Vec<&[u8]> = rest.chunks(part).collect();
            streams.resize(nsocks, &[]);
            let (msgs, _) =
                sock::data_streams(&streams, slot_bytes, slots).expect("valid geometry");
            let mut seqs: Vec<u64> = msgs.iter().map(|m| m.0).collect();
            seqs.sort_unstable();
            seqs.dedup();
            assert_eq!(seqs.len(), msgs.len(), "a message published twice");
            for (seq, m) in &msgs {
                assert!(*seq < slots as u64, "message {seq} beyond the credits");
                assert!(m.len() <= slot_bytes);
            }
        }
        // Messages encoded as a sender stripes them: all arrive intact.
        1 => {
            let sizes: Vec<usize> = rest
                .chunks(2)
                .take(slots)
                .map(|c| {
                    let v = usize::from(c[0]) | usize::from(*c.get(1).unwrap_or(&0)) << 8;
                    (v * 97) % (slot_bytes + 1)
                })
                .collect();
            let msgs: Vec<Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| (0..n).map(|j| (j * 31 + i * 7) as u8).collect())
                .collect();
            let streams = encode_socket_messages(&msgs, nsocks);
            let streams: Vec<&[u8]> = streams.iter().map(Vec::as_slice).collect();
            let (got, err) =
                sock::data_streams(&streams, slot_bytes, slots).expect("valid geometry");
            let mut got = got;
            got.sort_by_key(|m| m.0);
            let want: Vec<(u64, Vec<u8>)> = msgs
                .into_iter()
                .enumerate()
                .map(|(i, m)| (i as u64, m))
                .collect();
            assert_eq!(got, want, "striped messages did not arrive intact");
            let err = err.expect("end of stream is reported");
            assert!(err.contains("was closed"), "{err}");
        }
        // A control socket, as a sender's (credits checked) or a receiver's.
        _ => {
            let committed = (geo & 0x80 != 0).then_some(u64::from(geo & 0x7f));
            let (credits, closed, err) = sock::ctrl_stream(rest, committed);
            match committed {
                None => assert!(credits.is_empty()),
                Some(c) => {
                    assert!(credits.windows(2).all(|w| w[0] <= w[1]));
                    assert!(credits.iter().all(|&v| v <= c));
                }
            }
            // A stream ends with a failure, or (at a receiver) a normal close.
            assert!(
                err.is_some() || (closed && committed.is_none()),
                "a control stream ended unreported"
            );
        }
    }
}

/// The data-socket byte streams of `msgs` (messages 0, 1, ...) as a
/// sender writes them: each message cut into stripes, each stripe a frame
/// header and its bytes on its socket.
pub fn encode_socket_messages(msgs: &[Vec<u8>], nsocks: usize) -> Vec<Vec<u8>> {
    let mut streams = vec![Vec::new(); nsocks];
    for (seq, m) in msgs.iter().enumerate() {
        let seq = seq as u64;
        for (s, off, len) in sock::stripes(seq, m.len(), nsocks) {
            let h = sock::FrameHeader {
                seq,
                total: m.len() as u32,
                offset: off as u32,
                len: len as u32,
                direct: false,
            };
            streams[s].extend_from_slice(&h.encode());
            streams[s].extend_from_slice(&m[off..off + len]);
        }
    }
    streams
}

fn check_topology(sys: &System) {
    let topo = Topology::new(sys.clone());
    let _ = json::to_json(&topo);
}

/// NCCL topology XML import; what imports exports and re-imports equal.
pub fn topo_xml(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match xml::from_xml("fuzz.xml", text) {
        Ok(sys) => {
            let out = xml::to_xml(&sys);
            let again = xml::from_xml("export.xml", &out)
                .unwrap_or_else(|e| panic!("export does not re-import: {e}\n{out}"));
            assert_eq!(again, sys, "export changed the model:\n{out}");
            check_topology(&sys);
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.starts_with("fuzz.xml:"), "{msg}");
        }
    }
}

/// braid JSON topology import; what imports serialises and re-imports equal.
pub fn topo_json(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(sys) = json::from_json("fuzz.json", text) {
        let out = serde_json::to_string(&sys).expect("a model serialises");
        let again = json::from_json("export.json", &out).expect("serialised model re-imports");
        assert_eq!(again, sys);
        let _ = xml::to_xml(&sys);
        check_topology(&sys);
    }
}

/// Slurm host lists (`SLURM_JOB_NODELIST`): expansion and its first host.
pub fn slurm_hostlist(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let all = braid::internals::parse_hostlist(s);
    let first = braid::internals::first_host(s);
    match &all {
        Ok(v) => {
            assert!(!v.is_empty() && v.len() <= 1 << 20);
            assert_eq!(first.as_ref().ok(), v.first(), "first_host disagrees");
        }
        Err(e) => assert!(matches!(e, braid::Error::Env(_)), "{e:?}"),
    }
    if let Err(e) = &first {
        assert!(matches!(e, braid::Error::Env(_)), "{e:?}");
    }
}

// ------------------------------------------------------------------ seeds

/// One seed: its file name and bytes.
pub type Seed = (String, Vec<u8>);

/// The seed corpus: for every target, named inputs made by braid's own
/// encoders (`tests/corpus.rs` writes and checks `corpus/<target>/`).
pub fn seeds() -> Vec<(&'static str, Vec<Seed>)> {
    let named = |v: Vec<Vec<u8>>| -> Vec<Seed> {
        v.into_iter()
            .enumerate()
            .map(|(i, b)| (format!("seed-{i:02}"), b))
            .collect()
    };
    let with = |m: u8, b: Vec<u8>| [vec![m], b].concat();

    let ids: Vec<Vec<u8>> = [
        UniqueId {
            addr: "127.0.0.1:29500".parse::<SocketAddr>().unwrap(),
            secret: SECRET,
        },
        UniqueId {
            addr: "[::1]:4000".parse::<SocketAddr>().unwrap(),
            secret: [0xab; 16],
        },
    ]
    .iter()
    .map(|id| id.to_string().into_bytes())
    .collect();

    let hello = bs::hello_frame(&SECRET, &ROOT_NONCE, &CLIENT_NONCE, 1, 4, b"payload");
    let session = [
        bs::challenge_frame(&ROOT_NONCE),
        bs::accept_frame(&SECRET, &CLIENT_NONCE, &ROOT_NONCE, 0),
        bs::data_frame(0, 0, b"rank0"),
        bs::data_frame(0, 1, b""),
    ]
    .concat();
    let frames = [
        bs::challenge_frame(&ROOT_NONCE),
        hello.clone(),
        bs::contrib_frame(3, b"contribution"),
        bs::error_frame("rank 2 left the bootstrap"),
    ]
    .concat();

    let peer = braid::internals::rendezvous::encode_peer(2, 4242, "host-a", &[]);
    let blobs = braid::internals::rendezvous::encode_blobs(&[
        (b"recv".to_vec(), b"send".to_vec()),
        (Vec::new(), b"x".to_vec()),
    ]);

    let op = OpHeader {
        kind: 1,
        dtype: 7,
        op: 0,
        root: u32::MAX,
        count: 1024,
        seq: 7,
    }
    .encode();

    let shm_recv = shm::encode_recv(&shm::RecvBlob {
        pid: 42,
        from: 3,
        to: 5,
        slots: 8,
        slot_bytes: 512 << 10,
        nonce: 0xdead_beef,
        name: "/braid-42-0123456789abcdef-3-5".into(),
        segment_bytes: 0,
    });
    let shm_send = shm::encode_send(7, 3, 5);

    let (ri, si) = socket_blobs();
    let mut ri6 = ri.clone();
    ri6.addr = "[fe80::1%3]:80".parse().unwrap();
    let sock_hello = sock::Hello {
        kind: sock::KIND_DATA,
        index: 1,
        from: 1,
        to: 2,
        token: ri.token,
        nonce: si.nonce,
    }
    .encode();
    let fh = sock::FrameHeader {
        seq: 5,
        total: 4096,
        offset: 0,
        len: 4096,
        direct: false,
    }
    .encode();
    let ctrl = sock::ctrl_frame(sock::CtrlKind::Abort, 0, b"why");

    let msgs = vec![b"hello".to_vec(), vec![9u8; 100]];
    let one = encode_socket_messages(&msgs, 1).concat();
    let ctrl_stream = [
        sock::ctrl_frame(sock::CtrlKind::Credit, 1, &[]),
        sock::ctrl_frame(sock::CtrlKind::Credit, 2, &[]),
        sock::ctrl_frame(sock::CtrlKind::Close, 0, b""),
    ]
    .concat();

    let xml_text = r#"<?xml version="1.0"?>
<system version="1">
  <cpu numaid="0" affinity="0000ffff" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="85">
    <pci busid="0000:17:00.0" class="0x060400" link_speed="16.0 GT/s PCIe" link_width="16">
      <pci busid="0000:18:00.0" class="0x030200" vendor="0x10de" device="0x20b0">
        <gpu dev="0" sm="80" rank="0" gdr="1">
          <nvlink target="0000:19:00.0" count="12" tclass="0x030200"/>
        </gpu>
      </pci>
      <pci busid="0000:19:00.0" class="0x030200"><gpu dev="1" sm="80"/></pci>
      <pci busid="0000:1a:00.0" class="0x020700">
        <nic><net name="mlx5_0" dev="0" speed="100000" port="1" gdr="1" link_layer="InfiniBand"/></nic>
      </pci>
    </pci>
  </cpu>
  <cpu numaid="1" affinity="ffff0000"/>
</system>
"#;
    let sys = xml::from_xml("seed.xml", xml_text).expect("seed XML imports");
    let json_text = json::to_value(&Topology::new(sys.clone())).to_string();
    let bare_json = serde_json::to_string(&sys).expect("model serialises");

    vec![
        ("unique_id", named(ids)),
        (
            "bootstrap_frames",
            named(vec![
                with(0, frames.clone()),
                with(3, [vec![1, 7, 200], frames].concat()),
            ]),
        ),
        (
            "bootstrap_root",
            named(vec![
                with(0, hello),
                with(1, bs::contrib_frame(9, b"data")[5..].to_vec()),
            ]),
        ),
        ("bootstrap_client", named(vec![with(1, session)])),
        (
            "rendezvous_payloads",
            named(vec![
                [vec![2, 2], peer].concat(),
                [vec![0, 2], blobs].concat(),
            ]),
        ),
        ("op_header", named(vec![op.to_vec()])),
        (
            "shm_info",
            named(vec![with(0, shm_recv), with(1, shm_send)]),
        ),
        (
            "socket_info",
            named(vec![
                with(0, ri.encode()),
                with(0, ri6.encode()),
                with(1, si.encode()),
                with(2, [sock_hello.to_vec(), vec![0, 0, 1]].concat()),
                with(3, fh.to_vec()),
                with(4, ctrl),
            ]),
        ),
        (
            "socket_link",
            named(vec![
                [vec![0, 0b0000_0101], one].concat(),
                vec![1, 0b0001_1111, 0xff, 0xff, 3, 0],
                [vec![2, 0x85], ctrl_stream].concat(),
            ]),
        ),
        ("topo_xml", named(vec![xml_text.as_bytes().to_vec()])),
        (
            "topo_json",
            named(vec![json_text.into_bytes(), bare_json.into_bytes()]),
        ),
        (
            "slurm_hostlist",
            named(vec![
                b"node[01-04,07],gpu3".to_vec(),
                b"r[1-2]n[1-2]".to_vec(),
                b"a,b,c".to_vec(),
            ]),
        ),
    ]
}
