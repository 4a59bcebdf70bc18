//! Which addresses a webhook may reach while `webhooks.allow_private_networks` is off: public
//! ones only. Literal addresses are checked at schedule time and again at each call; names are
//! resolved at each call by [`PublicOnly`], which hands the HTTP client only the public addresses
//! of the answer, so the client connects to nothing else (a name that changes its answer between
//! the check and the call cannot rebind around it).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use reqwest::dns::{Addrs, Name, Resolve, Resolving};

/// Why `ip` is not public (loopback, private, link-local …), or `None` when it is. An IPv6
/// address that carries an IPv4 one (mapped, compatible, 6to4) is judged by that one; NAT64,
/// Teredo and site-local prefixes, which reach IPv4 or local networks by translation, are not
/// public.
pub fn not_public(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => not_public_v4(v4),
        IpAddr::V6(v6) => match embedded_v4(v6) {
            Some(v4) => not_public_v4(v4),
            None => not_public_v6(v6),
        },
    }
}

/// The IPv4 address an IPv6 one carries: IPv4-mapped (`::ffff:a.b.c.d`), IPv4-compatible
/// (`::a.b.c.d`, but `::` and `::1`), 6to4 (`2002:AABB:CCDD::`).
fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    if let Some(v4) = ip.to_ipv4_mapped() {
        return Some(v4);
    }
    let s = ip.segments();
    let v4 = |hi: u16, lo: u16| Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo));
    if s[..6] == [0; 6] && !ip.is_loopback() && !ip.is_unspecified() {
        return Some(v4(s[6], s[7]));
    }
    if s[0] == 0x2002 {
        return Some(v4(s[1], s[2]));
    }
    None
}

fn not_public_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    if ip.is_loopback() {
        Some("a loopback address")
    } else if ip.is_private() {
        Some("a private address")
    } else if ip.is_link_local() {
        Some("a link-local address (cloud metadata services live there)")
    } else if ip.is_unspecified() || a == 0 {
        Some("an unspecified address")
    } else if a == 100 && (64..128).contains(&b) {
        Some("a shared (carrier-grade NAT) address")
    } else if (a, b, c) == (192, 0, 0) || (a == 198 && (b == 18 || b == 19)) {
        Some("a reserved address (IETF protocol assignments, benchmarking)")
    } else if matches!((a, b, c), (192, 0, 2) | (198, 51, 100) | (203, 0, 113)) {
        Some("a documentation address")
    } else if ip.is_broadcast() || ip.is_multicast() || a >= 240 {
        Some("a broadcast, multicast or reserved address")
    } else {
        None
    }
}

fn not_public_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    if ip.is_loopback() {
        Some("a loopback address")
    } else if ip.is_unspecified() {
        Some("an unspecified address")
    } else if s[0] & 0xfe00 == 0xfc00 {
        Some("a unique local (private) address")
    } else if s[0] & 0xffc0 == 0xfe80 || s[0] & 0xffc0 == 0xfec0 {
        Some("a link-local or site-local address")
    } else if s[0] == 0x64 && s[1] == 0xff9b {
        Some("a NAT64 address (it reaches IPv4 addresses, private ones too)")
    } else if s[0] == 0x2001 && s[1] == 0 {
        Some("a Teredo address")
    } else if ip.is_multicast() {
        Some("a multicast address")
    } else {
        None
    }
}

/// Resolves names to their public addresses only.
pub struct PublicOnly;

impl Resolve for PublicOnly {
    fn resolve(&self, name: Name) -> Resolving {
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let all: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let public: Vec<SocketAddr> = all
                .iter()
                .copied()
                .filter(|a| not_public(a.ip()).is_none())
                .collect();
            if public.is_empty() {
                let why = all
                    .first()
                    .and_then(|a| not_public(a.ip()))
                    .unwrap_or("no address");
                let message = format!(
                    "{host} resolves to {why}, not a public one (webhooks.allow_private_networks is off)"
                );
                return Err(message.into());
            }
            let addrs: Addrs = Box::new(public.into_iter());
            Ok(addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_pass() {
        for blocked in [
            "127.0.0.1",
            "10.0.0.1",
            "172.16.5.4",
            "192.168.1.1",
            "169.254.169.254",
            "100.100.100.200",
            "0.0.0.0",
            "255.255.255.255",
            "::1",
            "::",
            "fd00:ec2::254",
            "fe80::1",
            "fec0::1",
            "::ffff:10.0.0.1",
            "::127.0.0.1",
            "::10.0.0.1",
            "64:ff9b::a00:1",
            "64:ff9b:1::1",
            "2002:7f00:1::",
            "2001:0:4136:e378::1",
            "192.0.0.8",
            "198.18.0.1",
            "192.0.2.1",
            "203.0.113.9",
        ] {
            let ip: IpAddr = blocked.parse().unwrap();
            assert!(not_public(ip).is_some(), "{blocked} passed");
        }
        for open in [
            "93.184.216.34",
            "1.1.1.1",
            "2606:4700:4700::1111",
            "2002:5db8:d822::",
        ] {
            let ip: IpAddr = open.parse().unwrap();
            assert_eq!(not_public(ip), None, "{open}");
        }
    }

    #[tokio::test]
    async fn names_of_loopback_resolve_to_nothing() {
        let refused = PublicOnly
            .resolve("localhost".parse().unwrap())
            .await
            .err()
            .map(|e| e.to_string());
        let refused = refused.unwrap_or_default();
        assert!(
            refused.contains("localhost resolves to a loopback address"),
            "{refused}"
        );
    }
}
