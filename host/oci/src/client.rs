//! A registry session for one repository: the manifest (through an index), tokens
//! for `Bearer` challenges, credentials, the blob and its redirects, every byte
//! checked against its digest.

use hyper::StatusCode;
use hyper::header::{ACCEPT, AUTHORIZATION, HeaderName, HeaderValue, LOCATION, WWW_AUTHENTICATE};
use serde::Deserialize;

use crate::http::{self, Response, encode_query, is_loopback};
use crate::{Reference, digest_of, is_sha256_hex};

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
    /// `sha256:HEX` of the manifest (or index) the reference names: the artifact's
    /// digest, as `REPOSITORY@DIGEST` pins it.
    pub manifest: String,
}

/// What a registry is shown when it asks who pulls.
#[derive(Clone)]
pub enum Credentials {
    /// A user name and password (or an access token in the password): sent as
    /// `Basic` to a registry that challenges so, and to the token service of one
    /// that challenges `Bearer`.
    Basic { username: String, password: String },
    /// A registry token: sent as `Bearer` from the first request on.
    Bearer(String),
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Secrets stay out of logs.
        match self {
            Credentials::Basic { username, .. } => f
                .debug_struct("Basic")
                .field("username", username)
                .finish_non_exhaustive(),
            Credentials::Bearer(_) => f.write_str("Bearer(..)"),
        }
    }
}

impl Credentials {
    fn basic_header(&self) -> Option<String> {
        use base64::Engine as _;
        match self {
            Credentials::Basic { username, password } => Some(format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{username}:{password}"))
            )),
            Credentials::Bearer(_) => None,
        }
    }
}

/// A registry session: one repository, with the token a challenge gave (if any).
#[derive(Debug)]
pub struct Client<'a> {
    reference: &'a Reference,
    base: String,
    credentials: Option<Credentials>,
    /// The `Authorization` header's value once the registry asked for one.
    authorization: Option<String>,
}

impl<'a> Client<'a> {
    /// An anonymous session.
    pub fn new(reference: &'a Reference) -> Self {
        Self {
            reference,
            base: reference.base(),
            credentials: None,
            authorization: None,
        }
    }

    /// A session showing `credentials`.
    pub fn with_credentials(mut self, credentials: Option<Credentials>) -> Self {
        if let Some(Credentials::Bearer(token)) = &credentials {
            self.authorization = Some(format!("Bearer {token}"));
        }
        self.credentials = credentials;
        self
    }

    /// Reads the manifest (through an index, if the reference names one) and returns
    /// its WebAssembly layer.
    pub async fn resolve(&mut self) -> Result<Layer, String> {
        let reference = self.reference.reference.clone();
        let (manifest, manifest_digest) = self.manifest(&reference).await?;
        let manifest = match manifest.manifests {
            Some(entries) => {
                let chosen =
                    choose_from_index(&entries).map_err(|e| format!("{}: {e}", self.name()))?;
                let digest = chosen.digest.clone();
                let (inner, _) = self.manifest(&digest).await?;
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
            manifest: manifest_digest,
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
        self.reference.to_string()
    }

    /// The manifest `reference` names, and its digest.
    async fn manifest(&mut self, reference: &str) -> Result<(Manifest, String), String> {
        let url = format!("{}/manifests/{reference}", self.base);
        let response = self.get(&url, Some(MANIFEST_TYPES), MAX_MANIFEST).await?;
        let body = self.check(response, "manifest")?;
        let actual = digest_of(&body);
        if let Some(hex) = reference.strip_prefix("sha256:")
            && !actual.ends_with(hex)
        {
            return Err(format!(
                "{}: the manifest served for sha256:{hex} has digest {actual}",
                self.name()
            ));
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
        Ok((manifest, actual))
    }

    /// A GET to the registry, answering one challenge: `Bearer` with a token from the
    /// registry's token service (asked with the credentials, if any), `Basic` with the
    /// credentials.
    async fn get(
        &mut self,
        url: &str,
        accept: Option<&'static str>,
        limit: usize,
    ) -> Result<Response, String> {
        let response = http::get(url, &self.headers(accept)?, limit).await?;
        if response.status != StatusCode::UNAUTHORIZED || self.authorization.is_some() {
            return Ok(response);
        }
        let challenge = response
            .header(WWW_AUTHENTICATE.as_str())
            .unwrap_or_default();
        let basic = self
            .credentials
            .as_ref()
            .and_then(Credentials::basic_header);
        if let Some(params) = bearer_challenge(challenge) {
            let token = self.token(&params, basic.as_deref()).await?;
            self.authorization = Some(format!("Bearer {token}"));
        } else if let Some(basic) = basic.filter(|_| {
            challenge
                .trim_start()
                .get(..6)
                .is_some_and(|s| s.eq_ignore_ascii_case("basic "))
        }) {
            self.authorization = Some(basic);
        } else {
            return Err(format!(
                "{}: the registry asks for credentials ({challenge:?}) and {}",
                self.name(),
                if self.credentials.is_some() {
                    "those given are of no use for that challenge"
                } else {
                    "none were given"
                }
            ));
        }
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
        if let Some(authorization) = &self.authorization {
            let value = HeaderValue::from_str(authorization).map_err(|_| {
                format!(
                    "{}: the registry's credentials are not a header value",
                    self.name()
                )
            })?;
            headers.push((AUTHORIZATION, value));
        }
        Ok(headers)
    }

    /// A token from the challenge's realm: anonymous, or for the `basic` credentials.
    async fn token(
        &self,
        params: &[(String, String)],
        basic: Option<&str>,
    ) -> Result<String, String> {
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
        let mut headers = Vec::new();
        if let Some(basic) = basic {
            let value = HeaderValue::from_str(basic)
                .map_err(|_| format!("{}: the credentials are not a header value", self.name()))?;
            headers.push((AUTHORIZATION, value));
        }
        let response = http::get(&url, &headers, MAX_TOKEN).await?;
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

    fn parse(name: &str) -> Reference {
        Reference::parse(name).unwrap()
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
        let remote = parse("ghcr.io/a/b:1");
        let client = Client::new(&remote);
        assert!(client.may_follow("https://cdn.example/blob").is_ok());
        let err = client
            .may_follow("http://127.0.0.1:8080/token")
            .unwrap_err();
        assert!(err.contains("loopback"), "{err}");
        assert!(client.may_follow("https://[::1]/x").is_err());
        let local = parse("127.0.0.1:5000/a/b:1");
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
