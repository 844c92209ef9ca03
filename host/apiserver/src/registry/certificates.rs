//! `certificates.k8s.io/v1` CertificateSigningRequests, as Kubernetes' registry keeps
//! them: the requester's identity recorded at create (`spec.username`, `uid`,
//! `groups`, `extra`, whatever the client sent), a spec that never changes, approval
//! (the Approved and Denied conditions) written only through `/approval`, and the
//! issued certificate only through `/status`.
//!
//! The signing itself is [`crate::certificates`].

use serde_json::{Map, Value, json};
use trellis_api::status::StatusCause;
use trellis_api::{UserInfo, registry::ResourceInfo, registry::Subresource};

use crate::object::Object;

/// The shortest `spec.expirationSeconds` Kubernetes accepts (ten minutes).
pub const MIN_EXPIRATION_SECONDS: i64 = 600;

/// The key usages Kubernetes knows, as `spec.usages` spells them.
const KNOWN_USAGES: &[&str] = &[
    "signing",
    "digital signature",
    "content commitment",
    "key encipherment",
    "key agreement",
    "data encipherment",
    "cert sign",
    "crl sign",
    "encipher only",
    "decipher only",
    "any",
    "server auth",
    "client auth",
    "code signing",
    "email protection",
    "s/mime",
    "ipsec end system",
    "ipsec tunnel",
    "ipsec user",
    "timestamping",
    "ocsp signing",
    "microsoft sgc",
    "netscape sgc",
];

/// Condition types only `/approval` writes.
const APPROVAL_CONDITIONS: &[&str] = &["Approved", "Denied"];

pub fn is_csr(res: &ResourceInfo) -> bool {
    res.group == "certificates.k8s.io" && res.plural == "certificatesigningrequests"
}

/// What a create records of its requester, replacing whatever the client sent: the
/// approver and signer decide on these, so a client must not choose them.
pub fn set_requester(obj: &mut Object, user: &UserInfo) {
    let spec = obj
        .entry("spec")
        .or_insert_with(|| Value::Object(Map::new()));
    let Value::Object(spec) = spec else {
        return;
    };
    spec.insert("username".into(), json!(user.name));
    if user.uid.is_empty() {
        spec.remove("uid");
    } else {
        spec.insert("uid".into(), json!(user.uid));
    }
    spec.insert("groups".into(), json!(user.groups));
    if user.extra.is_empty() {
        spec.remove("extra");
    } else {
        spec.insert("extra".into(), json!(user.extra));
    }
}

/// The condition of `kind` (`Approved`, `Denied`, `Failed`) with status True, if any.
pub fn condition<'a>(obj: &'a Object, kind: &str) -> Option<&'a Value> {
    obj.get("status")?
        .get("conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind && c["status"] != "False")
}

fn conditions(obj: &Object) -> Vec<Value> {
    obj.get("status")
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

fn status_mut(obj: &mut Object) -> &mut Map<String, Value> {
    let status = obj
        .entry("status")
        .or_insert_with(|| Value::Object(Map::new()));
    if !status.is_object() {
        *status = Value::Object(Map::new());
    }
    match status {
        Value::Object(m) => m,
        _ => unreachable!("replaced above"),
    }
}

/// An update of `old` into `new` through the main resource, `/status` or `/approval`:
/// the spec never changes; `/approval` writes the approval conditions and nothing
/// else; `/status` writes the rest of the status (the certificate, other conditions)
/// and keeps the approval as it was. The main resource keeps the whole status.
pub fn merge(sub: Option<Subresource>, old: &Object, new: &mut Object) {
    if let Some(spec) = old.get("spec") {
        new.insert("spec".into(), spec.clone());
    }
    let approval = |c: &Value| {
        APPROVAL_CONDITIONS
            .iter()
            .any(|t| c["type"].as_str() == Some(t))
    };
    match sub {
        Some(Subresource::Approval) => {
            let mut kept: Vec<Value> = conditions(old)
                .into_iter()
                .filter(|c| !approval(c))
                .collect();
            kept.extend(conditions(new).into_iter().filter(approval));
            // Everything else, the certificate included, stays as stored.
            *new = old.clone();
            status_mut(new).insert("conditions".into(), Value::Array(kept));
        }
        Some(Subresource::Status) => {
            let mut kept: Vec<Value> = conditions(new)
                .into_iter()
                .filter(|c| !approval(c))
                .collect();
            kept.extend(conditions(old).into_iter().filter(approval));
            status_mut(new).insert("conditions".into(), Value::Array(kept));
        }
        _ => {}
    }
}

/// Kubernetes' validation of a CSR: a PEM `CERTIFICATE REQUEST` whose signature
/// verifies, a signer name, known usages, an expiration of at least ten minutes; not
/// both approved and denied; a certificate only once approved.
pub fn validate(obj: &Object, causes: &mut Vec<StatusCause>) {
    let spec = obj.get("spec");
    let field = |name: &str| spec.and_then(|s| s.get(name));
    match field("request").and_then(Value::as_str) {
        None | Some("") => causes.push(StatusCause::required("spec.request")),
        Some(b64) => {
            use base64::Engine as _;
            let pem = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .ok()
                .and_then(|b| String::from_utf8(b).ok());
            match pem
                .ok_or("not valid base64".to_owned())
                .and_then(|p| parse_request(&p).map_err(|e| e.to_string()))
            {
                Err(detail) => causes.push(StatusCause::new(
                    "FieldValueInvalid",
                    "spec.request",
                    format!("Invalid value: []byte{{...}}: {detail}"),
                )),
                // As Kubernetes' CertificateSubjectRestriction: a client certificate
                // in system:masters would be a cluster admin's, whoever approved it.
                Ok(subject)
                    if subject.organizations.iter().any(|o| o == "system:masters")
                        && field("signerName").and_then(Value::as_str)
                            == Some("kubernetes.io/kube-apiserver-client") =>
                {
                    causes.push(StatusCause::forbidden(
                        "spec.request",
                        "use of kubernetes.io/kube-apiserver-client signer with system:masters group is not allowed",
                    ));
                }
                Ok(_) => {}
            }
        }
    }
    match field("signerName").and_then(Value::as_str) {
        None | Some("") => causes.push(StatusCause::required("spec.signerName")),
        Some(name) if !valid_signer_name(name) => causes.push(StatusCause::invalid(
            "spec.signerName",
            name,
            "must be a fully qualified domain and path of the form 'example.com/signer-name'",
        )),
        Some(_) => {}
    }
    match field("usages").and_then(Value::as_array) {
        None => causes.push(StatusCause::required("spec.usages")),
        Some(usages) if usages.is_empty() => causes.push(StatusCause::required("spec.usages")),
        Some(usages) => {
            for (i, u) in usages.iter().enumerate() {
                let known = u.as_str().is_some_and(|u| KNOWN_USAGES.contains(&u));
                if !known {
                    causes.push(StatusCause::new(
                        "FieldValueNotSupported",
                        format!("spec.usages[{i}]"),
                        format!(
                            "Unsupported value: {u}: supported values: {}",
                            KNOWN_USAGES
                                .iter()
                                .map(|k| format!("\"{k}\""))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    ));
                }
            }
        }
    }
    if let Some(seconds) = field("expirationSeconds").and_then(Value::as_i64)
        && seconds < MIN_EXPIRATION_SECONDS
    {
        causes.push(StatusCause::invalid(
            "spec.expirationSeconds",
            &seconds.to_string(),
            "may not specify a duration less than 600 seconds (10 minutes)",
        ));
    }
    let approved = condition(obj, "Approved").is_some();
    if approved && condition(obj, "Denied").is_some() {
        causes.push(StatusCause::invalid(
            "status.conditions",
            "Approved, Denied",
            "Approved and Denied conditions are mutually exclusive",
        ));
    }
    let certificate = obj
        .get("status")
        .and_then(|s| s.get("certificate"))
        .and_then(Value::as_str)
        .is_some_and(|c| !c.is_empty());
    if certificate && !approved {
        causes.push(StatusCause::forbidden(
            "status.certificate",
            "cannot be set unless the request is approved",
        ));
    }
}

/// Go's rule for a signer name: a DNS subdomain, a slash, then a path.
fn valid_signer_name(name: &str) -> bool {
    let Some((domain, path)) = name.split_once('/') else {
        return false;
    };
    !path.is_empty()
        && domain.contains('.')
        && domain.split('.').all(|label| {
            !label.is_empty()
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        })
}

/// The subject of a certificate request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSubject {
    pub common_name: String,
    pub organizations: Vec<String>,
    /// Whether the request asks for subject alternative names of any kind.
    pub has_alt_names: bool,
}

/// Why a certificate request does not parse.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("PEM block type must be CERTIFICATE REQUEST")]
    NotPem,
    #[error("the certificate request does not parse: {0}")]
    Parse(String),
    #[error("the certificate request's signature does not verify")]
    Signature,
}

/// Parses a PEM certificate request, checks its signature, and returns its subject.
pub fn parse_request(pem: &str) -> Result<RequestSubject, RequestError> {
    use x509_parser::prelude::FromDer as _;
    let (_, block) =
        x509_parser::pem::parse_x509_pem(pem.as_bytes()).map_err(|_| RequestError::NotPem)?;
    if block.label != "CERTIFICATE REQUEST" && block.label != "NEW CERTIFICATE REQUEST" {
        return Err(RequestError::NotPem);
    }
    let (_, csr) =
        x509_parser::certification_request::X509CertificationRequest::from_der(&block.contents)
            .map_err(|e| RequestError::Parse(e.to_string()))?;
    csr.verify_signature()
        .map_err(|_| RequestError::Signature)?;
    let subject = &csr.certification_request_info.subject;
    let common_name = subject
        .iter_common_name()
        .filter_map(|a| a.as_str().ok())
        .last()
        .unwrap_or_default()
        .to_owned();
    let organizations = subject
        .iter_organization()
        .filter_map(|a| a.as_str().ok().map(str::to_owned))
        .collect();
    let has_alt_names = csr.requested_extensions().is_some_and(|mut exts| {
        exts.any(|e| {
            matches!(
                e,
                x509_parser::extensions::ParsedExtension::SubjectAlternativeName(_)
            )
        })
    });
    Ok(RequestSubject {
        common_name,
        organizations,
        has_alt_names,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn csr_pem(cn: &str, orgs: &[&str]) -> String {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = rcgen::CertificateParams::default();
        let mut dn = rcgen::DistinguishedName::new();
        dn.push(rcgen::DnType::CommonName, cn);
        for o in orgs {
            dn.push(rcgen::DnType::OrganizationName, *o);
        }
        params.distinguished_name = dn;
        params.serialize_request(&key).unwrap().pem().unwrap()
    }

    #[test]
    fn parses_subject_of_a_signed_request() {
        let subject = parse_request(&csr_pem("system:node:a", &["system:nodes"])).unwrap();
        assert_eq!(subject.common_name, "system:node:a");
        assert_eq!(subject.organizations, vec!["system:nodes".to_owned()]);
        assert!(parse_request("not a pem").is_err());
    }

    #[test]
    fn approval_writes_only_approval_conditions() {
        let old = json!({"spec": {"request": "x"}, "status": {"certificate": "c", "conditions": [{"type": "Failed", "status": "True"}]}});
        let mut new = json!({"spec": {"request": "changed"}, "status": {"conditions": [{"type": "Approved", "status": "True"}]}});
        let (Value::Object(old), Value::Object(new_map)) = (old, &mut new) else {
            unreachable!()
        };
        merge(Some(Subresource::Approval), &old, new_map);
        assert_eq!(new["spec"]["request"], "x");
        assert_eq!(new["status"]["certificate"], "c");
        assert_eq!(new["status"]["conditions"].as_array().unwrap().len(), 2);
    }
}
