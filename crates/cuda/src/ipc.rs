//! CUDA IPC handles as bytes, and the connect-info of the IPC links.
//!
//! A memory handle (`cuIpcGetMemHandle`) names a device allocation so that
//! another process on the same host can map it (`cuIpcOpenMemHandle`); an
//! event handle (`cuIpcGetEventHandle`, events created with
//! `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`) lets another process
//! wait on an event. Both are 64 opaque bytes that travel through the
//! bootstrap inside a link's connect-info. This module is the pure half
//! (types, encoding, checks: tested on the host); the driver calls that make
//! and open handles are in [`crate::driver`] (`ipc_*`), the one module of
//! this crate with `unsafe` code. Both GPU transport crates use this module
//! (NCCL has one P2P transport; the path class only decides its name).

use crate::error::{CudaError, Result};
use braid_core::wire::Reader;

/// Bytes of a CUDA IPC handle (`CU_IPC_HANDLE_SIZE`).
pub const HANDLE_BYTES: usize = 64;

/// A CUDA IPC memory handle.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle(pub [u8; HANDLE_BYTES]);

/// A CUDA IPC event handle.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcEventHandle(pub [u8; HANDLE_BYTES]);

impl std::fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "IpcMemHandle({:02x}{:02x}{:02x}{:02x}..)",
            self.0[0], self.0[1], self.0[2], self.0[3]
        )
    }
}

impl std::fmt::Debug for IpcEventHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "IpcEventHandle({:02x}{:02x}{:02x}{:02x}..)",
            self.0[0], self.0[1], self.0[2], self.0[3]
        )
    }
}

/// Magic of a link connect-info blob ("bCIP").
const MAGIC: u32 = 0x5049_4362;
/// Version of the encoding.
const VERSION: u16 = 1;

/// What the receiving end of a device-slot link tells the sender: where its
/// slot ring lives (an IPC handle to device memory on GPU `bus_id`), its
/// geometry, and the connect-info of the host control FIFO that carries
/// the credits (a shared-memory link with one small slot per device slot).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkInfo {
    /// PCI bus id of the GPU that holds the slots (`0000:3b:00.0`).
    pub bus_id: String,
    /// Device ordinal in the receiver's process (for messages).
    pub device: u32,
    /// The slot ring: `slots · slot_bytes` bytes of device memory.
    pub mem: IpcMemHandle,
    /// Offset of the ring inside the allocation the handle names.
    pub offset: u64,
    pub slot_bytes: u64,
    pub slots: u32,
    /// The control FIFO's own connect-info (opaque here).
    pub control: Vec<u8>,
}

/// A wire reader's error as this crate's.
fn rd<T>(r: std::result::Result<T, braid_core::wire::ParseError>) -> Result<T> {
    r.map_err(malformed)
}

fn malformed(detail: impl Into<String>) -> CudaError {
    CudaError::Malformed {
        what: "CUDA IPC connect-info",
        detail: detail.into(),
    }
}

impl LinkInfo {
    /// Encode as bytes (little-endian, versioned).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(128 + self.control.len());
        v.extend_from_slice(&MAGIC.to_le_bytes());
        v.extend_from_slice(&VERSION.to_le_bytes());
        let bus = self.bus_id.as_bytes();
        v.extend_from_slice(&(bus.len() as u16).to_le_bytes());
        v.extend_from_slice(bus);
        v.extend_from_slice(&self.device.to_le_bytes());
        v.extend_from_slice(&self.mem.0);
        v.extend_from_slice(&self.offset.to_le_bytes());
        v.extend_from_slice(&self.slot_bytes.to_le_bytes());
        v.extend_from_slice(&self.slots.to_le_bytes());
        v.extend_from_slice(&(self.control.len() as u32).to_le_bytes());
        v.extend_from_slice(&self.control);
        v
    }

    /// Decode, rejecting truncated, oversized or foreign blobs.
    pub fn decode(b: &[u8]) -> Result<LinkInfo> {
        let mut r = Reader::new(b);
        let magic = rd(r.u32())?;
        if magic != MAGIC {
            return Err(malformed(format!(
                "bad magic {magic:#010x}: the peer is not a braid CUDA IPC link (different transports or versions?)"
            )));
        }
        let version = rd(r.u16())?;
        if version != VERSION {
            return Err(malformed(format!(
                "version {version}, this build speaks {VERSION}: run the same braid build on every rank"
            )));
        }
        let n = rd(r.u16())? as usize;
        if n > 64 {
            return Err(malformed(format!("bus id of {n} bytes")));
        }
        let bus_id = std::str::from_utf8(rd(r.take(n))?)
            .map_err(|_| malformed("bus id is not UTF-8"))?
            .to_string();
        let device = rd(r.u32())?;
        let mut mem = [0u8; HANDLE_BYTES];
        mem.copy_from_slice(rd(r.take(HANDLE_BYTES))?);
        let offset = rd(r.u64())?;
        let slot_bytes = rd(r.u64())?;
        let slots = rd(r.u32())?;
        if slots == 0 || slot_bytes == 0 || slot_bytes % 64 != 0 {
            return Err(malformed(format!(
                "impossible geometry {slots} slots x {slot_bytes} bytes"
            )));
        }
        let clen = rd(r.u32())? as usize;
        let control = rd(r.take(clen))?.to_vec();
        rd(r.end())?;
        Ok(LinkInfo {
            bus_id,
            device,
            mem: IpcMemHandle(mem),
            offset,
            slot_bytes,
            slots,
            control,
        })
    }
}

/// What a sending end tells the receiver: its GPU and its control FIFO info.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SenderInfo {
    pub bus_id: String,
    pub device: u32,
    pub control: Vec<u8>,
}

const SENDER_MAGIC: u32 = 0x5349_4362;

impl SenderInfo {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&SENDER_MAGIC.to_le_bytes());
        v.extend_from_slice(&VERSION.to_le_bytes());
        let bus = self.bus_id.as_bytes();
        v.extend_from_slice(&(bus.len() as u16).to_le_bytes());
        v.extend_from_slice(bus);
        v.extend_from_slice(&self.device.to_le_bytes());
        v.extend_from_slice(&(self.control.len() as u32).to_le_bytes());
        v.extend_from_slice(&self.control);
        v
    }

    pub fn decode(b: &[u8]) -> Result<SenderInfo> {
        let mut r = Reader::new(b);
        if rd(r.u32())? != SENDER_MAGIC {
            return Err(malformed("bad magic in sender info"));
        }
        if rd(r.u16())? != VERSION {
            return Err(malformed("sender info of another version"));
        }
        let n = rd(r.u16())? as usize;
        if n > 64 {
            return Err(malformed(format!("bus id of {n} bytes")));
        }
        let bus_id = std::str::from_utf8(rd(r.take(n))?)
            .map_err(|_| malformed("bus id is not UTF-8"))?
            .to_string();
        let device = rd(r.u32())?;
        let clen = rd(r.u32())? as usize;
        let control = rd(r.take(clen))?.to_vec();
        rd(r.end())?;
        Ok(SenderInfo {
            bus_id,
            device,
            control,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> LinkInfo {
        let mut h = [0u8; HANDLE_BYTES];
        for (i, b) in h.iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        LinkInfo {
            bus_id: "0000:3b:00.0".into(),
            device: 2,
            mem: IpcMemHandle(h),
            offset: 4096,
            slot_bytes: 1 << 20,
            slots: 8,
            control: vec![9, 8, 7, 6, 5],
        }
    }

    #[test]
    fn link_info_round_trips() {
        let i = sample();
        assert_eq!(LinkInfo::decode(&i.encode()).unwrap(), i);
        let s = SenderInfo {
            bus_id: "0000:af:00.0".into(),
            device: 1,
            control: vec![1, 2, 3],
        };
        assert_eq!(SenderInfo::decode(&s.encode()).unwrap(), s);
    }

    #[test]
    fn every_truncation_is_rejected() {
        let b = sample().encode();
        for n in 0..b.len() {
            let e = LinkInfo::decode(&b[..n]).unwrap_err();
            assert!(matches!(e, CudaError::Malformed { .. }), "{n}: {e}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(LinkInfo::decode(&long)
            .unwrap_err()
            .to_string()
            .contains("trailing"));
    }

    #[test]
    fn garbage_and_foreign_blobs_are_rejected() {
        let mut b = sample().encode();
        b[0] ^= 0xff;
        assert!(LinkInfo::decode(&b)
            .unwrap_err()
            .to_string()
            .contains("magic"));
        let mut b = sample().encode();
        b[4] = 99;
        assert!(LinkInfo::decode(&b)
            .unwrap_err()
            .to_string()
            .contains("version"));
        // A sender blob is not a receiver blob.
        let s = SenderInfo {
            bus_id: "x".into(),
            device: 0,
            control: vec![],
        };
        assert!(LinkInfo::decode(&s.encode()).is_err());
        // Zero slots.
        let mut i = sample();
        i.slots = 0;
        assert!(LinkInfo::decode(&i.encode())
            .unwrap_err()
            .to_string()
            .contains("geometry"));
        // Pseudo-random garbage never panics.
        let mut x = 0x1234_5678_9abc_def0u64;
        for len in 0..300 {
            let g: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = LinkInfo::decode(&g);
            let _ = SenderInfo::decode(&g);
        }
    }
}
