//! The peer descriptions exchanged at creation, and the two-phase link
//! set-up shared by the host and the device communicators.

use super::*;

pub(super) fn encode_peer(p: &PeerDesc) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&p.rank.to_le_bytes());
    v.extend_from_slice(&p.pid.to_le_bytes());
    let mut field = |b: &[u8]| {
        v.extend_from_slice(&(b.len() as u16).to_le_bytes());
        v.extend_from_slice(b);
    };
    field(p.host_id.as_bytes());
    for (t, f) in &p.fabrics {
        field(t.as_bytes());
        field(f.as_bytes());
    }
    v
}

pub(super) fn decode_peer(b: &[u8], from: u32) -> Result<PeerDesc> {
    let bad = || Error::Bootstrap(format!("rank {from} sent a malformed peer description"));
    if b.len() < 8 || b.len() > 8 + 16384 {
        return Err(bad());
    }
    let rank = u32::from_le_bytes(b[0..4].try_into().map_err(|_| bad())?);
    let pid = u32::from_le_bytes(b[4..8].try_into().map_err(|_| bad())?);
    let mut at = 8;
    let field = |at: &mut usize| -> Result<String> {
        let l = b.get(*at..*at + 2).ok_or_else(bad)?;
        let l = u16::from_le_bytes([l[0], l[1]]) as usize;
        let s = b.get(*at + 2..*at + 2 + l).ok_or_else(bad)?;
        *at += 2 + l;
        String::from_utf8(s.to_vec()).map_err(|_| bad())
    };
    let host_id = field(&mut at)?;
    let mut fabrics = Vec::new();
    while at < b.len() {
        let t = field(&mut at)?;
        let f = field(&mut at)?;
        fabrics.push((t, f));
    }
    if rank != from {
        return Err(Error::Bootstrap(format!(
            "slot {from} of the rendezvous holds rank {rank}'s description"
        )));
    }
    Ok(PeerDesc {
        rank,
        host_id,
        pid,
        fabrics,
    })
}

/// Setting up the links of a communicator: phase 1 allocates both ends of
/// each link and collects their connect-info; phase 2 exchanges it among all
/// ranks and connects. Shared by the host and the device communicators.
pub(crate) struct LinkSetup {
    rank: u32,
    recv: Vec<Option<Box<dyn PendingRecv>>>,
    send: Vec<Option<Box<dyn PendingSend>>>,
    blobs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl LinkSetup {
    pub(crate) fn new(rank: u32, nranks: usize) -> LinkSetup {
        LinkSetup {
            rank,
            recv: (0..nranks).map(|_| None).collect(),
            send: (0..nranks).map(|_| None).collect(),
            blobs: vec![(Vec::new(), Vec::new()); nranks],
        }
    }

    /// Phase 1 for the two links with rank `q`, over transport `t`.
    pub(crate) fn add(
        &mut self,
        q: usize,
        t: &dyn braid_core::transport::Transport,
        me: &PeerDesc,
        peer: &PeerDesc,
    ) -> Result<()> {
        let (pr, rb) = t.listen(me, peer)?;
        let (ps, sb) = t.prepare_send(me, peer)?;
        self.recv[q] = Some(pr);
        self.send[q] = Some(ps);
        self.blobs[q] = (rb, sb);
        Ok(())
    }

    /// Phase 2: `allgather` every rank's connect-info, then connect the send
    /// ends first (they never wait), then the receive ends, within `timeout`.
    pub(crate) fn connect(
        self,
        allgather: impl FnOnce(&[u8]) -> Result<Vec<Vec<u8>>>,
        timeout: Duration,
    ) -> Result<Channels> {
        let p = self.blobs.len();
        let all = allgather(&encode_blobs(&self.blobs))?;
        let all: Vec<Vec<(Vec<u8>, Vec<u8>)>> = all
            .iter()
            .enumerate()
            .map(|(r, b)| decode_blobs(b, p, r as u32))
            .collect::<Result<_>>()?;
        if all.len() != p {
            return Err(Error::Bootstrap(format!(
                "connect-info from {} ranks, expected {p}",
                all.len()
            )));
        }
        let deadline = Instant::now() + timeout;
        let me = self.rank as usize;
        let mut chans = Channels {
            send: (0..p).map(|_| None).collect(),
            recv: (0..p).map(|_| None).collect(),
            scratch: Vec::new(),
        };
        for (q, ps) in self.send.into_iter().enumerate() {
            if let Some(ps) = ps {
                // q's receive end for the link me → q.
                chans.send[q] = Some(ps.connect(&all[q][me].0, deadline)?);
            }
        }
        for (q, pr) in self.recv.into_iter().enumerate() {
            if let Some(pr) = pr {
                chans.recv[q] = Some(pr.connect(&all[q][me].1, deadline)?);
            }
        }
        Ok(chans)
    }
}

pub(crate) fn encode_blobs(blobs: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut v = Vec::new();
    for (a, b) in blobs {
        for x in [a, b] {
            v.extend_from_slice(&(x.len() as u32).to_le_bytes());
            v.extend_from_slice(x);
        }
    }
    v
}

pub(crate) fn decode_blobs(b: &[u8], p: usize, from: u32) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let bad = || Error::Bootstrap(format!("rank {from} sent malformed connect-info"));
    let mut out = Vec::with_capacity(p);
    let mut at = 0usize;
    let mut take = || -> Result<Vec<u8>> {
        let l = b.get(at..at + 4).ok_or_else(bad)?;
        let l = u32::from_le_bytes(l.try_into().map_err(|_| bad())?) as usize;
        let x = b.get(at + 4..at + 4 + l).ok_or_else(bad)?.to_vec();
        at += 4 + l;
        Ok(x)
    };
    for _ in 0..p {
        let r = take()?;
        let s = take()?;
        out.push((r, s));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_descriptions_round_trip_with_fabrics() {
        let p = PeerDesc {
            rank: 3,
            host_id: "host/a:b/pid:[1]".into(),
            pid: 77,
            fabrics: vec![("ib".into(), "ib:fe80000000000000".into())],
        };
        assert_eq!(decode_peer(&encode_peer(&p), 3).unwrap(), p);
        let q = PeerDesc {
            fabrics: Vec::new(),
            ..p.clone()
        };
        assert_eq!(decode_peer(&encode_peer(&q), 3).unwrap(), q);
        // Wrong slot, truncation.
        assert!(decode_peer(&encode_peer(&p), 2).is_err());
        let b = encode_peer(&p);
        for n in [0, 7, 9, b.len() - 1] {
            assert!(decode_peer(&b[..n], 3).is_err(), "prefix {n}");
        }
    }
}
