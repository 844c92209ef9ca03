//! The controller world's imports for one controller plugin ([`KubeHost`]): cache reads
//! from the process's shared informers, writes as plain Kubernetes requests through the
//! controller's own [`kube::Client`] (so the API server's `Status` comes back whole,
//! field causes included), and events through the event recorder.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{Api, DynamicObject};
use serde_json::{Value, json};
use trellis_api::selector::LabelSelector;
use trellis_client::events::{EventRecorder, EventType as RecordedType};
use trellis_client::informer::BY_OWNER;
use trellis_plugin_host::{
    ApiError, Cause, ClusterReader, ControllerHost, EventType, GroupVersionResource, PatchType,
    Propagation, ServedResource, UpdateRequest, Write,
};

use crate::cache::{Cached, SharedCaches};
use crate::expectations::{Expectations, Expected};
use crate::key::{Key, gvr_key, object_key};

/// Retries of a write answered 429, and how long to wait when the answer says not.
const MAX_RETRIES: u32 = 5;
const RETRY_DELAY: Duration = Duration::from_millis(100);
/// The longest `Retry-After` honoured: a reconcile has a deadline.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(1);

/// The primary resource of a controller, as ownerReferences name its kind.
#[derive(Clone, Debug)]
pub(crate) struct Primary {
    pub gvr: String,
    pub api_version: String,
    pub kind: String,
}

/// What the answer to a write says of the written object.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct Answer {
    kind: Option<String>,
    metadata: AnswerMeta,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct AnswerMeta {
    name: Option<String>,
    namespace: Option<String>,
    resource_version: Option<String>,
    owner_references: Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>,
}

/// What one controller plugin's imports are served by.
pub struct KubeHost {
    /// The controller's name: its field manager, and how errors name it.
    pub(crate) name: String,
    /// Its own identity's client: every write is its user's.
    pub(crate) client: kube::Client,
    /// The informers of the resources it reads.
    pub(crate) caches: SharedCaches,
    pub(crate) events: EventRecorder,
    /// Its primary resource; `None` for a controller of every resource.
    pub(crate) primary: Option<Primary>,
    /// Where each write is noted against the key it belongs to.
    pub(crate) expectations: Arc<Expectations>,
    /// The controller manager's runtime, where requests are sent.
    pub(crate) runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for KubeHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeHost")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// What an event names as its involved object.
fn reference_to(obj: &Value) -> ObjectReference {
    let text = |v: &Value| v.as_str().map(str::to_owned);
    ObjectReference {
        api_version: text(&obj["apiVersion"]),
        kind: text(&obj["kind"]),
        namespace: text(&obj["metadata"]["namespace"]),
        name: text(&obj["metadata"]["name"]),
        uid: text(&obj["metadata"]["uid"]),
        resource_version: text(&obj["metadata"]["resourceVersion"]),
        field_path: None,
    }
}

fn to_json(obj: &DynamicObject) -> String {
    serde_json::to_string(obj).unwrap_or_default()
}

fn api_error(code: u16, reason: &str, message: String) -> ApiError {
    ApiError {
        code,
        reason: reason.into(),
        message,
        causes: Vec::new(),
    }
}

/// Sends one request as the controller; the body the API server stored, or its
/// refusal. A 429 (too many requests in flight) is retried after the `Retry-After`
/// the server asks for, a few times, as client-go does.
async fn send(
    client: kube::Client,
    method: http::Method,
    url: String,
    content_type: String,
    body: Vec<u8>,
) -> Result<String, ApiError> {
    let mut attempt = 0;
    loop {
        let request = http::Request::builder()
            .method(method.clone())
            .uri(url.as_str())
            .header(http::header::CONTENT_TYPE, content_type.as_str())
            .header(http::header::ACCEPT, "application/json")
            .body(kube::client::Body::from(body.clone()))
            .map_err(|e| api_error(500, "InternalError", format!("build the request: {e}")))?;
        let response = client
            .send(request)
            .await
            .map_err(|e| api_error(503, "ServiceUnavailable", format!("send the request: {e}")))?;
        let code = response.status().as_u16();
        let retry_after = response
            .headers()
            .get(http::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let body =
            response.into_body().collect_bytes().await.map_err(|e| {
                api_error(503, "ServiceUnavailable", format!("read the answer: {e}"))
            })?;
        if (200..300).contains(&code) {
            return Ok(String::from_utf8_lossy(&body).into_owned());
        }
        if code == 429 && attempt < MAX_RETRIES {
            attempt += 1;
            let wait =
                retry_after.map_or(RETRY_DELAY, |s| Duration::from_secs(s).min(MAX_RETRY_DELAY));
            tokio::time::sleep(wait).await;
            continue;
        }
        return Err(status_error(code, &body));
    }
}

/// The refusal a Kubernetes `Status` body says, or the bare HTTP code.
fn status_error(code: u16, body: &[u8]) -> ApiError {
    let status: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    ApiError {
        code,
        reason: status["reason"]
            .as_str()
            .map_or_else(|| format!("HTTP{code}"), str::to_owned),
        message: match status["message"].as_str() {
            Some(m) => m.to_owned(),
            None => String::from_utf8_lossy(body).into_owned(),
        },
        causes: status["details"]["causes"]
            .as_array()
            .map(|causes| {
                causes
                    .iter()
                    .map(|c| Cause {
                        reason: text(&c["reason"]),
                        message: text(&c["message"]),
                        field: text(&c["field"]),
                    })
                    .collect()
            })
            .unwrap_or_default(),
    }
}

impl KubeHost {
    fn cache(&self, resource: &GroupVersionResource) -> Result<Cached, String> {
        self.caches
            .current()
            .by_resource
            .get(&gvr_key(resource))
            .cloned()
            .ok_or_else(|| {
                format!(
                    "controller {} does not watch {}: declare it in the Plugin's spec.controller",
                    self.name,
                    gvr_key(resource)
                )
            })
    }

    /// The URL of `resource`'s collection in `namespace`.
    fn collection(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
    ) -> Result<String, ApiError> {
        let resolved = &self
            .cache(resource)
            .map_err(|m| api_error(403, "Forbidden", m))?
            .resolved;
        let api: Api<DynamicObject> = match (resolved.namespaced, namespace) {
            (true, Some(ns)) => Api::namespaced_with(self.client.clone(), ns, &resolved.resource),
            (true, None) => {
                return Err(api_error(
                    422,
                    "Invalid",
                    format!(
                        "{} is namespaced: a write needs a namespace",
                        gvr_key(resource)
                    ),
                ));
            }
            (false, _) => Api::all_with(self.client.clone(), &resolved.resource),
        };
        Ok(api.resource_url().to_owned())
    }

    /// [`send`] on the controller manager's runtime.
    async fn send(
        &self,
        method: http::Method,
        url: String,
        content_type: &str,
        body: Vec<u8>,
    ) -> Result<String, ApiError> {
        // On the controller manager's runtime: the plugin's calls run on threads
        // without an I/O driver (a plugin is granted no sockets), and a remote
        // client's connections need one.
        let client = self.client.clone();
        let content_type = content_type.to_owned();
        self.runtime
            .spawn(send(client, method, url, content_type, body))
            .await
            .unwrap_or_else(|e| {
                Err(api_error(
                    500,
                    "InternalError",
                    format!("the request stopped: {e}"),
                ))
            })
    }

    async fn send_write(&self, write: Write) -> Result<String, ApiError> {
        match write {
            Write::Create(c) => {
                let url = self.collection(&c.resource, c.namespace.as_deref())?;
                let url = format!("{url}{}", self.query(false));
                self.send(
                    http::Method::POST,
                    url,
                    "application/json",
                    c.object.into_bytes(),
                )
                .await
            }
            Write::Update(u) => {
                let object: Value = serde_json::from_str(&u.object).map_err(|e| {
                    api_error(400, "BadRequest", format!("the object is not JSON: {e}"))
                })?;
                let name = object["metadata"]["name"].as_str().unwrap_or_default();
                let url = self.collection(&u.resource, u.namespace.as_deref())?;
                let status = if u.status { "/status" } else { "" };
                let url = format!("{url}/{name}{status}{}", self.query(false));
                self.send(
                    http::Method::PUT,
                    url,
                    "application/json",
                    u.object.into_bytes(),
                )
                .await
            }
            Write::Patch(p) => {
                let url = self.collection(&p.resource, p.namespace.as_deref())?;
                let status = if p.status { "/status" } else { "" };
                let url = format!("{url}/{}{status}{}", p.name, self.query(p.force));
                let content_type = match p.patch_type {
                    PatchType::Json => "application/json-patch+json",
                    PatchType::Merge => "application/merge-patch+json",
                    PatchType::Strategic => "application/strategic-merge-patch+json",
                    // JSON is YAML.
                    PatchType::Apply => "application/apply-patch+yaml",
                };
                self.send(http::Method::PATCH, url, content_type, p.patch.into_bytes())
                    .await
            }
            Write::Delete(d) => {
                let url = self.collection(&d.resource, d.namespace.as_deref())?;
                let url = format!("{url}/{}", d.name);
                let mut options = json!({"kind": "DeleteOptions", "apiVersion": "v1"});
                if let Some(p) = d.propagation {
                    options["propagationPolicy"] = json!(match p {
                        Propagation::Background => "Background",
                        Propagation::Foreground => "Foreground",
                        Propagation::Orphan => "Orphan",
                    });
                }
                if let Some(uid) = d.uid {
                    options["preconditions"] = json!({"uid": uid});
                }
                self.send(
                    http::Method::DELETE,
                    url,
                    "application/json",
                    options.to_string().into_bytes(),
                )
                .await
            }
        }
    }

    /// Notes a successful write against the primary key it belongs to, so that key
    /// waits for the caches to show it (see [`crate::expectations`]).
    fn note(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        delete: bool,
        before: Option<&DynamicObject>,
        answer: &str,
    ) {
        let Ok(cached) = self.cache(resource) else {
            return;
        };
        let informer = &cached.informer;
        let answer: Answer = serde_json::from_str(answer).unwrap_or_default();
        let namespace = answer
            .metadata
            .namespace
            .clone()
            .or(namespace.map(str::to_owned))
            .filter(|n| !n.is_empty());
        let (name, revision, owners) = if answer.kind.as_deref() == Some("Status") {
            let Some(before) = before else { return };
            (
                before.metadata.name.clone(),
                None,
                before.metadata.owner_references.clone().unwrap_or_default(),
            )
        } else {
            let m = answer.metadata;
            (
                m.name,
                m.resource_version.and_then(|r| r.parse().ok()),
                m.owner_references,
            )
        };
        let Some(name) = name else { return };
        // A controller of every resource reconciles the written object itself.
        let (key_resource, owner) = match &self.primary {
            None => (gvr_key(resource), Some(name.clone())),
            Some(primary) if gvr_key(resource) == primary.gvr => {
                (primary.gvr.clone(), Some(name.clone()))
            }
            Some(primary) => (
                primary.gvr.clone(),
                owners
                    .iter()
                    .find(|o| {
                        o.controller == Some(true)
                            && o.kind == primary.kind
                            && o.api_version == primary.api_version
                    })
                    .map(|o| o.name.clone()),
            ),
        };
        let Some(owner) = owner else { return };
        self.expectations.expect(
            Key {
                resource: key_resource.into(),
                namespace: namespace.clone(),
                name: owner,
            },
            Expected {
                informer: informer.clone(),
                object: object_key(namespace.as_deref(), &name),
                revision,
                gone: delete,
            },
        );
    }

    /// A write refused by authorization is told in a Warning event on the object it
    /// was for: the primary object that controls the written one, or the written one
    /// itself. So an operator sees a controller short of RBAC rules in `kubectl
    /// describe`, not only in its Plugin's counters.
    fn refused(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        verb: &str,
        written: Option<Value>,
        error: &ApiError,
    ) {
        tracing::warn!(controller = %self.name, verb, resource = %gvr_key(resource), "{}", error.message);
        let Some(written) = written else { return };
        // A create names its namespace in the request, not always in the object.
        let namespace = written["metadata"]["namespace"].as_str().or(namespace);
        let controlling = self.primary.as_ref().and_then(|primary| {
            let owner = written["metadata"]["ownerReferences"]
                .as_array()?
                .iter()
                .find(|o| {
                    o["controller"] == true
                        && o["kind"] == primary.kind.as_str()
                        && o["apiVersion"] == primary.api_version.as_str()
                })?;
            let cached = self.caches.current().by_resource.get(&primary.gvr)?.clone();
            let obj = cached
                .informer
                .get(&object_key(namespace, owner["name"].as_str()?))?;
            serde_json::to_value(&*obj).ok()
        });
        let about = match controlling {
            Some(owner) => owner,
            // A create's object does not exist: only an owner can be told.
            None if verb == "create" => return,
            None => written,
        };
        self.events.record_for(
            reference_to(&about),
            RecordedType::Warning,
            "Forbidden",
            &format!(
                "the controller {} may not {verb} {}: {}",
                self.name, resource.resource, error.message
            ),
        );
    }

    fn query(&self, force: bool) -> String {
        let mut q = format!("?fieldManager={}", self.name);
        if force {
            q.push_str("&force=true");
        }
        q
    }
}

/// The path of `resource`'s collection (in `namespace`), by the API's convention.
fn uncached_collection(resource: &GroupVersionResource, namespace: Option<&str>) -> String {
    let base = if resource.group.is_empty() {
        format!("/api/{}", resource.version)
    } else {
        format!("/apis/{}/{}", resource.group, resource.version)
    };
    match namespace {
        Some(ns) => format!("{base}/namespaces/{ns}/{}", resource.resource),
        None => format!("{base}/{}", resource.resource),
    }
}

#[async_trait::async_trait]
impl ClusterReader for KubeHost {
    async fn get(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<String>, String> {
        Ok(self
            .cache(resource)?
            .informer
            .get(&object_key(namespace, name))
            .map(|o| to_json(&o)))
    }

    async fn list(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        label_selector: &str,
    ) -> Result<Vec<String>, String> {
        let informer = self.cache(resource)?.informer;
        let selector = LabelSelector::parse(label_selector)
            .map_err(|e| format!("label selector {label_selector:?}: {e}"))?;
        let none = std::collections::BTreeMap::new();
        // A label the selector pins narrows the scan to the objects that carry it:
        // a ReplicaSet's pods among ten thousand in its namespace.
        let pinned = selector.requirements().iter().find_map(|r| {
            selector
                .requires_exact_match(r.key())
                .map(|value| format!("{}={value}", r.key()))
        });
        let objects = match (pinned, namespace) {
            (Some(label), ns) => informer
                .by_index(trellis_client::informer::BY_LABEL, &label)
                .into_iter()
                .filter(|o| ns.is_none_or(|ns| o.metadata.namespace.as_deref() == Some(ns)))
                .collect(),
            (None, Some(ns)) => informer.by_index(trellis_client::informer::BY_NAMESPACE, ns),
            (None, None) => informer.list(),
        };
        Ok(objects
            .iter()
            .filter(|o| selector.matches_map(o.metadata.labels.as_ref().unwrap_or(&none)))
            .map(|o| to_json(o))
            .collect())
    }
}

#[async_trait::async_trait]
impl ControllerHost for KubeHost {
    async fn owned_by(
        &self,
        resource: &GroupVersionResource,
        owner_uid: &str,
    ) -> Result<Vec<String>, String> {
        Ok(self
            .cache(resource)?
            .informer
            .by_index(BY_OWNER, owner_uid)
            .iter()
            .map(|o| to_json(o))
            .collect())
    }

    async fn dependents(&self, owner_uid: &str) -> Result<Vec<String>, String> {
        let mut found = Vec::new();
        for cached in self.caches.current().by_resource.values() {
            for obj in cached.informer.by_index(BY_OWNER, owner_uid) {
                // Cached objects carry no kind: the dependent's is its resource's.
                let mut value = serde_json::to_value(&*obj).unwrap_or(Value::Null);
                value["apiVersion"] = json!(cached.resolved.resource.api_version);
                value["kind"] = json!(cached.resolved.resource.kind);
                found.push(value.to_string());
            }
        }
        Ok(found)
    }

    async fn resource_of(&self, api_version: &str, kind: &str) -> Option<ServedResource> {
        let caches = self.caches.current();
        let key = caches
            .by_kind
            .get(&(api_version.to_owned(), kind.to_owned()))?;
        let cached = &caches.by_resource[key];
        Some(ServedResource {
            resource: cached.gvr.clone(),
            namespaced: cached.resolved.namespaced,
        })
    }

    async fn resources(&self) -> Vec<ServedResource> {
        self.caches
            .current()
            .by_resource
            .values()
            .map(|c| ServedResource {
                resource: c.gvr.clone(),
                namespaced: c.resolved.namespaced,
            })
            .collect()
    }

    async fn update_subresource(
        &self,
        request: UpdateRequest,
        subresource: &str,
    ) -> Result<String, ApiError> {
        let object: Value = serde_json::from_str(&request.object)
            .map_err(|e| api_error(400, "BadRequest", format!("the object is not JSON: {e}")))?;
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        let url = self.collection(&request.resource, request.namespace.as_deref())?;
        let url = format!("{url}/{name}/{subresource}{}", self.query(false));
        self.send(
            http::Method::PUT,
            url,
            "application/json",
            request.object.into_bytes(),
        )
        .await
    }

    async fn read(
        &self,
        resource: &GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<String>, ApiError> {
        let collection = match self.collection(resource, namespace) {
            Ok(url) => url,
            // A resource no informer caches, as one that cannot be watched
            // (metrics.k8s.io's PodMetrics): its path is the API's convention.
            Err(e) if e.code == 403 => uncached_collection(resource, namespace),
            Err(e) => return Err(e),
        };
        let url = format!("{collection}/{name}");
        match self
            .send(http::Method::GET, url, "application/json", Vec::new())
            .await
        {
            Ok(body) => Ok(Some(body)),
            Err(e) if e.code == 404 => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn write(&self, write: Write) -> Result<String, ApiError> {
        let (resource, namespace, deleted) = match &write {
            Write::Create(c) => (c.resource.clone(), c.namespace.clone(), None),
            Write::Update(u) => (u.resource.clone(), u.namespace.clone(), None),
            Write::Patch(p) => (p.resource.clone(), p.namespace.clone(), None),
            Write::Delete(d) => (
                d.resource.clone(),
                d.namespace.clone(),
                Some(d.name.clone()),
            ),
        };
        // A delete may be answered with a bare Status: what it deleted is read first.
        let before = deleted.as_deref().and_then(|name| {
            let cached = self.cache(&resource).ok()?;
            cached.informer.get(&object_key(namespace.as_deref(), name))
        });
        let verb = match &write {
            Write::Create(_) => "create",
            Write::Update(_) => "update",
            Write::Patch(_) => "patch",
            Write::Delete(_) => "delete",
        };
        let written = match &write {
            Write::Create(c) => serde_json::from_str(&c.object).ok(),
            Write::Update(u) => serde_json::from_str(&u.object).ok(),
            Write::Patch(p) => self
                .cache(&resource)
                .ok()
                .and_then(|c| c.informer.get(&object_key(namespace.as_deref(), &p.name)))
                .and_then(|o| serde_json::to_value(&*o).ok()),
            Write::Delete(_) => before.as_deref().and_then(|o| serde_json::to_value(o).ok()),
        };
        let answer = match self.send_write(write).await {
            Ok(answer) => answer,
            Err(e) if e.code == 403 => {
                self.refused(&resource, namespace.as_deref(), verb, written, &e);
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        self.note(
            &resource,
            namespace.as_deref(),
            deleted.is_some(),
            before.as_deref(),
            &answer,
        );
        Ok(answer)
    }

    async fn record_event(&self, object: &str, event_type: EventType, reason: &str, message: &str) {
        let Ok(obj) = serde_json::from_str::<Value>(object) else {
            tracing::warn!(controller = %self.name, reason, "an event about something that is not JSON: dropped");
            return;
        };
        let involved = reference_to(&obj);
        let kind = match event_type {
            EventType::Normal => RecordedType::Normal,
            EventType::Warning => RecordedType::Warning,
        };
        self.events.record_for(involved, kind, reason, message);
    }
}
