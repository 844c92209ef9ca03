//! The Kubernetes users components act as. No component runs as `system:masters`: each
//! is held to the bootstrap role Kubernetes gives it.

use trellis_api::UserInfo;
use trellis_api::user::groups;

/// The scheduler: `system:kube-scheduler`, bound to the ClusterRole of that name.
pub fn scheduler() -> UserInfo {
    UserInfo::new("system:kube-scheduler", [groups::AUTHENTICATED])
}

/// The controller manager's own loops (leader election, informers):
/// `system:kube-controller-manager`, bound to the ClusterRole of that name.
pub fn controller_manager() -> UserInfo {
    UserInfo::new("system:kube-controller-manager", [groups::AUTHENTICATED])
}

/// One controller, as kube-controller-manager runs each with its own credentials
/// (`--use-service-account-credentials`): the ServiceAccount `kube-system/NAME`, which
/// Kubernetes binds to the ClusterRole `system:controller:NAME`.
pub fn controller(name: &str) -> UserInfo {
    UserInfo::new(
        format!("system:serviceaccount:kube-system:{name}"),
        [
            "system:serviceaccounts",
            "system:serviceaccounts:kube-system",
            groups::AUTHENTICATED,
        ],
    )
}

/// The node agent of node `name`: `system:node:NAME` in `system:nodes`, which the Node
/// authorizer limits to its own Node, Lease and pods.
pub fn node(name: &str) -> UserInfo {
    UserInfo::new(
        format!("system:node:{name}"),
        ["system:nodes", groups::AUTHENTICATED],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_component_is_a_master() {
        for user in [
            scheduler(),
            controller_manager(),
            controller("deployment-controller"),
            node("n1"),
        ] {
            assert!(!user.in_group(groups::MASTERS), "{user:?}");
        }
        assert_eq!(
            controller("replicaset-controller").name,
            "system:serviceaccount:kube-system:replicaset-controller"
        );
        assert!(node("n1").in_group("system:nodes"));
    }
}
