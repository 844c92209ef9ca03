//! Validation of label keys and values, as `k8s.io/apimachinery/pkg/util/validation`
//! (`IsQualifiedName`, `IsValidLabelValue`, DNS-1123 subdomains).

const QUALIFIED_NAME_CHARS: &str = "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character";

/// Validates a label key (or another qualified name, such as a finalizer) as
/// Kubernetes' `IsQualifiedName`: `[prefix/]name`, where the prefix is a DNS-1123
/// subdomain and the name at most 63 characters.
pub fn validate_key(key: &str) -> Result<(), &'static str> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if name.contains('/') {
        return Err(
            "a key is a name with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName'), with at most one '/'",
        );
    }
    if let Some(prefix) = prefix {
        if prefix.is_empty() {
            return Err("prefix part must be non-empty");
        }
        if prefix.len() > 253 {
            return Err("prefix part must be no more than 253 characters");
        }
        if !is_dns1123_subdomain(prefix) {
            return Err(
                "prefix part must be a lowercase RFC 1123 subdomain: lower case alphanumeric characters, '-' or '.', starting and ending with an alphanumeric character",
            );
        }
    }
    if name.is_empty() {
        return Err("name part must be non-empty");
    }
    if name.len() > 63 {
        return Err("name part must be no more than 63 characters");
    }
    if !is_qualified_name_part(name) {
        return Err(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
        );
    }
    Ok(())
}

/// Validates a label value as Kubernetes' `IsValidLabelValue`; the empty value is valid.
pub(super) fn validate_value(value: &str) -> Result<(), &'static str> {
    if value.len() > 63 {
        return Err("must be no more than 63 characters");
    }
    if !value.is_empty() && !is_qualified_name_part(value) {
        return Err(QUALIFIED_NAME_CHARS);
    }
    Ok(())
}

/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`
fn is_qualified_name_part(s: &str) -> bool {
    let bytes = s.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => {
            first.is_ascii_alphanumeric()
                && last.is_ascii_alphanumeric()
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

/// Dot-separated labels of `[a-z0-9]([-a-z0-9]*[a-z0-9])?`.
fn is_dns1123_subdomain(s: &str) -> bool {
    s.split('.').all(|label| {
        let bytes = label.as_bytes();
        let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
        match (bytes.first(), bytes.last()) {
            (Some(first), Some(last)) => {
                alnum(first) && alnum(last) && bytes.iter().all(|b| alnum(b) || *b == b'-')
            }
            _ => false,
        }
    })
}

#[cfg(test)]
mod tests {
    use crate::selector::test_support::{only, parse, parse_err};

    #[test]
    fn rejects_invalid_keys() {
        let long_name = "a".repeat(64);
        let long_prefix = format!("{}/a", "a".repeat(254));
        let cases: &[(&str, &str)] = &[
            ("-a=b", "name part must consist of alphanumeric"),
            ("a-=b", "name part must consist of alphanumeric"),
            ("a/b/c=d", "at most one '/'"),
            ("/a=b", "prefix part must be non-empty"),
            ("a/=b", "name part must be non-empty"),
            ("Example.com/a=b", "lowercase RFC 1123 subdomain"),
            ("ex..com/a=b", "lowercase RFC 1123 subdomain"),
            (&format!("{long_name}=b"), "no more than 63 characters"),
            (&long_prefix, "no more than 253 characters"),
            ("ключ=b", "name part must consist of alphanumeric"),
        ];
        for (input, reason) in cases {
            let err = parse_err(input);
            assert!(err.starts_with("invalid label key \""), "{input}: {err}");
            assert!(err.contains(reason), "{input}: {err}");
        }
    }

    #[test]
    fn accepts_keys_at_the_length_limits() {
        let key = format!("{}/{}", "a".repeat(253), "b".repeat(63));
        assert_eq!(only(&parse(&key)).0, key);
    }

    #[test]
    fn rejects_invalid_values() {
        let err = parse_err("a=-b");
        assert!(
            err.contains("invalid label value \"-b\" for key \"a\""),
            "{err}"
        );
        let err = parse_err(&format!("a in (x,{})", "v".repeat(64)));
        assert!(err.contains("no more than 63 characters"), "{err}");
        let err = parse_err("a!=b/c");
        assert!(err.contains("invalid label value \"b/c\""), "{err}");
        assert_eq!(only(&parse(&format!("a={}", "v".repeat(63)))).2.len(), 1);
    }
}
