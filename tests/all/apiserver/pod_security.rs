//! Pod Security admission as `trellis up` runs it (enforce `baseline`, warn and audit
//! `restricted`, `kube-system` exempt), through the real kubectl: a user who may
//! only edit one namespace cannot start a privileged `process` pod (a root process on
//! the node), namespace labels tighten or open the policy, and what is not refused
//! is warned about and audited with Kubernetes' words.

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use trellis_tests::{Kubectl, TestCluster};

/// The message kube-apiserver gives for a container that asks to be privileged.
const PRIVILEGED: &str =
    "privileged (container \"sh\" must not set securityContext.privileged=true)";

/// What a pod with no securityContext lacks at `restricted`, for container `name`.
fn unrestricted(name: &str) -> String {
    format!(
        "allowPrivilegeEscalation != false (container \"{name}\" must set securityContext.allowPrivilegeEscalation=false), \
         unrestricted capabilities (container \"{name}\" must set securityContext.capabilities.drop=[\"ALL\"]), \
         runAsNonRoot != true (pod or container \"{name}\" must set securityContext.runAsNonRoot=true), \
         seccompProfile (pod or container \"{name}\" must set securityContext.seccompProfile.type to \"RuntimeDefault\" or \"Localhost\")"
    )
}

/// A `process` pod running the node's shell, privileged when asked.
fn shell_pod(name: &str, privileged: bool) -> String {
    let mut container = json!({"name": "sh", "image": "file:///bin/sh"});
    if privileged {
        container["securityContext"] = json!({"privileged": true});
    }
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"runtimeClassName": "process", "containers": [container]}})
    .to_string()
}

/// Runs kubectl with `stdin`; returns whether it succeeded and its stderr, where
/// kubectl prints both errors and `Warning:` lines.
async fn run(kubectl: &Kubectl, args: &[&str], stdin: Option<&str>) -> Result<(bool, String)> {
    let output = kubectl.run(args, stdin).await?;
    Ok((
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_security_refuses_privileged_pods_and_warns_as_kubernetes_does() -> Result<()> {
    let cluster = TestCluster::builder()
        .with_default_pod_security()
        .start()
        .await?;
    let admin = cluster.admin();

    // The issue's user: a ServiceAccount that may edit namespace `team` only.
    cluster.kubectl_ok(&["create", "namespace", "team"]).await?;
    cluster
        .kubectl_ok(&["create", "serviceaccount", "dev", "-n", "team"])
        .await?;
    cluster
        .kubectl_ok(&[
            "create",
            "rolebinding",
            "dev-edit",
            "-n",
            "team",
            "--clusterrole=edit",
            "--serviceaccount=team:dev",
        ])
        .await?;
    let token_request = cluster.data_dir.join("token-request.json");
    std::fs::write(
        &token_request,
        r#"{"apiVersion":"authentication.k8s.io/v1","kind":"TokenRequest","spec":{}}"#,
    )?;
    let answer: Value = serde_json::from_str(
        &cluster
            .kubectl_ok(&[
                "create",
                "--raw",
                "/api/v1/namespaces/team/serviceaccounts/dev/token",
                "-f",
                token_request.to_str().context("utf-8 path")?,
            ])
            .await?,
    )?;
    let token = answer["status"]["token"].as_str().context("no token")?;
    let dev = cluster.kubectl_with_token("dev", token)?;
    let in_team = ["create", "-n", "team", "-f", "-"];

    // A privileged process pod is a root process on the node: refused under baseline.
    let (created, stderr) = run(&dev, &in_team, Some(&shell_pod("escape", true))).await?;
    ensure!(!created, "the privileged pod was admitted: {stderr}");
    ensure!(
        stderr.contains(&format!(
            "Error from server (Forbidden): error when creating \"STDIN\": pods \"escape\" is forbidden: violates PodSecurity \"baseline:latest\": {PRIVILEGED}"
        )),
        "{stderr}"
    );
    // Without `privileged` it is admitted (it will run sandboxed), with the warning
    // of what `restricted` would ask.
    let (created, stderr) = run(&dev, &in_team, Some(&shell_pod("sandboxed", false))).await?;
    ensure!(created, "{stderr}");
    ensure!(
        stderr.contains(&format!(
            "Warning: would violate PodSecurity \"restricted:latest\": {}",
            unrestricted("sh")
        )),
        "{stderr}"
    );

    // A Deployment's template is warned about, never refused: the pods it would make
    // are what enforce refuses.
    let deployment = json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"selector": {"matchLabels": {"app": "web"}}, "template": {
            "metadata": {"labels": {"app": "web"}},
            "spec": {"hostNetwork": true, "containers": [{"name": "web", "image": "file:///bin/true"}]}}}});
    let (created, stderr) = run(&dev, &in_team, Some(&deployment.to_string())).await?;
    ensure!(created, "{stderr}");
    ensure!(
        stderr.contains(&format!(
            "Warning: would violate PodSecurity \"restricted:latest\": host namespaces (hostNetwork=true), {}",
            unrestricted("web")
        )),
        "{stderr}"
    );

    // Raising the enforce level warns about the pods already there.
    let (labelled, stderr) = run(
        admin,
        &[
            "label",
            "namespace",
            "team",
            "pod-security.kubernetes.io/enforce=restricted",
        ],
        None,
    )
    .await?;
    ensure!(labelled, "{stderr}");
    ensure!(
        stderr.contains("Warning: existing pods in namespace \"team\" violate the new PodSecurity enforce level \"restricted:latest\"")
            && stderr.contains("Warning: sandboxed: allowPrivilegeEscalation != false, unrestricted capabilities, runAsNonRoot != true, seccompProfile"),
        "{stderr}"
    );
    // And now the plain pod is refused with restricted's full message; a pod that
    // sets what restricted asks is admitted without a word.
    let (created, stderr) = run(&dev, &in_team, Some(&shell_pod("plain", false))).await?;
    ensure!(!created, "{stderr}");
    ensure!(
        stderr.contains(&format!(
            "pods \"plain\" is forbidden: violates PodSecurity \"restricted:latest\": {}",
            unrestricted("sh")
        )),
        "{stderr}"
    );
    let compliant = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "compliant"},
        "spec": {"runtimeClassName": "process",
                 "securityContext": {"runAsNonRoot": true, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
                 "containers": [{"name": "app", "image": "file:///bin/true", "securityContext": {
                     "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}}]}});
    let (created, stderr) = run(&dev, &in_team, Some(&compliant.to_string())).await?;
    ensure!(created && !stderr.contains("Warning"), "{stderr}");

    // A label that is not a level is refused, as kube-apiserver refuses it.
    let (labelled, stderr) = run(
        admin,
        &[
            "label",
            "--overwrite",
            "namespace",
            "team",
            "pod-security.kubernetes.io/enforce=strict",
        ],
        None,
    )
    .await?;
    ensure!(
        !labelled
            && stderr.contains("metadata.labels[pod-security.kubernetes.io/enforce]: Invalid value: \"strict\": must be one of privileged, baseline, restricted"),
        "{stderr}"
    );

    // A namespace opened to privileged admits the pod (still warned at restricted).
    cluster
        .kubectl_ok(&["create", "namespace", "infra"])
        .await?;
    cluster
        .kubectl_ok(&[
            "label",
            "namespace",
            "infra",
            "pod-security.kubernetes.io/enforce=privileged",
        ])
        .await?;
    let (created, stderr) = run(
        admin,
        &["create", "-n", "infra", "-f", "-"],
        Some(&shell_pod("agent", true)),
    )
    .await?;
    ensure!(created, "{stderr}");
    ensure!(
        stderr.contains(&format!(
            "Warning: would violate PodSecurity \"restricted:latest\": {PRIVILEGED}, "
        )),
        "{stderr}"
    );

    // kube-system is exempt: neither refused nor warned.
    let (created, stderr) = run(
        admin,
        &["create", "-n", "kube-system", "-f", "-"],
        Some(&shell_pod("system", true)),
    )
    .await?;
    ensure!(created && !stderr.contains("Warning"), "{stderr}");

    // The refusal and the exemption are on the audit log, as Kubernetes annotates
    // its audit events.
    let audit_path = cluster.data_dir.join("audit.log");
    let annotations = |namespace: &str, code: u16| -> Option<Value> {
        std::fs::read_to_string(&audit_path)
            .ok()?
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|l| {
                l["verb"] == "create"
                    && l["resource"] == "pods"
                    && l["namespace"] == namespace
                    && l["code"] == code
            })
            .map(|l| l["annotations"].clone())
    };
    // The log is written by a background task: woken by its writes.
    let seen = trellis_tests::wait_written(
        &cluster.data_dir,
        || Some((annotations("team", 403)?, annotations("kube-system", 201)?)),
        std::time::Duration::from_secs(2),
    )
    .await?;
    let (escape, system) = seen.context("the audit log has no lines for the pods")?;
    ensure!(
        escape["pod-security.kubernetes.io/enforce-policy"] == "baseline:latest"
            && escape["pod-security.kubernetes.io/audit-violations"]
                .as_str()
                .is_some_and(|v| v.starts_with(&format!(
                    "would violate PodSecurity \"restricted:latest\": {PRIVILEGED}, "
                ))),
        "{escape}"
    );
    ensure!(
        system["pod-security.kubernetes.io/exempt"] == "namespace",
        "{system}"
    );
    Ok(())
}
