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
pub struct Peer(pub Option<UserInfo>);

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
