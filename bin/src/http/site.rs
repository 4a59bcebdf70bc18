//! Requests that web pages of other sites make a browser send. Without authentication (the
//! embedded default) the API would do what any page the operator visits asks:
//!
//! - a write from another site's page (a form, or `fetch` with `mode: "no-cors"`, which a
//!   browser sends without asking first) carries an `Origin` that is not this service: refused,
//!   403 `cross_site`. Clients that are not browsers send no `Origin`, and pass.
//! - a page whose DNS name its site points at this service's address (DNS rebinding) is of the
//!   same origin as far as the browser knows, and may read the answers: its `Host` is not one
//!   of `http.allowed_hosts` (by default, on a loopback address, `localhost` and loopback
//!   addresses only): refused, 403 `host_not_allowed`, reads too.
//!
//! This module imports nothing else of the binary but the error type.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;

/// The host names the API answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hosts {
    /// Any name.
    Any,
    /// `localhost` (and its subdomains) and loopback addresses.
    Loopback,
    /// These names (lowercase), and loopback ones.
    Named(Vec<String>),
}

impl Hosts {
    /// What `http.allowed_hosts` (and `http.addr`, when it is unset) allow.
    pub fn of(allowed: Option<&[String]>, listens_on_loopback: bool) -> Self {
        match allowed {
            None if listens_on_loopback => Hosts::Loopback,
            None => Hosts::Any,
            Some([]) => Hosts::Any,
            Some(names) => Hosts::Named(names.iter().map(|n| n.to_ascii_lowercase()).collect()),
        }
    }

    fn allows(&self, name: &str) -> bool {
        let loopback = || {
            name == "localhost"
                || name.ends_with(".localhost")
                || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
        };
        match self {
            Hosts::Any => true,
            Hosts::Loopback => loopback(),
            Hosts::Named(names) => names.iter().any(|n| n == name) || loopback(),
        }
    }

    /// Whether a page of `origin` is one of the names listed in `http.allowed_hosts`: behind a
    /// reverse proxy that sends its own `Host` upstream, the dashboard's pages come from the
    /// public name the operator listed there.
    fn lists_origin(&self, origin: &str) -> bool {
        let Hosts::Named(names) = self else {
            return false;
        };
        origin_of(origin).is_some_and(|(host, _)| names.contains(&host))
    }
}

/// The host name and port a request was sent to: its URI's authority (HTTP/2), else its `Host`
/// header; the name lowercase, an IPv6 address without brackets.
fn target(request: &Request) -> Option<(String, Option<u16>)> {
    let authority = match request.uri().authority() {
        Some(authority) => authority.clone(),
        None => request
            .headers()
            .get(header::HOST)?
            .to_str()
            .ok()?
            .parse()
            .ok()?,
    };
    let name = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    Some((name.to_ascii_lowercase(), authority.port_u16()))
}

/// The host name of `origin` (`scheme://host[:port]`), lowercase, an IPv6 address without
/// brackets, with its port (the scheme's default when it names none).
fn origin_of(origin: &str) -> Option<(String, Option<u16>)> {
    let origin = url::Url::parse(origin).ok()?;
    let host = origin
        .host_str()?
        .trim_start_matches('[')
        .trim_end_matches(']');
    Some((host.to_ascii_lowercase(), origin.port_or_known_default()))
}

/// Whether the page of `origin` is of the site the request was sent to (`name`, `port`; a
/// `Host` without a port names the default port of the origin's scheme).
fn same_site(origin: &str, name: &str, port: Option<u16>) -> bool {
    let Some((host, origin_port)) = origin_of(origin) else {
        return false;
    };
    let default = match origin.split_once("://").map(|(scheme, _)| scheme) {
        Some(scheme) if scheme.eq_ignore_ascii_case("https") => Some(443),
        Some(scheme) if scheme.eq_ignore_ascii_case("http") => Some(80),
        _ => None,
    };
    host == name && port.or(default) == origin_port
}

/// The middleware (see the module's text).
pub async fn guard(State(hosts): State<Arc<Hosts>>, request: Request, next: Next) -> Response {
    // A browser always names the host; a request without one is not a page's.
    let target = target(&request);
    if let Some((name, _)) = target.as_ref().filter(|(name, _)| !hosts.allows(name)) {
        let message = format!(
            "this service does not answer for the host name {name:?} (http.allowed_hosts: a web \
             page whose DNS name points at this address must not reach it)"
        );
        return ApiError::new(StatusCode::FORBIDDEN, "host_not_allowed", message).into_response();
    }
    let reads = matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS
    );
    let origin = request
        .headers()
        .get(header::ORIGIN)
        .map(|o| o.to_str().unwrap_or("null"));
    if let (false, Some(origin)) = (reads, origin) {
        let own = target
            .as_ref()
            .is_some_and(|(name, port)| same_site(origin, name, *port));
        if !own && !hosts.lists_origin(origin) {
            let message = format!(
                "a write from a web page of another site (Origin {origin}) is refused: the API \
                 takes writes from its own pages and from clients that send no Origin"
            );
            return ApiError::new(StatusCode::FORBIDDEN, "cross_site", message).into_response();
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names_and_the_named_ones_are_allowed() {
        let loopback = Hosts::of(None, true);
        for name in [
            "localhost",
            "app.localhost",
            "127.0.0.1",
            "127.3.4.5",
            "::1",
        ] {
            assert!(loopback.allows(name), "{name}");
        }
        for name in ["evil.example", "10.0.0.1", "localhost.evil.example"] {
            assert!(!loopback.allows(name), "{name}");
        }
        assert_eq!(Hosts::of(None, false), Hosts::Any);
        assert_eq!(Hosts::of(Some(&[]), true), Hosts::Any);
        let named = Hosts::of(Some(&["Timers.Example.com".to_owned()]), false);
        assert!(named.allows("timers.example.com") && named.allows("127.0.0.1"));
        assert!(!named.allows("evil.example"));
    }

    #[test]
    fn an_origin_is_of_the_site_when_name_and_port_match() {
        assert!(same_site("http://127.0.0.1:8080", "127.0.0.1", Some(8080)));
        assert!(same_site("http://LocalHost:8080", "localhost", Some(8080)));
        assert!(same_site(
            "https://timers.example.com",
            "timers.example.com",
            None
        ));
        assert!(same_site(
            "https://timers.example.com",
            "timers.example.com",
            Some(443)
        ));
        assert!(same_site("http://[::1]:8080", "::1", Some(8080)));
        assert!(!same_site("http://127.0.0.1:9999", "127.0.0.1", Some(8080)));
        assert!(!same_site("https://evil.example", "127.0.0.1", Some(8080)));
        assert!(!same_site("null", "127.0.0.1", Some(8080)));
        // A Host without a port is the scheme's default port, not any port.
        assert!(same_site("http://localhost", "localhost", None));
        assert!(!same_site("http://localhost:3000", "localhost", None));
        assert!(!same_site(
            "https://timers.example.com:8443",
            "timers.example.com",
            None
        ));
    }

    #[test]
    fn an_origin_among_the_allowed_hosts_may_write() {
        let named = Hosts::of(Some(&["timers.example.com".to_owned()]), true);
        assert!(named.lists_origin("https://Timers.Example.com"));
        assert!(!named.lists_origin("https://evil.example"));
        assert!(!Hosts::of(None, true).lists_origin("http://localhost:3000"));
    }
}
