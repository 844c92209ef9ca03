//! Defaults and validation of the workload, batch, storage and aggregation kinds, as
//! kube-apiserver 1.30's (`pkg/apis/{apps,batch,core,storage}/v1/defaults.go`, their
//! `validation` packages and the Job strategy's generated selector; kube-aggregator's
//! for APIServices).

use serde_json::{Map, Value, json};
use trellis_api::quantity::Quantity;
use trellis_api::registry::ResourceInfo;
use trellis_api::status::StatusCause;

use super::{
    check_selector, default_template, go_labels, invalid_json, invalid_shown, nonnegative,
    object_at, set_default, str_field, validate_pod_spec, without_empty,
};
use crate::object::Object;

/// The Job strategy's labels: pods of a Job with a generated selector carry both the
/// legacy and the `batch.kubernetes.io/` names.
const CONTROLLER_UID: &str = "batch.kubernetes.io/controller-uid";
const LEGACY_CONTROLLER_UID: &str = "controller-uid";
const JOB_NAME: &str = "batch.kubernetes.io/job-name";
const LEGACY_JOB_NAME: &str = "job-name";

/// Applies the defaults of `res`, if it is one of these kinds; false otherwise.
pub(super) fn defaults(res: &ResourceInfo, obj: &mut Object, old: Option<&Object>) -> bool {
    match (res.group.as_str(), res.plural.as_str()) {
        ("apps", "daemonsets") => {
            let spec = object_at(obj, "spec");
            set_default(spec, "revisionHistoryLimit", json!(10));
            let strategy = object_at(spec, "updateStrategy");
            set_default(strategy, "type", json!("RollingUpdate"));
            if strategy.get("type") == Some(&json!("RollingUpdate")) {
                let rolling = object_at(strategy, "rollingUpdate");
                set_default(rolling, "maxUnavailable", json!(1));
                set_default(rolling, "maxSurge", json!(0));
            }
            default_template(obj);
            set_template_generation(obj, old);
        }
        ("apps", "statefulsets") => {
            let spec = object_at(obj, "spec");
            set_default(spec, "replicas", json!(1));
            set_default(spec, "revisionHistoryLimit", json!(10));
            set_default(spec, "podManagementPolicy", json!("OrderedReady"));
            let retention = object_at(spec, "persistentVolumeClaimRetentionPolicy");
            set_default(retention, "whenDeleted", json!("Retain"));
            set_default(retention, "whenScaled", json!("Retain"));
            let strategy = object_at(spec, "updateStrategy");
            if strategy.get("type").is_none_or(Value::is_null) {
                strategy.insert("type".into(), json!("RollingUpdate"));
                object_at(strategy, "rollingUpdate");
            }
            if strategy.get("type") == Some(&json!("RollingUpdate"))
                && let Some(Value::Object(rolling)) = strategy.get_mut("rollingUpdate")
            {
                set_default(rolling, "partition", json!(0));
            }
            if let Some(Value::Array(templates)) = spec.get_mut("volumeClaimTemplates") {
                for claim in templates.iter_mut().filter_map(Value::as_object_mut) {
                    set_default(object_at(claim, "spec"), "volumeMode", json!("Filesystem"));
                    set_default(object_at(claim, "status"), "phase", json!("Pending"));
                }
            }
            default_template(obj);
        }
        ("batch", "jobs") => {
            default_job_spec(obj);
            // Before the selector's labels go in: the Job's own labels are its
            // template's as the user wrote them.
            let labels = str_field(obj, &["spec", "template", "metadata", "labels"])
                .filter(|l| l.as_object().is_some_and(|m| !m.is_empty()))
                .cloned();
            let meta = crate::object::metadata_mut(obj);
            if let Some(labels) = labels
                && meta
                    .get("labels")
                    .and_then(Value::as_object)
                    .is_none_or(Map::is_empty)
            {
                meta.insert("labels".into(), labels);
            }
            let manual = str_field(obj, &["spec", "manualSelector"]) == Some(&json!(true));
            if old.is_none() && !manual {
                generate_job_selector(obj);
                // Kubernetes defaults the stored Job again when it reads it: a Job that
                // has no labels then takes its template's, generated ones included.
                let labels = str_field(obj, &["spec", "template", "metadata", "labels"]).cloned();
                let meta = crate::object::metadata_mut(obj);
                if let Some(labels) = labels
                    && meta
                        .get("labels")
                        .and_then(Value::as_object)
                        .is_none_or(Map::is_empty)
                {
                    meta.insert("labels".into(), labels);
                }
            }
            default_template(obj);
        }
        ("batch", "cronjobs") => {
            let spec = object_at(obj, "spec");
            set_default(spec, "concurrencyPolicy", json!("Allow"));
            set_default(spec, "suspend", json!(false));
            set_default(spec, "successfulJobsHistoryLimit", json!(3));
            set_default(spec, "failedJobsHistoryLimit", json!(1));
            let template_spec = spec
                .get_mut("jobTemplate")
                .and_then(|t| t.get_mut("spec"))
                .and_then(|s| s.get_mut("template"))
                .and_then(|t| t.get_mut("spec"))
                .and_then(Value::as_object_mut);
            if let Some(pod_spec) = template_spec {
                super::default_pod_spec(pod_spec);
            }
        }
        ("", "persistentvolumeclaims") => {
            set_default(object_at(obj, "spec"), "volumeMode", json!("Filesystem"));
        }
        ("", "persistentvolumes") => {
            let spec = object_at(obj, "spec");
            set_default(spec, "persistentVolumeReclaimPolicy", json!("Retain"));
            set_default(spec, "volumeMode", json!("Filesystem"));
        }
        ("storage.k8s.io", "storageclasses") => {
            set_default(obj, "reclaimPolicy", json!("Delete"));
            set_default(obj, "volumeBindingMode", json!("Immediate"));
        }
        ("apiregistration.k8s.io", "apiservices") => {
            let spec = object_at(obj, "spec");
            if let Some(Value::Object(service)) = spec.get_mut("service") {
                set_default(service, "port", json!(443));
            }
        }
        _ => return false,
    }
    true
}

/// The annotation apps/v1 carries a DaemonSet's template generation in (its internal
/// `spec.templateGeneration`): 1 at create, one more at each template change. The
/// DaemonSet controller labels its pods with it.
const TEMPLATE_GENERATION: &str = "deprecated.daemonset.template.generation";

fn set_template_generation(obj: &mut Object, old: Option<&Object>) {
    let generation = match old {
        None => 1,
        Some(old) => {
            let was = old
                .get("metadata")
                .and_then(|m| m.get("annotations"))
                .and_then(|a| a.get(TEMPLATE_GENERATION))
                .and_then(Value::as_str)
                .and_then(|g| g.parse::<i64>().ok())
                .unwrap_or(1);
            let changed = old.get("spec").and_then(|s| s.get("template"))
                != obj.get("spec").and_then(|s| s.get("template"));
            if changed { was + 1 } else { was }
        }
    };
    let annotations = object_at(object_at(obj, "metadata"), "annotations");
    annotations.insert(TEMPLATE_GENERATION.into(), json!(generation.to_string()));
}

fn default_job_spec(obj: &mut Object) {
    let spec = object_at(obj, "spec");
    let unset = |spec: &Map<String, Value>, key: &str| spec.get(key).is_none_or(Value::is_null);
    // A Job that states neither runs one pod to one completion.
    if unset(spec, "completions") && unset(spec, "parallelism") {
        spec.insert("completions".into(), json!(1));
    }
    set_default(spec, "parallelism", json!(1));
    let backoff = if unset(spec, "backoffLimitPerIndex") {
        6
    } else {
        i64::from(i32::MAX)
    };
    set_default(spec, "backoffLimit", json!(backoff));
    set_default(spec, "completionMode", json!("NonIndexed"));
    set_default(spec, "suspend", json!(false));
    let replacement = if unset(spec, "podFailurePolicy") {
        "TerminatingOrFailed"
    } else {
        "Failed"
    };
    set_default(spec, "podReplacementPolicy", json!(replacement));
    if let Some(Value::Array(rules)) = spec
        .get_mut("podFailurePolicy")
        .and_then(|p| p.get_mut("rules"))
    {
        for rule in rules {
            if let Some(Value::Array(patterns)) = rule.get_mut("onPodConditions") {
                for pattern in patterns.iter_mut().filter_map(Value::as_object_mut) {
                    set_default(pattern, "status", json!("True"));
                }
            }
        }
    }
}

/// The Job strategy's selector for a Job created without `manualSelector`: its pods'
/// template gets the job's name and uid as labels (both the legacy and the
/// `batch.kubernetes.io/` keys; labels the user set are left for validation to judge)
/// and the selector matches the uid.
fn generate_job_selector(obj: &mut Object) {
    let name = crate::object::meta_str(obj, "name")
        .unwrap_or_default()
        .to_owned();
    let uid = crate::object::meta_str(obj, "uid")
        .unwrap_or_default()
        .to_owned();
    let spec = object_at(obj, "spec");
    let template = object_at(spec, "template");
    let labels = object_at(object_at(template, "metadata"), "labels");
    for key in [LEGACY_JOB_NAME, JOB_NAME] {
        set_default(labels, key, json!(name));
    }
    for key in [LEGACY_CONTROLLER_UID, CONTROLLER_UID] {
        set_default(labels, key, json!(uid));
    }
    let selector = object_at(spec, "selector");
    let match_labels = object_at(selector, "matchLabels");
    set_default(match_labels, CONTROLLER_UID, json!(uid));
}

/// Validates `obj` if `res` is one of these kinds; false otherwise.
pub(super) fn validate(
    res: &ResourceInfo,
    obj: &Object,
    old: Option<&Object>,
    causes: &mut Vec<StatusCause>,
) -> bool {
    match (res.group.as_str(), res.plural.as_str()) {
        ("apps", "daemonsets") => validate_daemon_set(obj, old, causes),
        ("apps", "statefulsets") => validate_stateful_set(obj, old, causes),
        ("apps", "controllerrevisions") => validate_controller_revision(obj, old, causes),
        ("batch", "jobs") => validate_job(obj, old, causes),
        ("batch", "cronjobs") => validate_cron_job(obj, old, causes),
        ("", "persistentvolumeclaims") => validate_claim(obj, old, causes),
        ("", "persistentvolumes") => validate_volume(obj, old, causes),
        ("storage.k8s.io", "storageclasses") => validate_storage_class(obj, old, causes),
        ("apiregistration.k8s.io", "apiservices") => validate_api_service(obj, causes),
        _ => return false,
    }
    true
}

fn not_supported(field: impl Into<String>, value: &Value, supported: &[&str]) -> StatusCause {
    let shown = match value {
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    };
    let supported: Vec<String> = supported.iter().map(|s| format!("{s:?}")).collect();
    StatusCause::new(
        "FieldValueNotSupported",
        field,
        format!(
            "Unsupported value: {shown}: supported values: {}",
            supported.join(", ")
        ),
    )
}

fn immutable(field: impl Into<String>, value: &Value) -> StatusCause {
    invalid_json(field, value, "field is immutable")
}

/// `value` must be one of `supported`; required when missing.
fn one_of(field: &str, value: Option<&Value>, supported: &[&str], causes: &mut Vec<StatusCause>) {
    match value {
        None | Some(Value::Null) => causes.push(StatusCause::required(field)),
        Some(v) if v.as_str().is_some_and(|s| supported.contains(&s)) => {}
        Some(v) => causes.push(not_supported(field, v, supported)),
    }
}

fn name_of(obj: &Object) -> &str {
    crate::object::meta_str(obj, "name").unwrap_or_default()
}

/// A workload's selector and template, as Kubernetes validates a DaemonSet's or
/// StatefulSet's (a Deployment's too): a non-empty, well-formed selector the
/// template's labels fit, unchanged on update, and a valid pod template whose
/// restart policy is `Always`.
fn selector_and_template(
    kind: &str,
    kind_name: &str,
    obj: &Object,
    old: Option<&Object>,
    causes: &mut Vec<StatusCause>,
) {
    let fits = match str_field(obj, &["spec", "selector"]) {
        None | Some(Value::Null) => {
            causes.push(StatusCause::required("spec.selector"));
            Some(false)
        }
        Some(sel) => {
            let usable = check_selector(sel, causes);
            if usable.as_ref().is_some_and(|s| s.is_empty()) {
                causes.push(invalid_json(
                    "spec.selector",
                    sel,
                    &format!("empty selector is invalid for {kind}"),
                ));
            }
            usable.map(|s| {
                let template = str_field(obj, &["spec", "template"]).cloned();
                s.is_empty() || template.is_some_and(|t| s.matches_object(&t))
            })
        }
    };
    if fits == Some(false) {
        causes.push(invalid_shown(
            "spec.template.metadata.labels",
            &go_labels(str_field(obj, &["spec", "template", "metadata", "labels"])),
            "`selector` does not match template `labels`",
        ));
    }
    let pod_spec = str_field(obj, &["spec", "template", "spec"]);
    validate_pod_spec(pod_spec, "spec.template.spec", causes);
    if let Some(policy) = pod_spec.and_then(|s| s.get("restartPolicy"))
        && policy != "Always"
    {
        causes.push(not_supported(
            "spec.template.spec.restartPolicy",
            policy,
            &["Always"],
        ));
    }
    if pod_spec.is_some_and(|s| s.get("activeDeadlineSeconds").is_some_and(|v| !v.is_null())) {
        causes.push(StatusCause::forbidden(
            "spec.template.spec.activeDeadlineSeconds",
            &format!("activeDeadlineSeconds in {kind_name} is not Supported"),
        ));
    }
    if let (Some(old), Some(sel)) = (old, str_field(obj, &["spec", "selector"]))
        && !sel.is_null()
    {
        let was = old.get("spec").and_then(|s| s.get("selector"));
        if was.map(without_empty) != Some(without_empty(sel)) {
            causes.push(immutable("spec.selector", sel));
        }
    }
}

/// An int or a percentage of `rollingUpdate` at `field`: its number, whether it is a
/// percentage; a cause for a malformed or negative one.
fn int_or_percent(
    value: Option<&Value>,
    field: &str,
    causes: &mut Vec<StatusCause>,
) -> (i64, bool) {
    match value {
        Some(v @ Value::Number(n)) => {
            let n = n.as_i64().unwrap_or(0);
            if n < 0 {
                causes.push(invalid_json(field, v, "must be greater than or equal to 0"));
            }
            (n, false)
        }
        Some(v @ Value::String(s)) => {
            match s
                .strip_suffix('%')
                .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
            {
                Some(d) => {
                    let n = d.parse().unwrap_or(i64::MAX);
                    if n > 100 {
                        causes.push(invalid_json(field, v, "must not be greater than 100%"));
                    }
                    (n, true)
                }
                None => {
                    causes.push(invalid_json(field, v, super::PERCENT_FORMAT));
                    (0, false)
                }
            }
        }
        _ => (0, false),
    }
}

fn validate_daemon_set(obj: &Object, old: Option<&Object>, causes: &mut Vec<StatusCause>) {
    selector_and_template("daemonset", "DaemonSet", obj, old, causes);
    nonnegative(obj, "minReadySeconds", causes);
    nonnegative(obj, "revisionHistoryLimit", causes);
    let strategy = str_field(obj, &["spec", "updateStrategy"]);
    let kind = strategy.and_then(|s| s.get("type"));
    one_of(
        "spec.updateStrategy.type",
        kind,
        &["RollingUpdate", "OnDelete"],
        causes,
    );
    let rolling = strategy
        .and_then(|s| s.get("rollingUpdate"))
        .filter(|r| !r.is_null());
    match (kind.and_then(Value::as_str), rolling) {
        (Some("RollingUpdate"), None) => {
            causes.push(StatusCause::required("spec.updateStrategy.rollingUpdate"))
        }
        (Some("RollingUpdate"), Some(rolling)) => {
            let unavailable_field = "spec.updateStrategy.rollingUpdate.maxUnavailable";
            let (unavailable, _) =
                int_or_percent(rolling.get("maxUnavailable"), unavailable_field, causes);
            let (surge, _) = int_or_percent(
                rolling.get("maxSurge"),
                "spec.updateStrategy.rollingUpdate.maxSurge",
                causes,
            );
            if unavailable == 0 && surge == 0 {
                let shown = rolling.get("maxUnavailable").cloned().unwrap_or(json!(0));
                causes.push(invalid_json(
                    unavailable_field,
                    &shown,
                    "may not be 0 when `maxSurge` is 0",
                ));
            }
            if unavailable != 0 && surge != 0 {
                let shown = rolling.get("maxSurge").cloned().unwrap_or(json!(0));
                causes.push(invalid_json(
                    "spec.updateStrategy.rollingUpdate.maxSurge",
                    &shown,
                    "may not be set when maxUnavailable is non-zero",
                ));
            }
        }
        _ => {}
    }
}

fn validate_stateful_set(obj: &Object, old: Option<&Object>, causes: &mut Vec<StatusCause>) {
    if let Some(problem) = crate::object::dns1123_label(name_of(obj)) {
        causes.push(StatusCause::invalid(
            "metadata.name",
            name_of(obj),
            &problem,
        ));
    }
    selector_and_template("statefulset", "StatefulSet", obj, old, causes);
    nonnegative(obj, "replicas", causes);
    nonnegative(obj, "minReadySeconds", causes);
    nonnegative(obj, "revisionHistoryLimit", causes);
    one_of(
        "spec.podManagementPolicy",
        str_field(obj, &["spec", "podManagementPolicy"]),
        &["OrderedReady", "Parallel"],
        causes,
    );
    let strategy = str_field(obj, &["spec", "updateStrategy"]);
    let kind = strategy.and_then(|s| s.get("type"));
    one_of(
        "spec.updateStrategy.type",
        kind,
        &["RollingUpdate", "OnDelete"],
        causes,
    );
    let rolling = strategy
        .and_then(|s| s.get("rollingUpdate"))
        .filter(|r| !r.is_null());
    if let Some(rolling) = rolling {
        if kind.and_then(Value::as_str) == Some("OnDelete") {
            causes.push(invalid_json(
                "spec.updateStrategy.rollingUpdate",
                rolling,
                "only allowed for updateStrategy 'RollingUpdate'",
            ));
        }
        if let Some(p) = rolling
            .get("partition")
            .filter(|p| p.as_i64().is_some_and(|n| n < 0))
        {
            causes.push(invalid_json(
                "spec.updateStrategy.rollingUpdate.partition",
                p,
                "must be greater than or equal to 0",
            ));
        }
        let field = "spec.updateStrategy.rollingUpdate.maxUnavailable";
        if let Some(v) = rolling.get("maxUnavailable").filter(|v| !v.is_null()) {
            let (n, _) = int_or_percent(Some(v), field, causes);
            if n == 0 {
                causes.push(invalid_json(field, v, "must be greater than 0"));
            }
        }
    }
    let retention = str_field(obj, &["spec", "persistentVolumeClaimRetentionPolicy"]);
    for key in ["whenDeleted", "whenScaled"] {
        if let Some(v) = retention.and_then(|r| r.get(key)) {
            one_of(
                &format!("spec.persistentVolumeClaimRetentionPolicy.{key}"),
                Some(v),
                &["Retain", "Delete"],
                causes,
            );
        }
    }
    if let Some(start) =
        str_field(obj, &["spec", "ordinals", "start"]).filter(|s| s.as_i64().is_some_and(|n| n < 0))
    {
        causes.push(invalid_json(
            "spec.ordinals.start",
            start,
            "must be greater than or equal to 0",
        ));
    }
    let templates = str_field(obj, &["spec", "volumeClaimTemplates"]).and_then(Value::as_array);
    for (i, claim) in templates.into_iter().flatten().enumerate() {
        claim_spec(
            claim.get("spec"),
            &format!("spec.volumeClaimTemplates[{i}].spec"),
            causes,
        );
    }
    if let Some(old) = old {
        // As Kubernetes: only these fields of a StatefulSet's spec may change.
        let mutable = [
            "replicas",
            "ordinals",
            "template",
            "updateStrategy",
            "persistentVolumeClaimRetentionPolicy",
            "minReadySeconds",
            "revisionHistoryLimit",
        ];
        let rest = |o: &Object| {
            let mut spec = o
                .get("spec")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            spec.retain(|k, _| !mutable.contains(&k.as_str()));
            without_empty(&Value::Object(spec))
        };
        if rest(obj) != rest(old) {
            causes.push(StatusCause::forbidden(
                "spec",
                "updates to statefulset spec for fields other than 'replicas', 'ordinals', \
                 'template', 'updateStrategy', 'persistentVolumeClaimRetentionPolicy' and \
                 'minReadySeconds' are forbidden",
            ));
        }
    }
}

fn validate_controller_revision(obj: &Object, old: Option<&Object>, causes: &mut Vec<StatusCause>) {
    match obj.get("revision") {
        Some(v) if v.as_i64().is_some_and(|n| n < 0) => causes.push(invalid_json(
            "revision",
            v,
            "must be greater than or equal to 0",
        )),
        _ => {}
    }
    if let Some(old) = old {
        // Only the data: controllers renumber a revision they roll back to.
        let now = obj.get("data").unwrap_or(&Value::Null);
        if old.get("data").unwrap_or(&Value::Null) != now {
            causes.push(immutable("data", now));
        }
    }
}

fn validate_job(obj: &Object, old: Option<&Object>, causes: &mut Vec<StatusCause>) {
    let labels = str_field(obj, &["spec", "template", "metadata", "labels"]);
    // Its pods carry its name as a label value (job-name): at most 63 characters.
    for (key, value) in labels.and_then(Value::as_object).into_iter().flatten() {
        let value = value.as_str().unwrap_or_default();
        if value.len() > 63 {
            causes.push(StatusCause::invalid(
                format!("spec.template.labels[{key}]"),
                value,
                "must be no more than 63 characters",
            ));
        }
    }
    let manual = str_field(obj, &["spec", "manualSelector"]) == Some(&json!(true));
    if !manual {
        // A generated selector: it selects this Job's uid, and its pods carry it.
        let uid = crate::object::meta_str(obj, "uid").unwrap_or_default();
        let expected = json!({"matchLabels": {CONTROLLER_UID: uid}});
        let selector = str_field(obj, &["spec", "selector"]);
        if let Some(sel) = selector
            && without_empty(sel) != expected
        {
            causes.push(invalid_json(
                "spec.selector",
                sel,
                "`selector` not auto-generated",
            ));
        }
        for key in [CONTROLLER_UID, LEGACY_CONTROLLER_UID] {
            match labels.and_then(|l| l.get(key)) {
                Some(v) if v != uid => causes.push(invalid_json(
                    format!("spec.template.metadata.labels[{key}]"),
                    v,
                    &format!("must be '{uid}'"),
                )),
                _ => {}
            }
        }
    }
    job_spec(obj.get("spec"), "spec", causes, true);
    if let Some(old) = old {
        job_update(obj, old, causes);
    }
}

/// A Job's spec (or a CronJob's job template's, at `path`), as Kubernetes'
/// `validateJobSpec`; `selector_required` for a Job, whose selector is set by now.
fn job_spec(
    spec: Option<&Value>,
    path: &str,
    causes: &mut Vec<StatusCause>,
    selector_required: bool,
) {
    let get = |key: &str| spec.and_then(|s| s.get(key)).filter(|v| !v.is_null());
    for key in [
        "parallelism",
        "completions",
        "activeDeadlineSeconds",
        "backoffLimit",
        "ttlSecondsAfterFinished",
        "backoffLimitPerIndex",
        "maxFailedIndexes",
    ] {
        if let Some(v) = get(key).filter(|v| v.as_i64().is_some_and(|n| n < 0)) {
            causes.push(invalid_json(
                format!("{path}.{key}"),
                v,
                "must be greater than or equal to 0",
            ));
        }
    }
    let mode = get("completionMode");
    if let Some(mode) = mode {
        one_of(
            &format!("{path}.completionMode"),
            Some(mode),
            &["NonIndexed", "Indexed"],
            causes,
        );
    }
    let indexed = mode.and_then(Value::as_str) == Some("Indexed");
    if indexed {
        const MAX_INDEXED: i64 = 100_000;
        match get("completions") {
            None => causes.push(
                StatusCause::required(format!("{path}.completions"))
                    .with_message("Required value: when completion mode is Indexed"),
            ),
            Some(v) if v.as_i64().is_some_and(|n| n > MAX_INDEXED) => causes.push(invalid_json(
                format!("{path}.completions"),
                v,
                "must be less than or equal to 100000 when completion mode is Indexed",
            )),
            _ => {}
        }
        if let Some(v) = get("parallelism").filter(|v| v.as_i64().is_some_and(|n| n > MAX_INDEXED))
        {
            causes.push(invalid_json(
                format!("{path}.parallelism"),
                v,
                "must be less than or equal to 100000 when completion mode is Indexed",
            ));
        }
    } else if let Some(v) = get("backoffLimitPerIndex") {
        causes.push(invalid_json(
            format!("{path}.backoffLimitPerIndex"),
            v,
            "requires indexed completion mode",
        ));
    }
    match get("selector") {
        None if selector_required => causes.push(StatusCause::required(format!("{path}.selector"))),
        None => {}
        Some(sel) => {
            let mut selector_causes = Vec::new();
            let usable = check_selector(sel, &mut selector_causes);
            for mut c in selector_causes {
                c.field = c.field.replacen("spec.", &format!("{path}."), 1);
                causes.push(c);
            }
            let template = spec.and_then(|s| s.get("template")).cloned();
            if let Some(s) = usable
                && !(s.is_empty() || template.is_some_and(|t| s.matches_object(&t)))
            {
                causes.push(invalid_shown(
                    format!("{path}.template.metadata.labels"),
                    &go_labels(
                        spec.and_then(|s| s.get("template"))
                            .and_then(|t| t.get("metadata"))
                            .and_then(|m| m.get("labels")),
                    ),
                    "`selector` does not match template `labels`",
                ));
            }
        }
    }
    let pod_spec = spec
        .and_then(|s| s.get("template"))
        .and_then(|t| t.get("spec"));
    validate_pod_spec(pod_spec, &format!("{path}.template.spec"), causes);
    let restart = pod_spec.and_then(|s| s.get("restartPolicy"));
    let restart_field = format!("{path}.template.spec.restartPolicy");
    match restart.and_then(Value::as_str) {
        Some("OnFailure" | "Never") => {}
        _ => causes.push(not_supported(
            restart_field.clone(),
            restart.unwrap_or(&json!("")),
            &["OnFailure", "Never"],
        )),
    }
    if let Some(policy) = get("podFailurePolicy") {
        if restart.and_then(Value::as_str) == Some("OnFailure") {
            causes.push(invalid_json(
                restart_field,
                &json!("OnFailure"),
                "only \"Never\" is supported when podFailurePolicy is specified",
            ));
        }
        pod_failure_policy(policy, &format!("{path}.podFailurePolicy"), causes);
    }
}

/// `podFailurePolicy`'s rules: at most 20, each with a known action and exactly one of
/// `onExitCodes` (In/NotIn on non-empty, unique values; 0 not in an `In`) and
/// `onPodConditions`.
fn pod_failure_policy(policy: &Value, path: &str, causes: &mut Vec<StatusCause>) {
    let rules = policy.get("rules").and_then(Value::as_array);
    let rules = rules.map(Vec::as_slice).unwrap_or_default();
    if rules.len() > 20 {
        causes.push(StatusCause::new(
            "FieldValueTooMany",
            format!("{path}.rules"),
            format!("Too many: {}: must have at most 20 items", rules.len()),
        ));
    }
    for (i, rule) in rules.iter().enumerate() {
        let rule_path = format!("{path}.rules[{i}]");
        one_of(
            &format!("{rule_path}.action"),
            rule.get("action"),
            &["Count", "FailIndex", "FailJob", "Ignore"],
            causes,
        );
        let codes = rule.get("onExitCodes").filter(|v| !v.is_null());
        let conditions = rule
            .get("onPodConditions")
            .and_then(Value::as_array)
            .filter(|c| !c.is_empty());
        match (codes, conditions) {
            (Some(_), Some(_)) => causes.push(invalid_json(
                &rule_path,
                rule,
                "specifying both OnExitCodes and OnPodConditions is not supported",
            )),
            (None, None) => causes.push(invalid_json(
                &rule_path,
                rule,
                "specifying one of OnExitCodes and OnPodConditions is required",
            )),
            _ => {}
        }
        if let Some(codes) = codes {
            let codes_path = format!("{rule_path}.onExitCodes");
            let operator = codes.get("operator");
            one_of(
                &format!("{codes_path}.operator"),
                operator,
                &["In", "NotIn"],
                causes,
            );
            let values: Vec<i64> = codes
                .get("values")
                .and_then(Value::as_array)
                .map(|v| v.iter().filter_map(Value::as_i64).collect())
                .unwrap_or_default();
            if values.is_empty() {
                causes.push(invalid_json(
                    format!("{codes_path}.values"),
                    &json!(values),
                    "at least one value is required",
                ));
            }
            for (j, v) in values.iter().enumerate() {
                if values[..j].contains(v) {
                    causes.push(StatusCause::new(
                        "FieldValueDuplicate",
                        format!("{codes_path}.values[{j}]"),
                        format!("Duplicate value: {v}"),
                    ));
                }
                if *v == 0 && operator == Some(&json!("In")) {
                    causes.push(invalid_json(
                        format!("{codes_path}.values[{j}]"),
                        &json!(0),
                        "must not be 0 for the In operator",
                    ));
                }
            }
        }
        for (j, pattern) in conditions.into_iter().flatten().enumerate() {
            let pattern_path = format!("{rule_path}.onPodConditions[{j}]");
            one_of(
                &format!("{pattern_path}.status"),
                pattern.get("status"),
                &["True", "False", "Unknown"],
                causes,
            );
            if pattern
                .get("type")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
            {
                causes.push(StatusCause::required(format!("{pattern_path}.type")));
            }
        }
    }
}

/// What a Job's update may change, as Kubernetes 1.30: not its selector, completion
/// mode, failure policy or per-index limit; completions only together with an equal
/// parallelism of an Indexed Job; its template only while the Job is suspended and
/// has never started, and then only its scheduling directives and labels and
/// annotations.
fn job_update(obj: &Object, old: &Object, causes: &mut Vec<StatusCause>) {
    let spec = |o: &Object, key: &str| -> Value {
        str_field(o, &["spec", key]).cloned().unwrap_or(Value::Null)
    };
    for key in [
        "selector",
        "completionMode",
        "podFailurePolicy",
        "backoffLimitPerIndex",
        "manualSelector",
    ] {
        let now = spec(obj, key);
        if without_empty(&now) != without_empty(&spec(old, key)) {
            causes.push(immutable(format!("spec.{key}"), &now));
        }
    }
    let completions = spec(obj, "completions");
    if completions != spec(old, "completions") {
        let indexed = spec(obj, "completionMode") == json!("Indexed");
        if !indexed {
            causes.push(immutable("spec.completions", &completions));
        } else if completions != spec(obj, "parallelism") {
            causes.push(invalid_json(
                "spec.completions",
                &completions,
                "can only be modified in tandem with spec.parallelism",
            ));
        }
    }
    let template = spec(obj, "template");
    let old_template = spec(old, "template");
    if template != old_template {
        let suspended = spec(obj, "suspend") == json!(true);
        let never_started = str_field(old, &["status", "startTime"]).is_none_or(Value::is_null);
        // The fields a suspended Job's template may still change (Kubernetes'
        // mutable scheduling directives).
        let strip = |t: &Value| {
            let mut t = t.clone();
            if let Some(m) = t.get_mut("metadata").and_then(Value::as_object_mut) {
                m.remove("labels");
                m.remove("annotations");
            }
            if let Some(s) = t.get_mut("spec").and_then(Value::as_object_mut) {
                for key in ["nodeSelector", "tolerations", "affinity", "schedulingGates"] {
                    s.remove(key);
                }
            }
            without_empty(&t)
        };
        if !(suspended && never_started && strip(&template) == strip(&old_template)) {
            causes.push(immutable("spec.template", &template));
        }
    }
}

fn validate_cron_job(obj: &Object, old: Option<&Object>, causes: &mut Vec<StatusCause>) {
    // Its Jobs are named `<name>-<minutes since the epoch>`, 11 characters more,
    // within the 63 of a label value.
    let name = name_of(obj);
    if name.len() > 52 {
        causes.push(StatusCause::invalid(
            "metadata.name",
            name,
            "must be no more than 52 characters",
        ));
    }
    let spec = obj.get("spec");
    let get = |key: &str| spec.and_then(|s| s.get(key)).filter(|v| !v.is_null());
    let time_zone = get("timeZone");
    match get("schedule").and_then(Value::as_str) {
        None | Some("") => causes.push(StatusCause::required("spec.schedule")),
        Some(schedule) => {
            if let Err(e) = parse_schedule(schedule) {
                causes.push(StatusCause::invalid("spec.schedule", schedule, &e));
            }
            let had_tz = old
                .and_then(|o| str_field(o, &["spec", "schedule"]))
                .and_then(Value::as_str)
                .is_some_and(|s| s.contains("TZ"));
            if schedule.contains("TZ") {
                if !had_tz {
                    causes.push(StatusCause::invalid(
                        "spec.schedule",
                        schedule,
                        "cannot use TZ or CRON_TZ in schedule, use timeZone field instead",
                    ));
                } else if time_zone.is_some() {
                    causes.push(StatusCause::invalid(
                        "spec.schedule",
                        schedule,
                        "cannot use both timeZone field and TZ or CRON_TZ in schedule",
                    ));
                }
            }
        }
    }
    if let Some(tz) = time_zone {
        let tz = tz.as_str().unwrap_or_default();
        if let Err(e) = check_time_zone(tz) {
            causes.push(StatusCause::invalid("spec.timeZone", tz, &e));
        }
    }
    one_of(
        "spec.concurrencyPolicy",
        get("concurrencyPolicy"),
        &["Allow", "Forbid", "Replace"],
        causes,
    );
    for key in [
        "startingDeadlineSeconds",
        "successfulJobsHistoryLimit",
        "failedJobsHistoryLimit",
    ] {
        if let Some(v) = get(key).filter(|v| v.as_i64().is_some_and(|n| n < 0)) {
            causes.push(invalid_json(
                format!("spec.{key}"),
                v,
                "must be greater than or equal to 0",
            ));
        }
    }
    let job = get("jobTemplate").and_then(|t| t.get("spec"));
    job_spec(job, "spec.jobTemplate.spec", causes, false);
    if let Some(sel) = job.and_then(|j| j.get("selector")).filter(|s| !s.is_null()) {
        causes.push(invalid_json(
            "spec.jobTemplate.spec.selector",
            sel,
            "`selector` will be auto-generated",
        ));
    }
    if job.and_then(|j| j.get("manualSelector")) == Some(&json!(true)) {
        causes.push(not_supported(
            "spec.jobTemplate.spec.manualSelector",
            &json!(true),
            &["nil", "false"],
        ));
    }
}

/// A time zone as Kubernetes accepts one: a name of the IANA database.
fn check_time_zone(tz: &str) -> Result<(), String> {
    if tz.is_empty() {
        return Err("timeZone must be nil or non-empty string".into());
    }
    let part_ok = |p: &str| {
        !p.is_empty()
            && p != "."
            && p != ".."
            && !p.starts_with('-')
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'+'))
    };
    if !tz.split('/').all(part_ok) {
        return Err(format!("unknown time zone {tz}"));
    }
    jiff::tz::TimeZone::get(tz)
        .map(|_| ())
        .map_err(|_| format!("unknown time zone {tz}"))
}

/// A cron schedule as Kubernetes (robfig/cron's standard parser) reads one: five
/// fields, or a descriptor (`@hourly`, `@every 1h`), optionally after `TZ=`/`CRON_TZ=`;
/// the error in its words.
pub fn parse_schedule(schedule: &str) -> Result<(), String> {
    let mut spec = schedule.trim();
    if spec.is_empty() {
        return Err("empty spec string".into());
    }
    if let Some(rest) = spec
        .strip_prefix("TZ=")
        .or_else(|| spec.strip_prefix("CRON_TZ="))
    {
        let (tz, rest) = rest.split_once(' ').unwrap_or((rest, ""));
        jiff::tz::TimeZone::get(tz)
            .map_err(|_| format!("provided bad location {tz}: unknown time zone {tz}"))?;
        spec = rest.trim();
    }
    if let Some(descriptor) = spec.strip_prefix('@') {
        return match descriptor {
            "yearly" | "annually" | "monthly" | "weekly" | "daily" | "midnight" | "hourly" => {
                Ok(())
            }
            d if d.starts_with("every ") => {
                let every = d["every ".len()..].trim();
                go_duration(every).then_some(()).ok_or_else(|| {
                    format!("failed to parse duration {spec}: time: invalid duration {every:?}")
                })
            }
            _ => Err(format!("unrecognized descriptor: {spec}")),
        };
    }
    let fields: Vec<&str> = spec.split_whitespace().collect();
    if fields.len() != 5 {
        return Err(format!(
            "expected exactly 5 fields, found {}: [{}]",
            fields.len(),
            fields.join(" ")
        ));
    }
    const MONTHS: &[&str] = &[
        "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
    ];
    const DAYS: &[&str] = &["sun", "mon", "tue", "wed", "thu", "fri", "sat"];
    let bounds: [(i64, i64, &[&str], i64); 5] = [
        (0, 59, &[], 0),
        (0, 23, &[], 0),
        (1, 31, &[], 0),
        (1, 12, MONTHS, 1),
        (0, 6, DAYS, 0),
    ];
    for (i, (field, (min, max, names, first))) in fields.iter().zip(bounds).enumerate() {
        // `?` stands for `*` in the day fields.
        let day_field = i == 2 || i == 4;
        for range in field.split(',') {
            cron_range(range, min, max, names, first, day_field)?;
        }
    }
    Ok(())
}

/// One comma-separated part of a cron field: `*`, `n`, `a-b`, any of them `/step`.
fn cron_range(
    expr: &str,
    min: i64,
    max: i64,
    names: &[&str],
    first: i64,
    day_field: bool,
) -> Result<(), String> {
    let parse = |s: &str| -> Result<i64, String> {
        if let Some(i) = names.iter().position(|n| n.eq_ignore_ascii_case(s)) {
            return Ok(i as i64 + first);
        }
        s.parse::<i64>()
            .ok()
            .filter(|_| !s.starts_with('+'))
            .ok_or_else(|| {
                format!("failed to parse int from {s}: strconv.Atoi: parsing {s:?}: invalid syntax")
            })
    };
    let (range, step) = match expr.split('/').collect::<Vec<_>>()[..] {
        [range] => (range, None),
        [range, step] => (range, Some(step)),
        _ => return Err(format!("too many slashes: {expr}")),
    };
    let (start, end) = if range == "*" || (day_field && range == "?") {
        (min, max)
    } else {
        match range.split('-').collect::<Vec<_>>()[..] {
            [one] => {
                let n = parse(one)?;
                (n, if step.is_some() { max } else { n })
            }
            [a, b] => (parse(a)?, parse(b)?),
            _ => return Err(format!("too many hyphens: {expr}")),
        }
    };
    if let Some(step) = step {
        let step = parse(step)?;
        if step <= 0 {
            return Err(format!("step of range should be a positive number: {expr}"));
        }
    }
    if start < min {
        return Err(format!(
            "beginning of range ({start}) below minimum ({min}): {expr}"
        ));
    }
    if end > max {
        return Err(format!(
            "end of range ({end}) above maximum ({max}): {expr}"
        ));
    }
    if start > end {
        return Err(format!(
            "beginning of range ({start}) beyond end of range ({end}): {expr}"
        ));
    }
    Ok(())
}

/// Whether `s` is a Go duration (`1h30m`, `90s`, `1.5h`).
fn go_duration(s: &str) -> bool {
    let mut rest = s;
    if rest.is_empty() {
        return false;
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if digits == 0 {
            return false;
        }
        rest = &rest[digits..];
        let unit = ["ns", "us", "µs", "ms", "s", "m", "h"]
            .iter()
            .filter(|u| rest.starts_with(*u))
            .max_by_key(|u| u.len());
        match unit {
            Some(u) => rest = &rest[u.len()..],
            None => return false,
        }
    }
    true
}

const ACCESS_MODES: &[&str] = &[
    "ReadWriteOnce",
    "ReadOnlyMany",
    "ReadWriteMany",
    "ReadWriteOncePod",
];

fn access_modes(modes: Option<&Value>, path: &str, causes: &mut Vec<StatusCause>) {
    let list = modes.and_then(Value::as_array).filter(|m| !m.is_empty());
    let Some(list) = list else {
        causes.push(
            StatusCause::required(format!("{path}.accessModes"))
                .with_message("Required value: at least 1 access mode is required"),
        );
        return;
    };
    for mode in list {
        if !mode.as_str().is_some_and(|m| ACCESS_MODES.contains(&m)) {
            causes.push(not_supported(
                format!("{path}.accessModes"),
                mode,
                ACCESS_MODES,
            ));
        }
    }
    if list.len() > 1 && list.iter().any(|m| m == "ReadWriteOncePod") {
        causes.push(StatusCause::forbidden(
            format!("{path}.accessModes"),
            "may not use ReadWriteOncePod with other access modes",
        ));
    }
}

fn volume_mode(mode: Option<&Value>, path: &str, causes: &mut Vec<StatusCause>) {
    if let Some(mode) = mode.filter(|m| !m.is_null())
        && !matches!(mode.as_str(), Some("Block" | "Filesystem"))
    {
        causes.push(not_supported(
            format!("{path}.volumeMode"),
            mode,
            &["Block", "Filesystem"],
        ));
    }
}

/// A claim's spec at `path`: access modes, a positive storage request.
fn claim_spec(spec: Option<&Value>, path: &str, causes: &mut Vec<StatusCause>) {
    access_modes(spec.and_then(|s| s.get("accessModes")), path, causes);
    volume_mode(spec.and_then(|s| s.get("volumeMode")), path, causes);
    let storage = spec
        .and_then(|s| s.get("resources"))
        .and_then(|r| r.get("requests"))
        .and_then(|r| r.get("storage"));
    let field = format!("{path}.resources[storage]");
    match storage {
        None | Some(Value::Null) => causes.push(StatusCause::required(field)),
        Some(v) => match v.as_str().map(Quantity::parse) {
            Some(Ok(q)) if q > Quantity::default() => {}
            Some(Ok(_)) => causes.push(invalid_json(field, v, "must be greater than zero")),
            _ => causes.push(invalid_json(field, v, "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")),
        },
    }
}

fn storage_request(obj: &Object) -> Option<Quantity> {
    str_field(obj, &["spec", "resources", "requests", "storage"])
        .and_then(Value::as_str)
        .and_then(|s| Quantity::parse(s).ok())
}

fn validate_claim(obj: &Object, old: Option<&Object>, causes: &mut Vec<StatusCause>) {
    claim_spec(obj.get("spec"), "spec", causes);
    let Some(old) = old else { return };
    // A claim's spec is fixed once made, but for what binding and expansion write:
    // the volume's name on an unbound claim, a class on a claim without one, a larger
    // request on a bound claim.
    let mut now = obj.get("spec").cloned().unwrap_or(json!({}));
    let was = old.get("spec").cloned().unwrap_or(json!({}));
    let bound = was
        .get("volumeName")
        .and_then(Value::as_str)
        .is_some_and(|v| !v.is_empty());
    if !bound && let Some(v) = was.get("volumeName") {
        now["volumeName"] = v.clone();
    }
    if !bound
        && was.get("volumeName").is_none()
        && let Some(m) = now.as_object_mut()
    {
        m.remove("volumeName");
    }
    if was.get("storageClassName").is_none_or(Value::is_null) {
        match was.get("storageClassName") {
            Some(v) => now["storageClassName"] = v.clone(),
            None => {
                if let Some(m) = now.as_object_mut() {
                    m.remove("storageClassName");
                }
            }
        }
    }
    let request = |s: &Value| s.pointer("/resources/requests/storage").cloned();
    if bound && request(&now) != request(&was) {
        if let (Some(new), Some(prev)) = (storage_request(obj), storage_request(old))
            && new < prev
        {
            causes.push(StatusCause::forbidden(
                "spec.resources.requests.storage",
                "field can not be less than previous value",
            ));
        }
        if let (Some(r), Some(m)) = (request(&was), now.pointer_mut("/resources/requests")) {
            m["storage"] = r;
        }
    }
    if without_empty(&now) != without_empty(&was) {
        causes.push(StatusCause::forbidden(
            "spec",
            "spec is immutable after creation except resources.requests and \
             volumeAttributesClassName for bound claims",
        ));
    }
}

/// The volume sources a PersistentVolume may name.
const VOLUME_SOURCES: &[&str] = &[
    "awsElasticBlockStore",
    "azureDisk",
    "azureFile",
    "cephfs",
    "cinder",
    "csi",
    "fc",
    "flexVolume",
    "flocker",
    "gcePersistentDisk",
    "glusterfs",
    "hostPath",
    "iscsi",
    "local",
    "nfs",
    "photonPersistentDisk",
    "portworxVolume",
    "quobyte",
    "rbd",
    "scaleIO",
    "storageos",
    "vsphereVolume",
];

fn validate_volume(obj: &Object, old: Option<&Object>, causes: &mut Vec<StatusCause>) {
    let spec = obj.get("spec");
    access_modes(spec.and_then(|s| s.get("accessModes")), "spec", causes);
    volume_mode(spec.and_then(|s| s.get("volumeMode")), "spec", causes);
    let capacity = spec
        .and_then(|s| s.get("capacity"))
        .and_then(Value::as_object)
        .filter(|c| !c.is_empty());
    match capacity {
        None => causes.push(StatusCause::required("spec.capacity")),
        Some(c) if !c.contains_key("storage") || c.len() > 1 => causes.push(not_supported(
            "spec.capacity",
            &Value::Object(c.clone()),
            &["storage"],
        )),
        Some(c) => {
            let v = &c["storage"];
            let positive = v
                .as_str()
                .and_then(|s| Quantity::parse(s).ok())
                .is_some_and(|q| q > Quantity::default());
            if !positive {
                causes.push(invalid_json(
                    "spec.capacity[storage]",
                    v,
                    "must be greater than zero",
                ));
            }
        }
    }
    if let Some(policy) = spec.and_then(|s| s.get("persistentVolumeReclaimPolicy")) {
        one_of(
            "spec.persistentVolumeReclaimPolicy",
            Some(policy),
            &["Delete", "Recycle", "Retain"],
            causes,
        );
    }
    let sources: Vec<&str> = VOLUME_SOURCES
        .iter()
        .copied()
        .filter(|s| spec.and_then(|sp| sp.get(*s)).is_some_and(|v| !v.is_null()))
        .collect();
    match sources.as_slice() {
        [] => causes.push(
            StatusCause::required("spec")
                .with_message("Required value: must specify a volume type"),
        ),
        [_] => {}
        [_, rest @ ..] => {
            for s in rest {
                causes.push(StatusCause::forbidden(
                    format!("spec.{s}"),
                    "may not specify more than 1 volume type",
                ));
            }
        }
    }
    for (source, key) in [
        ("hostPath", "path"),
        ("local", "path"),
        ("nfs", "path"),
        ("nfs", "server"),
    ] {
        if let Some(s) = spec.and_then(|sp| sp.get(source)).filter(|v| !v.is_null())
            && s.get(key).and_then(Value::as_str).is_none_or(str::is_empty)
        {
            causes.push(StatusCause::required(format!("spec.{source}.{key}")));
        }
    }
    let affinity = spec
        .and_then(|s| s.get("nodeAffinity"))
        .filter(|v| !v.is_null());
    if sources.contains(&"local") && affinity.is_none() {
        causes.push(
            StatusCause::required("spec.nodeAffinity")
                .with_message("Required value: Local volume requires node affinity"),
        );
    }
    let Some(old) = old else { return };
    let source_of = |o: &Object| {
        let spec = o.get("spec").and_then(Value::as_object);
        let sources: Map<String, Value> = VOLUME_SOURCES
            .iter()
            .filter_map(|s| {
                spec.and_then(|sp| sp.get(*s))
                    .map(|v| ((*s).to_owned(), v.clone()))
            })
            .collect();
        without_empty(&Value::Object(sources))
    };
    if source_of(obj) != source_of(old) {
        causes.push(StatusCause::forbidden(
            "spec.persistentvolumesource",
            "spec.persistentvolumesource is forbidden to be changed",
        ));
    }
    let field =
        |o: &Object, key: &str| str_field(o, &["spec", key]).cloned().unwrap_or(Value::Null);
    if field(obj, "volumeMode") != field(old, "volumeMode") {
        causes.push(immutable("spec.volumeMode", &field(obj, "volumeMode")));
    }
    let old_affinity = field(old, "nodeAffinity");
    if !old_affinity.is_null() && field(obj, "nodeAffinity") != old_affinity {
        causes.push(immutable("spec.nodeAffinity", &field(obj, "nodeAffinity")));
    }
}

fn validate_storage_class(obj: &Object, old: Option<&Object>, causes: &mut Vec<StatusCause>) {
    match obj.get("provisioner").and_then(Value::as_str) {
        None | Some("") => causes.push(StatusCause::required("provisioner")),
        Some(p)
            if p.len() > 63
                || crate::object::dns1123_subdomain(&p.replace('/', ".").to_lowercase())
                    .is_some() =>
        {
            causes.push(StatusCause::invalid(
                "provisioner",
                p,
                "a qualified name must consist of alphanumeric characters, '-', '_' or '.', \
                 and must start and end with an alphanumeric character",
            ))
        }
        Some(_) => {}
    }
    one_of(
        "reclaimPolicy",
        obj.get("reclaimPolicy"),
        &["Delete", "Retain"],
        causes,
    );
    one_of(
        "volumeBindingMode",
        obj.get("volumeBindingMode"),
        &["Immediate", "WaitForFirstConsumer"],
        causes,
    );
    let Some(old) = old else { return };
    let field = |o: &Object, key: &str| o.get(key).cloned().unwrap_or(Value::Null);
    for key in ["parameters", "provisioner", "reclaimPolicy"] {
        if without_empty(&field(obj, key)) != without_empty(&field(old, key)) {
            causes.push(StatusCause::forbidden(
                key,
                &format!("updates to {key} are forbidden."),
            ));
        }
    }
    if field(obj, "volumeBindingMode") != field(old, "volumeBindingMode") {
        causes.push(immutable(
            "volumeBindingMode",
            &field(obj, "volumeBindingMode"),
        ));
    }
}

fn validate_api_service(obj: &Object, causes: &mut Vec<StatusCause>) {
    let spec = obj.get("spec");
    let get = |key: &str| spec.and_then(|s| s.get(key)).filter(|v| !v.is_null());
    let group = get("group").and_then(Value::as_str).unwrap_or_default();
    let version = get("version").and_then(Value::as_str).unwrap_or_default();
    let name = name_of(obj);
    let required_name = format!("{version}.{group}");
    if name != required_name {
        causes.push(StatusCause::invalid(
            "metadata.name",
            name,
            &format!("must be {required_name}"),
        ));
    }
    if group.is_empty() && version != "v1" {
        causes.push(StatusCause::forbidden(
            "spec.group",
            "only v1 may have an empty group and it better be legacy kube",
        ));
    }
    if !group.is_empty()
        && let Some(problem) = crate::object::dns1123_subdomain(group)
    {
        causes.push(StatusCause::invalid("spec.group", group, &problem));
    }
    if version.is_empty() {
        causes.push(StatusCause::required("spec.version"));
    } else if let Some(problem) = crate::object::dns1123_label(version) {
        causes.push(StatusCause::invalid("spec.version", version, &problem));
    }
    let priority = |key: &str, max: i64, causes: &mut Vec<StatusCause>| {
        let v = get(key).cloned().unwrap_or(json!(0));
        if !v.as_i64().is_some_and(|n| n > 0 && n <= max) {
            causes.push(invalid_json(
                format!("spec.{key}"),
                &v,
                &format!("must be positive and less than {max}"),
            ));
        }
    };
    priority("groupPriorityMinimum", 20000, causes);
    priority("versionPriority", 1000, causes);
    let insecure = get("insecureSkipTLSVerify") == Some(&json!(true));
    let ca_bundle = get("caBundle")
        .and_then(Value::as_str)
        .is_some_and(|c| !c.is_empty());
    match get("service") {
        None => {
            if ca_bundle {
                causes.push(StatusCause::invalid(
                    "spec.caBundle",
                    "",
                    "local APIServices may not have a caBundle",
                ));
            }
            if insecure {
                causes.push(invalid_json(
                    "spec.insecureSkipTLSVerify",
                    &json!(true),
                    "local APIServices may not have insecureSkipTLSVerify",
                ));
            }
        }
        Some(service) => {
            for key in ["namespace", "name"] {
                if service
                    .get(key)
                    .and_then(Value::as_str)
                    .is_none_or(str::is_empty)
                {
                    causes.push(StatusCause::required(format!("spec.service.{key}")));
                }
            }
            if let Some(port) = service.get("port")
                && !port.as_i64().is_some_and(|p| (1..=65535).contains(&p))
            {
                causes.push(invalid_json(
                    "spec.service.port",
                    port,
                    "port is not valid: must be between 1 and 65535, inclusive",
                ));
            }
            if insecure && ca_bundle {
                causes.push(invalid_json(
                    "spec.insecureSkipTLSVerify",
                    &json!(true),
                    "may not be true if caBundle is present",
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::typed::default_and_validate;

    fn res(plural: &str) -> ResourceInfo {
        trellis_api::registry::builtins()
            .into_iter()
            .find(|r| r.plural == plural)
            .unwrap()
    }

    fn obj(v: Value) -> Object {
        serde_json::from_value(v).unwrap()
    }

    /// The fields of the causes a write of `v` is refused with; empty if accepted.
    fn fields(plural: &str, v: Value, old: Option<&Object>) -> Vec<String> {
        let mut o = obj(v);
        match default_and_validate(&res(plural), &mut o, old) {
            Ok(()) => Vec::new(),
            Err(e) => e
                .details
                .map(|d| d.causes.into_iter().map(|c| c.field).collect())
                .unwrap_or_default(),
        }
    }

    fn pod_template(restart: &str) -> Value {
        json!({"metadata": {"labels": {"app": "web"}},
               "spec": {"restartPolicy": restart, "containers": [{"name": "c", "image": "busybox"}]}})
    }

    fn job(edit: impl FnOnce(&mut Value)) -> Value {
        let mut v = json!({"metadata": {"name": "pi", "uid": "u-1"},
                           "spec": {"template": pod_template("Never")}});
        edit(&mut v);
        v
    }

    #[test]
    fn jobs_get_a_generated_selector_and_kubernetes_defaults() {
        let mut j = obj(job(|v| v["spec"]["template"]["metadata"] = json!({})));
        default_and_validate(&res("jobs"), &mut j, None).unwrap();
        let labels = &j["spec"]["template"]["metadata"]["labels"];
        assert_eq!(labels["batch.kubernetes.io/controller-uid"], "u-1");
        assert_eq!(labels["controller-uid"], "u-1");
        assert_eq!(labels["batch.kubernetes.io/job-name"], "pi");
        assert_eq!(labels["job-name"], "pi");
        assert_eq!(
            j["spec"]["selector"],
            json!({"matchLabels": {"batch.kubernetes.io/controller-uid": "u-1"}})
        );
        // A Job without labels of its own shows its pods'.
        assert_eq!(&j["metadata"]["labels"], labels);
        for (key, value) in [
            ("completions", json!(1)),
            ("parallelism", json!(1)),
            ("backoffLimit", json!(6)),
            ("completionMode", json!("NonIndexed")),
            ("suspend", json!(false)),
            ("podReplacementPolicy", json!("TerminatingOrFailed")),
        ] {
            assert_eq!(j["spec"][key], value, "{key}");
        }
        // Parallelism alone leaves completions unset (work queue Jobs).
        let mut queue = obj(job(|v| v["spec"]["parallelism"] = json!(3)));
        default_and_validate(&res("jobs"), &mut queue, None).unwrap();
        assert!(queue["spec"].get("completions").is_none());
        // The user's labels stay the Job's.
        let mut labelled = obj(job(|_| {}));
        default_and_validate(&res("jobs"), &mut labelled, None).unwrap();
        assert_eq!(labelled["metadata"]["labels"], json!({"app": "web"}));
    }

    #[test]
    fn jobs_refuse_what_kubernetes_refuses() {
        let cases: Vec<(Value, &[&str])> = vec![
            (
                job(|v| v["spec"]["template"] = pod_template("Always")),
                &["spec.template.spec.restartPolicy"],
            ),
            (
                job(|v| v["spec"]["selector"] = json!({"matchLabels": {"app": "web"}})),
                &["spec.selector"],
            ),
            (job(|v| v["spec"]["completionMode"] = json!("Indexed")), &[]),
            (
                job(|v| {
                    v["spec"]["completionMode"] = json!("Indexed");
                    v["spec"]["parallelism"] = json!(2);
                }),
                &["spec.completions"],
            ),
            (
                job(|v| v["spec"]["backoffLimit"] = json!(-1)),
                &["spec.backoffLimit"],
            ),
            (
                job(|v| v["metadata"]["name"] = json!("j".repeat(64))),
                &[
                    "spec.template.labels[batch.kubernetes.io/job-name]",
                    "spec.template.labels[job-name]",
                ],
            ),
            (
                job(|v| {
                    v["spec"]["manualSelector"] = json!(true);
                    v["spec"]["selector"] = json!({"matchLabels": {"app": "api"}});
                }),
                &["spec.template.metadata.labels"],
            ),
            (
                job(|v| {
                    v["spec"]["podFailurePolicy"] = json!({"rules": [
                        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [0, 1, 1]}}]});
                }),
                &[
                    "spec.podFailurePolicy.rules[0].onExitCodes.values[0]",
                    "spec.podFailurePolicy.rules[0].onExitCodes.values[2]",
                ],
            ),
        ];
        for (i, (v, want)) in cases.into_iter().enumerate() {
            assert_eq!(fields("jobs", v, None), want, "case {i}");
        }
    }

    #[test]
    fn a_jobs_template_and_completions_are_immutable() {
        let mut stored = obj(job(|_| {}));
        default_and_validate(&res("jobs"), &mut stored, None).unwrap();
        let edit = |f: &dyn Fn(&mut Value)| {
            let mut v = Value::Object(stored.clone());
            f(&mut v);
            v
        };
        let image = |v: &mut Value| {
            v["spec"]["template"]["spec"]["containers"][0]["image"] = json!("nginx");
        };
        assert_eq!(
            fields("jobs", edit(&image), Some(&stored)),
            ["spec.template"]
        );
        assert_eq!(
            fields(
                "jobs",
                edit(&|v| v["spec"]["completions"] = json!(3)),
                Some(&stored)
            ),
            ["spec.completions"]
        );
        assert!(
            fields(
                "jobs",
                edit(&|v| v["spec"]["parallelism"] = json!(3)),
                Some(&stored)
            )
            .is_empty()
        );
        // A suspended Job that never started may move: its scheduling directives change.
        let mut suspended = stored.clone();
        suspended["spec"]["suspend"] = json!(true);
        let moved = edit(&|v| {
            v["spec"]["suspend"] = json!(true);
            v["spec"]["template"]["spec"]["nodeSelector"] = json!({"zone": "a"});
        });
        assert!(fields("jobs", moved, Some(&suspended)).is_empty());
    }

    fn cron(edit: impl FnOnce(&mut Value)) -> Value {
        let mut v = json!({"metadata": {"name": "hello"}, "spec": {"schedule": "*/5 * * * *",
            "jobTemplate": {"spec": {"template": pod_template("OnFailure")}}}});
        edit(&mut v);
        v
    }

    #[test]
    fn cron_jobs_check_schedule_and_time_zone() {
        let mut c = obj(cron(|_| {}));
        default_and_validate(&res("cronjobs"), &mut c, None).unwrap();
        assert_eq!(c["spec"]["concurrencyPolicy"], "Allow");
        assert_eq!(c["spec"]["successfulJobsHistoryLimit"], 3);
        assert_eq!(c["spec"]["failedJobsHistoryLimit"], 1);
        assert_eq!(c["spec"]["suspend"], false);
        for ok in [
            "@hourly",
            "0 0 * * MON-FRI",
            "*/15 9-17 1,15 jan-jun ?",
            "@every 1h30m",
        ] {
            assert!(
                fields(
                    "cronjobs",
                    cron(|v| v["spec"]["schedule"] = json!(ok)),
                    None
                )
                .is_empty(),
                "{ok}"
            );
        }
        for bad in [
            "* * * *",
            "61 * * * *",
            "@fortnightly",
            "TZ=UTC * * * * *",
            "*/0 * * * *",
        ] {
            assert_eq!(
                fields(
                    "cronjobs",
                    cron(|v| v["spec"]["schedule"] = json!(bad)),
                    None
                ),
                ["spec.schedule"],
                "{bad}"
            );
        }
        assert_eq!(
            parse_schedule("* * * *").unwrap_err(),
            "expected exactly 5 fields, found 4: [* * * *]"
        );
        assert_eq!(
            parse_schedule("61 * * * *").unwrap_err(),
            "end of range (61) above maximum (59): 61"
        );
        assert!(
            fields(
                "cronjobs",
                cron(|v| v["spec"]["timeZone"] = json!("Etc/UTC")),
                None
            )
            .is_empty()
        );
        assert_eq!(
            fields(
                "cronjobs",
                cron(|v| v["spec"]["timeZone"] = json!("Mars/Olympus")),
                None
            ),
            ["spec.timeZone"]
        );
        assert_eq!(
            fields(
                "cronjobs",
                cron(|v| v["spec"]["concurrencyPolicy"] = json!("Sometimes")),
                None
            ),
            ["spec.concurrencyPolicy"]
        );
        assert_eq!(
            fields(
                "cronjobs",
                cron(|v| v["metadata"]["name"] = json!("x".repeat(53))),
                None
            ),
            ["metadata.name"]
        );
    }

    fn workload(edit: impl FnOnce(&mut Value)) -> Value {
        let mut v = json!({"metadata": {"name": "web"}, "spec": {
            "selector": {"matchLabels": {"app": "web"}}, "serviceName": "web",
            "template": {"metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "c", "image": "nginx"}]}}}});
        edit(&mut v);
        v
    }

    #[test]
    fn daemon_sets_and_stateful_sets_default_and_validate_as_kubernetes() {
        let mut ds = obj(workload(|_| {}));
        default_and_validate(&res("daemonsets"), &mut ds, None).unwrap();
        assert_eq!(
            ds["spec"]["updateStrategy"],
            json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}})
        );
        assert_eq!(ds["spec"]["revisionHistoryLimit"], 10);
        let generation = |o: &Object| o["metadata"]["annotations"][TEMPLATE_GENERATION].clone();
        assert_eq!(generation(&ds), "1");
        let mut relabelled = ds.clone();
        relabelled.insert("status".into(), json!({"numberReady": 1}));
        default_and_validate(&res("daemonsets"), &mut relabelled, Some(&ds)).unwrap();
        assert_eq!(generation(&relabelled), "1");
        let mut changed = ds.clone();
        changed["spec"]["template"]["metadata"]["labels"]["v"] = json!("2");
        changed["spec"]["selector"]["matchLabels"]["v"] = json!("2");
        let _ = default_and_validate(&res("daemonsets"), &mut changed, Some(&ds));
        assert_eq!(generation(&changed), "2");
        let mut sts = obj(workload(|v| {
            v["spec"]["volumeClaimTemplates"] = json!([{"metadata": {"name": "data"},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}]);
        }));
        default_and_validate(&res("statefulsets"), &mut sts, None).unwrap();
        assert_eq!(
            sts["spec"]["updateStrategy"],
            json!({"type": "RollingUpdate", "rollingUpdate": {"partition": 0}})
        );
        assert_eq!(sts["spec"]["podManagementPolicy"], "OrderedReady");
        assert_eq!(
            sts["spec"]["persistentVolumeClaimRetentionPolicy"],
            json!({"whenDeleted": "Retain", "whenScaled": "Retain"})
        );
        assert_eq!(
            sts["spec"]["volumeClaimTemplates"][0]["spec"]["volumeMode"],
            "Filesystem"
        );
        let cases: Vec<(&str, Value, &[&str])> = vec![
            (
                "daemonsets",
                workload(|v| v["spec"]["template"]["spec"]["restartPolicy"] = json!("Never")),
                &["spec.template.spec.restartPolicy"],
            ),
            (
                "daemonsets",
                workload(|v| {
                    v["spec"]["updateStrategy"] =
                        json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0}})
                }),
                &["spec.updateStrategy.rollingUpdate.maxUnavailable"],
            ),
            (
                "daemonsets",
                workload(|v| v["spec"]["updateStrategy"] = json!({"type": "Sometimes"})),
                &["spec.updateStrategy.type"],
            ),
            (
                "daemonsets",
                workload(|v| v["spec"]["selector"] = json!({"matchLabels": {"app": "api"}})),
                &["spec.template.metadata.labels"],
            ),
            (
                "statefulsets",
                workload(|v| v["spec"]["podManagementPolicy"] = json!("Whenever")),
                &["spec.podManagementPolicy"],
            ),
            (
                "statefulsets",
                workload(|v| {
                    v["spec"]["updateStrategy"] =
                        json!({"type": "OnDelete", "rollingUpdate": {"partition": 1}})
                }),
                &["spec.updateStrategy.rollingUpdate"],
            ),
            (
                "statefulsets",
                workload(|v| {
                    v["spec"]["volumeClaimTemplates"] =
                        json!([{"metadata": {"name": "d"}, "spec": {}}])
                }),
                &[
                    "spec.volumeClaimTemplates[0].spec.accessModes",
                    "spec.volumeClaimTemplates[0].spec.resources[storage]",
                ],
            ),
            (
                "statefulsets",
                workload(|v| v["metadata"]["name"] = json!("web.1")),
                &["metadata.name"],
            ),
        ];
        for (i, (plural, v, want)) in cases.into_iter().enumerate() {
            assert_eq!(fields(plural, v, None), want, "case {i}");
        }
        // Of a StatefulSet's spec, replicas and the template may change; the service
        // name may not.
        let mut sts = obj(workload(|_| {}));
        default_and_validate(&res("statefulsets"), &mut sts, None).unwrap();
        let scaled = workload(|v| v["spec"]["replicas"] = json!(3));
        assert!(fields("statefulsets", scaled, Some(&sts)).is_empty());
        let renamed = workload(|v| v["spec"]["serviceName"] = json!("other"));
        assert_eq!(fields("statefulsets", renamed, Some(&sts)), ["spec"]);
    }

    #[test]
    fn controller_revisions_keep_their_data() {
        let stored = obj(json!({"metadata": {"name": "web-1"}, "revision": 1, "data": {"a": 1}}));
        let changed = json!({"metadata": {"name": "web-1"}, "revision": 2, "data": {"a": 2}});
        assert_eq!(
            fields("controllerrevisions", changed, Some(&stored)),
            ["data"]
        );
        let renumbered = json!({"metadata": {"name": "web-1"}, "revision": 3, "data": {"a": 1}});
        assert!(fields("controllerrevisions", renumbered, Some(&stored)).is_empty());
        let relabelled = json!({"metadata": {"name": "web-1", "labels": {"x": "y"}}, "revision": 1, "data": {"a": 1}});
        assert!(fields("controllerrevisions", relabelled, Some(&stored)).is_empty());
    }

    fn claim(edit: impl FnOnce(&mut Value)) -> Value {
        let mut v = json!({"metadata": {"name": "data"}, "spec": {"accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}}}});
        edit(&mut v);
        v
    }

    #[test]
    fn claims_volumes_and_classes_validate_as_kubernetes() {
        let mut c = obj(claim(|_| {}));
        default_and_validate(&res("persistentvolumeclaims"), &mut c, None).unwrap();
        assert_eq!(c["spec"]["volumeMode"], "Filesystem");
        assert_eq!(
            fields(
                "persistentvolumeclaims",
                claim(|v| v["spec"]["accessModes"] = json!([])),
                None
            ),
            ["spec.accessModes"]
        );
        assert_eq!(
            fields(
                "persistentvolumeclaims",
                claim(|v| v["spec"]["resources"]["requests"]["storage"] = json!("0")),
                None
            ),
            ["spec.resources[storage]"]
        );
        // Binding sets the volume and the class; the rest is fixed.
        let bound = claim(|v| {
            v["spec"]["volumeName"] = json!("pv-1");
            v["spec"]["storageClassName"] = json!("local-path");
        });
        assert!(fields("persistentvolumeclaims", bound.clone(), Some(&c)).is_empty());
        let bound = obj(bound);
        assert_eq!(
            fields(
                "persistentvolumeclaims",
                claim(|v| {
                    v["spec"]["volumeName"] = json!("pv-1");
                    v["spec"]["storageClassName"] = json!("local-path");
                    v["spec"]["accessModes"] = json!(["ReadWriteMany"]);
                }),
                Some(&bound)
            ),
            ["spec"]
        );
        let pv = |edit: fn(&mut Value)| {
            let mut v = json!({"metadata": {"name": "pv-1"}, "spec": {"accessModes": ["ReadWriteOnce"],
                "capacity": {"storage": "1Gi"}, "hostPath": {"path": "/data"}}});
            edit(&mut v);
            v
        };
        let mut volume = obj(pv(|_| {}));
        default_and_validate(&res("persistentvolumes"), &mut volume, None).unwrap();
        assert_eq!(volume["spec"]["persistentVolumeReclaimPolicy"], "Retain");
        assert_eq!(
            fields(
                "persistentvolumes",
                pv(|v| v["spec"]["hostPath"] = Value::Null),
                None
            ),
            ["spec"]
        );
        assert_eq!(
            fields(
                "persistentvolumes",
                pv(|v| v["spec"]["local"] = json!({"path": "/d"})),
                None
            ),
            ["spec.local", "spec.nodeAffinity"]
        );
        assert_eq!(
            fields(
                "persistentvolumes",
                pv(|v| v["spec"]["hostPath"]["path"] = json!("/other")),
                Some(&volume)
            ),
            ["spec.persistentvolumesource"]
        );
        let class = |edit: fn(&mut Value)| {
            let mut v =
                json!({"metadata": {"name": "local-path"}, "provisioner": "rancher.io/local-path"});
            edit(&mut v);
            v
        };
        let mut sc = obj(class(|_| {}));
        default_and_validate(&res("storageclasses"), &mut sc, None).unwrap();
        assert_eq!(sc["reclaimPolicy"], "Delete");
        assert_eq!(sc["volumeBindingMode"], "Immediate");
        assert_eq!(
            fields(
                "storageclasses",
                class(|v| v["volumeBindingMode"] = json!("Later")),
                None
            ),
            ["volumeBindingMode"]
        );
        assert_eq!(
            fields(
                "storageclasses",
                class(|v| v["provisioner"] = json!("other.io/x")),
                Some(&sc)
            ),
            ["provisioner"]
        );
    }

    #[test]
    fn api_services_are_named_after_their_group_version() {
        let service = |name: &str| {
            json!({"metadata": {"name": name}, "spec": {"group": "metrics.k8s.io", "version": "v1beta1",
                "groupPriorityMinimum": 100, "versionPriority": 100, "insecureSkipTLSVerify": true,
                "service": {"namespace": "kube-system", "name": "metrics-server"}}})
        };
        let mut ok = obj(service("v1beta1.metrics.k8s.io"));
        default_and_validate(&res("apiservices"), &mut ok, None).unwrap();
        assert_eq!(ok["spec"]["service"]["port"], 443);
        assert_eq!(
            fields("apiservices", service("metrics"), None),
            ["metadata.name"]
        );
        let mut local = service("v1beta1.metrics.k8s.io");
        local["spec"]["service"] = Value::Null;
        local["spec"]["versionPriority"] = json!(0);
        assert_eq!(
            fields("apiservices", local, None),
            ["spec.versionPriority", "spec.insecureSkipTLSVerify"]
        );
    }
}
