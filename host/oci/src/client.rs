//! Pulling a module from an OCI registry: a WebAssembly artifact as `wkg`, `oras` and
//! Kubewarden push it, an OCI image manifest whose single layer is the component
//! (`application/wasm`, or the older `application/vnd.wasm.content.layer.v1+wasm`).
//!
//! The reference is `oci://HOST[:PORT]/REPOSITORY[:TAG]` or `…/REPOSITORY@sha256:HEX`.
//! Registries are spoken to over HTTPS, or plain HTTP when the host is a loopback
//! address. Pulls are anonymous; a registry that answers 401 with a `Bearer`
//! challenge gets asked for an anonymous token, as public registries (ghcr.io,
//! Docker Hub) require. Every byte is checked: a manifest named by digest against that
//! digest, the layer against its descriptor.

use hyper::StatusCode;
use hyper::header::{ACCEPT, AUTHORIZATION, HeaderName, HeaderValue, LOCATION, WWW_AUTHENTICATE};
use serde::Deserialize;
use trellis_plugin_host::digest_of;

use super::http::{self, Response, encode_query, is_loopback};

/// Largest manifest read (real ones are well under 10 KiB).
const MAX_MANIFEST: usize = 4 << 20;
/// Largest token answer read.
const MAX_TOKEN: usize = 64 << 10;
/// Blob downloads are often redirected to a CDN; more hops than this is a loop.
const MAX_REDIRECTS: usize = 5;

/// What a manifest request accepts: OCI and Docker manifests and indexes.
const MANIFEST_TYPES: &str = "application/vnd.oci.image.manifest.v1+json, \
     application/vnd.oci.image.index.v1+json, \
     application/vnd.docker.distribution.manifest.v2+json, \
     application/vnd.docker.distribution.manifest.list.v2+json";

/// Layer media types that hold a WebAssembly binary: the CNCF wasm working group's,
/// and the one Kubewarden and older tools push.
const WASM_LAYER_TYPES: [&str; 2] = [
    "application/wasm",
    "application/vnd.wasm.content.layer.v1+wasm",
];

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    #[serde(default)]
    media_type: String,
    digest: String,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Debug, Deserialize)]
struct Platform {
    #[serde(default)]
    architecture: String,
}

/// A manifest or an index: which one is told by the fields present.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Manifest {
    #[serde(default)]
    media_type: Option<String>,
    #[serde(default)]
    layers: Option<Vec<Descriptor>>,
    #[serde(default)]
    manifests: Option<Vec<Descriptor>>,
}

/// The WebAssembly layer an artifact points at.
#[derive(Debug)]
pub struct Layer {
    /// Lowercase hex of its sha256.
    pub hex: String,
    pub size: u64,
}

/// A registry session: one repository, with the token a challenge gave (if any).
pub struct Client<'a> {
    reference: &'a Reference,
    base: String,
    token: Option<String>,
}

impl<'a> Client<'a> {
    pub fn new(reference: &'a Reference) -> Self {
        Self {
            reference,
            base: reference.base(),
            token: None,
        }
    }

    /// Reads the manifest (through an index, if the reference names one) and returns
    /// its WebAssembly layer.
    pub async fn resolve(&mut self) -> Result<Layer, String> {
        let reference = self.reference.reference.clone();
        let manifest = self.manifest(&reference).await?;
        let manifest = match manifest.manifests {
            Some(entries) => {
                let chosen =
                    choose_from_index(&entries).map_err(|e| format!("{}: {e}", self.name()))?;
                let digest = chosen.digest.clone();
                let inner = self.manifest(&digest).await?;
                if inner.manifests.is_some() {
                    return Err(format!(
                        "{}: the index names another index ({digest}); expected a manifest",
                        self.name()
                    ));
                }
                inner
            }
            None => manifest,
        };
        let layers = manifest.layers.unwrap_or_default();
        let wasm: Vec<&Descriptor> = layers
            .iter()
            .filter(|l| WASM_LAYER_TYPES.contains(&l.media_type.as_str()))
            .collect();
        let layer = match wasm.as_slice() {
            [one] => *one,
            [] => {
                let types: Vec<&str> = layers.iter().map(|l| l.media_type.as_str()).collect();
                return Err(format!(
                    "{}: not a WebAssembly artifact: no layer of type {} (layers: {types:?})",
                    self.name(),
                    WASM_LAYER_TYPES.join(" or ")
                ));
            }
            more => {
                return Err(format!(
                    "{}: {} WebAssembly layers; expected one component",
                    self.name(),
                    more.len()
                ));
            }
        };
        let hex = layer
            .digest
            .strip_prefix("sha256:")
            .filter(|h| is_sha256_hex(h))
            .ok_or_else(|| {
                format!(
                    "{}: the layer's digest {:?} is not sha256:HEX",
                    self.name(),
                    layer.digest
                )
            })?;
        Ok(Layer {
            hex: hex.to_owned(),
            size: layer.size,
        })
    }

    /// Downloads the layer (following redirects to where the registry keeps blobs)
    /// and checks it against its descriptor.
    pub async fn blob(&mut self, layer: &Layer, limit: usize) -> Result<Vec<u8>, String> {
        if layer.size > limit as u64 {
            return Err(format!(
                "{}: the layer is {} bytes, more than the {limit} a module may have",
                self.name(),
                layer.size
            ));
        }
        let mut url = format!("{}/blobs/sha256:{}", self.base, layer.hex);
        let mut same_registry = true;
        let mut hops = 0;
        let response = loop {
            let response = if same_registry {
                self.get(&url, None, limit).await?
            } else {
                // The registry's credentials are not the CDN's to see.
                http::get(&url, &[], limit).await?
            };
            if !response.status.is_redirection() {
                break response;
            }
            hops += 1;
            let Some(location) = response
                .header(LOCATION.as_str())
                .filter(|_| hops <= MAX_REDIRECTS)
            else {
                return Err(format!(
                    "{}: the blob's download was redirected more than {MAX_REDIRECTS} times, or without a Location",
                    self.name()
                ));
            };
            let next = resolve_location(&url, location);
            self.may_follow(&next)?;
            same_registry = authority(&next) == authority(&self.base);
            url = next;
        };
        let body = self.check(response, "blob")?;
        let actual = digest_of(&body);
        if actual != format!("sha256:{}", layer.hex) {
            return Err(format!(
                "{}: the layer downloaded has digest {actual}, not the sha256:{} its manifest names",
                self.name(),
                layer.hex
            ));
        }
        Ok(body.to_vec())
    }

    /// A remote registry may not steer the server to this machine (a token realm or a
    /// redirect naming a loopback address); a loopback registry may.
    fn may_follow(&self, url: &str) -> Result<(), String> {
        let host_of = |u: &str| {
            u.parse::<hyper::Uri>()
                .ok()
                .and_then(|u| u.host().map(str::to_owned))
                .unwrap_or_default()
        };
        if is_loopback(&host_of(url)) && !is_loopback(&host_of(&self.base)) {
            return Err(format!(
                "{}: the registry sent the server to a loopback address ({url}), which only a loopback registry may",
                self.name()
            ));
        }
        Ok(())
    }

    fn name(&self) -> String {
        let r = self.reference;
        let sep = if r.reference.starts_with("sha256:") {
            '@'
        } else {
            ':'
        };
        format!("{}/{}{sep}{}", r.registry, r.repository, r.reference)
    }

    async fn manifest(&mut self, reference: &str) -> Result<Manifest, String> {
        let url = format!("{}/manifests/{reference}", self.base);
        let response = self.get(&url, Some(MANIFEST_TYPES), MAX_MANIFEST).await?;
        let body = self.check(response, "manifest")?;
        if let Some(hex) = reference.strip_prefix("sha256:") {
            let actual = digest_of(&body);
            if !actual.ends_with(hex) {
                return Err(format!(
                    "{}: the manifest served for sha256:{hex} has digest {actual}",
                    self.name()
                ));
            }
        }
        let manifest: Manifest = serde_json::from_slice(&body)
            .map_err(|e| format!("{}: the manifest is not valid JSON: {e}", self.name()))?;
        if manifest.layers.is_none() && manifest.manifests.is_none() {
            return Err(format!(
                "{}: a manifest of type {:?} with neither layers nor manifests",
                self.name(),
                manifest.media_type.as_deref().unwrap_or("(none)")
            ));
        }
        Ok(manifest)
    }

    /// A GET to the registry, answering one Bearer challenge with an anonymous token.
    async fn get(
        &mut self,
        url: &str,
        accept: Option<&'static str>,
        limit: usize,
    ) -> Result<Response, String> {
        let response = http::get(url, &self.headers(accept)?, limit).await?;
        if response.status != StatusCode::UNAUTHORIZED || self.token.is_some() {
            return Ok(response);
        }
        let challenge = response
            .header(WWW_AUTHENTICATE.as_str())
            .unwrap_or_default();
        let Some(params) = bearer_challenge(challenge) else {
            return Err(format!(
                "{}: the registry asks for credentials ({challenge:?}); only anonymous pulls are supported",
                self.name()
            ));
        };
        self.token = Some(self.anonymous_token(&params).await?);
        http::get(url, &self.headers(accept)?, limit).await
    }

    fn headers(
        &self,
        accept: Option<&'static str>,
    ) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
        let mut headers = Vec::new();
        if let Some(accept) = accept {
            headers.push((ACCEPT, HeaderValue::from_static(accept)));
        }
        if let Some(token) = &self.token {
            let value = HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
                format!(
                    "{}: the registry's token is not a header value",
                    self.name()
                )
            })?;
            headers.push((AUTHORIZATION, value));
        }
        Ok(headers)
    }

    async fn anonymous_token(&self, params: &[(String, String)]) -> Result<String, String> {
        let param = |key: &str| {
            params
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(key))
                .map(|(_, v)| v.as_str())
        };
        let realm = param("realm")
            .ok_or_else(|| format!("{}: a Bearer challenge without a realm", self.name()))?;
        let scope = param("scope")
            .map(str::to_owned)
            .unwrap_or_else(|| format!("repository:{}:pull", self.reference.repository));
        let mut url = realm.to_owned();
        url.push(if realm.contains('?') { '&' } else { '?' });
        if let Some(service) = param("service") {
            url.push_str(&format!("service={}&", encode_query(service)));
        }
        url.push_str(&format!("scope={}", encode_query(&scope)));
        self.may_follow(&url)?;
        let response = http::get(&url, &[], MAX_TOKEN).await?;
        if !response.status.is_success() {
            return Err(format!(
                "{}: the registry's token service ({realm}) answered {}: {}",
                self.name(),
                response.status,
                error_text(&response.body)
            ));
        }
        #[derive(Deserialize)]
        struct TokenAnswer {
            token: Option<String>,
            access_token: Option<String>,
        }
        let answer: TokenAnswer = serde_json::from_slice(&response.body).map_err(|e| {
            format!(
                "{}: the registry's token service answered something that is not a token: {e}",
                self.name()
            )
        })?;
        answer
            .token
            .or(answer.access_token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| format!("{}: the token service's answer has no token", self.name()))
    }

    /// The body of a successful answer, or an error with the registry's own words.
    fn check(&self, response: Response, what: &str) -> Result<bytes::Bytes, String> {
        if response.status.is_success() {
            return Ok(response.body);
        }
        Err(format!(
            "{}: the registry answered {} for the {what}: {}",
            self.name(),
            response.status,
            error_text(&response.body)
        ))
    }
}

/// Picks the WebAssembly entry of an image index: the one whose platform's
/// architecture is `wasm`, or the only entry.
fn choose_from_index(entries: &[Descriptor]) -> Result<&Descriptor, String> {
    let wasm: Vec<&Descriptor> = entries
        .iter()
        .filter(|e| {
            e.platform
                .as_ref()
                .is_some_and(|p| p.architecture == "wasm")
        })
        .collect();
    match (wasm.as_slice(), entries) {
        ([one], _) => Ok(one),
        ([], [only]) => Ok(only),
        _ => Err(format!(
            "an image index of {} entries, {} for architecture wasm; expected exactly one",
            entries.len(),
            wasm.len()
        )),
    }
}

/// The parameters of a `Bearer` challenge; `None` for any other scheme.
fn bearer_challenge(header: &str) -> Option<Vec<(String, String)>> {
    let (scheme, rest) = header.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let mut params = Vec::new();
    let mut chars = rest.trim().chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if key.is_empty() {
            break;
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next()),
                    '"' => break,
                    c => value.push(c),
                }
            }
        } else {
            value = chars.by_ref().take_while(|c| *c != ',').collect();
        }
        params.push((key.trim().to_owned(), value.trim().to_owned()));
    }
    Some(params)
}

/// A registry's error body (`{"errors": [{"code", "message"}]}`) as one line, or the
/// start of whatever else it sent.
fn error_text(body: &[u8]) -> String {
    #[derive(Deserialize)]
    struct Errors {
        errors: Vec<ErrorItem>,
    }
    #[derive(Deserialize)]
    struct ErrorItem {
        #[serde(default)]
        code: String,
        #[serde(default)]
        message: String,
    }
    if let Ok(errors) = serde_json::from_slice::<Errors>(body)
        && !errors.errors.is_empty()
    {
        return errors
            .errors
            .iter()
            .map(|e| format!("{}: {}", e.code, e.message))
            .collect::<Vec<_>>()
            .join("; ");
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    match text.char_indices().nth(200) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None if text.is_empty() => "(no body)".into(),
        None => text.to_owned(),
    }
}

/// A redirect's target, which may be relative to the URL that answered.
fn resolve_location(from: &str, location: &str) -> String {
    if location.starts_with("http://") || location.starts_with("https://") {
        return location.to_owned();
    }
    let origin_end = from
        .find("://")
        .and_then(|i| from[i + 3..].find('/').map(|j| i + 3 + j))
        .unwrap_or(from.len());
    if location.starts_with('/') {
        format!("{}{location}", &from[..origin_end])
    } else {
        let dir_end = from
            .rfind('/')
            .filter(|&i| i >= origin_end)
            .unwrap_or(origin_end);
        format!("{}/{location}", &from[..dir_end])
    }
}

fn authority(url: &str) -> Option<String> {
    url.parse::<hyper::Uri>()
        .ok()
        .and_then(|u| Some(format!("{}://{}", u.scheme_str()?, u.authority()?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> Reference {
        Reference::parse(url).unwrap()
    }

    #[test]
    fn references_with_tags_digests_and_ports_parse() {
        assert_eq!(
            parse("oci://ghcr.io/acme/policies/pod-policy:v1.2"),
            Reference {
                registry: "ghcr.io".into(),
                repository: "acme/policies/pod-policy".into(),
                reference: "v1.2".into(),
            }
        );
        let hex = "a".repeat(64);
        let r = parse(&format!("oci://127.0.0.1:5000/p@sha256:{hex}"));
        assert_eq!(r.registry, "127.0.0.1:5000");
        assert_eq!(r.reference, format!("sha256:{hex}"));
        assert_eq!(r.base(), "http://127.0.0.1:5000/v2/p");
        assert_eq!(parse("oci://localhost:5000/a/b").reference, "latest");
        assert_eq!(
            parse("oci://ghcr.io/a/b:1").base(),
            "https://ghcr.io/v2/a/b"
        );
        let hub = parse("oci://docker.io/nginx:1");
        assert_eq!(hub.base(), "https://registry-1.docker.io/v2/library/nginx");
    }

    #[test]
    fn bad_references_say_what_is_wrong() {
        for (url, why) in [
            ("oci://ghcr.io", "HOST[:PORT]/REPOSITORY"),
            ("oci://ghcr.io/Acme/p:1", "lowercase"),
            ("oci://ghcr.io/a//p:1", "lowercase"),
            ("oci://ghcr.io/a/p:-x", "a tag is"),
            ("oci://ghcr.io/a/p@md5:00", "sha256:HEX"),
            ("oci://ghcr.io/a/p@sha256:ABC", "64 lowercase hex"),
            ("oci:///a/p:1", "HOST[:PORT]"),
            ("oci://user@ghcr.io/a/p:1", "HOST[:PORT]"),
        ] {
            let err = Reference::parse(url).unwrap_err();
            assert!(err.starts_with("spec.module.url: Invalid value"), "{err}");
            assert!(err.contains(why), "{url}: {err}");
        }
    }

    #[test]
    fn bearer_challenges_are_read_with_quoted_commas() {
        let params = bearer_challenge(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull,push""#,
        )
        .unwrap();
        assert_eq!(
            params,
            vec![
                ("realm".into(), "https://auth.example/token".into()),
                ("service".into(), "registry.example".into()),
                ("scope".into(), "repository:a/b:pull,push".into()),
            ]
        );
        assert!(bearer_challenge(r#"Basic realm="registry""#).is_none());
    }

    #[test]
    fn registry_errors_are_quoted() {
        assert_eq!(
            error_text(br#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown","detail":{}}]}"#),
            "MANIFEST_UNKNOWN: manifest unknown"
        );
        assert_eq!(error_text(b""), "(no body)");
        assert_eq!(error_text(b"nope\n"), "nope");
    }

    #[test]
    fn redirects_resolve_against_the_answering_url() {
        let from = "https://ghcr.io/v2/a/b/blobs/sha256:00";
        assert_eq!(
            resolve_location(from, "https://cdn.example/x"),
            "https://cdn.example/x"
        );
        assert_eq!(resolve_location(from, "/blob/1"), "https://ghcr.io/blob/1");
        assert_eq!(
            resolve_location(from, "x?y=1"),
            "https://ghcr.io/v2/a/b/blobs/x?y=1"
        );
        assert_eq!(authority(from).as_deref(), Some("https://ghcr.io"));
    }

    #[test]
    fn only_loopback_registries_may_point_at_loopback() {
        let remote = parse("oci://ghcr.io/a/b:1");
        let client = Client::new(&remote);
        assert!(client.may_follow("https://cdn.example/blob").is_ok());
        let err = client
            .may_follow("http://127.0.0.1:8080/token")
            .unwrap_err();
        assert!(err.contains("loopback"), "{err}");
        assert!(client.may_follow("https://[::1]/x").is_err());
        let local = parse("oci://127.0.0.1:5000/a/b:1");
        assert!(
            Client::new(&local)
                .may_follow("http://localhost:9/token")
                .is_ok()
        );
    }

    #[test]
    fn an_index_yields_its_wasm_entry() {
        let entries: Vec<Descriptor> = serde_json::from_str(
            r#"[{"mediaType":"m","digest":"sha256:1","size":1,"platform":{"architecture":"amd64","os":"linux"}},
                {"mediaType":"m","digest":"sha256:2","size":1,"platform":{"architecture":"wasm","os":"wasip2"}}]"#,
        )
        .unwrap();
        assert_eq!(choose_from_index(&entries).unwrap().digest, "sha256:2");
        assert!(choose_from_index(&entries[..1]).is_ok());
        assert!(choose_from_index(&[]).is_err());
    }
}
