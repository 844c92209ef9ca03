//! Bootstrap tokens, as Kubernetes keeps them: a bearer token `ID.SECRET`
//! (`[a-z0-9]{6}.[a-z0-9]{16}`) is good while the Secret `kube-system/bootstrap-token-ID`
//! of type `bootstrap.kubernetes.io/token` holds the same secret, allows
//! `usage-bootstrap-authentication`, and has not expired. It authenticates as
//! `system:bootstrap:ID` in `system:bootstrappers`, the Secret's `auth-extra-groups`
//! and `system:authenticated`: what a joining node uses to ask for its certificate.

use base64::Engine as _;
use serde_json::Value;
use trellis_api::UserInfo;

use crate::object::Object;

/// The namespace bootstrap token Secrets live in.
pub const NAMESPACE: &str = "kube-system";
/// The type of a bootstrap token Secret.
pub const SECRET_TYPE: &str = "bootstrap.kubernetes.io/token";
/// What the name of a token's Secret starts with, followed by the token's id.
pub const SECRET_PREFIX: &str = "bootstrap-token-";
/// The group of every bootstrap token's user.
pub const BOOTSTRAPPERS: &str = "system:bootstrappers";
/// The extra group `trellis token create` gives its tokens, as kubeadm's default.
pub const DEFAULT_NODE_TOKEN_GROUP: &str = "system:bootstrappers:trellis:default-node-token";

/// The id and secret of a bearer token shaped like a bootstrap token.
pub fn parse(token: &str) -> Option<(&str, &str)> {
    let (id, secret) = token.split_once('.')?;
    let ok = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    };
    (ok(id, 6) && ok(secret, 16)).then_some((id, secret))
}

fn data(secret: &Object, key: &str) -> Option<String> {
    let encoded = secret.get("data")?.get(key)?.as_str()?;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .ok()?;
    String::from_utf8(bytes).ok()
}

/// The user `ID.SECRET` authenticates as, given the token's Secret (if it exists) and
/// the time now (Unix seconds).
pub fn authenticate(id: &str, secret: &str, stored: Option<&Object>, now: i64) -> Option<UserInfo> {
    let stored = stored?;
    if stored.get("type").and_then(Value::as_str) != Some(SECRET_TYPE) {
        return None;
    }
    // A Secret being deleted no longer authenticates, as in Kubernetes.
    if crate::object::meta_str(stored, "deletionTimestamp").is_some() {
        return None;
    }
    let want = data(stored, "token-secret")?;
    if !super::tokens::constant_time_eq(want.as_bytes(), secret.as_bytes()) {
        return None;
    }
    if data(stored, "token-id").is_some_and(|stored_id| stored_id != id) {
        return None;
    }
    if let Some(expiration) = data(stored, "expiration") {
        let expires = expiration.parse::<jiff::Timestamp>().ok()?;
        if now >= expires.as_second() {
            return None;
        }
    }
    if data(stored, "usage-bootstrap-authentication").as_deref() != Some("true") {
        return None;
    }
    let mut groups = vec![BOOTSTRAPPERS.to_owned()];
    if let Some(extra) = data(stored, "auth-extra-groups") {
        for group in extra.split(',').map(str::trim).filter(|g| !g.is_empty()) {
            // Kubernetes refuses other groups: a token cannot make its holder an admin.
            if group.starts_with("system:bootstrappers:") && !groups.iter().any(|g| g == group) {
                groups.push(group.to_owned());
            }
        }
    }
    groups.push(trellis_api::user::groups::AUTHENTICATED.to_owned());
    Some(UserInfo {
        name: format!("system:bootstrap:{id}"),
        uid: String::new(),
        groups,
        extra: Default::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn secret(token_secret: &str, expiration: &str) -> Object {
        let b = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let Value::Object(o) = json!({
            "type": SECRET_TYPE,
            "metadata": {"name": "bootstrap-token-abcdef", "namespace": NAMESPACE},
            "data": {
                "token-id": b("abcdef"),
                "token-secret": b(token_secret),
                "expiration": b(expiration),
                "usage-bootstrap-authentication": b("true"),
                "auth-extra-groups": b("system:bootstrappers:trellis:default-node-token,system:masters"),
            },
        }) else {
            unreachable!()
        };
        o
    }

    #[test]
    fn parses_only_bootstrap_shaped_tokens() {
        assert_eq!(
            parse("abcdef.0123456789abcdef"),
            Some(("abcdef", "0123456789abcdef"))
        );
        assert_eq!(parse("ABCDEF.0123456789abcdef"), None);
        assert_eq!(parse("abcdef.0123456789abcde"), None);
        assert_eq!(parse("eyJ.a.b"), None);
    }

    #[test]
    fn valid_token_authenticates_with_extra_groups_only_of_bootstrappers() {
        let s = secret("0123456789abcdef", "2100-01-01T00:00:00Z");
        let user = authenticate("abcdef", "0123456789abcdef", Some(&s), 1_000).unwrap();
        assert_eq!(user.name, "system:bootstrap:abcdef");
        assert_eq!(
            user.groups,
            [
                "system:bootstrappers",
                "system:bootstrappers:trellis:default-node-token",
                "system:authenticated"
            ]
        );
    }

    #[test]
    fn wrong_secret_expired_or_missing_tokens_are_refused() {
        let s = secret("0123456789abcdef", "2000-01-01T00:00:00Z");
        let now = jiff::Timestamp::now().as_second();
        assert!(authenticate("abcdef", "0123456789abcdef", Some(&s), now).is_none());
        let s = secret("0123456789abcdef", "2100-01-01T00:00:00Z");
        assert!(authenticate("abcdef", "0123456789abcdeX", Some(&s), now).is_none());
        assert!(authenticate("abcdef", "0123456789abcdef", None, now).is_none());
    }
}
