//! `oci://` modules: `spec.module.url` read as an OCI reference and pulled with
//! [`trellis_oci`] (shared with the container runtime), anonymously.

pub use trellis_oci::Client;

/// How the API server reads an `oci://HOST[:PORT]/REPOSITORY[:TAG|@sha256:HEX]`
/// module URL: its errors name the field.
#[derive(Debug)]
pub struct Reference;

impl Reference {
    pub fn parse(url: &str) -> Result<trellis_oci::Reference, String> {
        let bad = |why: &str| format!("spec.module.url: Invalid value: {url:?}: {why}");
        let rest = url
            .strip_prefix("oci://")
            .ok_or_else(|| bad("not an oci:// reference"))?;
        trellis_oci::Reference::parse(rest).map_err(|why| bad(&why))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_module_urls_name_the_field() {
        for (url, why) in [
            ("https://ghcr.io/a/p:1", "not an oci:// reference"),
            ("oci://ghcr.io", "HOST[:PORT]/REPOSITORY"),
            ("oci://ghcr.io/Acme/p:1", "lowercase"),
        ] {
            let err = Reference::parse(url).unwrap_err();
            assert!(err.starts_with("spec.module.url: Invalid value"), "{err}");
            assert!(err.contains(why), "{url}: {err}");
        }
        assert_eq!(
            Reference::parse("oci://127.0.0.1:5000/p:v1")
                .unwrap()
                .to_string(),
            "127.0.0.1:5000/p:v1"
        );
    }
}
