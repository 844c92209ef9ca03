//! `Warning` headers: anything in the request's path (admission plugins, field
//! validation) may add one; the response carries them all.

use std::cell::RefCell;

use axum::http::HeaderValue;
use axum::response::Response;

tokio::task_local! {
    static WARNINGS: RefCell<Vec<String>>;
}

/// Runs a request's handling with a place to collect warnings, then adds them to its
/// response as `Warning: 299 - "…"` headers, as Kubernetes does.
pub async fn collect(handle: impl Future<Output = Response>) -> Response {
    let (mut response, warnings) = WARNINGS
        .scope(RefCell::new(Vec::new()), async {
            let response = handle.await;
            (response, WARNINGS.with(|w| w.take()))
        })
        .await;
    for text in warnings {
        // RFC 7234's warn-code 299 ("miscellaneous persistent warning"), the text
        // quoted as kube-apiserver sends it; kubectl prints the text. Anything not
        // valid in a header is dropped rather than failing the response.
        let quoted = serde_json::Value::String(text).to_string();
        if let Ok(value) = HeaderValue::from_str(&format!("299 - {quoted}")) {
            response.headers_mut().append("warning", value);
        }
    }
    response
}

/// Adds a warning to the current request's response (ignored outside a request).
pub fn add(text: impl Into<String>) {
    let text = text.into();
    let _ = WARNINGS.try_with(|w| w.borrow_mut().push(text));
}
