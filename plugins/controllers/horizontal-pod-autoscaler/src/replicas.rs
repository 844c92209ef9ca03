//! The replica calculator: how many pods a resource metric asks for, from the pods'
//! usage and requests, as Kubernetes' `ReplicaCalculator` counts them (pods
//! grouped into ready, unready, missing and ignored; the tolerance; unready and
//! missing pods filled in so that they damp a change rather than cause one).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;
use trellis_plugin::controller::time;
use trellis_plugin::quantity::Quantity;

/// One pod's usage of a resource, from its PodMetrics.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PodMetric {
    /// When it was measured, in milliseconds since the epoch.
    pub timestamp_ms: i64,
    /// Over how long, in milliseconds.
    pub window_ms: i64,
    /// Thousandths of a unit (millicores, or millibytes).
    pub milli: i64,
}

/// What the calculator proposes for one metric.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Proposal {
    pub replicas: i32,
    /// Average utilization, percent of the requests (utilization targets only).
    pub utilization: Option<i32>,
    /// Average usage per pod, in thousandths of a unit.
    pub raw_milli: i64,
}

/// The knobs Kubernetes takes from flags.
#[derive(Clone, Copy, Debug)]
pub struct Calculator {
    pub tolerance: f64,
    /// `--horizontal-pod-autoscaler-cpu-initialization-period`, in milliseconds.
    pub cpu_initialization_ms: i64,
    /// `--horizontal-pod-autoscaler-initial-readiness-delay`, in milliseconds.
    pub initial_readiness_delay_ms: i64,
    pub now_ms: i64,
}

/// A Go duration as PodMetrics' `window` writes it (`15s`, `1m0s`, `1.5s`, `500ms`).
pub fn duration_ms(s: &str) -> Option<i64> {
    let mut total = 0.0;
    let mut rest = s.trim();
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..end].parse().ok()?;
        rest = &rest[end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let ms = match &rest[..unit_end] {
            "h" => 3_600_000.0,
            "m" => 60_000.0,
            "s" => 1000.0,
            "ms" => 1.0,
            "us" | "µs" => 0.001,
            "ns" => 0.000_001,
            _ => return None,
        };
        total += number * ms;
        rest = &rest[unit_end..];
    }
    Some(total.round() as i64)
}

/// Milliseconds since the epoch of an RFC 3339 time, its fraction kept.
pub fn time_ms(t: &str) -> Option<i64> {
    let secs = time::parse(t)?;
    let fraction = t
        .get(19..)
        .and_then(|f| f.strip_prefix('.'))
        .map(|f| f.trim_end_matches(|c: char| !c.is_ascii_digit()))
        .map_or(0, |digits| {
            let padded: String = digits.chars().chain("000".chars()).take(3).collect();
            padded.parse::<i64>().unwrap_or(0)
        });
    Some(secs * 1000 + fraction)
}

/// A pod's usage of `resource` from its PodMetrics (of one container, or summed
/// over all): `None` when a container has no such usage, as Kubernetes then drops
/// the pod's sample.
pub fn pod_metric(metrics: &Value, resource: &str, container: Option<&str>) -> Option<PodMetric> {
    let containers = metrics["containers"].as_array()?;
    let mut milli = 0;
    let mut found = false;
    for c in containers {
        if container.is_some_and(|name| c["name"] != name) {
            continue;
        }
        let usage = Quantity::parse(c["usage"][resource].as_str()?).ok()?;
        milli += usage.milli_value();
        found = true;
    }
    if !found {
        return None;
    }
    Some(PodMetric {
        timestamp_ms: time_ms(metrics["timestamp"].as_str().unwrap_or_default()).unwrap_or(0),
        window_ms: duration_ms(metrics["window"].as_str().unwrap_or_default()).unwrap_or(0),
        milli,
    })
}

/// The pod's request of `resource` (of one container, or summed), in thousandths;
/// `Err` names the container without one.
pub fn pod_request(pod: &Value, resource: &str, container: Option<&str>) -> Result<i64, String> {
    let mut total = 0;
    for c in pod["spec"]["containers"].as_array().into_iter().flatten() {
        let name = c["name"].as_str().unwrap_or_default();
        if container.is_some_and(|want| want != name) {
            continue;
        }
        let request = c["resources"]["requests"][resource]
            .as_str()
            .and_then(|q| Quantity::parse(q).ok())
            .ok_or_else(|| {
                format!(
                    "missing request for {resource} in container {name} of Pod {}",
                    pod["metadata"]["name"].as_str().unwrap_or_default()
                )
            })?;
        total += request.milli_value();
    }
    Ok(total)
}

/// The pods' groups, as Kubernetes' `groupPods`.
struct Groups {
    ready: usize,
    unready: BTreeSet<String>,
    missing: BTreeSet<String>,
    ignored: BTreeSet<String>,
}

fn condition<'a>(pod: &'a Value, kind: &str) -> Option<&'a Value> {
    pod["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
}

impl Calculator {
    fn group(
        &self,
        pods: &[Value],
        metrics: &BTreeMap<String, PodMetric>,
        resource: &str,
    ) -> Groups {
        let mut groups = Groups {
            ready: 0,
            unready: BTreeSet::new(),
            missing: BTreeSet::new(),
            ignored: BTreeSet::new(),
        };
        for pod in pods {
            let name = pod["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let phase = pod["status"]["phase"].as_str().unwrap_or_default();
            if !pod["metadata"]["deletionTimestamp"].is_null() || phase == "Failed" {
                groups.ignored.insert(name);
                continue;
            }
            if phase == "Pending" {
                groups.unready.insert(name);
                continue;
            }
            let Some(metric) = metrics.get(&name) else {
                groups.missing.insert(name);
                continue;
            };
            if resource == "cpu" {
                let ready = condition(pod, "Ready");
                let start = pod["status"]["startTime"].as_str().and_then(time_ms);
                let unready = match (ready, start) {
                    (Some(ready), Some(start)) => {
                        let transition = ready["lastTransitionTime"]
                            .as_str()
                            .and_then(time_ms)
                            .unwrap_or(0);
                        if start + self.cpu_initialization_ms > self.now_ms {
                            // Still starting: a sample taken before one window past
                            // its becoming ready may count its start-up burst.
                            ready["status"] == "False"
                                || metric.timestamp_ms < transition + metric.window_ms
                        } else {
                            // Unready and never ready since it started.
                            ready["status"] == "False"
                                && start + self.initial_readiness_delay_ms > transition
                        }
                    }
                    _ => true,
                };
                if unready {
                    groups.unready.insert(name);
                    continue;
                }
            }
            groups.ready += 1;
        }
        groups
    }

    /// The replicas a utilization (`target_utilization` percent of the requests)
    /// or an average value (`target_milli` per pod) target asks for.
    pub fn replicas(
        &self,
        current: i32,
        target: Target,
        pods: &[Value],
        mut metrics: BTreeMap<String, PodMetric>,
        resource: &str,
        container: Option<&str>,
    ) -> Result<Proposal, String> {
        if pods.is_empty() {
            return Err("no pods returned by selector while calculating replica count".into());
        }
        let groups = self.group(pods, &metrics, resource);
        for name in groups.ignored.iter().chain(&groups.unready) {
            metrics.remove(name);
        }
        if metrics.is_empty() {
            return Err("did not receive metrics for targeted pods (pods might be unready)".into());
        }
        let mut requests = BTreeMap::new();
        if let Target::Utilization(_) = target {
            for pod in pods {
                let name = pod["metadata"]["name"].as_str().unwrap_or_default();
                requests.insert(name.to_owned(), pod_request(pod, resource, container)?);
            }
        }
        let ratio = |metrics: &BTreeMap<String, PodMetric>| target.ratio(metrics, &requests);
        let (usage_ratio, utilization, raw) = ratio(&metrics)?;
        let proposal = |replicas| Proposal {
            replicas,
            utilization,
            raw_milli: raw,
        };
        let scale_up_with_unready = !groups.unready.is_empty() && usage_ratio > 1.0;
        if !scale_up_with_unready && groups.missing.is_empty() {
            if (1.0 - usage_ratio).abs() <= self.tolerance {
                return Ok(proposal(current));
            }
            return Ok(proposal(ceil(usage_ratio * groups.ready as f64)));
        }
        // Missing pods count as using their request (scale down) or nothing (scale
        // up), unready ones as nothing: both can only damp the change.
        for name in &groups.missing {
            let fill = if usage_ratio < 1.0 {
                match target {
                    Target::Utilization(u) => {
                        requests.get(name).copied().unwrap_or(0) * i64::from(u.max(100)) / 100
                    }
                    Target::AverageValue(v) => v,
                }
            } else {
                0
            };
            if usage_ratio != 1.0 {
                metrics.insert(
                    name.clone(),
                    PodMetric {
                        timestamp_ms: 0,
                        window_ms: 0,
                        milli: fill,
                    },
                );
            }
        }
        if scale_up_with_unready {
            for name in &groups.unready {
                metrics.insert(
                    name.clone(),
                    PodMetric {
                        timestamp_ms: 0,
                        window_ms: 0,
                        milli: 0,
                    },
                );
            }
        }
        let (new_ratio, _, _) = ratio(&metrics)?;
        if (1.0 - new_ratio).abs() <= self.tolerance
            || (usage_ratio < 1.0 && new_ratio > 1.0)
            || (usage_ratio > 1.0 && new_ratio < 1.0)
        {
            return Ok(proposal(current));
        }
        let replicas = ceil(new_ratio * metrics.len() as f64);
        if (new_ratio < 1.0 && replicas > current) || (new_ratio > 1.0 && replicas < current) {
            return Ok(proposal(current));
        }
        Ok(proposal(replicas))
    }
}

/// What a resource metric aims at.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Target {
    /// Percent of the pods' requests.
    Utilization(i32),
    /// Thousandths of a unit per pod.
    AverageValue(i64),
}

impl Target {
    /// Usage over target, the utilization (percent), and the average usage per pod.
    fn ratio(
        self,
        metrics: &BTreeMap<String, PodMetric>,
        requests: &BTreeMap<String, i64>,
    ) -> Result<(f64, Option<i32>, i64), String> {
        match self {
            Target::Utilization(target) => {
                let (mut used, mut requested, mut entries) = (0i64, 0i64, 0i64);
                for (name, metric) in metrics {
                    let Some(request) = requests.get(name) else {
                        continue;
                    };
                    used += metric.milli;
                    requested += request;
                    entries += 1;
                }
                if requested == 0 {
                    return Err("no metrics returned matched known pods".into());
                }
                let utilization = i32::try_from(used * 100 / requested).unwrap_or(i32::MAX);
                Ok((
                    f64::from(utilization) / f64::from(target.max(1)),
                    Some(utilization),
                    used / entries,
                ))
            }
            Target::AverageValue(target) => {
                let used: i64 = metrics.values().map(|m| m.milli).sum();
                let count = i64::try_from(metrics.len()).unwrap_or(i64::MAX).max(1);
                Ok((
                    used as f64 / (target.max(1) as f64 * count as f64),
                    None,
                    used / count,
                ))
            }
        }
    }
}

fn ceil(x: f64) -> i32 {
    let c = x.ceil();
    if c >= f64::from(i32::MAX) {
        i32::MAX
    } else {
        c as i32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NOW: i64 = 1_000_000_000;

    fn calc() -> Calculator {
        Calculator {
            tolerance: 0.1,
            cpu_initialization_ms: 300_000,
            initial_readiness_delay_ms: 30_000,
            now_ms: NOW,
        }
    }

    /// A running pod, ready since long ago, requesting `request` of CPU.
    fn pod(name: &str, request: &str) -> Value {
        let long_ago = time::format(NOW / 1000 - 3600);
        json!({
            "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": request}}}]},
            "status": {"phase": "Running", "startTime": long_ago, "conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": long_ago}
            ]},
        })
    }

    fn metric(milli: i64) -> PodMetric {
        PodMetric {
            timestamp_ms: NOW - 1000,
            window_ms: 1000,
            milli,
        }
    }

    #[test]
    fn utilization_scales_by_the_ratio_of_usage_to_target() {
        let pods = [pod("a", "100m"), pod("b", "100m")];
        let metrics = BTreeMap::from([("a".into(), metric(200)), ("b".into(), metric(100))]);
        let p = calc()
            .replicas(2, Target::Utilization(50), &pods, metrics, "cpu", None)
            .unwrap();
        // 150 % against 50 %: three times the pods.
        assert_eq!(p.replicas, 6);
        assert_eq!(p.utilization, Some(150));
        assert_eq!(p.raw_milli, 150);
    }

    #[test]
    fn a_ratio_within_the_tolerance_keeps_the_count() {
        let pods = [pod("a", "100m")];
        let metrics = BTreeMap::from([("a".into(), metric(54))]);
        let p = calc()
            .replicas(3, Target::Utilization(50), &pods, metrics, "cpu", None)
            .unwrap();
        assert_eq!(p.replicas, 3);
    }

    #[test]
    fn missing_and_unready_pods_damp_the_change() {
        // Scale down with a pod missing metrics: it counts as using its request.
        let pods = [pod("a", "100m"), pod("b", "100m")];
        let metrics = BTreeMap::from([("a".into(), metric(10))]);
        let p = calc()
            .replicas(2, Target::Utilization(50), &pods, metrics, "cpu", None)
            .unwrap();
        // (10 + 100) / 200 = 55 % → ratio 1.1: within the tolerance.
        assert_eq!(p.replicas, 2);
        // Scale up with a pending pod: it counts as using nothing.
        let mut pending = pod("b", "100m");
        pending["status"]["phase"] = json!("Pending");
        let pods = [pod("a", "100m"), pending];
        let metrics = BTreeMap::from([("a".into(), metric(100))]);
        let p = calc()
            .replicas(2, Target::Utilization(50), &pods, metrics, "cpu", None)
            .unwrap();
        // 100 / 200 = 50 %: no change, though the ready pod alone is at 100 %.
        assert_eq!(p.replicas, 2);
    }

    #[test]
    fn a_starting_pods_sample_from_before_it_was_ready_is_left_out() {
        let just_now = time::format(NOW / 1000 - 5);
        let mut starting = pod("b", "100m");
        starting["status"]["startTime"] = json!(just_now);
        starting["status"]["conditions"][0]["lastTransitionTime"] = json!(just_now);
        let pods = [pod("a", "100m"), starting];
        let mut early = metric(1000);
        early.timestamp_ms = NOW - 5000;
        let metrics = BTreeMap::from([("a".into(), metric(100)), ("b".into(), early)]);
        let p = calc()
            .replicas(2, Target::Utilization(50), &pods, metrics, "cpu", None)
            .unwrap();
        // Only a's 100 % counts, and b as zero: (100 + 0) / 200 = 50 %.
        assert_eq!(p.replicas, 2);
    }

    #[test]
    fn average_values_and_errors_read_as_kubernetes_words_them() {
        let pods = [pod("a", "100m"), pod("b", "100m")];
        let metrics = BTreeMap::from([("a".into(), metric(300)), ("b".into(), metric(300))]);
        let p = calc()
            .replicas(2, Target::AverageValue(100), &pods, metrics, "cpu", None)
            .unwrap();
        assert_eq!((p.replicas, p.utilization, p.raw_milli), (6, None, 300));
        let err = calc()
            .replicas(
                1,
                Target::Utilization(50),
                &[],
                BTreeMap::new(),
                "cpu",
                None,
            )
            .unwrap_err();
        assert!(err.contains("no pods returned by selector"), "{err}");
        let mut no_request = pod("a", "1");
        no_request["spec"]["containers"][0]["resources"] = json!({});
        let metrics = BTreeMap::from([("a".into(), metric(300))]);
        let err = calc()
            .replicas(
                1,
                Target::Utilization(50),
                &[no_request],
                metrics,
                "cpu",
                None,
            )
            .unwrap_err();
        assert_eq!(err, "missing request for cpu in container c of Pod a");
    }

    #[test]
    fn pod_metrics_and_go_durations_are_read() {
        let m = json!({
            "timestamp": "2026-11-28T10:00:00.250Z", "window": "1.5s",
            "containers": [{"name": "a", "usage": {"cpu": "250m"}}, {"name": "b", "usage": {"cpu": "1"}}],
        });
        let got = pod_metric(&m, "cpu", None).unwrap();
        assert_eq!(got.milli, 1250);
        assert_eq!(got.window_ms, 1500);
        assert_eq!(got.timestamp_ms % 1000, 250);
        assert_eq!(pod_metric(&m, "cpu", Some("a")).unwrap().milli, 250);
        assert_eq!(pod_metric(&m, "memory", None), None);
        assert_eq!(duration_ms("1m0s"), Some(60_000));
        assert_eq!(duration_ms("500ms"), Some(500));
        assert_eq!(duration_ms("soon"), None);
    }
}
