//! CUDA IPC memory handles as bytes.
//!
//! A memory handle (`cuIpcGetMemHandle`) names a device allocation so that
//! another process on the same host can map it (`cuIpcOpenMemHandle`): 64
//! opaque bytes that travel through the bootstrap inside a link's
//! connect-info (`braid-transport-nvlink`'s `info` module encodes them).
//! This module is the pure half; the driver calls that make and open
//! handles are [`crate::DeviceBuffer::ipc_handle`] and
//! [`crate::IpcMapping::open`] in [`crate::driver`].

/// Bytes of a CUDA IPC handle (`CU_IPC_HANDLE_SIZE`).
pub const HANDLE_BYTES: usize = 64;

/// A CUDA IPC memory handle.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle(pub [u8; HANDLE_BYTES]);

impl std::fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "IpcMemHandle({:02x}{:02x}{:02x}{:02x}..)",
            self.0[0], self.0[1], self.0[2], self.0[3]
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_only_the_first_bytes() {
        let mut h = [0u8; HANDLE_BYTES];
        h[..4].copy_from_slice(&[0xde, 0xad, 0xbe, 0xef]);
        assert_eq!(format!("{:?}", IpcMemHandle(h)), "IpcMemHandle(deadbeef..)");
    }
}
