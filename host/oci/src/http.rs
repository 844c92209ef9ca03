//! One HTTP/1.1 request at a time, for fetching modules: HTTPS verified against the
//! system's roots, and plain HTTP only to loopback addresses (a registry or file server
//! on the same machine, where nothing travels over a network).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty, Limited};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::{StatusCode, Uri};

/// Time to open a connection (and finish the TLS handshake).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Time for a whole request, body included: a 128 MiB module at ~1 MB/s.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// A response read to its end.
#[derive(Debug)]
pub struct Response {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// Whether `host` (as in a URI, IPv6 in brackets) is this machine.
pub fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    bare.eq_ignore_ascii_case("localhost")
        || bare
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// GETs `url`, reading at most `limit` bytes of body. Redirects are returned, not
/// followed: the caller decides whether the target may be trusted.
pub async fn get(
    url: &str,
    headers: &[(HeaderName, HeaderValue)],
    limit: usize,
) -> Result<Response, String> {
    tokio::time::timeout(REQUEST_TIMEOUT, get_inner(url, headers, limit))
        .await
        .map_err(|_| format!("{url}: no complete answer within {REQUEST_TIMEOUT:?}"))?
}

async fn get_inner(
    url: &str,
    headers: &[(HeaderName, HeaderValue)],
    limit: usize,
) -> Result<Response, String> {
    let uri: Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let host = uri.host().ok_or_else(|| format!("{url}: no host"))?;
    let tls = match uri.scheme_str() {
        Some("https") => true,
        Some("http") if is_loopback(host) => false,
        Some("http") => {
            return Err(format!(
                "{url}: plain http:// is only used for loopback addresses; use https://"
            ));
        }
        _ => return Err(format!("{url}: not an http(s) URL")),
    };
    let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
    let bare = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let authority = uri
        .authority()
        .map_or_else(|| host.to_owned(), |a| a.as_str().to_owned());
    let tcp = tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio::net::TcpStream::connect((bare.as_str(), port)),
    )
    .await
    .map_err(|_| format!("{url}: no connection within {CONNECT_TIMEOUT:?}"))?
    .map_err(|e| format!("{url}: {e}"))?;
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut request = hyper::Request::get(path).header(hyper::header::HOST, authority);
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let request = request
        .body(Empty::<Bytes>::new())
        .map_err(|e| format!("{url}: {e}"))?;
    let response = if tls {
        let server_name = rustls::pki_types::ServerName::try_from(bare.clone())
            .map_err(|e| format!("{url}: {e}"))?;
        let stream = tokio::time::timeout(
            CONNECT_TIMEOUT,
            tokio_rustls::TlsConnector::from(tls_config()?).connect(server_name, tcp),
        )
        .await
        .map_err(|_| format!("{url}: no TLS handshake within {CONNECT_TIMEOUT:?}"))?
        .map_err(|e| format!("{url}: {e}"))?;
        send(url, hyper_util::rt::TokioIo::new(stream), request).await?
    } else {
        send(url, hyper_util::rt::TokioIo::new(tcp), request).await?
    };
    let (parts, body) = response.into_parts();
    let body = Limited::new(body, limit)
        .collect()
        .await
        .map_err(|e| format!("{url}: {e}"))?
        .to_bytes();
    Ok(Response {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

async fn send<IO>(
    url: &str,
    io: IO,
    request: hyper::Request<Empty<Bytes>>,
) -> Result<hyper::Response<hyper::body::Incoming>, String>
where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    tokio::spawn(conn);
    sender
        .send_request(request)
        .await
        .map_err(|e| format!("{url}: {e}"))
}

/// The client TLS configuration, with the system's roots read once.
fn tls_config() -> Result<Arc<rustls::ClientConfig>, String> {
    static CONFIG: OnceLock<Result<Arc<rustls::ClientConfig>, String>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let mut roots = rustls::RootCertStore::empty();
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
            let config = rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
            Ok(Arc::new(config))
        })
        .clone()
}

/// Percent-encodes a query parameter's value (RFC 3986 unreserved characters stay).
pub fn encode_query(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_are_recognised() {
        for host in [
            "127.0.0.1",
            "127.8.9.1",
            "[::1]",
            "::1",
            "localhost",
            "LOCALHOST",
        ] {
            assert!(is_loopback(host), "{host}");
        }
        for host in [
            "10.0.0.1",
            "example.com",
            "[2001:db8::1]",
            "localhost.example.com",
        ] {
            assert!(!is_loopback(host), "{host}");
        }
    }

    #[tokio::test]
    async fn plain_http_is_refused_beyond_loopback() {
        let err = get("http://example.com/x.wasm", &[], 10).await.unwrap_err();
        assert!(err.contains("only used for loopback"), "{err}");
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(
            encode_query("repository:team/policy:pull,push"),
            "repository%3Ateam%2Fpolicy%3Apull%2Cpush"
        );
    }
}
