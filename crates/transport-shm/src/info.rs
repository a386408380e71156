//! Connect-info blobs: compact, versioned, little-endian, validated.
//!
//! Both blobs start with braid's connect-info header
//! ([`braid_core::wire::Header`]): magic `BRSM`, version (2), role byte
//! (1: receiver, 2: sender).
//!
//! Receiver blob (`listen`), 41 bytes + name:
//!
//! | bytes | field |
//! | --- | --- |
//! | 4 | magic `BRSM` |
//! | 2 | version (2) |
//! | 1 | role: 1, receiver |
//! | 4 | receiver pid |
//! | 4 | sending rank (`from`) |
//! | 4 | receiving rank (`to`) |
//! | 4 | slots |
//! | 8 | slot_bytes |
//! | 8 | nonce (also stored in the segment) |
//! | 2 | name length `n` |
//! | n | segment name, `/braid-[0-9a-z-]*`, at most 255 bytes |
//!
//! Sender blob (`prepare_send`), 19 bytes: the header with role 2, sender
//! pid, `from`, `to`.
//!
//! Version 1 had a magic per role (`BRSR`, `BRSS`) and two reserved bytes
//! after the version.
//!
//! Parsing checks the exact length, every field's range and the name's
//! character set, so a garbage, truncated or oversized blob is an error and
//! never reaches `shm_open`.

use crate::segment::Layout;
use braid_core::wire::{Header, Reader, ROLE_RECEIVER, ROLE_SENDER};

/// The header of both blobs.
pub(crate) const HEADER: Header = Header {
    magic: *b"BRSM",
    version: 2,
    what: "shm",
};
const RECV_FIXED: usize = Header::LEN + 34;
const SEND_LEN: usize = Header::LEN + 12;
/// Longest segment name (NAME_MAX, including the leading `/`).
pub(crate) const MAX_NAME: usize = 255;
/// Prefix of every segment name.
pub(crate) const NAME_PREFIX: &str = "/braid-";

/// What the receiver tells the sender.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RecvInfo {
    pub pid: u32,
    pub from: u32,
    pub to: u32,
    pub slots: u32,
    pub slot_bytes: u64,
    pub nonce: u64,
    pub name: String,
}

/// What the sender tells the receiver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SendInfo {
    pub pid: u32,
    pub from: u32,
    pub to: u32,
}

fn check_pid(pid: u32) -> Result<u32, String> {
    // 0 and negative pids mean process groups to kill(2): never accept them.
    if pid == 0 || pid > i32::MAX as u32 {
        return Err(format!("invalid process id {pid}"));
    }
    Ok(pid)
}

/// Whether `name` is a segment name this crate could have made.
pub(crate) fn valid_name(name: &str) -> bool {
    name.len() <= MAX_NAME
        && name.len() > NAME_PREFIX.len()
        && name.starts_with(NAME_PREFIX)
        && name[1..]
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

impl RecvInfo {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(RECV_FIXED + self.name.len());
        HEADER.write(&mut v, ROLE_RECEIVER);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.from.to_le_bytes());
        v.extend_from_slice(&self.to.to_le_bytes());
        v.extend_from_slice(&self.slots.to_le_bytes());
        v.extend_from_slice(&self.slot_bytes.to_le_bytes());
        v.extend_from_slice(&self.nonce.to_le_bytes());
        v.extend_from_slice(&(self.name.len() as u16).to_le_bytes());
        v.extend_from_slice(self.name.as_bytes());
        v
    }

    /// Parses and validates; also returns the segment layout it describes.
    pub(crate) fn decode(buf: &[u8]) -> Result<(RecvInfo, Layout), String> {
        if buf.len() > RECV_FIXED + MAX_NAME {
            return Err(format!("oversized ({} bytes)", buf.len()));
        }
        let mut r = Reader::new(buf);
        HEADER.read(&mut r, ROLE_RECEIVER)?;
        let pid = check_pid(r.u32()?)?;
        let from = r.u32()?;
        let to = r.u32()?;
        let slots = r.u32()?;
        let slot_bytes = r.u64()?;
        let nonce = r.u64()?;
        let n = r.u16()? as usize;
        let name = r.take(n)?;
        r.end()?;
        let name = std::str::from_utf8(name)
            .ok()
            .filter(|s| valid_name(s))
            .ok_or_else(|| format!("invalid segment name {:?}", String::from_utf8_lossy(name)))?;
        let layout = usize::try_from(slot_bytes)
            .ok()
            .and_then(|sb| Layout::new(sb, slots as usize))
            .ok_or_else(|| format!("invalid geometry: {slots} slots of {slot_bytes} bytes"))?;
        Ok((
            RecvInfo {
                pid,
                from,
                to,
                slots,
                slot_bytes,
                nonce,
                name: name.to_owned(),
            },
            layout,
        ))
    }
}

impl SendInfo {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(SEND_LEN);
        HEADER.write(&mut v, ROLE_SENDER);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.from.to_le_bytes());
        v.extend_from_slice(&self.to.to_le_bytes());
        v
    }

    pub(crate) fn decode(buf: &[u8]) -> Result<SendInfo, String> {
        if buf.len() > SEND_LEN {
            return Err(format!("oversized ({} bytes)", buf.len()));
        }
        let mut r = Reader::new(buf);
        HEADER.read(&mut r, ROLE_SENDER)?;
        let pid = check_pid(r.u32()?)?;
        let from = r.u32()?;
        let to = r.u32()?;
        debug_assert!(r.end().is_ok());
        Ok(SendInfo { pid, from, to })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv() -> RecvInfo {
        RecvInfo {
            pid: 42,
            from: 3,
            to: 5,
            slots: 8,
            slot_bytes: 512 * 1024,
            nonce: 0xdead_beef,
            name: "/braid-42-0123456789abcdef-3-5".into(),
        }
    }

    #[test]
    fn roundtrip() {
        let r = recv();
        let (got, layout) = RecvInfo::decode(&r.encode()).unwrap();
        assert_eq!(got, r);
        assert_eq!(layout.slots, 8);
        let s = SendInfo {
            pid: 7,
            from: 3,
            to: 5,
        };
        assert_eq!(SendInfo::decode(&s.encode()).unwrap(), s);
    }

    #[test]
    fn rejects_every_truncation_and_extension() {
        let b = recv().encode();
        for n in 0..b.len() {
            assert!(RecvInfo::decode(&b[..n]).is_err(), "prefix {n}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(RecvInfo::decode(&long).is_err());
        let s = SendInfo {
            pid: 7,
            from: 0,
            to: 1,
        }
        .encode();
        for n in 0..s.len() {
            assert!(SendInfo::decode(&s[..n]).is_err(), "prefix {n}");
        }
        // The two kinds are not interchangeable.
        let e = RecvInfo::decode(&s).unwrap_err();
        assert!(e.contains("shm connect-info of role 2, expected 1"), "{e}");
        let e = SendInfo::decode(&b).unwrap_err();
        assert!(e.starts_with("oversized"), "{e}");
        let e = SendInfo::decode(&b[..SEND_LEN]).unwrap_err();
        assert!(e.contains("shm connect-info of role 1, expected 2"), "{e}");
    }

    #[test]
    fn rejects_bad_fields() {
        let mut r = recv();
        r.pid = 0;
        assert!(RecvInfo::decode(&r.encode()).is_err());
        let mut r = recv();
        r.name = "/dev-shm-other".into();
        assert!(RecvInfo::decode(&r.encode()).is_err());
        let mut r = recv();
        r.name = "/braid-../x".into();
        assert!(RecvInfo::decode(&r.encode()).is_err());
        let mut r = recv();
        r.slots = 1;
        assert!(RecvInfo::decode(&r.encode()).is_err());
        let mut r = recv();
        r.slot_bytes = 100;
        assert!(RecvInfo::decode(&r.encode()).is_err());
        let mut b = recv().encode();
        b[4] = 9; // version
        let e = RecvInfo::decode(&b).unwrap_err();
        assert!(
            e.contains("shm connect-info version 9, this build speaks 2"),
            "{e}"
        );
        let mut b = recv().encode();
        b[6] = ROLE_SENDER; // role
        assert!(RecvInfo::decode(&b).is_err());
        let mut b = recv().encode();
        b[0] = b'X'; // magic
        let e = RecvInfo::decode(&b).unwrap_err();
        assert!(e.starts_with("not a braid shm connect-info"), "{e}");
    }
}
