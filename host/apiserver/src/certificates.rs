//! The CertificateSigningRequest approver and signer, in the API server because it
//! holds the cluster CA's key (kube-controller-manager's `csrapproving` and
//! `csrsigning` controllers).
//!
//! - Approval: a request for signer `kubernetes.io/kube-apiserver-client-kubelet` whose
//!   subject is `CN=system:node:NAME, O=system:nodes`, without alternative names, with
//!   usages digital signature and client auth (key encipherment allowed) is approved
//!   (`AutoApproved`) when its requester may `create` `certificatesigningrequests/
//!   selfnodeclient` (a node renewing its own, CN its own name) or
//!   `certificatesigningrequests/nodeclient` (a bootstrap token), as RBAC says.
//!   Anything else waits for `kubectl certificate approve|deny`.
//! - Signing: an approved request for the kubelet client signer or
//!   `kubernetes.io/kube-apiserver-client` gets its certificate in `status.certificate`,
//!   valid for `spec.expirationSeconds` clamped to [`Signing`]'s bounds; a request the
//!   signer refuses gets a `Failed` condition. Denied and failed requests stay unsigned.
//!
//! - Cleaning (kube-controller-manager's `csrcleaner`): at start and every
//!   [`Cleaning::interval`] the requests done with are deleted: issued, denied or
//!   failed ones an hour after their condition was last updated, those whose
//!   certificate has expired, and pending ones a day after they were made. A node that rotates its certificate
//!   leaves one request per rotation; without this they would pile up.
//!
//! It follows the watch cache: after each change to a CSR it looks at every CSR again
//! (there are few, and each is acted on once).

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use tracing::{info, warn};
use trellis_api::registry::ResourceInfo;
use trellis_api::{ApiError, Shutdown, UserInfo};

use crate::authorization::rbac;
use crate::endpoints::request::{ApiRequest, BodyFormat, Query};
use crate::object::{self, Object};
use crate::registry::certificates::{RequestSubject, condition, parse_request};
use crate::server::pki::{ClientUsages, Pki};
use crate::state::AppState;
use trellis_pki::{CLIENT_SIGNER, KUBELET_CLIENT_SIGNER};

/// How long issued certificates live.
#[derive(Clone, Debug)]
pub struct Signing {
    /// The longest certificate issued, and what a request naming no duration gets
    /// (kube-controller-manager's `--cluster-signing-duration`, one year).
    pub max_duration: Duration,
    /// The shortest certificate issued, whatever the request asks (ten minutes, as
    /// Kubernetes; tests lower it).
    pub min_duration: Duration,
}

impl Default for Signing {
    fn default() -> Self {
        Self {
            max_duration: Duration::from_secs(365 * 24 * 60 * 60),
            min_duration: Duration::from_secs(600),
        }
    }
}

/// When requests done with are deleted; Kubernetes' `csrcleaner` constants by default,
/// shorter in tests.
#[derive(Clone, Debug)]
pub struct Cleaning {
    /// How often the requests are looked at (an hour).
    pub interval: Duration,
    /// How long an approved, denied or failed request stays after its condition was
    /// last updated (an hour).
    pub decided: Duration,
    /// How long a request nobody decided stays after it was made (a day).
    pub pending: Duration,
}

impl Default for Cleaning {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(3600),
            decided: Duration::from_secs(3600),
            pending: Duration::from_secs(24 * 3600),
        }
    }
}

/// The user the approver's and signer's writes are recorded as.
const MANAGER: &str = "certificate-controller";
const NODES_GROUP: &str = trellis_api::user::groups::NODES;
/// How long to wait before looking again after the cache could not be followed.
const RETRY: Duration = Duration::from_millis(200);

/// Starts the approver and signer, and the cleaner; they stop with `stop`.
pub fn start(
    state: Arc<AppState>,
    pki: Arc<Pki>,
    signing: Signing,
    cleaning: Cleaning,
    stop: Shutdown,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(clean(state.clone(), cleaning, stop.clone()));
    tokio::spawn(async move {
        let Ok(res) = state.resource("certificates.k8s.io", "v1", "certificatesigningrequests")
        else {
            return;
        };
        let prefix = res.prefix();
        loop {
            let listed = state.cache.list(&prefix);
            let subscription = state.cache.subscribe(&prefix, listed.revision);
            for csr in &listed.objects {
                if let Err(e) = reconcile(&state, &res, &pki, &signing, csr).await {
                    let name = object::name(csr).unwrap_or_default();
                    warn!(csr = %name, error = %e.message, "handling the certificate signing request failed");
                }
            }
            match subscription {
                Ok(mut sub) if sub.replay.is_empty() => {
                    tokio::select! {
                        event = sub.rx.recv() => if event.is_none() && state.cache.is_stopped() {
                            return;
                        },
                        _ = stop.wait() => return,
                    }
                }
                Ok(_) => {}
                Err(_) => {
                    tokio::select! {
                        () = tokio::time::sleep(RETRY) => {}
                        _ = stop.wait() => return,
                    }
                }
            }
        }
    })
}

/// The cleaner: deletes, every `cleaning.interval`, the requests [`expired`] says are
/// done with. Every API server on a store runs it; a request another deleted first is
/// not found, which is fine.
async fn clean(state: Arc<AppState>, cleaning: Cleaning, stop: Shutdown) {
    let Ok(res) = state.resource("certificates.k8s.io", "v1", "certificatesigningrequests") else {
        return;
    };
    let prefix = res.prefix();
    // The first pass at once, as Kubernetes' cleaner: a server restarted more often
    // than the interval still cleans.
    let mut passes = tokio::time::interval(cleaning.interval);
    passes.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = passes.tick() => {}
            _ = stop.wait() => return,
        }
        let now = jiff::Timestamp::now();
        for csr in &state.cache.list(&prefix).objects {
            let Some(why) = expired(csr, &cleaning, now) else {
                continue;
            };
            let name = object::name(csr).unwrap_or_default().to_owned();
            let params = crate::registry::delete::DeleteParams {
                uid: object::meta_str(csr, "uid").map(str::to_owned),
                ..Default::default()
            };
            let req = internal_request(&res, "delete", Some(&name), None);
            match crate::registry::delete_one(&state, &req, &name, &params).await {
                Ok(_) => info!(csr = %name, why, "deleted"),
                Err(e) if matches!(e.0.code, 404 | 409) => {}
                Err(e) => {
                    warn!(csr = %name, error = %e.0.message, "deleting the certificate signing request failed")
                }
            }
        }
    }
}

/// Why the request is done with at `now`, by Kubernetes' `csrcleaner` rules; `None`
/// while it is kept.
fn expired(csr: &Object, cleaning: &Cleaning, now: jiff::Timestamp) -> Option<&'static str> {
    let past = |at: Option<&str>, after: Duration| {
        at.and_then(|t| t.parse::<jiff::Timestamp>().ok())
            .and_then(|t| t.checked_add(after).ok())
            .is_some_and(|deadline| deadline < now)
    };
    // A condition written without times (a client may send one) counts from the
    // request's creation, so that it is not kept for ever.
    let created = object::meta_str(csr, "creationTimestamp");
    let updated = |type_: &str| {
        condition(csr, type_).map(|c| {
            c.get("lastUpdateTime")
                .or_else(|| c.get("lastTransitionTime"))
                .and_then(Value::as_str)
                .or(created)
                .map(str::to_owned)
        })
    };
    let approved = condition(csr, "Approved").is_some();
    if approved && issued(csr) {
        let certificate = csr
            .get("status")
            .and_then(|s| s.get("certificate"))
            .and_then(Value::as_str)
            .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
            .and_then(|pem| String::from_utf8(pem).ok());
        if let Some(Ok((_, not_after))) = certificate.map(|pem| trellis_pki::cert_validity(&pem))
            && not_after < now.as_second()
        {
            return Some("its certificate has expired");
        }
    }
    for (type_, why) in [
        (
            "Approved",
            "issued longer ago than decided requests are kept",
        ),
        ("Denied", "denied longer ago than decided requests are kept"),
        ("Failed", "failed longer ago than decided requests are kept"),
    ] {
        // Approved counts once signed: a request approved for a signer that has not
        // signed it yet stays, as in Kubernetes.
        if type_ == "Approved" && !issued(csr) {
            continue;
        }
        if let Some(at) = updated(type_)
            && past(at.as_deref(), cleaning.decided)
        {
            return Some(why);
        }
    }
    let undecided = ["Approved", "Denied", "Failed"]
        .iter()
        .all(|t| condition(csr, t).is_none());
    if undecided && past(object::meta_str(csr, "creationTimestamp"), cleaning.pending) {
        return Some("pending longer than undecided requests are kept");
    }
    None
}

/// What to do with one request.
async fn reconcile(
    state: &AppState,
    res: &ResourceInfo,
    pki: &Pki,
    signing: &Signing,
    csr: &Object,
) -> Result<(), ApiError> {
    if issued(csr) || condition(csr, "Denied").is_some() || condition(csr, "Failed").is_some() {
        return Ok(());
    }
    let spec = csr.get("spec").cloned().unwrap_or_default();
    let signer = spec["signerName"].as_str().unwrap_or_default();
    if signer != KUBELET_CLIENT_SIGNER && signer != CLIENT_SIGNER {
        return Ok(());
    }
    let request = spec["request"]
        .as_str()
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .and_then(|b| String::from_utf8(b).ok())
        .unwrap_or_default();
    let subject = parse_request(&request);
    let usages: Vec<&str> = spec["usages"]
        .as_array()
        .map(|u| u.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let name = object::name(csr).unwrap_or_default().to_owned();
    let uid = object::meta_str(csr, "uid").unwrap_or_default().to_owned();
    if condition(csr, "Approved").is_none() {
        let Ok(subject) = &subject else {
            return Ok(());
        };
        if signer == KUBELET_CLIENT_SIGNER
            && node_client_request(subject, &usages)
            && may_have_node_client(state, &spec, subject).await?
        {
            let approved = json!({
                "type": "Approved",
                "status": "True",
                "reason": "AutoApproved",
                "message": "Auto approving kubelet client certificate after SubjectAccessReview.",
                "lastUpdateTime": object::now_timestamp(),
                "lastTransitionTime": object::now_timestamp(),
            });
            write(state, res, &name, &uid, |status| {
                push_condition(status, approved.clone());
            })
            .await?;
            info!(csr = %name, requester = spec["username"].as_str().unwrap_or_default(), "approved");
        }
        return Ok(());
    }
    // Approved: sign, or say why not.
    let signed = match &subject {
        Ok(subject) => sign(pki, signing, signer, subject, &usages, &spec, &request),
        Err(e) => Err(e.to_string()),
    };
    match signed {
        Ok(pem) => {
            let encoded = base64::engine::general_purpose::STANDARD.encode(pem);
            write(state, res, &name, &uid, |status| {
                status.insert("certificate".into(), json!(encoded));
            })
            .await?;
            info!(csr = %name, signer, "signed");
        }
        Err(reason) => {
            let failed = json!({
                "type": "Failed",
                "status": "True",
                "reason": "SignerValidationFailure",
                "message": reason,
                "lastUpdateTime": object::now_timestamp(),
                "lastTransitionTime": object::now_timestamp(),
            });
            write(state, res, &name, &uid, |status| {
                push_condition(status, failed.clone());
            })
            .await?;
            warn!(csr = %name, signer, %reason, "refused to sign");
        }
    }
    Ok(())
}

/// Whether the request carries its certificate.
fn issued(csr: &Object) -> bool {
    csr.get("status")
        .and_then(|s| s.get("certificate"))
        .and_then(Value::as_str)
        .is_some_and(|c| !c.is_empty())
}

/// Kubernetes' `isNodeClientCert`: the subject and usages of a node's client
/// certificate, and nothing more.
pub fn node_client_request(subject: &RequestSubject, usages: &[&str]) -> bool {
    let mut usages: Vec<&str> = usages.to_vec();
    usages.sort_unstable();
    usages.dedup();
    let usages_ok = usages == ["client auth", "digital signature"]
        || usages == ["client auth", "digital signature", "key encipherment"];
    usages_ok
        && subject.organizations == [NODES_GROUP]
        && subject
            .common_name
            .strip_prefix("system:node:")
            .is_some_and(|n| !n.is_empty())
        && !subject.has_alt_names
}

/// Whether the requester may have a node client certificate for `subject`: its own
/// (`selfnodeclient`) or any (`nodeclient`), by RBAC.
async fn may_have_node_client(
    state: &AppState,
    spec: &Value,
    subject: &RequestSubject,
) -> Result<bool, ApiError> {
    let user = UserInfo {
        name: spec["username"].as_str().unwrap_or_default().to_owned(),
        uid: spec["uid"].as_str().unwrap_or_default().to_owned(),
        groups: spec["groups"]
            .as_array()
            .map(|g| {
                g.iter()
                    .filter_map(|g| g.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default(),
        extra: Default::default(),
    };
    let allowed = |resource: &'static str| rbac::Attributes {
        verb: "create",
        group: "certificates.k8s.io",
        resource,
        namespace: "",
        name: "",
    };
    if user.name == subject.common_name
        && rbac::authorize(
            &state.rbac,
            &user,
            &allowed("certificatesigningrequests/selfnodeclient"),
        )
        .await
        .is_ok()
    {
        return Ok(true);
    }
    Ok(rbac::authorize(
        &state.rbac,
        &user,
        &allowed("certificatesigningrequests/nodeclient"),
    )
    .await
    .is_ok())
}

/// The certificate for an approved request, or why the signer refuses it.
fn sign(
    pki: &Pki,
    signing: &Signing,
    signer: &str,
    subject: &RequestSubject,
    usages: &[&str],
    spec: &Value,
    request: &str,
) -> Result<String, String> {
    if signer == KUBELET_CLIENT_SIGNER && !node_client_request(subject, usages) {
        return Err(format!(
            "invalid certificate request for {KUBELET_CLIENT_SIGNER}: the subject must be CN=system:node:NAME, O=system:nodes, without alternative names, with usages digital signature and client auth"
        ));
    }
    if !usages.contains(&"client auth")
        || usages
            .iter()
            .any(|u| !matches!(*u, "client auth" | "digital signature" | "key encipherment"))
    {
        return Err(format!(
            "invalid usages for {signer}: only digital signature, key encipherment and client auth are allowed, and client auth is required"
        ));
    }
    if subject.common_name.is_empty() {
        return Err("the certificate request has no common name".to_owned());
    }
    // Validation refuses these at create; a request stored before that rule is
    // refused here too: no approval makes a cluster admin.
    if subject.organizations.iter().any(|o| o == "system:masters") {
        return Err("the signer does not sign for the system:masters group".to_owned());
    }
    let requested = spec["expirationSeconds"]
        .as_u64()
        .map(Duration::from_secs)
        .unwrap_or(signing.max_duration);
    let validity = requested.clamp(signing.min_duration, signing.max_duration);
    pki.sign_client_request(
        request,
        &subject.common_name,
        &subject.organizations,
        ClientUsages {
            key_encipherment: usages.contains(&"key encipherment"),
        },
        validity,
    )
    .map_err(|e| format!("{e:#}"))
}

fn push_condition(status: &mut serde_json::Map<String, Value>, condition: Value) {
    let conditions = status
        .entry("conditions")
        .or_insert_with(|| Value::Array(Vec::new()));
    if let Value::Array(list) = conditions {
        list.retain(|c| c["type"] != condition["type"]);
        list.push(condition);
    } else {
        *conditions = Value::Array(vec![condition]);
    }
}

/// A request of the controller's own, made as the server.
fn internal_request(
    res: &ResourceInfo,
    verb: &'static str,
    name: Option<&str>,
    subresource: Option<trellis_api::registry::Subresource>,
) -> ApiRequest {
    ApiRequest {
        resource: res.clone(),
        namespace: None,
        name: name.map(str::to_owned),
        subresource,
        verb,
        query: Query::default(),
        user: UserInfo::new(
            crate::registry::status::INTERNAL_USER,
            [trellis_api::user::groups::AUTHENTICATED],
        ),
        content_type: None,
        user_agent: Some(MANAGER.to_owned()),
        body_format: BodyFormat::Json,
        table: None,
        dry_run: false,
        include_uninitialized: true,
    }
}

/// Writes the status `change` makes to the request `name` (of uid `uid`), as the
/// server: a request replaced or already decided meanwhile is left alone.
async fn write(
    state: &AppState,
    res: &ResourceInfo,
    name: &str,
    uid: &str,
    mut change: impl FnMut(&mut serde_json::Map<String, Value>),
) -> Result<(), ApiError> {
    let req = internal_request(
        res,
        "update",
        Some(name),
        Some(trellis_api::registry::Subresource::Status),
    );
    let written = crate::registry::guaranteed_update(state, &req, name, |old, new| {
        if object::meta_str(old, "uid") != Some(uid) {
            return Ok(());
        }
        // Another server (they share the store) may have got there first: a request is
        // decided and signed once.
        let decided =
            condition(old, "Denied").is_some() || condition(old, "Failed").is_some() || issued(old);
        if decided {
            return Ok(());
        }
        let mut status = old
            .get("status")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        change(&mut status);
        new.insert("status".into(), Value::Object(status));
        crate::registry::typed::default_and_validate_with(
            res,
            new,
            Some(old),
            crate::registry::typed::UnknownFields::Ignore,
        )?;
        crate::fieldmanager::field_manager::record_write(state, &req, Some(old), new)
    })
    .await;
    match written {
        Ok(_) => Ok(()),
        Err(e) if e.0.code == 404 => Ok(()),
        Err(e) => Err(e.0),
    }
}

/// Whether the user may `verb` requests of the stored CSR's signer: `approve` (to
/// approve or deny them) or `sign` (to write their status) on `certificates.k8s.io`
/// `signers`, named for the signer or for all of its domain (`example.com/*`), as
/// Kubernetes' CSR approval and signing admission ask.
pub async fn authorize_signer(
    state: &crate::state::AppState,
    req: &crate::endpoints::request::ApiRequest,
    verb: &str,
) -> Result<(), trellis_api::ApiError> {
    let name = req.name()?;
    let (csr, _) = crate::registry::read(state, &req.resource, None, name)
        .await
        .map_err(|e| e.0)?;
    let signer = csr
        .get("spec")
        .and_then(|s| s.get("signerName"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let domain_wide = signer
        .split_once('/')
        .map(|(domain, _)| format!("{domain}/*"))
        .unwrap_or_default();
    for signer_name in [signer.as_str(), domain_wide.as_str()] {
        let attrs = crate::authorization::rbac::Attributes {
            verb,
            group: "certificates.k8s.io",
            resource: "signers",
            namespace: "",
            name: signer_name,
        };
        if crate::authorization::rbac::authorize(&state.rbac, &req.user, &attrs)
            .await
            .is_ok()
        {
            return Ok(());
        }
    }
    Err(trellis_api::ApiError::admission_forbidden(
        "certificates.k8s.io",
        "certificatesigningrequests",
        name,
        &format!("user not permitted to {verb} requests with signerName {signer:?}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn csr(value: Value) -> Object {
        match value {
            Value::Object(map) => map,
            _ => unreachable!(),
        }
    }

    fn decided(type_: &str, at: &str) -> Value {
        json!({"type": type_, "status": "True", "lastUpdateTime": at})
    }

    #[test]
    fn the_cleaner_keeps_requests_for_kubernetes_times() {
        let cleaning = Cleaning::default();
        let now: jiff::Timestamp = "2026-11-26T12:00:00Z".parse().unwrap();
        let created = json!({"creationTimestamp": "2026-11-26T11:30:00Z"});
        for (status, expected) in [
            // Pending: a day from its creation.
            (json!({}), None),
            (
                json!({"conditions": [decided("Approved", "2026-11-26T11:30:00Z")]}),
                None,
            ),
            // Approved an hour ago: gone once issued, kept while its signer has not
            // signed it.
            (
                json!({"conditions": [decided("Approved", "2026-11-26T10:59:59Z")],
                       "certificate": "bm90IHJlYWQ="}),
                Some("issued"),
            ),
            (
                json!({"conditions": [decided("Approved", "2026-11-26T10:59:59Z")]}),
                None,
            ),
            (
                json!({"conditions": [decided("Denied", "2026-11-26T10:59:59Z")]}),
                Some("denied"),
            ),
            (
                json!({"conditions": [decided("Failed", "2026-11-26T10:59:59Z")]}),
                Some("failed"),
            ),
            (
                json!({"conditions": [decided("Denied", "2026-11-26T11:00:01Z")]}),
                None,
            ),
        ] {
            let got = expired(
                &csr(json!({"metadata": created, "status": status})),
                &cleaning,
                now,
            );
            assert_eq!(
                got.map(|why| why.split(' ').next().unwrap_or_default()),
                expected,
                "{status}"
            );
        }
        // A condition without times counts from the request's creation.
        let untimed = csr(
            json!({"metadata": {"creationTimestamp": "2026-11-26T10:00:00Z"},
            "status": {"conditions": [{"type": "Denied", "status": "True"}]}}),
        );
        assert!(expired(&untimed, &cleaning, now).is_some_and(|w| w.starts_with("denied")));
        let old = csr(json!({"metadata": {"creationTimestamp": "2026-11-25T11:59:59Z"}}));
        assert!(expired(&old, &cleaning, now).is_some_and(|w| w.starts_with("pending")));
        // A condition written as not holding decides nothing.
        let undecided = csr(
            json!({"metadata": {"creationTimestamp": "2026-11-25T11:59:59Z"},
            "status": {"conditions": [{"type": "Denied", "status": "False",
                                       "lastUpdateTime": "2026-11-26T10:00:00Z"}]}}),
        );
        assert!(expired(&undecided, &cleaning, now).is_some_and(|w| w.starts_with("pending")));
    }

    #[test]
    fn the_cleaner_deletes_a_request_whose_certificate_has_expired() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::load_or_create(dir.path(), &[]).unwrap();
        let (cert_pem, _) = pki.issue_client_cert("jane", &[], 1).unwrap();
        let (_, not_after) = trellis_pki::cert_validity(&cert_pem).unwrap();
        let encoded = base64::engine::general_purpose::STANDARD.encode(&cert_pem);
        let approved_now = jiff::Timestamp::from_second(not_after - 60).unwrap();
        let request = csr(json!({
            "metadata": {"creationTimestamp": approved_now.to_string()},
            "status": {"certificate": encoded,
                       "conditions": [decided("Approved", &approved_now.to_string())]},
        }));
        let cleaning = Cleaning::default();
        let before = jiff::Timestamp::from_second(not_after - 30).unwrap();
        assert_eq!(expired(&request, &cleaning, before), None);
        let after = jiff::Timestamp::from_second(not_after + 1).unwrap();
        assert_eq!(
            expired(&request, &cleaning, after),
            Some("its certificate has expired")
        );
    }
}
