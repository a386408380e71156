//! Reading the little-endian wire blobs every transport exchanges through
//! the bootstrap (connect infos, hellos, IPC handles): each field is taken
//! in order from a byte slice, and a short or overlong blob is an error
//! saying so, never a panic or a half-parsed value.

/// Why a blob was rejected.
pub type ParseError = String;

/// Role byte of a receiving end's connect-info.
pub const ROLE_RECEIVER: u8 = 1;
/// Role byte of a sending end's connect-info.
pub const ROLE_SENDER: u8 = 2;

/// The header every connect-info blob starts with: a 4-byte magic naming
/// the transport, a little-endian `u16` version and a role byte
/// ([`ROLE_RECEIVER`], [`ROLE_SENDER`], or a transport's own), so that a
/// blob of another transport, another braid build or the other end is
/// rejected with a message saying which.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Identifies the transport's blobs.
    pub magic: [u8; 4],
    /// Bumped whenever the blob's layout changes.
    pub version: u16,
    /// The transport's name, for messages.
    pub what: &'static str,
}

impl Header {
    /// Bytes the header takes.
    pub const LEN: usize = 7;

    /// Append the header for `role` to `v`.
    pub fn write(&self, v: &mut Vec<u8>, role: u8) {
        v.extend_from_slice(&self.magic);
        v.extend_from_slice(&self.version.to_le_bytes());
        v.push(role);
    }

    /// Read and check the header of a blob that should be `role`'s.
    pub fn read(&self, r: &mut Reader<'_>, role: u8) -> Result<(), ParseError> {
        let what = self.what;
        let m = r.take(4)?;
        if m != self.magic {
            return Err(format!(
                "not a braid {what} connect-info (magic {m:02x?}, expected {:02x?})",
                self.magic
            ));
        }
        let v = r.u16()?;
        if v != self.version {
            return Err(format!(
                "{what} connect-info version {v}, this build speaks {}: run the same braid build on every rank",
                self.version
            ));
        }
        let got = r.u8()?;
        if got != role {
            return Err(format!(
                "{what} connect-info of role {got}, expected {role} (the two ends' blobs swapped?)"
            ));
        }
        Ok(())
    }
}

/// Takes fields one after another from the front of a byte slice.
#[derive(Debug)]
pub struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `b`.
    pub fn new(b: &'a [u8]) -> Reader<'a> {
        Reader { b, at: 0 }
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], ParseError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| {
                format!(
                    "truncated: needs {n} bytes at offset {}, has {}",
                    self.at,
                    self.b.len()
                )
            })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    /// The next `N` bytes as an array.
    pub fn arr<const N: usize>(&mut self) -> Result<[u8; N], ParseError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    /// One byte.
    pub fn u8(&mut self) -> Result<u8, ParseError> {
        Ok(self.arr::<1>()?[0])
    }

    /// A little-endian `u16`.
    pub fn u16(&mut self) -> Result<u16, ParseError> {
        Ok(u16::from_le_bytes(self.arr()?))
    }

    /// A little-endian `u32`.
    pub fn u32(&mut self) -> Result<u32, ParseError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }

    /// A little-endian `u64`.
    pub fn u64(&mut self) -> Result<u64, ParseError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.b.len() - self.at
    }

    /// Ok when every byte was read; trailing bytes are an error.
    pub fn end(&self) -> Result<(), ParseError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(format!("{n} unexpected trailing bytes")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_in_order_then_errors_for_short_and_long_blobs() {
        let b = [1u8, 2, 0, 3, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 9];
        let mut r = Reader::new(&b);
        assert_eq!(r.u8().unwrap(), 1);
        assert_eq!(r.u16().unwrap(), 2);
        assert_eq!(r.u32().unwrap(), 3);
        assert_eq!(r.u64().unwrap(), 4);
        assert_eq!(r.remaining(), 1);
        assert_eq!(r.end().unwrap_err(), "1 unexpected trailing bytes");
        let e = r.u16().unwrap_err();
        assert!(
            e.starts_with("truncated: needs 2 bytes at offset 15"),
            "{e}"
        );
        assert_eq!(r.u8().unwrap(), 9);
        assert!(r.end().is_ok());
        assert!(Reader::new(&b).take(usize::MAX).is_err());
    }

    #[test]
    fn headers_reject_other_transports_builds_and_ends() {
        const H: Header = Header {
            magic: *b"BRXX",
            version: 3,
            what: "test",
        };
        let mut v = Vec::new();
        H.write(&mut v, ROLE_SENDER);
        assert_eq!(v.len(), Header::LEN);
        assert!(H.read(&mut Reader::new(&v), ROLE_SENDER).is_ok());
        let e = H.read(&mut Reader::new(&v), ROLE_RECEIVER).unwrap_err();
        assert!(e.contains("role 2, expected 1"), "{e}");
        let other = Header { version: 4, ..H };
        let e = other.read(&mut Reader::new(&v), ROLE_SENDER).unwrap_err();
        assert!(e.contains("version 3, this build speaks 4"), "{e}");
        let alien = Header {
            magic: *b"BRYY",
            ..H
        };
        let e = alien.read(&mut Reader::new(&v), ROLE_SENDER).unwrap_err();
        assert!(e.starts_with("not a braid test connect-info"), "{e}");
        assert!(H.read(&mut Reader::new(&v[..5]), ROLE_SENDER).is_err());
    }
}
