//! `Warning` headers: anything in the request's path (admission plugins, field
//! validation) may add one; the response carries them all. Audit annotations are
//! gathered the same way, for the request's audit log line.

use std::cell::RefCell;
use std::collections::BTreeMap;

use axum::http::HeaderValue;
use axum::response::Response;

/// What a request's handling has to say besides its response.
#[derive(Default)]
struct Collected {
    warnings: Vec<String>,
    annotations: BTreeMap<String, String>,
}

tokio::task_local! {
    static COLLECTED: RefCell<Collected>;
}

/// The audit annotations a request's handling added (see [`annotate`]), as a response
/// extension the audit log reads.
#[derive(Clone, Debug, Default)]
pub struct AuditAnnotations(pub BTreeMap<String, String>);

/// Runs a request's handling with a place to collect warnings, then adds them to its
/// response as `Warning: 299 - "…"` headers, as Kubernetes does, and its audit
/// annotations as an [`AuditAnnotations`] extension.
pub async fn collect(handle: impl Future<Output = Response>) -> Response {
    let (mut response, collected) = COLLECTED
        .scope(RefCell::new(Collected::default()), async {
            let response = handle.await;
            (response, COLLECTED.with(|c| c.take()))
        })
        .await;
    for text in collected.warnings {
        // RFC 7234's warn-code 299 ("miscellaneous persistent warning"), the text
        // quoted as kube-apiserver sends it; kubectl prints the text. Anything not
        // valid in a header is dropped rather than failing the response.
        let quoted = serde_json::Value::String(text).to_string();
        if let Ok(value) = HeaderValue::from_str(&format!("299 - {quoted}")) {
            response.headers_mut().append("warning", value);
        }
    }
    if !collected.annotations.is_empty() {
        response
            .extensions_mut()
            .insert(AuditAnnotations(collected.annotations));
    }
    response
}

/// Adds a warning to the current request's response (ignored outside a request). The
/// same text twice is sent once, as kube-apiserver's warning recorder does: a write
/// retried on a conflict runs its admission again.
pub fn add(text: impl Into<String>) {
    let text = text.into();
    let _ = COLLECTED.try_with(|c| {
        let mut c = c.borrow_mut();
        if !c.warnings.contains(&text) {
            c.warnings.push(text);
        }
    });
}

/// Records an annotation on the current request's audit event, as Kubernetes'
/// admission plugins add `pod-security.kubernetes.io/enforce-policy` (ignored outside
/// a request; a later value for the same key replaces an earlier one).
pub fn annotate(key: impl Into<String>, value: impl Into<String>) {
    let (key, value) = (key.into(), value.into());
    let _ = COLLECTED.try_with(|c| {
        c.borrow_mut().annotations.insert(key, value);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn warnings_are_sent_once_and_annotations_ride_along() {
        let response = collect(async {
            add("would violate");
            add("would violate");
            add("other");
            annotate(
                "pod-security.kubernetes.io/enforce-policy",
                "baseline:latest",
            );
            Response::new(axum::body::Body::empty())
        })
        .await;
        let warnings: Vec<_> = response.headers().get_all("warning").iter().collect();
        assert_eq!(warnings, ["299 - \"would violate\"", "299 - \"other\""]);
        let annotations = response.extensions().get::<AuditAnnotations>().unwrap();
        assert_eq!(
            annotations.0["pod-security.kubernetes.io/enforce-policy"],
            "baseline:latest"
        );
    }
}
