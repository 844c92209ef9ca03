//! kubectl's columns of the workload, batch, storage, autoscaling and aggregation
//! kinds, as its printers lay them out.

use serde_json::{Value, json};
use trellis_api::registry::ResourceInfo;

use super::{
    AGE, Column, NAME, NONE, age, col, human_duration, int_at, selector_text, since, str_at, wide,
    workload_wide_cells,
};
use crate::object::{Object, meta_str, metadata};

const CONTAINERS: Column = wide("Containers", "Names of each container in the template.");
const IMAGES: Column = wide(
    "Images",
    "Images referenced by each container in the template.",
);

fn selector_column(description: &'static str) -> Column {
    wide("Selector", description)
}

/// The columns of `res`, if it is one of these kinds.
pub(super) fn columns(res: &ResourceInfo) -> Option<Vec<Column>> {
    Some(match (res.group.as_str(), res.plural.as_str()) {
        ("apps", "daemonsets") => vec![
            NAME,
            col(
                "Desired",
                "integer",
                "",
                "The total number of nodes that should be running the daemon pod.",
            ),
            col(
                "Current",
                "integer",
                "",
                "The number of nodes that are running at least 1 daemon pod and are supposed to run the daemon pod.",
            ),
            col(
                "Ready",
                "integer",
                "",
                "The number of nodes that should be running the daemon pod and have one or more of the daemon pod running with a Ready Condition.",
            ),
            col(
                "Up-to-date",
                "integer",
                "",
                "The total number of nodes that are running updated daemon pod",
            ),
            col(
                "Available",
                "integer",
                "",
                "The number of nodes that should be running the daemon pod and have one or more of the daemon pod running and available (ready for at least spec.minReadySeconds)",
            ),
            col(
                "Node Selector",
                "string",
                "",
                "NodeSelector is a selector which must be true for the pod to fit on a node.",
            ),
            AGE,
            CONTAINERS,
            IMAGES,
            selector_column("A label query over pods that are managed by the daemon set."),
        ],
        ("apps", "statefulsets") => vec![
            NAME,
            col("Ready", "string", "", "Number of the pod with ready state"),
            AGE,
            CONTAINERS,
            IMAGES,
        ],
        ("apps", "controllerrevisions") => vec![
            NAME,
            col("Controller", "string", "", "Controller of the object"),
            col(
                "Revision",
                "string",
                "",
                "Revision indicates the revision of the state represented by Data.",
            ),
            AGE,
        ],
        ("batch", "jobs") => vec![
            NAME,
            col("Status", "string", "", "Status of the job."),
            col(
                "Completions",
                "string",
                "",
                "The number of pods which reached phase Succeeded.",
            ),
            col(
                "Duration",
                "string",
                "",
                "Time required to complete the job.",
            ),
            AGE,
            CONTAINERS,
            IMAGES,
            selector_column("A label query over pods that should match the pod count."),
        ],
        ("batch", "cronjobs") => vec![
            NAME,
            col(
                "Schedule",
                "string",
                "",
                "The schedule in Cron format, see https://en.wikipedia.org/wiki/Cron.",
            ),
            col(
                "Timezone",
                "string",
                "",
                "The time zone name for the given schedule.",
            ),
            col(
                "Suspend",
                "boolean",
                "",
                "This flag tells the controller to suspend subsequent executions.",
            ),
            col(
                "Active",
                "integer",
                "",
                "A list of pointers to currently running jobs.",
            ),
            col(
                "Last Schedule",
                "string",
                "",
                "Information when was the last time the job was successfully scheduled.",
            ),
            AGE,
            CONTAINERS,
            IMAGES,
            selector_column("A label query over pods that should match the pod count."),
        ],
        ("", "persistentvolumeclaims") => vec![
            NAME,
            col(
                "Status",
                "string",
                "",
                "phase represents the current phase of PersistentVolumeClaim.",
            ),
            col(
                "Volume",
                "string",
                "",
                "volumeName is the binding reference to the PersistentVolume backing this claim.",
            ),
            col(
                "Capacity",
                "string",
                "",
                "capacity represents the actual resources of the underlying volume.",
            ),
            col(
                "Access Modes",
                "string",
                "",
                "accessModes contains the actual access modes the volume backing the PVC has.",
            ),
            col("StorageClass", "string", "", "StorageClass of the pvc"),
            col(
                "VolumeAttributesClass",
                "string",
                "",
                "VolumeAttributesClass of the pvc",
            ),
            AGE,
            wide(
                "VolumeMode",
                "volumeMode defines what type of volume is required by the claim.",
            ),
        ],
        ("", "persistentvolumes") => vec![
            NAME,
            col(
                "Capacity",
                "string",
                "",
                "capacity is the description of the persistent volume's resources and capacity.",
            ),
            col(
                "Access Modes",
                "string",
                "",
                "accessModes contains all ways the volume can be mounted.",
            ),
            col(
                "Reclaim Policy",
                "string",
                "",
                "persistentVolumeReclaimPolicy defines what happens to a persistent volume when released from its claim.",
            ),
            col(
                "Status",
                "string",
                "",
                "phase indicates if a volume is available, bound to a claim, or released by a claim.",
            ),
            col(
                "Claim",
                "string",
                "",
                "claimRef is part of a bi-directional binding between PersistentVolume and PersistentVolumeClaim.",
            ),
            col("StorageClass", "string", "", "StorageClass of the pv"),
            col(
                "VolumeAttributesClass",
                "string",
                "",
                "VolumeAttributesClass of the pv",
            ),
            col(
                "Reason",
                "string",
                "",
                "reason is a brief CamelCase string that describes any failure.",
            ),
            AGE,
            wide(
                "VolumeMode",
                "volumeMode defines if a volume is intended to be used with a formatted filesystem or to remain in raw block state.",
            ),
        ],
        ("storage.k8s.io", "storageclasses") => vec![
            NAME,
            col(
                "Provisioner",
                "string",
                "",
                "provisioner indicates the type of the provisioner.",
            ),
            col(
                "ReclaimPolicy",
                "string",
                "",
                "reclaimPolicy controls the reclaimPolicy for dynamically provisioned PersistentVolumes of this storage class.",
            ),
            col(
                "VolumeBindingMode",
                "string",
                "",
                "volumeBindingMode indicates how PersistentVolumeClaims should be provisioned and bound.",
            ),
            col(
                "AllowVolumeExpansion",
                "string",
                "",
                "allowVolumeExpansion shows whether the storage class allow volume expand.",
            ),
            AGE,
        ],
        ("autoscaling", "horizontalpodautoscalers") => vec![
            NAME,
            col(
                "Reference",
                "string",
                "",
                "scaleTargetRef points to the target resource to scale.",
            ),
            col(
                "Targets",
                "string",
                "",
                "metrics contains the specifications for which to use to calculate the desired replica count.",
            ),
            col(
                "MinPods",
                "string",
                "",
                "minReplicas is the lower limit for the number of replicas to which the autoscaler can scale down.",
            ),
            col(
                "MaxPods",
                "string",
                "",
                "maxReplicas is the upper limit for the number of replicas to which the autoscaler can scale up.",
            ),
            col(
                "Replicas",
                "string",
                "",
                "currentReplicas is current number of replicas of pods managed by this autoscaler.",
            ),
            AGE,
        ],
        ("apiregistration.k8s.io", "apiservices") => vec![
            NAME,
            col(
                "Service",
                "string",
                "",
                "The reference to the service that hosts this API endpoint.",
            ),
            col(
                "Available",
                "string",
                "",
                "Whether this service is available.",
            ),
            AGE,
        ],
        _ => return None,
    })
}

fn int(obj: &Object, path: &[&str]) -> Value {
    json!(int_at(obj, path))
}

fn spec_int(obj: &Object, key: &str) -> Option<i64> {
    obj.get("spec")?.get(key)?.as_i64()
}

/// Labels as Kubernetes' `labels.FormatLabels` prints them: `k=v` sorted by key,
/// `<none>` for none.
fn format_labels(labels: Option<&Value>) -> String {
    let mut pairs: Vec<String> = labels
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
        .collect();
    if pairs.is_empty() {
        return NONE.to_owned();
    }
    pairs.sort();
    pairs.join(",")
}

/// A condition's status by type, if the object has that condition.
fn condition_true(obj: &Object, kind: &str) -> bool {
    obj.get("status")
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|c| c.get("type").and_then(Value::as_str) == Some(kind))
        .is_some_and(|c| c.get("status").and_then(Value::as_str) == Some("True"))
}

fn deleting(obj: &Object) -> bool {
    metadata(obj).is_some_and(|m| m.get("deletionTimestamp").is_some_and(|t| !t.is_null()))
}

/// Access modes as kubectl abbreviates them, in its fixed order.
fn access_modes(modes: Option<&Value>) -> String {
    let modes: Vec<&str> = modes
        .and_then(Value::as_array)
        .map(|m| m.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    [
        ("ReadWriteOnce", "RWO"),
        ("ReadOnlyMany", "ROX"),
        ("ReadWriteMany", "RWX"),
        ("ReadWriteOncePod", "RWOP"),
    ]
    .iter()
    .filter(|(mode, _)| modes.contains(mode))
    .map(|(_, short)| *short)
    .collect::<Vec<_>>()
    .join(",")
}

/// A claim's or volume's class: the beta annotation, else `storageClassName`.
fn storage_class(obj: &Object) -> String {
    metadata(obj)
        .and_then(|m| m.get("annotations"))
        .and_then(|a| a.get("volume.beta.kubernetes.io/storage-class"))
        .and_then(Value::as_str)
        .or_else(|| str_at(obj, &["spec", "storageClassName"]))
        .unwrap_or_default()
        .to_owned()
}

fn unset_or(value: Option<&str>) -> Value {
    json!(value.filter(|v| !v.is_empty()).unwrap_or("<unset>"))
}

/// Seconds between two RFC 3339 timestamps (`to` now when `None`).
fn seconds_between(from: &str, to: Option<&str>) -> Option<i64> {
    let from = from.parse::<jiff::Timestamp>().ok()?;
    let to = match to {
        Some(t) => t.parse::<jiff::Timestamp>().ok()?,
        None => jiff::Timestamp::now(),
    };
    Some(to.as_second() - from.as_second())
}

/// kubectl's TARGETS of an autoscaler: each metric as `current/target` (with the
/// resource's name for resource metrics), two at most, then `+ N more...`.
fn hpa_targets(obj: &Object) -> String {
    let specs: Vec<&Value> = obj
        .get("spec")
        .and_then(|s| s.get("metrics"))
        .and_then(Value::as_array)
        .map(|m| m.iter().collect())
        .unwrap_or_default();
    if specs.is_empty() {
        return NONE.to_owned();
    }
    let statuses = obj
        .get("status")
        .and_then(|s| s.get("currentMetrics"))
        .and_then(Value::as_array);
    let status = |i: usize, kind: &str| statuses.and_then(|s| s.get(i)).and_then(|s| s.get(kind));
    let text = |v: Option<&Value>| -> Option<String> {
        v.and_then(|v| match v {
            Value::String(s) => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            _ => None,
        })
    };
    let unknown = || "<unknown>".to_owned();
    let mut list = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let kind = spec.get("type").and_then(Value::as_str).unwrap_or("");
        let entry = match kind {
            "Resource" | "ContainerResource" => {
                let field = if kind == "Resource" {
                    "resource"
                } else {
                    "containerResource"
                };
                let source = &spec[field];
                let name = source["name"].as_str().unwrap_or("");
                let target = &source["target"];
                let current = status(i, field).map(|s| &s["current"]);
                if let Some(value) = text(target.get("averageValue")) {
                    let now =
                        text(current.and_then(|c| c.get("averageValue"))).unwrap_or_else(unknown);
                    format!("{name}: {now}/{value}")
                } else {
                    let now = current
                        .and_then(|c| c.get("averageUtilization"))
                        .and_then(Value::as_i64)
                        .map_or_else(unknown, |u| format!("{u}%"));
                    let want = target
                        .get("averageUtilization")
                        .and_then(Value::as_i64)
                        .map_or_else(|| "<auto>".to_owned(), |u| format!("{u}%"));
                    format!("{name}: {now}/{want}")
                }
            }
            "Pods" => {
                let now = text(status(i, "pods").and_then(|s| s["current"].get("averageValue")))
                    .unwrap_or_else(unknown);
                let want = text(spec["pods"]["target"].get("averageValue")).unwrap_or_default();
                format!("{now}/{want}")
            }
            "Object" | "External" => {
                let field = if kind == "Object" {
                    "object"
                } else {
                    "external"
                };
                let target = &spec[field]["target"];
                let current = status(i, field).map(|s| &s["current"]);
                if let Some(value) = text(target.get("averageValue")) {
                    let now =
                        text(current.and_then(|c| c.get("averageValue"))).unwrap_or_else(unknown);
                    format!("{now}/{value} (avg)")
                } else {
                    let now = text(current.and_then(|c| c.get("value"))).unwrap_or_else(unknown);
                    format!("{now}/{}", text(target.get("value")).unwrap_or_default())
                }
            }
            _ => "<unknown type>".to_owned(),
        };
        list.push(entry);
    }
    const MAX: usize = 2;
    let more = list.len().saturating_sub(MAX);
    list.truncate(MAX);
    let text = list.join(", ");
    if more > 0 {
        format!("{text} + {more} more...")
    } else {
        text
    }
}

/// The cells of `obj`, if `res` is one of these kinds.
pub(super) fn cells(res: &ResourceInfo, obj: &Object) -> Option<Vec<Value>> {
    let name = json!(meta_str(obj, "name").unwrap_or_default());
    let age = json!(age(obj));
    Some(match (res.group.as_str(), res.plural.as_str()) {
        ("apps", "daemonsets") => {
            let node_selector = obj
                .get("spec")
                .and_then(|s| s.pointer("/template/spec/nodeSelector"));
            [
                vec![
                    name,
                    int(obj, &["status", "desiredNumberScheduled"]),
                    int(obj, &["status", "currentNumberScheduled"]),
                    int(obj, &["status", "numberReady"]),
                    int(obj, &["status", "updatedNumberScheduled"]),
                    int(obj, &["status", "numberAvailable"]),
                    json!(format_labels(node_selector)),
                    age,
                ],
                workload_wide_cells(obj),
            ]
            .concat()
        }
        ("apps", "statefulsets") => {
            let mut wide = workload_wide_cells(obj);
            wide.truncate(2);
            [
                vec![
                    name,
                    json!(format!(
                        "{}/{}",
                        int_at(obj, &["status", "readyReplicas"]),
                        spec_int(obj, "replicas").unwrap_or(0)
                    )),
                    age,
                ],
                wide,
            ]
            .concat()
        }
        ("apps", "controllerrevisions") => {
            let owner = metadata(obj)
                .and_then(|m| m.get("ownerReferences"))
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .find(|o| o.get("controller") == Some(&json!(true)));
            let controller = owner.map_or_else(
                || NONE.to_owned(),
                |o| {
                    let kind = o["kind"].as_str().unwrap_or("").to_lowercase();
                    let group = o["apiVersion"]
                        .as_str()
                        .and_then(|v| v.rsplit_once('/'))
                        .map(|(g, _)| g)
                        .unwrap_or("");
                    let name = o["name"].as_str().unwrap_or("");
                    if group.is_empty() {
                        format!("{kind}/{name}")
                    } else {
                        format!("{kind}.{group}/{name}")
                    }
                },
            );
            vec![
                name,
                json!(controller),
                json!(obj.get("revision").and_then(Value::as_i64).unwrap_or(0)),
                age,
            ]
        }
        ("batch", "jobs") => {
            let succeeded = int_at(obj, &["status", "succeeded"]);
            let completions = match spec_int(obj, "completions") {
                Some(c) => format!("{succeeded}/{c}"),
                None => match spec_int(obj, "parallelism").unwrap_or(0) {
                    p if p > 1 => format!("{succeeded}/1 of {p}"),
                    _ => format!("{succeeded}/1"),
                },
            };
            let duration = str_at(obj, &["status", "startTime"])
                .and_then(|start| {
                    seconds_between(start, str_at(obj, &["status", "completionTime"]))
                })
                .map(human_duration)
                .unwrap_or_default();
            let status = if condition_true(obj, "Complete") {
                "Complete"
            } else if condition_true(obj, "Failed") {
                "Failed"
            } else if deleting(obj) {
                "Terminating"
            } else if condition_true(obj, "Suspended") {
                "Suspended"
            } else if condition_true(obj, "FailureTarget") {
                "FailureTarget"
            } else {
                "Running"
            };
            [
                vec![
                    name,
                    json!(status),
                    json!(completions),
                    json!(duration),
                    age,
                ],
                workload_wide_cells(obj),
            ]
            .concat()
        }
        ("batch", "cronjobs") => {
            let job = obj
                .get("spec")
                .and_then(|s| s.pointer("/jobTemplate/spec"))
                .and_then(Value::as_object)
                .map(|spec| {
                    let mut o = Object::new();
                    o.insert("spec".into(), Value::Object(spec.clone()));
                    o
                })
                .unwrap_or_default();
            let mut wide = workload_wide_cells(&job);
            // A job template's selector is generated per Job: none here.
            wide[2] = json!(selector_text(
                job.get("spec").and_then(|s| s.get("selector"))
            ));
            let last = str_at(obj, &["status", "lastScheduleTime"]).map_or(NONE.to_owned(), since);
            let active = obj
                .get("status")
                .and_then(|s| s.get("active"))
                .and_then(Value::as_array)
                .map_or(0, Vec::len);
            [
                vec![
                    name,
                    json!(str_at(obj, &["spec", "schedule"]).unwrap_or_default()),
                    json!(str_at(obj, &["spec", "timeZone"]).unwrap_or(NONE)),
                    // kubectl's printBoolPtr: True or False, as text.
                    json!(if obj
                        .get("spec")
                        .and_then(|s| s.get("suspend"))
                        .and_then(Value::as_bool)
                        .unwrap_or(false)
                    {
                        "True"
                    } else {
                        "False"
                    }),
                    json!(active),
                    json!(last),
                    age,
                ],
                wide,
            ]
            .concat()
        }
        ("", "persistentvolumeclaims") => {
            let phase = if deleting(obj) {
                "Terminating"
            } else {
                str_at(obj, &["status", "phase"]).unwrap_or("Pending")
            };
            let volume = str_at(obj, &["spec", "volumeName"]).unwrap_or_default();
            let (capacity, modes) = if volume.is_empty() {
                (String::new(), String::new())
            } else {
                (
                    str_at(obj, &["status", "capacity", "storage"])
                        .unwrap_or_default()
                        .to_owned(),
                    access_modes(obj.get("status").and_then(|s| s.get("accessModes"))),
                )
            };
            vec![
                name,
                json!(phase),
                json!(volume),
                json!(capacity),
                json!(modes),
                json!(storage_class(obj)),
                unset_or(str_at(obj, &["spec", "volumeAttributesClassName"])),
                age,
                unset_or(str_at(obj, &["spec", "volumeMode"])),
            ]
        }
        ("", "persistentvolumes") => {
            let phase = if deleting(obj) {
                "Terminating"
            } else {
                str_at(obj, &["status", "phase"]).unwrap_or("Pending")
            };
            let claim = obj
                .get("spec")
                .and_then(|s| s.get("claimRef"))
                .filter(|c| !c.is_null())
                .map(|c| {
                    format!(
                        "{}/{}",
                        c["namespace"].as_str().unwrap_or(""),
                        c["name"].as_str().unwrap_or("")
                    )
                })
                .unwrap_or_default();
            vec![
                name,
                json!(str_at(obj, &["spec", "capacity", "storage"]).unwrap_or_default()),
                json!(access_modes(
                    obj.get("spec").and_then(|s| s.get("accessModes"))
                )),
                json!(str_at(obj, &["spec", "persistentVolumeReclaimPolicy"]).unwrap_or_default()),
                json!(phase),
                json!(claim),
                json!(storage_class(obj)),
                unset_or(str_at(obj, &["spec", "volumeAttributesClassName"])),
                json!(str_at(obj, &["status", "reason"]).unwrap_or_default()),
                age,
                unset_or(str_at(obj, &["spec", "volumeMode"])),
            ]
        }
        ("storage.k8s.io", "storageclasses") => {
            let default = metadata(obj)
                .and_then(|m| m.get("annotations"))
                .is_some_and(|a| {
                    [
                        "storageclass.kubernetes.io/is-default-class",
                        "storageclass.beta.kubernetes.io/is-default-class",
                    ]
                    .iter()
                    .any(|k| a.get(*k).and_then(Value::as_str) == Some("true"))
                });
            let shown = format!(
                "{}{}",
                meta_str(obj, "name").unwrap_or_default(),
                if default { " (default)" } else { "" }
            );
            vec![
                json!(shown),
                json!(
                    obj.get("provisioner")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                ),
                json!(
                    obj.get("reclaimPolicy")
                        .and_then(Value::as_str)
                        .unwrap_or("Delete")
                ),
                json!(
                    obj.get("volumeBindingMode")
                        .and_then(Value::as_str)
                        .unwrap_or("Immediate")
                ),
                json!(
                    obj.get("allowVolumeExpansion")
                        .and_then(Value::as_bool)
                        .unwrap_or(false)
                        .to_string()
                ),
                age,
            ]
        }
        ("autoscaling", "horizontalpodautoscalers") => {
            let reference = format!(
                "{}/{}",
                str_at(obj, &["spec", "scaleTargetRef", "kind"]).unwrap_or_default(),
                str_at(obj, &["spec", "scaleTargetRef", "name"]).unwrap_or_default()
            );
            // autoscaling/v1 names its one target at the top of the spec.
            let targets = match spec_int(obj, "targetCPUUtilizationPercentage") {
                Some(want) => {
                    let now = obj
                        .get("status")
                        .and_then(|s| s.get("currentCPUUtilizationPercentage"))
                        .and_then(Value::as_i64)
                        .map_or_else(|| "<unknown>".to_owned(), |n| format!("{n}%"));
                    format!("cpu: {now}/{want}%")
                }
                None => hpa_targets(obj),
            };
            vec![
                name,
                json!(reference),
                json!(targets),
                json!(
                    spec_int(obj, "minReplicas")
                        .map_or_else(|| "<unset>".to_owned(), |n| n.to_string())
                ),
                json!(spec_int(obj, "maxReplicas").unwrap_or(0)),
                int(obj, &["status", "currentReplicas"]),
                age,
            ]
        }
        ("apiregistration.k8s.io", "apiservices") => {
            let service = obj
                .get("spec")
                .and_then(|s| s.get("service"))
                .filter(|s| !s.is_null())
                .map_or_else(
                    || "Local".to_owned(),
                    |s| {
                        format!(
                            "{}/{}",
                            s["namespace"].as_str().unwrap_or(""),
                            s["name"].as_str().unwrap_or("")
                        )
                    },
                );
            let available = obj
                .get("status")
                .and_then(|s| s.get("conditions"))
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .find(|c| c.get("type").and_then(Value::as_str) == Some("Available"))
                .map_or_else(
                    || "Unknown".to_owned(),
                    |c| {
                        // kube-aggregator's printer: the reason only when not True.
                        let status = c["status"].as_str().unwrap_or("Unknown");
                        match c["reason"].as_str().filter(|r| !r.is_empty()) {
                            Some(reason) if status != "True" => format!("{status} ({reason})"),
                            _ => status.to_owned(),
                        }
                    },
                );
            vec![name, json!(service), json!(available), age]
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(plural: &str) -> ResourceInfo {
        trellis_api::registry::builtins()
            .into_iter()
            .find(|r| r.plural == plural)
            .unwrap()
    }

    fn row(plural: &str, v: Value) -> Vec<Value> {
        let obj: Object = serde_json::from_value(v).unwrap();
        let cells = cells(&res(plural), &obj).unwrap();
        assert_eq!(
            cells.len(),
            columns(&res(plural)).unwrap().len(),
            "{plural}"
        );
        cells
    }

    #[test]
    fn workloads_show_kubectls_cells() {
        let ds = row(
            "daemonsets",
            json!({"metadata": {"name": "fluentd"}, "spec": {
                "selector": {"matchLabels": {"app": "fluentd"}},
                "template": {"spec": {"nodeSelector": {"zone": "a", "disk": "ssd"},
                    "containers": [{"name": "f", "image": "fluentd:1"}]}}},
              "status": {"desiredNumberScheduled": 3, "currentNumberScheduled": 2, "numberReady": 1,
                         "updatedNumberScheduled": 2, "numberAvailable": 1}}),
        );
        assert_eq!(
            ds[1..7],
            [
                json!(3),
                json!(2),
                json!(1),
                json!(2),
                json!(1),
                json!("disk=ssd,zone=a")
            ]
        );
        assert_eq!(
            ds[8..],
            [json!("f"), json!("fluentd:1"), json!("app=fluentd")]
        );
        let sts = row(
            "statefulsets",
            json!({"metadata": {"name": "web"}, "spec": {"replicas": 3, "template": {"spec": {
                "containers": [{"name": "nginx", "image": "nginx"}]}}}, "status": {"readyReplicas": 2}}),
        );
        assert_eq!(sts[1], "2/3");
        let cr = row(
            "controllerrevisions",
            json!({"metadata": {"name": "web-7b9", "ownerReferences": [{"apiVersion": "apps/v1",
                "kind": "StatefulSet", "name": "web", "uid": "u", "controller": true}]}, "revision": 2}),
        );
        assert_eq!(cr[1..3], [json!("statefulset.apps/web"), json!(2)]);
    }

    #[test]
    fn jobs_and_cron_jobs_show_kubectls_cells() {
        let job = |status: Value, spec: Value| {
            row(
                "jobs",
                json!({"metadata": {"name": "pi"}, "spec": spec, "status": status}),
            )
        };
        let done = job(
            json!({"succeeded": 1, "startTime": "2024-01-01T00:00:00Z",
                   "completionTime": "2024-01-01T00:00:07Z",
                   "conditions": [{"type": "Complete", "status": "True"}]}),
            json!({"completions": 1, "parallelism": 1}),
        );
        assert_eq!(done[1..4], [json!("Complete"), json!("1/1"), json!("7s")]);
        let queue = job(json!({}), json!({"parallelism": 3}));
        assert_eq!(
            queue[1..4],
            [json!("Running"), json!("0/1 of 3"), json!("")]
        );
        let failed = job(
            json!({"conditions": [{"type": "Failed", "status": "True"}]}),
            json!({"completions": 2}),
        );
        assert_eq!(failed[1..3], [json!("Failed"), json!("0/2")]);
        let cj = row(
            "cronjobs",
            json!({"metadata": {"name": "hello"}, "spec": {"schedule": "*/1 * * * *", "suspend": true,
                "jobTemplate": {"spec": {"template": {"spec": {"containers": [{"name": "h", "image": "busybox"}]}}}}},
              "status": {"active": [{"name": "hello-1"}]}}),
        );
        assert_eq!(
            cj[1..6],
            [
                json!("*/1 * * * *"),
                json!("<none>"),
                json!("True"),
                json!(1),
                json!("<none>")
            ]
        );
        assert_eq!(cj[7..], [json!("h"), json!("busybox"), json!("<none>")]);
    }

    #[test]
    fn storage_shows_kubectls_cells() {
        let pending = row(
            "persistentvolumeclaims",
            json!({"metadata": {"name": "data"}, "spec": {"accessModes": ["ReadWriteOnce"],
                "storageClassName": "local-path", "volumeMode": "Filesystem"}}),
        );
        assert_eq!(
            pending[1..7],
            [
                json!("Pending"),
                json!(""),
                json!(""),
                json!(""),
                json!("local-path"),
                json!("<unset>")
            ]
        );
        let bound = row(
            "persistentvolumeclaims",
            json!({"metadata": {"name": "data"}, "spec": {"volumeName": "pv-1", "storageClassName": "local-path"},
                "status": {"phase": "Bound", "capacity": {"storage": "1Gi"},
                           "accessModes": ["ReadWriteMany", "ReadWriteOnce"]}}),
        );
        assert_eq!(
            bound[1..5],
            [
                json!("Bound"),
                json!("pv-1"),
                json!("1Gi"),
                json!("RWO,RWX")
            ]
        );
        let pv = row(
            "persistentvolumes",
            json!({"metadata": {"name": "pv-1"}, "spec": {"capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"], "persistentVolumeReclaimPolicy": "Delete",
                "claimRef": {"namespace": "default", "name": "data"}, "storageClassName": "local-path"},
              "status": {"phase": "Bound"}}),
        );
        assert_eq!(
            pv[1..7],
            [
                json!("1Gi"),
                json!("RWO"),
                json!("Delete"),
                json!("Bound"),
                json!("default/data"),
                json!("local-path")
            ]
        );
        let sc = row(
            "storageclasses",
            json!({"metadata": {"name": "local-path", "annotations": {
                "storageclass.kubernetes.io/is-default-class": "true"}},
              "provisioner": "rancher.io/local-path", "volumeBindingMode": "WaitForFirstConsumer"}),
        );
        assert_eq!(
            sc[..5],
            [
                json!("local-path (default)"),
                json!("rancher.io/local-path"),
                json!("Delete"),
                json!("WaitForFirstConsumer"),
                json!("false")
            ]
        );
    }

    #[test]
    fn autoscalers_and_api_services_show_kubectls_cells() {
        let hpa = row(
            "horizontalpodautoscalers",
            json!({"metadata": {"name": "web"}, "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "web"},
                "maxReplicas": 3, "metrics": [
                    {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 50}}},
                    {"type": "Resource", "resource": {"name": "memory", "target": {"type": "AverageValue", "averageValue": "100Mi"}}}]},
              "status": {"currentReplicas": 2, "currentMetrics": [
                    {"type": "Resource", "resource": {"name": "cpu", "current": {"averageUtilization": 72}}}]}}),
        );
        assert_eq!(
            hpa[1..6],
            [
                json!("Deployment/web"),
                json!("cpu: 72%/50%, memory: <unknown>/100Mi"),
                json!("<unset>"),
                json!(3),
                json!(2)
            ]
        );
        let local = row(
            "apiservices",
            json!({"metadata": {"name": "v1.apps"}, "spec": {"group": "apps", "version": "v1"},
                "status": {"conditions": [{"type": "Available", "status": "True", "reason": "Passed"}]}}),
        );
        assert_eq!(local[1..3], [json!("Local"), json!("True")]);
        let down = row(
            "apiservices",
            json!({"metadata": {"name": "v1beta1.metrics.k8s.io"}, "spec": {
                "service": {"namespace": "kube-system", "name": "metrics-server"}},
                "status": {"conditions": [{"type": "Available", "status": "False", "reason": "MissingEndpoints"}]}}),
        );
        assert_eq!(
            down[1..3],
            [
                json!("kube-system/metrics-server"),
                json!("False (MissingEndpoints)")
            ]
        );
    }
}
