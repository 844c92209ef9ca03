//! Objects as the server handles them: Kubernetes JSON (`serde_json::Value`) with
//! helpers for the metadata the server owns (uid, timestamps, resourceVersion,
//! generation) and the checks every write makes (names, apiVersion/kind).

use serde_json::{Map, Value};
use trellis_api::ApiError;
use trellis_api::registry::ResourceInfo;
use trellis_api::status::StatusCause;

pub type Object = Map<String, Value>;

/// Parses a request body (JSON or YAML) into an object.
pub fn decode(body: &[u8], yaml: bool) -> Result<Object, ApiError> {
    let value: Value = if yaml {
        let text = std::str::from_utf8(body)
            .map_err(|e| ApiError::bad_request(format!("the request body is not UTF-8: {e}")))?;
        serde_saphyr::from_str(text)
            .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?
    } else {
        serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("error decoding JSON: {e}")))?
    };
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ApiError::bad_request(format!(
            "the request body must be an object, not {}",
            type_name(&other)
        ))),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// An object as the store keeps it.
pub fn encode(obj: &Object) -> Result<bytes::Bytes, ApiError> {
    serde_json::to_vec(obj)
        .map(bytes::Bytes::from)
        .map_err(|e| ApiError::internal(format!("encode the object: {e}")))
}

/// `spec.selector` of a workload as a label selector: a ReplicationController's is a
/// plain map of labels, which is its `matchLabels`.
pub fn spec_selector(obj: &Object) -> Option<Value> {
    let selector = obj.get("spec")?.get("selector")?;
    Some(match selector.as_object() {
        Some(m)
            if !m.is_empty()
                && !m.contains_key("matchLabels")
                && !m.contains_key("matchExpressions") =>
        {
            serde_json::json!({ "matchLabels": selector })
        }
        _ => selector.clone(),
    })
}

pub fn metadata(obj: &Object) -> Option<&Object> {
    obj.get("metadata").and_then(Value::as_object)
}

/// The object's metadata, created if missing or not an object.
pub fn metadata_mut(obj: &mut Object) -> &mut Object {
    let entry = obj
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    if !entry.is_object() {
        *entry = Value::Object(Map::new());
    }
    match entry {
        Value::Object(m) => m,
        _ => unreachable!("metadata was just made an object"),
    }
}

pub fn meta_str<'a>(obj: &'a Object, field: &str) -> Option<&'a str> {
    metadata(obj)
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
}

pub fn name(obj: &Object) -> Option<&str> {
    meta_str(obj, "name").filter(|n| !n.is_empty())
}

pub fn set_meta(obj: &mut Object, field: &str, value: impl Into<Value>) {
    metadata_mut(obj).insert(field.to_owned(), value.into());
}

pub fn remove_meta(obj: &mut Object, field: &str) -> Option<Value> {
    metadata_mut(obj).remove(field)
}

/// RFC 3339 in UTC with second precision, as `metav1.Time`.
pub fn now_timestamp() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// Checks `apiVersion` and `kind` of a body against the resource it was sent to;
/// fills them in when the client left them out.
pub fn check_type(obj: &mut Object, res: &ResourceInfo) -> Result<(), ApiError> {
    let want_version = res.api_version();
    match obj.get("apiVersion").and_then(Value::as_str) {
        None | Some("") => {
            obj.insert("apiVersion".into(), want_version.into());
        }
        Some(v) if v == want_version => {}
        Some(v) => {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({v}) does not match the expected API version ({want_version})"
            )));
        }
    }
    match obj.get("kind").and_then(Value::as_str) {
        None | Some("") => {
            obj.insert("kind".into(), res.kind.clone().into());
        }
        Some(k) if k == res.kind => {}
        Some(k) => {
            return Err(ApiError::bad_request(format!(
                "the kind in the data ({k}) does not match the expected kind ({})",
                res.kind
            )));
        }
    }
    Ok(())
}

/// Kubernetes' DNS-1123 subdomain check (object names of most kinds): at most 253
/// characters of lowercase alphanumerics, `-` and `.`, starting and ending alphanumeric.
pub fn dns1123_subdomain(name: &str) -> Option<String> {
    if name.len() > 253 {
        return Some(format!(
            "must be no more than 253 characters (is {})",
            name.len()
        ));
    }
    let ok_chars = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    let ends_ok = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if !ok_chars || !ends_ok(name.bytes().next()) || !ends_ok(name.bytes().last()) {
        return Some(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', \
             and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation \
             is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
                .to_owned(),
        );
    }
    None
}

/// Kubernetes' DNS-1123 label check (namespace names): at most 63 characters, no dots.
pub fn dns1123_label(name: &str) -> Option<String> {
    if name.len() > 63 {
        return Some(format!(
            "must be no more than 63 characters (is {})",
            name.len()
        ));
    }
    if name.contains('.') {
        return Some("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character".to_owned());
    }
    dns1123_subdomain(name)
}

/// `metadata.ownerReferences` as Kubernetes checks them: each names its owner's
/// apiVersion, kind, name and uid, and at most one is the controller.
pub fn validate_owner_references(obj: &Object) -> Vec<StatusCause> {
    let mut causes = Vec::new();
    let Some(refs) = metadata(obj)
        .and_then(|m| m.get("ownerReferences"))
        .and_then(Value::as_array)
    else {
        return causes;
    };
    let mut controllers = Vec::new();
    for (i, reference) in refs.iter().enumerate() {
        let text = |key: &str| reference.get(key).and_then(Value::as_str).unwrap_or("");
        // `v1` or `group/version`: the version part must be there.
        let api_version = text("apiVersion");
        let version = match api_version.split_once('/') {
            Some((_, version)) if version.contains('/') => "",
            Some((_, version)) => version,
            None => api_version,
        };
        if version.is_empty() {
            causes.push(StatusCause::invalid(
                format!("metadata.ownerReferences[{i}].apiVersion"),
                api_version,
                "version must not be empty",
            ));
        }
        for (key, what) in [("kind", "kind"), ("name", "name"), ("uid", "uid")] {
            if text(key).is_empty() {
                causes.push(StatusCause::invalid(
                    format!("metadata.ownerReferences[{i}].{key}"),
                    "",
                    &format!("{what} must not be empty"),
                ));
            }
        }
        if reference.get("controller").and_then(Value::as_bool) == Some(true) {
            controllers.push(format!("{}/{}", text("kind"), text("name")));
        }
    }
    if controllers.len() > 1 {
        causes.push(StatusCause::invalid(
            "metadata.ownerReferences",
            "",
            &format!(
                "Only one reference can have Controller set to true. Found \"true\" in references for {}",
                controllers.join(" and ")
            ),
        ));
    }
    causes
}

/// The name checks of a create: a valid name, and a namespace where one belongs.
pub fn validate_name(res: &ResourceInfo, name: &str) -> Vec<StatusCause> {
    let problem = if res.plural == "namespaces" {
        dns1123_label(name)
    } else if res.group == "rbac.authorization.k8s.io" {
        // Roles and bindings take any name a URL path segment can carry, as
        // Kubernetes' ValidateRBACName (`system:auth-delegator`).
        path_segment(name)
    } else {
        dns1123_subdomain(name)
    };
    problem
        .map(|p| StatusCause::invalid("metadata.name", name, &p))
        .into_iter()
        .collect()
}

/// Kubernetes' `ValidatePathSegmentName`.
fn path_segment(name: &str) -> Option<String> {
    if name == "." || name == ".." {
        return Some(format!("may not be '{name}'"));
    }
    ["/", "%"]
        .into_iter()
        .find(|bad| name.contains(bad))
        .map(|bad| format!("may not contain '{bad}'"))
}

/// A random suffix for `generateName`, as Kubernetes: 5 characters of consonants and
/// digits that cannot spell words.
pub fn name_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_dns1123() {
        assert!(dns1123_subdomain("web-1.example").is_none());
        assert!(dns1123_subdomain("Web").is_some());
        assert!(dns1123_subdomain("-web").is_some());
        assert!(dns1123_subdomain(&"a".repeat(254)).unwrap().contains("253"));
        assert!(dns1123_label("a.b").is_some());
        assert!(dns1123_label(&"a".repeat(64)).is_some());
        assert!(path_segment("system:metrics-server").is_none());
        assert_eq!(path_segment("a/b").unwrap(), "may not contain '/'");
        assert!(path_segment("..").is_some());
    }

    #[test]
    fn decodes_json_and_yaml_and_refuses_non_objects() {
        let j = decode(br#"{"kind":"Pod"}"#, false).unwrap();
        assert_eq!(j["kind"], "Pod");
        let y = decode(b"kind: Pod\nmetadata:\n  name: web\n", true).unwrap();
        assert_eq!(name(&y), Some("web"));
        assert!(
            decode(b"[1]", false)
                .unwrap_err()
                .message
                .contains("an array")
        );
        assert!(
            decode(b"{", false)
                .unwrap_err()
                .message
                .contains("error decoding JSON")
        );
    }

    #[test]
    fn timestamps_are_rfc3339_seconds() {
        let t = now_timestamp();
        assert_eq!(t.len(), 20, "{t}");
        assert!(t.ends_with('Z'));
    }
}
