//! Who calls the API and what they may do.
//!
//! A caller shows a bearer token: an API key of `http.keys` (the config holds its SHA-256, never
//! the key), the single `http.token` (a key for every tenant with every scope), or a JWT checked
//! against `http.jwt`. Either way the caller becomes a [`Principal`]: a name for logs, the tenants
//! it may use and its scopes (`read`, `write`, `admin`).
//!
//! Every route has a [`Rule`] ([`rule`]); a route without one is refused, and a test checks that
//! every route of the OpenAPI document has one. Routes with `{tenant}` in their path are checked
//! here before their handler runs (GET needs `read`, every other method `write`), so a refusal
//! (403) is the same whether or not the timer exists. Routes whose tenants are in the body or
//! that span tenants (`POST /v1/timers`, the batch, `/v1/commands`, the summary, the event
//! stream) get the [`Principal`] as a request extension and check or filter each item.
//!
//! Every request that is not a GET leaves one audit line (target `timer_service::audit`): key
//! name, tenant, action, timer id, HTTP status and the API's outcome code.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::{FromRequestParts, MatchedPath, RawPathParams, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use timer_core::Error;

use crate::http::error_body;

/// What a caller may do. `admin` is for the routes about the whole service (`/v1/status`,
/// `/v1/dead-letters`); it does not imply the others.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Read timers, lists, history, summaries and the event stream of the key's tenants.
    Read,
    /// Schedule, cancel, pause, resume, retry, trigger and bulk actions on the key's tenants.
    Write,
    /// The operator routes about the whole service.
    Admin,
}

impl Scope {
    pub const ALL: [Scope; 3] = [Scope::Read, Scope::Write, Scope::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Write => "write",
            Scope::Admin => "admin",
        }
    }

    fn parse(word: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|s| s.as_str() == word)
    }
}

/// One API key of `[[http.keys]]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// Shown in logs and audit lines instead of the key.
    pub name: String,
    /// SHA-256 of the key, 64 hex digits (`timer-service hash-token KEY` prints it).
    pub sha256: String,
    /// The tenants the key may use, or `["*"]` for every tenant.
    pub tenants: Vec<String>,
    /// `read`, `write`, `admin`.
    pub scopes: Vec<Scope>,
}

/// `[http.jwt]`: bearer tokens signed by an identity provider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    /// Shared secret for HS256 tokens (at least 32 bytes). Either this or `jwks_file`.
    pub hs256_secret: Option<String>,
    /// A JWKS file (`{"keys": [...]}`) with the public keys of RS256 and ES256 tokens, chosen by
    /// the token's `kid`. Read at start.
    pub jwks_file: Option<PathBuf>,
    /// The `aud` a token must name (required: a token issued for another service is refused).
    pub audience: String,
    /// The `iss` a token must name, when set.
    pub issuer: Option<String>,
    /// The claim with the tenants: a list of strings, or `"*"`.
    #[serde(default = "default_tenants_claim")]
    pub tenants_claim: String,
    /// The claim with the scopes: space-separated as in OAuth 2 (`"read write"`), or a list.
    /// Words other than read, write and admin are ignored.
    #[serde(default = "default_scopes_claim")]
    pub scopes_claim: String,
}

fn default_tenants_claim() -> String {
    "tenants".into()
}

fn default_scopes_claim() -> String {
    "scope".into()
}

/// The tenants a caller may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tenants {
    All,
    Only(BTreeSet<String>),
}

impl Tenants {
    fn from_list<S: AsRef<str>>(list: &[S]) -> Tenants {
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

impl IntoResponse for Forbidden {
    fn into_response(self) -> Response {
        error_body(
            StatusCode::FORBIDDEN,
            "forbidden",
            self.field,
            &self.message,
        )
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
    /// The checker for `http`'s keys, token and JWT settings; `None` when none is set (the API is
    /// open). Errors name the key that is wrong, never its value.
    pub fn from_config(http: &crate::config::HttpConfig) -> Result<Option<Auth>, Error> {
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

/// How JWTs are checked.
struct Jwt {
    keys: JwtKeys,
    validation: Validation,
    tenants_claim: String,
    scopes_claim: String,
}

enum JwtKeys {
    Secret(DecodingKey),
    /// `(kid, algorithm, key)` of each usable JWKS entry.
    Set(Vec<(Option<String>, Algorithm, DecodingKey)>),
}

/// Algorithms a JWKS key may have.
const PUBLIC_KEY_ALGORITHMS: [Algorithm; 2] = [Algorithm::RS256, Algorithm::ES256];

impl Jwt {
    fn new(config: &JwtConfig) -> Result<Jwt, Error> {
        let keys = match (&config.hs256_secret, &config.jwks_file) {
            (Some(secret), None) => {
                if secret.len() < 32 {
                    return Err(Error::config(
                        "http.jwt.hs256_secret is shorter than 32 bytes (HS256 needs a key at \
                         least as long as its hash)",
                    ));
                }
                JwtKeys::Secret(DecodingKey::from_secret(secret.as_bytes()))
            }
            (None, Some(file)) => JwtKeys::Set(read_jwks(file)?),
            _ => {
                return Err(Error::config(
                    "http.jwt needs exactly one of hs256_secret (HS256) and jwks_file \
                     (RS256/ES256)",
                ))
            }
        };
        if config.audience.trim().is_empty() {
            return Err(Error::config("http.jwt.audience is empty"));
        }
        let mut validation = Validation::new(Algorithm::HS256);
        validation.algorithms = match keys {
            JwtKeys::Secret(_) => vec![Algorithm::HS256],
            JwtKeys::Set(_) => PUBLIC_KEY_ALGORITHMS.to_vec(),
        };
        validation.set_audience(&[&config.audience]);
        let mut required = vec!["exp", "aud"];
        if let Some(issuer) = &config.issuer {
            validation.set_issuer(&[issuer]);
            required.push("iss");
        }
        validation.set_required_spec_claims(&required);
        validation.validate_nbf = true;
        // Clocks of issuer and service may differ a little.
        validation.leeway = 30;
        Ok(Jwt {
            keys,
            validation,
            tenants_claim: config.tenants_claim.clone(),
            scopes_claim: config.scopes_claim.clone(),
        })
    }

    fn verify(&self, token: &str) -> Result<Principal, String> {
        let header = jsonwebtoken::decode_header(token).map_err(|e| format!("bad JWT: {e}"))?;
        let mut validation = self.validation.clone();
        let key = match &self.keys {
            JwtKeys::Secret(key) => key,
            JwtKeys::Set(keys) => {
                let found = keys.iter().find(|(kid, alg, _)| {
                    *alg == header.alg && (header.kid.is_none() || *kid == header.kid)
                });
                let Some((_, alg, key)) = found else {
                    return Err(format!(
                        "no key in http.jwt.jwks_file for this JWT (kid {:?}, alg {:?})",
                        header.kid, header.alg
                    ));
                };
                validation.algorithms = vec![*alg];
                key
            }
        };
        let data = jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(
            token,
            key,
            &validation,
        )
        .map_err(|e| format!("JWT refused: {}", jwt_error(&e)))?;
        let claims = data.claims;
        let tenants = match claims.get(&self.tenants_claim) {
            Some(serde_json::Value::String(s)) if s == "*" => Tenants::All,
            Some(serde_json::Value::Array(items)) => {
                let list: Option<Vec<&str>> = items.iter().map(|v| v.as_str()).collect();
                match list {
                    Some(list) => Tenants::from_list(&list),
                    None => {
                        return Err(format!(
                            "JWT claim {:?} is not a list of strings",
                            self.tenants_claim
                        ))
                    }
                }
            }
            _ => {
                return Err(format!(
                    "JWT has no {:?} claim (a list of tenants, or \"*\")",
                    self.tenants_claim
                ))
            }
        };
        let words: Vec<&str> = match claims.get(&self.scopes_claim) {
            Some(serde_json::Value::String(s)) => s.split_whitespace().collect(),
            Some(serde_json::Value::Array(items)) => {
                items.iter().filter_map(|v| v.as_str()).collect()
            }
            _ => Vec::new(),
        };
        let scopes: BTreeSet<Scope> = words.into_iter().filter_map(Scope::parse).collect();
        let subject = claims.get("sub").and_then(|s| s.as_str()).unwrap_or("");
        // `exp` is required and was checked: a number of seconds since the epoch (one too far
        // for the system clock counts as never).
        let expires_at = claims
            .get("exp")
            .and_then(serde_json::Value::as_u64)
            .and_then(|exp| std::time::UNIX_EPOCH.checked_add(std::time::Duration::from_secs(exp)));
        Ok(Principal {
            name: format!("jwt:{subject}").into(),
            tenants,
            scopes,
            expires_at,
        })
    }
}

/// Why a JWT was refused, in words (the token itself is never shown).
fn jwt_error(e: &jsonwebtoken::errors::Error) -> String {
    use jsonwebtoken::errors::ErrorKind as K;
    match e.kind() {
        K::ExpiredSignature => "expired (exp)".into(),
        K::ImmatureSignature => "not valid yet (nbf)".into(),
        K::InvalidAudience => "wrong audience (aud)".into(),
        K::InvalidIssuer => "wrong issuer (iss)".into(),
        K::InvalidSignature => "bad signature".into(),
        K::InvalidAlgorithm => "algorithm not accepted".into(),
        K::MissingRequiredClaim(claim) => format!("missing claim {claim}"),
        _ => e.to_string(),
    }
}

fn read_jwks(file: &Path) -> Result<Vec<(Option<String>, Algorithm, DecodingKey)>, Error> {
    let at = || format!("http.jwt.jwks_file {}", file.display());
    let text = std::fs::read_to_string(file)
        .map_err(|e| Error::config(format!("{}: cannot read it: {e}", at())))?;
    let set: JwkSet = serde_json::from_str(&text)
        .map_err(|e| Error::config(format!("{}: not a JWKS ({{\"keys\": [...]}}): {e}", at())))?;
    let mut keys = Vec::new();
    for (i, jwk) in set.keys.iter().enumerate() {
        use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve};
        let alg = match &jwk.algorithm {
            AlgorithmParameters::RSA(_) => Algorithm::RS256,
            AlgorithmParameters::EllipticCurve(ec) if ec.curve == EllipticCurve::P256 => {
                Algorithm::ES256
            }
            _ => {
                return Err(Error::config(format!(
                    "{}: key {i} is neither an RSA nor a P-256 key (RS256, ES256)",
                    at()
                )))
            }
        };
        let key = DecodingKey::from_jwk(jwk)
            .map_err(|e| Error::config(format!("{}: key {i}: {e}", at())))?;
        keys.push((jwk.common.key_id.clone(), alg, key));
    }
    if keys.is_empty() {
        return Err(Error::config(format!("{}: has no keys", at())));
    }
    Ok(keys)
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
    let read_or_write = if *method == Method::GET {
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

/// The middleware on every API route: authenticates, applies the route's [`Rule`], passes the
/// [`Principal`] on, and writes the audit line of a write.
pub async fn guard(
    State(auth): State<Option<Arc<Auth>>>,
    request: Request,
    next: Next,
) -> Response {
    let (mut parts, body) = request.into_parts();
    let matched = parts.extensions.get::<MatchedPath>().cloned();
    let params = RawPathParams::from_request_parts(&mut parts, &())
        .await
        .ok();
    let mut request = Request::from_parts(parts, body);
    let principal = match &auth {
        None => Principal::anonymous(),
        Some(auth) => {
            let bearer = request
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            let checked = match bearer {
                Some(bearer) => auth.authenticate(bearer.trim()),
                None => Err("missing bearer token (Authorization: Bearer …)".into()),
            };
            match checked {
                Ok(principal) => principal,
                Err(why) => return unauthorized(&why),
            }
        }
    };
    let method = request.method().clone();
    let Some(path) = matched.as_ref().map(|m| m.as_str().to_owned()) else {
        // No route matched: the 404 says nothing more than that.
        return next.run(request).await;
    };
    let param = |wanted: &str| {
        let params = params.as_ref()?;
        let (_, value) = params.iter().find(|(name, _)| *name == wanted)?;
        Some(value.to_owned())
    };
    let (tenant, id) = (param("tenant"), param("id"));
    let checked = match rule(&method, &path) {
        None => Err(Forbidden::new("this route has no access rule")),
        Some(Rule::Authenticated) => Ok(()),
        Some(Rule::Each(scope)) => principal.need(scope),
        Some(Rule::Tenant(scope)) => principal.need(scope).and_then(|()| match &tenant {
            Some(tenant) => principal.need_tenant(tenant, None),
            None => Err(Forbidden::new("this route has no tenant in its path")),
        }),
    };
    let name = principal.name.clone();
    request.extensions_mut().insert(principal);
    let response = match checked {
        Ok(()) => next.run(request).await,
        Err(refused) => refused.into_response(),
    };
    if method != Method::GET {
        audit(&name, &method, &path, tenant, id, response).await
    } else {
        response
    }
}

fn unauthorized(why: &str) -> Response {
    let mut response = error_body(StatusCode::UNAUTHORIZED, "unauthorized", None, why);
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// Largest answer whose outcome the audit line reads; a larger one is logged by its status.
const AUDIT_BODY_LIMIT: usize = 1 << 20;

/// Writes the audit line of a write: who, which tenant, what, and how it ended (the answer's
/// `outcome`, or its error `reason`), and gives the answer back unchanged.
async fn audit(
    key: &str,
    method: &Method,
    path: &str,
    tenant: Option<String>,
    id: Option<String>,
    response: Response,
) -> Response {
    use axum::body::HttpBody as _;
    let (parts, body) = response.into_parts();
    // Only an answer already in memory and small is read (every write route's JSON is); any
    // other is passed on untouched and logged by its status.
    let small = body
        .size_hint()
        .exact()
        .is_some_and(|n| n <= AUDIT_BODY_LIMIT as u64);
    let (body, json) = if small {
        match axum::body::to_bytes(body, AUDIT_BODY_LIMIT).await {
            Ok(bytes) => {
                let json: Option<serde_json::Value> = serde_json::from_slice(&bytes).ok();
                (axum::body::Body::from(bytes), json)
            }
            // An in-memory body of known size does not fail.
            Err(_) => (axum::body::Body::empty(), None),
        }
    } else {
        (body, None)
    };
    let outcome = json.as_ref().and_then(|v| {
        v.get("outcome")
            .or_else(|| v.pointer("/error/reason"))
            .and_then(|o| o.as_str())
            .map(str::to_owned)
    });
    // The tenant of `POST /v1/timers` is in its body; the answer names it.
    let tenant = tenant.or_else(|| {
        json.as_ref()
            .and_then(|v| v.pointer("/timer/tenantId"))
            .and_then(|t| t.as_str())
            .map(str::to_owned)
    });
    tracing::info!(
        target: "timer_service::audit",
        key = %key,
        tenant = tenant.as_deref(),
        action = action(method, path),
        id = id.as_deref(),
        status = parts.status.as_u16(),
        outcome = outcome.as_deref(),
        "api write"
    );
    Response::from_parts(parts, body)
}

/// The audit name of a write route.
fn action(method: &Method, path: &str) -> &'static str {
    match (method.as_str(), path) {
        ("POST", "/v1/timers") => "schedule",
        ("POST", "/v1/timers/batch") => "schedule_batch",
        ("POST", "/v1/commands") => "command",
        ("DELETE", _) => "cancel",
        (_, p) if p.ends_with("/pause") => "pause",
        (_, p) if p.ends_with("/resume") => "resume",
        (_, p) if p.ends_with("/retry") => "retry",
        (_, p) if p.ends_with("/trigger") => "trigger",
        (_, p) if p.ends_with("/complete") => "complete",
        (_, p) if p.ends_with("/bulk") => "bulk",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_sha256_hex() {
        // SHA-256("test"), as `sha256sum` prints it.
        assert_eq!(
            hash_token("test"),
            "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
        );
        assert_eq!(
            parse_hash(&hash_token("x")),
            Some(Sha256::digest(b"x").into())
        );
        assert_eq!(parse_hash("9f86"), None);
        assert_eq!(parse_hash(&"g".repeat(64)), None);
    }

    #[test]
    fn tenant_routes_need_read_for_get_and_write_otherwise() {
        let get = Method::GET;
        let post = Method::POST;
        assert_eq!(
            rule(&get, "/v1/tenants/{tenant}/timers/{id}"),
            Some(Rule::Tenant(Scope::Read))
        );
        assert_eq!(
            rule(&Method::DELETE, "/v1/tenants/{tenant}/timers/{id}"),
            Some(Rule::Tenant(Scope::Write))
        );
        assert_eq!(
            rule(&post, "/v1/tenants/{tenant}/timers/bulk"),
            Some(Rule::Tenant(Scope::Write))
        );
        assert_eq!(rule(&get, "/v1/status"), Some(Rule::Each(Scope::Admin)));
        assert_eq!(rule(&get, "/v1/unknown"), None);
    }

    /// A route added without a rule would be refused to everyone; this names it first.
    #[test]
    fn every_route_of_the_api_has_a_rule() {
        let config = crate::config::load(&figment::Figment::new()).expect("the defaults load");
        let (_, document) = crate::http::routes(&config, None);
        let document = serde_json::to_value(&document).expect("the document serializes");
        let open = ["/healthz", "/readyz", "/metrics"];
        let paths = document["paths"].as_object().expect("paths");
        assert!(paths.len() > 10, "{paths:?}");
        for (path, item) in paths {
            for method in item.as_object().expect("a path item").keys() {
                let method: Method = method.to_uppercase().parse().expect("a method");
                let expected = !open.contains(&path.as_str());
                assert_eq!(rule(&method, path).is_some(), expected, "{method} {path}");
            }
        }
    }
}
