//! Host buffers that peers on this host copy from without the kernel.
//!
//! Memory from `malloc` is private to its process: a peer on the same host
//! can only have the kernel copy it (`process_vm_readv`), which pins every
//! page of every transfer and writes the destination through the cache. A
//! [`HostBuffer`] is memory a peer can map instead: a memory file
//! (`memfd_create`), sealed so that it can neither shrink nor grow, mapped
//! shared into this process and registered process-wide. When a collective
//! sends a piece that lies in one by reference (single copy), the shm
//! transport puts the file's name — descriptor number, inode, the buffer's
//! address and size — next to the address in the slot. The receiving rank
//! opens the file once through `/proc/<pid>/fd/<n>` (allowed where
//! `process_vm_readv` is: same user, ptrace policy), checks inode, size and
//! seals, maps it read-only and from then on copies such pieces itself with
//! streaming stores. Anything that does not check out (the file cannot be
//! opened, another inode, a piece outside the buffer) falls back to
//! `process_vm_readv` of the same address, which reads the same bytes.
//!
//! This is the host counterpart of NCCL's `ncclMemAlloc` with buffer
//! registration and of `MPI_Alloc_mem`: allocate the buffers you pass to
//! collectives with [`HostBuffer::new`] and single-copy transfers out of
//! them skip the system call. Receive buffers gain too wherever a plan
//! forwards from them (ring AllGather and Broadcast relays, in-place
//! collectives).
//!
//! A receiver keeps up to [`MAPS_PER_PEER`] peers' buffers mapped per
//! channel, dropping the least recently used; a buffer the owner freed stays
//! allocated until every receiver that mapped it dropped its mapping (its
//! channel closed or the mapping was evicted).

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::sync::RwLock;

use braid_core::error::{CoreError, Result};
use braid_core::types::Element;
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MemFdCreateFlag};

use crate::segment::{OwnMap, PeerMap, PAGE};

/// How many peers' buffers one receiving channel keeps mapped.
pub const MAPS_PER_PEER: usize = 16;

/// A registered buffer, as the sender names it in a direct slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Region {
    /// Inode of the memory file (never 0 for a real file).
    pub ino: u64,
    /// The owner's descriptor number for it.
    pub fd: u64,
    /// Address of the mapping in the owner's process.
    pub base: u64,
    /// Size of the file and of the mapping.
    pub len: u64,
}

/// Every live [`HostBuffer`] of this process.
static REGIONS: RwLock<Vec<Region>> = RwLock::new(Vec::new());

/// The registered buffer that holds all of `ptr..ptr+len`, if any.
pub(crate) fn region_of(ptr: *const u8, len: usize) -> Option<Region> {
    let (a, n) = (ptr as u64, len as u64);
    let regions = REGIONS.read().unwrap_or_else(|e| e.into_inner());
    regions
        .iter()
        .find(|r| a >= r.base && a.checked_add(n).is_some_and(|end| end <= r.base + r.len))
        .copied()
}

fn unavailable(reason: String) -> CoreError {
    CoreError::Unavailable {
        transport: crate::NAME,
        reason,
    }
}

/// Host memory that ranks on this host read directly (see the module
/// documentation). Page-aligned, zeroed, pre-faulted; unmapped and
/// unregistered on drop.
pub struct HostBuffer {
    map: OwnMap,
    len: usize,
    ino: u64,
    // Kept open: receivers find the file through this descriptor.
    fd: OwnedFd,
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("ptr", &self.map.ptr())
            .field("len", &self.len)
            .field("ino", &self.ino)
            .finish()
    }
}

impl HostBuffer {
    /// Allocates `len` bytes (rounded up to whole pages in the file).
    pub fn new(len: usize) -> Result<HostBuffer> {
        if len == 0 {
            return Err(CoreError::InvalidArgument(
                "a host buffer of 0 bytes: ask for at least one".into(),
            ));
        }
        let size = len
            .checked_next_multiple_of(PAGE)
            .filter(|&s| i64::try_from(s).is_ok())
            .ok_or_else(|| CoreError::InvalidArgument(format!("a host buffer of {len} bytes")))?;
        let fd = memfd_create(
            c"braid-host-buffer",
            MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
        )
        .map_err(|e| unavailable(format!("memfd_create failed: {e}")))?;
        nix::unistd::ftruncate(&fd, size as i64).map_err(|e| {
            unavailable(format!(
                "cannot size a {size}-byte memory file: {e} (is /dev/shm or memory short?)"
            ))
        })?;
        // Sealed before anyone maps it: receivers rely on the size (a
        // mapping past a shrunk file's end would fault).
        fcntl(
            fd.as_raw_fd(),
            FcntlArg::F_ADD_SEALS(
                SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
            ),
        )
        .map_err(|e| unavailable(format!("cannot seal the memory file: {e}")))?;
        let ino = nix::sys::stat::fstat(fd.as_raw_fd())
            .map_err(|e| unavailable(format!("fstat of the memory file failed: {e}")))?
            .st_ino;
        let map = OwnMap::new(&fd, size)
            .map_err(|e| unavailable(format!("cannot map {size} bytes: {e}")))?;
        let region = Region {
            ino,
            fd: fd.as_raw_fd() as u64,
            base: map.ptr() as u64,
            len: size as u64,
        };
        REGIONS
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(region);
        tracing::debug!(bytes = size, ino, "shm: host buffer registered");
        Ok(HostBuffer { map, len, ino, fd })
    }

    /// Length in bytes (as asked for).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never: at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.map.typed::<u8>()[..self.len]
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map.typed_mut::<u8>()[..self.len]
    }

    /// The buffer as elements of `T` (`len / size_of::<T>()` of them; a
    /// trailing partial element is left out), for the typed collectives.
    pub fn typed<T: Element>(&self) -> &[T] {
        &self.map.typed::<T>()[..self.len / std::mem::size_of::<T>()]
    }

    /// [`HostBuffer::typed`], writable.
    pub fn typed_mut<T: Element>(&mut self) -> &mut [T] {
        &mut self.map.typed_mut::<T>()[..self.len / std::mem::size_of::<T>()]
    }
}

impl std::ops::Deref for HostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::ops::DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        let mut regions = REGIONS.write().unwrap_or_else(|e| e.into_inner());
        regions.retain(|r| r.ino != self.ino || r.fd != self.fd.as_raw_fd() as u64);
    }
}

/// A peer's buffer mapped here.
#[derive(Debug)]
struct PeerFile {
    region: Region,
    map: PeerMap,
}

/// The peer's buffers a receiving channel has mapped (most recently used
/// last), and the ones it could not.
#[derive(Debug)]
pub(crate) struct PeerFiles {
    /// The peer's rank (for the log) and process.
    peer: u32,
    pid: u32,
    maps: Vec<PeerFile>,
    refused: Vec<Region>,
}

impl PeerFiles {
    /// No buffer of rank `peer` (process `pid`) mapped yet.
    pub(crate) fn new(peer: u32, pid: u32) -> PeerFiles {
        PeerFiles {
            peer,
            pid,
            maps: Vec::new(),
            refused: Vec::new(),
        }
    }

    /// Where the `len` bytes at `addr` in the peer's process — inside
    /// `region`, the sender says — can be copied from here: a mapping of the
    /// region's file (mapped now if it is not yet) and their offset in it.
    /// `None` when that is not possible; the caller then reads the bytes
    /// with `process_vm_readv`.
    pub(crate) fn locate(
        &mut self,
        region: Region,
        addr: u64,
        len: usize,
    ) -> Option<(&PeerMap, usize)> {
        let off = addr
            .checked_sub(region.base)
            .and_then(|o| usize::try_from(o).ok())?;
        let at = match self.maps.iter().position(|m| m.region == region) {
            Some(i) => i,
            None => {
                if self.refused.contains(&region) {
                    return None;
                }
                match open(self.pid, region) {
                    Ok(map) => {
                        tracing::debug!(
                            peer = self.peer,
                            bytes = region.len,
                            "shm: mapped the peer's host buffer; single-copy reads from it skip process_vm_readv"
                        );
                        if self.maps.len() == MAPS_PER_PEER {
                            self.maps.remove(0);
                        }
                        self.maps.push(PeerFile { region, map });
                        self.maps.len() - 1
                    }
                    Err(why) => {
                        tracing::debug!(
                            peer = self.peer,
                            why,
                            "shm: peer's host buffer not mapped; reading it with process_vm_readv"
                        );
                        if self.refused.len() == MAPS_PER_PEER {
                            self.refused.remove(0);
                        }
                        self.refused.push(region);
                        return None;
                    }
                }
            }
        };
        // Most recently used last.
        let f = self.maps.remove(at);
        self.maps.push(f);
        let inside = off
            .checked_add(len)
            .is_some_and(|end| end as u64 <= region.len);
        let f = self.maps.last()?;
        inside.then_some((&f.map, off))
    }

    /// How many peer buffers are mapped.
    #[cfg(test)]
    pub(crate) fn mapped(&self) -> usize {
        self.maps.len()
    }
}

/// Opens and maps the peer's buffer file, checking that it is the file the
/// sender named, of its size and sealed against shrinking.
fn open(pid: u32, region: Region) -> std::result::Result<PeerMap, String> {
    let path = format!("/proc/{pid}/fd/{}", region.fd);
    let check = |meta: std::fs::Metadata| {
        if !meta.is_file() || meta.ino() != region.ino || meta.len() != region.len {
            return Err(format!(
                "{path} is {} inode {} of {} bytes, not the memory file (inode {}, {} bytes)",
                if meta.is_file() { "file" } else { "a non-file" },
                meta.ino(),
                meta.len(),
                region.ino,
                region.len
            ));
        }
        Ok(())
    };
    // Look before opening (the descriptor number comes from the peer: never
    // open its pipe, socket or terminal), open without blocking, and look
    // again at what was opened.
    check(std::fs::metadata(&path).map_err(|e| format!("stat {path}: {e}"))?)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(&path)
        .map_err(|e| format!("open {path}: {e}"))?;
    check(file.metadata().map_err(|e| format!("fstat {path}: {e}"))?)?;
    let seals = fcntl(file.as_raw_fd(), FcntlArg::F_GET_SEALS)
        .map_err(|e| format!("{path}: no seals ({e})"))?;
    if SealFlag::from_bits_truncate(seals).contains(SealFlag::F_SEAL_SHRINK) {
        let len = usize::try_from(region.len).map_err(|_| "too large".to_string())?;
        PeerMap::new(&OwnedFd::from(file), len).map_err(|e| e.to_string())
    } else {
        Err(format!("{path} can shrink (not sealed)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Copies through `files` as the receiver does (`locate`, then
    /// `read_at`): false when nothing was copied.
    fn read(
        files: &mut PeerFiles,
        region: Region,
        addr: u64,
        dst: &mut [u8],
        len: usize,
        stream: bool,
    ) -> bool {
        assert!(len <= dst.len());
        match files.locate(region, addr, len) {
            // SAFETY: `dst` holds at least `len` writable bytes (checked).
            Some((map, off)) => unsafe { map.read_at(off, dst.as_mut_ptr(), len, stream) },
            None => false,
        }
    }

    #[test]
    fn buffers_are_registered_while_alive_and_zeroed() {
        let mut b = HostBuffer::new(10_000).unwrap();
        assert_eq!(b.len(), 10_000);
        assert!(b.iter().all(|&x| x == 0));
        b[9_999] = 7;
        let p = b.as_ptr();
        let r = region_of(p, 10_000).expect("registered");
        assert_eq!(r.base, p as u64);
        assert_eq!(r.len, 12_288, "whole pages");
        assert_eq!(region_of(p.wrapping_add(100), 12_188), Some(r));
        assert_eq!(region_of(p.wrapping_add(100), 12_189), None, "past the end");
        assert_eq!(region_of(p.wrapping_sub(1), 2), None, "before the start");
        let other = [0u8; 64];
        assert_eq!(region_of(other.as_ptr(), 64), None);
        assert_eq!(b.typed::<f64>().len(), 1250);
        assert_eq!(b.typed::<u32>().len(), 2500);
        b.typed_mut::<u32>()[2499] = 0x0102_0304;
        assert_eq!(b[9_996..10_000], 0x0102_0304u32.to_ne_bytes());
        drop(b);
        assert_eq!(region_of(p, 1), None, "unregistered on drop");
        assert!(HostBuffer::new(0).is_err());
    }

    #[test]
    fn a_peer_maps_the_file_and_reads_what_the_owner_wrote() {
        let mut b = HostBuffer::new(3 << 20).unwrap();
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
        let r = region_of(b.as_ptr(), b.len()).unwrap();
        let pid = std::process::id();
        let mut files = PeerFiles::new(1, pid);
        let mut dst = vec![0u8; 2 << 20];
        let off = 12345;
        let n = dst.len();
        assert!(read(&mut files, r, r.base + off, &mut dst, n, true));
        let want: Vec<u8> = (off as usize..off as usize + dst.len())
            .map(|i| (i % 251) as u8)
            .collect();
        assert!(dst == want);
        assert_eq!(files.mapped(), 1);
        // Writes after the mapping are seen (one shared file).
        b[off as usize] = 0xEE;
        assert!(read(&mut files, r, r.base + off, &mut dst, 16, false));
        assert_eq!(dst[0], 0xEE);
        assert_eq!(files.mapped(), 1, "mapped once");
        // Past the end, a wrong inode, a wrong size: refused, nothing copied.
        dst[0] = 1;
        assert!(!read(
            &mut files,
            r,
            r.base + r.len - 8,
            &mut dst,
            16,
            false
        ));
        assert!(!read(&mut files, r, r.base - 8, &mut dst, 16, false));
        let wrong = Region {
            ino: r.ino + 1,
            ..r
        };
        assert!(!read(&mut files, wrong, r.base, &mut dst, 16, false));
        let wrong = Region {
            len: r.len - 4096,
            ..r
        };
        assert!(!read(&mut files, wrong, r.base, &mut dst, 16, false));
        let wrong = Region { fd: 987_654, ..r };
        assert!(!read(&mut files, wrong, r.base, &mut dst, 16, false));
        assert_eq!(dst[0], 1);
        assert_eq!(files.mapped(), 1);
    }

    #[test]
    fn an_unsealed_file_is_not_mapped() {
        let fd = memfd_create(c"braid-test", MemFdCreateFlag::MFD_CLOEXEC).unwrap();
        nix::unistd::ftruncate(&fd, 8192).unwrap();
        let st = nix::sys::stat::fstat(fd.as_raw_fd()).unwrap();
        let r = Region {
            ino: st.st_ino,
            fd: fd.as_raw_fd() as u64,
            base: 1 << 30,
            len: 8192,
        };
        let err = open(std::process::id(), r).unwrap_err();
        assert!(
            err.contains("not sealed") || err.contains("no seals"),
            "{err}"
        );
    }

    #[test]
    fn a_descriptor_that_is_not_the_file_is_refused_without_opening_it() {
        // A FIFO nobody writes to: opening it for reading would block.
        let dir = std::env::temp_dir().join(format!("braid-host-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        let ino = f.metadata().unwrap().ino();
        let r = Region {
            ino,
            fd: f.as_raw_fd() as u64,
            base: 1 << 30,
            len: 0,
        };
        let err = open(std::process::id(), r).unwrap_err();
        assert!(err.contains("non-file"), "{err}");
        drop(f);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn mappings_are_capped_per_peer() {
        let bufs: Vec<HostBuffer> = (0..MAPS_PER_PEER + 2)
            .map(|_| HostBuffer::new(4096).unwrap())
            .collect();
        let mut files = PeerFiles::new(0, std::process::id());
        let mut dst = [0u8; 8];
        for b in &bufs {
            let r = region_of(b.as_ptr(), 8).unwrap();
            assert!(read(&mut files, r, r.base, &mut dst, 8, false));
        }
        assert_eq!(files.mapped(), MAPS_PER_PEER);
    }
}
