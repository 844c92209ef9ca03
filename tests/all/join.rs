//! Joining nodes: bootstrap tokens authenticate while their Secret says so, and
//! CertificateSigningRequests are recorded with their requester, auto-approved for a
//! bootstrapper's node certificate, approved by hand otherwise, signed by the cluster
//! CA, and refused with field causes when malformed. One server for the module.

use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use base64::Engine as _;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, UnixTime};
use serde_json::json;
use trellis_tests::TestCluster;

const TOKEN: &str = "abcdef.0123456789abcdef";

fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

/// A bootstrap token's Secret, as `trellis token create` writes it.
fn token_secret(id: &str, secret: &str, expiration: &str) -> Result<Secret> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": format!("bootstrap-token-{id}"), "namespace": "kube-system"},
        "type": "bootstrap.kubernetes.io/token",
        "stringData": {
            "token-id": id,
            "token-secret": secret,
            "expiration": expiration,
            "usage-bootstrap-authentication": "true",
            "usage-bootstrap-signing": "true",
            "auth-extra-groups": "system:bootstrappers:trellis:default-node-token",
        },
    }))?)
}

fn csr_yaml(name: &str, request_pem: &str, signer: &str) -> String {
    format!(
        "apiVersion: certificates.k8s.io/v1\nkind: CertificateSigningRequest\n\
         metadata: {{name: {name}}}\n\
         spec:\n  request: {}\n  signerName: {signer}\n  usages: [digital signature, client auth]\n",
        b64(request_pem)
    )
}

/// Waits, on a watch, until the request has a certificate; returns it (DER).
async fn issued(api: &Api<CertificateSigningRequest>, name: &str) -> Result<Vec<u8>> {
    let has_cert = |csr: Option<&CertificateSigningRequest>| {
        csr.and_then(|c| c.status.as_ref())
            .is_some_and(|s| s.certificate.is_some())
    };
    let csr = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        kube::runtime::wait::await_condition(api.clone(), name, has_cert),
    )
    .await
    .with_context(|| format!("wait for {name}'s certificate"))??
    .with_context(|| format!("{name} is gone"))?;
    let pem = csr
        .status
        .and_then(|s| s.certificate)
        .context("no certificate")?;
    let der = CertificateDer::from_pem_slice(&pem.0).context("parse the certificate")?;
    Ok(der.to_vec())
}

/// Checks that the cluster CA signed `der` as a client certificate.
fn verify_client_cert(cluster: &TestCluster, der: &[u8]) -> Result<()> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(cluster.ca_pem.as_bytes())?)?;
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::new(rustls::crypto::ring::default_provider()),
    )
    .build()?;
    verifier
        .verify_client_cert(&CertificateDer::from(der.to_vec()), &[], UnixTime::now())
        .context("verify the certificate against the cluster CA")?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_join_with_bootstrap_tokens_and_signed_requests() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let admin = cluster.kube_admin().await?;
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), "kube-system");
    secrets
        .create(
            &PostParams::default(),
            &token_secret("abcdef", "0123456789abcdef", "2100-01-01T00:00:00Z")?,
        )
        .await?;
    secrets
        .create(
            &PostParams::default(),
            &token_secret("expird", "0123456789abcdef", "2000-01-01T00:00:00Z")?,
        )
        .await?;

    // The authenticator: a good token is a bootstrapper; others are nobody.
    let bootstrapper = cluster.kubectl_with_token("bootstrapper", TOKEN)?;
    let whoami = bootstrapper
        .ok(&["auth", "whoami", "-o", "jsonpath={.status.userInfo}"])
        .await?;
    ensure!(
        whoami.contains("system:bootstrap:abcdef")
            && whoami.contains("system:bootstrappers:trellis:default-node-token"),
        "{whoami}"
    );
    for (name, token) in [
        ("wrong", "abcdef.0123456789abcdeX"),
        ("expired", "expird.0123456789abcdef"),
        ("missing", "zzzzzz.0123456789abcdef"),
    ] {
        let refused = cluster
            .kubectl_with_token(name, token)?
            .err(&["get", "csr"], None)
            .await?;
        ensure!(
            refused.contains("provide credentials") || refused.contains("Unauthorized"),
            "{name}: {refused}"
        );
    }

    // A bootstrapper's request for another subject waits for a person.
    let csrs: Api<CertificateSigningRequest> = Api::all(admin.clone());
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "jane");
    let jane = params.serialize_request(&key)?.pem()?;
    bootstrapper
        .ok_stdin(
            &["create", "-f", "-"],
            &csr_yaml("jane", &jane, "kubernetes.io/kube-apiserver-client"),
        )
        .await?;

    // A node's request with the token: recorded as the bootstrapper's, approved and
    // signed for system:node:joiner in system:nodes.
    let (_, request) = trellis_pki::node_client_request("joiner")?;
    bootstrapper
        .ok_stdin(
            &["create", "-f", "-"],
            &csr_yaml(
                "node-csr-joiner",
                &request,
                "kubernetes.io/kube-apiserver-client-kubelet",
            ),
        )
        .await?;
    let der = issued(&csrs, "node-csr-joiner").await?;
    verify_client_cert(&cluster, &der)?;
    let user = trellis_pki::identity_from_cert(&der).context("read the certificate's subject")?;
    ensure!(user.name == "system:node:joiner", "{user:?}");
    ensure!(user.groups == ["system:nodes"], "{user:?}");
    let node_csr = csrs.get("node-csr-joiner").await?;
    ensure!(
        node_csr.spec.username.as_deref() == Some("system:bootstrap:abcdef"),
        "{:?}",
        node_csr.spec
    );
    ensure!(
        node_csr
            .spec
            .groups
            .iter()
            .flatten()
            .any(|g| g == "system:bootstrappers"),
        "{:?}",
        node_csr.spec.groups
    );
    let approved = node_csr
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default();
    ensure!(
        approved
            .iter()
            .any(|c| c.type_ == "Approved" && c.reason.as_deref() == Some("AutoApproved")),
        "{approved:?}"
    );

    // The approver has looked at every request by now: jane's still waits.
    let pending = cluster.admin().ok(&["get", "csr", "jane"]).await?;
    ensure!(pending.contains("Pending"), "{pending}");
    // Approving takes `approve` on the request's signer, not only the /approval
    // subresource: an approver of requests without it is refused.
    let approver = cluster.kubectl_with_cert("approver", &[])?;
    cluster
        .admin()
        .ok_stdin(
            &["apply", "-f", "-"],
            r#"{"apiVersion": "v1", "kind": "List", "items": [
              {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
               "metadata": {"name": "csr-approver"},
               "rules": [{"apiGroups": ["certificates.k8s.io"], "resources": ["certificatesigningrequests"], "verbs": ["get", "list"]},
                         {"apiGroups": ["certificates.k8s.io"], "resources": ["certificatesigningrequests/approval"], "verbs": ["update"]}]},
              {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": "csr-approver"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "csr-approver"},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "approver"}]}]}"#,
        )
        .await?;
    let refused = approver
        .err(&["certificate", "approve", "jane"], None)
        .await?;
    ensure!(
        refused.contains("not permitted to approve requests with signerName"),
        "{refused}"
    );
    cluster
        .admin()
        .ok_stdin(
            &["apply", "-f", "-"],
            r#"{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
               "metadata": {"name": "csr-approver"},
               "rules": [{"apiGroups": ["certificates.k8s.io"], "resources": ["certificatesigningrequests"], "verbs": ["get", "list"]},
                         {"apiGroups": ["certificates.k8s.io"], "resources": ["certificatesigningrequests/approval", "certificatesigningrequests/status"], "verbs": ["get", "update", "patch"]},
                         {"apiGroups": ["certificates.k8s.io"], "resources": ["signers"], "resourceNames": ["kubernetes.io/*"], "verbs": ["approve"]}]}"#,
        )
        .await?;
    approver.ok(&["certificate", "approve", "jane"]).await?;
    let der = issued(&csrs, "jane").await?;
    // Writing a certificate takes `sign` on the signer, which the approver lacks.
    let refused = approver
        .err(
            &[
                "patch",
                "csr",
                "jane",
                "--subresource=status",
                "--type=merge",
                "-p",
                r#"{"status": {"certificate": "Zm9v"}}"#,
            ],
            None,
        )
        .await?;
    ensure!(
        refused.contains("not permitted to sign requests with signerName"),
        "{refused}"
    );
    verify_client_cert(&cluster, &der)?;
    let user = trellis_pki::identity_from_cert(&der).context("subject")?;
    ensure!(user.name == "jane", "{user:?}");
    let listed = cluster.admin().ok(&["get", "csr"]).await?;
    ensure!(
        listed.contains("REQUESTOR") && listed.contains("Approved,Issued"),
        "{listed}"
    );

    // A client certificate in system:masters would be an admin's: refused at create,
    // whoever asks.
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "mallory");
    params
        .distinguished_name
        .push(rcgen::DnType::OrganizationName, "system:masters");
    let mallory = params.serialize_request(&key)?.pem()?;
    let refused = cluster
        .admin()
        .err(
            &["create", "-f", "-"],
            Some(&csr_yaml(
                "mallory",
                &mallory,
                "kubernetes.io/kube-apiserver-client",
            )),
        )
        .await?;
    ensure!(
        refused.contains("system:masters group is not allowed"),
        "{refused}"
    );

    // A malformed request: 422 with a cause per field.
    let bad = "apiVersion: certificates.k8s.io/v1\nkind: CertificateSigningRequest\n\
               metadata: {name: bad}\nspec:\n  request: aGVsbG8K\n  usages: [client auth, flying]\n";
    let refused = cluster
        .admin()
        .err(&["create", "-f", "-", "-v=6"], Some(bad))
        .await?;
    ensure!(refused.contains("422"), "{refused}");
    for cause in [
        "spec.request: Invalid value",
        "spec.signerName: Required value",
        "spec.usages[1]: Unsupported value: \"flying\"",
    ] {
        ensure!(refused.contains(cause), "{cause} in {refused}");
    }
    cluster.stop().await
}

/// The cleaner deletes requests done with, as kube-controller-manager's `csrcleaner`
/// (its hours cut to seconds here): a denied request once its denial is old, one
/// nobody decided once it is old itself. (`certificates::tests` holds the rules.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_done_with_are_cleaned_up() -> Result<()> {
    use futures::StreamExt as _;
    use kube::runtime::watcher;

    let cluster = TestCluster::builder()
        .with_csr_cleaning(trellis_apiserver::certificates::Cleaning {
            interval: std::time::Duration::from_millis(200),
            decided: std::time::Duration::from_secs(1),
            pending: std::time::Duration::from_secs(2),
        })
        .start()
        .await?;
    let admin = cluster.kube_admin().await?;
    let csrs: Api<CertificateSigningRequest> = Api::all(admin);
    let mut changes = watcher(csrs.clone(), watcher::Config::default()).boxed();
    // Listed before the requests exist, so that no deletion happens before the watch.
    loop {
        match changes.next().await {
            Some(Ok(watcher::Event::InitDone)) => break,
            Some(_) => {}
            None => anyhow::bail!("the watch ended"),
        }
    }
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    for name in ["denied", "undecided"] {
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let request = params.serialize_request(&key)?.pem()?;
        cluster
            .admin()
            .ok_stdin(
                &["create", "-f", "-"],
                &csr_yaml(name, &request, "kubernetes.io/kube-apiserver-client"),
            )
            .await?;
    }
    cluster
        .admin()
        .ok(&["certificate", "deny", "denied"])
        .await?;
    let both_gone = async {
        let mut gone = Vec::new();
        while gone.len() < 2 {
            match changes.next().await {
                Some(Ok(watcher::Event::Delete(csr))) => gone.extend(csr.metadata.name),
                Some(_) => {}
                None => anyhow::bail!("the watch ended"),
            }
        }
        gone.sort();
        anyhow::Ok(gone)
    };
    let gone = tokio::time::timeout(std::time::Duration::from_secs(20), both_gone)
        .await
        .context("the requests were not cleaned up within 20 s")??;
    ensure!(gone == ["denied", "undecided"], "{gone:?}");
    cluster.stop().await
}
