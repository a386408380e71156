//! The [`UniqueId`]: the root's address and the job's secret, with its text
//! form, and the OS randomness that secrets and nonces come from.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Where the bootstrap root listens and the secret every rank must prove.
///
/// Text form (`Display`/`FromStr`): `<socketaddr>/<32 lowercase hex>`, e.g.
/// `127.0.0.1:29500/00112233445566778899aabbccddeeff` or
/// `[::1]:29500/00112233445566778899aabbccddeeff`.
///
/// `Debug` does not print the secret.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId {
    /// The root's address.
    pub addr: SocketAddr,
    /// The shared secret.
    pub secret: [u8; 16],
}

impl UniqueId {
    /// A new id for a root at `addr` with a random secret from the OS.
    pub fn generate(addr: SocketAddr) -> Result<UniqueId> {
        Ok(UniqueId {
            addr,
            secret: random_bytes()?,
        })
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UniqueId")
            .field("addr", &self.addr)
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, to_hex(&self.secret))
    }
}

impl FromStr for UniqueId {
    type Err = Error;

    fn from_str(s: &str) -> Result<UniqueId> {
        let bad = |why: &str| {
            Error::InvalidArgument(format!(
                "invalid unique id {s:?}: {why}; expected <ip>:<port>/<32 hex digits>, \
                 e.g. 127.0.0.1:29500/00112233445566778899aabbccddeeff or \
                 [::1]:29500/00112233445566778899aabbccddeeff"
            ))
        };
        let s_trim = s.trim();
        let (addr, secret) = s_trim
            .rsplit_once('/')
            .ok_or_else(|| bad("no '/' between address and secret"))?;
        let addr: SocketAddr = addr
            .parse()
            .map_err(|_| bad("the address is not <ip>:<port>"))?;
        let secret =
            parse_secret_hex(secret).ok_or_else(|| bad("the secret is not 32 hex digits"))?;
        Ok(UniqueId { addr, secret })
    }
}

/// Parses exactly 32 hex digits into a 16-byte secret.
pub(crate) fn parse_secret_hex(s: &str) -> Option<[u8; 16]> {
    let b = s.as_bytes();
    if b.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let hi = hex_val(b[2 * i])?;
        let lo = hex_val(b[2 * i + 1])?;
        *o = (hi << 4) | lo;
    }
    Some(out)
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

pub(crate) fn to_hex(b: &[u8]) -> String {
    const H: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(H[(x >> 4) as usize] as char);
        s.push(H[(x & 15) as usize] as char);
    }
    s
}

/// `N` random bytes from the OS (secrets and nonces).
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b)
        .map_err(|e| Error::Bootstrap(format!("cannot get random bytes from the OS: {e}")))?;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    const LOCAL4: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);

    #[test]
    fn unique_id_text_roundtrip() {
        let id = UniqueId {
            addr: "127.0.0.1:4000".parse().unwrap(),
            secret: [0xab; 16],
        };
        assert_eq!(
            id.to_string(),
            "127.0.0.1:4000/abababababababababababababababab"
        );
        assert_eq!(id.to_string().parse::<UniqueId>().unwrap(), id);
        let id6: UniqueId = "[::1]:4000/00112233445566778899aabbccddeeff"
            .parse()
            .unwrap();
        assert_eq!(id6.addr, "[::1]:4000".parse::<SocketAddr>().unwrap());
        assert_eq!(id6.secret[1], 0x11);
        assert_eq!(
            id6.to_string(),
            "[::1]:4000/00112233445566778899aabbccddeeff"
        );
        assert!(
            !format!("{id:?}").contains("abab"),
            "Debug must not leak the secret"
        );
        for bad in [
            "",
            "127.0.0.1:4000",
            "127.0.0.1/00112233445566778899aabbccddeeff",
            "127.0.0.1:4000/0011",
            "127.0.0.1:4000/00112233445566778899aabbccddeefg",
            "host:4000/00112233445566778899aabbccddeeff",
        ] {
            let e = bad.parse::<UniqueId>().unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e}");
            assert!(e.to_string().contains("<ip>:<port>/<32 hex digits>"), "{e}");
        }
        let g1 = UniqueId::generate(LOCAL4).unwrap();
        let g2 = UniqueId::generate(LOCAL4).unwrap();
        assert_ne!(g1.secret, g2.secret);
    }
}
