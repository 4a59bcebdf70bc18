//! The access settings of `[http]`: API keys (`[[http.keys]]`) and JWTs (`[http.jwt]`), and the
//! scopes a caller may have. `http::auth` checks tokens against them.

use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

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

    pub fn parse(word: &str) -> Option<Scope> {
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
