//! Connect-info of the PCIe transport: the [`braid_core::wire::Header`]
//! [`HEADER`] (magic, version, role), a mode byte ([`MODE_P2P`] or
//! [`MODE_STAGED`]), then the blob of the link that mode uses (the CUDA IPC
//! device link's, or the shared-memory ring's). Two ranks that chose
//! different modes for their link fail at set-up with a message saying
//! what to set the same on every rank, instead of mis-reading slots.

use braid_core::wire::{Header, Reader};
use braid_core::CoreError;

/// Header of the transport's blobs: magic `BPCI`, version 1.
pub const HEADER: Header = Header {
    magic: *b"BPCI",
    version: 1,
    what: "pcie",
};

/// Mode byte: CUDA IPC peer-to-peer (the device-slot ring of
/// `braid-transport-nvlink`).
pub const MODE_P2P: u8 = 1;
/// Mode byte: staged through shared host memory.
pub const MODE_STAGED: u8 = 2;

fn mode_name(m: u8) -> &'static str {
    match m {
        MODE_P2P => "CUDA IPC peer-to-peer",
        MODE_STAGED => "staging through host memory",
        _ => "an unknown mode",
    }
}

/// The blob of `role` ([`braid_core::wire::ROLE_RECEIVER`] or
/// [`braid_core::wire::ROLE_SENDER`]) for a link in `mode` whose own blob
/// is `blob`.
pub fn tagged(role: u8, mode: u8, blob: Vec<u8>) -> Vec<u8> {
    let mut v = Vec::with_capacity(Header::LEN + 1 + blob.len());
    HEADER.write(&mut v, role);
    v.push(mode);
    v.extend_from_slice(&blob);
    v
}

/// The inner blob of `peer`'s blob `b`, which should be `role`'s, checking
/// that the peer chose this rank's mode `mine`.
pub fn untag(role: u8, mine: u8, peer: u32, b: &[u8]) -> Result<&[u8], CoreError> {
    let protocol = |detail: String| CoreError::Protocol { peer, detail };
    let mut r = Reader::new(b);
    HEADER.read(&mut r, role).map_err(protocol)?;
    let m = r
        .u8()
        .map_err(|_| protocol("PCIe connect-info without a mode".into()))?;
    if m != mine {
        return Err(protocol(format!(
            "rank {peer} chose {} for this PCIe link and this rank {}: set BRAID_P2P_LEVEL / BRAID_P2P_DISABLE / BRAID_TOPO_FILE the same on every rank",
            mode_name(m),
            mode_name(mine)
        )));
    }
    Ok(&b[Header::LEN + 1..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_core::wire::{ROLE_RECEIVER, ROLE_SENDER};

    #[test]
    fn mode_tags_round_trip_and_disagreement_is_explained() {
        let b = tagged(ROLE_SENDER, MODE_STAGED, vec![1, 2, 3]);
        assert_eq!(untag(ROLE_SENDER, MODE_STAGED, 3, &b).unwrap(), &[1, 2, 3]);
        let e = untag(ROLE_SENDER, MODE_P2P, 3, &b).unwrap_err().to_string();
        assert!(
            e.contains("rank 3 chose staging through host memory"),
            "{e}"
        );
        assert!(e.contains("BRAID_P2P_LEVEL"), "{e}");
        assert!(untag(ROLE_SENDER, MODE_P2P, 3, &[]).is_err());
    }

    #[test]
    fn foreign_swapped_and_short_blobs_are_rejected() {
        let b = tagged(ROLE_RECEIVER, MODE_P2P, vec![]);
        assert_eq!(untag(ROLE_RECEIVER, MODE_P2P, 1, &b).unwrap(), &[] as &[u8]);
        let e = untag(ROLE_SENDER, MODE_P2P, 1, &b).unwrap_err().to_string();
        assert!(e.contains("role"), "{e}");
        let e = untag(ROLE_RECEIVER, MODE_P2P, 1, &b[..Header::LEN])
            .unwrap_err()
            .to_string();
        assert!(e.contains("without a mode"), "{e}");
        let mut f = b.clone();
        f[0] ^= 0xff;
        let e = untag(ROLE_RECEIVER, MODE_P2P, 1, &f)
            .unwrap_err()
            .to_string();
        assert!(e.contains("magic"), "{e}");
        for n in 0..b.len() {
            assert!(untag(ROLE_RECEIVER, MODE_P2P, 1, &b[..n]).is_err(), "{n}");
        }
    }
}
