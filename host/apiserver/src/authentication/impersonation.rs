//! Impersonation: `kubectl --as USER --as-group GROUP --as-uid UID`, the
//! `Impersonate-User`, `Impersonate-Group`, `Impersonate-Uid` and
//! `Impersonate-Extra-KEY` headers. The authenticated requester must be allowed the
//! `impersonate` verb on each thing it asks to be (users, groups, uids, userextras,
//! or a ServiceAccount); the request then runs as the impersonated identity alone, so
//! an administrator who impersonates drops its own privileges.

use std::collections::BTreeMap;

use axum::http::HeaderMap;
use trellis_api::user::groups;
use trellis_api::{ApiError, UserInfo};

use crate::authorization::rbac;
use crate::state::AppState;

const USER: &str = "impersonate-user";
const GROUP: &str = "impersonate-group";
const UID: &str = "impersonate-uid";
const EXTRA: &str = "impersonate-extra-";

/// The identity the request runs as: `requester`, or the one its impersonation headers
/// name once each part of it is authorized.
pub async fn impersonate(
    state: &AppState,
    requester: UserInfo,
    headers: &HeaderMap,
) -> Result<UserInfo, ApiError> {
    let values = |name: &str| -> Result<Vec<String>, ApiError> {
        headers
            .get_all(name)
            .iter()
            .map(|v| {
                v.to_str().map(str::to_owned).map_err(|_| {
                    ApiError::bad_request(format!("the {name} header is not valid text"))
                })
            })
            .collect()
    };
    let user = values(USER)?;
    let asked_groups = values(GROUP)?;
    let uid = values(UID)?;
    let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, value) in headers {
        if let Some(key) = name.as_str().strip_prefix(EXTRA) {
            let value = value.to_str().map_err(|_| {
                ApiError::bad_request(format!("the {name} header is not valid text"))
            })?;
            // Keys travel percent-encoded, as HTTP header names are case-insensitive.
            extra
                .entry(percent_decode(key))
                .or_default()
                .push(value.to_owned());
        }
    }
    let Some(name) = user.first().cloned() else {
        if !asked_groups.is_empty() || !uid.is_empty() || !extra.is_empty() {
            return Err(ApiError::bad_request(
                "requested impersonation of groups, uid or extra without impersonating a user",
            ));
        }
        return Ok(requester);
    };
    if user.len() > 1 || uid.len() > 1 {
        return Err(ApiError::bad_request(
            "only one user and one uid may be impersonated",
        ));
    }

    // What the requester must be allowed, as kube-apiserver's impersonation filter
    // checks it: the user (or its ServiceAccount), each group, the uid, each extra.
    let mut checks: Vec<(&str, String, String, String)> = Vec::new();
    match service_account(&name) {
        Some((namespace, account)) => checks.push((
            "",
            "serviceaccounts".into(),
            namespace.to_owned(),
            account.to_owned(),
        )),
        None => checks.push(("", "users".into(), String::new(), name.clone())),
    }
    for group in &asked_groups {
        checks.push(("", "groups".into(), String::new(), group.clone()));
    }
    for uid in &uid {
        checks.push((
            "authentication.k8s.io",
            "uids".into(),
            String::new(),
            uid.clone(),
        ));
    }
    for (key, values) in &extra {
        for value in values {
            checks.push((
                "authentication.k8s.io",
                format!("userextras/{key}"),
                String::new(),
                value.clone(),
            ));
        }
    }
    for (group, resource, namespace, object) in &checks {
        let attributes = rbac::Attributes {
            verb: "impersonate",
            group,
            resource,
            namespace,
            name: object,
        };
        rbac::authorize(&state.rbac, &requester, &attributes).await?;
    }

    let mut impersonated = UserInfo {
        name: name.clone(),
        uid: uid.into_iter().next().unwrap_or_default(),
        groups: asked_groups,
        extra,
    };
    // A ServiceAccount with no groups asked for gets its own, as Kubernetes gives it.
    if let Some((namespace, _)) = service_account(&name)
        && impersonated.groups.is_empty()
    {
        impersonated.groups = vec![
            "system:serviceaccounts".to_owned(),
            format!("system:serviceaccounts:{namespace}"),
        ];
    }
    if name != "system:anonymous" && !impersonated.in_group(groups::AUTHENTICATED) {
        impersonated.groups.push(groups::AUTHENTICATED.to_owned());
    }
    Ok(impersonated)
}

/// `(namespace, name)` of a ServiceAccount's user name.
fn service_account(user: &str) -> Option<(&str, &str)> {
    user.strip_prefix("system:serviceaccount:")?.split_once(':')
}

/// An extra's key as its header name carries it, percent-decoded.
fn percent_decode(key: &str) -> String {
    percent_encoding::percent_decode_str(key)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_keys_are_percent_decoded_and_service_accounts_recognised() {
        assert_eq!(percent_decode("example.com%2Fteam"), "example.com/team");
        assert_eq!(percent_decode("plain"), "plain");
        assert_eq!(percent_decode("bad%zz"), "bad%zz");
        assert_eq!(
            service_account("system:serviceaccount:ns:builder"),
            Some(("ns", "builder"))
        );
        assert_eq!(service_account("alice"), None);
    }
}
