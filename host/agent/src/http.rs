//! What the node's HTTPS routes share: the response body, plain-text answers, and the
//! checks of names and query booleans the kubelet makes.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Full};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Response, StatusCode};

/// The body of every response the server sends.
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

pub(crate) fn text(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    let mut message = message.into();
    if !message.ends_with('\n') {
        message.push('\n');
    }
    let mut response = Response::new(Full::new(Bytes::from(message)).boxed_unsync());
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// A DNS label or subdomain (what namespace, pod and container names are): never a
/// path of its own.
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
}

/// Go's `strconv.ParseBool`, as Kubernetes parses query booleans.
pub(crate) fn parse_bool(key: &str, value: &str) -> Result<bool, String> {
    match value {
        "" | "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        _ => Err(format!("invalid {key} {value:?}: not a boolean")),
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_cannot_escape_the_log_directory() {
        for bad in ["", ".", "..", "a/b", "a_b", "a%2F"] {
            assert!(!valid_name(bad), "{bad}");
        }
        assert!(valid_name("web-1.example"));
    }
}
