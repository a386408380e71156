//! The transport conformance suite (braid-conformance), run against the socket
//! transport over loopback with a few geometries and socket counts.

use braid_transport_socket::{SocketConfig, SocketTransport};

fn over(addr: &str, slot_bytes: usize, slots: usize, nsocks: usize) -> SocketTransport {
    let cfg = SocketConfig::default()
        .with_addr(addr.parse().unwrap())
        .with_geometry(slot_bytes, slots)
        .with_nsocks(nsocks);
    SocketTransport::new(cfg).unwrap()
}

/// IPv4 loopback, small slots, 4 data sockets (slot_bytes = the stripe
/// minimum, so full slots are one piece).
mod v4 {
    use super::*;
    braid_conformance::transport_conformance_tests!(|| over("127.0.0.1", 64 * 1024, 4, 4));
}

/// IPv4 loopback, slots that stripe over 3 sockets, odd slot count.
mod v4_striped {
    use super::*;
    braid_conformance::transport_conformance_tests!(|| over("127.0.0.1", 192 * 1024 + 64, 3, 3));
}

/// One data socket, tiny slots.
mod v4_one_socket {
    use super::*;
    braid_conformance::transport_conformance_tests!(|| over("127.0.0.1", 4096 + 64, 2, 1));
}

/// IPv6 loopback where the host has it; elsewhere IPv4 (with a message).
mod v6 {
    use super::*;
    fn v6_addr() -> &'static str {
        static ONCE: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
        ONCE.get_or_init(|| {
            if std::net::TcpListener::bind("[::1]:0").is_ok() {
                "::1"
            } else {
                eprintln!(
                    "IPv6 loopback (::1) unavailable here: the v6 module runs over 127.0.0.1"
                );
                "127.0.0.1"
            }
        })
    }
    braid_conformance::transport_conformance_tests!(|| over(v6_addr(), 64 * 1024, 4, 2));
}
