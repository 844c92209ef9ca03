//! Who is asking: client certificates (verified by TLS), bearer tokens from the token
//! file, ServiceAccount tokens and bootstrap tokens.
//!
//! # Layout
//! - [`tokens`]: the static token file and the admin's token.
//! - [`sa_token`]: ServiceAccount tokens: signing and checking.
//! - [`bootstrap_token`]: bootstrap tokens (`ID.SECRET`) kept in kube-system Secrets.
//! - [`impersonation`]: `Impersonate-*` headers (`kubectl --as`), authorized by RBAC's
//!   `impersonate` verb.

pub mod bootstrap_token;
pub mod impersonation;
pub mod sa_token;
pub mod tokens;

use axum::http::{HeaderMap, header};
use trellis_api::{ApiError, UserInfo};

use crate::state::AppState;

pub use trellis_api::user::Peer;

/// Who is asking: a verified client certificate, else a bearer token; anonymous
/// requests are refused.
pub async fn authenticate(
    state: &AppState,
    peer: &Peer,
    headers: &HeaderMap,
) -> Result<UserInfo, ApiError> {
    // As kube-apiserver's union of authenticators: a verified client certificate
    // first, then a bearer token (a ServiceAccount token, or one of tokens.csv). A
    // certificate that has expired since the handshake authenticates no one.
    if let Some(user) = peer.user_at(jiff::Timestamp::now().as_second()) {
        return Ok(user.clone());
    }
    let auth = headers
        .get(header::AUTHORIZATION)
        .ok_or_else(ApiError::unauthorized)?;
    // The scheme in any case, as kube-apiserver reads it: the official Python
    // client's in-cluster configuration sends `bearer`.
    let token = auth
        .to_str()
        .ok()
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
        .ok_or_else(ApiError::unauthorized)?;
    if sa_token::looks_like_jwt(token) {
        return service_account(state, token)
            .await
            .ok_or_else(ApiError::unauthorized);
    }
    if let Some(user) = state.tokens.lookup(token) {
        return Ok(user.clone());
    }
    match bootstrap_token::parse(token) {
        Some((id, secret)) => bootstrap(state, id, secret)
            .await
            .ok_or_else(ApiError::unauthorized),
        None => Err(ApiError::unauthorized()),
    }
}

/// The user a bootstrap token authenticates, read from its Secret.
async fn bootstrap(state: &AppState, id: &str, secret: &str) -> Option<UserInfo> {
    let secrets = state.resource("", "v1", "secrets").ok()?;
    let key = secrets.key(
        Some(bootstrap_token::NAMESPACE),
        &format!("{}{id}", bootstrap_token::SECRET_PREFIX),
    );
    let stored = state.secrets.get(&key).await.ok()?;
    bootstrap_token::authenticate(
        id,
        secret,
        stored.as_deref(),
        jiff::Timestamp::now().as_second(),
    )
}

/// The ServiceAccount a token names, if it is valid and the account still exists
/// with the uid the token was issued for.
async fn service_account(state: &AppState, token: &str) -> Option<UserInfo> {
    let claims =
        state
            .verified_tokens
            .verify(&state.signer, token, jiff::Timestamp::now().as_second())?;
    let accounts = state.resource("", "v1", "serviceaccounts").ok()?;
    let account = state
        .service_accounts
        .get(&accounts.key(Some(&claims.namespace), &claims.name))
        .await
        .ok()??;
    (crate::object::meta_str(&account, "uid") == Some(claims.uid.as_str()))
        .then(|| sa_token::user_of(&claims))
}
