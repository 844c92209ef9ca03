//! Who is asking: the identity authentication produces and authorization checks.

/// An authenticated user, as Kubernetes' `user.Info`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UserInfo {
    pub name: String,
    pub uid: String,
    pub groups: Vec<String>,
    /// Further attributes an authenticator (or an impersonating client) attaches, as
    /// `user.Info.GetExtra()`; RBAC does not read them, reviews report them.
    pub extra: std::collections::BTreeMap<String, Vec<String>>,
}

/// The identity a request carries before any header is read, as a request extension:
/// what a connection's verified client certificate proves, or the component an
/// in-process client was made for. Extensions never cross the wire, so a remote
/// client can only get one from its certificate.
#[derive(Clone, Debug, Default)]
pub struct Peer {
    pub user: Option<UserInfo>,
    /// When the certificate that proved `user` expires, in Unix seconds; `None` for an
    /// in-process client. A connection outlives the handshake that checked its
    /// certificate, so each request checks this again, as Kubernetes' x509
    /// authenticator verifies the certificate on every request.
    pub not_after: Option<i64>,
}

impl Peer {
    /// An in-process client's identity, which does not expire.
    pub fn in_process(user: UserInfo) -> Self {
        Self {
            user: Some(user),
            not_after: None,
        }
    }

    /// The user this peer is at `now` (Unix seconds): none once its certificate has
    /// expired.
    pub fn user_at(&self, now: i64) -> Option<&UserInfo> {
        match self.not_after {
            Some(not_after) if now > not_after => None,
            _ => self.user.as_ref(),
        }
    }
}

impl UserInfo {
    pub fn new(
        name: impl Into<String>,
        groups: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        Self {
            name: name.into(),
            uid: String::new(),
            groups: groups.into_iter().map(Into::into).collect(),
            extra: std::collections::BTreeMap::new(),
        }
    }

    pub fn in_group(&self, group: &str) -> bool {
        self.groups.iter().any(|g| g == group)
    }
}

/// Kubernetes' well-known group names.
pub mod groups {
    /// Members may do anything (bypasses RBAC), as in Kubernetes.
    pub const MASTERS: &str = "system:masters";
    pub const AUTHENTICATED: &str = "system:authenticated";
    pub const UNAUTHENTICATED: &str = "system:unauthenticated";
    pub const NODES: &str = "system:nodes";
}
