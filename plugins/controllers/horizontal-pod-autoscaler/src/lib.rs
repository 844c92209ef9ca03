//! The HorizontalPodAutoscaler controller, as Kubernetes 1.30's: every sync period
//! each autoscaler reads its target's scale subresource, the usage of the target's
//! pods from `metrics.k8s.io` (PodMetrics), and sets the target's replicas to what
//! its metrics ask for.
//!
//! - Resource and ContainerResource metrics, with `Utilization` (percent of the
//!   pods' requests) or `AverageValue` targets; the highest proposal of all metrics
//!   wins; within the tolerance (0.1) nothing changes. Pods and Object/External
//!   metrics need a custom metrics API, which is not served: they count as invalid.
//! - Pods are grouped as Kubernetes' replica calculator groups them (deleting and
//!   failed ignored; pending and, for CPU, not yet ready or measured before they
//!   were ready counted as unready; those without a PodMetrics as missing) so that
//!   they damp a change rather than cause one ([`replicas`]).
//! - min and max, `behavior` (stabilization windows, Pods/Percent policies over
//!   their periods, selectPolicy) or without one the downscale stabilization and
//!   the fixed scale-up rate ([`behavior`]); a target scaled to 0 is left alone.
//! - `status`: currentReplicas, desiredReplicas, currentMetrics, lastScaleTime and
//!   the conditions AbleToScale, ScalingActive and ScalingLimited with Kubernetes'
//!   reasons and messages; events SuccessfulRescale, FailedRescale, FailedGetScale,
//!   FailedGetResourceMetric, FailedComputeMetricsReplicas, SelectorRequired.
//!
//! The target is found by kind among the resources the controller caches (the
//! workloads with a scale subresource) and read and written through its `scale`
//! subresource. PodMetrics are read one pod at a time: metrics cannot be watched,
//! so they are no cache's, and the controller world reads single objects.
//!
//! Configuration (kube-controller-manager's flags): `syncPeriodSeconds` (15),
//! `tolerance` (0.1), `downscaleStabilizationSeconds` (300),
//! `cpuInitializationPeriodSeconds` (300), `initialReadinessDelaySeconds` (30).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{
    Action, EventType, ObjectKey, PatchType, Reconcile, cache, client, events, time,
};

pub mod behavior;
pub mod replicas;

use behavior::{HISTORY_ANNOTATION, History, Normalized, Rules};
use replicas::{Calculator, Target};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HorizontalPodAutoscaler {
    /// `--horizontal-pod-autoscaler-sync-period`: how often each autoscaler syncs.
    #[serde(default = "defaults::sync_period")]
    pub sync_period_seconds: f64,
    /// `--horizontal-pod-autoscaler-tolerance`.
    #[serde(default = "defaults::tolerance")]
    pub tolerance: f64,
    /// `--horizontal-pod-autoscaler-downscale-stabilization`: the scale-down window
    /// of an autoscaler without one of its own.
    #[serde(default = "defaults::downscale_stabilization")]
    pub downscale_stabilization_seconds: i64,
    /// `--horizontal-pod-autoscaler-cpu-initialization-period`.
    #[serde(default = "defaults::cpu_initialization")]
    pub cpu_initialization_period_seconds: i64,
    /// `--horizontal-pod-autoscaler-initial-readiness-delay`.
    #[serde(default = "defaults::initial_readiness_delay")]
    pub initial_readiness_delay_seconds: i64,
}

mod defaults {
    pub fn sync_period() -> f64 {
        15.0
    }
    pub fn tolerance() -> f64 {
        0.1
    }
    pub fn downscale_stabilization() -> i64 {
        300
    }
    pub fn cpu_initialization() -> i64 {
        300
    }
    pub fn initial_readiness_delay() -> i64 {
        30
    }
}

/// Where PodMetrics are served.
pub fn pod_metrics() -> GroupVersionResource {
    GroupVersionResource {
        group: "metrics.k8s.io".into(),
        version: "v1beta1".into(),
        resource: "pods".into(),
    }
}

fn pods() -> GroupVersionResource {
    GroupVersionResource {
        group: String::new(),
        version: "v1".into(),
        resource: "pods".into(),
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(0))
}

impl Reconcile for HorizontalPodAutoscaler {
    fn check_configuration(&self) -> Result<(), String> {
        if self.sync_period_seconds.is_nan() || self.sync_period_seconds < 0.0 {
            return Err("syncPeriodSeconds: must not be negative".into());
        }
        if self.tolerance.is_nan() || self.tolerance < 0.0 {
            return Err("tolerance: must not be negative".into());
        }
        Ok(())
    }

    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let namespace = key.namespace.as_deref();
        let Some(mut hpa) = cache::get(&key.resource, namespace, &key.name)? else {
            return Ok(Action::Done);
        };
        if !hpa["metadata"]["deletionTimestamp"].is_null() {
            return Ok(Action::Done);
        }
        let period = (self.sync_period_seconds * 1000.0) as i64;
        let now = now_ms();
        let mut history = History::of(&hpa);
        // Every change of the autoscaler (its own status writes too) brings the key
        // back; it syncs at most once a period, as Kubernetes' queue lets it.
        let since = now - history.last_sync;
        if (0..period).contains(&since) {
            return Ok(Action::RequeueAfter(Duration::from_millis(
                u64::try_from(period - since).unwrap_or(0),
            )));
        }
        history.last_sync = now;
        hpa["apiVersion"] = json!("autoscaling/v2");
        hpa["kind"] = json!("HorizontalPodAutoscaler");
        let status = Sync {
            config: self,
            hpa: &hpa,
            namespace: namespace.unwrap_or_default(),
            now,
            conditions: hpa["status"]["conditions"]
                .as_array()
                .cloned()
                .unwrap_or_default(),
        }
        .run(&mut history)?;
        // The history goes with the status: the autoscaler may write its status
        // (and, through it, its annotations) but not its spec.
        let recorded = serde_json::to_string(&history).map_err(|e| e.to_string())?;
        if status != hpa["status"]
            || hpa["metadata"]["annotations"][HISTORY_ANNOTATION] != recorded.as_str()
        {
            let patch = json!({
                "metadata": {"annotations": {HISTORY_ANNOTATION: recorded}},
                "status": status,
            });
            match client::patch(
                &key.resource,
                namespace,
                &key.name,
                PatchType::Merge,
                patch,
                true,
            ) {
                Ok(_) => {}
                Err(e) if e.is_not_found() => return Ok(Action::Done),
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(Action::RequeueAfter(Duration::from_millis(
            u64::try_from(period.max(1)).unwrap_or(1),
        )))
    }
}

/// One sync of one autoscaler.
struct Sync<'a> {
    config: &'a HorizontalPodAutoscaler,
    hpa: &'a Value,
    namespace: &'a str,
    now: i64,
    /// The status' conditions, as this sync sets them.
    conditions: Vec<Value>,
}

/// The scale subresource of a target, and where it is served.
struct Scale {
    resource: GroupVersionResource,
    /// The `autoscaling/v1` Scale as read: written back with the new count.
    object: Value,
    replicas: i32,
    selector: String,
}

/// Why a metric gave no proposal: the condition it sets, and the error.
struct Invalid {
    reason: &'static str,
    message: String,
    error: String,
}

fn int(v: &Value) -> Option<i32> {
    v.as_i64().and_then(|n| i32::try_from(n).ok())
}

impl Sync<'_> {
    fn event(&self, event_type: EventType, reason: &str, message: &str) {
        events::record(self.hpa, event_type, reason, message);
    }

    /// Sets a condition, its transition time kept unless its status changed.
    fn condition(&mut self, kind: &str, status: bool, reason: &str, message: &str) {
        let status = if status { "True" } else { "False" };
        let now = time::format(self.now / 1000);
        match self.conditions.iter_mut().find(|c| c["type"] == kind) {
            Some(c) => {
                if c["status"] != status {
                    c["lastTransitionTime"] = json!(now);
                }
                c["status"] = json!(status);
                c["reason"] = json!(reason);
                c["message"] = json!(message);
            }
            None => self.conditions.push(json!({
                "type": kind, "status": status, "lastTransitionTime": now,
                "reason": reason, "message": message,
            })),
        }
    }

    /// The status to write: the counts and metrics, the conditions set so far.
    fn status(&self, current: i32, desired: i32, metrics: Vec<Value>, rescaled: bool) -> Value {
        let old = &self.hpa["status"];
        let mut status = json!({
            "currentReplicas": current,
            "desiredReplicas": desired,
            "conditions": self.conditions,
        });
        if !metrics.is_empty() {
            status["currentMetrics"] = Value::Array(metrics);
        }
        if rescaled {
            status["lastScaleTime"] = json!(time::format(self.now / 1000));
        } else if !old["lastScaleTime"].is_null() {
            status["lastScaleTime"] = old["lastScaleTime"].clone();
        }
        status
    }

    /// The old status with this sync's conditions.
    fn conditions_only(&self) -> Value {
        let old = &self.hpa["status"];
        self.status(
            int(&old["currentReplicas"]).unwrap_or(0),
            int(&old["desiredReplicas"]).unwrap_or(0),
            old["currentMetrics"]
                .as_array()
                .cloned()
                .unwrap_or_default(),
            false,
        )
    }

    fn scale(&self) -> Result<Scale, String> {
        let target = &self.hpa["spec"]["scaleTargetRef"];
        let api_version = target["apiVersion"].as_str().unwrap_or_default();
        let kind = target["kind"].as_str().unwrap_or_default();
        let name = target["name"].as_str().unwrap_or_default();
        let served = cache::resource_of(api_version, kind).ok_or_else(|| {
            format!(
                "unable to determine resource for scale target reference: no matches for kind \"{kind}\" in version \"{api_version}\""
            )
        })?;
        let scale = client::read(
            &served.resource,
            Some(self.namespace),
            &format!("{name}/scale"),
        )
        .map_err(|e| e.message)?
        .ok_or_else(|| {
            format!(
                "{}.{} \"{name}\" not found",
                served.resource.resource, served.resource.group
            )
        })?;
        Ok(Scale {
            resource: served.resource,
            replicas: int(&scale["spec"]["replicas"]).unwrap_or(0),
            selector: scale["status"]["selector"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            object: scale,
        })
    }

    /// The sync: returns the status to write.
    fn run(mut self, history: &mut History) -> Result<Value, String> {
        let spec = &self.hpa["spec"];
        let min = int(&spec["minReplicas"]).unwrap_or(1);
        let max = int(&spec["maxReplicas"]).unwrap_or(min);
        let scale = match self.scale() {
            Ok(scale) => scale,
            Err(e) => {
                self.event(EventType::Warning, "FailedGetScale", &e);
                self.condition(
                    "AbleToScale",
                    false,
                    "FailedGetScale",
                    &format!(
                        "the HPA controller was unable to get the target's current scale: {e}"
                    ),
                );
                return Ok(self.conditions_only());
            }
        };
        self.condition(
            "AbleToScale",
            true,
            "SucceededGetScale",
            "the HPA controller was able to get the target's current scale",
        );
        let current = scale.replicas;
        let mut metrics = Vec::new();
        let (desired, reason) = if current == 0 && min != 0 {
            self.condition(
                "ScalingActive",
                false,
                "ScalingDisabled",
                "scaling is disabled since the replica count of the target is zero",
            );
            (0, String::new())
        } else if current > max {
            (
                max,
                "Current number of replicas above Spec.MaxReplicas".into(),
            )
        } else if current < min {
            (
                min,
                "Current number of replicas below Spec.MinReplicas".into(),
            )
        } else {
            let (proposed, metric, statuses, failure) = self.metric_replicas(&scale);
            metrics = statuses;
            let Some(proposed) = proposed else {
                let error = failure.unwrap_or_default();
                self.event(EventType::Warning, "FailedComputeMetricsReplicas", &error);
                return Ok(self.status(
                    current,
                    int(&self.hpa["status"]["desiredReplicas"]).unwrap_or(0),
                    metrics,
                    false,
                ));
            };
            let normalized = self.normalize(history, current, proposed, min, max);
            self.condition("AbleToScale", true, normalized.able.0, normalized.able.1);
            let (limited, reason, message) = normalized.limited;
            self.condition("ScalingLimited", limited, reason, message);
            let reason = if normalized.desired > current {
                format!("{metric} above target")
            } else {
                "All metrics below target".into()
            };
            (normalized.desired, reason)
        };
        if desired == current {
            return Ok(self.status(current, current, metrics, false));
        }
        let mut object = scale.object.clone();
        object["spec"]["replicas"] = json!(desired);
        let written =
            client::update_subresource(&scale.resource, Some(self.namespace), &object, "scale");
        if let Err(e) = written {
            self.event(
                EventType::Warning,
                "FailedRescale",
                &format!(
                    "New size: {desired}; reason: {reason}; error: {}",
                    e.message
                ),
            );
            self.condition(
                "AbleToScale",
                false,
                "FailedUpdateScale",
                &format!(
                    "the HPA controller was unable to update the target scale: {}",
                    e.message
                ),
            );
            let desired = int(&self.hpa["status"]["desiredReplicas"]).unwrap_or(0);
            return Ok(self.status(current, desired, metrics, false));
        }
        self.condition(
            "AbleToScale",
            true,
            "SucceededRescale",
            &format!("the HPA controller was able to update the target scale to {desired}"),
        );
        self.event(
            EventType::Normal,
            "SuccessfulRescale",
            &format!("New size: {desired}; reason: {reason}"),
        );
        if !self.hpa["spec"]["behavior"].is_null() {
            let (up, down) = self.rules();
            behavior::record_scale(history, self.now, &up, &down, current, desired);
        }
        Ok(self.status(current, desired, metrics, true))
    }

    fn rules(&self) -> (Rules, Rules) {
        let behavior = &self.hpa["spec"]["behavior"];
        let window = self.config.downscale_stabilization_seconds;
        (
            Rules::of(&behavior["scaleUp"], true, window),
            Rules::of(&behavior["scaleDown"], false, window),
        )
    }

    fn normalize(
        &self,
        history: &mut History,
        current: i32,
        proposed: i32,
        min: i32,
        max: i32,
    ) -> Normalized {
        if self.hpa["spec"]["behavior"].is_null() {
            let window = self.config.downscale_stabilization_seconds;
            behavior::normalize(history, self.now, window, current, proposed, min, max)
        } else {
            let (up, down) = self.rules();
            behavior::normalize_with_behavior(
                history, self.now, &up, &down, current, proposed, min, max,
            )
        }
    }

    /// The highest count the metrics propose, the metric that proposed it, every
    /// metric's status, and the first invalid metric's error. `None` when no metric
    /// gave a count, or some failed and the others would scale down.
    fn metric_replicas(
        &mut self,
        scale: &Scale,
    ) -> (Option<i32>, String, Vec<Value>, Option<String>) {
        if scale.selector.is_empty() {
            self.event(
                EventType::Warning,
                "SelectorRequired",
                "selector is required",
            );
            self.condition(
                "ScalingActive",
                false,
                "InvalidSelector",
                "the HPA target's scale is missing a selector",
            );
            return (
                None,
                String::new(),
                Vec::new(),
                Some("selector is required".into()),
            );
        }
        let specs = self.hpa["spec"]["metrics"]
            .as_array()
            .cloned()
            .unwrap_or_else(|| {
                // Kubernetes' default: 80 % of the pods' CPU requests.
                vec![json!({"type": "Resource", "resource": {"name": "cpu",
                    "target": {"type": "Utilization", "averageUtilization": 80}}})]
            });
        let mut statuses = Vec::new();
        let mut best: Option<(i32, String)> = None;
        let mut invalid: Vec<Invalid> = Vec::new();
        for spec in &specs {
            match self.metric(spec, scale) {
                Ok((replicas, name, status)) => {
                    statuses.push(status);
                    if best.as_ref().is_none_or(|(r, _)| replicas > *r) {
                        best = Some((replicas, name));
                    }
                }
                Err(e) => {
                    statuses.push(json!({"type": ""}));
                    invalid.push(e);
                }
            }
        }
        let failure = invalid.first().map(|first| {
            format!(
                "invalid metrics ({} invalid out of {}), first error is: {}",
                invalid.len(),
                specs.len(),
                first.error
            )
        });
        let proposed = best.as_ref().map(|(r, _)| *r);
        if let Some(first) = invalid.first()
            && (invalid.len() >= specs.len() || proposed.is_some_and(|r| r < scale.replicas))
        {
            let (reason, message) = (first.reason, first.message.clone());
            self.condition("ScalingActive", false, reason, &message);
            return (None, String::new(), statuses, failure);
        }
        let (replicas, name) = best.unwrap_or_default();
        self.condition(
            "ScalingActive",
            true,
            "ValidMetricFound",
            &format!("the HPA was able to successfully calculate a replica count from {name}"),
        );
        (Some(replicas), name, statuses, failure)
    }

    /// One metric's proposal, its name in messages, and its status.
    fn metric(&self, spec: &Value, scale: &Scale) -> Result<(i32, String, Value), Invalid> {
        let kind = spec["type"].as_str().unwrap_or_default();
        let (source, container) = match kind {
            "Resource" => (&spec["resource"], None),
            "ContainerResource" => (
                &spec["containerResource"],
                spec["containerResource"]["container"].as_str(),
            ),
            "Pods" | "Object" | "External" => {
                let reason = match kind {
                    "Pods" => "FailedGetPodsMetric",
                    "Object" => "FailedGetObjectMetric",
                    _ => "FailedGetExternalMetric",
                };
                let error = format!(
                    "unable to get metric {}: no custom metrics API (custom.metrics.k8s.io or external.metrics.k8s.io) is served",
                    spec[kind.to_lowercase()]["metric"]["name"]
                        .as_str()
                        .unwrap_or_default()
                );
                self.event(EventType::Warning, reason, &error);
                return Err(Invalid {
                    reason,
                    message: format!("the HPA was unable to compute the replica count: {error}"),
                    error,
                });
            }
            other => {
                let error = format!("unknown metric source type {other:?}");
                return Err(Invalid {
                    reason: "InvalidMetricSourceType",
                    message: format!("the HPA was unable to compute the replica count: {error}"),
                    error,
                });
            }
        };
        let resource = source["name"].as_str().unwrap_or_default();
        let target = &source["target"];
        let failed = |error: String| {
            let reason = if container.is_some() {
                "FailedGetContainerResourceMetric"
            } else {
                "FailedGetResourceMetric"
            };
            self.event(EventType::Warning, reason, &error);
            Invalid {
                reason,
                message: format!("the HPA was unable to compute the replica count: {error}"),
                error: format!("failed to get {resource} resource metric value: {error}"),
            }
        };
        let target = if let Some(v) = target["averageValue"].as_str() {
            let milli = trellis_plugin::quantity::Quantity::parse(v)
                .map_err(|e| failed(format!("averageValue {v:?}: {e}")))?
                .milli_value();
            Target::AverageValue(milli)
        } else if let Some(u) = int(&target["averageUtilization"]) {
            Target::Utilization(u)
        } else {
            return Err(failed(
                "invalid resource metric source: neither an average utilization target nor an average value (usage) target was set".into(),
            ));
        };
        let pods: Vec<Value> = cache::list_as(&pods(), Some(self.namespace), &scale.selector)
            .map_err(|e| failed(e.clone()))?;
        let usage = self.usage(&pods, resource, container).map_err(|e| {
            failed(format!(
                "unable to get metrics for resource {resource}: {e}"
            ))
        })?;
        let calculator = Calculator {
            tolerance: self.config.tolerance,
            cpu_initialization_ms: self.config.cpu_initialization_period_seconds * 1000,
            initial_readiness_delay_ms: self.config.initial_readiness_delay_seconds * 1000,
            now_ms: self.now,
        };
        let proposal = calculator
            .replicas(scale.replicas, target, &pods, usage, resource, container)
            .map_err(|e| match target {
                Target::Utilization(_) => {
                    failed(format!("failed to get {resource} utilization: {e}"))
                }
                Target::AverageValue(_) => failed(e),
            })?;
        let average =
            trellis_plugin::quantity::Quantity::parse(&format!("{}m", proposal.raw_milli))
                .map(|q| q.to_string())
                .unwrap_or_default();
        let mut current = json!({"averageValue": average});
        if let Some(u) = proposal.utilization {
            current["averageUtilization"] = json!(u);
        }
        let (name, status) = match container {
            None => (
                match target {
                    Target::Utilization(_) => {
                        format!("{resource} resource utilization (percentage of request)")
                    }
                    Target::AverageValue(_) => format!("{resource} resource"),
                },
                json!({"type": "Resource", "resource": {"name": resource, "current": current}}),
            ),
            Some(c) => (
                match target {
                    Target::Utilization(_) => {
                        format!("{resource} container resource utilization (percentage of request)")
                    }
                    Target::AverageValue(_) => format!("{resource} container resource"),
                },
                json!({"type": "ContainerResource", "containerResource":
                    {"name": resource, "container": c, "current": current}}),
            ),
        };
        Ok((proposal.replicas, name, status))
    }

    /// The pods' usage of `resource`, by pod name, from their PodMetrics: one read
    /// each, for the pods whose sample can count (not pending, failed or deleting).
    fn usage(
        &self,
        pods: &[Value],
        resource: &str,
        container: Option<&str>,
    ) -> Result<BTreeMap<String, replicas::PodMetric>, String> {
        let mut usage = BTreeMap::new();
        let mut read = 0;
        for pod in pods {
            let phase = pod["status"]["phase"].as_str().unwrap_or_default();
            if phase == "Pending"
                || phase == "Failed"
                || !pod["metadata"]["deletionTimestamp"].is_null()
            {
                continue;
            }
            let name = pod["metadata"]["name"].as_str().unwrap_or_default();
            let metrics =
                client::read(&pod_metrics(), Some(self.namespace), name).map_err(|e| {
                    format!(
                        "unable to fetch metrics from resource metrics API: {}",
                        e.message
                    )
                })?;
            let Some(metrics) = metrics else { continue };
            read += 1;
            if let Some(m) = replicas::pod_metric(&metrics, resource, container) {
                usage.insert(name.to_owned(), m);
            }
        }
        if read == 0 {
            return Err("no metrics returned from resource metrics API".into());
        }
        Ok(usage)
    }
}

trellis_plugin::controller!(HorizontalPodAutoscaler);

#[cfg(test)]
mod tests;
