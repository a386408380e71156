//! Connect-info blobs: compact, versioned, little-endian, validated.
//!
//! Receiver blob (`listen`), 42 bytes + name:
//!
//! | bytes | field |
//! | --- | --- |
//! | 4 | magic `BRSR` |
//! | 2 | version (1) |
//! | 2 | reserved, 0 |
//! | 4 | receiver pid |
//! | 4 | sending rank (`from`) |
//! | 4 | receiving rank (`to`) |
//! | 4 | slots |
//! | 8 | slot_bytes |
//! | 8 | nonce (also stored in the segment) |
//! | 2 | name length `n` |
//! | n | segment name, `/braid-[0-9a-z-]*`, at most 255 bytes |
//!
//! Sender blob (`prepare_send`), 20 bytes: magic `BRSS`, version, reserved,
//! sender pid, `from`, `to`.
//!
//! Parsing checks the exact length, every field's range and the name's
//! character set, so a garbage, truncated or oversized blob is an error and
//! never reaches `shm_open`.

use crate::segment::Layout;
use braid_core::wire::Reader;

const RECV_MAGIC: [u8; 4] = *b"BRSR";
const SEND_MAGIC: [u8; 4] = *b"BRSS";
/// Wire version of both blobs.
pub(crate) const INFO_VERSION: u16 = 1;
const RECV_FIXED: usize = 42;
const SEND_LEN: usize = 20;
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

fn check_header(r: &mut Reader<'_>, magic: [u8; 4], kind: &str) -> Result<(), String> {
    let m = r.take(4)?;
    if m != magic {
        return Err(format!(
            "not an shm {kind} connect-info (bad magic {m:02x?})"
        ));
    }
    let v = r.u16()?;
    if v != INFO_VERSION {
        return Err(format!(
            "connect-info version {v}, this build speaks {INFO_VERSION}: run the same braid version on every rank"
        ));
    }
    if r.u16()? != 0 {
        return Err("reserved field is not zero".into());
    }
    Ok(())
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
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(RECV_FIXED + self.name.len());
        v.extend_from_slice(&RECV_MAGIC);
        v.extend_from_slice(&INFO_VERSION.to_le_bytes());
        v.extend_from_slice(&0u16.to_le_bytes());
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
    pub fn decode(buf: &[u8]) -> Result<(RecvInfo, Layout), String> {
        if buf.len() > RECV_FIXED + MAX_NAME {
            return Err(format!("oversized ({} bytes)", buf.len()));
        }
        let mut r = Reader::new(buf);
        check_header(&mut r, RECV_MAGIC, "receiver")?;
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
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(SEND_LEN);
        v.extend_from_slice(&SEND_MAGIC);
        v.extend_from_slice(&INFO_VERSION.to_le_bytes());
        v.extend_from_slice(&0u16.to_le_bytes());
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.from.to_le_bytes());
        v.extend_from_slice(&self.to.to_le_bytes());
        v
    }

    pub fn decode(buf: &[u8]) -> Result<SendInfo, String> {
        if buf.len() > SEND_LEN {
            return Err(format!("oversized ({} bytes)", buf.len()));
        }
        let mut r = Reader::new(buf);
        check_header(&mut r, SEND_MAGIC, "sender")?;
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
        assert!(RecvInfo::decode(&s).is_err());
        assert!(SendInfo::decode(&b).is_err());
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
        assert!(RecvInfo::decode(&b).is_err());
        let mut b = recv().encode();
        b[6] = 1; // reserved
        assert!(RecvInfo::decode(&b).is_err());
    }
}
