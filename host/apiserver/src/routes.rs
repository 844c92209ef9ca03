//! The request chain: health and version endpoints, then for everything else
//! authentication → authorization → discovery or a resource handler.
//!
//! Resource paths are parsed by hand rather than by a route table, because which
//! segment is a name and which a resource depends on the registry (which grows with
//! custom resources): `/api/v1/namespaces/x/pods` is a namespaced collection while
//! `/api/v1/namespaces/x/status` is a subresource of namespace `x`.

use axum::Router;
use axum::body::Body;
use axum::extract::{Extension, State as AxState};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use trellis_api::registry::Subresource;
use trellis_api::{ApiError, UserInfo};

use crate::handlers::{self, State};
use crate::request::{self, ApiRequest, BodyFormat, MAX_BODY, Query};
use crate::response::{ErrorResponse, json_response};
use crate::watch;
use crate::{discovery, node_authz, rbac, reviews, sa_token, subresources};

/// The identity a connection's verified client certificate proves, if any.
#[derive(Clone, Debug, Default)]
pub struct Peer(pub Option<UserInfo>);

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

/// Who is asking: a verified client certificate, else a bearer token; anonymous
/// requests are refused.
async fn authenticate(
    state: &State,
    peer: &Peer,
    headers: &HeaderMap,
) -> Result<UserInfo, ApiError> {
    // As kube-apiserver's union of authenticators: a verified client certificate
    // first, then a bearer token (a ServiceAccount token, or one of tokens.csv).
    if let Some(user) = &peer.0 {
        return Ok(user.clone());
    }
    let auth = headers
        .get(header::AUTHORIZATION)
        .ok_or_else(ApiError::unauthorized)?;
    let token = auth
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .ok_or_else(ApiError::unauthorized)?;
    if sa_token::looks_like_jwt(token) {
        return service_account(state, token)
            .await
            .ok_or_else(ApiError::unauthorized);
    }
    state
        .tokens
        .lookup(token)
        .cloned()
        .ok_or_else(ApiError::unauthorized)
}

/// The ServiceAccount a token names, if it is valid and the account still exists
/// with the uid the token was issued for.
async fn service_account(state: &State, token: &str) -> Option<UserInfo> {
    let claims = state
        .signer
        .verify(token, jiff::Timestamp::now().as_second())?;
    let accounts = state.resource("", "v1", "serviceaccounts").ok()?;
    let kv = state
        .store
        .get(&accounts.key(Some(&claims.namespace), &claims.name))
        .await
        .ok()??;
    let account = crate::watch_cache::decode_stored(&kv.value, kv.mod_revision)?;
    (crate::object::meta_str(&account, "uid") == Some(claims.uid.as_str()))
        .then(|| sa_token::user_of(&claims))
}

/// Authorization through RBAC; the refusal names user, verb and resource.
async fn authorize(state: &State, req: &ApiRequest) -> Result<(), ApiError> {
    if let Some(decision) = node_authz::authorize(state.store.as_ref(), req).await {
        return decision;
    }
    let resource = match req.subresource {
        Some(sub) => format!("{}/{}", req.resource.plural, sub.name()),
        None => req.resource.plural.clone(),
    };
    let attributes = rbac::Attributes {
        verb: req.verb,
        group: &req.resource.group,
        resource: &resource,
        namespace: req.namespace.as_deref().unwrap_or(""),
        name: req.name.as_deref().unwrap_or(""),
    };
    rbac::authorize(state.store.as_ref(), &req.user, &attributes).await
}

async fn dispatch(
    AxState(state): AxState<State>,
    peer: Option<Extension<Peer>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let peer = peer.map(|Extension(p)| p).unwrap_or_default();
    let started = tokio::time::Instant::now();
    let mut info = RequestInfo::default();
    let response = crate::warnings::collect(async {
        match handle(state.clone(), peer, method, uri, headers, body, &mut info).await {
            Ok(r) => r,
            Err(e) => e.into_response(),
        }
    })
    .await;
    let code = response.status().as_u16();
    let elapsed = started.elapsed();
    if info.name.is_empty()
        && let Some(crate::audit::ObjectName(name)) = response.extensions().get()
    {
        info.name.clone_from(name);
    }
    state
        .metrics
        .record(&info.verb, &info.resource, code, elapsed);
    if let Some(audit) = &state.audit {
        audit.record(crate::audit::Entry {
            user: info.user,
            verb: info.verb,
            resource: info.resource,
            namespace: info.namespace,
            name: info.name,
            code,
            latency_ms: elapsed.as_secs_f64() * 1e3,
        });
    }
    response
}

/// What the metrics and the audit log record of a request, filled in as it is parsed.
#[derive(Debug, Default)]
struct RequestInfo {
    user: String,
    verb: String,
    resource: String,
    namespace: String,
    name: String,
}

/// `/openapi/v2` and `/openapi/v3[/…]`, for any authenticated user (as Kubernetes'
/// `system:discovery`). JSON, and v2 also as protobuf (what kubectl asks first);
/// `/swagger-2.0.0.pb-v1` is the v2 protobuf under its old name, kubectl 1.20's
/// fallback. A client that accepts neither gets 406.
fn openapi(
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
                crate::openapi_proto::CONTENT_TYPE | crate::openapi_proto::ACCEPT_DEPRECATED
                    if rest == ["v2"] =>
                {
                    Some(crate::openapi_proto::CONTENT_TYPE)
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
    let docs = state.openapi();
    let json = |body: Vec<u8>| {
        let mut r = (StatusCode::OK, body).into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("application/json"),
        );
        r
    };
    match rest {
        ["v2"] if chosen == crate::openapi_proto::CONTENT_TYPE => Ok(openapi_v2_protobuf(&docs)),
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
        header::HeaderValue::from_static(crate::openapi_proto::CONTENT_TYPE),
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

async fn handle(
    state: State,
    peer: Peer,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
    info: &mut RequestInfo,
) -> Result<Response, ErrorResponse> {
    info.verb = method.as_str().to_lowercase();
    info.resource = uri.path().to_owned();
    let mut user = authenticate(&state, &peer, &headers).await?;
    // Kubernetes puts every authenticated user in this group too.
    if !user.in_group(trellis_api::user::groups::AUTHENTICATED) {
        user.groups
            .push(trellis_api::user::groups::AUTHENTICATED.to_owned());
    }
    info.user = user.name.clone();
    if uri.path() == "/metrics" {
        let mut text = state.metrics.render(state.cache.watcher_count());
        if let Some(plugins) = state.plugins.get() {
            plugins.render_metrics(&mut text);
        }
        return Ok((
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            text,
        )
            .into_response());
    }
    let path = uri.path().trim_end_matches('/');
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    if let ["api" | "apis"] = segments.as_slice()
        && let Some(r) = discovery::aggregated_response(&state, segments[0] == "api", &headers)
    {
        return Ok(r);
    }
    let (group, version, rest) = match segments.as_slice() {
        ["api"] => {
            return Ok(json_response(
                StatusCode::OK,
                &discovery::core_versions(&state),
            ));
        }
        ["apis"] => {
            return Ok(json_response(
                StatusCode::OK,
                &discovery::group_list(&state),
            ));
        }
        ["api", "v1", rest @ ..] => ("", "v1", rest),
        ["apis", group] => {
            return discovery::group(&state, group)
                .map(|g| json_response(StatusCode::OK, &g))
                .ok_or_else(|| not_found().into());
        }
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        ["openapi", rest @ ..] => return openapi(&state, rest, uri.query(), &headers),
        ["swagger-2.0.0.pb-v1"] => return Ok(openapi_v2_protobuf(&state.openapi())),
        _ => return Err(not_found().into()),
    };
    if !state.serves(group, version) {
        return Err(not_found().into());
    }
    if rest.is_empty() {
        return Ok(json_response(
            StatusCode::OK,
            &discovery::resource_list(&state, group, version),
        ));
    }

    // namespaces/{ns}/{plural}… is a namespaced request when {plural} is a namespaced
    // resource of this group-version; otherwise it addresses the namespace itself.
    let namespaced_target = |plural: &str| {
        state
            .resource(group, version, plural)
            .ok()
            .filter(|r| r.namespaced)
    };
    let (namespace, plural, name, sub) = match rest {
        ["namespaces", ns, plural, tail @ ..] if namespaced_target(plural).is_some() => (
            Some(*ns),
            *plural,
            tail.first().copied(),
            tail.get(1).copied(),
        ),
        [plural, tail @ ..] => (None, *plural, tail.first().copied(), tail.get(1).copied()),
        [] => return Err(not_found().into()),
    };
    if rest.len() > 5 {
        return Err(not_found().into());
    }
    let resource = state.resource(group, version, plural)?;
    if resource.namespaced != namespace.is_some()
        && !(resource.namespaced && namespace.is_none() && name.is_none())
    {
        return Err(not_found().into());
    }
    let subresource = match sub {
        None => None,
        Some(s) => match Subresource::parse(s).filter(|r| resource.has(*r)) {
            Some(r) => Some(r),
            None => return Err(not_found().into()),
        },
    };
    let query = Query::parse(uri.query())?;
    let verb = request::verb(&method, name.is_some(), query.watch).ok_or_else(|| {
        ApiError::method_not_allowed(
            "the server does not allow this method on the requested resource",
        )
    })?;
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
        namespace: namespace.map(str::to_owned),
        name: name.map(str::to_owned),
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
        wants_table: request::wants_table(&headers),
    };
    info.verb = req.verb.to_owned();
    info.resource = match req.subresource {
        Some(sub) => format!("{}/{}", req.resource.qualified(), sub.name()),
        None => req.resource.qualified(),
    };
    info.namespace = req.namespace.clone().unwrap_or_default();
    info.name = req.name.clone().unwrap_or_default();
    authorize(&state, &req).await?;
    if matches!(method, Method::POST | Method::PUT | Method::PATCH)
        && req.body_format == BodyFormat::Unsupported
    {
        return Err(
            ApiError::unsupported_media_type(req.content_type.as_deref().unwrap_or("")).into(),
        );
    }
    let body = axum::body::to_bytes(body, MAX_BODY)
        .await
        .map_err(|_| ApiError::too_large(MAX_BODY))?;
    node_authz::check_create(&req, &body)?;
    let mut req = req;
    if matches!(verb, "delete" | "deletecollection") && handlers::delete_dry_run(&req, &body)? {
        req.dry_run = true;
    }

    if verb == "watch" && req.subresource.is_none() {
        return watch::watch(state, req).await;
    }
    let result = match (verb, req.subresource) {
        ("get", None | Some(Subresource::Status)) => handlers::get(&state, &req).await,
        ("list", None) => handlers::list(&state, &req).await,
        ("create", None) if reviews::answers(&req.resource) => {
            return reviews::create(&state, &req, body).await;
        }
        ("create", None) if req.name.is_none() => handlers::create(&state, &req, body).await,
        ("update", None | Some(Subresource::Status)) => handlers::update(&state, &req, body).await,
        ("patch", None | Some(Subresource::Status)) => handlers::patch(&state, &req, body).await,
        ("delete", None) => handlers::delete(&state, &req, body).await,
        ("deletecollection", None) => handlers::delete_collection(&state, &req).await,
        ("get", Some(Subresource::Scale)) => subresources::get_scale(&state, &req).await,
        ("update" | "patch", Some(Subresource::Scale)) => {
            subresources::write_scale(&state, &req, body).await
        }
        ("create", Some(Subresource::Binding)) => subresources::bind(&state, &req, body).await,
        ("create", Some(Subresource::Token)) => {
            subresources::token_request(&state, &req, body).await
        }
        ("get", Some(Subresource::Log)) => subresources::log(&state, &req).await,
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
        handlers::after_write(&state, &req).await;
    }
    result
}
