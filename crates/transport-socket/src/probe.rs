//! What this host offers the socket transport: its interfaces and their
//! addresses ([`list`]), the route to the root ([`route_source`]), and the
//! choice of the local address to listen on ([`choose`], pure).
//!
//! `BRAID_SOCKET_IFNAME` has the syntax of `NCCL_SOCKET_IFNAME`, parsed by
//! [`NameList`]: a comma-separated list of interface-name prefixes
//! (`eth,ib` matches `eth0`, `ib1`, ...); a leading `^` turns the list into
//! an exclusion list (`^docker,lo`), and a leading `=` (after the `^`, if
//! any) makes every entry an exact name (`=eth0`, `^=eth1`).
//!
//! Without it, the address is the one the kernel would use as the source to
//! reach the root (a UDP socket `connect`ed to the root, then
//! `getsockname`: no packet is sent). A loopback root means all ranks run on
//! one host, so loopback is fine then; otherwise loopback is never chosen.
//! Without a root either, NCCL's default applies: `ib*` interfaces first, then
//! anything but `lo*` and `docker*`; loopback only if nothing else is up.
//!
//! Among the addresses of the chosen interfaces, IPv4 comes first unless the
//! root is IPv6 (or `BRAID_SOCKET_FAMILY` says otherwise); global IPv6
//! addresses come before link-local ones (which carry their scope id).

use std::net::{IpAddr, Ipv6Addr, SocketAddr, SocketAddrV6, UdpSocket};

use braid_core::config::NameList;

/// An address family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// IPv4 (`AF_INET`).
    V4,
    /// IPv6 (`AF_INET6`).
    V6,
}

impl Family {
    /// Parses `4`, `6`, `ipv4`, `ipv6`, `AF_INET`, `AF_INET6` (any case).
    pub fn parse(s: &str) -> Option<Family> {
        match s.trim().to_ascii_lowercase().as_str() {
            "4" | "ipv4" | "inet" | "af_inet" | "v4" => Some(Family::V4),
            "6" | "ipv6" | "inet6" | "af_inet6" | "v6" => Some(Family::V6),
            _ => None,
        }
    }

    /// The family of `ip`.
    pub fn of(ip: &IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }
}

/// One address of one interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfAddr {
    /// Interface name (`eth0`).
    pub name: String,
    /// The address.
    pub ip: IpAddr,
    /// IPv6 scope id (interface index) for link-local addresses, else 0.
    pub scope_id: u32,
    /// Whether the interface is a loopback interface.
    pub loopback: bool,
}

impl IfAddr {
    /// The address with port 0 (and the scope id for IPv6).
    pub fn socket_addr(&self) -> SocketAddr {
        match self.ip {
            IpAddr::V4(ip) => SocketAddr::new(IpAddr::V4(ip), 0),
            IpAddr::V6(ip) => SocketAddr::V6(SocketAddrV6::new(ip, 0, 0, self.scope_id)),
        }
    }
}

/// The addresses of the interfaces that are up, in the order the kernel
/// lists them.
pub fn list() -> Result<Vec<IfAddr>, String> {
    use nix::net::if_::InterfaceFlags;
    let addrs = nix::ifaddrs::getifaddrs().map_err(|e| format!("getifaddrs failed: {e}"))?;
    let mut out = Vec::new();
    for a in addrs {
        if !a.flags.contains(InterfaceFlags::IFF_UP) {
            continue;
        }
        let Some(sa) = a.address else { continue };
        let loopback = a.flags.contains(InterfaceFlags::IFF_LOOPBACK);
        if let Some(v4) = sa.as_sockaddr_in() {
            out.push(IfAddr {
                name: a.interface_name.clone(),
                ip: IpAddr::V4(v4.ip()),
                scope_id: 0,
                loopback,
            });
        } else if let Some(v6) = sa.as_sockaddr_in6() {
            let ip = v6.ip();
            out.push(IfAddr {
                name: a.interface_name.clone(),
                ip: IpAddr::V6(ip),
                scope_id: if is_link_local(&ip) { v6.scope_id() } else { 0 },
                loopback,
            });
        }
    }
    Ok(out)
}

fn is_link_local(ip: &Ipv6Addr) -> bool {
    (ip.segments()[0] & 0xffc0) == 0xfe80
}

/// The source address the kernel would use to reach `root` (no packet is
/// sent).
pub fn route_source(root: SocketAddr) -> Option<IpAddr> {
    let bind: SocketAddr = match root {
        SocketAddr::V4(_) => "0.0.0.0:0".parse().ok()?,
        SocketAddr::V6(_) => "[::]:0".parse().ok()?,
    };
    let s = UdpSocket::bind(bind).ok()?;
    // Port 0 cannot be connected to; the port does not matter for routing.
    let mut to = root;
    if to.port() == 0 {
        to.set_port(9);
    }
    s.connect(to).ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then_some(ip)
}

/// Picks the listen address from `ifaces` (pure; see the module docs).
/// `route_src` is [`route_source`] of `root`.
pub fn choose(
    ifaces: &[IfAddr],
    spec: Option<&NameList>,
    family: Option<Family>,
    root: Option<SocketAddr>,
    route_src: Option<IpAddr>,
) -> Result<IfAddr, String> {
    let family_ok = |a: &&IfAddr| family.is_none_or(|f| Family::of(&a.ip) == f);
    let usable: Vec<&IfAddr> = ifaces
        .iter()
        .filter(|a| !a.ip.is_unspecified())
        .filter(family_ok)
        .collect();
    let root_loopback = root.is_some_and(|r| r.ip().is_loopback());
    let prefer_v6 = match family {
        Some(f) => f == Family::V6,
        None => root.is_some_and(|r| r.is_ipv6()),
    };
    // Ordering among candidates: preferred family first, global IPv6 before
    // link-local, then the kernel's order.
    let rank = |a: &IfAddr| -> u8 {
        let fam = u8::from((Family::of(&a.ip) == Family::V6) != prefer_v6);
        let ll = match a.ip {
            IpAddr::V6(ip) => u8::from(is_link_local(&ip)),
            IpAddr::V4(_) => 0,
        };
        fam * 2 + ll
    };
    let pick = |cands: Vec<&IfAddr>| -> Option<IfAddr> {
        if let Some(src) = route_src {
            if let Some(a) = cands.iter().find(|a| a.ip == src) {
                return Some((*a).clone());
            }
        }
        cands.into_iter().min_by_key(|a| rank(a)).cloned()
    };

    if let Some(spec) = spec {
        let cands: Vec<&IfAddr> = usable
            .iter()
            .copied()
            .filter(|a| spec.matches(&a.name))
            .collect();
        let names: Vec<&str> = ifaces.iter().map(|a| a.name.as_str()).collect();
        return pick(cands).ok_or_else(|| {
            format!(
                "no interface that is up matches BRAID_SOCKET_IFNAME={spec} \
                 (interfaces with addresses: {}); fix the variable or unset it",
                dedup(names).join(", ")
            )
        });
    }

    // The route to the root decides, when there is one.
    if let Some(src) = route_src {
        if let Some(a) = usable.iter().find(|a| a.ip == src) {
            if !a.loopback || root_loopback {
                return Ok((*a).clone());
            }
        }
    }
    if root_loopback {
        if let Some(a) = pick(usable.iter().copied().filter(|a| a.loopback).collect()) {
            return Ok(a);
        }
    }
    // NCCL's default: ib* first, then anything but lo and docker.
    let ib: Vec<&IfAddr> = usable
        .iter()
        .copied()
        .filter(|a| !a.loopback && a.name.starts_with("ib"))
        .collect();
    if let Some(a) = pick(ib) {
        return Ok(a);
    }
    let default_spec = NameList::parse("^docker,lo");
    let rest: Vec<&IfAddr> = usable
        .iter()
        .copied()
        .filter(|a| !a.loopback && default_spec.matches(&a.name))
        .collect();
    if let Some(a) = pick(rest) {
        return Ok(a);
    }
    if root.is_none() || root_loopback {
        // Nothing but loopback (and docker bridges): only one host can work.
        if let Some(a) = pick(usable.iter().copied().filter(|a| a.loopback).collect()) {
            return Ok(a);
        }
    }
    Err(match root {
        Some(r) => format!(
            "no usable interface to reach the root at {r} (only loopback or \
             docker interfaces are up); set BRAID_SOCKET_IFNAME"
        ),
        None => "no network interface with an address is up; set BRAID_SOCKET_IFNAME".into(),
    })
}

fn dedup(mut v: Vec<&str>) -> Vec<&str> {
    let mut seen = Vec::new();
    v.retain(|n| {
        if seen.contains(n) {
            false
        } else {
            seen.push(*n);
            true
        }
    });
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(name: &str, ip: &str) -> IfAddr {
        let ip: IpAddr = ip.parse().unwrap();
        IfAddr {
            name: name.into(),
            loopback: name == "lo",
            scope_id: match ip {
                IpAddr::V6(v6) if is_link_local(&v6) => 2,
                _ => 0,
            },
            ip,
        }
    }

    fn host() -> Vec<IfAddr> {
        vec![
            a("lo", "127.0.0.1"),
            a("docker0", "172.17.0.1"),
            a("eth0", "10.0.0.5"),
            a("eth1", "192.168.1.5"),
            a("lo", "::1"),
            a("eth0", "fe80::1"),
            a("eth0", "2001:db8::5"),
            a("ib0", "fd00::7"),
        ]
    }

    /// `BRAID_SOCKET_IFNAME` as [`NameList`] reads it.
    #[test]
    fn ifname_syntax() {
        let s = NameList::parse("eth,ib");
        assert!(s.matches("eth0") && s.matches("ib1") && !s.matches("lo") && !s.matches("en0"));
        let s = NameList::parse("^docker,lo");
        assert!(!s.matches("docker0") && !s.matches("lo") && s.matches("eth0"));
        let s = NameList::parse("=eth0");
        assert!(s.matches("eth0") && !s.matches("eth01") && !s.matches("eth1"));
        let s = NameList::parse("^=eth0");
        assert!(!s.matches("eth0") && s.matches("eth01"));
        let s = NameList::parse(" eth0 , ,ib ");
        let names: Vec<&str> = s.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["eth0", "ib"]);
        assert!(!NameList::parse("").matches("eth0"));
        assert!(NameList::parse("^").matches("eth0"));
    }

    #[test]
    fn family_parse() {
        assert_eq!(Family::parse("AF_INET"), Some(Family::V4));
        assert_eq!(Family::parse("af_inet6"), Some(Family::V6));
        assert_eq!(Family::parse("6"), Some(Family::V6));
        assert_eq!(Family::parse("x"), None);
    }

    #[test]
    fn ifname_picks_ipv4_first_then_ipv6() {
        let h = host();
        let eth0 = NameList::parse("=eth0");
        assert_eq!(
            choose(&h, Some(&eth0), None, None, None).unwrap().ip,
            "10.0.0.5".parse::<IpAddr>().unwrap()
        );
        // An IPv6 root prefers IPv6, global before link-local.
        let root6: SocketAddr = "[2001:db8::1]:4000".parse().unwrap();
        assert_eq!(
            choose(&h, Some(&eth0), None, Some(root6), None).unwrap().ip,
            "2001:db8::5".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            choose(&h, Some(&eth0), Some(Family::V6), None, None)
                .unwrap()
                .ip,
            "2001:db8::5".parse::<IpAddr>().unwrap()
        );
        let ib = NameList::parse("ib");
        assert_eq!(
            choose(&h, Some(&ib), Some(Family::V4), None, None).unwrap_err()[..9],
            *"no interf"
        );
        // Exclusion list.
        let not = NameList::parse("^eth,lo,docker");
        assert_eq!(
            choose(&h, Some(&not), None, None, None).unwrap().name,
            "ib0"
        );
    }

    #[test]
    fn ifname_may_choose_loopback_explicitly() {
        let lo = NameList::parse("=lo");
        assert_eq!(
            choose(&host(), Some(&lo), None, None, None).unwrap().ip,
            "127.0.0.1".parse::<IpAddr>().unwrap()
        );
    }

    #[test]
    fn route_to_root_decides() {
        let h = host();
        let root: SocketAddr = "192.168.1.1:29500".parse().unwrap();
        let got = choose(
            &h,
            None,
            None,
            Some(root),
            Some("192.168.1.5".parse().unwrap()),
        );
        assert_eq!(got.unwrap().name, "eth1");
        // A root on this host is reached through lo but from the eth address.
        let root: SocketAddr = "10.0.0.5:29500".parse().unwrap();
        let got = choose(
            &h,
            None,
            None,
            Some(root),
            Some("10.0.0.5".parse().unwrap()),
        );
        assert_eq!(got.unwrap().name, "eth0");
    }

    #[test]
    fn never_loopback_for_a_remote_root() {
        let h = host();
        let root: SocketAddr = "10.9.9.9:1".parse().unwrap();
        // Even if the route lookup claims loopback, a remote root never gets it.
        let got = choose(
            &h,
            None,
            None,
            Some(root),
            Some("127.0.0.1".parse().unwrap()),
        );
        let got = got.unwrap();
        assert!(!got.loopback, "{got:?}");
        let only_lo = vec![a("lo", "127.0.0.1"), a("docker0", "172.17.0.1")];
        assert!(choose(&only_lo, None, None, Some(root), None).is_err());
    }

    #[test]
    fn loopback_root_is_fine() {
        let h = host();
        let root: SocketAddr = "127.0.0.1:29500".parse().unwrap();
        let got = choose(
            &h,
            None,
            None,
            Some(root),
            Some("127.0.0.1".parse().unwrap()),
        );
        assert_eq!(got.unwrap().ip, "127.0.0.1".parse::<IpAddr>().unwrap());
        let root: SocketAddr = "[::1]:29500".parse().unwrap();
        let got = choose(&h, None, None, Some(root), None);
        assert_eq!(got.unwrap().ip, "::1".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn default_prefers_ib_and_skips_docker_and_lo() {
        let h = host();
        assert_eq!(choose(&h, None, None, None, None).unwrap().name, "ib0");
        let no_ib: Vec<IfAddr> = h.into_iter().filter(|x| x.name != "ib0").collect();
        let got = choose(&no_ib, None, None, None, None).unwrap();
        assert_eq!(got.ip, "10.0.0.5".parse::<IpAddr>().unwrap());
        let only_lo = vec![a("lo", "127.0.0.1"), a("docker0", "172.17.0.1")];
        assert!(choose(&only_lo, None, None, None, None).unwrap().loopback);
    }

    #[test]
    fn link_local_keeps_its_scope() {
        let h = vec![a("eth0", "fe80::1")];
        let got = choose(&h, None, Some(Family::V6), None, None).unwrap();
        match got.socket_addr() {
            SocketAddr::V6(v6) => assert_eq!(v6.scope_id(), 2),
            other => panic!("{other}"),
        }
    }

    #[test]
    fn this_host_lists_loopback() {
        let l = list().unwrap();
        assert!(l.iter().any(|a| a.ip.is_loopback()), "{l:?}");
        let lo = route_source("127.0.0.1:1".parse().unwrap());
        assert_eq!(lo, Some("127.0.0.1".parse().unwrap()));
    }
}
