//! Bearer tokens that are JWTs (`http.jwt`): HS256 with a shared secret, or RS256/ES256 with
//! the public keys of a JWKS file, chosen by the token's `kid`.

use std::collections::BTreeSet;
use std::path::Path;

use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use timer_core::Error;

use super::{Principal, Scope, Tenants};
use crate::config::auth::JwtConfig;

/// How JWTs are checked.
pub(super) struct Jwt {
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
    pub(super) fn new(config: &JwtConfig) -> Result<Jwt, Error> {
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

    pub(super) fn verify(&self, token: &str) -> Result<Principal, String> {
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
        // Who it is for: the name of audit lines and of per-key limits (event streams), so
        // tokens of different callers are never counted as one.
        let subject = match claims.get("sub").and_then(|s| s.as_str()) {
            Some(sub) if !sub.trim().is_empty() => sub,
            _ => return Err("JWT has no \"sub\" claim (who it is for: a non-empty string)".into()),
        };
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
