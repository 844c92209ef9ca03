//! The request chain: health and version endpoints, then for everything else
//! authentication → authorization → discovery or a resource handler, chosen by what
//! [`RequestInfo::parse`] reads from the path.

use std::pin::Pin;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::{Extension, State as AxState};
use axum::http::{Extensions, HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use trellis_api::ApiError;
use trellis_api::registry::Subresource;

use crate::authentication::Peer;
use crate::authorization::reviews;
use crate::endpoints::request::{
    self, ApiRequest, BodyFormat, IncludeObject, MAX_BODY, NonResourcePath, Query, RequestInfo,
    ResourcePath,
};
use crate::endpoints::response::{ErrorResponse, json_response};
use crate::endpoints::watch;
use crate::endpoints::{conversion, discovery};
use crate::observability::metrics::RequestLabels;
use crate::registry::subresources;
use crate::registry::{self, State};

pub fn router(state: State) -> Router {
    Router::new()
        .route("/healthz", get(ok))
        .route("/livez", get(ok))
        .route("/readyz", get(ok))
        .route(
            "/version",
            get(|| async { json_response(StatusCode::OK, &discovery::version()) }),
        )
        .fallback(dispatch)
        .with_state(state)
}

async fn ok() -> &'static str {
    "ok"
}

async fn dispatch(
    AxState(state): AxState<State>,
    peer: Option<Extension<Peer>>,
    request: axum::extract::Request,
) -> Response {
    let peer = peer.map(|Extension(p)| p).unwrap_or_default();
    let (method, uri) = (request.method().clone(), request.uri().clone());
    let started = tokio::time::Instant::now();
    // An upgraded connection (`pods/exec`'s WebSocket) lasts as long as its session.
    let long_running = request::is_long_running(&uri)
        || crate::registry::exec::wants_websocket(request.headers())
        || crate::registry::portforward::wants_spdy(request.headers());
    let mutating = mutating_method(&method);
    let record = Arc::new(Mutex::new(RequestRecord::default()));
    let work = {
        let (state, record) = (state.clone(), record.clone());
        crate::warnings::collect(async move {
            handle(state, peer, request, &record, long_running)
                .await
                .unwrap_or_else(IntoResponse::into_response)
        })
    };
    // A write runs to its end in a task of its own: what follows its commit
    // (initializers, quota settlement, lister fences) must not stop because the client
    // went away or the request timed out.
    let work: Pin<Box<dyn Future<Output = Response> + Send>> = if mutating {
        let task = tokio::spawn(work);
        Box::pin(async move {
            task.await.unwrap_or_else(|e| {
                ErrorResponse(ApiError::internal(format!(
                    "the request's task failed: {e}"
                )))
                .into_response()
            })
        })
    } else {
        Box::pin(work)
    };
    let response = if long_running {
        work.await
    } else {
        match tokio::time::timeout(state.settings.request_timeout, work).await {
            Ok(response) => response,
            Err(_) => ErrorResponse(ApiError::timeout(format!(
                "the request did not complete within {}s",
                state.settings.request_timeout.as_secs_f64()
            )))
            .into_response(),
        }
    };
    let code = response.status().as_u16();
    let elapsed = started.elapsed();
    let mut record = std::mem::take(&mut *lock(&record));
    if record.name.is_empty()
        && let Some(crate::observability::audit::ObjectName(name)) = response.extensions().get()
    {
        record.name.clone_from(name);
    }
    state.metrics.record(&record.labels, code, elapsed);
    if let Some(audit) = &state.audit {
        audit.record(crate::observability::audit::Entry {
            user: record.user,
            impersonated_user: record.impersonated,
            verb: record.verb,
            resource: record.resource,
            namespace: record.namespace,
            name: record.name,
            code,
            latency_ms: elapsed.as_secs_f64() * 1e3,
            annotations: response
                .extensions()
                .get::<crate::warnings::AuditAnnotations>()
                .map(|a| a.0.clone())
                .unwrap_or_default(),
        });
    }
    response
}

fn lock(record: &Mutex<RequestRecord>) -> std::sync::MutexGuard<'_, RequestRecord> {
    record.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the metrics and the audit log record of a request, filled in as it is parsed.
#[derive(Debug, Default)]
struct RequestRecord {
    /// What `/metrics` counts the request as: bounded label values only.
    labels: RequestLabels,
    user: String,
    /// The user the requester acts as, when it impersonates one.
    impersonated: Option<String>,
    verb: String,
    resource: String,
    namespace: String,
    name: String,
}

impl RequestRecord {
    /// Fills in a resource request, once parsed: its metrics labels and what the audit
    /// log names (verb, resource with subresource, namespace, name).
    fn describe(&mut self, req: &ApiRequest) {
        self.labels = RequestLabels {
            verb: req.verb.to_owned(),
            group: req.resource.group.clone(),
            version: req.resource.version.clone(),
            resource: req.resource.plural.clone(),
            subresource: req
                .subresource
                .map(|s| s.name().to_owned())
                .unwrap_or_default(),
            scope: if req.name.is_some() {
                "resource"
            } else if req.namespace.is_some() {
                "namespace"
            } else {
                "cluster"
            }
            .to_owned(),
        };
        self.verb = req.verb.to_owned();
        self.resource = match req.subresource {
            Some(sub) => format!("{}/{}", req.resource.qualified(), sub.name()),
            None => req.resource.qualified(),
        };
        self.namespace = req.namespace.clone().unwrap_or_default();
        self.name = req.name.clone().unwrap_or_default();
    }
}

/// `/openapi/v2` and `/openapi/v3[/…]`, for any authenticated user (as Kubernetes'
/// `system:discovery`). JSON, and v2 also as protobuf (what kubectl asks first);
/// `/swagger-2.0.0.pb-v1` is the v2 protobuf under its old name, kubectl 1.20's
/// fallback. A client that accepts neither gets 406.
async fn openapi(
    state: &State,
    rest: &[&str],
    query: Option<&str>,
    headers: &HeaderMap,
) -> Result<Response, ErrorResponse> {
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    // The first media type of the Accept list the server has, JSON when none is named.
    let chosen = if accept.is_empty() {
        Some("application/json")
    } else {
        accept
            .split(',')
            .find_map(|a| match a.split(';').next().unwrap_or("").trim() {
                "application/json" | "application/*" | "*/*" => Some("application/json"),
                crate::endpoints::openapi::proto::CONTENT_TYPE
                | crate::endpoints::openapi::proto::ACCEPT_DEPRECATED
                    if rest == ["v2"] =>
                {
                    Some(crate::endpoints::openapi::proto::CONTENT_TYPE)
                }
                _ => None,
            })
    };
    let Some(chosen) = chosen else {
        return Err(ApiError::not_acceptable(format!(
            "the server was unable to respond with a content type that the client supports ({accept}); it serves application/json"
        ))
        .into());
    };
    let docs = state.openapi().await;
    let json = |body: Vec<u8>| {
        let mut r = (StatusCode::OK, body).into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("application/json"),
        );
        r
    };
    match rest {
        ["v2"] if chosen == crate::endpoints::openapi::proto::CONTENT_TYPE => {
            Ok(openapi_v2_protobuf(&docs))
        }
        ["v2"] => Ok(json(docs.v2.clone())),
        ["v3"] => Ok(json(docs.index.clone())),
        ["v3", path @ ..] => {
            let path = path.join("/");
            let (body, hash) = docs.v3.get(&path).ok_or_else(not_found)?;
            let asked = query.and_then(|q| request::form_pairs(q).remove("hash"));
            match asked {
                Some(h) if &h != hash => {
                    let mut r = StatusCode::MOVED_PERMANENTLY.into_response();
                    if let Ok(v) =
                        header::HeaderValue::from_str(&format!("/openapi/v3/{path}?hash={hash}"))
                    {
                        r.headers_mut().insert(header::LOCATION, v);
                    }
                    Ok(r)
                }
                _ => {
                    let mut r = json(body.clone());
                    if let Ok(v) = header::HeaderValue::from_str(&format!("\"{hash}\"")) {
                        r.headers_mut().insert(header::ETAG, v);
                    }
                    r.headers_mut()
                        .insert(header::VARY, header::HeaderValue::from_static("Accept"));
                    Ok(r)
                }
            }
        }
        _ => Err(not_found().into()),
    }
}

fn openapi_v2_protobuf(docs: &crate::state::OpenApiDocs) -> Response {
    let mut r = (StatusCode::OK, docs.v2_protobuf.clone()).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(crate::endpoints::openapi::proto::CONTENT_TYPE),
    );
    r
}

fn not_found() -> ApiError {
    ApiError::new(
        404,
        trellis_api::status::Reason::NotFound,
        "the server could not find the requested resource",
    )
}

/// A non-resource path, once authorized by its URL.
async fn non_resource(
    state: &State,
    path: NonResourcePath,
    query: Option<&str>,
    headers: &HeaderMap,
) -> Result<Response, ErrorResponse> {
    match path {
        NonResourcePath::Metrics => {
            let mut text = state.metrics.render(
                state.cache.watcher_count(),
                state.cache.terminated_watchers(),
            );
            if let Some(plugins) = state.plugins.get() {
                plugins.render_metrics(&mut text);
            }
            Ok((
                StatusCode::OK,
                [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                text,
            )
                .into_response())
        }
        NonResourcePath::ApiVersions | NonResourcePath::ApiGroupList => {
            let core = path == NonResourcePath::ApiVersions;
            if let Some(r) = discovery::aggregated_response(state, core, headers) {
                return Ok(r);
            }
            Ok(if core {
                json_response(StatusCode::OK, &discovery::core_versions(state))
            } else {
                json_response(StatusCode::OK, &discovery::group_list(state))
            })
        }
        NonResourcePath::ApiGroup(group) => discovery::group(state, &group)
            .map(|g| json_response(StatusCode::OK, &g))
            .ok_or_else(|| not_found().into()),
        NonResourcePath::ApiResourceList { group, version } => {
            if !state.serves(&group, &version) {
                return Err(not_found().into());
            }
            Ok(json_response(
                StatusCode::OK,
                &discovery::resource_list(state, &group, &version),
            ))
        }
        NonResourcePath::OpenApi(rest) => {
            let rest: Vec<&str> = rest.iter().map(String::as_str).collect();
            openapi(state, &rest, query, headers).await
        }
        NonResourcePath::SwaggerProtobuf => Ok(openapi_v2_protobuf(&*state.openapi().await)),
        NonResourcePath::Unknown => Err(not_found().into()),
    }
}

/// Authentication, the in-flight limits, then by the path's [`RequestInfo`]: a
/// non-resource path, or a resource request authorized and given its body.
async fn handle(
    state: State,
    peer: Peer,
    request: axum::extract::Request,
    record: &Mutex<RequestRecord>,
    long_running: bool,
) -> Result<Response, ErrorResponse> {
    let (parts, body) = request.into_parts();
    let (method, uri, headers) = (parts.method, parts.uri, parts.headers);
    let mut extensions = parts.extensions;
    {
        let mut record = lock(record);
        record.verb = method.as_str().to_lowercase();
        record.resource = uri.path().to_owned();
        record.labels = RequestLabels::non_resource(method.as_str());
    }
    let mut user = crate::authentication::authenticate(&state, &peer, &headers).await?;
    // Kubernetes puts every authenticated user in this group too.
    if !user.in_group(trellis_api::user::groups::AUTHENTICATED) {
        user.groups
            .push(trellis_api::user::groups::AUTHENTICATED.to_owned());
    }
    lock(record).user = user.name.clone();
    let requester = user.name.clone();
    let user = crate::authentication::impersonation::impersonate(&state, user, &headers).await?;
    if user.name != requester {
        lock(record).impersonated = Some(user.name.clone());
    }
    let _admitted = state
        .inflight
        .admit(&user, uri.path(), mutating_method(&method), long_running)
        .inspect_err(|_| state.metrics.rejected(&lock(record).labels))?;
    // A group-version an APIService sends to an extension API server.
    if let Some(route) = crate::aggregator::route_for(&state, uri.path()) {
        return crate::aggregator::handle(&state, route, &user, method, &uri, &headers, body).await;
    }
    let info = RequestInfo::parse(uri.path(), |group, version, plural| {
        state
            .resource(group, version, plural)
            .is_ok_and(|r| r.namespaced)
    });
    let path = match info {
        RequestInfo::NonResource(path) => {
            crate::authorization::authorize_non_resource(&state, &user, &method, uri.path())
                .await?;
            return non_resource(&state, path, uri.query(), &headers).await;
        }
        RequestInfo::Resource(None) => return Err(not_found().into()),
        RequestInfo::Resource(Some(path)) => path,
    };
    if !state.serves(&path.group, &path.version) {
        return Err(not_found().into());
    }
    let resource = state.resource(&path.group, &path.version, &path.resource)?;
    let subresource = path.subresource_of(&resource).ok_or_else(not_found)?;
    let ResourcePath {
        namespace, name, ..
    } = path;
    // A proxied request's query is the node's, passed on as it is.
    let query = if subresource == Some(Subresource::Proxy) {
        Query::default()
    } else {
        Query::parse(uri.query())?
    };
    let verb = request::verb(&method, name.is_some(), query.watch).ok_or_else(|| {
        ApiError::method_not_allowed(
            "the server does not allow this method on the requested resource",
        )
    })?;
    // Kubernetes (1.30+) authorizes an exec as `create` whether it came as a POST or as
    // a WebSocket's GET: reading must not be enough to run commands (nor to reach a
    // pod's ports).
    let verb = match (verb, subresource) {
        ("get", Some(Subresource::Exec | Subresource::PortForward)) => "create",
        _ => verb,
    };
    if subresource.is_none() && !resource.allows(verb) {
        return Err(ApiError::method_not_allowed(format!(
            "{verb} is not supported on {}",
            resource.qualified()
        ))
        .into());
    }
    let (content_type, body_format) = request::body_format(&headers);
    let req = ApiRequest {
        dry_run: query.dry_run,
        include_uninitialized: query.include_uninitialized,
        resource,
        namespace,
        name,
        subresource,
        verb,
        query,
        user,
        content_type,
        user_agent: headers
            .get(header::USER_AGENT)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        body_format,
        // Read once the request is authorized, as kube-apiserver reads its options.
        table: None,
    };
    lock(record).describe(&req);
    crate::authorization::authorize(&state, &req).await?;
    let mut req = req;
    if request::wants_table(&headers) {
        req.table = Some(IncludeObject::parse(req.query.include_object.as_deref())?);
    }
    if matches!(method, Method::POST | Method::PUT | Method::PATCH)
        && req.body_format == BodyFormat::Unsupported
    {
        return Err(
            ApiError::unsupported_media_type(req.content_type.as_deref().unwrap_or("")).into(),
        );
    }
    // Bounded in time too: a write's task outlives its client, and must not wait for
    // ever on a body that stopped arriving.
    let body = tokio::time::timeout(state.settings.request_timeout, read_body(body))
        .await
        .map_err(|_| ApiError::timeout("the request body did not arrive in time"))??;
    crate::authorization::node::check_create(&req, &body)?;
    if matches!(verb, "delete" | "deletecollection") && registry::delete_dry_run(&req, &body)? {
        req.dry_run = true;
    }

    // A version served from another's storage: converted on the way in and out.
    let watch = req.verb == "watch";
    let (body, served) = conversion::inbound(&state, &mut req, body).await?;
    let response = handle_resource(state, req, body, &uri, &headers, &mut extensions).await;
    match (response, served) {
        (Ok(response), Some(served)) => Ok(conversion::outbound(response, &served, watch).await),
        (response, _) => response,
    }
}

/// A resource request, authorized, with its body: to the handler of its verb and
/// subresource.
async fn handle_resource(
    state: State,
    req: ApiRequest,
    body: bytes::Bytes,
    uri: &Uri,
    headers: &HeaderMap,
    extensions: &mut Extensions,
) -> Result<Response, ErrorResponse> {
    let verb = req.verb;
    if verb == "watch" && req.subresource.is_none() {
        return watch::watch(state, req).await;
    }
    let result = match (verb, req.subresource) {
        ("get", None | Some(Subresource::Status | Subresource::Approval)) => {
            registry::get(&state, &req).await
        }
        ("list", None) => registry::list(&state, &req).await,
        ("create", None) if reviews::answers(&req.resource) => {
            return reviews::create(&state, &req, body).await;
        }
        ("create", None) if req.name.is_none() => registry::create(&state, &req, body).await,
        ("update" | "patch", Some(Subresource::Approval))
            if let Err(e) =
                crate::certificates::authorize_signer(&state, &req, "approve").await =>
        {
            Err(e.into())
        }
        ("update" | "patch", Some(Subresource::Status))
            if registry::certificates::is_csr(&req.resource)
                && let Err(e) =
                    crate::certificates::authorize_signer(&state, &req, "sign").await =>
        {
            Err(e.into())
        }
        ("update", None | Some(Subresource::Status | Subresource::Approval)) => {
            registry::update(&state, &req, body).await
        }
        ("patch", None | Some(Subresource::Status | Subresource::Approval)) => {
            registry::patch(&state, &req, body).await
        }
        ("delete", None) => registry::delete(&state, &req, body).await,
        ("deletecollection", None) => registry::delete_collection(&state, &req).await,
        ("get", Some(Subresource::Scale)) => subresources::get_scale(&state, &req).await,
        ("update" | "patch", Some(Subresource::Scale)) => {
            subresources::write_scale(&state, &req, body).await
        }
        ("create", Some(Subresource::Binding)) => subresources::bind(&state, &req, body).await,
        ("create", Some(Subresource::Eviction)) => {
            registry::eviction::evict(&state, &req, body).await
        }
        ("create", Some(Subresource::Token)) => {
            subresources::token_request(&state, &req, body).await
        }
        ("get", Some(Subresource::Log)) => subresources::log(&state, &req).await,
        ("get", Some(Subresource::Proxy)) => registry::proxy::node(&state, &req, uri).await,
        ("create", Some(Subresource::Exec)) => {
            let upgrade = extensions.remove::<hyper::upgrade::OnUpgrade>();
            return registry::exec::exec(&state, &req, headers, uri.query(), upgrade).await;
        }
        ("create", Some(Subresource::PortForward)) => {
            let upgrade = extensions.remove::<hyper::upgrade::OnUpgrade>();
            return registry::portforward::port_forward(
                &state,
                &req,
                headers,
                uri.query(),
                upgrade,
            )
            .await;
        }
        // Only `spec.finalizers` changes: see `registry::update`'s merge.
        ("update", Some(Subresource::Finalize)) => registry::update(&state, &req, body).await,
        _ => Err(ApiError::method_not_allowed(format!(
            "{verb} is not supported on {}{}",
            req.resource.qualified(),
            req.subresource
                .map(|s| format!("/{}", s.name()))
                .unwrap_or_default()
        ))
        .into()),
    };
    if result.is_ok()
        && matches!(
            verb,
            "create" | "update" | "patch" | "delete" | "deletecollection"
        )
    {
        registry::after_write(&state, &req).await;
    }
    result
}

fn mutating_method(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// The request body, whole: 413 past [`MAX_BODY`], 400 when the client stops sending
/// before the end it announced.
async fn read_body(body: Body) -> Result<bytes::Bytes, ApiError> {
    use http_body_util::BodyExt as _;
    match http_body_util::Limited::new(body, MAX_BODY).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ApiError::too_large(MAX_BODY)),
        Err(e) => Err(ApiError::bad_request(format!(
            "the request body could not be read: {}",
            crate::endpoints::response::error_chain(e.as_ref())
        ))),
    }
}
