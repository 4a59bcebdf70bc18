//! Who calls the API and what they may do.
//!
//! A caller shows a bearer token: an API key of `http.keys` (the config holds its SHA-256, never
//! the key), the single `http.token` (a key for every tenant with every scope), or a JWT checked
//! against `http.jwt`. Either way the caller becomes a [`Principal`]: a name for logs, the tenants
//! it may use and its scopes (`read`, `write`, `admin`).
//!
//! Every route has a [`Rule`] ([`rule`]); a route without one is refused, and a test checks that
//! every route of the OpenAPI document has one. Routes with `{tenant}` in their path are checked
//! here before their handler runs (GET and HEAD need `read`, every other method `write`), so a
//! refusal (403) is the same whether or not the timer exists. Routes whose tenants are in the
//! body or that span tenants (`POST /v1/timers`, the batch, `/v1/commands`, the summary, the
//! event stream) get the [`Principal`] as a request extension and check or filter each item.
//!
//! Every request that is not a GET or HEAD leaves one audit line (target
//! `timer_service::audit`): key name, tenant, action, timer id, HTTP status and the API's
//! outcome code.

mod guard;
mod jwt;

use std::collections::BTreeSet;
use std::sync::Arc;

use axum::http::{Method, StatusCode};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use timer_core::wire::{addressed, Addressed};
use timer_core::Error;

pub use crate::config::auth::Scope;
use crate::config::HttpConfig;
use crate::http::error::ApiError;
pub use guard::guard;
use jwt::Jwt;

/// The tenants a caller may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tenants {
    All,
    Only(BTreeSet<String>),
}

impl Tenants {
    pub(super) fn from_list<S: AsRef<str>>(list: &[S]) -> Tenants {
        if list.iter().any(|t| t.as_ref() == "*") {
            Tenants::All
        } else {
            Tenants::Only(list.iter().map(|t| t.as_ref().to_owned()).collect())
        }
    }
}

/// A caller, once its token is checked.
#[derive(Debug, Clone)]
pub struct Principal {
    /// The key's name (`jwt:<sub>` for a JWT; `token` for `http.token`; `anonymous` when the API
    /// has no authentication).
    pub name: Arc<str>,
    pub tenants: Tenants,
    scopes: BTreeSet<Scope>,
    /// When its credential stops being valid (a JWT's `exp`); `None` for keys and tokens. A
    /// request is checked when it arrives; what lasts (the event stream) ends then.
    pub expires_at: Option<std::time::SystemTime>,
}

impl Principal {
    /// Everything: the API without authentication.
    pub fn anonymous() -> Principal {
        Principal {
            name: "anonymous".into(),
            tenants: Tenants::All,
            scopes: Scope::ALL.into_iter().collect(),
            expires_at: None,
        }
    }

    pub fn has(&self, scope: Scope) -> bool {
        self.scopes.contains(&scope)
    }

    pub fn may_use(&self, tenant: &str) -> bool {
        match &self.tenants {
            Tenants::All => true,
            Tenants::Only(set) => set.contains(tenant),
        }
    }

    /// 403 unless the caller has `scope`.
    pub fn need(&self, scope: Scope) -> Result<(), Forbidden> {
        if self.has(scope) {
            return Ok(());
        }
        Err(Forbidden::new(format!(
            "key {:?} lacks the {} scope this route needs",
            self.name,
            scope.as_str()
        )))
    }

    /// 403 unless the caller may use `tenant` (given in the body's `field`, when not in the
    /// path). The answer only repeats what the caller sent, so it says nothing about whether the
    /// tenant has timers.
    pub fn need_tenant(&self, tenant: &str, field: Option<&'static str>) -> Result<(), Forbidden> {
        if self.may_use(tenant) {
            return Ok(());
        }
        Err(Forbidden {
            field,
            message: format!("key {:?} may not use tenant {tenant:?}", self.name),
        })
    }

    /// 403 when a command names (`tenantId`, as [`addressed`] read it) a tenant this key may
    /// not use: asked before the command is checked, so a key learns nothing of another
    /// tenant's rules (its targets, its broker's limits) from the answer. A command without a
    /// readable tenant passes: its check refuses it.
    pub fn need_tenant_of(&self, command: &Addressed) -> Result<(), Forbidden> {
        match &command.tenant_id {
            Some(tenant) => self.need_tenant(tenant, Some("tenantId")),
            None => Ok(()),
        }
    }
}

/// The tenant a command names, read alone as the decoder reads it (nothing else of it is
/// checked).
pub fn tenant_named(body: &[u8]) -> Option<String> {
    addressed(body).tenant_id
}

/// `answer` with the tenant and timer its command named (as [`addressed`] read them), for its
/// audit line where the path names none: refused or not.
pub fn audited(
    command: Addressed,
    answer: impl axum::response::IntoResponse,
) -> axum::response::Response {
    let mut response = answer.into_response();
    response.extensions_mut().insert(command);
    response
}

/// A refusal: 403 `forbidden`, naming the field of the body it is about.
#[derive(Debug)]
pub struct Forbidden {
    field: Option<&'static str>,
    message: String,
}

impl Forbidden {
    pub fn new(message: impl Into<String>) -> Forbidden {
        Forbidden {
            field: None,
            message: message.into(),
        }
    }
}

impl From<Forbidden> for ApiError {
    fn from(refused: Forbidden) -> Self {
        let error = ApiError::new(StatusCode::FORBIDDEN, "forbidden", refused.message);
        match refused.field {
            Some(field) => error.field(field),
            None => error,
        }
    }
}

/// A configured key: its hash and what it may do.
struct Key {
    hash: [u8; 32],
    principal: Principal,
}

/// Checks bearer tokens: the keys (and `http.token`) by hash, JWTs by signature and claims.
pub struct Auth {
    keys: Vec<Key>,
    jwt: Option<Jwt>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("keys", &self.keys.len())
            .field("jwt", &self.jwt.is_some())
            .finish()
    }
}

/// SHA-256 of `key` as 64 lowercase hex digits: what `[[http.keys]] sha256` holds.
pub fn hash_token(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn parse_hash(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

impl Auth {
    /// Whether callers come with different names (several keys, or JWTs): with `http.token`
    /// alone every caller is one.
    pub fn tells_apart(&self) -> bool {
        self.keys.len() > 1 || self.jwt.is_some()
    }

    /// The checker for `http`'s keys, token and JWT settings; `None` when none is set (the API is
    /// open). Errors name the key that is wrong, never its value.
    pub fn from_config(http: &HttpConfig) -> Result<Option<Auth>, Error> {
        let mut keys = Vec::new();
        if let Some(token) = &http.token {
            keys.push(Key {
                hash: Sha256::digest(token.as_bytes()).into(),
                principal: Principal {
                    name: "token".into(),
                    ..Principal::anonymous()
                },
            });
        }
        let mut names = BTreeSet::new();
        for (i, key) in http.keys.iter().enumerate() {
            let at = format!("http.keys[{i}]");
            if key.name.trim().is_empty() {
                return Err(Error::config(format!("{at}.name is empty")));
            }
            if !names.insert(key.name.as_str()) || key.name == "token" && http.token.is_some() {
                return Err(Error::config(format!(
                    "{at}.name {:?} is used twice (names tell keys apart in the audit log)",
                    key.name
                )));
            }
            let Some(hash) = parse_hash(&key.sha256) else {
                return Err(Error::config(format!(
                    "{at}.sha256 (key {:?}) is not 64 hex digits: it holds the key's SHA-256 \
                     (`timer-service hash-token KEY` prints it), not the key",
                    key.name
                )));
            };
            if keys.iter().any(|k| k.hash == hash) {
                return Err(Error::config(format!(
                    "{at}.sha256 (key {:?}) is the hash of another key too",
                    key.name
                )));
            }
            if key.tenants.is_empty() || key.tenants.iter().any(|t| t.is_empty()) {
                return Err(Error::config(format!(
                    "{at}.tenants (key {:?}) must list tenants, or be [\"*\"] for all",
                    key.name
                )));
            }
            if key.scopes.is_empty() {
                return Err(Error::config(format!(
                    "{at}.scopes (key {:?}) is empty (read, write, admin)",
                    key.name
                )));
            }
            keys.push(Key {
                hash,
                principal: Principal {
                    name: key.name.as_str().into(),
                    tenants: Tenants::from_list(&key.tenants),
                    scopes: key.scopes.iter().copied().collect(),
                    expires_at: None,
                },
            });
        }
        let jwt = http.jwt.as_ref().map(Jwt::new).transpose()?;
        if keys.is_empty() && jwt.is_none() {
            return Ok(None);
        }
        Ok(Some(Auth { keys, jwt }))
    }

    /// The caller behind `bearer`, or why it is refused (a message that never repeats the
    /// token).
    pub fn authenticate(&self, bearer: &str) -> Result<Principal, String> {
        let hash: [u8; 32] = Sha256::digest(bearer.as_bytes()).into();
        // Every key is compared, in constant time, so timing tells nothing about which matched.
        let mut found = None;
        for key in &self.keys {
            if bool::from(key.hash.ct_eq(&hash)) {
                found = Some(&key.principal);
            }
        }
        if let Some(principal) = found {
            return Ok(principal.clone());
        }
        match &self.jwt {
            Some(jwt) if bearer.split('.').count() == 3 => jwt.verify(bearer),
            _ => Err("unknown bearer token".into()),
        }
    }
}

/// What a route needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// The scope, on the tenant of the path (`{tenant}`).
    Tenant(Scope),
    /// The scope; the handler checks or filters the tenants of what it touches.
    Each(Scope),
    /// Any caller with a valid token.
    Authenticated,
}

/// The rule of a route, by method and path pattern; `None` for a route nobody gave one (it is
/// refused).
pub fn rule(method: &Method, path: &str) -> Option<Rule> {
    let read_or_write = if reads(method) {
        Scope::Read
    } else {
        Scope::Write
    };
    if path.starts_with("/v1/tenants/{tenant}/") {
        return Some(Rule::Tenant(read_or_write));
    }
    match path {
        "/v1/timers" | "/v1/timers/batch" | "/v1/commands" | "/v1/summary" | "/v1/events" => {
            Some(Rule::Each(read_or_write))
        }
        "/v1/status" | "/v1/dead-letters" => Some(Rule::Each(Scope::Admin)),
        "/v1/openapi.json" => Some(Rule::Authenticated),
        _ => None,
    }
}

/// Whether a request of `method` only reads: GET, and HEAD (which axum answers with the GET
/// route's handler, without the body).
pub fn reads(method: &Method) -> bool {
    *method == Method::GET || *method == Method::HEAD
}

#[cfg(test)]
mod tests;
