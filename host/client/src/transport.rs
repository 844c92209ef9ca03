//! The two ways a component reaches the API server, both behind one [`kube::Client`]:
//!
//! - [`remote`]: a kubeconfig (client certificates or bearer tokens) over HTTPS, HTTP/2
//!   when the server offers it (one connection carries every watch and request, as
//!   client-go's does).
//! - [`InProcess`]: the API server's router as a tower service, called directly: no
//!   TLS, no socket, no serialization beyond the JSON bodies. The component's identity
//!   rides in the request's [`Peer`] extension, which authentication reads as it reads
//!   a verified client certificate; RBAC, admission, validation and the watch cache
//!   apply unchanged. Extensions never cross the wire, so no remote request can carry
//!   one.

use std::convert::Infallible;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use axum::http;
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::ConfigExt;
use kube::config::{KubeConfigOptions, Kubeconfig};
use tower::{BoxError, ServiceBuilder, ServiceExt};
use trellis_api::UserInfo;
use trellis_api::user::Peer;

/// How long a remote connection may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A client for the cluster a kubeconfig file describes (its current context).
pub async fn remote(kubeconfig: &Path) -> anyhow::Result<kube::Client> {
    remote_with(remote_config(kubeconfig).await?)
}

/// The connection settings of a kubeconfig file's current context.
pub async fn remote_config(kubeconfig: &Path) -> anyhow::Result<kube::Config> {
    let file = Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("read the kubeconfig {}", kubeconfig.display()))?;
    kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
        .await
        .with_context(|| format!("load the kubeconfig {}", kubeconfig.display()))
}

/// A client for `config`'s cluster, over HTTP/2 when the server negotiates it.
pub fn remote_with(config: kube::Config) -> anyhow::Result<kube::Client> {
    // The connector offers h2 and http/1.1 by ALPN itself.
    let tls = config
        .rustls_client_config()
        .context("build the TLS configuration")?;
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_all_versions()
        .wrap_connector(http);
    let hyper: hyper_util::client::legacy::Client<_, kube::client::Body> =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .timer(hyper_util::rt::TokioTimer::new())
            // Pings keep an idle connection's watches alive through middleboxes and
            // find a dead server without waiting for TCP.
            .http2_keep_alive_interval(Duration::from_secs(30))
            .http2_keep_alive_timeout(Duration::from_secs(10))
            .build(https);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer().context("build the credentials")?)
        .layer(
            config
                .extra_headers_layer()
                .context("build the extra headers")?,
        )
        .map_err(BoxError::from)
        .service(hyper);
    Ok(kube::Client::new(service, config.default_namespace))
}

/// The API server's router, for clients in the same process.
#[derive(Clone, Debug)]
pub struct InProcess {
    router: axum::Router,
}

impl InProcess {
    /// `router`: the API server's (`trellis_apiserver::Server::in_process`).
    pub fn new(router: axum::Router) -> Self {
        Self { router }
    }

    /// A client that acts as `user` (see [`crate::identity`]): the server
    /// authenticates each of its requests as that user and nothing else.
    pub fn client(&self, user: UserInfo) -> kube::Client {
        let router = self.router.clone();
        let peer = Peer::in_process(user);
        let service = tower::service_fn(move |request: http::Request<kube::client::Body>| {
            let router = router.clone();
            let peer = peer.clone();
            async move {
                let (mut parts, body) = request.into_parts();
                parts.extensions.insert(peer);
                let request = http::Request::from_parts(parts, axum::body::Body::new(body));
                let response = router.oneshot(request).await?;
                Ok::<_, Infallible>(response.map(|b| b.map_err(BoxError::from)))
            }
        });
        kube::Client::new(service, "default")
    }
}
