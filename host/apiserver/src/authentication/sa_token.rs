//! ServiceAccount tokens: ES256-signed JWTs for in-cluster identities, issued through
//! the `serviceaccounts/{name}/token` subresource (TokenRequest) and accepted as
//! bearer tokens while they are unexpired and their ServiceAccount still exists with
//! the same uid.
//!
//! The identity is Kubernetes': user `system:serviceaccount:NS:NAME`, groups
//! `system:serviceaccounts` and `system:serviceaccounts:NS`.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use ring::rand::SystemRandom;
use ring::signature::{
    ECDSA_P256_SHA256_FIXED, ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair,
    UnparsedPublicKey,
};
use serde_json::{Value, json};
use trellis_api::UserInfo;

/// The issuer and default audience of the tokens.
pub const ISSUER: &str = "https://kubernetes.default.svc.cluster.local";
/// Lifetime of a token when the request names none (Kubernetes' default: one hour).
pub const DEFAULT_EXPIRATION_SECONDS: i64 = 3600;

/// Signs and verifies ServiceAccount tokens with the cluster's `sa.key`.
pub struct TokenSigner {
    key: EcdsaKeyPair,
    rng: SystemRandom,
    kid: String,
}

impl std::fmt::Debug for TokenSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenSigner")
            .field("kid", &self.kid)
            .finish_non_exhaustive()
    }
}

/// The claims a token carries about its ServiceAccount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claims {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub expires: i64,
}

/// Tokens whose signature was checked lately, by their SHA-256: verifying an ECDSA
/// signature costs more than the rest of a GET, and a client sends the same token with
/// every request. As kube-apiserver's token cache, a success is remembered for a short
/// while (never past the token's expiry); failures are not remembered.
#[derive(Debug, Default)]
pub struct VerifiedTokens {
    entries: std::sync::Mutex<std::collections::HashMap<[u8; 32], (Claims, i64)>>,
}

/// How long a verified token is taken on trust, in seconds.
const VERIFIED_TTL: i64 = 10;
/// Most tokens remembered; past it the memory starts again empty.
const VERIFIED_MAX: usize = 10_000;

impl VerifiedTokens {
    /// The claims of `token` at `now`: remembered, or verified by `signer` and then
    /// remembered.
    pub fn verify(&self, signer: &TokenSigner, token: &str, now: i64) -> Option<Claims> {
        let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
        let mut key = [0_u8; 32];
        key.copy_from_slice(digest.as_ref());
        let lock = || self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((claims, until)) = lock().get(&key)
            && now < *until
        {
            return Some(claims.clone());
        }
        let claims = signer.verify(token, now)?;
        let until = (now + VERIFIED_TTL).min(claims.expires);
        let mut entries = lock();
        if entries.len() >= VERIFIED_MAX {
            entries.clear();
        }
        entries.insert(key, (claims.clone(), until));
        Some(claims)
    }
}

fn pem_body(pem: &str) -> anyhow::Result<Vec<u8>> {
    let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    Ok(base64::engine::general_purpose::STANDARD.decode(body)?)
}

impl TokenSigner {
    /// From the PKCS#8 PEM of an ECDSA P-256 key (`pki/sa.key`).
    pub fn from_pem(pem: &str) -> anyhow::Result<Self> {
        let rng = SystemRandom::new();
        let der = pem_body(pem)?;
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &der, &rng)
            .map_err(|e| anyhow::anyhow!("read the ServiceAccount signing key: {e}"))?;
        let digest = ring::digest::digest(&ring::digest::SHA256, key.public_key().as_ref());
        let kid = B64.encode(&digest.as_ref()[..16]);
        Ok(Self { key, rng, kid })
    }

    /// A token for a ServiceAccount, valid for `seconds` from `now` (Unix seconds).
    pub fn issue(&self, claims: &Claims, audiences: &[String], now: i64) -> anyhow::Result<String> {
        let header = json!({"alg": "ES256", "typ": "JWT", "kid": self.kid});
        let audiences: Vec<String> = if audiences.is_empty() {
            vec![ISSUER.to_owned()]
        } else {
            audiences.to_vec()
        };
        let body = json!({
            "iss": ISSUER,
            "sub": format!("system:serviceaccount:{}:{}", claims.namespace, claims.name),
            "aud": audiences,
            "iat": now,
            "nbf": now,
            "exp": claims.expires,
            "kubernetes.io": {
                "namespace": claims.namespace,
                "serviceaccount": {"name": claims.name, "uid": claims.uid},
            },
        });
        let signing_input = format!(
            "{}.{}",
            B64.encode(header.to_string()),
            B64.encode(body.to_string())
        );
        let signature = self
            .key
            .sign(&self.rng, signing_input.as_bytes())
            .map_err(|e| anyhow::anyhow!("sign a ServiceAccount token: {e}"))?;
        Ok(format!(
            "{signing_input}.{}",
            B64.encode(signature.as_ref())
        ))
    }

    /// The claims of a token this signer issued, if its signature, issuer, audience
    /// and lifetime are good at `now`.
    pub fn verify(&self, token: &str, now: i64) -> Option<Claims> {
        let mut parts = token.split('.');
        let (header, body, signature) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let public =
            UnparsedPublicKey::new(&ECDSA_P256_SHA256_FIXED, self.key.public_key().as_ref());
        let signature = B64.decode(signature).ok()?;
        public
            .verify(format!("{header}.{body}").as_bytes(), &signature)
            .ok()?;
        let claims: Value = serde_json::from_slice(&B64.decode(body).ok()?).ok()?;
        let exp = claims["exp"].as_i64()?;
        let nbf = claims["nbf"].as_i64().unwrap_or(0);
        let audience_ok = claims["aud"]
            .as_array()
            .is_some_and(|a| a.iter().any(|v| v == ISSUER));
        if claims["iss"] != ISSUER || !audience_ok || now >= exp || now + 60 < nbf {
            return None;
        }
        let k8s = &claims["kubernetes.io"];
        Some(Claims {
            namespace: k8s["namespace"].as_str()?.to_owned(),
            name: k8s["serviceaccount"]["name"].as_str()?.to_owned(),
            uid: k8s["serviceaccount"]["uid"].as_str()?.to_owned(),
            expires: exp,
        })
    }
}

/// Whether a bearer token is shaped like a JWT (and so not a static token).
pub fn looks_like_jwt(token: &str) -> bool {
    token.split('.').count() == 3 && token.starts_with("eyJ")
}

/// The user a ServiceAccount's token authenticates as.
pub fn user_of(claims: &Claims) -> UserInfo {
    UserInfo {
        name: format!("system:serviceaccount:{}:{}", claims.namespace, claims.name),
        uid: claims.uid.clone(),
        groups: vec![
            "system:serviceaccounts".to_owned(),
            format!("system:serviceaccounts:{}", claims.namespace),
            trellis_api::user::groups::AUTHENTICATED.to_owned(),
        ],
        extra: Default::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signer() -> TokenSigner {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        TokenSigner::from_pem(&key.serialize_pem()).unwrap()
    }

    fn claims(expires: i64) -> Claims {
        Claims {
            namespace: "team".into(),
            name: "builder".into(),
            uid: "u-1".into(),
            expires,
        }
    }

    #[test]
    fn issued_tokens_verify_until_they_expire() {
        let s = signer();
        let token = s.issue(&claims(2_000), &[], 1_000).unwrap();
        assert!(looks_like_jwt(&token));
        assert_eq!(s.verify(&token, 1_500), Some(claims(2_000)));
        assert_eq!(s.verify(&token, 2_000), None, "expired");
        let user = user_of(&claims(2_000));
        assert_eq!(user.name, "system:serviceaccount:team:builder");
        assert!(user.in_group("system:serviceaccounts:team"));
    }

    #[test]
    fn tampered_foreign_and_wrong_audience_tokens_are_refused() {
        let s = signer();
        let token = s.issue(&claims(2_000), &[], 1_000).unwrap();
        let mut parts: Vec<String> = token.split('.').map(str::to_owned).collect();
        let forged = json!({"iss": ISSUER, "aud": [ISSUER], "exp": 9_999, "kubernetes.io": {"namespace": "kube-system", "serviceaccount": {"name": "admin", "uid": "x"}}});
        parts[1] = B64.encode(forged.to_string());
        assert_eq!(s.verify(&parts.join("."), 1_500), None, "tampered claims");
        assert_eq!(
            signer().verify(&token, 1_500),
            None,
            "another cluster's key"
        );
        let other_audience = s
            .issue(&claims(2_000), &["vault".to_owned()], 1_000)
            .unwrap();
        assert_eq!(s.verify(&other_audience, 1_500), None);
        assert_eq!(s.verify("a.b", 1_500), None);
    }
}
