//! Connect-info of the CUDA IPC device-slot link: what the receiving end
//! ([`LinkInfo`]) and the sending end ([`SenderInfo`]) publish through the
//! bootstrap. Each blob starts with the [`braid_core::wire::Header`]
//! [`HEADER`] (magic, version, role), integers are little-endian, and a blob
//! has one exact length: truncated, padded, foreign or swapped blobs are
//! rejected with a message, never half-parsed. Pure (tested on the host).
//! Both GPU transports use these blobs (`braid-transport-pcie` wraps them
//! in its own header with a mode byte).

use braid_core::wire::{Header, ParseError, Reader, ROLE_RECEIVER, ROLE_SENDER};
use braid_cuda::ipc::{IpcMemHandle, HANDLE_BYTES};

/// Header of both blobs: magic `bCIP` ("braid CUDA IPC"), version 2 (1 had
/// a magic per role and no role byte, process or ring address).
pub const HEADER: Header = Header {
    magic: *b"bCIP",
    version: 2,
    what: "CUDA IPC device link",
};

/// Longest PCI bus id accepted.
const MAX_BUS_ID: usize = 64;

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
    /// A random number naming the receiver's process (0: unknown). A sender
    /// in the same process (CUDA IPC cannot open a handle there) uses
    /// [`LinkInfo::ring`] instead of the handle.
    pub process: u64,
    /// Device address of the allocation in the receiver's process.
    pub ring: u64,
    /// The slot ring: `slots · slot_bytes` bytes of device memory and the
    /// counters after them.
    pub mem: IpcMemHandle,
    /// Offset of the ring inside the allocation the handle names.
    pub offset: u64,
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Slots in the ring.
    pub slots: u32,
    /// The control FIFO's own connect-info (opaque here).
    pub control: Vec<u8>,
}

fn put_bus_id(v: &mut Vec<u8>, bus_id: &str) {
    let bus = bus_id.as_bytes();
    v.extend_from_slice(&(bus.len() as u16).to_le_bytes());
    v.extend_from_slice(bus);
}

fn bus_id(r: &mut Reader<'_>) -> Result<String, ParseError> {
    let n = r.u16()? as usize;
    if n > MAX_BUS_ID {
        return Err(format!("bus id of {n} bytes"));
    }
    Ok(std::str::from_utf8(r.take(n)?)
        .map_err(|_| "bus id is not UTF-8".to_string())?
        .to_string())
}

fn put_control(v: &mut Vec<u8>, control: &[u8]) {
    v.extend_from_slice(&(control.len() as u32).to_le_bytes());
    v.extend_from_slice(control);
}

fn control(r: &mut Reader<'_>) -> Result<Vec<u8>, ParseError> {
    let n = r.u32()? as usize;
    Ok(r.take(n)?.to_vec())
}

impl LinkInfo {
    /// Encode as bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(160 + self.control.len());
        HEADER.write(&mut v, ROLE_RECEIVER);
        put_bus_id(&mut v, &self.bus_id);
        v.extend_from_slice(&self.device.to_le_bytes());
        v.extend_from_slice(&self.process.to_le_bytes());
        v.extend_from_slice(&self.ring.to_le_bytes());
        v.extend_from_slice(&self.mem.0);
        v.extend_from_slice(&self.offset.to_le_bytes());
        v.extend_from_slice(&self.slot_bytes.to_le_bytes());
        v.extend_from_slice(&self.slots.to_le_bytes());
        put_control(&mut v, &self.control);
        v
    }

    /// Decode, rejecting truncated, oversized, foreign or sender blobs.
    pub fn decode(b: &[u8]) -> Result<LinkInfo, ParseError> {
        let mut r = Reader::new(b);
        HEADER.read(&mut r, ROLE_RECEIVER)?;
        let bus_id = bus_id(&mut r)?;
        let device = r.u32()?;
        let process = r.u64()?;
        let ring = r.u64()?;
        let mem = IpcMemHandle(r.arr::<HANDLE_BYTES>()?);
        let offset = r.u64()?;
        let slot_bytes = r.u64()?;
        let slots = r.u32()?;
        if slots == 0 || slot_bytes == 0 || slot_bytes % 64 != 0 {
            return Err(format!(
                "impossible geometry {slots} slots x {slot_bytes} bytes"
            ));
        }
        let control = control(&mut r)?;
        r.end()?;
        Ok(LinkInfo {
            bus_id,
            device,
            process,
            ring,
            mem,
            offset,
            slot_bytes,
            slots,
            control,
        })
    }
}

/// What a sending end tells the receiver: its GPU and its control FIFO's
/// connect-info.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SenderInfo {
    /// PCI bus id of the sender's GPU.
    pub bus_id: String,
    /// Device ordinal in the sender's process (for messages).
    pub device: u32,
    /// The control FIFO's own connect-info (opaque here).
    pub control: Vec<u8>,
}

impl SenderInfo {
    /// Encode as bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(32 + self.control.len());
        HEADER.write(&mut v, ROLE_SENDER);
        put_bus_id(&mut v, &self.bus_id);
        v.extend_from_slice(&self.device.to_le_bytes());
        put_control(&mut v, &self.control);
        v
    }

    /// Decode, rejecting truncated, oversized, foreign or receiver blobs.
    pub fn decode(b: &[u8]) -> Result<SenderInfo, ParseError> {
        let mut r = Reader::new(b);
        HEADER.read(&mut r, ROLE_SENDER)?;
        let bus_id = bus_id(&mut r)?;
        let device = r.u32()?;
        let control = control(&mut r)?;
        r.end()?;
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
            process: 0x0123_4567_89ab_cdef,
            ring: 0x7f00_0020_0000,
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
            assert!(e.contains("truncated"), "{n}: {e}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(LinkInfo::decode(&long).unwrap_err().contains("trailing"));
    }

    #[test]
    fn garbage_and_foreign_blobs_are_rejected() {
        let mut b = sample().encode();
        b[0] ^= 0xff;
        assert!(LinkInfo::decode(&b).unwrap_err().contains("magic"));
        let mut b = sample().encode();
        b[4] = 99;
        assert!(LinkInfo::decode(&b).unwrap_err().contains("version"));
        // A sender blob is not a receiver blob, nor the other way round.
        let s = SenderInfo {
            bus_id: "x".into(),
            device: 0,
            control: vec![],
        };
        assert!(LinkInfo::decode(&s.encode()).unwrap_err().contains("role"));
        assert!(SenderInfo::decode(&sample().encode())
            .unwrap_err()
            .contains("role"));
        // Zero slots.
        let mut i = sample();
        i.slots = 0;
        assert!(LinkInfo::decode(&i.encode())
            .unwrap_err()
            .contains("geometry"));
        // An overlong bus id.
        let mut i = sample();
        i.bus_id = "0".repeat(65);
        assert!(LinkInfo::decode(&i.encode())
            .unwrap_err()
            .contains("bus id"));
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
